"""bf16 Winograd (backends/numba_cpu/winograd_bf16.py): a 3x3 stride-1 conv marked bf16 runs as
F(2x2, 3x3) with U and V rounded once to bf16, the batched GEMMs on the bf16 micro-kernel and every
sum in float32. Compared with onnxruntime in float32.

The bound is the module docstring's, computed here per tile in float64 (u = 2^-8, v = 2^-24,
gamma(n) = n v / (1 - n v)):

    S_M[xi, oc, tile] = sum_c (|G| |W[oc, c]| |G^T|)[xi] (|B^T| |d_c| |B|)[xi]      (d_c: the tile's patch)
    S = |A^T| S_M |A|                                          (per tile: the output positions' magnitudes)
    eta = 2u + u^2 + (1 + u)^2 gamma(2) + gamma(C) (1 + u)(1 + u + gamma(2))
    |Y - Y_ort| <= eta S + gamma(6) ((1 + eta) S + |b| + |R|) + gamma(9 C + 3) (|X| * |W| + |b| + |R|)

(the gamma(9 C + 3) term onnxruntime's own float32 sums; Relu is 1-Lipschitz), plus
9 * 2^-126 (1 + u) max_xi sum_c |U| where V is rounded by vcvtneps2bf16 (a subnormal V flushed to
zero: winograd_bf16.py's docstring). Whole models: cosine
similarity >= 0.999 to float32 on every output, as test_precision.py's.
"""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil.explain import explain_model
from tests.helpers import cosine

U, V32 = 2.0 ** -8, 2.0 ** -24
BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=np.float64)
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=np.float64)
G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=np.float64)


def _gamma(n):
    return n * V32 / (1 - n * V32)


