"""The int8 GEMM on AVX512-VNNI (backends/numba_cpu/ukernel_int8.py, qgemm.py).

Integer products are exact and onnxruntime's integer ops are deterministic, so every comparison
here is bit-exact: MatMulInteger's int32 sums, QLinearMatMul's requantised bytes (the multiplier
s_a s_b / s_y in float32, round half to even, as onnxruntime's MLAS does). The micro-kernel alone
is compared with numpy's int64 matrix product (exact), each float step written as it rounds.
Shapes cover the edges: M not a multiple of the 6-row tile, N not a multiple of 64 (masked
columns), N < 64 (a narrower tile), uint8 and int8 activations (the +128 shift and its
compensation), constant, run-time and absent activation zero points, per-column weight zero
points and scales.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from onnx import helper

from backends.numba_cpu.ukernel_int8 import Int8UKSpec, int8_ukernel_ir, pack_b_quads
from backends.targets import has_feature, resolve_target
from cuvil.explain import explain_model
from tests.helpers import make_model, run_ort

import cuvil

U8, I8, F32 = np.uint8, np.int8, np.float32
HOST = resolve_target("native")
pytestmark = pytest.mark.skipif(not has_feature(HOST, "avx512vnni"), reason="this CPU has no AVX512-VNNI")


def ints(shape, dtype, seed):
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def _jit_kernel(spec):
    from backends.numba_cpu.hostjit import HostJit
    jit = HostJit(HOST.cpu, HOST.features, 512)
    jit.add(int8_ukernel_ir(spec))
    p, i = ctypes.c_void_p, ctypes.c_int64
    return jit, jit.function(spec.name, ctypes.c_int32, p, i, i, p, i, p, i, i, i, i, p, p, p, i, i, p)


UKERNEL = {
    # name: (out, a dtype, rows, N[, multiplier range])
    "i32_u8": ("i32", U8, 6, 64),
    "i32_s8_narrow": ("i32", I8, 4, 40),
    "f32_u8_scale_bias_relu": ("f32", U8, 6, 50),
    "u8_s8_requantised": ("u8", I8, 3, 64),
    "s8_u8_requantised_clip": ("s8", U8, 5, 20),
    # multipliers up to 1e7 (signed sums up to ~6e5): scaled values far past +-2^31, where the x86
    # requantisation's rounding conversion gives INT_MIN (_requantise): both ends must saturate
    "u8_u8_multiplier_past_int32": ("u8", U8, 6, 64, (1e-2, 1e7)),
    "s8_s8_multiplier_past_int32": ("s8", I8, 4, 30, (1e-2, 1e7)),
}


@pytest.mark.parametrize("case", list(UKERNEL))
def test_micro_kernel_is_exact(case):
    out, a_dtype, mr, N, *scales = UKERNEL[case]
    K, za, zy = 36, 9, -3 if out == "s8" else 7
    act = {"f32": ("Relu", 0.0, 0.0), "s8": ("Clip", -0.5, 0.25)}.get(out, ("", 0.0, 0.0))
    if scales:
        act = ("", 0.0, 0.0)
    nr = 64 if N > 48 else 48
    spec = Int8UKSpec(mr=mr, nr=nr, out=out, a_signed=int(a_dtype == I8), ascale=1, bias=1, act=act[0],
                      act_lo=act[1], act_hi=act[2], zy=zy)
    jit, kernel = _jit_kernel(spec)   # jit holds the compiled code alive while kernel is called
    A, B = ints((mr, K), a_dtype, 1), ints((K, N), I8, 2)
    rng = np.random.default_rng(3)
    comp = np.zeros(nr, np.int32)
    comp[:N] = -B.astype(np.int32).sum(0)
    mult = rng.uniform(*(scales[0] if scales else (1e-3, 2e-2)), nr).astype(F32)
    bias = rng.uniform(-1, 1, nr).astype(F32)
    ascale = np.array([0.37], F32)
    C = np.zeros((mr, N), {"i32": np.int32, "f32": F32, "u8": U8, "s8": I8}[out])
    ptr = lambda x: x.ctypes.data  # noqa: E731
    zeff = za + (128 if a_dtype == I8 else 0)
    packed = pack_b_quads(B, nr)   # held: ctypes takes its address only
    kernel(ptr(A), 0, K, ptr(packed), 0, ptr(C), 0, N, K // 4, (1 << N) - 1, ptr(comp), ptr(mult),
           ptr(bias), 0, zeff, ptr(ascale))
    acc = (A.astype(np.int64) - za) @ B.astype(np.int64)
    lo, hi = act[1:] if act[0] == "Clip" else (0, np.inf) if act[0] == "Relu" else (-np.inf, np.inf)
    if out == "i32":
        want = acc.astype(np.int32)
    elif out == "f32":
        want = np.clip(acc.astype(F32) * (mult[:N] * ascale[0]) + bias[:N], lo, hi).astype(F32)
    else:
        info = np.iinfo(C.dtype)
        y = np.clip(acc.astype(F32) * mult[:N], F32(lo), F32(hi))
        want = np.clip(np.rint(y) + zy, info.min, info.max).astype(C.dtype)
    np.testing.assert_array_equal(C, want)


def _one_node(op, inputs, out_dtype, opset=10):
    """A model of one node; inputs [(name, array, constant?)] (name "" skips an optional input)."""
    names = [n for n, _, _ in inputs]
    inits = {n: a for n, a, const in inputs if const and n}
    feeds = {n: a for n, a, const in inputs if not const and n}
    model = make_model([helper.make_node(op, names, ["y"])], [(n, a.dtype, list(a.shape)) for n, a in feeds.items()],
                       [("y", out_dtype, None)], initializers=inits, opset=opset)
    return model, feeds


def _int8_kernels(model) -> list[str]:
    return [k.precision for k in explain_model(model, target="native").kernels if k.precision.startswith("int8")]


MATMUL_INTEGER = {
    # name: (a, b, a zero point (None: omitted), a zero point constant?, b zero point)
    "u8_runtime_zero": (ints((13, 64), U8, 1), ints((64, 100), I8, 2), np.array(131, U8), False, None),
    "s8_const_zero_batched": (ints((2, 7, 32), I8, 3), ints((32, 70), I8, 4), np.array(-5, I8), True, None),
    "u8_weights_zero_128": (ints((5, 48), U8, 5), ints((48, 20), U8, 6), np.array(7, U8), True, np.array(128, U8)),
    "s8_no_zero_per_column_b_zero": (ints((9, 16), I8, 7), ints((16, 33), I8, 8) // 2, None, False,
                                     ints((33,), I8, 9) // 4),
}


@pytest.mark.parametrize("case", list(MATMUL_INTEGER))
def test_matmul_integer_with_constant_weights_is_onnxruntimes(case):
    a, b, za, za_const, zb = MATMUL_INTEGER[case]
    inputs = [("a", a, False), ("b", b, True), ("za", za, za_const) if za is not None else ("", None, True)]
    if zb is not None:
        inputs.append(("zb", zb, True))
    model, feeds = _one_node("MatMulInteger", inputs, np.int32)
    assert _int8_kernels(model), "the VNNI kernel was not used"
    got = cuvil.compile(model).run(feeds)["y"]
    np.testing.assert_array_equal(got, run_ort(model, feeds)["y"])


QLINEAR_MATMUL = {
    # name: (a dtype, M, K, N, per-column b scale)
    "u8": (U8, 10, 64, 96, False),
    "s8_per_column": (I8, 17, 128, 40, True),
}


@pytest.mark.parametrize("case", list(QLINEAR_MATMUL))
def test_qlinear_matmul_with_constant_weights_is_onnxruntimes(case):
    dtype, M, K, N, per_column = QLINEAR_MATMUL[case]
    rng = np.random.default_rng(11)
    sb = rng.uniform(0.002, 0.01, N).astype(F32) if per_column else np.array(0.004, F32)
    zero = (lambda v: np.array(v, dtype))
    inputs = [("a", ints((M, K), dtype, 12), False), ("sa", np.array(0.05, F32), True), ("za", zero(3), True),
              ("b", ints((K, N), I8, 13), True), ("sb", sb, True), ("zb", np.array(0, I8), True),
              ("sy", np.array(0.9, F32), True), ("zy", zero(120 if dtype == U8 else -4), True)]
    model, feeds = _one_node("QLinearMatMul", inputs, dtype)
    assert _int8_kernels(model), "the VNNI kernel was not used"
    got = cuvil.compile(model).run(feeds)["y"]
    np.testing.assert_array_equal(got, run_ort(model, feeds)["y"])


def test_without_vnni_the_scalar_kernels_compute_the_same():
    """x86_64-avx512 (Skylake-X) has no VNNI: MatMulInteger keeps the exact scalar loops."""
    a, b, za, za_const, zb = MATMUL_INTEGER["u8_runtime_zero"]
    model, feeds = _one_node("MatMulInteger", [("a", a, False), ("b", b, True), ("za", za, False)], np.int32)
    assert not [k for k in explain_model(model, target="x86_64-avx512").kernels if k.precision.startswith("int8")]
    got = cuvil.compile(model, target="x86_64-avx512").run(feeds)["y"]
    np.testing.assert_array_equal(got, run_ort(model, feeds)["y"])


QLINEAR_CONV = {
    # name: (x shape, w shape, attrs, activations, path: "" channel quads, "im2col" (C not whole
    # quads: the patches gathered into quads), "channel lanes" (small planes: Int8RowConvSpec))
    "3x3_pad": ((1, 8, 10, 12), (16, 8, 3, 3), {"pads": [1, 1, 1, 1]}, U8, ""),
    "stride2_int8_batch2": ((2, 5, 9, 9), (7, 5, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, I8, "im2col"),
    "7x7_stride2_three_channels": ((1, 3, 20, 20), (8, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}, U8,
                                   "im2col"),
    "5x5_one_channel_odd_plane": ((1, 1, 17, 19), (20, 1, 5, 5), {"pads": [2, 2, 2, 2]}, U8, "im2col"),
    "7x7_stem_int8_batch2": ((2, 3, 37, 33), (64, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}, I8,
                             "im2col"),
    "1x1_small_plane": ((1, 16, 7, 7), (30, 16, 1, 1), {}, U8, ""),
    "dilated_uneven_pads_wide": ((1, 4, 40, 70), (6, 4, 3, 3), {"dilations": [2, 2], "pads": [2, 1, 2, 1]}, U8, ""),
    "3x3_7x7_plane": ((1, 64, 7, 7), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}, U8, "channel lanes"),
    "3x3_stride2_to_7x7_int8_batch2": ((2, 32, 14, 14), (96, 32, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]},
                                       I8, "channel lanes"),
    "1x1_stride2_to_7x7": ((1, 64, 14, 14), (128, 64, 1, 1), {"strides": [2, 2]}, U8, "channel lanes"),
    "3x3_14x14_plane": ((1, 24, 14, 14), (32, 24, 3, 3), {"pads": [1, 1, 1, 1]}, U8, "channel lanes"),
    # tiles of 11 and 5 pixels: the channel-lane store's transpose in 16- and 8-byte slots
    "3x3_11x11_plane_rows_of_11": ((1, 12, 11, 11), (64, 12, 3, 3), {"pads": [1, 1, 1, 1]}, U8, "channel lanes"),
    "1x1_5x5_plane_int8_batch2": ((2, 8, 5, 5), (32, 8, 1, 1), {}, I8, "channel lanes"),
    # the rows narrower than the taps' reach (W + max pad: _layout_holds): asymmetric pads, left
    # heavier and right heavier; a strided 1x1 with padding copies only the phase it reads
    "3x3_left_pad_2_right_0_odd": ((1, 8, 11, 13), (16, 8, 3, 3), {"pads": [0, 2, 1, 0]}, U8, ""),
    "3x3_right_pad_2_int8": ((1, 4, 9, 10), (12, 4, 3, 3), {"pads": [2, 0, 0, 2]}, I8, ""),
    "1x1_stride2_padded_batch2": ((2, 16, 15, 13), (24, 16, 1, 1), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, U8,
                                  ""),
    # must not fire: 48 output channels are not whole blocks of 32 (channel lanes); 8 channels are
    # whole quads (im2col)
    "7x7_plane_48_channels": ((1, 16, 7, 7), (48, 16, 3, 3), {"pads": [1, 1, 1, 1]}, U8, ""),
    "7x7_kernel_whole_quads": ((1, 8, 12, 12), (16, 8, 7, 7), {"pads": [3, 3, 3, 3]}, U8, ""),
}


@pytest.mark.parametrize("case", list(QLINEAR_CONV))
def test_qlinear_conv_is_onnxruntimes(case):
    """QLinearConv on the VNNI kernels, bit-exact with onnxruntime on 1 and 2 threads, on each path
    (the same int32 sums whatever the order of the products; the same float32 requantisation)."""
    xs, ws, attrs, dtype, path = QLINEAR_CONV[case]
    OC = ws[0]
    rng = np.random.default_rng(0)
    inits = {"sx": np.array(0.02, F32), "zx": np.array(100 if dtype == U8 else -3, dtype), "w": ints(ws, I8, 1),
             "sw": rng.uniform(0.001, 0.01, OC).astype(F32), "zw": np.zeros(OC, I8), "sy": np.array(0.1, F32),
             "zy": np.array(90 if dtype == U8 else 4, dtype), "b": rng.integers(-2000, 2000, OC).astype(np.int32)}
    node = helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy", "b"], ["y"], **attrs)
    model = make_model([node], [("x", dtype, list(xs))], [("y", dtype, None)], initializers=inits, opset=13)
    feeds = {"x": ints(xs, dtype, 5)}
    labels = _int8_kernels(model)
    assert labels, "the VNNI kernel was not used"
    kind = "im2col" if any("im2col" in k for k in labels) else "channel lanes" if any(
        "channel lanes" in k for k in labels) else ""
    assert kind == path, labels
    want = run_ort(model, feeds)["y"]
    for threads in (1, 2):
        np.testing.assert_array_equal(cuvil.compile(model, threads=threads).run(feeds)["y"], want)


DEPTHWISE = {
    # name: (x shape, kernel, attrs, activations)
    "3x3_pad": ((1, 8, 10, 12), 3, {"pads": [1, 1, 1, 1]}, U8),
    "stride2_int8_batch2": ((2, 5, 9, 9), 3, {"strides": [2, 2], "pads": [1, 1, 1, 1]}, I8),
    "5x5_small_plane": ((1, 16, 7, 7), 5, {"pads": [2, 2, 2, 2]}, U8),
    "stride2_uint8_rows": ((1, 24, 15, 13), 3, {"strides": [2, 2], "pads": [1, 1, 1, 1]}, U8),
    "dilated_rows": ((1, 6, 20, 70), 3, {"dilations": [2, 2], "pads": [2, 2, 2, 2]}, U8),
}


@pytest.mark.parametrize("case", list(DEPTHWISE))
def test_depthwise_qlinear_conv_is_onnxruntimes(case):
    """Depthwise convs, bit-exact: up to 4 taps a kernel row on VNNI (one vpdpbusd a kernel row on
    bytes shuffled into windows; int8 inputs shifted), wider kernels on int32 vector loops."""
    xs, k, attrs, dtype = DEPTHWISE[case]
    C = xs[1]
    rng = np.random.default_rng(1)
    inits = {"sx": np.array(0.02, F32), "zx": np.array(100 if dtype == U8 else -3, dtype), "w": ints((C, 1, k, k), I8, 1),
             "sw": rng.uniform(0.001, 0.01, C).astype(F32), "zw": np.zeros(C, I8), "sy": np.array(0.1, F32),
             "zy": np.array(90 if dtype == U8 else 4, dtype), "b": rng.integers(-2000, 2000, C).astype(np.int32)}
    node = helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy", "b"], ["y"], group=C, **attrs)
    model = make_model([node], [("x", dtype, list(xs))], [("y", dtype, None)], initializers=inits, opset=13)
    feeds = {"x": ints(xs, dtype, 5)}
    labels = [k.precision for k in explain_model(model, target="native").kernels]
    assert ("int8 (depthwise, vnni)" if k <= 4 else "int8 (depthwise)") in labels
    np.testing.assert_array_equal(cuvil.compile(model).run(feeds)["y"], run_ort(model, feeds)["y"])


DEPTHWISE_INTO_QUADS = {
    # name: (x shape, depthwise attrs, 1x1 output channels, fused?)
    "3x3_14x14": ((1, 16, 14, 14), {"pads": [1, 1, 1, 1]}, 24, True),
    "stride2_batch2_7x7": ((2, 8, 13, 13), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, 12, True),
    "wide_rows_40": ((1, 8, 9, 40), {"pads": [1, 1, 1, 1]}, 20, True),
    # must not fire: 6 channels is not whole quads (the depthwise keeps its own output)
    "channels_not_quads": ((1, 6, 10, 10), {"pads": [1, 1, 1, 1]}, 8, False),
}


@pytest.mark.parametrize("case", list(DEPTHWISE_INTO_QUADS))
def test_depthwise_writes_the_next_1x1_convs_quads(case):
    """A depthwise QLinearConv read only by a 1x1 QLinearConv writes that conv's channel quads itself
    (Int8DwQuadSpec: no compaction, no QuadPad): bit-exact with onnxruntime, as both ops alone are."""
    xs, attrs, OC, fused = DEPTHWISE_INTO_QUADS[case]
    C = xs[1]
    rng = np.random.default_rng(2)
    inits = {"sx": np.array(0.02, F32), "zx": np.array(100, U8), "w": ints((C, 1, 3, 3), I8, 1),
             "sw": rng.uniform(0.001, 0.01, C).astype(F32), "zw": np.zeros(C, I8), "sy": np.array(0.1, F32),
             "zy": np.array(90, U8), "b": rng.integers(-2000, 2000, C).astype(np.int32),
             "w2": ints((OC, C, 1, 1), I8, 3), "sw2": rng.uniform(0.001, 0.01, OC).astype(F32),
             "zw2": np.zeros(OC, I8), "sy2": np.array(0.05, F32), "zy2": np.array(120, U8),
             "b2": rng.integers(-2000, 2000, OC).astype(np.int32)}
    dw = helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy", "b"], ["t"], group=C, **attrs)
    pw = helper.make_node("QLinearConv", ["t", "sy", "zy", "w2", "sw2", "zw2", "sy2", "zy2", "b2"], ["y"])
    model = make_model([dw, pw], [("x", U8, list(xs))], [("y", U8, None)], initializers=inits, opset=13)
    feeds = {"x": ints(xs, U8, 5)}
    symbols = " ".join(k.symbol for k in explain_model(model, target="native").kernels)
    assert ("qdwconvquads" in symbols) == fused and ("quadpad" in symbols) != fused, symbols
    np.testing.assert_array_equal(cuvil.compile(model).run(feeds)["y"], run_ort(model, feeds)["y"])


def _qconv(name, x, y, w, group=1, zy=90, **attrs):
    """A QLinearConv node and its initializers (uint8 activations, per-channel int8 weights, int32
    bias); its input's scale and zero point are the names `x`_s, `x`_z."""
    OC = w.shape[0]
    rng = np.random.default_rng(len(name))
    inits = {f"{name}_w": w, f"{name}_sw": rng.uniform(0.001, 0.01, OC).astype(F32), f"{name}_zw": np.zeros(OC, I8),
             f"{y}_s": np.array(0.05 + 0.01 * len(name), F32), f"{y}_z": np.array(zy, U8),
             f"{name}_b": rng.integers(-2000, 2000, OC).astype(np.int32)}
    node = helper.make_node("QLinearConv", [x, f"{x}_s", f"{x}_z", f"{name}_w", f"{name}_sw", f"{name}_zw", f"{y}_s",
                                            f"{y}_z", f"{name}_b"], [y], group=group, **attrs)
    return node, inits


