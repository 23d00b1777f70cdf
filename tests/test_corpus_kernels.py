"""The conv paths issue 27's corpus asked for, against onnxruntime: 1-D convs on the 2-D GEMM
kernels (conv1d.py), long-kernel / large-stride convs as im2col + a 1x1 conv (convim2col.py: the
STFT as a Conv1d, ViT's patch embedding), with epilogues and residuals, and the selection rule
between them. No timing here (benchmarks/corpus.py does that).

Tolerances: every output is a float32 sum of K = channels x taps products, which cuvil and
onnxruntime add in different orders. The rounding error of such a sum is at most about
K * u * sum|w x| (u = 2**-24, the float32 unit roundoff) and with independent roundings
typically sqrt(K) * u * sum|w x|; the weights and inputs here are standard normal (or scaled so),
so sum|w x| is within ~sqrt(K) of max|y|, and K * u * max|y| bounds the relative error we
compare: `tol(K) = 4 * K * u` (4: a margin for the epilogue's own roundings; K = 768 gives
1.8e-4, K = 9 gives 2.1e-6, below which we keep 1e-5 as the other conv tests do).
"""
import numpy as np
import pytest
from onnx import helper

from backends.numba_cpu import convim2col
from cuvil.ir import Value
from tests.helpers import assert_matches_ort, make_model, rand

U = 2.0 ** -24


def tol(k: int) -> float:
    return max(4 * k * U, 1e-5)


def families(model) -> list[str]:
    """The kernel families of the model's schedule after cuvil's passes (one thread)."""
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    from passes import resolve_passes, run_passes
    graph, _ = import_onnx(model)
    graph = run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"])
    return [c.kernel.family for c in lower(graph)]


def conv_model(x_shape, w_shape, bias=True, relu=False, residual=False, seed=0, **attrs):
    k = int(np.prod(w_shape[1:]))
    inits = {"w": (rand(*w_shape, seed=seed + 1) / np.sqrt(k)).astype(np.float32)}
    if bias:
        inits["b"] = rand(w_shape[0], seed=seed + 2)
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c"], **attrs)]
    inputs, feeds, last = [("x", np.float32, x_shape)], {"x": rand(*x_shape, seed=seed + 3)}, "c"
    if residual:
        from onnx.reference import ReferenceEvaluator
        y_shape = ReferenceEvaluator(make_model(nodes, inputs, [("c", np.float32, None)], inits)).run(None, feeds)[0].shape
        inputs.append(("r", np.float32, y_shape))
        feeds["r"] = rand(*y_shape, seed=seed + 4)
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        last = "s"
    if relu:
        nodes.append(helper.make_node("Relu", [last], ["y"]))
        last = "y"
    return make_model(nodes, inputs, [(last, np.float32, None)], inits), feeds


@pytest.mark.parametrize("x_shape,w_shape,attrs,extra", [
    ((2, 1, 2000), (258, 1, 256), dict(strides=[128]), dict(bias=False)),                # STFT, batch 2, 14 frames
    ((1, 2, 300), (40, 2, 80), dict(strides=[10], pads=[35, 35]), dict(relu=True)),      # padded, 2 channels
    ((1, 1, 700), (32, 1, 100), dict(strides=[7], dilations=[2]), dict(residual=True, relu=True)),
])
def test_long_kernel_conv1d_as_im2col_gemm(x_shape, w_shape, attrs, extra):
    model, feeds = conv_model(x_shape, w_shape, **attrs, **extra)
    assert "Im2col" in families(model)
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))))


