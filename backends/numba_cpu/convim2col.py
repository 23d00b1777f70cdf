"""Convolutions with many taps and few output positions: im2col, then a 1x1 conv.

    col[n, c*T + t, o] = Xpad[n, c, o_h*s_h + kh*d_h, o_w*s_w + kw*d_w]      (t = kh*KW + kw)
    Y[n, oc, o]        = B[oc] + sum_k W[oc, k] * col[n, k, o]                (k = c*T + t)

An STFT written as a Conv1d (1 input channel, kernel 256, stride 128, 7 frames) or a ViT
patch embedding (3 channels, 16 x 16, stride 16: 196 patches) has few channels and hundreds of
taps. The implicit-GEMM kernels unroll their tap loop (one statement or one micro-kernel step
per tap, phase images per stride phase): hundreds of taps make code larger than the
instruction cache and, at a large stride, as many phase images as the stride. Copying the
frames once (`col`: K = C x T rows of the output positions; the STFT's rows are its
overlapping frames, a patch embedding's a reshuffle with no duplication) leaves a plain GEMM,
M = output channels, N = positions, K = C x T, which conv.py lowers as the 1x1 conv it is (the
channels-in-lanes micro-kernel when the positions are few, the micro-kernel GEMM otherwise),
with the node's epilogue (bias, residual, activation). The copy writes K x N floats for
M x K x N multiply-adds: 1/M of the work. A one-channel 1-D conv without padding whose 1x1 conv
convsmall.py takes (the STFT at batch 1) needs no copy at all: its micro-kernel broadcasts tap k
of frame ow from X[ow*stride + k] (`_frames_in_place`; the STFT 3.79 -> 3.55 us from C).

A batch of images with few output positions each (a streaming VAD's 3 frames per chunk, batch
8) folds the images into the GEMM's columns: col is then (C*T, N*P), one GEMM of N*P columns
instead of N GEMMs of P (the position-in-lanes kernels fill a 16-float vector with 3 of them),
and a copy scatters its (OC, N*P) result to Y (N, OC, P): N*OC*P floats for OC*K*N*P
multiply-adds. A folded conv needs no long kernel (a k3 conv over 3 positions folds too), but
no residual: the residual is laid out like Y, not like the folded result.

`prefer` is the selection rule between this path and the implicit GEMM of convgemm.py /
convsmall.py: a cost model of the instructions the tap loop unrolls and of the phase images
(see TAPS_UNROLLED), and of the vector lanes the columns fill (see `folds`); the decision is a
function of the node's shapes, so it is part of the kernel source and of every cache key
downstream.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Node, Value

from .kernel import Kernel, KernelCall, Source, kernel_header, literal
from .scratch import scratch_value
from .ukernel import TBLOCK, TBlockSpec

# The implicit-GEMM kernels unroll their tap loop: past this many taps per input channel the
# micro-kernel's code outgrows the instruction cache (256 taps x 7 broadcasts x 2-3 FMAs ~ 40 KB
# against a 32 KB L1i). One-node models, one thread, timed from C (AMD EPYC, shared machine):
# the STFT conv (1 -> 258, k256 s128, 7 frames) 0.750 ms on the direct kernel, 0.029 ms on
# convsmall's taps micro-kernel, 0.0097 ms here; 124 frames 5.78 / 0.235 / 0.072 ms
# (onnxruntime through Python 0.015 and 0.086 ms).
TAPS_UNROLLED = 64
# Past this many phase images (each a few positions wide), convgemm's per-tap panels are short
# runs: ViT's patch embedding (3 -> 192, 16x16 stride 16: 256 phases) 2.07 ms there, 0.26 ms here
# (onnxruntime 0.23 ms).
PHASES_MAX = 16
COL_MAX_BYTES = 8 << 20   # the frames buffer stays below this (it lives in the arena while the conv runs)
LANES = 16                # float32 lanes of one AVX-512 vector: the GEMM's column granularity
# Fold the batch into the columns when that fills this many times more lanes (it pays a copy of
# Y): 3 positions x 8 images fill 24 of 32 lanes against 3 of 16 (4x); ConvNeXt's 7x7 stage at
# batch 4 would gain 1.23x and stays per image.
FOLD_GAIN = 1.5
# ... and when the GEMM has this many multiply-adds: the fold's two extra calls cost more than the
# lanes gain on a tiny one (EfficientNet's squeeze-excite convs, 32 -> 8 channels at one position:
# the model at batch 4 measured 1.08x slower with them folded).
FOLD_MIN_MACS = 1 << 18


def _filled(columns: int) -> float:
    return columns / (-(-columns // LANES) * LANES)


def folds(X, W, Y, residual: bool = False) -> bool:
    """Whether the images of a batch go into one GEMM's columns (see the module docstring)."""
    N, positions = int(X.shape[0]), int(np.prod(Y.shape[2:]))
    macs = int(np.prod(W.shape)) * N * positions
    return (N > 1 and not residual and macs >= FOLD_MIN_MACS
            and _filled(N * positions) >= FOLD_GAIN * _filled(positions))