def _direct_magnitude(x, w):
    """|X| * |W| (3x3, pad 1, stride 1) in float64."""
    N, C, H, W = x.shape
    xp = np.pad(np.abs(x).astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    y = np.zeros((N, w.shape[0], H, W))
    for kh in range(3):
        for kw in range(3):
            y += np.einsum("nchw,oc->nohw", xp[:, :, kh:kh + H, kw:kw + W], np.abs(w[:, :, kh, kw]).astype(np.float64))
    return y


def _winograd_magnitude(x, w):
    """S = |A^T| S_M |A| per 2x2 output tile, cropped to the output (float64)."""
    N, C, H, W = x.shape
    TH, TW = -(-H // 2), -(-W // 2)
    xp = np.zeros((N, C, 2 * TH + 2, 2 * TW + 2))
    xp[:, :, 1:H + 1, 1:W + 1] = np.abs(x)
    patches = np.stack([np.stack([xp[:, :, 2 * i:2 * i + 4, 2 * j:2 * j + 4] for j in range(TW)], 2)
                        for i in range(TH)], 2)                                     # N, C, TH, TW, 4, 4
    v = np.einsum("ik,nctukl,jl->nijctu", np.abs(BT), patches, np.abs(BT))        # |B^T| |d| |B|
    u = np.einsum("ik,ockl,jl->ijoc", np.abs(G), np.abs(w).astype(np.float64), np.abs(G))
    s_m = np.einsum("ijoc,nijctu->noijtu", u, v)
    s = np.einsum("ri,noijtu,qj->notruq", np.abs(AT), s_m, np.abs(AT))            # N, OC, TH, 2, TW, 2
    return s.reshape(N, w.shape[0], 2 * TH, 2 * TW)[:, :, :H, :W]


def _bound(x, w, b, r):
    C = x.shape[1]
    eta = 2 * U + U * U + (1 + U) ** 2 * _gamma(2) + _gamma(C) * (1 + U) * (1 + U + _gamma(2))
    s = _winograd_magnitude(x, w)
    extra = np.abs(b).astype(np.float64)[None, :, None, None] + (np.abs(r) if r is not None else 0)
    # V rounded by vcvtneps2bf16 (winoin_lanes "hw"): a subnormal V flushed, at most 2^-126 each,
    # times sum_c |U^| (U^ = U (1 + u)) in M, times the 3 x 3 ones of |A^T| . |A| in Y
    u_sum = np.einsum("ik,ockl,jl->ijo", np.abs(G), np.abs(w).astype(np.float64), np.abs(G)).max(axis=(0, 1))
    flush = 9 * 2.0 ** -126 * (1 + U) * u_sum[None, :, None, None]
    return eta * s + _gamma(6) * ((1 + eta) * s + extra) + _gamma(9 * C + 3) * (_direct_magnitude(x, w) + extra) \
        + flush


def _conv_model(x_shape, oc, residual, seed=0, second=False, skip=False):
    """Conv 3x3 pad 1 (+ bias) [+ Add(residual)] + Relu [+ a second such conv reading it, `skip`:
    plus its input, a bf16 activation, as a ResNet block's residual]; the model, W, b and the
    second conv's W (or None)."""
    rng = np.random.default_rng(seed)
    C = x_shape[1]
    w = (rng.standard_normal((oc, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    w2 = (rng.standard_normal((oc, oc, 3, 3)) / np.sqrt(9 * oc)).astype(np.float32) if second else None
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], name="conv", pads=[1] * 4)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    if residual:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [x_shape[0], oc, *x_shape[2:]]))
        nodes.append(helper.make_node("Add", ["h", "r"], ["z"]))
    nodes.append(helper.make_node("Relu", ["z" if residual else "h"], ["y1" if second else "y"]))
    if second:
        inits.append(numpy_helper.from_array(w2, "w2"))
        nodes.append(helper.make_node("Conv", ["y1", "w2", "b"], ["h2"], name="conv2", pads=[1] * 4))
        if skip:
            nodes.append(helper.make_node("Add", ["h2", "y1"], ["s2"]))
        nodes.append(helper.make_node("Relu", ["s2" if skip else "h2"], ["y"]))
    graph = helper.make_graph(nodes, "conv", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w, b, w2


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _feeds(x_shape, oc, residual):
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    if residual:
        feeds["r"] = rng.standard_normal((x_shape[0], oc, *x_shape[2:])).astype(np.float32)
    return feeds


def _labels(model, **kw):
    return [k.precision for k in explain_model(model, precision="bf16", **kw).kernels]


CASES = {   # x shape, out channels, residual, threads
    "32 -> 48 channels, 20x20": ((2, 32, 20, 20), 48, False, 1),
    # V and M over winograd_bf16.BAND_BYTES: three bands of tile rows, the last one partial
    "64 channels, odd 39x41 in 3 bands, residual": ((1, 64, 39, 41), 64, True, 2),
    "128 -> 96 channels, 9x11": ((1, 128, 9, 11), 96, False, 1),
    "256 channels, 7x7": ((1, 256, 7, 7), 256, True, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bf16_winograd_conv_is_within_the_derived_bound(case):
    x_shape, oc, residual, threads = CASES[case]
    model, w, b, _ = _conv_model(x_shape, oc, residual)
    feeds = _feeds(x_shape, oc, residual)
    lib = cuvil.compile(model, precision="bf16", threads=threads)
    got, want = lib.run(feeds)["y"], _ort(model, feeds)
    bound = _bound(feeds["x"], w, b, feeds.get("r"))
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    # the operands really were rounded to bf16: float32 would be ~100x closer than the bound
    assert np.max(np.abs(got - want)) > 1e-3 * np.max(bound)
    labels = _labels(model, threads=threads)
    assert "bf16 winograd F2 (dpbf16)" in labels or "bf16 winograd F2 (widen)" in labels, labels


def test_a_target_without_avx512_bf16_widens_the_pairs():
    """x86_64-avx2 has no vdpbf16ps: the same bf16 U and V, each pair widened to two float32 FMAs
    (ukernel_lowp "widen"; one rounding per product as vdpbf16ps, so the same bound)."""
    x_shape, oc = (1, 32, 13, 15), 48
    model, w, b, _ = _conv_model(x_shape, oc, True)
    feeds = _feeds(x_shape, oc, True)
    got, want = cuvil.compile(model, precision="bf16", target="x86_64-avx2").run(feeds)["y"], _ort(model, feeds)
    bound = _bound(feeds["x"], w, b, feeds["r"])
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    assert np.max(np.abs(got - want)) > 1e-3 * np.max(bound)
    assert "bf16 winograd F2 (widen)" in _labels(model, target="x86_64-avx2")


def test_f2_keeps_within_4x_of_the_direct_bf16_conv_error():
    """The choice of F(2x2, 3x3) over F(4x4, 3x3) in bf16 rests on this (module docstring): on a
    ResNet-style conv (post-Relu input) F2's max error against onnxruntime float32 is at most 4x
    the direct bf16 conv's (measured 1.5-1.7x)."""
    x_shape, oc = (1, 64, 28, 28), 64
    model, w, b, _ = _conv_model(x_shape, oc, False)
    x = np.maximum(_feeds(x_shape, oc, False)["x"], 0)
    want = _ort(model, {"x": x})
    wino = cuvil.compile(model, precision="bf16").run({"x": x})["y"]
    direct = cuvil.compile(model, precision="bf16", disable_passes=["winograd"]).run({"x": x})["y"]
    e_wino, e_direct = np.max(np.abs(wino - want)), np.max(np.abs(direct - want))
    assert 0 < e_wino <= 4 * e_direct, (e_wino, e_direct)


CHAINS = {   # x shape, threads, the second conv's residual (its own input, a bf16 activation)[, target]
    "32 channels 12x12": ((1, 32, 12, 12), 1, False),
    # rows of even length: Y and the residual as pair words; from 30 columns on the phases
    # copied in words (winograd_bf16._pad_words_kernel), odd rows: a partial last row of tiles
    "16 channels, odd 13 rows of 14, residual, 2 threads": ((1, 16, 13, 14), 2, True),
    "16 channels, odd 33 rows of 34, residual": ((1, 16, 33, 34), 1, True),
    # odd row length: the 16-bit phase copy and Y stores
    "48 channels 9x7, residual": ((1, 48, 9, 7), 1, True),
    # a 64-channel 40x40 plane: several bands (BAND_BYTES), residual, 2 threads
    "64 channels 40x40 in bands, residual, 2 threads": ((1, 64, 40, 40), 2, True),
    "256 channels 7x7, residual, 2 threads": ((1, 256, 7, 7), 2, True),
    # no vdpbf16ps: the same transforms, the GEMMs widened (ukernel_lowp "widen")
    "x86_64-avx2: 16 channels 33x34, residual": ((1, 16, 33, 34), 1, True, "x86_64-avx2"),
}


@pytest.mark.parametrize("case", list(CHAINS))
def test_bf16_activations_between_two_winograd_convs(case):
    """conv -> relu -> conv [+ its input] -> relu: the tensor between them is stored in bf16
    (assign_precision), the first WinoOut rounds it once on its store and the second conv's
    phases (and its residual) read it as bf16 pairs."""
    x_shape, threads, skip, *target = CHAINS[case]
    target = {"target": target[0]} if target else {}
    oc = x_shape[1]
    model, w, b, w2 = _conv_model(x_shape, oc, False, second=True, skip=skip)
    feeds = _feeds(x_shape, oc, False)
    got = cuvil.compile(model, precision="bf16", threads=threads, **target).run(feeds)["y"]
    want = _ort(model, feeds)
    labels = _labels(model, threads=threads, **target)
    assert labels.count("bf16 winograd F2 (X bf16)") == 1 and labels.count("bf16 winograd F2 (X float32)") == 1, labels
    # The second conv reads y1^, the first conv's output rounded once to bf16 on its store:
    # |y1^ - y1_ort| <= e1 = first + u (|y1_ort| + first), with `first` the first conv's bound plus
    # onnxruntime's float32 error once more (its y1 inside the whole model, not the one-conv model's).
    # The second conv is within its bound over magnitudes |y1_ort| + e1, plus |W2| * e1 carried.
    first_model, _, _, _ = _conv_model(x_shape, oc, False)
    y1 = _ort(first_model, feeds).astype(np.float64)
    first = _bound(feeds["x"], w, b, None) \
        + _gamma(9 * x_shape[1] + 3) * (_direct_magnitude(feeds["x"], w) + np.abs(b)[None, :, None, None])
    # (+ 2^-126: Y rounded by vcvtneps2bf16 on AVX512-BF16, winoout_plane.py / winoout_rows.py: a
    # subnormal flushed to zero)
    e1 = first + U * (np.abs(y1) + first) + 2.0 ** -126
    # with the skip, y1^ is the residual too: its magnitude in the bound, its error carried as is
    r1 = np.abs(y1) + e1 if skip else None
    bound = _bound(np.abs(y1) + e1, w2, b, r1) + _direct_magnitude(e1, w2) + (e1 if skip else 0)
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    # bf16 really was used: float32 all through would be ~2^-20 of the outputs, not u / 16 (the
    # chained bound, |W2| * e1 carried, is too loose at 256 channels for the 1e-3 * bound check)
    assert np.max(np.abs(got - want)) > U / 16 * np.max(np.abs(want))


def test_what_bf16_winograd_does_not_take():
    """An odd channel count (bf16 pairs channels) and a strided conv run as the direct bf16 conv;
    fp16 keeps winograd out of its pass list; a float32 build keeps F(4x4) float32 Winograd."""
    odd, _, _, _ = _conv_model((1, 15, 12, 12), 16, False)
    labels = _labels(odd)
    assert not any("winograd" in label for label in labels), labels
    assert any(label in ("bf16 (dpbf16)", "bf16 (widen)") for label in labels), labels
    from cuvil import pipeline
    assert "winograd" in pipeline.pass_list(2, precision="bf16")[0]
    assert "winograd" not in pipeline.pass_list(2, precision="fp16")[0]
    model, _, _, _ = _conv_model((1, 32, 20, 20), 32, False)
    assert not any("winograd" in label for label in _labels(model, disable_passes=["winograd"]))
    fp32 = [k.precision for k in explain_model(model).kernels]
    assert all(label == "" for label in fp32), fp32


# two builds of an 18-layer model, ~25 s: test_bf16_activations_between_two_winograd_convs is the
# default run's case of convs between bf16 activations
@pytest.mark.slow
def test_a_resnet18_shaped_model_in_bf16_winograd_keeps_its_outputs():
    pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.resnet((2, 2, 2, 2), width=16), {"x": (1, 3, 64, 64)})
    x = zoo.sample_input((1, 3, 64, 64))
    fp32 = cuvil.compile(model)
    bf16 = cuvil.compile(model, precision="bf16")
    name = fp32.output_names[0]
    want = fp32.run({fp32.input_names[0]: x})[name]
    assert cosine(bf16.run({bf16.input_names[0]: x})[name], want) >= 0.999
    labels = _labels(model)
    assert sum(label in ("bf16 winograd F2 (dpbf16)", "bf16 winograd F2 (widen)") for label in labels) >= 4, labels


def test_the_32_bit_lane_conversions_are_bf16_rne_bit_for_bit():
    """narrow.BF16_LANES (the transforms' rounding and widening on i32) gives bf16_rne's bits:
    random float32 patterns, ties, NaNs, infinities, subnormals, the largest finite values."""
    from backends.numba_cpu import narrow
    namespace = {}
    exec("import numpy as np\n" + narrow.BIT_HELPERS + narrow.BF16_RNE + narrow.BF16_LANES + '''
@njit
def run(x, y, pair, want, half, widened):
    for i in range(x.size):
        pair[i] = bf16_pair_rne(x[i], y[i])
        want[i] = np.uint32(bf16_rne(x[i]) | (bf16_rne(y[i]) << 16))
        half[i] = bf16_rne16(x[i])
        widened[i] = _f32_bits(pair_lo_f32(pair[i])) == _f32_bits(bf16_widen(half[i])) \\
            and _f32_bits(pair_hi_f32(pair[i])) == (pair[i] & 4294901760)
''', namespace)
    rng = np.random.default_rng(0)
    special = np.array([0, 0x80000000, 0x7f800000, 0xff800000, 0x7f800001, 0x7fbfffff, 0x7fffffff, 0xffffffff,
                        0x7fc00000, 0x00000001, 0x00008000, 0x00018000, 0x807fffff, 0x3f808000, 0x3f818000,
                        0x7f7fffff, 0x7f7f8000, 0xff7fffff], dtype=np.uint32)
    ties = (rng.integers(0, 1 << 16, 50_000).astype(np.uint32) << 16) | 0x8000
    bits = np.concatenate([special, ties, rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)])
    x, y = bits.view(np.float32), np.roll(bits, 5).view(np.float32)
    pair, want = np.zeros(x.size, np.uint32), np.zeros(x.size, np.uint32)
    half, widened = np.zeros(x.size, np.uint16), np.zeros(x.size, np.bool_)
    namespace["run"](x, y, pair, want, half, widened)
    assert np.array_equal(pair, want)
    assert np.array_equal(half, (want & 0xFFFF).astype(np.uint16))
    assert widened.all()


@pytest.mark.parametrize("C, streams", [(256, True), (128, False)])
def test_a_large_position_streams_its_u_far_ahead(C, streams):
    """A WinoGemm whose A (one position's U, C x C bf16) is over gemm.STREAM_A_BYTES prefetches it
    ukernel_lowp.LowpStreamedSpec.prefetch_a k pairs ahead (256 channels: 128 KB a position); a
    smaller one (128: 32 KB) keeps the plain micro-kernel. A prefetch changes no arithmetic: the
    256-channel 7x7 case of test_a_bf16_winograd_conv_is_within_the_derived_bound runs it against
    onnxruntime."""
    from backends.numba_cpu.gemm import STREAM_A_BYTES, Operand, uk_gemm_kernel
    assert (2 * C * C > STREAM_A_BYTES) == streams
    T, xs = 16, C // 2 * 16 + 16
    kernel, _ = uk_gemm_kernel("WinoGemm", C, T, C, (1, 16), Operand((0, C * C + 32), C, 1),
                               Operand((2 * 16 * xs, 2 * xs), 2 * T, 1), None, Operand((16 * xs, xs), T, 1),
                               a_panels=True, self_sized=False, lowp=("bf16", "dpbf16"), tile=(12, 32))
    assert ('"kind": "lowpstream"' in kernel.source) == streams
