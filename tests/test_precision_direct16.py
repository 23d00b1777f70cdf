"""1x1 convs that write their 16-bit output from the micro-kernel's registers
(backends/numba_cpu/ukernel_lowp.py LowpOut16Spec, convgemm._direct16_body): bias, a 16-bit
residual and Relu added in float32, the sum rounded once to bf16 / fp16. Compared with
onnxruntime in float32, stage by stage, with test_precision_activations.py's propagated bound:

    conv reading h (|h - h_ort| <= b), K = channels x taps:
        (2u + u^2 + 2 gamma(K + 3)) (|W| * (|h_ort| + b) + |bias| + |R| + b_R + u (|R| + b_R))
        + |W| * b + b_R + u (|R| + b_R)

u = 2^-8 (bf16) or 2^-11 (fp16): each operand rounded once to 16 bits (2u + u^2 per product);
the float32 sums over K products plus bias and residual (gamma(K + 3), twice: ours and
onnxruntime's); a residual stored in 16 bits rounded once (u |R|); Relu is 1-Lipschitz. The
output's own rounding to 16 bits is the next stage's operand rounding (its 2u), and the last
stage writes float32 (no rounding).

Odd sizes: 5 input channels (bf16 pairs repeat the last one), 21 channels into a 1x1 conv (an
odd pair count: through its phase image) and 17 out (a partial panel of output rows), an 11 x 13
plane (143 outputs: a masked last tile, whose loads of the in-place X are masked), a stride-2 1x1
conv onto 6 x 7; at 1 and 2 threads.
"""
import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil.explain import explain_model
from tests.helpers import make_model, run_ort
from tests.test_precision_activations import _conv_bound, _weights
from tests.test_precision_conv import U

F = np.float32


def _conv(x, w, b, y, s, p):
    return helper.make_node("Conv", [x, w, b], [y], strides=[s, s], pads=[p] * 4)


def _staged(inits, stages, ins, outs, C, H, W):
    """The whole chain as one model and each stage as a model of its own (what onnxruntime runs
    stage by stage: the references the propagated bounds start from)."""
    used = lambda nodes: {k: v for k, v in inits.items() if any(k in n.input for n in nodes)}
    model = make_model([n for s in stages for n in s], [("x", F, [1, C, H, W])], [("y", F, None)], inits)
    parts = [make_model(s, [(i, F, None)], [(o, F, None)], used(s)) for s, i, o in zip(stages, ins, outs)]
    return model, parts


def _ort_stages(parts, x):
    """x and onnxruntime's float32 output of every stage, each stage fed the previous one's."""
    ort = [x]
    for part in parts:
        ort.append(next(iter(run_ort(part, {part.graph.input[0].name: ort[-1]}).values())))
    return ort


def _assert_within(got, y, bound_y):
    """|got - y| within the bound everywhere, and the 16-bit path ran: float32 throughout stays
    within ~gamma(K) ~ 2^-18 of the magnitudes."""
    err = np.abs(got.astype(np.float64) - y)
    assert np.all(err <= bound_y), float(np.max(err - bound_y))
    assert np.max(err) > 2.0 ** -18 * np.max(np.abs(y)), (np.max(err), np.max(np.abs(y)))


def _chain(C, D, E, G, H, W):
    """conv1 (3x3, Relu) -> conv2 (1x1) + h1 + Relu -> conv3 (1x1 stride 2, no activation) ->
    conv4 (1x1, Relu) -> conv5 (3x3) -> y. h1..h4 are stored in 16 bits; conv2, conv3 and conv4
    write them directly; conv2 (stride 1, D even) reads h1 in place, conv4 (E odd) and the
    strided conv3 through their phase images."""
    w1, b1 = _weights(D, C, 3, 11)
    w2, b2 = _weights(D, D, 1, 12)
    w3, b3 = _weights(E, D, 1, 13)
    w4, b4 = _weights(G, E, 1, 14)
    w5, b5 = _weights(8, G, 3, 15)
    inits = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3, "w4": w4, "b4": b4, "w5": w5, "b5": b5}
    stages = [
        [_conv("x", "w1", "b1", "c1", 1, 1), helper.make_node("Relu", ["c1"], ["h1"])],
        [_conv("h1", "w2", "b2", "c2", 1, 0), helper.make_node("Add", ["c2", "h1"], ["s2"]),
         helper.make_node("Relu", ["s2"], ["h2"])],
        [_conv("h2", "w3", "b3", "h3", 2, 0)],
        [_conv("h3", "w4", "b4", "c4", 1, 0), helper.make_node("Relu", ["c4"], ["h4"])],
        [_conv("h4", "w5", "b5", "y", 1, 1)],
    ]
    ins, outs = ["x", "h1", "h2", "h3", "h4"], ["h1", "h2", "h3", "h4", "y"]
    model, parts = _staged(inits, stages, ins, outs, C, H, W)
    return model, parts, (w1, b1, w2, b2, w3, b3, w4, b4, w5, b5)


