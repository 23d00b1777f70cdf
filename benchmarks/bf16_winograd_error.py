"""The error of bf16 Winograd against the direct bf16 conv, measured (backends/numba_cpu/winograd_bf16.py
chooses F(2x2, 3x3) in bf16 on these figures).

One ResNet-style conv per stage (3x3, pad 1, bias, Relu, as many output as input channels, a
seeded post-Relu input), built four ways and compared with onnxruntime float32: the direct bf16
conv (`disable_passes: [winograd]`), bf16 Winograd F(2x2, 3x3) (the default), bf16 Winograd
F(4x4, 3x3) (never chosen: forced here by replacing winograd_bf16.choose in this process, for the
record) and float32 (F(4x4, 3x3) Winograd). Prints max |Y - Y_ort| / max |Y_ort| and the ratios
to the direct conv's. Each build gets a fresh cache (the forced build's lowering would otherwise
come from the cache, keyed by the graph).

    python benchmarks/bf16_winograd_error.py
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    import cuvil
    from backends.numba_cpu import winograd, winograd_bf16
    from tests.test_precision_winograd import _conv_model, _ort
    forced = {"transform": None}
    choose = winograd_bf16.choose

    def forcing(*args, **kwargs):
        chosen = choose(*args, **kwargs)
        return forced["transform"] if chosen is not None and forced["transform"] is not None else chosen
    winograd_bf16.choose = forcing

    def build(model, transform=None, **options):
        os.environ["CUVIL_CACHE_DIR"] = tempfile.mkdtemp(prefix="cuvil-bf16-winograd-error-")
        forced["transform"] = transform
        try:
            return cuvil.compile(model, jobs=1, **options)
        finally:
            forced["transform"] = None

    rng = np.random.default_rng(3)
    for C, HW in ((64, 56), (128, 28), (256, 14), (512, 7)):
        model, _, _, _ = _conv_model((1, C, HW, HW), C, False, seed=C)
        x = np.maximum(rng.standard_normal((1, C, HW, HW)), 0).astype(np.float32)
        want = _ort(model, {"x": x})
        builds = {"direct bf16": build(model, precision="bf16", disable_passes=["winograd"]),
                  "F2 bf16": build(model, precision="bf16"),
                  "F4 bf16": build(model, winograd.F4, precision="bf16"),
                  "fp32 (F4)": build(model)}
        scale = np.max(np.abs(want))
        err = {k: float(np.max(np.abs(lib.run({"x": x})["y"] - want)) / scale) for k, lib in builds.items()}
        ratios = {k: err[k] / err["direct bf16"] for k in ("F2 bf16", "F4 bf16")}
        print(f"C={C} {HW}x{HW}: " + "  ".join(f"{k} {v:.2e}" for k, v in err.items())
              + "".join(f"  {k.split()[0]}/direct {v:.2f}" for k, v in ratios.items()), flush=True)


if __name__ == "__main__":
    main()
