"""Reduced-precision convolutions: a Conv / FusedConv with constant weights is marked
(passes/assign_precision.py) and runs as an implicit GEMM over bf16 / fp16 phase images and weights
with float32 sums and a float32 epilogue (backends/numba_cpu/convgemm.py over ukernel_lowp.py).
Compared with onnxruntime in float32.

The bound is test_precision.py's with K = channels per group x taps: each operand is rounded once
(2u + u^2 per product, u = 2^-8 for bf16, 2^-11 for fp16; fp16 subnormals add 2^-25 (1 + u) per
operand magnitude), and both engines sum the K products, the bias and a residual in float32, each
within gamma(K + 3) of the sum of magnitudes. With a 1-Lipschitz activation (Relu):

    |Y - Y_ort| <= (2u + u^2 + 2 gamma(K + 3)) (|X| * |W| + |b| + |R|)   [+ the fp16 subnormal term]

where |X| * |W| is the convolution of the magnitudes, computed here in float64. Winograd is
disabled: these are the implicit GEMM's cases (a bf16 3x3 stride-1 conv would take bf16 Winograd:
tests/test_precision_winograd.py; an fp16 build leaves Winograd out).
"""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil.explain import explain_model
from tests.helpers import cosine

U = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
FORMAT = {"bf16": "bf16", "fp16": "f16"}   # the kernels' names of the formats


def _gamma(n):
    return n * 2.0 ** -24 / (1 - n * 2.0 ** -24)


def _conv64(x, w, stride, pad, group):
    """Float64 convolution (NCHW, OIHW) by im2col: the reference magnitudes of the bound."""
    N, C, H, W = x.shape
    OC, ICg, KH, KW = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    OH, OW = (H + 2 * pad - KH) // stride + 1, (W + 2 * pad - KW) // stride + 1
    y = np.zeros((N, OC, OH, OW))
    ocg = OC // group
    for g in range(group):
        for kh in range(KH):
            for kw in range(KW):
                patch = xp[:, g * ICg:(g + 1) * ICg, kh:kh + stride * OH:stride, kw:kw + stride * OW:stride]
                y[:, g * ocg:(g + 1) * ocg] += np.einsum("nchw,oc->nohw", patch,
                                                         w[g * ocg:(g + 1) * ocg, :, kh, kw].astype(np.float64))
    return y


def _bound(x, w, b, r, stride, pad, group, precision):
    u = U[precision]
    K = w.shape[1] * w.shape[2] * w.shape[3]
    magnitude = _conv64(np.abs(x), np.abs(w), stride, pad, group) + np.abs(b)[None, :, None, None]
    if r is not None:
        magnitude += np.abs(r)
    bound = (2 * u + u * u + 2 * _gamma(K + 3)) * magnitude
    if precision == "fp16":   # subnormal operands: 2^-25 (1 + u) per product, times the other operand
        ones = np.ones_like(w, dtype=np.float64)
        bound += 2.0 ** -25 * (1 + u) * (_conv64(np.abs(x), ones, stride, pad, group)
                                         + np.abs(w).reshape(w.shape[0], -1).sum(axis=1)[None, :, None, None])
    return bound


def _conv_model(x_shape, oc, k, stride, pad, group, residual, seed=0):
    """Conv (with bias) [+ Add(residual)] + Relu: fusion makes it one FusedConv."""
    rng = np.random.default_rng(seed)
    C = x_shape[1]
    w = (rng.standard_normal((oc, C // group, k, k)) / np.sqrt(C // group * k * k)).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], name="conv", strides=[stride, stride],
                              pads=[pad] * 4, group=group)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    if residual:
        OH = (x_shape[2] + 2 * pad - k) // stride + 1
        OW = (x_shape[3] + 2 * pad - k) // stride + 1
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [x_shape[0], oc, OH, OW]))
        nodes.append(helper.make_node("Add", ["h", "r"], ["z"]))
    nodes.append(helper.make_node("Relu", ["z" if residual else "h"], ["y"]))
    graph = helper.make_graph(nodes, "conv", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w, b


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


CASES = {   # x shape, out channels, kernel, stride, pad, group, residual
    "3x3 padded": ((2, 32, 20, 20), 48, 3, 1, 1, 1, False),
    "1x1": ((1, 64, 14, 14), 40, 1, 1, 0, 1, False),
    "3x3 strided": ((1, 24, 17, 17), 32, 3, 2, 1, 1, False),
    "7x7 stem, 3 channels": ((1, 3, 32, 32), 16, 7, 2, 3, 1, False),
    "grouped": ((1, 32, 12, 12), 32, 3, 1, 1, 4, False),
    "residual epilogue": ((1, 32, 16, 16), 32, 3, 1, 1, 1, True),
    # bf16: 3 channel pairs (< 16 work items: blocks of rows), the last one unpaired
    "odd channels, few planes": ((1, 5, 11, 13), 16, 3, 1, 1, 1, False),
}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_conv_is_within_the_derived_bound(case, precision):
    x_shape, oc, k, stride, pad, group, residual = CASES[case]
    model, w, b = _conv_model(x_shape, oc, k, stride, pad, group, residual)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    if residual:
        shape = (x_shape[0], oc, x_shape[2], x_shape[3])
        feeds["r"] = rng.standard_normal(shape).astype(np.float32)
    lib = cuvil.compile(model, precision=precision, disable_passes=["winograd"])
    got, want = lib.run(feeds)["y"], _ort(model, feeds)
    bound = _bound(feeds["x"], w, b, feeds.get("r"), stride, pad, group, precision)
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    # the operands really were rounded: float32 would be ~100x closer than the bound
    assert np.max(np.abs(got - want)) > 1e-3 * np.max(bound)
    labels = [k.precision for k in explain_model(model, precision=precision, disable_passes=["winograd"]).kernels]
    assert any(label.startswith(f"{precision} (") and "converted" not in label for label in labels), labels


def test_a_small_resnet_in_bf16_keeps_its_outputs():
    pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.resnet((1, 1, 1, 1), width=16), {"x": (1, 3, 64, 64)})
    x = zoo.sample_input((1, 3, 64, 64))
    fp32 = cuvil.compile(model)
    bf16 = cuvil.compile(model, precision="bf16")
    name = fp32.output_names[0]
    want = fp32.run({fp32.input_names[0]: x})[name]
    assert cosine(bf16.run({bf16.input_names[0]: x})[name], want) >= 0.999
    assert cosine(want, _ort(model, {fp32.input_names[0]: x})) >= 0.99999
    labels = [k.precision for k in explain_model(model, precision="bf16").kernels]
    assert sum(label.startswith("bf16 (") and "converted" not in label for label in labels) >= 4, labels


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_stride_1_conv_converts_its_input_in_its_padding_pass(precision):
    # The 16-bit phase images are written straight from X (convgemm.padded_lowp_input_kernel): no
    # float32 ConvPad nor a separate conversion over the tensor. The numbers are test_a_conv_is_
    # within_the_derived_bound's ("3x3 padded", "1x1", "odd channels, few planes").
    model, _, _ = _conv_model((1, 6, 9, 9), 8, 3, 1, 1, 1, False)
    kernels = explain_model(model, precision=precision, disable_passes=["winograd"]).kernels
    families = ["_".join(k.symbol.split("_")[1:-1]) for k in kernels]   # cuvilk_<family>_<hash>
    assert families == [f"convpad_{FORMAT[precision]}", "conv"], families