def prefer(X, W, B, Y, group, kernel, strides, dilations, residual: bool = False) -> bool:
    """Whether this path beats the implicit GEMM for a float32 2-D conv with constant weights."""
    if np.dtype(Y.dtype) != np.float32 or len(X.shape) != 4 or not W.is_const or (B is not None and not B.is_const):
        return False
    if group != 1:
        return False
    taps = int(np.prod(kernel))
    N, C = int(X.shape[0]), int(X.shape[1])
    positions = int(np.prod(Y.shape[2:]))
    if positions < 1 or 4 * N * C * taps * positions > COL_MAX_BYTES:
        return False
    if taps <= 1:      # a 1x1 conv (an SE block's squeeze at batch 4: one column per image) only folds
        return folds(X, W, Y, residual)
    phases = int(np.prod([min(s, k) for s, k in zip(strides, kernel)]))
    return taps > TAPS_UNROLLED or phases > PHASES_MAX or folds(X, W, Y, residual)


def im2col_kernel(N, C, H, W, OH, OW, kernel, strides, dilations, pads) -> tuple[Kernel, int]:
    """X (N, C, H, W) -> col (N, C*T, OH*OW); one work item per (image, channel, tap) row."""
    KH, KW = kernel
    (s_h, s_w), (d_h, d_w), (p_t, p_l) = strides, dilations, pads
    T, P = KH * KW, OH * OW
    zero = literal(0, np.float32)
    src = Source().line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"t = item % {T}").line(f"plane = item // {T}")
    src.line(f"kh = t // {KW}").line(f"kw = t % {KW}")
    src.line(f"xb = plane * {H * W}").line(f"ob = item * {P}")
    # Columns whose input is inside the row: [j_lo, j_hi) (the rest is the zero padding).
    src.line(f"off = kw * {d_w} - {p_l}")
    src.line(f"j_lo = 0 if off >= 0 else min({OW}, (-off + {s_w - 1}) // {s_w})")
    src.line(f"j_hi = max(j_lo, min({OW}, ({W - 1} - off) // {s_w} + 1))")
    src.line(f"for oh in range({OH}):").indent()
    src.line(f"r = oh * {s_h} + kh * {d_h} - {p_t}").line(f"o = ob + oh * {OW}")
    src.line(f"if r < 0 or r >= {H}:").indent()
    src.line(f"for j in range({OW}):").indent().line(f"p1[o + j] = {zero}").dedent()
    src.dedent().line("else:").indent()
    src.line(f"x = xb + r * {W} + off")
    src.line("for j in range(j_lo):").indent().line(f"p1[o + j] = {zero}").dedent()
    src.line("for j in range(j_lo, j_hi):").indent().line(f"p1[o + j] = p0[x + j * {s_w}]").dedent()
    src.line(f"for j in range(j_hi, {OW}):").indent().line(f"p1[o + j] = {zero}").dedent()
    return Kernel("Im2col", src.text(), ("float32", "float32")), N * C * T