CONV_INTO_DEPTHWISE = {
    # name: (x shape, first conv (out channels, kernel, attrs), depthwise attrs, 1x1 after?, output also read?)
    "expand_1x1_dw_project": ((1, 8, 14, 14), (24, 1, {}), {"pads": [1, 1, 1, 1]}, True, False),
    "stem_3x3_stride2_dw": ((1, 3, 23, 23), (16, 3, {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
                            {"pads": [1, 1, 1, 1]}, False, False),
    "expand_dw_stride2_batch2": ((2, 12, 9, 9), (20, 1, {}), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True, False),
    # must not fire: the conv's output is a graph output too (it must exist as it is)
    "output_read_twice": ((1, 8, 10, 10), (16, 1, {}), {"pads": [1, 1, 1, 1]}, False, True),
}


@pytest.mark.parametrize("case", list(CONV_INTO_DEPTHWISE))
def test_conv_writes_the_next_depthwises_padded_planes(case):
    """A VNNI QLinearConv read only by a depthwise QLinearConv computes on the depthwise's padded grid
    and stores whole rows, the padding columns as the zero point (Int8ConvBlendSpec); the depthwise
    fills only its top and bottom rows. A MobileNetV2 block (1x1 -> depthwise -> 1x1) then copies
    nothing between its convs. Bit-exact with onnxruntime."""
    xs, (OC, k, attrs), dw_attrs, project, twice = CONV_INTO_DEPTHWISE[case]
    C = xs[1]
    first, inits = _qconv("c1", "x", "t", ints((OC, C, k, k), I8, 1), **attrs)
    dw, more = _qconv("dw", "t", "u", ints((OC, 1, 3, 3), I8, 2), group=OC, zy=77, **dw_attrs)
    inits.update(more, x_s=np.array(0.02, F32), x_z=np.array(100, U8))
    nodes, last = [first, dw], "u"
    if project:
        pw, more = _qconv("pw", "u", "y", ints((8, OC, 1, 1), I8, 3), zy=120)
        inits.update(more)
        nodes, last = nodes + [pw], "y"
    outputs = [(last, U8, None)] + ([("t", U8, None)] if twice else [])
    model = make_model(nodes, [("x", U8, list(xs))], outputs, initializers=inits, opset=13)
    feeds = {"x": ints(xs, U8, 5)}
    symbols = " ".join(k.symbol for k in explain_model(model, target="native").kernels)
    assert ("qdwborder" in symbols) != twice and ("qdwpad" in symbols) == twice, symbols
    if project:
        assert "qdwconvquads" in symbols and symbols.count("quadpad") == 1, symbols
    got, want = cuvil.compile(model).run(feeds), run_ort(model, feeds)
    for name, _, _ in outputs:
        np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.parametrize("k", [3, 5])
def test_mobilenet_block_on_two_threads(k):
    """The same two paths split over 2 threads (work items of tiles, row blocks and quads write
    disjoint bytes); with a 5x5 depthwise (the int32 loops, not the VNNI rows) the conv before still
    writes its planes, and the depthwise keeps its own output: bit-exact with onnxruntime."""
    xs, C, OC = (1, 32, 28, 28), 32, 64     # every conv above MIN_SPLIT_OPS: split in work items
    first, inits = _qconv("c1", "x", "t", ints((OC, C, 1, 1), I8, 1))
    dw, more = _qconv("dw", "t", "u", ints((OC, 1, k, k), I8, 2), group=OC, zy=77, pads=[k // 2] * 4)
    pw, more2 = _qconv("pw", "u", "y", ints((48, OC, 1, 1), I8, 3), zy=120)
    inits.update(more, **more2, x_s=np.array(0.02, F32), x_z=np.array(100, U8))
    model = make_model([first, dw, pw], [("x", U8, list(xs))], [("y", U8, None)], initializers=inits, opset=13)
    feeds = {"x": ints(xs, U8, 5)}
    symbols = " ".join(k.symbol for k in explain_model(model, target="native").kernels)
    assert "qdwborder" in symbols and "qdwpad" not in symbols, symbols
    assert ("qdwconvquads" in symbols) == (k == 3), symbols
    want = run_ort(model, feeds)["y"]
    np.testing.assert_array_equal(cuvil.compile(model, threads=2).run(feeds)["y"], want)


CONV_INTO_CONV = {
    # name: (x shape, [(out channels, kernel, attrs) of each conv], quads written by a conv before)
    "resnet_3x3_3x3": ((1, 16, 14, 14), [(24, 3, {"pads": [1] * 4}), (24, 3, {"pads": [1] * 4})], 1),
    "stride2_then_3x3_batch2": ((2, 8, 15, 15), [(16, 3, {"strides": [2, 2], "pads": [1] * 4}),
                                                 (16, 3, {"pads": [1] * 4})], 1),
    "1x1_then_3x3_edge_tile": ((1, 8, 9, 11), [(20, 1, {}), (8, 3, {"pads": [1] * 4})], 1),
    # three convs: the middle one reads what the first wrote, so it writes its own output plainly
    "chain_of_three": ((1, 8, 12, 12), [(16, 3, {"pads": [1] * 4}), (16, 3, {"pads": [1] * 4}),
                                        (8, 3, {"pads": [1] * 4})], 1),
    # odd sizes on the narrow grid (W + 1 wide): the first conv's own input rows run on into the
    # next row (QuadPad's flat runs); a 5x5 pad-2 conv into a 3x3 pad-1 conv: its input, shifted
    # by 1 + 2, would need rows of W + 2 and the grid has W + 1 (must not fire)
    "odd_planes_batch2": ((2, 12, 9, 13), [(16, 3, {"pads": [1] * 4}), (8, 3, {"pads": [1] * 4})], 1),
    "5x5_into_3x3": ((1, 8, 11, 12), [(8, 5, {"pads": [2] * 4}), (8, 3, {"pads": [1] * 4})], 0),
    # must not fire: a 3x3 conv's grid is wider than the unpadded 1x1's; 6 channels are not whole quads
    "3x3_then_1x1": ((1, 8, 10, 10), [(16, 3, {"pads": [1] * 4}), (8, 1, {})], 0),
    "channels_not_quads": ((1, 8, 10, 10), [(6, 3, {"pads": [1] * 4}), (8, 3, {"pads": [1] * 4})], 0),
    # a 7x7 plane: the first conv computes with channels in the lanes and writes its own output
    "small_plane_channel_lanes": ((1, 16, 7, 7), [(64, 3, {"pads": [1] * 4}), (32, 3, {"pads": [1] * 4})], 0),
}


@pytest.mark.parametrize("case", list(CONV_INTO_CONV))
def test_conv_writes_the_next_convs_quads(case):
    """A VNNI QLinearConv read only by a stride-1 VNNI QLinearConv computes on that conv's padded grid
    and stores its rows as interleaved channel quads (Int8ConvBlendSpec quads, padding columns as the
    zero point); the next conv fills only its top and bottom rows (QuadBorder), no QuadPad copy.
    Bit-exact with onnxruntime, on 1 and 2 threads."""
    xs, convs, written = CONV_INTO_CONV[case]
    inits = {"x_s": np.array(0.02, F32), "x_z": np.array(100, U8)}
    nodes, C, src = [], xs[1], "x"
    for i, (OC, k, attrs) in enumerate(convs):
        node, more = _qconv(f"c{i}", src, f"t{i}", ints((OC, C, k, k), I8, i), zy=80 + i, **attrs)
        nodes.append(node)
        inits.update(more)
        C, src = OC, f"t{i}"
    model = make_model(nodes, [("x", U8, list(xs))], [(src, U8, None)], initializers=inits, opset=13)
    feeds = {"x": ints(xs, U8, 5)}
    symbols = " ".join(k.symbol for k in explain_model(model, target="native").kernels)
    assert symbols.count("quadborder") == written, symbols
    want = run_ort(model, feeds)[src]
    for threads in (1, 2):
        np.testing.assert_array_equal(cuvil.compile(model, threads=threads).run(feeds)[src], want)


def test_narrow_grid_layouts():
    """qconv._layout_holds, the check behind the grids' widths: every output lane's every tap must
    find its pixel, or padding, in phase images read flat (rows may run on into the next)."""
    from backends.numba_cpu.qconv import _layout_holds
    # a 3x3 pad-1 conv on 56x56: rows of 57 hold (a tap past the end reads the next row's left
    # padding) with one more row at the bottom; 56 do not, nor 57 without that row
    resnet = (56, 56, 56, 56, 3, 3, 1, (1, 1), 1, 1)
    assert _layout_holds(*resnet, 0, 59, 57)
    assert not _layout_holds(*resnet, 0, 58, 57)
    assert not _layout_holds(*resnet, 0, 59, 56)
    # on the next conv's grid (its left pad: col 1) the input rows run on into the next row, and hold
    assert _layout_holds(*resnet, 1, 59, 57)
    # left pad 2, right pad 0: the left padding must hold both pad columns (W + 2)
    assert _layout_holds(10, 10, 10, 10, 3, 3, 1, (1, 1), 1, 2, 0, 13, 12)
    assert not _layout_holds(10, 10, 10, 10, 3, 3, 1, (1, 1), 1, 2, 0, 13, 11)
    # the 7x7 stride-2 stem: phases 114 wide with a row more, not 113
    stem = (224, 224, 112, 112, 7, 7, 2, (1, 1), 3, 3, 0)
    assert _layout_holds(*stem, 116, 114) and not _layout_holds(*stem, 115, 114)
    assert not _layout_holds(*stem, 116, 113)