@pytest.mark.parametrize("precision,threads,target", [("bf16", 1, "native"), ("bf16", 2, "native"),
                                                      ("fp16", 1, "native"), ("bf16", 1, "x86_64-avx2")])
def test_1x1_convs_writing_16_bits_from_registers_are_within_the_propagated_bound(precision, threads, target):
    # (x86_64-avx2: bf16 by the "widen" method, 8 lanes, the planar rows widened by shifts)
    C, D, E, G, H, W = 5, 30, 21, 17, 11, 13
    model, parts, (w1, b1, w2, b2, w3, b3, w4, b4, w5, b5) = _chain(C, D, E, G, H, W)
    x = np.random.default_rng(0).standard_normal((1, C, H, W)).astype(F)
    u = U[precision]
    ort = _ort_stages(parts, x)
    _, h1, h2, h3, h4, y = ort
    bound1 = _conv_bound(x, 0.0, w1, b1, 1, u)
    bound2 = _conv_bound(h1, bound1, w2, b2, 1, u, residual=h1, b_res=bound1, pad=0)
    bound3 = _conv_bound(h2, bound2, w3, b3, 2, u, pad=0)
    bound4 = _conv_bound(h3, bound3, w4, b4, 1, u, pad=0)
    bound_y = _conv_bound(h4, bound4, w5, b5, 1, u)

    lib = cuvil.compile(model, precision=precision, threads=threads, target=target)
    got = lib.run({"x": x})["y"]
    assert got.dtype == np.float32 and got.shape == y.shape
    _assert_within(got, y, bound_y)

    # h1..h3 are 16-bit tensors; the 3x3 conv1 keeps its float32 tile slots (passes over the
    # channels), the 1x1 convs have none: they wrote their 16-bit outputs themselves
    info = explain_model(model, precision=precision, threads=threads, target=target)
    own = {b[4]: b[1] for b in info.buffers if "__" not in b[4]}
    assert set(own.values()) <= {2 * h.size for h in (h1, h2, h3, h4)}, own
    tiles = sorted(b[4] for b in info.buffers if b[4].startswith("__ctile__"))
    convs = list(dict.fromkeys(k.node for k in info.kernels if k.op in ("Conv", "FusedConv")))
    assert len(convs) == 5 and len(tiles) == 1 and tiles[0].endswith(convs[0]), (tiles, convs)
    # bf16: conv2 reads h1 in place (no phase image of its own); every other conv makes one
    phases = {k.node for k in info.kernels if k.symbol.split("_")[1].startswith("convpad")}
    assert phases == (set(convs) - {convs[1]} if precision == "bf16" else set(convs)), (phases, convs)


