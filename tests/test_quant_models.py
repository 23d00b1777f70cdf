"""Whole models quantised by onnxruntime's own tools build and match onnxruntime on the same file.

- `quantize_static` (QDQ, per-channel int8 weights, uint8 or int8 activations, calibrated on a few
  seeded random inputs): ResNet-18 and MobileNetV2 of tests/zoo.py. The output is quantised
  (a QuantizeLinear -> DequantizeLinear pair on it), so both engines give multiples of its scale
  s_y apart from the zero point, and the difference is counted in steps of s_y. It is not zero:
  onnxruntime fuses each DQ -> Conv -> Q into an integer convolution requantised by one float
  multiply, while cuvil (like onnxruntime with its graph optimisations off) dequantises and sums
  in float32. The two differ by float32 rounding, which sends a value within that rounding of a
  .5 boundary to the other neighbour at some QuantizeLinear; later layers carry such flips to the
  output. How far that goes depends on the model, so the tolerance is measured on the same file:
  cuvil may be as far from onnxruntime's integer path as onnxruntime's own float path is (at
  least one step), and on average no more than 1.25 x as far (at least half a step). On these
  models that is 1 step for ResNet-18 and 4 steps for MobileNetV2 (its depthwise layers carry
  flips further), with a third to two thirds of the outputs equal.
- `quantize_dynamic` (DynamicQuantizeLinear + MatMulInteger, int8 weights): the BERT-style
  encoder. Its output is float (after LayerNorm). Both engines compute the same integer
  products from the same quantised activations; the float ops around them round differently
  (as in the float model, ~1e-6 here). The tolerance is what one activation quantised to the
  neighbouring step would change: s_x * max|W| for the product it feeds, where s_x is that
  activation's run-time scale (read from onnxruntime) and W the product's dequantised weight,
  the largest over the model's products.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests import zoo
from tests.helpers import run_ort

import cuvil

torch = pytest.importorskip("torch")
quantization = pytest.importorskip("onnxruntime.quantization")

IMAGE = (1, 3, 224, 224)
CALIBRATION_SAMPLES = 2


class SeededImages(quantization.CalibrationDataReader):
    """A few seeded random images: calibration data the test can reproduce anywhere."""

    def __init__(self, name: str, shape, count: int):
        self.feeds = iter([{name: zoo.sample_input(shape, seed=10 + i)} for i in range(count)])

    def get_next(self):
        return next(self.feeds, None)


def quantize_static(model: onnx.ModelProto, folder, activations: str) -> onnx.ModelProto:
    """The model as onnxruntime's quantize_static writes it: QDQ, per-channel int8 weights."""
    source, target = folder / "float.onnx", folder / "qdq.onnx"
    onnx.save(model, source)
    act = {"u8": quantization.QuantType.QUInt8, "s8": quantization.QuantType.QInt8}[activations]
    quantization.quantize_static(str(source), str(target), SeededImages("input", IMAGE, CALIBRATION_SAMPLES),
                                 quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                                 activation_type=act, weight_type=quantization.QuantType.QInt8)
    return onnx.load(target)


def output_scale(model: onnx.ModelProto) -> float:
    """The scale of the DequantizeLinear that writes the model's (first) output."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    last = next(n for n in model.graph.node if n.output[0] == model.graph.output[0].name)
    assert last.op_type == "DequantizeLinear", last.op_type
    return float(inits[last.input[1]])


STATIC = {
    "resnet18_u8": (lambda: zoo.resnet(), "u8"),
    "mobilenet_v2_u8": (lambda: zoo.mobilenet_v2(), "u8"),
    "resnet18_s8": (lambda: zoo.resnet(), "s8"),
}


def _steps(got: np.ndarray, want: np.ndarray, step: float) -> np.ndarray:
    """|got - want| in output quantisation steps (both are (q - zero point) * step in float32)."""
    return np.rint(np.abs(got.astype(np.float64) - want.astype(np.float64)) / step).astype(np.int64)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "resnet18_u8" else c
                                  for c in STATIC])   # resnet18_s8 covers ResNet-18 by default
def test_quantize_static_qdq_model_matches_onnxruntime(case, tmp_path):
    make, activations = STATIC[case]
    model = quantize_static(zoo.export(make(), {"input": IMAGE}), tmp_path, activations)
    feeds = {"input": zoo.sample_input(IMAGE, seed=100)}
    got = cuvil.compile(model, jobs=2).run(feeds)["output"]
    want = run_ort(model, feeds)["output"]
    emulated = run_ort(model, feeds, optimize=False)["output"]
    step = output_scale(model)
    ours, theirs = _steps(got, want, step), _steps(emulated, want, step)
    assert ours.max() <= max(1, theirs.max()), \
        f"{ours.max()} output steps from onnxruntime (its own float path: {theirs.max()})"
    assert ours.mean() <= max(0.5, 1.25 * theirs.mean()), \
        f"mean {ours.mean():.3f} steps from onnxruntime (its own float path: {theirs.mean():.3f})"


def _dynamic_activation_step_bound(model: onnx.ModelProto, feeds) -> float:
    """max over MatMulInteger of s_x * max|W|: s_x the run-time scale DynamicQuantizeLinear chose
    for its activation (read from onnxruntime), W its dequantised weight."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    scales, weights = [], []
    for node in model.graph.node:
        if node.op_type != "MatMulInteger":
            continue
        dql = producers[node.input[0]]
        assert dql.op_type == "DynamicQuantizeLinear"
        scales.append(dql.output[1])
        w = inits[node.input[1]].astype(np.float64) - (inits[node.input[3]] if len(node.input) > 3 else 0)
        # quantize_dynamic multiplies the two scales first: Mul(x_scale, w_scale)
        scale_mul = next(n for n in model.graph.node if n.op_type == "Mul" and dql.output[1] in n.input)
        w_scale = next(inits[i] for i in scale_mul.input if i in inits)
        weights.append(float(np.max(np.abs(w)) * np.max(w_scale)))
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(s, onnx.TensorProto.FLOAT, []) for s in scales)
    run = run_ort(probe, feeds)
    return max(float(run[s]) * w for s, w in zip(scales, weights))


def test_quantize_dynamic_encoder_matches_onnxruntime(tmp_path):
    seq = 16
    model = zoo.export(zoo.bert_encoder(seq=seq), {"ids": (1, seq), "mask": (1, seq)}, int_inputs=("ids",))
    onnx.save(model, tmp_path / "float.onnx")
    quantization.quantize_dynamic(str(tmp_path / "float.onnx"), str(tmp_path / "dynamic.onnx"),
                                  weight_type=quantization.QuantType.QInt8)
    model = onnx.load(tmp_path / "dynamic.onnx")
    assert any(n.op_type == "MatMulInteger" for n in model.graph.node)
    mask = np.ones((1, seq), np.float32)
    mask[0, 11:] = 0
    feeds = {"ids": np.random.default_rng(2).integers(0, 100, (1, seq)).astype(np.int64), "mask": mask}
    got = cuvil.compile(model, jobs=2).run(feeds)["output"]
    want = run_ort(model, feeds)["output"]
    bound = _dynamic_activation_step_bound(model, feeds)
    diff = float(np.max(np.abs(got.astype(np.float64) - want)))
    assert diff <= bound, f"max |diff| {diff:.3g} > one activation step's effect {bound:.3g}"
