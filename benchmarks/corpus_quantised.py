"""Every corpus model quantised as onnxruntime's tools write it, built by Cuvil, checked against
onnxruntime on the same file: does each quantised form a user brings import and run?

For each model of benchmarks/corpus_models.py (batch 1): `quantize_dynamic` (int8 weights;
DynamicQuantizeLinear + MatMulInteger, ConvInteger, DynamicQuantizeLSTM) and `quantize_static`
(QDQ, per-channel int8 weights, uint8 activations, calibrated on two seeded inputs), then one line:
"ok" with max |cuvil - onnxruntime| / max |onnxruntime| on the first output and the contrib ops the
file holds, or the CuvilError Cuvil gave, or "INTERNAL" for any other exception (a defect).

A large rel err is not by itself Cuvil's: statically quantised transformers calibrated on two random
inputs are chaotic (one activation on the other side of a rounding step moves the output), and
onnxruntime's own optimised and unoptimised sessions differ by as much on those files
(`--ort-spread` prints that spread next to each row).

    python benchmarks/corpus_quantised.py [--models vit_tiny,lstm] [--ort-spread]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def quantised(path: Path, shapes: dict, mode: str) -> Path:
    from benchmarks.bench import quantize_static_qdq
    out = path.with_suffix(f".{mode}.onnx")
    if mode == "dynamic":
        from onnxruntime import quantization as q
        q.quantize_dynamic(str(path), str(out), weight_type=q.QuantType.QInt8)
    else:
        quantize_static_qdq(path, out, shapes)
    return out


def rel_err(got, want) -> float:
    """corpus.rel_err over the finite elements, when both engines have the same non-finite ones
    (log(0) = -inf in both is equal); inf when they differ there."""
    import corpus
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)) or not np.array_equal(got[~finite], want[~finite]):
        return float("inf")
    return corpus.rel_err(got[finite], want[finite]) if finite.any() else 0.0


def ort_run(path: Path, feeds: dict, optimise: bool = True):
    import onnxruntime as ort
    options = ort.SessionOptions()
    if not optimise:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def main(argv=None) -> int:
    import onnx
    import cuvil
    from cuvil.errors import CuvilError
    import corpus
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(corpus.CORPUS))
    parser.add_argument("--ort-spread", action="store_true", help="also onnxruntime optimised vs unoptimised")
    args = parser.parse_args(argv)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="cuvil-quantised-") as tmp:
        for name in args.models.split(","):
            path = Path(tmp) / f"{name}.onnx"
            shapes = corpus.export(name, 1, path)
            feeds = {k: np.random.default_rng(3).standard_normal(s).astype(np.float32) for k, s in shapes.items()}
            for mode in ("dynamic", "static"):
                try:
                    qpath = quantised(path, shapes, mode)
                    want = ort_run(qpath, feeds)
                except Exception as error:   # the tool or onnxruntime itself: not Cuvil's row
                    print(f"{name:20s} {mode:8s} onnxruntime's side failed: {str(error).splitlines()[0][:100]}")
                    continue
                contrib = sorted({n.op_type for n in onnx.load(qpath).graph.node if n.domain not in ("", "ai.onnx")})
                spread = f"  ort spread {rel_err(ort_run(qpath, feeds, False), want):.2e}" if args.ort_spread else ""
                try:
                    got = next(iter(cuvil.compile(str(qpath), input_shapes=shapes).run(feeds).values()))
                    print(f"{name:20s} {mode:8s} ok  rel err {rel_err(got, want):.2e}{spread}  contrib {contrib}",
                          flush=True)
                except CuvilError as error:
                    print(f"{name:20s} {mode:8s} CuvilError: {str(error).splitlines()[0][:150]}", flush=True)
                except Exception as error:
                    failures += 1
                    print(f"{name:20s} {mode:8s} INTERNAL {type(error).__name__}: {str(error)[:150]}", flush=True)
                    traceback.print_exc(limit=4)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
