"""bf16 strided convs over few, odd input channels (backends/numba_cpu/convtappairs.py): the products
`vdpbf16ps` sums in pairs are pairs of (channel, tap) products from bf16 pair planes.

Compared with onnxruntime in float32 within test_precision_conv's derived bound: every product is
bf16(x) * bf16(w) (2u + u^2 of its magnitude, u = 2^-8), exact in float32, and the K = C x KH x KW
products plus the bias are summed in float32 in some order (gamma(K + 3) of the sum of magnitudes
each engine; the zero-weight products added are exact zeros). The form is also checked to be the
one that ran (its pair-plane kernel in the explained kernels) and to multiply no more pairs than
the plan says.
"""
import numpy as np
import pytest

from onnx import helper

import cuvil
from backends.numba_cpu import convtappairs
from backends.numba_cpu.lowp_pack import bf16_bits
from backends.numba_cpu.convgemm import phase_geometry
from cuvil.explain import explain_model
from tests.test_precision_conv import _bound, _conv_model, _ort

CASES = {   # x shape, out channels, kernel, stride, pad, threads, target
    "7x7 stem, odd plane, 2 images": ((2, 3, 37, 29), 24, 7, 2, 3, 1, "native"),
    "7x7 stem, 2 threads": ((1, 3, 40, 40), 64, 7, 2, 3, 2, "native"),
    "7x7 stem, avx2 (widen)": ((1, 3, 23, 31), 16, 7, 2, 3, 1, "x86_64-avx2"),
    "5x5 stride 2, 2 threads": ((1, 3, 27, 21), 16, 5, 2, 2, 2, "native"),
    "5x5 stride 3, 5 channels": ((1, 5, 26, 25), 12, 5, 3, 0, 1, "native"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tap_pair_conv_is_within_the_derived_bound(case):
    x_shape, oc, k, stride, pad, threads, target = CASES[case]
    model, w, b = _conv_model(x_shape, oc, k, stride, pad, 1, False)
    x = np.random.default_rng(2).standard_normal(x_shape).astype(np.float32)
    lib = cuvil.compile(model, precision="bf16", disable_passes=["winograd"], threads=threads, target=target)
    got, want = lib.run({"x": x})["y"], _ort(model, {"x": x})
    bound = _bound(x, w, b, None, stride, pad, 1, "bf16")
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    assert np.max(np.abs(got - want)) > 1e-3 * np.max(bound)   # the operands really were rounded
    info = explain_model(model, precision="bf16", disable_passes=["winograd"], threads=threads, target=target)
    symbols = [kernel.symbol for kernel in info.kernels]
    assert any("cvt_tappairs_bf16" in s for s in symbols), symbols


def _plan(C, k, stride, pad, H, W):
    OH, OW = (H + 2 * pad - k) // stride + 1, (W + 2 * pad - k) // stride + 1
    _, PH, PW, ldb, offsets, _ = phase_geometry((k, k), (stride, stride), (1, 1), pad, W, OH, OW)
    return convtappairs.plan(C, 1, offsets, ldb, PH, PW), len(offsets)


def test_the_resnet_stem_sums_148_products_per_output_not_196():
    pairs, taps = _plan(3, 7, 2, 3, 224, 224)
    assert len(pairs.offsets) == 74 and taps == 49   # 2 x 74 = 148 >= 147 products, was 2 pairs x 49 taps
    elements = [e for pair in pairs.elements for e in pair if e is not None]
    assert sorted(elements) == [(c, t) for c in range(3) for t in range(49)]   # each product exactly once


def test_the_weights_follow_the_pairs():
    pairs, _ = _plan(3, 7, 2, 3, 30, 30)
    W = np.random.default_rng(0).standard_normal((5, 3, 7, 7)).astype(np.float32)
    got = pairs.weights(W)
    for t, pair in enumerate(pairs.elements):
        for h, element in enumerate(pair):
            want = W.reshape(5, 3, 49)[:, element[0], element[1]] if element else 0.0
            np.testing.assert_array_equal(got[:, h, t], want)


@pytest.mark.parametrize("C", [2, 4, 64])
def test_even_channel_counts_keep_channel_pairs(C):
    assert _plan(C, 7, 2, 3, 64, 64)[0] is None


def test_a_3x3_stem_keeps_channel_pairs():
    assert _plan(3, 3, 2, 1, 224, 224)[0] is None   # MobileNetV2's: convtappairs.MIN_TAPS


def test_a_grouped_conv_keeps_channel_pairs():
    OH = OW = 16
    _, PH, PW, ldb, offsets, _ = phase_geometry((7, 7), (2, 2), (1, 1), 3, 32, OH, OW)
    assert convtappairs.plan(3, 1, offsets, ldb, PH, PW) is not None
    assert convtappairs.plan(3, 2, offsets, ldb, PH, PW) is None


@pytest.mark.parametrize("cpu", ["host-avx512bf16", "haswell"])
@pytest.mark.parametrize("stride", [2, 3])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 112])
def test_the_strided_pair_copy_is_exact_and_stays_in_its_rows(cpu, stride, n):
    """lowp.StridedPairCopySpec (a strided conv's bf16 phase-image rows): dst[2j + h] = row_h[stride j]
    bit for bit, nothing stored outside dst[0:2n] (whole vectors, then the masked rest)."""
    from backends.numba_cpu.lowp import StridedPairCopySpec
    from tests.test_lowp_kernels import kernel
    fn = kernel(StridedPairCopySpec(stride), cpu)
    gap = stride * n + 7
    src = np.random.default_rng(n).integers(0, 1 << 16, size=3 + 2 * gap, dtype=np.uint16)
    dst = np.full(2 * n + 4, 0xABCD, np.uint16)
    fn(src.ctypes.data, 3, gap, dst.ctypes.data, 2, n)
    rows = [src[3 + h * gap:3 + h * gap + stride * n:stride] for h in (0, 1)]
    assert (dst[2:-2] == np.stack(rows, axis=1).ravel()).all()
    assert (dst[:2] == 0xABCD).all() and (dst[-2:] == 0xABCD).all()