def frames_eligible(H, OH, KH, KW, OW, s_w, d_w) -> bool:
    """Whether frames_im2col_kernel writes this conv's col: one row (a 1-D conv), stride > 1 (at
    stride 1 im2col_kernel's row copies are contiguous and vectorise), unit dilation, and at least
    one whole 16 x 16 block of (taps, positions)."""
    return H == 1 and OH == 1 and KH == 1 and s_w > 1 and d_w == 1 and KW >= TBLOCK and OW >= TBLOCK


def frames_im2col_kernel(N, C, W, OW, KW, s_w, p_l) -> tuple[Kernel, int]:
    """A 1-D conv's col by block transposes: col[n, c*KW + kw, ow] = Xpad[n, c, ow*s + kw - p_l].

    For one (image, channel), the frames F[ow, kw] = X[ow*s + kw - p_l] are rows of X at stride s
    (an STFT's overlapping windows: kernel 256, stride 128), and col is F transposed. im2col_kernel
    copies each col row with a stride-s gather (one scalar load per float: 256 x 124 of them per
    image for a 1 s log-mel front end); here 16 frames x 16 taps are one TBlockSpec call (16 row
    loads of 16 contiguous taps, lane shuffles, 16 row stores). A block reading outside the row
    (the zero padding) or past the last whole 16 taps is copied one float at a time; the positions
    past the last whole 16 are the block ending at OW - 1 (it rewrites a few of its neighbour's
    columns with the same values, in the same work item). A work item is (image, channel, 16 taps)."""
    KB = -(-KW // TBLOCK)
    zero = literal(0, np.float32)
    src = Source()
    for line in TBlockSpec().declaration("tblock").splitlines():
        src.line(line)
    src.line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"k0 = (item % {KB}) * {TBLOCK}").line(f"plane = item // {KB}")
    src.line(f"k_hi = min(k0 + {TBLOCK}, {KW})")
    src.line(f"xb = plane * {W}").line(f"ob = (plane * {KW} + k0) * {OW}")
    regular = OW // TBLOCK   # whole blocks; then, with a remainder, the block ending at OW - 1
    src.line(f"for bi in range({-(-OW // TBLOCK)}):").indent()
    src.line(f"ow0 = bi * {TBLOCK} if bi < {regular} else {OW - TBLOCK}")
    src.line(f"x0 = ow0 * {s_w} + k0 - {p_l}")
    src.line(f"if k_hi - k0 == {TBLOCK} and x0 >= 0 and x0 + {(TBLOCK - 1) * s_w + TBLOCK - 1} < {W}:").indent()
    src.line(f"tblock(p0, xb + x0, {s_w}, p1, ob + ow0, {OW})").dedent()
    src.line("else:").indent()
    src.line("for kw in range(k0, k_hi):").indent()
    src.line(f"for ow in range(ow0, ow0 + {TBLOCK}):").indent()
    src.line(f"q = ow * {s_w} + kw - {p_l}")
    src.line(f"p1[ob + (kw - k0) * {OW} + ow] = p0[xb + q] if q >= 0 and q < {W} else {zero}")
    return Kernel("Im2col", src.text(), ("float32", "float32")), N * C * KB


