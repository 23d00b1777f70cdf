"""LLM generation from a torch export: Cuvil's generation library against onnxruntime running the
same exported ONNX file (its cache grown by Concat, fed back step by step, as a user of the export
runs it), greedy, each engine in a process of its own.

    python benchmarks/llm_export.py FOLDER [--family llama] [--threads 1 2] [--prompt 128] [--new 64]
                                    [--rounds 2]

FOLDER receives model.onnx, exported once (torch.onnx.export, dynamo) from a transformers config
with seeded random weights: the issue's LLaMA shape (hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1536, vocab 32000), or --family qwen2 / gpt2 of the same size. Per engine and thread
count: first token (prompt in, first token chosen), decode tokens/s (the other new tokens), peak
RSS, and whether the greedy tokens agree; rounds alternate between the engines, the best kept.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/profile.py would shadow the standard library's `profile`, which torch imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
SHAPE = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, vocab=32000)


def export(folder: Path, family: str) -> Path:
    path = folder / "model.onnx"
    if path.exists():
        return path
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from tests.test_llm_torch_export import _Flat
    torch.manual_seed(0)
    s = SHAPE
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                                         n_inner=s["intermediate"], vocab_size=s["vocab"], n_positions=1024,
                                         initializer_range=0.2)
        model = transformers.GPT2LMHeadModel(config)
    else:
        types = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
        config = types[0](hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                          num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
                          max_position_embeddings=1024, initializer_range=0.2)
        model = types[1](config)
    model.eval()
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head = config.hidden_size // heads
    layers = config.num_hidden_layers
    S, P = 3, 5
    args = (torch.zeros(1, S, dtype=torch.long), torch.ones(1, P + S, dtype=torch.long), torch.arange(P, P + S)[None],
            *[torch.zeros(1, kv, P, head) for _ in range(2 * layers)])
    past = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    dim = torch.export.Dim
    folder.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(_Flat(model).eval(), args, str(path), dynamo=True,
                      input_names=["input_ids", "attention_mask", "position_ids", *past],
                      output_names=["logits", *[n.replace("past_key_values", "present") for n in past]],
                      dynamic_shapes=({1: dim("S")}, {1: dim("T")}, {1: dim("S")}, tuple({2: dim("P")} for _ in past)))
    return path


def build(path: Path, prompt_len: int, new: int, threads: int) -> str:
    """The generation library's path (built through the step cache, in a process of its own so
    that the measuring one holds the library only)."""
    sys.path.insert(0, str(ROOT))
    import cuvil
    lib = cuvil.compile(path, name="llm", threads=threads,
                        generate={"max_context": prompt_len + new, "prefill_buckets": [prompt_len]})
    return str(lib.save(path.parent / f"cuvil-{threads}-threads"))


def run_cuvil(library: str, prompt, new: int, threads: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import cuvil
    lib = cuvil.load(library)
    best = None
    for _ in range(2):
        start = time.perf_counter()
        stream = lib.generate(prompt, max_new_tokens=new, stop_tokens=())
        tokens = [next(stream)]
        first = time.perf_counter() - start
        tokens += list(stream)
        total = time.perf_counter() - start
        figures = {"first_ms": first * 1e3, "decode_tps": (new - 1) / (total - first), "tokens": tokens}
        best = figures if best is None or figures["decode_tps"] > best["decode_tps"] else best
    return best


def run_ort(path: Path, prompt, new: int, threads: int) -> dict:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    kv = {i.name: i.shape for i in sess.get_inputs() if i.name.startswith("past_key_values")}
    best = None
    for _ in range(2):
        past = {n: np.zeros((1, s[1], 0, s[3]), np.float32) for n, s in kv.items()}
        ids, position, tokens = list(prompt), 0, []
        start = time.perf_counter()
        first = None
        while len(tokens) < new:
            feeds = {"input_ids": np.array([ids], np.int64),
                     "attention_mask": np.ones((1, position + len(ids)), np.int64),
                     "position_ids": np.arange(position, position + len(ids), dtype=np.int64)[None], **past}
            out = dict(zip(names, sess.run(names, feeds)))
            past = {n: out[n.replace("past_key_values", "present")] for n in kv}
            position += len(ids)
            ids = [int(np.argmax(out["logits"][0, -1]))]
            tokens += ids
            if first is None:
                first = time.perf_counter() - start
        total = time.perf_counter() - start
        figures = {"first_ms": first * 1e3, "decode_tps": (new - 1) / (total - first), "tokens": tokens}
        best = figures if best is None or figures["decode_tps"] > best["decode_tps"] else best
    return best


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: ru_maxrss survives execve on Linux, so a child of
    a parent that exported the model would report the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--family", default="llama", choices=("llama", "qwen2", "gpt2"))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = export(args.folder, args.family)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, SHAPE["vocab"], args.prompt)]
    if args.engine:
        engine, threads, library = (args.engine.split(":", 2) + [""])[:3]
        if engine == "build":
            print(json.dumps({"library": build(path, args.prompt, args.new, int(threads))}))
            return
        figures = run_cuvil(library, prompt, args.new, int(threads)) if engine == "cuvil" else \
            run_ort(path, prompt, args.new, int(threads))
        figures["rss_mb"] = peak_rss_mb()
        print(json.dumps(figures))
        return
    def child(engine: str) -> dict:
        out = subprocess.run([sys.executable, __file__, str(args.folder), "--family", args.family,
                              "--prompt", str(args.prompt), "--new", str(args.new), "--engine", engine],
                             check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    for threads in args.threads:
        library = child(f"build:{threads}")["library"]
        best = {}
        for _ in range(args.rounds):
            for engine in ("cuvil", "ort"):
                figures = child(f"{engine}:{threads}:{library}")
                if engine not in best or figures["decode_tps"] > best[engine]["decode_tps"]:
                    best[engine] = figures
        c, o = best["cuvil"], best["ort"]
        same = sum(a == b for a, b in zip(c["tokens"], o["tokens"]))
        print(f"{args.family} threads {threads}: first token {c['first_ms']:.1f} / {o['first_ms']:.1f} ms = "
              f"{c['first_ms'] / o['first_ms']:.2f}x; decode {c['decode_tps']:.0f} / {o['decode_tps']:.0f} tok/s = "
              f"{c['decode_tps'] / o['decode_tps']:.2f}x; peak RSS {c['rss_mb']:.0f} / {o['rss_mb']:.0f} MB; "
              f"same greedy tokens {same}/{args.new} (Cuvil / onnxruntime)")


if __name__ == "__main__":
    main()