def _pooled_conv_model(x_shape, oc, k, stride, pad):
    """MaxPool (3x3, stride 1: its output is stored in bf16, rounding commutes with the max) then
    Conv + Relu: the conv reads a bf16 X, its phase images copied by convgemm.padded_narrow_input_kernel."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(3)
    C = x_shape[1]
    w = (rng.standard_normal((oc, C, k, k)) / np.sqrt(C * k * k)).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Conv", ["p", "w", "b"], ["h"], strides=[stride] * 2, pads=[pad] * 4),
             helper.make_node("Relu", ["h"], ["y"])]
    graph = helper.make_graph(nodes, "pooled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w, b


STRIDED_BF16_X = {   # x shape, out channels, kernel, stride, pad, threads, target
    "3x3 stride 2, odd plane": ((1, 32, 29, 23), 48, 3, 2, 1, 1, "native"),
    "1x1 stride 2, 2 threads": ((2, 64, 28, 28), 32, 1, 2, 0, 2, "native"),
    "3x3 stride 2, odd channels, avx2": ((1, 21, 17, 19), 16, 3, 2, 1, 1, "x86_64-avx2"),
}


@pytest.mark.parametrize("case", list(STRIDED_BF16_X))
def test_a_strided_conv_reading_bf16_is_within_the_derived_bound(case):
    # The conv's X is bf16(maxpool(x)) = maxpool(bf16(x)); the bound is test_precision_conv's over
    # |maxpool(x)| (computed by onnxruntime), which the conv rounds to bf16 anyway.
    from onnx import helper
    x_shape, oc, k, stride, pad, threads, target = STRIDED_BF16_X[case]
    model, w, b = _pooled_conv_model(x_shape, oc, k, stride, pad)
    x = np.random.default_rng(4).standard_normal(x_shape).astype(np.float32)
    lib = cuvil.compile(model, precision="bf16", disable_passes=["winograd"], threads=threads, target=target)
    got, want = lib.run({"x": x})["y"], _ort(model, {"x": x})
    pool = helper.make_model(helper.make_graph([model.graph.node[0]], "pool", list(model.graph.input),
                                               [helper.make_tensor_value_info("p", 1, None)]),
                             opset_imports=[helper.make_opsetid("", 17)])
    bound = _bound(_ort(pool, {"x": x}), w, b, None, stride, pad, 1, "bf16")
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    assert np.max(np.abs(got - want)) > 1e-3 * np.max(bound)
    info = explain_model(model, precision="bf16", disable_passes=["winograd"], threads=threads, target=target)
    assert any("convpad_pairs16" in kernel.symbol for kernel in info.kernels), [k.symbol for k in info.kernels]


def _stem_pool_model(x_shape, oc):
    """ResNet's stem: Conv 7x7 / 2 (bias) + Relu, then MaxPool 3x3 / 2: the conv's Y is a bf16
    activation (MaxPool reads it), the case where the tap-pair conv writes it from its registers."""
    model, w, b = _conv_model(x_shape, oc, 7, 2, 3, 1, False)
    graph = model.graph
    graph.node[-1].output[0] = "h_relu"
    graph.node.append(helper.make_node("MaxPool", ["h_relu"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                                       pads=[1, 1, 1, 1]))
    return model, w, b


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bf16_stem_output_is_rounded_once_from_the_float32_sums(threads):
    """The stem conv writes its bf16 Y from the micro-kernel's registers (ukernel_lowp.LowpOut16CalledSpec,
    no float32 tile: no `ctile` buffer). Exact reference: the same conv built with its float32 Y as
    the graph output (same products, same float32 sums, bias and Relu in the same order), rounded
    once to bf16 (RNE, a float32 subnormal to zero as `vcvtneps2bf16` does) and max-pooled in numpy;
    and onnxruntime float32 within the derived bound: the conv's (test_precision_conv), plus the
    rounding's u |Y|, through MaxPool (1-Lipschitz: the window's largest bound)."""
    x_shape, oc = (1, 3, 46, 38), 24
    model, w, b = _stem_pool_model(x_shape, oc)
    conv_only, _, _ = _conv_model(x_shape, oc, 7, 2, 3, 1, False)
    x = np.random.default_rng(5).standard_normal(x_shape).astype(np.float32)
    lib = cuvil.compile(model, precision="bf16", threads=threads)
    got = lib.run({"x": x})["y"]
    y32 = cuvil.compile(conv_only, precision="bf16", threads=threads).run({"x": x})["y"]
    y32 = np.where(np.abs(y32) < 2.0 ** -126, np.float32(0), y32)
    y16 = (bf16_bits(y32).astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(got, _maxpool64(y16).astype(np.float32))
    conv_bound = _bound(x, w, b, None, 2, 3, 1, "bf16")
    y_ort = _ort(conv_only, {"x": x}).astype(np.float64)
    bound = _maxpool64(conv_bound + 2.0 ** -8 * (np.abs(y_ort) + conv_bound), pad_value=0.0)
    want = _ort(model, {"x": x})
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    info = explain_model(model, precision="bf16", threads=threads)
    assert not any("ctile" in str(buffer[-1]) for buffer in info.buffers), info.buffers


def _maxpool64(y, pad_value=-np.inf):
    """MaxPool 3x3 / 2, pads 1, in float64 (NCHW)."""
    N, C, H, W = y.shape
    yp = np.pad(y.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=pad_value)
    OH, OW = (H + 2 - 3) // 2 + 1, (W + 2 - 3) // 2 + 1
    windows = [yp[:, :, i:i + 2 * OH:2, j:j + 2 * OW:2] for i in range(3) for j in range(3)]
    return np.max(windows, axis=0)