@pytest.mark.parametrize("x_shape,w_shape,attrs,extra", [
    ((1, 1, 1024), (258, 1, 256), dict(strides=[128]), {}),                              # STFT: 7 frames
    ((1, 1, 1100), (258, 1, 256), dict(strides=[128]), dict(bias=False, relu=True)),     # frames end before x does
    ((1, 1, 800), (96, 1, 100), dict(strides=[100]), dict(relu=True)),                   # 8 frames, 2 whole panels
])
def test_stft_frames_read_in_place(x_shape, w_shape, attrs, extra):
    """A one-channel 1-D conv without padding is one Conv kernel (convim2col._frames_in_place): its
    micro-kernel broadcasts the frames' taps from x at the hop's stride, no Im2col copy."""
    from backends.numba_cpu.registry import lower
    from backends.numba_cpu.ukernel import specs_in
    from cuvil.frontends.onnx import import_onnx
    from passes import resolve_passes, run_passes
    model, feeds = conv_model(x_shape, w_shape, **attrs, **extra)
    graph, _ = import_onnx(model)
    calls = lower(run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"]))
    assert [c.kernel.family for c in calls] == ["Conv"]
    assert {spec.a_is for spec in specs_in(calls[0].kernel.source).values()} == {attrs["strides"][0]}
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))))
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))), threads=2)


@pytest.mark.parametrize("x_shape,w_shape,attrs,extra", [
    ((1, 3, 224, 224), (192, 3, 16, 16), dict(strides=[16, 16]), {}),                  # ViT-tiny patch embedding
    ((2, 3, 64, 48), (64, 3, 8, 8), dict(strides=[8, 8]), dict(relu=True)),             # batch 2, 8x6 patches
    ((1, 4, 40, 40), (48, 4, 9, 9), dict(strides=[4, 4], pads=[4, 4, 4, 4]), dict(residual=True)),  # overlapping
])
def test_patch_embedding_as_im2col_gemm(x_shape, w_shape, attrs, extra):
    model, feeds = conv_model(x_shape, w_shape, **attrs, **extra)
    assert families(model)[0] == "Im2col"
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))))


@pytest.mark.parametrize("x_shape,w_shape,attrs,extra", [
    ((1, 64, 200), (64, 64, 3), dict(pads=[1, 1]), dict(relu=True)),                    # a TCN layer
    ((2, 80, 100), (96, 80, 3), dict(pads=[1, 1], strides=[2]), {}),                     # Whisper's second conv
    ((1, 48, 120), (64, 48, 5), dict(pads=[4, 4], dilations=[2]), dict(residual=True)),
])
def test_conv1d_on_the_2d_gemm_kernels(x_shape, w_shape, attrs, extra):
    model, feeds = conv_model(x_shape, w_shape, **attrs, **extra)
    assert "Im2col" not in families(model)
    assert "ConvPad" in families(model)     # the 2-D phase images: the conv runs as 2-D of one row
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))))


@pytest.mark.parametrize("x_shape,w_shape,attrs,extra", [
    ((8, 1, 512), (258, 1, 256), dict(strides=[128]), dict(bias=False)),                 # VAD's STFT: 3 frames x 8
    ((8, 129, 3), (128, 129, 3), dict(pads=[1, 1]), dict(relu=True)),                    # VAD's encoder conv
    ((8, 512, 1, 1), (256, 512, 1, 1), {}, dict(relu=True)),                             # 1x1 on pooled features
    ((3, 64, 5, 4), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2]), {}),        # 3 x 2 positions, batch 3
])
def test_batch_folded_into_the_gemm_columns(x_shape, w_shape, attrs, extra):
    model, feeds = conv_model(x_shape, w_shape, **attrs, **extra)
    assert families(model)[0] == "Im2col" and families(model)[-1] == "Unfold"
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))))


def test_batch_not_folded_with_a_residual_or_many_positions():
    # A residual is laid out like Y, not like the folded result; 8 x 8 positions fill the lanes.
    model, feeds = conv_model((8, 129, 3), (128, 129, 3), pads=[1, 1], residual=True)
    assert "Unfold" not in families(model)
    assert_matches_ort(model, feeds, tol=tol(129 * 3))
    model, feeds = conv_model((4, 32, 8, 8), (32, 32, 3, 3), pads=[1, 1, 1, 1])
    assert not {"Im2col", "Unfold"} & set(families(model))


def _values(x_shape, w_shape, y_shape):
    return (Value("x", np.dtype(np.float32), x_shape), Value("w", np.dtype(np.float32), w_shape, np.zeros(w_shape)),
            None, Value("y", np.dtype(np.float32), y_shape))


