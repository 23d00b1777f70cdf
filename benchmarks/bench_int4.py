"""Weight-only int4: one decode step (batch 1, one token) of the LLaMA-architecture decoder of
tests/llama.py, each engine in its own process, one after the other, repeated `--rounds` times:

  cuvil int4 (file)   the MatMulNBits file onnxruntime's MatMulNBitsQuantizer writes (block 32,
                      symmetric or with zero points), built by cuvil: session_run timed in C
                      (file_f16: its scales rounded to float16, `imported_scales: fp16`)
  onnxruntime int4    the same file (its MatMulNBits CPU kernel, accuracy_level unset: float32)
  cuvil int4 (own)    the float32 model built with precision int4 (passes/quantize_weights.py)
  cuvil fp32          the float32 model built by cuvil
  onnxruntime fp32    the float32 model

An engine's figure is the lowest of its processes' medians (cuvil.bench.best_process_median). The
weights bytes per parameter are the built library's weights blob over the products' weights (what
the quantised MatMuls hold); the blob also holds the norms' weights and the rotary tables.

    python benchmarks/bench_int4.py [--hidden 512 --layers 8] [--threads 1,2] [--runs 200] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None):
    import numpy as np

    import cuvil
    from cuvil import bench as timing
    from tests import llama
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--past", type=int, default=31, help="tokens in the key/value cache")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--asymmetric", action="store_true", help="zero points (else symmetric)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    config = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, intermediate=args.intermediate,
                  past_len=args.past)
    shapes = llama.shapes(**config)
    work = Path(tempfile.mkdtemp(prefix="cuvil-bench-int4-"))
    fp32 = llama.export(**config)
    quant = llama.quantize(fp32, block_size=args.block, symmetric=not args.asymmetric)
    paths = {"fp32": work / "decoder.onnx", "int4": work / "decoder.int4.onnx"}
    paths["fp32"].write_bytes(fp32.SerializeToString())
    paths["int4"].write_bytes(quant.SerializeToString())
    params = llama.product_params(quant)
    feeds = llama.inputs(**config)
    print(f"# decoder hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, past {args.past}: "
          f"{params:,} product weights; MatMulNBits block {args.block}, "
          f"{'zero points' if args.asymmetric else 'symmetric'}")
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        f16 = {"quantize_weights": {"imported_scales": "fp16"}}
        builds = {"cuvil_int4_file": (paths["int4"], "fp32", None),
                  "cuvil_int4_file_f16": (paths["int4"], "int4", f16),
                  "cuvil_int4_own": (paths["fp32"], "int4", None),
                  "cuvil_fp32": (paths["fp32"], "fp32", None)}
        libs, info = {}, {}
        for name, (path, precision, options) in builds.items():
            compiled = cuvil.compile(str(path), threads=threads, jobs=args.jobs, precision=precision,
                                     pass_options=options,
                                     name=f"{name}_t{threads}")   # one name each: dlopen keeps one library per name
            out = work / f"{name}-t{threads}"
            compiled.save(out)
            libs[name] = out / compiled.artifacts.library.name
            info[name] = compiled.info
            got = compiled.run(feeds)["y"]
            ref = llama_reference(quant if name.startswith("cuvil_int4_file") else fp32, feeds)
            err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            weights = compiled.info["memory"]["weights_bytes"]
            print(f"  {name} t{threads}: max|y - onnxruntime| / max|y| = {err:.2e}; weights {weights:,} bytes "
                  f"= {weights / params:.3f} bytes per product weight", flush=True)
        processes = {k: [] for k in list(builds) + ["ort_int4", "ort_fp32"]}
        for _ in range(args.rounds):
            for name, lib in libs.items():
                processes[name].append(timing.time_library(lib, runs=args.runs, warmup=args.runs // 10, info=info[name]))
            processes["ort_int4"].append(timing.ort_times(paths["int4"], shapes, threads, args.runs))
            processes["ort_fp32"].append(timing.ort_times(paths["fp32"], shapes, threads, args.runs))
        best = {k: timing.best_process_median(v) * 1e3 for k, v in processes.items()}
        row = {"threads": threads, **{f"{k}_ms": round(v, 4) for k, v in best.items()},
               "int4_file_vs_ort": best["cuvil_int4_file"] / best["ort_int4"],
               "int4_file_f16_vs_ort": best["cuvil_int4_file_f16"] / best["ort_int4"],
               "int4_own_vs_cuvil_fp32": best["cuvil_int4_own"] / best["cuvil_fp32"],
               "round_medians_ms": {k: [round(float(np.median(t)) * 1e3, 4) for t in v] for k, v in processes.items()},
               "weights_bytes_per_param": {k: info[k]["memory"]["weights_bytes"] / params for k in builds}}
        results.append(row)
        print(f"threads {threads}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in best.items()))
        print(f"  cuvil int4 / onnxruntime int4 (same file) = {row['int4_file_vs_ort']:.2f}; "
              f"cuvil own int4 / cuvil fp32 = {row['int4_own_vs_cuvil_fp32']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "block": args.block, "params": params,
                                               "asymmetric": args.asymmetric, "results": results}, indent=2) + "\n")
    return results


def llama_reference(model, feeds):
    from tests.helpers import run_ort
    return run_ort(model, feeds)["y"]


if __name__ == "__main__":
    main()
