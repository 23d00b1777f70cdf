"""ConvTranspose, normalisation, Gelu and quantisation kernels
(backends/numba_cpu/convtranspose.py, norm.py, quant.py) against onnxruntime:
relative tolerance 1e-4 for float outputs, exact equality for integer ones
(quantised values are rounded exactly as onnxruntime rounds them, ties to even,
which the tie-heavy inputs below check)."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from tests.helpers import assert_matches_ort, make_model, rand, run_ort

import cuvil

F32, F64, U8, I8 = np.float32, np.float64, np.uint8, np.int8


def one_node(op, inputs, outputs, attrs=None, initializers=None, opset=17):
    """A model of one node; `inputs` [(name, array, constant?)], `outputs` [(name, dtype)].
    Returns the model and its feeds."""
    names = [name for name, _, _ in inputs]
    inits = {name: arr for name, arr, const in inputs if const and name}
    feeds = {name: arr for name, arr, const in inputs if not const and name}
    node = helper.make_node(op, names, [o for o, _ in outputs], **(attrs or {}))
    model = make_model([node], [(n, a.dtype, list(a.shape)) for n, a in feeds.items()],
                       [(o, dt, None) for o, dt in outputs if o], initializers=inits, opset=opset)
    return model, feeds


def ints(*shape, dtype=U8, seed=0):
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max, shape, endpoint=True).astype(dtype)


# ---------------------------------------------------------------- ConvTranspose

CONV_TRANSPOSE = {
    # name: (x shape, w shape, attrs, bias, constant weights, dtype)
    "plain": ((1, 3, 5, 5), (3, 2, 3, 3), {}, False, True, F32),
    "stride2_pads_output_padding": ((2, 3, 4, 5), (3, 4, 3, 3),
                                    {"strides": [2, 2], "pads": [1, 0, 1, 1], "output_padding": [1, 1]}, True, True, F32),
    "group2_dilation2_bias": ((1, 4, 5, 4), (4, 3, 3, 2), {"group": 2, "dilations": [2, 2]}, True, True, F32),
    "depthwise_stride3": ((1, 3, 3, 4), (3, 1, 2, 3), {"group": 3, "strides": [3, 2]}, True, True, F32),
    "output_shape": ((1, 2, 3, 3), (2, 3, 3, 3), {"strides": [3, 2], "output_shape": [10, 8]}, False, True, F32),
    "same_upper": ((1, 2, 3, 4), (2, 2, 4, 3), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}, True, True, F32),
    "same_lower": ((1, 2, 3, 4), (2, 2, 4, 3), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}, False, True, F32),
    "valid_2x2_stride2": ((2, 4, 4, 4), (4, 3, 2, 2), {"strides": [2, 2], "auto_pad": "VALID"}, True, True, F32),
    "1d": ((2, 3, 7), (3, 2, 4), {"strides": [3], "pads": [2, 1]}, True, True, F32),
    "3d": ((1, 2, 3, 3, 2), (2, 2, 2, 3, 2), {"strides": [2, 1, 2], "pads": [0, 1, 1, 1, 0, 0]}, True, True, F32),
    "runtime_weights": ((1, 3, 4, 4), (3, 2, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True, False, F32),
    # strides == kernel, no pads: each input pixel writes a patch of its own (convtranspose._patches:
    # a 1x1 GEMM on the micro-kernel, then a permutation); channels enough for whole micro-tiles,
    # odd planes, a non-square kernel
    "patches_2x2_bias": ((2, 32, 20, 20), (32, 16, 2, 2), {"strides": [2, 2]}, True, True, F32),
    "patches_odd_plane": ((1, 24, 7, 9), (24, 8, 2, 2), {"strides": [2, 2]}, False, True, F32),
    "patches_2x3_kernel": ((1, 16, 5, 6), (16, 5, 2, 3), {"strides": [2, 3]}, True, True, F32),
}


@pytest.mark.parametrize("case", list(CONV_TRANSPOSE))
def test_conv_transpose(case):
    x_shape, w_shape, attrs, bias, const, dtype = CONV_TRANSPOSE[case]
    inputs = [("x", rand(*x_shape, seed=1, dtype=dtype), False), ("w", rand(*w_shape, seed=2, dtype=dtype), const)]
    if bias:
        inputs.append(("b", rand(w_shape[1] * attrs.get("group", 1), seed=3, dtype=dtype), const))
    model, feeds = one_node("ConvTranspose", inputs, [("y", dtype)], attrs)
    assert_matches_ort(model, feeds)


def test_conv_transpose_float64():
    """onnxruntime has no float64 ConvTranspose: compare with its float32 result."""
    x, w, b = rand(1, 2, 4, 4, seed=1, dtype=F64), rand(2, 2, 3, 3, seed=2, dtype=F64), rand(2, seed=3, dtype=F64)
    model64, feeds = one_node("ConvTranspose", [("x", x, False), ("w", w, True), ("b", b, True)], [("y", F64)], {"strides": [2, 2]})
    model32, feeds32 = one_node("ConvTranspose", [("x", x.astype(F32), False), ("w", w.astype(F32), True), ("b", b.astype(F32), True)],
                                [("y", F32)], {"strides": [2, 2]})
    got, want = cuvil.compile(model64).run(feeds)["y"], run_ort(model32, feeds32)["y"]
    assert got.dtype == F64
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_conv_transpose_threads():
    inputs = [("x", rand(2, 4, 6, 6, seed=1), False), ("w", rand(4, 3, 2, 2, seed=2), True)]
    model, feeds = one_node("ConvTranspose", inputs, [("y", F32)], {"strides": [2, 2]})
    assert_matches_ort(model, feeds, threads=2)


# ---------------------------------------------------------------- normalisations, Gelu

LAYER_NORM = {
    # name: (x shape, attrs, bias, constant params, with Mean/InvStdDev)
    "last_axis": ((2, 5, 16), {}, True, True, False),
    "axis1_stats_no_bias": ((2, 3, 4, 5), {"axis": 1}, False, True, True),
    "axis_neg2_runtime_params": ((3, 4, 6), {"axis": -2, "epsilon": 1e-3}, True, False, True),
    "axis0_stats": ((3, 7), {"axis": 0}, True, True, True),
}


@pytest.mark.parametrize("case", list(LAYER_NORM))
def test_layer_normalization(case):
    shape, attrs, bias, const, stats = LAYER_NORM[case]
    axis = attrs.get("axis", -1) % len(shape)
    inputs = [("x", rand(*shape, seed=1) * F32(3) + F32(1), False), ("scale", rand(*shape[axis:], seed=2), const)]
    if bias:
        inputs.append(("bias", rand(*shape[axis:], seed=3), const))
    outputs = [("y", F32)] + ([("mean", F32), ("inv_std", F32)] if stats else [])
    model, feeds = one_node("LayerNormalization", inputs, outputs, attrs)
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("shape,const", [((2, 3, 5, 4), True), ((2, 4, 7), False)])
def test_instance_normalization(shape, const):
    C = shape[1]
    inputs = [("x", rand(*shape, seed=1) * F32(2) - F32(1), False), ("s", rand(C, seed=2), const), ("b", rand(C, seed=3), const)]
    model, feeds = one_node("InstanceNormalization", inputs, [("y", F32)], {"epsilon": 1e-3})
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    model, feeds = one_node("Gelu", [("x", rand(3, 50, seed=1) * F32(3), False)], [("y", F32)],
                            {"approximate": approximate}, opset=20)
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("p,axis", [(2, -1), (1, 1), (2, 0)])
def test_lp_normalization(p, axis):
    x = rand(3, 4, 5, seed=1)
    x[1, :, 2] = 0  # a zero vector along axis 1: its output is 0
    model, feeds = one_node("LpNormalization", [("x", x, False)], [("y", F32)], {"p": p, "axis": axis})
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("axes", [[0, 2, 3], [1], [2, 3], [0, 1, 2, 3]])
def test_mean_variance_normalization(axes):
    # axes given explicitly: ONNX's shape inference fails on MVN's function body with the default.
    model, feeds = one_node("MeanVarianceNormalization", [("x", rand(2, 3, 4, 5, seed=1), False)], [("y", F32)],
                            {"axes": axes}, opset=13)
    assert_matches_ort(model, feeds)


# ---------------------------------------------------------------- QuantizeLinear / DequantizeLinear

def _ties(n, scale, seed=0):
    """Values that land exactly on k + 0.5 steps of `scale` (after float32 division), and others."""
    rng = np.random.default_rng(seed)
    k = rng.integers(-140, 140, n).astype(F32) + F32(0.5)
    return np.concatenate([(k * scale).astype(F32), (rng.standard_normal(n) * 2).astype(F32)])


QUANTIZE = {
    # name: (x, scale, zero point (None: omitted), attrs, constant params, opset)
    "uint8_runtime": (_ties(300, F32(5 / 255)), np.array(5 / 255, F32), np.array(128, U8), {}, False, 13),
    "int8_constant": (_ties(300, F32(0.0173)), np.array(0.0173, F32), np.array(-3, I8), {}, True, 13),
    "no_zero_point": (_ties(100, F32(0.01)), np.array(0.01, F32), None, {}, True, 13),
    "per_axis": (rand(2, 3, 4, seed=1), np.array([0.01, 0.02, 0.013], F32), np.array([120, 128, 130], U8),
                 {"axis": 1}, False, 13),
    "per_axis_int8_const": (rand(4, 5, seed=2), np.array([0.01, 0.02, 0.013, 0.031, 0.007], F32),
                            np.array([0, 1, -1, 2, 0], I8), {"axis": -1}, True, 13),
    "blocked": (rand(3, 8, seed=3), np.array([[0.01, 0.03], [0.02, 0.011], [0.05, 0.007]], F32),
                np.array([[1, 2], [3, 4], [5, 6]], I8), {"axis": 1, "block_size": 4}, False, 21),
    "int16": (rand(40, seed=4) * F32(100), np.array(0.003, F32), np.array(-7, np.int16), {}, False, 21),
    "uint16": (rand(40, seed=5) * F32(100), np.array(0.003, F32), np.array(30000, np.uint16), {}, True, 21),
}


@pytest.mark.parametrize("case", list(QUANTIZE))
def test_quantize_linear(case):
    x, scale, zero, attrs, const, opset = QUANTIZE[case]
    inputs = [("x", x, False), ("s", scale, const)] + ([("z", zero, const)] if zero is not None else [])
    out = zero.dtype if zero is not None else U8
    model, feeds = one_node("QuantizeLinear", inputs, [("y", out)], attrs, opset=opset)
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("zero", [np.array(114, U8), np.array(-7, I8), np.array(30000, np.uint16),
                                  np.array(-300, np.int16)], ids=lambda z: z.dtype.name)
def test_quantize_linear_float32_rounding(zero, threads):
    """A float32 scale into an 8/16-bit integer: the quotient rounded once from float64, its rint, the
    zero point's sum and the clamp in float32 (quant.py). Ties, values that saturate at both ends,
    quotients past 2^24 (where a float32 sum is no longer exact) and past 2^31, an odd size (a
    vector loop's remainder), on 1 and 2 threads: equal to onnxruntime."""
    scale = F32(0.0187)
    big = np.array([2.0 ** 24 - 1, 2.0 ** 24, 2.0 ** 24 + 3, 2.0 ** 31, 3e9, 1e12], np.float64)
    steps = np.concatenate([big, -big, [127.5, 128.5, -128.5, 255.5, 65535.5, -32768.5, 32767.5]])
    x = np.concatenate([_ties(900, scale, seed=threads), (steps * np.float64(scale)).astype(F32),
                        (np.random.default_rng(threads).standard_normal(2000) * 800).astype(F32)])
    x = np.resize(x, (1, 3, 29, 37)).astype(F32)
    model, feeds = one_node("QuantizeLinear", [("x", x, False), ("s", np.array(scale), True), ("z", zero, True)],
                            [("y", zero.dtype)], opset=21)
    assert_matches_ort(model, feeds, threads=threads)


DEQUANTIZE = {
    "uint8": (ints(5, 7, seed=1), np.array(0.02, F32), np.array(127, U8), {}, False, 13),
    "int8_constant": (ints(30, dtype=I8, seed=2), np.array(0.5, F32), np.array(-4, I8), {}, True, 13),
    "per_axis": (ints(2, 3, 4, seed=3), np.array([0.1, 0.2, 0.3], F32), np.array([1, 128, 255], U8), {"axis": 1}, True, 13),
    "int32_no_zero_point": (np.arange(-20, 20, dtype=np.int32) * 1000, np.array(0.001, F32), None, {}, False, 13),
    "blocked": (ints(2, 6, dtype=I8, seed=4), np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], F32),
                np.array([[0, 1, 2], [3, 4, 5]], I8), {"axis": 1, "block_size": 2}, False, 21),
}


