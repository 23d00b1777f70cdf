"""On a machine with an NVIDIA GPU: build the zoo for this GPU, check it against onnxruntime,
time it against PyTorch on the same GPU (and onnxruntime's CUDA provider when it is installed).

benchmarks/gpu_check.sh installs what this needs and runs it; the results go to a JSON file:
per model the build time, the kernels, the largest error against onnxruntime (CPU, float32)
relative to max(1, max |reference|) and whether it is within 1e-4, and the latency (median
of `--runs` calls after a warm-up) of

  cuvil host      session_run: inputs and outputs in host memory (pinned staging, a CUDA graph)
  cuvil device    session_run_device on torch's device tensors, then a device synchronise
  torch device    the same torch module in eager mode on the GPU, tensors already there
  torch host      the same with the copies to and from the GPU (what `cuvil host` also does)
  ort cuda        onnxruntime's CUDAExecutionProvider (only when onnxruntime-gpu is installed)

ratio = cuvil device / torch device (< 1: cuvil faster). Each engine runs in this one process,
one after the other, never at the same time.

Then the bf16 and fp16 builds of the models whose work is weight products (`--lowp-models`: their
Gemm / MatMul / Conv on tensor cores, docs/cuda.md), rows with "precision": "bf16" | "fp16", checked
against onnxruntime's float32: the MLP within the derived bound carried through its layers
(tests/cuda_check.sequential_bound: (2u + u^2) per product, u = 2^-8 bf16, 2^-11 fp16, plus float32
sums), the others (batch norms folded, attention, LayerNorm: no closed bound here) by cosine
similarity >= 0.999 (issue 19's criterion) with the largest error reported; their latency beside
the float32 row's (torch runs float32 in every row).

    python benchmarks/gpu_check.py [--models mlp,resnet18,...] [--lowp-models mlp,encoder] [--runs 50] [--out gpu_check.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

TOL = 1e-4


def _zoo():
    from tests import zoo
    return zoo


def models() -> dict:
    """name -> () -> (torch module, input shapes, int inputs)."""
    from benchmarks.bench import MODELS
    out = {name: (lambda make=make: (*make(), ())) for name, make in MODELS.items()}
    out["bert"] = lambda: (_zoo().bert_encoder(layers=2, d=256, heads=4, ff=1024, vocab=1000, seq=128),
                           {"ids": (1, 128), "mask": (1, 128)}, ("ids",))
    out["gpt2_block"] = lambda: (_zoo().gpt2_block(d=256, heads=4, seq=64), {"x": (1, 64, 256)}, ())
    return out


DEFAULT = "mlp,resnet18,resnet50,mobilenet_v2,encoder,encoder_t16,bert,gpt2_block,lstm"
DEFAULT_LOWP = "mlp,resnet18,mobilenet_v2,encoder,encoder_t16,bert"
MIN_COSINE = 0.999


def gpu_target() -> tuple[str, str]:
    """The cuvil target for GPU 0 (its compute capability, or the newest below it) and its name."""
    import torch

    from backends.targets import CUDA_TARGETS
    major, minor = torch.cuda.get_device_capability(0)
    ccs = sorted((t.cc, name) for name, t in CUDA_TARGETS.items() if t.cc <= (major, minor))
    if not ccs:
        raise SystemExit(f"GPU sm_{major}{minor} is older than every cuvil CUDA target")
    return ccs[-1][1], torch.cuda.get_device_name(0)


def feeds_for(shapes: dict, int_inputs) -> dict:
    rng = np.random.default_rng(1)
    out = {}
    for name, shape in shapes.items():
        if name in int_inputs:
            out[name] = rng.integers(0, 100, size=shape).astype(np.int64)
        elif name == "mask":
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = rng.standard_normal(shape).astype(np.float32)
    return out


def median_ms(fn, runs: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def lowp_check(module, feeds: dict, want: dict, got: dict, precision: str) -> dict:
    """A bf16 / fp16 build's numerics against onnxruntime's float32 (see the module docstring)."""
    import torch

    from tests.cuda_check import sequential_bound
    out = {}
    if isinstance(module, torch.nn.Sequential) and set(feeds) == {"x"} and \
            all(isinstance(layer, (torch.nn.Linear, torch.nn.ReLU)) for layer in module):
        (name, ref), = want.items()
        _, bound = sequential_bound(module.cpu(), feeds["x"], precision)
        err = np.abs(got[name].astype(np.float64) - ref)
        out["worst_err_over_bound"] = float(np.max(err / bound))
        out["within_bound"] = bool(np.all(err <= bound))
    cosines = []
    for name, ref in want.items():
        y, y32 = got[name].astype(np.float64).ravel(), ref.astype(np.float64).ravel()
        norms = float(np.linalg.norm(y) * np.linalg.norm(y32))
        cosines.append(float(y @ y32 / norms) if norms else float(np.array_equal(y, y32)))
    out["cosine"] = min(cosines)
    out.setdefault("within_bound", out["cosine"] >= MIN_COSINE)
    return out


def check_model(name: str, make, target: str, runs: int, cache: Path, jobs: int, precision: str = "fp32") -> dict:
    import onnxruntime as ort
    import torch

    import cuvil
    zoo = _zoo()
    module, shapes, int_inputs = make()
    module = module.eval()
    model = zoo.export(module, shapes, int_inputs=int_inputs)
    feeds = feeds_for(shapes, int_inputs)
    row = {"model": name, "precision": precision}

    t = time.perf_counter()
    compiled = cuvil.compile(model, input_shapes={k: list(v) for k, v in shapes.items()}, target=target,
                             precision=precision, cache_dir=cache, jobs=jobs, name=name)
    row["build_s"] = round(time.perf_counter() - t, 2)
    info = compiled.info
    row["kernels"], row["steps"] = info["kernels"], info["steps"]
    row["arena_mib"] = round(info["memory"]["arena_bytes"] / 2**20, 2)

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(names, feeds)))
    got = compiled.run(feeds)
    errs = []
    for out_name, ref in want.items():
        scale = max(1.0, float(np.max(np.abs(ref))))
        errs.append(float(np.max(np.abs(got[out_name].astype(np.float64) - ref))) / scale)
    row["max_rel_err"] = max(errs)
    if precision == "fp32":
        row["within_1e-4"] = row["max_rel_err"] <= TOL
    else:
        row.update(lowp_check(module, feeds, want, got, precision))

    # cuvil, host pointers (what CompiledModel.run does, without the Python dict building)
    lib = cuvil.load(compiled.artifacts.library)
    session = lib.session()
    row["cuvil_host_ms"] = median_ms(lambda: session.run(feeds), runs)

    # cuvil, device pointers on torch tensors
    dev = torch.device("cuda")
    t_in = [torch.from_numpy(feeds[n["name"]]).to(dev) for n in info["inputs"]]
    t_out = [torch.empty(o["shape"], dtype=getattr(torch, o["dtype"]), device=dev) for o in info["outputs"]]
    prefix = info.get("symbol_prefix") or "cuvil_"
    clib = ctypes.CDLL(str(compiled.artifacts.library))
    create = getattr(clib, f"{prefix}session_create")
    create.restype = ctypes.c_void_p
    run_device = getattr(clib, f"{prefix}session_run_device")
    run_device.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    destroy = getattr(clib, f"{prefix}session_destroy")
    destroy.argtypes = [ctypes.c_void_p]
    s = create()
    ins = (ctypes.c_void_p * len(t_in))(*[t.data_ptr() for t in t_in])
    outs = (ctypes.c_void_p * len(t_out))(*[t.data_ptr() for t in t_out])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def cuvil_device():
        rc = run_device(s, ins, outs, stream)
        if rc:
            raise RuntimeError(f"session_run_device returned {rc}")
        torch.cuda.synchronize()
    row["cuvil_device_ms"] = median_ms(cuvil_device, runs)
    dev_out = t_out[0].cpu().numpy()
    first = next(iter(want.values()))
    row["device_path_max_rel_err"] = float(np.max(np.abs(dev_out - first))) / max(1.0, float(np.max(np.abs(first))))
    destroy(s)

    # torch eager on the same GPU
    m = module.to(dev)
    torch_in = [torch.from_numpy(feeds[k]).to(dev) for k in shapes]
    with torch.no_grad():
        def torch_device():
            m(*torch_in)
            torch.cuda.synchronize()

        def torch_host():
            xs = [torch.from_numpy(feeds[k]).to(dev) for k in shapes]
            y = m(*xs)
            (y[0] if isinstance(y, tuple) else y).cpu()
        row["torch_device_ms"] = median_ms(torch_device, runs)
        row["torch_host_ms"] = median_ms(torch_host, runs)
    row["ratio_device_vs_torch"] = round(row["cuvil_device_ms"] / row["torch_device_ms"], 3)

    if "CUDAExecutionProvider" in ort.get_available_providers():
        gpu_sess = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
        row["ort_cuda_ms"] = median_ms(lambda: gpu_sess.run(names, feeds), runs)
        row["ratio_host_vs_ort_cuda"] = round(row["cuvil_host_ms"] / row["ort_cuda_ms"], 3)
    for k, v in list(row.items()):
        if isinstance(v, float):
            row[k] = round(v, 4) if "ms" in k else v
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT)
    parser.add_argument("--lowp-models", default=DEFAULT_LOWP, help="built again in bf16 and fp16 ('' for none)")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)
    import onnxruntime as ort
    import torch
    target, gpu = gpu_target()
    table = models()
    results = {"gpu": gpu, "target": target, "torch": torch.__version__, "onnxruntime": ort.__version__,
               "ort_cuda": "CUDAExecutionProvider" in ort.get_available_providers(), "models": []}
    print(f"{gpu}: building for {target}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cuvil-gpu-check-") as cache:
        jobs = [(name, "fp32") for name in args.models.split(",") if name]
        jobs += [(name, precision) for precision in ("bf16", "fp16") for name in args.lowp_models.split(",") if name]
        for name, precision in jobs:
            try:
                row = check_model(name, table[name], target, args.runs, Path(cache), args.jobs, precision)
            except Exception as error:  # report and go on: one model's failure is a row, not the end
                row = {"model": name, "precision": precision, "error": f"{type(error).__name__}: {error}"[:2000],
                       "traceback": traceback.format_exc()[-3000:]}
            results["models"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    results["seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    ok = all(r.get("within_1e-4" if r.get("precision", "fp32") == "fp32" else "within_bound")
             for r in results["models"])
    print(f"{'all within' if ok else 'NOT all within'} {TOL} of onnxruntime (bf16 / fp16: their bound or cosine "
          f">= {MIN_COSINE}); {results['seconds']} s; {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