@pytest.mark.parametrize("x_shape,w_shape,y_shape,kernel,strides,fires", [
    ((1, 1, 1, 1024), (258, 1, 1, 256), (1, 258, 1, 7), [1, 256], [1, 128], True),      # STFT: 256 taps
    ((1, 3, 224, 224), (192, 3, 16, 16), (1, 192, 14, 14), [16, 16], [16, 16], True),    # patch: 256 phases
    ((1, 64, 56, 56), (64, 64, 3, 3), (1, 64, 56, 56), [3, 3], [1, 1], False),           # must not fire: 3x3
    ((1, 3, 224, 224), (64, 3, 7, 7), (1, 64, 112, 112), [7, 7], [2, 2], False),         # ResNet stem: 49 taps
    ((1, 16, 8, 8), (16, 16, 9, 9), (1, 16, 8, 8), [9, 9], [1, 1], True),                # 81 taps
    ((8, 129, 1, 5), (128, 129, 1, 3), (8, 128, 1, 3), [1, 3], [1, 1], True),            # 3 positions x 8: folds
    ((1, 129, 1, 5), (128, 129, 1, 3), (1, 128, 1, 3), [1, 3], [1, 1], False),           # batch 1: nothing to fold
    ((4, 384, 9, 9), (384, 384, 3, 3), (4, 384, 7, 7), [3, 3], [1, 1], False),           # 49 positions x 4: 1.23x
    ((4, 96, 1, 1), (4, 96, 1, 1), (4, 4, 1, 1), [1, 1], [1, 1], False),                 # an SE squeeze: too small
])
def test_selection_rule(x_shape, w_shape, y_shape, kernel, strides, fires):
    X, W, B, Y = _values(x_shape, w_shape, y_shape)
    assert convim2col.prefer(X, W, B, Y, 1, kernel, strides, [1, 1]) is fires


def resize_model(x_shape, scales, opset=17, mode="nearest", **attrs):
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode, **attrs)
    return make_model([node], [("x", np.float32, x_shape)], [("y", np.float32, None)],
                      {"scales": np.asarray(scales, dtype=np.float32)}, opset=opset), {"x": rand(*x_shape)}


# A nearest upsample copies elements: cuvil must equal onnxruntime exactly (tol 0).
@pytest.mark.parametrize("x_shape,scales,attrs", [
    ((1, 64, 20, 20), [1, 1, 2, 2], dict(coordinate_transformation_mode="asymmetric", nearest_mode="floor")),  # torch
    ((2, 8, 5, 7), [1, 1, 4, 4], dict()),                                     # half_pixel, round_prefer_floor
    ((1, 3, 6, 5), [1, 1, 3, 2], dict(coordinate_transformation_mode="asymmetric", nearest_mode="floor")),
    ((1, 4, 9), [1, 1, 8], dict(coordinate_transformation_mode="asymmetric", nearest_mode="floor")),        # 1-D
])
def test_nearest_integer_upsample_is_a_copy(x_shape, scales, attrs):
    model, feeds = resize_model(x_shape, scales, **attrs)
    assert families(model) == ["Resize"]
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    graph, _ = import_onnx(model)
    assert "acc" not in lower(graph)[0].kernel.source     # the copy, not the weighted taps
    assert_matches_ort(model, feeds, tol=0.0)


def test_fractional_or_linear_resize_keeps_the_tables():
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    for model, feeds in (resize_model((1, 2, 6, 6), [1, 1, 1.5, 1.5]),
                         resize_model((1, 2, 6, 6), [1, 1, 2, 2], mode="linear")):
        graph, _ = import_onnx(model)
        assert "acc" in lower(graph)[0].kernel.source
        # weighted taps summed in float64 then rounded once to float32: within one float32 rounding
        assert_matches_ort(model, feeds, tol=2 * U)


@pytest.mark.parametrize("T", [250, 256])
def test_attention_rows_off_the_1kb_stride(T):
    """Whisper's 250 tokens: rows of scores padded to 256 floats would be 1 KB apart; attention.py
    pads them one vector more. Sums of S = T products of P (in [0, 1], summing to 1) by V, and of
    D = 64 products for the scores: tol(T)."""
    from tests.test_attention import heads
    model, feeds = heads(T=T, S=T, H=2, D=64)
    assert "FusedAttention" in families(model)
    assert_matches_ort(model, feeds, tol=tol(T))


