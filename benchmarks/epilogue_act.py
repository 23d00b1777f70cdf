"""One product and the activation after it, timed from C: the epilogue's cost in isolation.

    python benchmarks/epilogue_act.py [--threads 1,2] [--rounds 5] [--runs 300]

Cases: DistilBERT's FFN up-projection ([128, 384] @ [384, 1536] + b, then Gelu), Whisper-tiny's
fc1 ([250, 384] @ [384, 1536]), wav2vec2's feature-encoder Conv1d (256 -> 256, k3 s2, 1599 ->
799) and its GroupNorm (InstanceNormalization + the affine Mul/Add) + Gelu; each model is exported
with torch's opset-17 Gelu (Div, Erf, Add, Mul, Mul). Prints, per case and thread count, the
minimum and the median of `--rounds` x `--runs` calls (cuvil.bench.time_library; minima are what
holds up on a shared machine). Run it once per checkout to compare builds (PYTHONPATH=<tree>).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _gelu(x, y, helper):
    return [helper.make_node("Div", [x, "sqrt2"], [f"{y}_d"]), helper.make_node("Erf", [f"{y}_d"], [f"{y}_e"]),
            helper.make_node("Add", [f"{y}_e", "one"], [f"{y}_p"]), helper.make_node("Mul", [x, f"{y}_p"], [f"{y}_m"]),
            helper.make_node("Mul", [f"{y}_m", "half"], [y])]


def cases():
    from onnx import helper
    from tests.helpers import make_model, rand
    consts = {"sqrt2": np.array(math.sqrt(2), np.float32), "one": np.array(1, np.float32),
              "half": np.array(0.5, np.float32)}
    out = {}
    for name, T in (("distilbert_ffn", 128), ("whisper_fc1", 250)):
        inits = {"w": (rand(384, 1536, seed=1) / 20).astype(np.float32), "b": rand(1536, seed=2), **consts}
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"])]
        out[name] = (make_model(nodes + _gelu("a", "y", helper), [("x", np.float32, (1, T, 384))],
                                [("y", np.float32, None)], inits), {"x": (1, T, 384)})
    inits = {"w": (rand(256, 256, 3, seed=1) / 28).astype(np.float32), **consts}
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], strides=[2])]
    out["wav2vec2_conv"] = (make_model(nodes + _gelu("c", "y", helper), [("x", np.float32, (1, 256, 1599))],
                                       [("y", np.float32, None)], inits), {"x": (1, 256, 1599)})
    inits = {"s": np.ones(256, np.float32), "z": np.zeros(256, np.float32), "g": rand(256, 1, seed=3),
             "h": rand(256, 1, seed=4), **consts}
    nodes = [helper.make_node("InstanceNormalization", ["x", "s", "z"], ["n"]),
             helper.make_node("Mul", ["n", "g"], ["ng"]), helper.make_node("Add", ["ng", "h"], ["a"])]
    out["wav2vec2_groupnorm"] = (make_model(nodes + _gelu("a", "y", helper), [("x", np.float32, (1, 256, 1599))],
                                            [("y", np.float32, None)], inits), {"x": (1, 256, 1599)})
    return out


def main():
    import cuvil
    from cuvil.bench import time_library
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--cases", default="", help="comma-separated subset")
    parser.add_argument("--cpu-time", action="store_true",
                        help="1 thread: CPU time (time.process_time) of batches of --runs calls from Python, "
                             "the lowest batch (see benchmarks/cpu_time.py: waits for a core left out)")
    args = parser.parse_args()
    wanted = [c for c in args.cases.split(",") if c]
    import tempfile
    workdir = Path(tempfile.mkdtemp(prefix="cuvil-epilogue-act-"))
    for name, (model, shapes) in cases().items():
        if wanted and name not in wanted:
            continue
        for threads in (int(t) for t in args.threads.split(",")):
            compiled = cuvil.compile(model, input_shapes=shapes, threads=threads, jobs=2)
            library = compiled.save(workdir / f"{name}-t{threads}")
            if args.cpu_time:
                import time
                feeds = {k: np.random.default_rng(1).standard_normal(v).astype(np.float32) for k, v in shapes.items()}
                for _ in range(20):
                    compiled.run(feeds)
                best = []
                for _ in range(args.rounds):
                    t0 = time.process_time()
                    for _ in range(args.runs):
                        compiled.run(feeds)
                    best.append((time.process_time() - t0) / args.runs)
                print(f"{name:20s} thr {threads}  CPU min {1e3 * min(best):.4f} ms  median {1e3 * float(np.median(best)):.4f} ms",
                      flush=True)
                continue
            times = []
            for _ in range(args.rounds):
                times += time_library(library, runs=args.runs, warmup=20, info=compiled.info)
            print(f"{name:20s} thr {threads}  min {1e3 * min(times):.4f} ms  median {1e3 * float(np.median(times)):.4f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
