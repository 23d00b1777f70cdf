"""One QLinearConv at a time, cuvil against onnxruntime in the same process (both 1 thread,
alternating batches of calls, best batch of each): where the int8 conv kernels stand per shape.

    python benchmarks/int8_convs.py [--cpu-time] [stem l1 l2s2 l2 l3s2 l3 l4s2 l4 ds4 pw56 ...]

`--cpu-time` times with `time.process_time` (this process's CPU time, best of 5 batches): on
cores shared with other work the wall clock counts the time the process waited for a core, the
CPU time does not (single-threaded calls only).

Calls go through Python on both sides (cuvil's ctypes `run`, onnxruntime's `InferenceSession.run`),
so small shapes carry ~10-30 us of call overhead each; `benchmarks/bench.py --precision int8` times
whole models from C.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

F32 = np.float32
CASES = {   # name: (x shape, w shape, attrs): ResNet-18's and MobileNetV2's convs
    "stem": ((1, 3, 224, 224), (64, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    "l1": ((1, 64, 56, 56), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
    "l2s2": ((1, 64, 56, 56), (128, 64, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "l2": ((1, 128, 28, 28), (128, 128, 3, 3), {"pads": [1, 1, 1, 1]}),
    "l3s2": ((1, 128, 28, 28), (256, 128, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "l3": ((1, 256, 14, 14), (256, 256, 3, 3), {"pads": [1, 1, 1, 1]}),
    "l4s2": ((1, 256, 14, 14), (512, 256, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "ds4": ((1, 256, 14, 14), (512, 256, 1, 1), {"strides": [2, 2]}),
    "l4": ((1, 512, 7, 7), (512, 512, 3, 3), {"pads": [1, 1, 1, 1]}),
    "pw56": ((1, 24, 56, 56), (144, 24, 1, 1), {}),
    "pw14": ((1, 96, 14, 14), (576, 96, 1, 1), {}),
    "pj14": ((1, 576, 14, 14), (96, 576, 1, 1), {}),
    "dw112": ((1, 32, 112, 112), (32, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 32}),
    "dw56s2": ((1, 144, 56, 56), (144, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 144, "strides": [2, 2]}),
    "dw14": ((1, 576, 14, 14), (576, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 576}),
}


def _ints(shape, dtype, seed):
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def model(name):
    from onnx import helper
    from tests.helpers import make_model
    xs, ws, attrs = CASES[name]
    oc, rng = ws[0], np.random.default_rng(0)
    inits = {"sx": np.array(0.02, F32), "zx": np.array(100, np.uint8), "w": _ints(ws, np.int8, 1) // 8,
             "sw": rng.uniform(0.001, 0.01, oc).astype(F32), "zw": np.zeros(oc, np.int8), "sy": np.array(0.1, F32),
             "zy": np.array(90, np.uint8), "b": rng.integers(-2000, 2000, oc).astype(np.int32)}
    node = helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy", "b"], ["y"], **attrs)
    return make_model([node], [("x", np.uint8, list(xs))], [("y", np.uint8, None)], initializers=inits, opset=13), \
        {"x": _ints(xs, np.uint8, 5)}


def main(names, timer=time.perf_counter):
    import onnxruntime as ort

    import cuvil
    for name in names or list(CASES):
        onnx_model, feeds = model(name)
        lib = cuvil.compile(onnx_model, threads=1)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        sess = ort.InferenceSession(onnx_model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        out = lib.run(feeds)["y"]
        assert np.array_equal(out, sess.run(None, feeds)[0]), name
        macs = int(np.prod(CASES[name][1])) * int(np.prod(out.shape[2:]))
        best = {"cuvil": [], "ort": []}
        for _ in range(5):
            for engine, call in (("cuvil", lambda: lib.run(feeds)), ("ort", lambda: sess.run(None, feeds))):
                t = timer()
                for _ in range(20):
                    call()
                best[engine].append((timer() - t) / 20)
        c, o = min(best["cuvil"]), min(best["ort"])
        print(f"{name:<8} cuvil {c * 1e3:7.3f} ms ({2 * macs / c / 1e9:5.0f} GOP/s)   onnxruntime {o * 1e3:7.3f} ms "
              f"({2 * macs / o / 1e9:5.0f} GOP/s)   ratio {c / o:.2f}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if a != "--cpu-time"], time.process_time if "--cpu-time" in args else time.perf_counter)
