"""GEMM throughput of cuvil's kernels, as GFLOP/s and as a fraction of this
machine's measured single-core FMA peak (benchmarks/peak.py), or with `--precision bf16` its
measured `vdpbf16ps` peak (benchmarks/peak_lowp.py, measured in the same run).

Each case is a one-node model, Y = X @ W, built by cuvil (in `--precision`: a bf16 build computes
the product on 16-bit operands with float32 sums, X converted in each run) and timed from C
(benchmarks/ctime.py, median of the runs):

    python benchmarks/gemm.py [--sizes 512,1024] [--threads 1] [--runs 30] [--weights const|input]
                              [--precision fp32|bf16|fp16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from onnx import helper  # noqa: E402

import cuvil  # noqa: E402
from cuvil import bench as ctime  # noqa: E402
from benchmarks import peak  # noqa: E402
from tests.helpers import make_model  # noqa: E402


def matmul_model(M, N, K, const_weights=True):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    inputs = [("x", np.float32, (M, K))]
    inits = {}
    if const_weights:
        inits["w"] = w
    else:
        inputs.append(("w", np.float32, (K, N)))
    return make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], inputs, [("y", np.float32, (M, N))], inits)


def run_case(M, N, K, threads=1, runs=30, const_weights=True, precision="fp32"):
    compiled = cuvil.compile(matmul_model(M, N, K, const_weights), threads=threads, precision=precision)
    # A correctness check against numpy first.
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((M, K)).astype(np.float32)}
    if not const_weights:
        feeds["w"] = rng.standard_normal((K, N)).astype(np.float32)
    got = compiled.run(feeds)["y"]
    w = feeds.get("w")
    if w is None:
        from onnx import numpy_helper
        w = numpy_helper.to_array(matmul_model(M, N, K).graph.initializer[0])
    ref = feeds["x"].astype(np.float64) @ w.astype(np.float64)
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    times = ctime.time_library(compiled.artifacts.library, runs=runs, warmup=max(3, runs // 10), info=compiled.info)
    t = statistics.median(times)
    from cuvil.explain import explain_model
    labels = sorted({k.precision for k in explain_model(matmul_model(M, N, K, const_weights), threads=threads,
                                                        precision=precision).kernels if k.precision})
    return {"M": M, "N": N, "K": K, "ms": t * 1e3, "gflops": 2 * M * N * K / t / 1e9, "rel_err": err,
            "kernels": labels}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="512,1024", help="square sizes, or MxNxK triples")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--weights", choices=["const", "input"], default="const")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="the build's precision; bf16 is measured against the bf16 peak")
    args = parser.parse_args(argv)
    p = peak.measure()["gflops"]
    print(f"# single-core FMA peak {p:.1f} GFLOP/s; threads={args.threads}; weights={args.weights}; "
          f"precision={args.precision}")
    if args.precision == "bf16":
        from benchmarks import peak_lowp
        bf16 = peak_lowp.measure()
        if bf16 is None:
            print("# no AVX512-BF16 on this CPU: % of the FP32 peak")
        else:
            p = bf16["gflops"]
            print(f"# single-core bf16 vdpbf16ps peak {p:.1f} GFLOP/s: % peak below is of it")
    print(f"{'M':>6}{'N':>6}{'K':>6}{'ms':>10}{'GFLOP/s':>10}{'% peak':>8}{'rel err':>10}")
    for size in args.sizes.split(","):
        M, N, K = (int(v) for v in size.split("x")) if "x" in size else (int(size),) * 3
        r = run_case(M, N, K, args.threads, args.runs, args.weights == "const", args.precision)
        frac = r["gflops"] / (p * args.threads)
        print(f"{M:>6}{N:>6}{K:>6}{r['ms']:>10.3f}{r['gflops']:>10.1f}{100 * frac:>7.0f}%{r['rel_err']:>10.1e}  {', '.join(r['kernels'])}", flush=True)


if __name__ == "__main__":
    main()
