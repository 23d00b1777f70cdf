"""Cuvil's own `precision: int8` against float32 on held-out inputs: cosine, max error, top-1.

The float model (tests/zoo.py) is calibrated on `--samples` seeded random inputs (calibrate.py's
seed), built by cuvil in int8, and run on `--held-out` other seeded inputs; the reference is
onnxruntime on the float file (float32). Prints one line per model.

    python benchmarks/int8_accuracy.py [--models resnet18,mobilenet_v2] [--samples 8] [--held-out 8]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = {
    "resnet18": lambda zoo: (zoo.resnet((2, 2, 2, 2)), (1, 3, 224, 224)),
    "resnet18_small": lambda zoo: (zoo.resnet((2, 2, 2, 2), width=16, num_classes=10), (1, 3, 64, 64)),
    "mobilenet_v2": lambda zoo: (zoo.mobilenet_v2(), (1, 3, 224, 224)),
    "mlp": lambda zoo: (zoo.mlp(), (8, 256)),
}


def measure(name: str, samples: int, held_out: int, method: str = "minmax") -> dict:
    import onnxruntime as ort

    import cuvil
    from tests import zoo
    module, shape = MODELS[name](zoo)
    model = zoo.export(module, {"input": shape}).SerializeToString()
    start = time.perf_counter()
    lib = cuvil.compile(model, name=name, precision="int8", calibration={"samples": samples, "method": method})
    build_s = time.perf_counter() - start
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    got, want = [], []
    for seed in range(1000, 1000 + held_out):
        x = zoo.sample_input(shape, seed=seed)
        got.append(lib.run({"input": x})["output"])
        want.append(session.run(None, {"input": x})[0])
    y, y32 = np.concatenate(got).astype(np.float64), np.concatenate(want).astype(np.float64)
    cosine = float(y.ravel() @ y32.ravel() / (np.linalg.norm(y) * np.linalg.norm(y32)))
    top1 = float(np.mean(y.argmax(-1) == y32.argmax(-1))) if y.ndim == 2 and y.shape[-1] > 1 else None
    return {"model": name, "samples": samples, "held_out": held_out, "method": method, "cosine": cosine,
            "max_abs_err": float(np.max(np.abs(y - y32))), "max_abs_ref": float(np.max(np.abs(y32))),
            "top1_agreement": top1, "build_s": build_s}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet18")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--method", default="minmax")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        r = measure(name, args.samples, args.held_out, args.method)
        print(f"{r['model']:<16} cosine {r['cosine']:.5f}  max err {r['max_abs_err']:.3g} (of {r['max_abs_ref']:.3g})"
              f"  top-1 {r['top1_agreement']}  ({r['samples']} calibration, {r['held_out']} held-out inputs, "
              f"{r['method']}; build {r['build_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