@pytest.mark.parametrize("case", list(DEQUANTIZE))
def test_dequantize_linear(case):
    x, scale, zero, attrs, const, opset = DEQUANTIZE[case]
    inputs = [("x", x, False), ("s", scale, const)] + ([("z", zero, const)] if zero is not None else [])
    model, feeds = one_node("DequantizeLinear", inputs, [("y", F32)], attrs, opset=opset)
    assert_matches_ort(model, feeds)


NARROW = {  # name: (element type, opset, zero points per row of a (3, 8) input)
    "int4": (TensorProto.INT4, 21, [0, 3, -2]),
    "uint4": (TensorProto.UINT4, 21, [8, 0, 15]),
    "int2": (TensorProto.INT2, 25, [0, 1, -1]),
    "uint2": (TensorProto.UINT2, 25, [1, 0, 3]),
    "float8_e4m3fn": (TensorProto.FLOAT8E4M3FN, 21, [0, 0, 0]),
    "float8_e5m2": (TensorProto.FLOAT8E5M2, 21, [0, 0, 0]),
    "float4_e2m1": (TensorProto.FLOAT4E2M1, 23, [0, 0, 0]),
}


def narrow_roundtrip_model(elem, opset, zeros, saturate=None):
    """x -> QuantizeLinear (per row) -> q (narrow) -> DequantizeLinear -> y; both outputs."""
    attrs = {"saturate": saturate} if saturate is not None else {}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=0, **attrs),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "narrow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info("q", elem, [3, 8]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
                              initializer=[helper.make_tensor("s", TensorProto.FLOAT, [3], [0.5, 0.25, 3.0]),
                                           helper.make_tensor("z", elem, [3], zeros)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 11 if opset >= 25 else 10
    return model


@pytest.mark.parametrize("case", list(NARROW))
def test_quantize_dequantize_narrow(case):
    """Narrow quantised types (int4/int2 with zero points, float8, float4): ties, saturation and
    NaN-free out-of-range values. The dequantised values are compared with onnxruntime where it
    implements the type (everything but float4), and the quantised bits with ONNX's reference."""
    elem, opset, zeros = NARROW[case]
    x = np.concatenate([np.linspace(-30, 30, 17), [0.125, 0.375, -0.375, 1e6, -1e6, 0.0, 2.5]]).astype(F32).reshape(3, 8)
    model = narrow_roundtrip_model(elem, opset, zeros)
    got = cuvil.compile(model).run({"x": x})
    want = ReferenceEvaluator(model).run(None, {"x": x})
    assert got["q"].dtype == want[0].dtype
    np.testing.assert_array_equal(got["q"].astype(F32), want[0].astype(F32))
    np.testing.assert_array_equal(got["y"], want[1])
    if case != "float4_e2m1":  # onnxruntime 1.32 has no float4 Quantize/DequantizeLinear
        # (only y: onnxruntime's Python API cannot return narrow-typed outputs)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(got["y"], session.run(["y"], {"x": x})[0])


def test_quantize_float8_without_saturation():
    """saturate=0: out-of-range values become inf (e5m2) or NaN (e4m3fn), as ONNX's reference says."""
    x = np.array([[1e6, -1e6, 3.0, 0.1]] * 3, F32).repeat(2, axis=1)
    for elem in (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2):
        model = narrow_roundtrip_model(elem, 21, [0, 0, 0], saturate=0)
        got = cuvil.compile(model).run({"x": x})
        want = ReferenceEvaluator(model).run(None, {"x": x})
        np.testing.assert_array_equal(got["y"], want[1])


def test_dequantize_float8_to_float16():
    """A float16 scale gives a float16 output, rounded once."""
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["y"])
    graph = helper.make_graph([helper.make_node("QuantizeLinear", ["x", "s32"], ["q"], output_dtype=TensorProto.FLOAT8E4M3FN), node],
                              "f16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [16])],
                              initializer=[helper.make_tensor("s32", TensorProto.FLOAT, [], [1.0]),
                                           helper.make_tensor("s", TensorProto.FLOAT16, [], [np.float16(0.1)])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    x = np.linspace(-400, 400, 16).astype(F32)
    got = cuvil.compile(model).run({"x": x})["y"]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, run_ort(model, {"x": x})["y"])


def test_dynamic_quantize_linear():
    model, feeds = one_node("DynamicQuantizeLinear", [("x", rand(4, 60, seed=1) * F32(3) + F32(1), False)],
                            [("y", U8), ("scale", F32), ("zero", U8)], opset=11)
    assert_matches_ort(model, feeds)


# ---------------------------------------------------------------- integer matmul and conv

MATMUL_INTEGER = {
    # name: (a, b, a zero point, b zero point, constant b)
    "uint8": (ints(5, 7, seed=1), ints(7, 6, seed=2), np.array(12, U8), np.array(200, U8), False),
    "int8_const_per_column_zero": (ints(4, 9, dtype=I8, seed=3), ints(9, 5, dtype=I8, seed=4), np.array(-2, I8),
                                   np.array([1, -1, 0, 3, 2], I8), True),
    "batched_broadcast": (ints(2, 3, 4, 6, seed=5), ints(3, 6, 5, seed=6), np.array(100, U8), None, True),
    "vector_a": (ints(6, seed=7), ints(2, 6, 3, seed=8), None, np.array(7, U8), False),
}


@pytest.mark.parametrize("case", list(MATMUL_INTEGER))
def test_matmul_integer(case):
    a, b, za, zb, const = MATMUL_INTEGER[case]
    inputs = [("a", a, False), ("b", b, const), ("za", za, False) if za is not None else ("", None, False)]
    if zb is not None:
        inputs.append(("zb", zb, const))
    model, feeds = one_node("MatMulInteger", inputs, [("y", np.int32)], opset=10)
    assert_matches_ort(model, feeds)


QLINEAR_MATMUL = {
    # name: (a, b, constant b and scales, b scale (per column when 1-D of N))
    "uint8_runtime": (ints(4, 8, seed=1), ints(8, 5, seed=2), False, np.array(0.02, F32)),
    "uint8_const": (ints(4, 8, seed=3), ints(8, 5, seed=4), True, np.array(0.015, F32)),
    "int8_batched": (ints(2, 3, 6, dtype=I8, seed=5), ints(2, 6, 4, dtype=I8, seed=6), True, np.array(0.03, F32)),
    "per_column_scale": (ints(3, 8, seed=7), ints(8, 4, seed=8), True, np.array([0.01, 0.02, 0.015, 0.03], F32)),
}


@pytest.mark.parametrize("case", list(QLINEAR_MATMUL))
def test_qlinear_matmul(case):
    a, b, const, b_scale = QLINEAR_MATMUL[case]
    dtype = a.dtype
    zero = lambda v: np.array(v, dtype)  # noqa: E731
    inputs = [("a", a, False), ("sa", np.array(0.05, F32), const), ("za", zero(3), const),
              ("b", b, const), ("sb", b_scale, const), ("zb", zero(10 if dtype == U8 else -2), const),
              ("sy", np.array(0.7, F32), const), ("zy", zero(120 if dtype == U8 else 5), const)]
    model, feeds = one_node("QLinearMatMul", inputs, [("y", dtype)], opset=10)
    assert_matches_ort(model, feeds)


def test_qlinear_matmul_float16_scales_match_reference():
    """float16 scales (opset 21): onnxruntime has no kernel, ONNX's reference evaluator does
    (each scale operation rounded to float16)."""
    from onnx.reference import ReferenceEvaluator
    h = np.float16
    inputs = [("a", ints(3, 5, seed=1), False), ("sa", np.array([0.0066], h), False), ("za", np.array([113], U8), False),
              ("b", ints(5, 4, seed=2), False), ("sb", np.array([0.00705], h), False), ("zb", np.array([114], U8), False),
              ("sy", np.array([0.0107], h), False), ("zy", np.array([118], U8), False)]
    model, feeds = one_node("QLinearMatMul", inputs, [("y", U8)], opset=21)
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_array_equal(cuvil.compile(model).run(feeds)["y"], want)


QLINEAR_CONV = {
    # name: (x, w shape, attrs, per-channel w scale, bias, constant weights)
    "plain": (ints(1, 3, 6, 6, seed=1), (4, 3, 3, 3), {}, False, False, True),
    "pads_strides_bias": (ints(2, 2, 7, 5, seed=2), (3, 2, 3, 2), {"pads": [1, 0, 1, 1], "strides": [2, 1]}, False, True, True),
    "per_channel_group": (ints(1, 4, 5, 5, seed=3), (4, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}, True, True, True),
    "runtime_weights_dilated": (ints(1, 2, 8, 8, seed=4), (2, 2, 2, 2), {"dilations": [2, 2]}, False, False, False),
    "int8_1d_same": (ints(1, 3, 9, dtype=I8, seed=5), (2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2]}, True, False, True),
}