def _small_chain(C, D, E, H, W):
    """conv1 (3x3, Relu) -> conv2 (1x1) + h1 + Relu -> conv3 (1x1 stride 2, Relu) -> conv4 (3x3) -> y
    on a plane of at most 64 pixels: conv2 and conv3 run as the transposed GEMM (conv1x1t.py)."""
    w1, b1 = _weights(D, C, 3, 21)
    w2, b2 = _weights(D, D, 1, 22)
    w3, b3 = _weights(E, D, 1, 23)
    w4, b4 = _weights(8, E, 3, 24)
    inits = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3, "w4": w4, "b4": b4}
    stages = [
        [_conv("x", "w1", "b1", "c1", 1, 1), helper.make_node("Relu", ["c1"], ["h1"])],
        [_conv("h1", "w2", "b2", "c2", 1, 0), helper.make_node("Add", ["c2", "h1"], ["s2"]),
         helper.make_node("Relu", ["s2"], ["h2"])],
        [_conv("h2", "w3", "b3", "c3", 2, 0), helper.make_node("Relu", ["c3"], ["h3"])],
        [_conv("h3", "w4", "b4", "y", 1, 1)],
    ]
    ins, outs = ["x", "h1", "h2", "h3"], ["h1", "h2", "h3", "y"]
    model, parts = _staged(inits, stages, ins, outs, C, H, W)
    return model, parts, (w1, b1, w2, b2, w3, b3, w4, b4)


@pytest.mark.parametrize("threads,target", [(1, "native"), (2, "native"), (1, "x86_64-avx2")])
def test_small_plane_1x1_convs_as_the_transposed_gemm_are_within_the_propagated_bound(threads, target):
    # 35 pixels (7-pixel tiles), 34 channels (17 pairs), 52 outputs (a 48-channel panel and a
    # masked one of 4), a stride-2 conv onto 3 x 4 (12 pixels: 6-pixel tiles); bound as above
    C, D, E, H, W = 6, 34, 52, 5, 7
    model, parts, (w1, b1, w2, b2, w3, b3, w4, b4) = _small_chain(C, D, E, H, W)
    x = np.random.default_rng(1).standard_normal((1, C, H, W)).astype(F)
    u = U["bf16"]
    ort = _ort_stages(parts, x)
    _, h1, h2, h3, y = ort
    bound1 = _conv_bound(x, 0.0, w1, b1, 1, u)
    bound2 = _conv_bound(h1, bound1, w2, b2, 1, u, residual=h1, b_res=bound1, pad=0)
    bound3 = _conv_bound(h2, bound2, w3, b3, 2, u, pad=0)
    bound_y = _conv_bound(h3, bound3, w4, b4, 1, u)

    got = cuvil.compile(model, precision="bf16", threads=threads, target=target).run({"x": x})["y"]
    _assert_within(got, y, bound_y)

    # conv2 and conv3 wrote 16 bits themselves (no float32 tile slots) and read their phase images
    # (conv2 would read h1 in place on convgemm's tiles); so did conv1, a 3x3 conv onto the same
    # 35-pixel plane (convtaps_t.py): no float32 tile slots at all
    info = explain_model(model, precision="bf16", threads=threads, target=target)
    convs = list(dict.fromkeys(k.node for k in info.kernels if k.op in ("Conv", "FusedConv")))
    tiles = sorted(b[4] for b in info.buffers if b[4].startswith("__ctile__"))
    assert len(convs) == 4 and not tiles, (tiles, convs)
    phases = {k.node for k in info.kernels if k.symbol.split("_")[1].startswith("convpad")}
    assert {convs[1], convs[2]} <= phases, (phases, convs)


@pytest.mark.parametrize("threads", [1, 2])
def test_transposed_gemm_writes_what_the_conv_gemm_tiles_write_bit_for_bit(threads, tmp_path, monkeypatch):
    # conv1x1t's tile epilogue (LowpOut16Spec.c_transposed: the 7-pixel row vectors transposed in
    # registers, each output channel's pixels loaded and stored as one masked run) against
    # convgemm's tiles on the same 7 x 7 convs (conv2 with its 16-bit residual, conv3 at stride 2
    # onto 4 x 4): the same float32 sums, bias, residual, Relu and rounding, so the same bits
    from backends.numba_cpu import conv1x1t
    C, D, E, H, W = 6, 34, 52, 7, 7
    model, _, _ = _small_chain(C, D, E, H, W)
    x = np.random.default_rng(2).standard_normal((1, C, H, W)).astype(F)
    transposed = cuvil.compile(model, precision="bf16", threads=threads).run({"x": x})["y"]
    monkeypatch.setattr(conv1x1t, "eligible", lambda *args: False)
    tiles = cuvil.compile(model, precision="bf16", threads=threads, cache_dir=tmp_path).run({"x": x})["y"]
    assert np.array_equal(transposed.view(np.uint32), tiles.view(np.uint32))
    assert not np.array_equal(transposed, 0 * transposed)