def folded_im2col_kernel(N, C, H, W, OH, OW, kernel, strides, dilations, pads) -> tuple[Kernel, int]:
    """X (N, C, H, W) -> col (C*T, N*OH*OW): row (c, t) holds image n's positions at [n*P, (n+1)*P).
    One work item per (image, channel) plane: the rows of a few positions each are too short to
    be items of their own (the bounds of each row cost more than its copy)."""
    KH, KW = kernel
    (s_h, s_w), (d_h, d_w), (p_t, p_l) = strides, dilations, pads
    T, P = KH * KW, OH * OW
    src = Source().line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {C}").line(f"c = item - n * {C}").line(f"xb = item * {H * W}")
    src.line(f"for kh in range({KH}):").indent().line(f"for kw in range({KW}):").indent()
    src.line(f"ob = (c * {T} + kh * {KW} + kw) * {N * P} + n * {P}")
    src.line(f"for oh in range({OH}):").indent()
    src.line(f"r = oh * {s_h} + kh * {d_h} - {p_t}")
    src.line(f"for ow in range({OW}):").indent()
    src.line(f"q = ow * {s_w} + kw * {d_w} - {p_l}")
    src.line(f"inside = r >= 0 and r < {H} and q >= 0 and q < {W}")
    src.line(f"p1[ob + oh * {OW} + ow] = p0[xb + r * {W} + q] if inside else {literal(0, np.float32)}")
    return Kernel("Im2col", src.text(), ("float32", "float32")), N * C


def unfold_kernel(N, OC, P) -> tuple[Kernel, int]:
    """The folded result (OC, N*P) -> Y (N, OC, P); one work item per (image, channel) row."""
    src = Source().line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {OC}").line(f"oc = item - n * {OC}")
    src.line(f"src = oc * {N * P} + n * {P}").line(f"dst = item * {P}")
    src.line(f"for j in range({P}):").indent().line("p1[dst + j] = p0[src + j]")
    return Kernel("Unfold", src.text(), ("float32", "float32")), N * OC


def lower_im2col(node, graph, X, W, B, Y, kernel, strides, dilations, pads, lower_conv) -> list:
    """The Im2col call, then the calls `lower_conv` makes of the 1x1 conv over its frames (a
    node of the same op, epilogue and residual, weights W reshaped to (OC, C*T, 1, 1)); with
    the batch folded into the columns, then the Unfold copy into Y."""
    N, C, H, Wd = (int(v) for v in X.shape)
    OC = int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    T = int(np.prod(kernel))
    if folds(X, W, Y, residual=bool(int(node.attr("has_residual", 0)))):
        return _lower_folded(node, graph, X, W, Y, kernel, strides, dilations, pads, lower_conv)
    direct = _frames_in_place(node, graph, X, W, B, Y, kernel, strides, dilations, pads)
    if direct is not None:
        return direct
    col_name = scratch_value(graph, node, (N, C * T, OH, OW), np.float32, tag="im2col")
    if frames_eligible(H, OH, kernel[0], kernel[1], OW, strides[1], dilations[1]):
        col_kernel, work = frames_im2col_kernel(N, C, Wd, OW, kernel[1], strides[1], pads[1])
    else:
        col_kernel, work = im2col_kernel(N, C, H, Wd, OH, OW, kernel, strides, dilations, pads)
    w_name = f"__im2col_w__{node.name}"
    graph.values[w_name] = Value(w_name, np.dtype(np.float32), (OC, C * T, 1, 1),
                                 np.ascontiguousarray(np.asarray(W.data, dtype=np.float32).reshape(OC, C * T, 1, 1)))
    # The 1x1 conv writes the node's output, which may be a 1-D conv's (N, OC, L): a view of the
    # same bytes as (N, OC, 1, L) is what the pointwise kernels read.
    y_name = Y.name
    inputs = [col_name, w_name] + list(node.inputs[2:])
    attrs = {k: v for k, v in node.attrs.items() if k not in ("kernel_shape", "strides", "dilations", "pads", "auto_pad")}
    pointwise = Node(node.op, node.name, inputs, [y_name], attrs, node.domain)
    views = [y_name] + ([node.inputs[-1]] if int(node.attr("has_residual", 0)) else [])
    saved = {name: graph.values[name] for name in views}
    if len(saved[y_name].shape) == 3:
        for name in views:
            graph.values[name] = _row_view(saved[name])
    try:
        calls = lower_conv(pointwise, graph).calls
    finally:
        graph.values.update(saved)
    return [KernelCall(col_kernel, [X.name, col_name], work, node.name)] + list(calls)


