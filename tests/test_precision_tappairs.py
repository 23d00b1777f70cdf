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

import cuvil
from backends.numba_cpu import convtappairs
from backends.numba_cpu.convgemm import phase_geometry
from cuvil.explain import explain_model
from tests.test_precision_conv import _bound, _conv_model, _ort

CASES = {   # x shape, out channels, kernel, stride, pad, threads, target
    "7x7 stem, odd plane, 2 images": ((2, 3, 37, 29), 24, 7, 2, 3, 1, "native"),
    "7x7 stem, 2 threads": ((1, 3, 40, 40), 64, 7, 2, 3, 2, "native"),
    "7x7 stem, avx2 (widen)": ((1, 3, 23, 31), 16, 7, 2, 3, 1, "x86_64-avx2"),
    "3x3 stride 2, 3 channels": ((1, 3, 33, 35), 32, 3, 2, 1, 1, "native"),
    "5x5 stride 2, 2 threads": ((1, 3, 27, 21), 16, 5, 2, 2, 2, "native"),
    "3x3 stride 3, 5 channels": ((1, 5, 20, 19), 12, 3, 3, 0, 1, "native"),
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


def test_a_grouped_conv_keeps_channel_pairs():
    OH = OW = 16
    _, PH, PW, ldb, offsets, _ = phase_geometry((3, 3), (2, 2), (1, 1), 1, 32, OH, OW)
    assert convtappairs.plan(3, 2, offsets, ldb, PH, PW) is None