# Depthwise convs with the channels in the lanes (dwlanes.py): K = KH * KW products per output.
def depthwise_model(C, H, Wd, k, N=1, pads=None, bias=True, relu=False, seed=0):
    pads = pads if pads is not None else [k // 2] * 4
    return conv_model((N, C, H, Wd), (C, 1, k, k), bias=bias, relu=relu, seed=seed, group=C, kernel_shape=[k, k],
                      pads=pads)


def lowered_kernels(model, threads=1):
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    from passes import resolve_passes, run_passes
    graph, _ = import_onnx(model)
    graph = run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"])
    return [c.kernel for c in lower(graph, threads) if hasattr(c, "kernel")]


@pytest.mark.parametrize("C,H,Wd,k,extra", [
    (384, 7, 7, 7, {}),                                   # ConvNeXt's last stage: a plane narrower than a row kernel's
    (192, 14, 14, 7, dict(N=2)),                          # two images
    (40, 9, 11, 7, dict(bias=False)),                     # a partial block of 8 channels, a plane not square
    (48, 56, 56, 7, {}),                                  # ConvNeXt's first stage: rows in 4 pieces of 14
    (32, 8, 64, 7, dict(pads=[1, 2, 5, 4])),              # asymmetric pads, 64 wide: pieces of 16
    (96, 7, 7, 3, {}),                                    # 3 x 3 taps on a narrow plane
])
def test_depthwise_channels_in_lanes(C, H, Wd, k, extra):
    model, feeds = depthwise_model(C, H, Wd, k, **extra)
    assert any("cuvil_dwlanes" in kernel.source for kernel in lowered_kernels(model))
    assert_matches_ort(model, feeds, tol=tol(k * k))


@pytest.mark.parametrize("target", ["x86_64-avx2", "generic"])
def test_depthwise_channels_in_lanes_narrower_targets(target):
    model, feeds = depthwise_model(40, 7, 9, 7)   # two vectors of 8 / four of 4 lanes per position
    assert_matches_ort(model, feeds, tol=tol(49), target=target)


@pytest.mark.parametrize("threads", [2, 3])
def test_depthwise_channels_in_lanes_any_thread_count(threads):
    model, feeds = depthwise_model(40, 7, 7, 7, N=2)
    assert_matches_ort(model, feeds, tol=tol(49), threads=threads)


@pytest.mark.parametrize("C,H,k,strides,act,fires", [
    (48, 56, 7, [1, 1], "", True),        # 7 x 7 taps: two transposes cost less than the row kernel's reads
    (96, 7, 3, [1, 1], "", True),         # a 7-wide row: the row kernel does not take it
    (96, 56, 3, [1, 1], "", False),       # must not fire: 3 x 3 on wide rows stays on the row kernel (faster)
    (240, 28, 5, [1, 1], "", False),      # 5 x 5: level, stays
    (48, 56, 7, [2, 2], "", False),       # stride 2
    (48, 56, 7, [1, 1], "Relu", False),   # an activation after it (not in this kernel's registers)
    (8, 7, 7, [1, 1], "", False),         # fewer channels than one block
    (16, 112, 7, [1, 1], "", False),      # rows over MAX_ROW
])
def test_depthwise_lanes_selection_rule(C, H, k, strides, act, fires):
    from backends.numba_cpu import dwlanes
    from backends.numba_cpu.epilogue import Epilogue
    OH = (H + 2 * (k // 2) - k) // strides[0] + 1
    X, W, B, Y = _values((1, C, H, H), (C, 1, k, k), (1, C, OH, OH))
    assert dwlanes.prefer(np.float32, X, W, B, C, [k, k], strides, [1, 1], Y, Epilogue(activation=act)) is fires


# A 1-D conv with stride > 1 and at least 16 taps and 16 positions: its col is written by 16 x 16
# block transposes of the frames (convim2col.frames_im2col_kernel); the blocks that read the zero
# padding or a partial 16 taps are copied one float at a time. A copy: the GEMM after it is the
# same, so the tolerance is that of the K = C x taps sums (tol).
@pytest.mark.parametrize("x_shape,w_shape,attrs,extra", [
    ((2, 1, 16000), (258, 1, 256), dict(strides=[128]), dict(bias=False)),             # log-mel: 124 frames
    ((1, 1, 4224), (64, 1, 256), dict(strides=[128]), {}),                             # 32 frames: whole blocks
    ((1, 2, 1000), (24, 2, 72), dict(strides=[8], pads=[36, 36]), dict(relu=True)),   # padded, 72 taps (4.5 blocks)
    ((3, 1, 900), (16, 1, 100), dict(strides=[3]), dict(residual=True)),               # overlapping frames
])
def test_strided_conv1d_frames_by_block_transposes(x_shape, w_shape, attrs, extra):
    model, feeds = conv_model(x_shape, w_shape, **attrs, **extra)
    assert any(k.family == "Im2col" and "cuvil_tblock16" in k.source for k in lowered_kernels(model))
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))))
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))), threads=2)