def _frames_in_place(node, graph, X, W, B, Y, kernel, strides, dilations, pads) -> list | None:
    """A one-channel 1-D conv whose frames all lie inside X (no padding, unit dilation; the STFT)
    on convsmall's channels-in-lanes kernel, the frames read in place (its micro-kernel broadcasts
    tap k of frame ow from X[ow*stride + k]): no Im2col copy. None when the conv is not one, or
    when convsmall would not take the 1x1 conv over its frames."""
    N, C, H, Wd = (int(v) for v in X.shape)
    OC, OW = int(W.shape[0]), int(Y.shape[-1])
    KW, hop = int(kernel[-1]), int(strides[-1])
    if C != 1 or H != 1 or int(np.prod(kernel)) != KW or any(int(d) != 1 for d in dilations) or any(pads) \
            or (OW - 1) * hop + KW > Wd or int(node.attr("has_residual", 0)):
        return None
    from . import convsmall
    from .epilogue import epilogue_of
    frames = Value(X.name, X.dtype, (N, KW, 1, OW))
    weights = Value(W.name, np.dtype(np.float32), (OC, KW, 1, 1), np.asarray(W.data, dtype=np.float32).reshape(OC, KW, 1, 1))
    out = Value(Y.name, Y.dtype, (N, OC, 1, OW))
    one, no_pads = (1, 1), (0, 0, 0, 0)
    if not convsmall.eligible(frames, weights, B, 1, one, one, one, no_pads, out, pointwise=True):
        return None
    return convsmall.lower_conv_small(node, graph, frames, weights, B, out, 1, one, one, one, no_pads,
                                      epilogue=epilogue_of(node)[0], pointwise=True, frames=(Wd, hop))


def _lower_folded(node, graph, X, W, Y, kernel, strides, dilations, pads, lower_conv) -> list:
    """Im2col into (C*T, N*P), the 1x1 conv of one image with N*P columns (bias and activation
    in its epilogue), Unfold into Y."""
    N, C, H, Wd = (int(v) for v in X.shape)
    OC = int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    T, P = int(np.prod(kernel)), OH * OW
    col_name = scratch_value(graph, node, (1, C * T, 1, N * P), np.float32, tag="im2col")
    col_kernel, work = folded_im2col_kernel(N, C, H, Wd, OH, OW, kernel, strides, dilations, pads)
    w_name = f"__im2col_w__{node.name}"
    graph.values[w_name] = Value(w_name, np.dtype(np.float32), (OC, C * T, 1, 1),
                                 np.ascontiguousarray(np.asarray(W.data, dtype=np.float32).reshape(OC, C * T, 1, 1)))
    folded = scratch_value(graph, node, (1, OC, 1, N * P), np.float32, tag="im2col_y")
    attrs = {k: v for k, v in node.attrs.items() if k not in ("kernel_shape", "strides", "dilations", "pads", "auto_pad")}
    pointwise = Node(node.op, node.name, [col_name, w_name] + list(node.inputs[2:]), [folded], attrs, node.domain)
    unfold, unfold_work = unfold_kernel(N, OC, P)
    return ([KernelCall(col_kernel, [X.name, col_name], work, node.name)] + list(lower_conv(pointwise, graph).calls)
            + [KernelCall(unfold, [folded, Y.name], unfold_work, node.name)])


def _row_view(value: Value) -> Value:
    """A 1-D conv's output (or a residual broadcast to it) as the 2-D one of one row: the same
    bytes, shape (N, C, L) -> (N, C, 1, L), lower ranks aligned on the right first."""
    shape = [1] * (3 - len(value.shape)) + list(value.shape)
    shape = tuple(shape[:2] + [1] + shape[2:])
    data = None if value.data is None else np.asarray(value.data).reshape(shape)
    return Value(value.name, value.dtype, shape, data)