@pytest.mark.parametrize("case", list(QLINEAR_CONV))
def test_qlinear_conv(case):
    x, w_shape, attrs, per_channel, bias, const = QLINEAR_CONV[case]
    dtype = x.dtype
    M = w_shape[0]
    w_dtype = I8 if dtype == I8 else U8
    w_scale = np.linspace(0.01, 0.03, M).astype(F32) if per_channel else np.array(0.02, F32)
    w_zero = np.array(0, w_dtype) if w_dtype == I8 else np.array(128, U8)
    inputs = [("x", x, False), ("sx", np.array(0.04, F32), const), ("zx", np.array(7, dtype), const),
              ("w", ints(*w_shape, dtype=w_dtype, seed=9), const), ("sw", w_scale, const), ("zw", w_zero, const),
              ("sy", np.array(0.9, F32), const), ("zy", np.array(100 if dtype == U8 else -3, dtype), const)]
    if bias:
        inputs.append(("bias", np.random.default_rng(10).integers(-2000, 2000, M).astype(np.int32), const))
    model, feeds = one_node("QLinearConv", inputs, [("y", dtype)], attrs, opset=10)
    assert_matches_ort(model, feeds)


def test_conv_integer():
    inputs = [("x", ints(1, 2, 5, 6, seed=1), False), ("w", ints(3, 2, 3, 3, seed=2), True),
              ("zx", np.array(9, U8), False), ("zw", np.array(130, U8), True)]
    model, feeds = one_node("ConvInteger", inputs, [("y", np.int32)], {"pads": [1, 1, 1, 1]}, opset=10)
    assert_matches_ort(model, feeds)