def test_frames_rule():
    # must not fire: stride 1 (contiguous row copies), fewer than 16 frames (the STFT's 7), 2-D
    assert not convim2col.frames_eligible(1, 1, 1, 256, 869, 1, 1)
    assert not convim2col.frames_eligible(1, 1, 1, 256, 7, 128, 1)
    assert not convim2col.frames_eligible(224, 14, 16, 16, 14, 16, 1)
    assert convim2col.frames_eligible(1, 1, 1, 256, 124, 128, 1)


# The implicit GEMM's last tile of the flat output grid, when it has fewer lanes than the tile,
# runs on a micro-kernel only as wide as they need (convgemm.py): a TCN's 400 positions on 8 x 48
# tiles (16 lanes in the ninth), a 2-D grid, the compress-store ("x") and the positional ("m",
# 1x1 stride 2) layouts, a residual the conv accumulates onto, 2 threads.
def tcn_block_model(C, L, d, seed=0):
    """conv 1x1 -> h; y = relu(h + conv_k3_dilated(h)): the residual is an intermediate the conv
    may accumulate onto (in place)."""
    inits = {"w0": (rand(C, C, 1, seed=seed + 1) / np.sqrt(C)).astype(np.float32), "b0": rand(C, seed=seed + 2),
             "w1": (rand(C, C, 3, seed=seed + 3) / np.sqrt(3 * C)).astype(np.float32), "b1": rand(C, seed=seed + 4)}
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["h"]),
             helper.make_node("Conv", ["h", "w1", "b1"], ["c"], pads=[d, d], dilations=[d]),
             helper.make_node("Add", ["h", "c"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    return make_model(nodes, [("x", np.float32, (1, C, L))], [("y", np.float32, None)], inits), \
        {"x": rand(1, C, L, seed=seed + 5)}


def _edge_specs(model, threads=1):
    """The (mr, nr) of every taps micro-kernel (convgemm.py's) the model's Conv kernels declare."""
    import json
    import re
    specs = set()
    for k in lowered_kernels(model, threads):
        if k.family == "Conv":
            for blob in re.findall(r"# cuvil-ukernel \S+ (\{.*\})", k.source):
                spec = json.loads(blob)
                if spec.get("taps") and "nr" in spec:
                    specs.add((spec["mr"], spec["nr"]))
    return specs


@pytest.mark.parametrize("d", [1, 32])
def test_conv_last_tile_on_a_narrower_micro_kernel(d):
    model, feeds = tcn_block_model(128, 400, d)
    assert {nr for _, nr in _edge_specs(model)} == {48, 16}   # 8 x 48 tiles, the ninth of 16 lanes
    # sums of K = 3 x 128 products, then the residual add (one more rounding, within the margin)
    assert_matches_ort(model, feeds, tol=tol(3 * 128))
    assert_matches_ort(model, feeds, tol=tol(3 * 128), threads=2)


@pytest.mark.parametrize("x_shape,w_shape,attrs,extra", [
    ((1, 16, 18, 18), (24, 16, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2]), dict(relu=True)),  # "x" stores
    ((2, 64, 28, 28), (128, 64, 1, 1), dict(strides=[2, 2]), {}),                   # 196 positions ("m" stores)
    ((1, 16, 18, 18), (24, 16, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2]), dict(residual=True)),
])
def test_conv2d_last_tile_on_a_narrower_micro_kernel(x_shape, w_shape, attrs, extra):
    model, feeds = conv_model(x_shape, w_shape, **attrs, **extra)
    assert len({nr for _, nr in _edge_specs(model)}) == 2
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))))
    assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))), threads=2)


