"""cuvil vs onnxruntime latency, side by side in one process.

Both engines get the same inputs and the same thread count; after a warm-up,
runs alternate between the engines (so drift in machine load hits both) and
the medians are compared. Ratio < 1 means cuvil is faster.

    python benchmarks/bench.py [--models mlp,resnet18,mobilenet_v2] [--threads 1] [--runs 50]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

import cuvil  # noqa: E402
from tests import zoo  # noqa: E402

MODELS = {
    "mlp": lambda: (zoo.mlp(), {"x": (1, 256)}),
    "resnet18": lambda: (zoo.resnet((2, 2, 2, 2)), {"input": (1, 3, 224, 224)}),
    "resnet50": lambda: (zoo.resnet((3, 4, 6, 3), bottleneck=True), {"input": (1, 3, 224, 224)}),
    "mobilenet_v2": lambda: (zoo.mobilenet_v2(), {"input": (1, 3, 224, 224)}),
}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def bench(name, threads, runs, jobs):
    module, shapes = MODELS[name]()
    model = zoo.export(module, shapes)
    feeds = {k: zoo.sample_input(s) for k, s in shapes.items()}
    t0 = time.perf_counter()
    compiled = cuvil.compile(model, threads=threads, jobs=jobs)
    build_s = time.perf_counter() - t0
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out_names = [o.name for o in sess.get_outputs()]
    session = compiled.session()
    ref = sess.run(out_names, feeds)[0]
    got = session.run(feeds)[out_names[0]]
    err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-6))
    for _ in range(max(3, runs // 10)):
        session.run(feeds)
        sess.run(out_names, feeds)
    cu, ox = [], []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(feeds)
        cu.append(time.perf_counter() - t)
        t = time.perf_counter()
        sess.run(out_names, feeds)
        ox.append(time.perf_counter() - t)
    c, o = statistics.median(cu), statistics.median(ox)
    return {"model": name, "cuvil_ms": c * 1e3, "ort_ms": o * 1e3, "ratio": c / o, "rel_err": err,
            "build_s": build_s, "kernels": compiled.info["kernels"], "arena": compiled.info["memory"]["arena_bytes"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,resnet18,mobilenet_v2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("-j", "--jobs", type=int, default=2, help="parallel kernel compiles")
    args = parser.parse_args(argv)
    print(f"# {cpu_name()}, onnxruntime {ort.__version__}, cuvil {cuvil.__version__}, threads={args.threads}")
    print(f"{'model':<14}{'cuvil ms':>11}{'ort ms':>11}{'ratio':>8}{'rel err':>10}{'build s':>9}{'kernels':>9}")
    for name in args.models.split(","):
        r = bench(name, args.threads, args.runs, args.jobs)
        print(f"{r['model']:<14}{r['cuvil_ms']:>11.3f}{r['ort_ms']:>11.3f}{r['ratio']:>8.2f}{r['rel_err']:>10.1e}"
              f"{r['build_s']:>9.1f}{r['kernels']:>9}", flush=True)


if __name__ == "__main__":
    main()
