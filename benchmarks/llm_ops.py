"""Decode-step latency of an onnxruntime-genai decoder (batch 1, one new token), Cuvil against
onnxruntime on the same static-shape model, the same inputs and the same threads, each engine in a
process of its own; and the memory-bandwidth floor of a token.

The static form is the generation runtime's (tests/test_llm_ops.py): input_ids [1, 1], attention_mask
[1, C] (ones for the first past + 1 positions), past/present [1, kv_heads, C, head], one buffer bound to
past and present (Cuvil: the same pointer through the C ABI; onnxruntime: IOBinding of one OrtValue to
both, its past_present_share_buffer mode, as onnxruntime-genai runs it). Each timed run is one decode
step at the same position (it rewrites the same cache row).

    python benchmarks/llm_ops.py --model /tmp/llm/fp32/model.onnx --threads 1 2 [--past 128 --context 256]
    python benchmarks/llm_ops.py --model ... --profile      # Cuvil's per-step profile (CUVIL_PROFILE=1)

Floor: the bytes a token must read (every weight but the embedding table, of which one row) over the
read bandwidth measured here on one thread (numpy summing a 1 GiB array, and a float32 dot of two
0.5 GiB arrays, which is faster here: the larger, best of 5).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decoder_info(path: Path) -> dict:
    return json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]


def shapes(path: Path, S: int, C: int) -> dict:
    d = decoder_info(path)
    out = {"input_ids": [1, S], "attention_mask": [1, C]}
    for layer in range(d["num_hidden_layers"]):
        for kv in ("key", "value"):
            out[f"past_key_values.{layer}.{kv}"] = [1, d["num_key_value_heads"], C, d["head_size"]]
    return out


def feeds(path: Path, past: int, C: int, S: int = 1, seed=0) -> dict:
    import numpy as np
    rng = np.random.default_rng(seed)
    f = {"input_ids": rng.integers(3, 1000, (1, S)).astype(np.int64),
         "attention_mask": (np.arange(C) < past + S).astype(np.int64)[None]}
    for name, shape in shapes(path, S, C).items():
        if name.startswith("past_key_values."):
            a = rng.standard_normal(shape).astype(np.float32)
            a[:, :, past:] = 0
            f[name] = a
    return f


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the initializers one token reads: all but the embedding table (one row of it)."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    total = 0
    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        size = n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        if t.name in gathered and len(t.dims) == 2:
            size = size // t.dims[0]
        elif t.name in ("cos_cache", "sin_cache"):
            size = 0
        total += size
    return total


def read_bandwidth(gib=1.0, repeats=5) -> dict:
    """Read bandwidth in bytes/s, best of `repeats`: numpy's float64 sum of a `gib` GiB array (on
    these machines it is bound by its own adds, not by memory) and a float32 dot product of two
    arrays of half that size each (BLAS: bound by memory); the floor uses the larger."""
    import numpy as np
    a = np.ones(int(gib * (1 << 30)) // 8, np.float64)
    x = np.ones(int(gib * (1 << 30)) // 8, np.float32)
    y = np.ones(x.size, np.float32)
    result = {}
    for name, fn, nbytes in (("sum", a.sum, a.nbytes), ("dot", lambda: x @ y, x.nbytes + y.nbytes)):
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        result[name] = nbytes / best
    return result


def _time(step, runs, warmup=5) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def worker_cuvil(args) -> dict:
    import ctypes

    import numpy as np

    import cuvil
    path = Path(args.model)
    t = time.perf_counter()
    lib = cuvil.compile(str(path), input_shapes=shapes(path, args.seq, args.context), threads=args.threads,
                        name=f"llm_s{args.seq}_t{args.threads}")
    build_s = time.perf_counter() - t
    f = feeds(path, args.past, args.context, args.seq)
    info = lib.info
    arrays = {v["name"]: np.ascontiguousarray(f[v["name"]]) for v in info["inputs"]}
    outs = {v["name"]: arrays[v["name"].replace("present.", "past_key_values.")] if v["name"].startswith("present.")
            else np.empty(v["shape"], np.dtype(v["dtype"])) for v in info["outputs"]}
    ins = (ctypes.c_void_p * len(info["inputs"]))(*[arrays[v["name"]].ctypes.data for v in info["inputs"]])
    outp = (ctypes.c_void_p * len(info["outputs"]))(*[outs[v["name"]].ctypes.data for v in info["outputs"]])
    c = lib._lib
    create, run, destroy = (c[f"{lib.prefix}session_{n}"] for n in ("create", "run", "destroy"))
    create.restype = ctypes.c_void_p
    run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    destroy.argtypes = [ctypes.c_void_p]
    session = create()
    ms = _time(lambda: run(session, ins, outp), args.runs)
    destroy(session)     # with CUVIL_PROFILE=1 the driver prints its step times here
    return {"ms": ms, "build_s": build_s, "logits0": float(outs["logits"].reshape(-1)[0])}


def worker_ort(args) -> dict:
    import numpy as np
    import onnxruntime as ort
    path = Path(args.model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    f = feeds(path, args.past, args.context, args.seq)
    binding = sess.io_binding()
    values = {}
    for name, a in f.items():
        values[name] = ort.OrtValue.ortvalue_from_numpy(a)
        binding.bind_ortvalue_input(name, values[name])
    for o in sess.get_outputs():
        if o.name.startswith("present."):
            binding.bind_ortvalue_output(o.name, values[o.name.replace("present.", "past_key_values.")])
        else:
            binding.bind_output(o.name, "cpu")
    ms = _time(lambda: sess.run_with_iobinding(binding), args.runs)
    return {"ms": ms, "logits0": float(binding.get_outputs()[0].numpy().reshape(-1)[0])}


def profile_summary(text: str) -> str:
    """Time per kernel family in the driver's profile lines (the vocabulary product apart)."""
    import re
    families: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"cuvil profile: +\d+ +([\d.]+) ms +[\d.]+% +(\S+)\t(.*)", line)
        if m:
            family = "lm_head" if "lm_head" in m.group(3) else m.group(2)
            families[family] = families.get(family, 0.0) + float(m.group(1))
    total = sum(families.values()) or 1.0
    return "per family: " + ", ".join(f"{f} {ms * 1e3:.0f} us ({ms / total:.0%})"
                                      for f, ms in sorted(families.items(), key=lambda kv: -kv[1]) if ms > 0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--past", type=int, default=128)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--seq", type=int, default=1, help="new tokens per step: 1 decodes, more is a prefill")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3, help="processes per engine, alternating; the best is kept")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--worker", choices=["cuvil", "ort"])
    args = p.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        print(json.dumps((worker_cuvil if args.worker == "cuvil" else worker_ort)(args)))
        return
    path = Path(args.model)
    nbytes = weight_bytes_per_token(path)
    bws = read_bandwidth()
    bw = max(bws.values())
    floor = nbytes / bw * 1e3
    print(f"model {path}: {nbytes / 1e6:.1f} MB of weights per token; read bandwidth (one thread) "
          f"{bws['sum'] / 1e9:.1f} GB/s numpy sum, {bws['dot'] / 1e9:.1f} GB/s float32 dot; "
          f"floor {floor:.2f} ms/token; past {args.past}, context {args.context}")
    for threads in args.threads:
        row = {}
        for _ in range(args.rounds):      # alternate the engines: the machine's load changes
            for engine in ("ort", "cuvil"):
                cmd = [sys.executable, __file__, "--worker", engine, "--model", str(path), "--threads", str(threads),
                       "--past", str(args.past), "--context", str(args.context), "--runs", str(args.runs),
                       "--seq", str(args.seq)]
                env = dict(os.environ, CUVIL_PROFILE="1") if args.profile and engine == "cuvil" else None
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                if engine not in row or result["ms"] < row[engine]["ms"]:
                    row[engine] = result
                    if args.profile and engine == "cuvil":
                        row["profile"] = "\n".join(l for l in out.stderr.splitlines() if l.startswith("cuvil profile"))
        if args.profile:
            print(row["profile"])
            print(profile_summary(row["profile"]))
        c, o = row["cuvil"]["ms"], row["ort"]["ms"]
        what = "ms/token" if args.seq == 1 else f"ms per {args.seq}-token prefill"
        print(f"threads {threads}: cuvil {c:.2f} {what}, onnxruntime {o:.2f}, cuvil/ort {c / o:.2f}x time "
              f"(ort/cuvil {o / c:.2f}x speed)" + (f"; floor/cuvil {floor / c:.0%}" if args.seq == 1 else "")
              + f"; logits[0] cuvil {row['cuvil']['logits0']:.5f} ort {row['ort']['logits0']:.5f}")

if __name__ == "__main__":
    main()
