"""Whole quantised models on one thread by CPU time: cuvil, onnxruntime and OpenVINO on the same
`quantize_static` file (bench.py's `quantise`), in one process, 10 calls a batch, the engines'
batches interleaved, the 20th percentile of each engine's batches.

    python benchmarks/int8_cputime.py [--rounds 10] resnet18 mobilenet_v2

`time.process_time` counts the CPU time the process used, not the time it waited for a core, so
on cores shared with other sessions it moves far less than the wall clock (bench.py) does. It is
a development check: the engines share a process (and caches), and only single-threaded runs
mean anything (two threads' CPU time adds up); bench.py, one process an engine, stays the
measurement of record.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None):
    import onnxruntime as ort
    import openvino as ov

    import cuvil
    from benchmarks.bench import MODELS, quantise
    from tests import zoo
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="cuvil-int8-cpu-"))
    for name in args.models:
        module, shapes = MODELS[name]()
        path = workdir / f"{name}.onnx"
        path.write_bytes(zoo.export(module, shapes).SerializeToString())
        path = quantise(name, path, shapes)
        feeds = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        lib = cuvil.compile(str(path), input_shapes=shapes, threads=1, jobs=2)
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        core = ov.Core()
        request = core.compile_model(core.read_model(str(path)), "CPU", {
            "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": 1,
            "INFERENCE_NUM_THREADS": 1}).create_infer_request()
        engines = {"cuvil": lambda: lib.run(feeds), "ort": lambda: sess.run(None, feeds),
                   "ov": lambda: request.infer(feeds)}
        times = {k: [] for k in engines}
        for call in engines.values():
            for _ in range(3):
                call()
        for _ in range(args.rounds):
            for k, call in engines.items():
                t = time.process_time()
                for _ in range(10):
                    call()
                times[k].append((time.process_time() - t) / 10)
        ms = {k: float(np.percentile(v, 20)) * 1e3 for k, v in times.items()}
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        print(f"{name:<13} cuvil {ms['cuvil']:.3f} ms  onnxruntime {ms['ort']:.3f}  OpenVINO {ms['ov']:.3f}  "
              f"cuvil/ort {ms['cuvil'] / ms['ort']:.3f}  cuvil/ov {ms['cuvil'] / ms['ov']:.3f}  load {load}", flush=True)


if __name__ == "__main__":
    main()