def _taps_chain(C, D, E, H, W):
    """conv1 (3x3, Relu) -> conv2 (3x3 stride 2, Relu) -> conv3 (3x3) + h2 + Relu -> conv4 (1x1) -> y:
    conv2 and conv3 write planes of at most 64 pixels, as the transposed GEMM with taps
    (convtaps_t.py); E odd keeps conv3 off the bf16 Winograd transforms."""
    w1, b1 = _weights(D, C, 3, 31)
    w2, b2 = _weights(E, D, 3, 32)
    w3, b3 = _weights(E, E, 3, 33)
    w4, b4 = _weights(8, E, 1, 34)
    inits = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": b3, "w4": w4, "b4": b4}
    stages = [
        [_conv("x", "w1", "b1", "c1", 1, 1), helper.make_node("Relu", ["c1"], ["h1"])],
        [_conv("h1", "w2", "b2", "c2", 2, 1), helper.make_node("Relu", ["c2"], ["h2"])],
        [_conv("h2", "w3", "b3", "c3", 1, 1), helper.make_node("Add", ["c3", "h2"], ["s3"]),
         helper.make_node("Relu", ["s3"], ["h3"])],
        [_conv("h3", "w4", "b4", "y", 1, 0)],
    ]
    ins, outs = ["x", "h1", "h2", "h3"], ["h1", "h2", "h3", "y"]
    model, parts = _staged(inits, stages, ins, outs, C, H, W)
    return model, parts, (w1, b1, w2, b2, w3, b3, w4, b4)


@pytest.mark.parametrize("threads,target", [(1, "native"), (2, "native"), (1, "x86_64-avx2")])
def test_small_plane_convs_with_taps_as_the_transposed_gemm_are_within_the_propagated_bound(threads, target):
    # 11 x 13 -> 6 x 7 (stride 2: 7-pixel rows) -> 6 x 7; 34 channels (17 pairs), 51 outputs (an odd
    # channel count, a 48-channel panel and a masked one of 3); bound as above
    C, D, E, H, W = 5, 34, 51, 11, 13
    model, parts, (w1, b1, w2, b2, w3, b3, w4, b4) = _taps_chain(C, D, E, H, W)
    x = np.random.default_rng(3).standard_normal((1, C, H, W)).astype(F)
    u = U["bf16"]
    ort = _ort_stages(parts, x)
    _, h1, h2, h3, y = ort
    bound1 = _conv_bound(x, 0.0, w1, b1, 1, u)
    bound2 = _conv_bound(h1, bound1, w2, b2, 2, u)
    bound3 = _conv_bound(h2, bound2, w3, b3, 1, u, residual=h2, b_res=bound2)
    bound_y = _conv_bound(h3, bound3, w4, b4, 1, u, pad=0)
    got = cuvil.compile(model, precision="bf16", threads=threads, target=target).run({"x": x})["y"]
    _assert_within(got, y, bound_y)


@pytest.mark.parametrize("threads", [1, 2])
def test_transposed_gemm_with_taps_writes_what_the_conv_gemm_tiles_write_bit_for_bit(threads, tmp_path, monkeypatch):
    # convtaps_t's tiles (an output row each, the taps shifting A) against convgemm's (the flat grid
    # on the lanes, passes over the channels through float32 tile slots): the same float32 sums in
    # the same order, bias, residual, Relu and one rounding, so the same bits
    from backends.numba_cpu import convtaps_t
    model, _, _ = _taps_chain(5, 34, 51, 11, 13)
    x = np.random.default_rng(4).standard_normal((1, 5, 11, 13)).astype(F)
    transposed = cuvil.compile(model, precision="bf16", threads=threads).run({"x": x})["y"]
    monkeypatch.setattr(convtaps_t, "eligible", lambda *args: False)
    tiles = cuvil.compile(model, precision="bf16", threads=threads, cache_dir=tmp_path).run({"x": x})["y"]
    assert np.array_equal(transposed.view(np.uint32), tiles.view(np.uint32))