def test_phase_images_end_with_the_right_padding_not_a_row():
    """Stride 1: a channel's phase image is its rows and then g zeros (the last row's right
    padding), not a whole zero row: a 1-D conv wrote twice the floats it needed. The numeric
    checks are the conv tests above (right padding of 1 to 32 columns, 1-D and 2-D)."""
    from backends.numba_cpu.convgemm import phase_geometry
    phases, PH, PW, ldb, offsets, g = phase_geometry([1, 3], [1, 1], [1, 32], 32, 400, 1, 400)
    assert (PH, PW, g, ldb) == (1, 432, 32, 432 + 32)
    assert max(offsets) + 399 < ldb    # the last output's last tap reads the last padding zero
    phases, PH, PW, ldb, offsets, g = phase_geometry([3, 3], [1, 1], [1, 1], 1, 56, 56, 56)
    assert (PH, PW, ldb) == (58, 57, 58 * 57 + 1)


# A 1-D conv at batch 1 on several threads: each thread its own rows of every column tile
# (conv1d.thread_split) where the column-first split leaves a thread waiting. Wav2vec2's
# 256 -> 256 k3 s2 on 1599 (17 tiles, the last 32 wide) and 799 -> 399 (9 tiles, the last 16),
# a TCN layer, and channels that do not split evenly over 3 threads (the split is kept).
@pytest.mark.parametrize("x_shape,w_shape,attrs,threads", [
    ((1, 256, 1599), (256, 256, 3), dict(strides=[2]), 2),
    ((1, 256, 799), (256, 256, 3), dict(strides=[2]), 2),
    ((1, 128, 400), (128, 128, 3), dict(pads=[1, 1]), 2),
    ((1, 96, 333), (96, 96, 3), dict(strides=[2]), 3),
])
def test_conv1d_rows_per_thread(x_shape, w_shape, attrs, threads):
    model, feeds = conv_model(x_shape, w_shape, bias=False, **attrs)
    # K = 3 x C products per output (tol's derivation at the top of the file)
    _, got = assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))), threads=threads)
    _, one = assert_matches_ort(model, feeds, tol=tol(int(np.prod(w_shape[1:]))), threads=1)
    # blocks group whole tiles: every output is the same sum in the same order on any split
    np.testing.assert_array_equal(got["c"], one["c"])


def test_conv1d_thread_split_rule():
    """Where the row split fires, and that it evens the threads' shares (thread_split's docstring)."""
    from backends.numba_cpu.conv1d import thread_split
    from backends.numba_cpu.gemm import slowest_share
    w2v = [48] * 16 + [32]                       # 799 outputs on 8 x 48 tiles, 32 panels of 8 rows
    old = (6, 3, 2, 16)                          # gemm.split_work's: 6 column blocks x 2 row blocks
    sizes = [sum(w2v[nb * 3:nb * 3 + 3]) * 16 for nb in range(6) for mb in range(2)]
    assert slowest_share(sizes, 2) > 1.07        # the first thread 9 tiles, the second 7.7
    assert thread_split(2, 1, w2v, 32, old) == (3, 6, 2, 16)
    assert thread_split(1, 1, w2v, 32, old) is None          # one thread
    assert thread_split(2, 4, w2v, 32, old) is None          # four images: whole images per thread
    assert thread_split(3, 1, w2v, 32, old) is None          # 32 panels do not split in 3
    assert thread_split(2, 1, [32] * 16, 32, (2, 8, 4, 8)) is None   # Whisper's 500 outputs: even already
    # the rows_outer decode in the generated conv: a thread's contiguous items are one row block
    model, _ = conv_model((1, 256, 799), (256, 256, 3), bias=False, strides=[2])
    conv = [k for k in lowered_kernels(model, threads=2) if k.family == "Conv"]
    assert len(conv) == 1 and "nb = item % 3" in conv[0].source
