"""CPU milliseconds per call at 1 thread, for a machine shared with other jobs.

On a loaded machine a call's wall time is mostly waiting for a core; the CPU time the process
spends (time.process_time) leaves the waits out, so engines timed one after the other still
compare (on this project's 2-core VM at load 9-10 it gave cuvil float32 ResNet-18 9.47 ms and
OpenVINO bf16 7.30 ms, against 9.45 and 7.18 ms of wall time on the quiet machine). It cannot
stand in for wall time at 2 threads (spinning pool threads count as CPU time), nor count what
the contention itself costs (caches, memory bandwidth shared with the other jobs).

For each model: cuvil float32, cuvil bf16, cuvil bf16 without the winograd pass (its 3x3 convs on
the direct bf16 conv), OpenVINO bf16 and float32 (one stream, one thread), all in this process,
each timed `--rounds` times in turn, `--batches` batches of `--per` calls; the figure is the
lowest batch's CPU time per call.

    python benchmarks/cpu_time.py --models resnet18,resnet50
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))


def cpu_ms(run, batches: int, per: int) -> float:
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(batches):
        start = time.process_time()
        for _ in range(per):
            run()
        best = min(best, (time.process_time() - start) / per)
    return best * 1e3


def engines(model, shapes, feeds, path):
    import cuvil
    runs = {}
    for label, options in (("cuvil fp32", {}), ("cuvil bf16", {"precision": "bf16"}),
                           ("cuvil bf16 direct 3x3", {"precision": "bf16", "disable_passes": ["winograd"]})):
        lib = cuvil.compile(model, threads=1, **options)
        runs[label] = lambda lib=lib: lib.run(feeds)
    try:
        import openvino as ov
    except ImportError:
        return runs
    core = ov.Core()
    for hint in ("bf16", "f32"):
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": hint, "NUM_STREAMS": 1,
                  "INFERENCE_NUM_THREADS": 1}
        request = core.compile_model(core.read_model(str(path)), "CPU", config).create_infer_request()
        runs[f"OpenVINO {hint}"] = lambda request=request: request.infer(feeds)
    return runs


def main(argv=None):
    from benchmarks.bench import MODELS
    from tests import zoo
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18,resnet50")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--per", type=int, default=5)
    parser.add_argument("--out", default="/tmp", help="where the exported ONNX files go (OpenVINO reads them)")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        module, shapes = MODELS[name]()
        model = zoo.export(module, shapes)
        path = Path(args.out) / f"cpu_time_{name}.onnx"
        path.write_bytes(model.SerializeToString())
        feeds = {k: np.random.default_rng(0).standard_normal(v).astype(np.float32) for k, v in shapes.items()}
        runs = engines(model, shapes, feeds, path)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.rounds):   # the engines in turn, so that a busy spell of the machine hits them all
            for label, run in runs.items():
                best[label] = min(best[label], cpu_ms(run, args.batches, args.per))
        for label, ms in best.items():
            print(f"{name:<10} {label:<22} {ms:8.3f} ms CPU per call", flush=True)


if __name__ == "__main__":
    main()
