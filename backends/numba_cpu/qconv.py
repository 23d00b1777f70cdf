"""QLinearConv on the AVX512-VNNI convolution micro-kernel (ukernel_int8.Int8ConvSpec).

    y[n, oc, oh, ow] = saturate(rint(float(acc + bias[oc]) * (s_x s_w[oc] / s_y)) + z_y)
    acc = sum_{c, kh, kw} (x[n, c, oh*s + kh*d - p, ow*s + kw*d - p] - z_x) * (w[oc, c, kh, kw] - z_w[oc])

Two kernels. The first copies the input into channel quads, padded, split in phase images for a
strided conv ("QuadPad"): element (c, h, w) of the padded input (hp = h + p_top, wp = w + p_left)
goes to phase (hp % s, wp % s), pixel (hp // s, wp // s) of quad c // 4, byte c % 4; padding and
the channels beyond C (weights zero) hold z_x. Int8 inputs are stored + 128 (their sign bit flipped),
so the micro-kernel only ever reads unsigned bytes; the compensation uses z_x + 128. The second
runs the micro-kernel on tiles of output channels x 64 positions of the phase grid (OH rows of
Wps pixels, read as one run: the columns past OW are computed and left out of the compressed
store); every tap (kh, kw) reads the phase ((kh d) % s, (kw d) % s) at pixel offset
((kh d) // s) * Wps + (kw d) // s. Only the phases the taps read are copied (a strided 1x1: one).
The rows are as narrow as that reading allows (`_layout_holds`, checked pixel by pixel at build
time): a tap past a row's end reads the next row's left padding, so a 3x3 pad-1 conv's rows are
W + 1 pixels, not W + 2 (the columns past OW are lanes computed for nothing: 1.8 % of them at 56,
3.4 % at 28), with one more padding row at the bottom. Where a conv computes on the next conv's
grid (below) its own input rows may then run on into the next row: QuadPad writes such an image
as one run of pixels a row in flat order (`_flat_runs`).

    sum (x - z_x) w' = sum x w' - z_x * sum_{c, t} w'[oc, c, t]      (w' = w - z_w, int8, packed)

so the compensation with the int32 bias is one build-time constant per output channel. Applies to
2-D convolutions with group 1, constant weights (w - z_w within int8), constant scales and zero
points; others keep quant.py's direct loops.

Two variants where the quads would run emptier (`_vnni_plan` decides, every reader asks it):
    im2col          C not whole quads (a stem's 3 channels: 49 quads for 147 products): the input
                    goes to one padded phase plane a channel (PhasePad), and the conv gathers each
                    chunk's patches (k = (c, kh, kw), the weights' order) into Kq = ceil(C T / 4)
                    quads of its own, in L1, before every tile of output channels runs on them
                    as on a 1x1 conv's quads (7x7x3: 37 quads); the sums are the same integers
    channel lanes   a small plane (16-pixel vectors under ROWS_BELOW full: 7x7 on its 9-wide grid
                    fills 49 of 64 lanes), output channels a multiple of ROWS_NR, plain output:
                    Int8RowConvSpec puts 32 output channels in the lanes and a run of 4-12 pixels
                    of one output row in the tile (the input's quads broadcast), so no lane is
                    empty; such a conv writes its own output (conv_into_conv declines)

A tensor that only the next conv reads is written in that conv's layout by its producer, and the
copy before the next conv shrinks to its top and bottom padding rows or goes:
    conv -> depthwise   conv_into_depthwise: the conv computes on the depthwise's padded grid and
                        stores whole rows, padding columns as the zero point (Int8ConvBlendSpec)
    conv -> conv        conv_into_conv: the same on the next conv's grid, rows interleaved as
                        quads (Int8ConvBlendSpec quads; QUAD_TILES)
    depthwise -> 1x1    depthwise_quad_consumer: 4 channels at once, compressed to the output
                        pixels and interleaved as quads (Int8DwQuadSpec)
Producer and consumer are lowered apart: both ask the same predicates of the graph, and the
buffer is the consumer's scratch value (its name comes from the consumer node).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .emit import NOALIAS_MARK
from .kernel import Kernel, KernelCall, Source, kernel_header, work_items
from .qgemm import vnni_target
from .ukernel_int8 import Int8ConvBlendSpec, Int8ConvSpec, Int8DwQuadSpec, Int8DwSpec, Int8RowConvSpec


def node_input(node, graph, k):
    """Input k of `node` as a graph value, or None where it is absent or empty (an optional input)."""
    name = node.inputs[k] if len(node.inputs) > k else ""
    return graph.values[name] if name else None


def conv_pads(node, in_spatial, kernel, strides, dilations, out_spatial):
    """The leading pads of a ConvInteger/QLinearConv node, `auto_pad` resolved."""
    n = len(in_spatial)
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad == "VALID":
        return [0] * n
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        heads = []
        for i in range(n):
            total = max(0, (out_spatial[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_spatial[i])
            heads.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
        return heads
    return list(node.attr("pads", [0] * 2 * n))[:n]

MIN_SPLIT_OPS = 1 << 21


# output channels x pixels of a micro-tile: 24 int32 accumulators. A core running two `vpdpbusd` a
# cycle (Zen 5; latency 4) needs 8 or more independent ones; the loads a tap (pixel vectors + weight
# broadcasts: 10, 11, 14, 25 for 24 dot products) leave 24x16 load-bound at ~90 % of the peak, the
# others at 95-100 % (benchmarks/int8_tiles.py, each tile alone in a loop, against peak_lowp.py's
# ~1100 GOP/s). 8x48 fits 64 channels (ResNet's stem and first layer) in whole tiles.
TILES = ((6, 64), (8, 48), (12, 32), (24, 16))


QUAD_TILES = ((8, 48), (12, 32), (24, 16))   # rows in whole quads, for a conv writing the next one's quads


ROWS_NR, ROWS_BELOW = 32, 0.9   # output channels a row tile (Int8RowConvSpec); pixel-lane fill it replaces


IM2COL_MAX_K = 256   # patch bytes up to which a conv on few channels gathers its patches (im2col_pays)


def choose_tile(OC: int, flat: int, tiles=TILES) -> tuple[int, int]:
    """The tile computing the fewest lanes for OC channels over `flat` grid positions (a 14x14 output
    on a 16-wide grid: 224 positions, 7 tiles of 32 rather than 4 of 64); ties keep the wider tile."""
    return min(tiles, key=lambda t: (-(-OC // t[0]) * t[0] * -(-flat // t[1]) * t[1], -t[1]))


def _to_uint8(x_dtype: str):
    """expr -> the expression of its byte as uint8: int8 inputs shifted by 128 (the VNNI kernels'
    unsigned operand)."""
    def read(expr):
        return f"np.uint8({expr})" if x_dtype == "uint8" else f"np.uint8(np.int32({expr}) + 128)"
    return read


def _padded_rows(src, s, pt, pl, H, W, Hps, Wps, width, plane, z):
    """The row loop QuadPad and PhasePad share: phase (a, b) of the work item's `ph`, rows hh of its
    padded phase image at dst = item * plane, `width` bytes per column (4: a quad); a row outside
    the input and the columns left of wlo and from whi on (outside the input: 0 <= ww*s + b - pl
    < W) get the zero point. Leaves the loop open at the row, h its input row, o its first byte."""
    def times(n):
        return n if width == 1 else f"{n} * {width}"
    src.line(f"a = ph // {s}").line(f"b = ph % {s}")
    src.line(f"dst = item * {plane}")
    src.line(f"wlo = min(max(0, ({pl} - b + {s - 1}) // {s}), {Wps})")
    src.line(f"whi = max(min({Wps}, ({W} + {pl} - b + {s - 1}) // {s}), wlo)")
    src.line(f"for hh in range({Hps}):").indent()
    src.line(f"h = hh * {s} + a - {pt}")
    src.line(f"o = dst + hh * {Wps * width}")
    src.line(f"if h < 0 or h >= {H}:").indent()
    src.line(f"for i in range({Wps * width}):").indent().line(f"p1[o + i] = {z}").dedent()
    src.line("continue").dedent()
    src.line(f"for i in range({times('wlo')}):").indent().line(f"p1[o + i] = {z}").dedent()
    src.line(f"for i in range({times('whi')}, {Wps * width}):").indent().line(f"p1[o + i] = {z}").dedent()


def quad_pad_kernel(x_dtype: str, N: int, C: int, H: int, W: int, s: int, pt: int, pl: int, Hps: int, Wps: int,
                    Cq: int, zero: int, slack: int, phases: int) -> tuple[Kernel, int]:
    """x [N, C, H, W] -> [N, phases, Cq quads, Hps, Wps, 4] uint8 (+ `slack` bytes of zero point
    at the end, which tiles read past the last row): the first `phases` of the s*s phase images (the
    ones the conv's taps read). One work item per (image, phase, quad); each
    row's valid columns are one loop storing the quad's 4 bytes together (an interleaved store
    LLVM vectorises), the padding around them filled apart."""
    read = _to_uint8(x_dtype)
    plane = Hps * Wps * 4
    total = N * phases * Cq * plane
    z = f"np.uint8({zero})"
    src = Source().line(NOALIAS_MARK).line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"q = item % {Cq}").line(f"ph = (item // {Cq}) % {phases}").line(f"n = item // {Cq * phases}")
    if (W - 1 + pl) // s >= Wps:
        _flat_runs(src, read, s, pt, pl, C, H, W, Wps, plane, z)
    else:
        _padded_rows(src, s, pt, pl, H, W, Hps, Wps, 4, plane, z)
        _quad_row_copy(src, read, s, pl, C, H, W, z)
    if slack:
        src.line(f"if end == {N * phases * Cq}:").indent()
        src.line(f"for i in range({slack}):").indent()
        src.line(f"p1[{total} + i] = {z}")
    return Kernel("QuadPad", src.text(), (x_dtype, "uint8")), N * phases * Cq


def _quad_row_copy(src, read, s, pl, C, H, W, z):
    """The copy of one row's valid columns [wlo, whi) inside _padded_rows' loop (closes it)."""
    src.line(f"sb = ((n * {C} + q * 4) * {H} + h) * {W} + b - {pl}")
    _copy_quads(src, read, s, C, H * W, "ww", "wlo, whi", z)
    src.dedent().dedent()


def _copy_quads(src, read, s, C, HW, var, bounds, z):
    """Pixels `var` in range(bounds) of quad q, input pixel sb + var * s of channel 4q + h to byte
    o + var * 4 + h: the quad's 4 bytes stored together (an interleaved store LLVM vectorises), a
    last quad past C filled with the zero point."""
    src.line(f"if q * 4 + 4 <= {C}:").indent()
    src.line(f"for {var} in range({bounds}):").indent()
    src.line(f"i = sb + {var} * {s}").line(f"d = o + {var} * 4")
    for c4 in range(4):
        src.line(f"p1[d + {c4}] = {read(f'p0[i + {c4 * HW}]')}")
    src.dedent().dedent().line("else:").indent()
    src.line("for c4 in range(4):").indent()
    src.line(f"for {var} in range({bounds}):").indent()
    src.line(f"p1[o + {var} * 4 + c4] = {read(f'p0[sb + c4 * {HW} + {var} * {s}]')} if q * 4 + c4 < {C} else {z}")
    src.dedent().dedent().dedent()


def _flat_runs(src, read, s, pt, pl, C, H, W, Wps, plane, z):
    """QuadPad's loop for a layout whose rows run on into the next (a conv computing on the next
    conv's grid, shifted right by that conv's left pad: _vnni_plan, `_layout_holds`): in the flat
    phase image (a, b), input row h's pixels w = w0, w0 + s, ... (those of column phase b) are one
    run of `cnt` quads from pixel ((h + pt) // s) * Wps + j0 on, whatever row that ends in; the
    runs of successive rows follow one another, and everything between them is the zero point."""
    src.line(f"a = ph // {s}").line(f"b = ph % {s}")
    src.line(f"dst = item * {plane}")
    src.line(f"w0 = (b + {s - pl % s}) % {s}")
    src.line(f"cnt = ({W} - w0 + {s - 1}) // {s}")
    src.line(f"j0 = (w0 + {pl}) // {s}")
    src.line("prev = 0")
    src.line(f"for h in range((a + {s - pt % s}) % {s}, {H}, {s}):").indent()
    src.line(f"start = ((h + {pt}) // {s}) * {Wps} + j0")
    src.line("for i in range(prev * 4, start * 4):").indent().line(f"p1[dst + i] = {z}").dedent()
    src.line(f"sb = ((n * {C} + q * 4) * {H} + h) * {W} + w0")
    src.line("o = dst + start * 4")
    _copy_quads(src, read, s, C, H * W, "k", "cnt", z)
    src.line("prev = start + cnt").dedent()
    src.line(f"for i in range(prev * 4, {plane}):").indent().line(f"p1[dst + i] = {z}").dedent()
    src.dedent()


def phase_pad_kernel(x_dtype: str, N: int, C: int, H: int, W: int, s: int, pt: int, pl: int, Hps: int, Wps: int,
                      zero: int, slack: int, phases: int) -> tuple[Kernel, int]:
    """x [N, C, H, W] -> [N, C, phases, Hps, Wps] uint8 (+ `slack` bytes of zero point): QuadPad's
    padded phase images (the first `phases` of s*s), one channel a plane, the source an im2col conv
    gathers its patches from. One work item per (image, channel, phase)."""
    read = _to_uint8(x_dtype)
    plane = Hps * Wps
    items = N * C * phases
    z = f"np.uint8({zero})"
    src = Source().line(NOALIAS_MARK).line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"ph = item % {phases}").line(f"nc = item // {phases}")
    _padded_rows(src, s, pt, pl, H, W, Hps, Wps, 1, plane, z)
    src.line(f"sb = (nc * {H} + h) * {W} + b - {pl}")
    src.line("for ww in range(wlo, whi):").indent()
    src.line(f"p1[o + ww] = {read(f'p0[sb + ww * {s}]')}")
    src.dedent().dedent().dedent()
    if slack:
        src.line(f"if end == {items}:").indent()
        src.line(f"for i in range({slack}):").indent()
        src.line(f"p1[{items * plane} + i] = {z}")
    return Kernel("PhasePad", src.text(), (x_dtype, "uint8")), items


def im2col_pays(C: int, T: int) -> bool:
    """Whether a conv's patches are gathered into quads of their own (im2col) rather than read in
    channel quads: C not whole quads (a stem's 3 channels fill 3 of every 4 lanes), patches of at
    most IM2COL_MAX_K bytes, and a tenth of the lanes or more saved (7x7x3: 37 quads, not 49)."""
    return C % 4 != 0 and C * T <= IM2COL_MAX_K and 10 * -(-(C * T) // 4) <= 9 * -(-C // 4) * T


@lru_cache(maxsize=256)     # every predicate on a conv asks its plan again (conv_into_conv, ...)
def _layout_holds(H, W, OH, OW, KH, KW, s, dil, pt, pl, col, Hps, Wps) -> bool:
    """Whether phase images of Hps rows of Wps pixels, read flat, give every output lane every tap's
    input: input pixel (h, w) is at padded (h + pt, w + pl + s*col), i.e. phase ((h + pt) % s,
    (w + pl') % s) at flat pixel ((h + pt) // s) * Wps + (w + pl') // s (a row too long runs on into
    the next one: QuadPad's `_flat_runs`), every other pixel is the zero point, and output (oh, ow)
    is lane oh * Wps + col + ow, its tap (kh, kw) reading phase ((kh d) % s, (kw d) % s) at
    + ((kh d) // s) * Wps + (kw d) // s. Holds when no two pixels share a place, no read leaves the
    image and every read finds the pixel the convolution wants there, or padding where it wants
    padding: checked pixel by pixel (build time, numpy)."""
    P = Hps * Wps
    hh, ww = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
    hp, wp = hh + pt, ww + pl + s * col
    at = ((hp % s) * s + wp % s) * P + (hp // s) * Wps + wp // s
    if ((hp // s) * Wps + wp // s).max(initial=0) >= P:
        return False
    held = np.full(s * s * P, -1, np.int64)
    held[at.reshape(-1)] = (hh * W + ww).reshape(-1)
    if np.count_nonzero(held >= 0) != H * W:
        return False
    oh, ow = np.meshgrid(np.arange(OH), np.arange(OW), indexing="ij")
    lane = oh * Wps + col + ow
    for kh in range(KH):
        for kw in range(KW):
            reads = lane + ((kh * dil[0]) // s) * Wps + (kw * dil[1]) // s
            if reads.max(initial=0) >= P:
                return False
            h, w = oh * s + kh * dil[0] - pt, ow * s + kw * dil[1] - pl
            want = np.where((h >= 0) & (h < H) & (w >= 0) & (w < W), h * W + w, -1)
            phase = ((kh * dil[0]) % s) * s + (kw * dil[1]) % s
            if not np.array_equal(held[phase * P + reads], want):
                return False
    return True


def _vnni_plan(node, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads, grid=None, quad_out=False) -> dict | None:
    """Everything lower_qlinear_conv_vnni builds before it emits (the layout of the quads, packed
    weights, tables), or None where the path does not apply. `grid` = (width, column): the grid rows
    are `width` pixels and output column ow sits at grid column `column` + ow (the input shifted
    right as much in the quads), the layout of the zero-padded planes of a depthwise conv after it."""
    if not vnni_target() or len(x.shape) != 4 or int(node.attr("group", 1)) != 1:
        return None
    if not (w.is_const and sx.is_const and sw.is_const and sy.is_const and (zx is None or zx.is_const)
            and (zw is None or zw.is_const) and (zy is None or zy.is_const) and (bias is None or bias.is_const)):
        return None
    if any(np.dtype(v.dtype).name != "float32" for v in (sx, sw, sy)) or sx.size != 1 or sy.size != 1:
        return None
    x_dtype = np.dtype(x.dtype).name
    if x_dtype not in ("uint8", "int8") or np.dtype(w.dtype).name not in ("uint8", "int8"):
        return None
    N, C, H, W = x.shape
    OC, _, KH, KW = w.shape
    _, _, OH, OW = y.shape
    strides = list(node.attr("strides", [1, 1]))
    dil = list(node.attr("dilations", [1, 1]))
    if strides[0] != strides[1]:
        return None
    s = strides[0]
    pt, pl = pads
    wdata = np.asarray(w.data).astype(np.int32)
    if zw is not None:
        z = np.asarray(zw.data).astype(np.int32).reshape(-1)
        wdata = wdata - (z.reshape(-1, 1, 1, 1) if z.size > 1 else z[0])
    if wdata.min(initial=0) < -128 or wdata.max(initial=0) > 127:
        return None
    T = KH * KW
    Cq = -(-C // 4)
    # the phase images, sized so that every tap of every output pixel lands inside its row
    Hps = OH + ((KH - 1) * dil[0]) // s
    Wps = OW + ((KW - 1) * dil[1]) // s
    col = 0
    shape = (H, W, OH, OW, KH, KW, s, tuple(dil), pt, pl)
    if grid is not None:
        # the lanes (output columns) on the grid's rows; the taps' reads may run on into the next
        # row where that holds what they must read (_layout_holds), with one more row of padding
        # at the bottom where the last row's reads run past the image
        Wps, col = grid
        if col + OW > Wps:
            return None
        extra = next((e for e in (0, 1) if _layout_holds(*shape, col, Hps + e, Wps)), None)
        if extra is None:
            return None
        Hps += extra
        pl = pl + s * col
    elif Wps > max(OW, (W - 1 + pl) // s + 1):
        # The rows as narrow as the taps allow. A tap right of a row's end reads the next row's left
        # padding, so at stride 1 W + max(left, right pad) columns do (a 3x3 pad-1 conv: 57 for a
        # 56-wide image, not 58; 29 for 28; the 7x7 stride-2 stem's phases: 114, not 115): the
        # tiles compute 1.8 / 3.4 / 0.9 % fewer lanes that are no output. Not so narrow that an
        # input row runs on into the next (a conv writing this one's quads, conv_into_conv, puts
        # its output row inside one grid row; PhasePad copies rows as they are).
        for width in range(max(OW, (W - 1 + pl) // s + 1), Wps):
            extra = next((e for e in (0, 1) if _layout_holds(*shape, 0, Hps + e, width)), None)
            if extra is not None:
                Hps, Wps = Hps + extra, width
                break
    plane = Hps * Wps
    # Tiles run over whole rows of the phase grid (OH rows of Wps pixels, the last Wps - OW of each
    # not an output): a 7x7 output computes 64 lanes for 49 pixels, not 7 of every 16. The mask of
    # each tile's valid lanes and the output offset of its first are build-time tables.
    flat = OH * Wps
    MR, NR = choose_tile(OC, flat, QUAD_TILES if quad_out else TILES)
    chunks = -(-flat // NR)
    pos = np.arange(chunks * NR).reshape(chunks, NR)
    valid = (pos < flat) & (pos % Wps >= col) & (pos % Wps < col + OW)
    masks = (valid.astype(np.uint64) << np.arange(NR, dtype=np.uint64)).sum(axis=1, dtype=np.uint64).view(np.int64)
    stores = ((pos < flat).astype(np.uint64) << np.arange(NR, dtype=np.uint64)).sum(axis=1, dtype=np.uint64).view(np.int64)
    starts = np.concatenate([[0], np.cumsum(valid.sum(axis=1))[:-1]]).astype(np.int64)
    # the phase images the taps read, in the order a * s + b: all s * s of a 3x3 stride-2 conv, the
    # first alone of a 1x1 (a strided 1x1 reads every s-th pixel: its copy is 1 / s^2 of the input)
    phases = max(((kh * dil[0]) % s) * s + (kw * dil[1]) % s for kh in range(KH) for kw in range(KW)) + 1
    taps = []
    for kh in range(KH):
        for kw in range(KW):
            a, b = (kh * dil[0]) % s, (kw * dil[1]) % s
            taps.append((a * s + b) * Cq * plane + ((kh * dil[0]) // s) * Wps + (kw * dil[1]) // s)
    shift = 128 if x_dtype == "int8" else 0
    zero_x = (int(np.asarray(zx.data).reshape(-1)[0]) if zx is not None else 0) + shift
    tiles = -(-OC // MR)
    packed = np.zeros((tiles * MR, Cq * 4, T), np.int8)
    packed[:OC, :C] = wdata.reshape(OC, C, T)
    # [tile, q, t, MR, 4]
    packed = np.ascontiguousarray(packed.reshape(tiles, MR, Cq, 4, T).transpose(0, 2, 4, 1, 3))
    im2col = im2col_pays(C, T)
    if im2col and (W - 1 + pl) // s >= Wps:     # rows running on into the next: QuadPad's alone
        return None
    Kq, koffs = Cq, None
    if im2col:
        # patch byte k = (c, kh, kw), the weights' own order, gathered from the phase plane of c
        # that tap reads (phase_pad_kernel's layout); bytes past C*T read plane 0 (weight 0)
        Kq = -(-(C * T) // 4)
        koffs = np.zeros(Kq * 4, np.int64)
        for k in range(C * T):
            c, (kh, kw) = k // T, divmod(k % T, KW)
            a, b = (kh * dil[0]) % s, (kw * dil[1]) % s
            koffs[k] = (c * phases + a * s + b) * plane + ((kh * dil[0]) // s) * Wps + (kw * dil[1]) // s
        packed = np.zeros((tiles * MR, Kq * 4), np.int8)
        packed[:OC, :C * T] = wdata.reshape(OC, C * T)
        # [tile, q, MR, 4]: Int8ConvSpec's packing with one tap
        packed = np.ascontiguousarray(packed.reshape(tiles, MR, Kq, 4).transpose(0, 2, 1, 3))
    rows_mr = 0
    if grid is None and not quad_out and not im2col and OC % ROWS_NR == 0:
        # output channels in the lanes where the pixel lanes go emptier than ROWS_BELOW: a tile is
        # the largest run of pixels (<= 12, 2 x 12 accumulators) that divides the output row
        fill = OH * OW / (chunks * NR)
        divisors = [m for m in range(12, 3, -1) if OW % m == 0]
        rows_mr = divisors[0] if fill < ROWS_BELOW and divisors else 0
    comp = np.zeros(tiles * MR, np.int64)
    comp[:OC] = -zero_x * wdata.reshape(OC, -1).astype(np.int64).sum(axis=1)
    if bias is not None:
        comp[:OC] += np.asarray(bias.data, np.int64).reshape(-1)
    if np.abs(comp).max(initial=0) >= 2**31:
        return None
    s_x = np.asarray(sx.data, np.float32).reshape(-1)[0]
    mult = np.zeros(tiles * MR, np.float32)
    mult[:OC] = (s_x * np.broadcast_to(np.asarray(sw.data, np.float32).reshape(-1), (OC,))) \
        / np.asarray(sy.data, np.float32).reshape(-1)[0]
    out = "u8" if np.dtype(y.dtype).name == "uint8" else "s8"
    zero_y = int(np.asarray(zy.data).reshape(-1)[0]) if zy is not None else 0
    slack = (chunks * NR - flat + ((KH - 1) * dil[0] // s + 1) * Wps + NR) * 4
    return dict(locals())


def lower_qlinear_conv_vnni(node, graph, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads) -> list | None:
    """The calls, or None where the path does not apply (see the module docstring); `pads`: the
    leading pad of each spatial axis. Where a depthwise conv before writes this conv's quads
    itself (`depthwise_quad_consumer`), the QuadPad copy is left out."""
    into = conv_into_depthwise(node, graph)
    onto = conv_into_conv(node, graph)
    grid = (into[1]["Wp"], into[1]["pl"]) if into else (onto[1]["Wps"], onto[1]["pl"]) if onto else None
    plan = _vnni_plan(node, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads, grid, quad_out=bool(onto))
    if plan is None:
        return None
    (N, C, H, W, s, pt, pl, Hps, Wps, Cq, plane, phases, OC, OH, OW, MR, NR, chunks, tiles, taps, packed, comp,
     mult, out, zero_y, slack, masks, starts, x_dtype, zero_x, T, im2col, Kq, koffs) = (plan[k] for k in (
        "N", "C", "H", "W", "s", "pt", "pl", "Hps", "Wps", "Cq", "plane", "phases", "OC", "OH", "OW", "MR", "NR",
        "chunks", "tiles", "taps", "packed", "comp", "mult", "out", "zero_y", "slack", "masks", "starts", "x_dtype",
        "zero_x", "T", "im2col", "Kq", "koffs"))
    from .scratch import scratch_value
    producer = graph.producers().get(x.name)
    chained = producer is not None and _same(depthwise_quad_consumer(producer, graph), node)
    if im2col:      # C is not whole quads: no conv before writes this conv's input (see conv_into_conv)
        quads = scratch_value(graph, node, (N * C * phases * plane + slack // 4,), np.uint8, tag="planes")
        pad_kernel, pad_work = phase_pad_kernel(x_dtype, N, C, H, W, s, pt, pl, Hps, Wps, zero_x, slack // 4,
                                                 phases)
        pad_args = [x.name, quads]
    elif producer is not None and _same((conv_into_conv(producer, graph) or (None,))[0], node):
        quads = scratch_value(graph, node, (N * phases * Cq * plane * 4 + slack,), np.uint8, tag="quads")
        # the conv before wrote rows pt .. pt + H - 1 of every quad: the rest is filled
        border = Source().line(NOALIAS_MARK).line(kernel_header(1)).indent()
        border.line("for item in range(begin, end):").indent()
        border.line(f"ob = item * {plane * 4}")
        border.line(f"for i in range({pt * Wps * 4}):").indent().line(f"p0[ob + i] = np.uint8({zero_x})").dedent()
        border.line(f"for i in range({(pt + H) * Wps * 4}, {plane * 4}):").indent()
        border.line(f"p0[ob + i] = np.uint8({zero_x})").dedent().dedent()
        border.line(f"if end == {N * Cq}:").indent()
        border.line(f"for i in range({slack}):").indent()
        border.line(f"p0[{N * Cq * plane * 4} + i] = np.uint8({zero_x})")
        pad_kernel, pad_work, pad_args = Kernel("QuadBorder", border.text(), ("uint8",)), N * Cq, [quads]
    else:
        quads = scratch_value(graph, node, (N * phases * Cq * plane * 4 + slack,), np.uint8, tag="quads")
        pad_kernel, pad_work = quad_pad_kernel(x_dtype, N, C, H, W, s, pt, pl, Hps, Wps, Cq, zero_x, slack,
                                                   phases)
        pad_args = [x.name, quads]
    if onto:    # the next conv's quads: rows pt .. pt + OH - 1 of each, padding columns included
        next_node, nxt = onto
        target = scratch_value(graph, next_node, (N * nxt["Cq"] * nxt["plane"] * 4 + nxt["slack"],), np.uint8,
                               tag="quads")
    if into:    # the depthwise's padded planes: rows pt .. pt + OH - 1 whole, padding columns included
        dw_node, dw = into
        target = scratch_value(graph, dw_node, (dw["padded_size"],), np.uint8, tag="dwpad")
        dw_plane = dw["Hp"] * dw["Wp"]

    specs = {}

    def spec(mr):
        if mr not in specs:
            extra = {"quads": 1} if onto else {}
            make = Int8ConvBlendSpec if into or onto else Int8ConvSpec
            specs[mr] = (f"uk{len(specs)}", make(mr=mr, nr=NR, taps=(0,) if im2col else tuple(taps),
                                                 plane=NR if im2col else plane, panel=MR, out=out, zy=zero_y, **extra))
        return specs[mr][0]

    # im2col: p7 the patch offsets, p8 the gathered quads, p9 the output (written args come last)
    ybuf = "p9" if im2col else "p7"

    def emit_tile(body, xbuf, xoff):
        """The micro-kernel calls of tile `tile` on chunk `ch` (names in the generated source)."""
        body.line(f"oc0 = tile * {MR}")
        body.line(f"woff = tile * {Kq * (1 if im2col else T) * MR * 4}")
        for edge in (False, True) if OC % MR else (False,):
            if OC % MR:
                body.line(f"if oc0 + {MR} <= {OC}:" if not edge else "else:").indent()
            name = spec(OC % MR if edge else MR)
            if onto:
                body.line(f"yoff = ((n * {nxt['Cq']} + oc0 // 4) * {nxt['plane']} + {nxt['pt'] * nxt['Wps']} + ch * {NR}) * 4")
                body.line(f"{name}(p0, woff, {xbuf}, {xoff}, {ybuf}, yoff, {nxt['plane'] * 4}, {Kq}, p5[ch], p2, p3, oc0, p6[ch])")
            elif into:
                body.line(f"yoff = (n * {OC} + oc0) * {dw_plane} + {dw['pt'] * dw['Wp']} + ch * {NR}")
                body.line(f"{name}(p0, woff, {xbuf}, {xoff}, {ybuf}, yoff, {dw_plane}, {Kq}, p5[ch], p2, p3, oc0, p6[ch])")
            else:
                body.line(f"yoff = (n * {OC} + oc0) * {OH * OW} + p6[ch]")
                body.line(f"{name}(p0, woff, {xbuf}, {xoff}, {ybuf}, yoff, {OH * OW}, {Kq}, p5[ch], p2, p3, oc0)")
            if OC % MR:
                body.dedent()

    want = work_items() if 2 * OC * C * T * OH * OW * N >= MIN_SPLIT_OPS else 1
    label = f"int8 (vnni conv{', im2col' if im2col else ''}, {out} out)"
    pad = [] if chained else [KernelCall(pad_kernel, pad_args, pad_work, node.name, precision=label)]
    if plan["rows_mr"] and not into and not onto:
        return pad + [_row_conv_call(plan, node, quads, y, want)]
    body = Source().indent()
    extra_args, extra_types = [], ()
    if im2col:
        # an item is a block of chunks: each chunk's patches are gathered into the item's own
        # Kq x NR quads (L1-sized: 7x7x3, 64 lanes: 9.5 KB), then every tile of output channels
        # runs on them while they are in cache
        r_blocks = max(1, min(chunks, want))
        rpb = -(-chunks // r_blocks)
        r_blocks = -(-chunks // rpb)
        items = N * r_blocks
        gathered = scratch_value(graph, node, (items * Kq * NR * 4,), np.uint8, tag="im2col")
        extra_args, extra_types = [koffs, gathered], ("int64", "uint8")
        body.line("for item in range(begin, end):").indent()
        body.line(f"rb = item % {r_blocks}").line(f"n = item // {r_blocks}")
        body.line(f"sc = item * {Kq * NR * 4}")
        body.line(f"for ch in range(rb * {rpb}, min(rb * {rpb} + {rpb}, {chunks})):").indent()
        body.line(f"xb = n * {C * phases * plane} + ch * {NR}")
        body.line(f"for q in range({Kq}):").indent()
        for h in range(4):
            body.line(f"o{h} = xb + p7[q * 4 + {h}]")
        body.line(f"d = sc + q * {NR * 4}")
        body.line(f"for j in range({NR}):").indent()
        for h in range(4):
            body.line(f"p8[d + j * 4 + {h}] = p1[o{h} + j]")
        body.dedent().dedent()
        body.line(f"for tile in range({tiles}):").indent()
        emit_tile(body, "p8", "sc")
        work = items
    else:
        t_blocks = min(tiles, want)
        r_blocks = max(1, min(chunks, -(-want // t_blocks)))
        tpb, rpb = -(-tiles // t_blocks), -(-chunks // r_blocks)
        t_blocks, r_blocks = -(-tiles // tpb), -(-chunks // rpb)
        body.line("for item in range(begin, end):").indent()
        body.line(f"rb = item % {r_blocks}").line(f"tb = (item // {r_blocks}) % {t_blocks}")
        body.line(f"n = item // {r_blocks * t_blocks}")
        body.line(f"for tile in range(tb * {tpb}, min(tb * {tpb} + {tpb}, {tiles})):").indent()
        body.line(f"for ch in range(rb * {rpb}, min(rb * {rpb} + {rpb}, {chunks})):").indent()
        emit_tile(body, "p1", f"(n * {phases * Cq * plane} + ch * {NR}) * 4")
        work = N * t_blocks * r_blocks
    head = Source()
    for name, uk in sorted(specs.values()):
        for line in uk.declaration(name).splitlines():
            head.line(line)
    head.line(kernel_header(8 + len(extra_args)))
    conv = Kernel("QConv", head.text() + body.text(), ("int8", "uint8", "int32", "float32", "float32", "int64",
                                                       "int64") + extra_types + (np.dtype(y.dtype).name,),
                  self_sized=True)
    return pad + [
            KernelCall(conv, [packed.reshape(-1), quads, comp.astype(np.int32), mult, np.zeros(1, np.float32),
                              masks, plan["stores"] if into or onto else starts] + extra_args
                       + [target if into or onto else y.name], work, node.name, n_outputs=1 + im2col,
                       precision=label)]


def _row_conv_call(plan, node, quads, y, want) -> KernelCall:
    """The conv on Int8RowConvSpec tiles (output channels in the lanes): a tile is rows_mr pixels of
    one output row x ROWS_NR channels; a work item a block of channel blocks of one image, whose
    weights (Cq x T x 32 x 4 bytes a block) stay in cache over the plane's pixel tiles."""
    N, C, Cq, T, OC, OH, OW, Wps, plane, phases, taps, wdata = (plan[k] for k in (
        "N", "C", "Cq", "T", "OC", "OH", "OW", "Wps", "plane", "phases", "taps", "wdata"))
    mr, nr = plan["rows_mr"], ROWS_NR
    blocks = OC // nr
    packed = np.zeros((OC, Cq * 4, T), np.int8)
    packed[:, :C] = wdata.reshape(OC, C, T)
    packed = np.ascontiguousarray(packed.reshape(blocks, nr, Cq, 4, T).transpose(0, 2, 4, 1, 3))
    uk = Int8RowConvSpec(mr=mr, nr=nr, taps=tuple(taps), plane=plane, out=plan["out"], zy=plan["zero_y"])
    o_blocks = max(1, min(blocks, want))
    opb = -(-blocks // o_blocks)
    o_blocks = -(-blocks // opb)
    src = Source()
    for line in uk.declaration("uk").splitlines():
        src.line(line)
    src.line(kernel_header(5)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"ob = item % {o_blocks}").line(f"n = item // {o_blocks}")
    src.line(f"for b in range(ob * {opb}, min(ob * {opb} + {opb}, {blocks})):").indent()
    src.line(f"for oh in range({OH}):").indent()
    src.line(f"for ow in range(0, {OW}, {mr}):").indent()
    src.line(f"xoff = (n * {phases * Cq * plane} + oh * {Wps} + ow) * 4")
    src.line(f"yoff = (n * {OC} + b * {nr}) * {OH * OW} + oh * {OW} + ow")
    src.line(f"uk(p0, b * {Cq * T * nr * 4}, p1, xoff, p4, yoff, {OH * OW}, {Cq}, p2, p3, b * {nr})")
    conv = Kernel("QConvRows", src.text(), ("int8", "uint8", "int32", "float32", np.dtype(y.dtype).name),
                  self_sized=True)
    return KernelCall(conv, [packed.reshape(-1), quads, plan["comp"][:OC].astype(np.int32), plan["mult"][:OC],
                             y.name], N * o_blocks, node.name, precision=f"int8 (vnni conv, channel lanes, {plan['out']} out)")


def _same(a, b) -> bool:
    return a is not None and b is not None and a.name == b.name


def conv_into_depthwise(node, graph):
    """(the depthwise QLinearConv, its _dw_plan) where this QLinearConv on the VNNI kernel writes
    that conv's zero-padded input planes itself, else None: the depthwise alone reads this output, it
    pads uint8 input as it is (no +128 copy), its input zero point is this output's, this conv's
    grid widened to the padded width reaches no tap outside its row (Int8ConvBlendSpec stores whole
    grid rows: the padding columns get the zero point), and no depthwise before writes this conv's
    quads (depthwise_quad_consumer decides first). MobileNet's expansion -> depthwise pairs: the
    depthwise's QDwPad copy shrinks to its top and bottom rows."""
    if node.op != "QLinearConv" or node.domain or not vnni_target():
        return None
    y = node.outputs[0]
    users = graph.consumers().get(y, [])
    if y in graph.outputs or len(users) != 1:
        return None
    user = users[0]
    if user.op != "QLinearConv" or user.domain or user.inputs[0] != y or y in user.inputs[1:]:
        return None
    dw = _node_plan(_dw_plan, user, graph)
    if dw is None or dw["shift"] or dw["x_dtype"] != "uint8":
        return None
    own = _node_plan(_vnni_plan, node, graph)
    if own is None or own["out"] != "u8" or own["zero_y"] != dw["zero_x"]:
        return None
    if _input_written(node, graph):
        return None
    if _node_plan(lambda *a: _vnni_plan(*a, grid=(dw["Wp"], dw["pl"])), node, graph) is None:
        return None
    return user, dw


def _input_written(node, graph) -> bool:
    """Whether the node before writes this conv's quads itself (its grid is then the default one)."""
    producer = graph.producers().get(node.inputs[0])
    return producer is not None and (_same(depthwise_quad_consumer(producer, graph), node)
                                     or _same((conv_into_conv(producer, graph) or (None,))[0], node))


def conv_into_conv(node, graph):
    """(the QLinearConv, its _vnni_plan) where this VNNI QLinearConv writes the next conv's channel
    quads itself, else None: the next conv alone reads this output, has stride 1 and uint8 input with
    this output's zero point, C a multiple of 4; this conv computes on the next one's grid (rows as
    wide, shifted by its left pad; QUAD_TILES, rows in whole quads) and stores whole rows
    interleaved, the padding columns as the zero point (Int8ConvBlendSpec quads); the next conv
    fills only its top and bottom rows (QuadBorder). ResNet's conv1 -> conv2."""
    if node.op != "QLinearConv" or node.domain or not vnni_target():
        return None
    y = node.outputs[0]
    users = graph.consumers().get(y, [])
    if y in graph.outputs or len(users) != 1:
        return None
    user = users[0]
    if user.op != "QLinearConv" or user.domain or user.inputs[0] != y or y in user.inputs[1:]:
        return None
    nxt = _node_plan(_vnni_plan, user, graph)
    if nxt is None or nxt["s"] != 1 or nxt["x_dtype"] != "uint8" or nxt["C"] % 4:
        return None
    own = _node_plan(_vnni_plan, node, graph)
    if own is None or own["out"] != "u8" or own["zero_y"] != nxt["zero_x"] or _input_written(node, graph):
        return None
    if own["rows_mr"]:      # a small plane: its own output with channels in the lanes, the next conv pads
        return None
    if _node_plan(lambda *a: _vnni_plan(*a, grid=(nxt["Wps"], nxt["pl"]), quad_out=True), node, graph) is None:
        return None
    return user, nxt


# ---------------------------------------------------------------- depthwise

def _dw_plan(node, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads) -> dict | None:
    """What lower_qlinear_depthwise computes before it emits, or None where it does not apply."""
    if len(x.shape) != 4 or not (w.is_const and sx.is_const and sw.is_const and sy.is_const
                                 and (zx is None or zx.is_const) and (zw is None or zw.is_const)
                                 and (zy is None or zy.is_const) and (bias is None or bias.is_const)):
        return None
    N, C, H, W = x.shape
    OC, cg, KH, KW = w.shape
    if int(node.attr("group", 1)) != C or OC != C or cg != 1 or KH * KW > 49:
        return None
    if any(np.dtype(v.dtype).name != "float32" for v in (sx, sw, sy)) or sx.size != 1 or sy.size != 1:
        return None
    _, _, OH, OW = y.shape
    strides, dil = list(node.attr("strides", [1, 1])), list(node.attr("dilations", [1, 1]))
    pt, pl = pads
    Hp = max(H + pt, (OH - 1) * strides[0] + (KH - 1) * dil[0] + 1)
    Wp = max(W + pl, (OW - 1) * strides[1] + (KW - 1) * dil[1] + 1)
    wdata = np.asarray(w.data).astype(np.int64).reshape(C, KH * KW)
    if zw is not None:
        wdata = wdata - np.asarray(zw.data).astype(np.int64).reshape(-1, 1)
    x_dtype, y_dtype = np.dtype(x.dtype).name, np.dtype(y.dtype).name
    # the VNNI rows kernel: up to 4 taps a kernel row, 16 windows in 64 bytes, weights within int8;
    # it reads unsigned bytes, so int8 inputs are copied + 128 (and their zero point with them)
    rows = (vnni_target() and KW <= 4 and strides[0] == strides[1] and dil[0] == dil[1]
            and strides[0] * 15 + (KW - 1) * dil[1] < 64 and wdata.min(initial=0) >= -128
            and wdata.max(initial=0) <= 127)
    shift = 128 if rows and x_dtype == "int8" else 0
    pad_dtype = "uint8" if shift else x_dtype
    zero_x = int(np.asarray(zx.data).reshape(-1)[0]) if zx is not None else 0
    comp = -(zero_x + shift) * wdata.sum(axis=1)
    if bias is not None:
        comp = comp + np.asarray(bias.data, np.int64).reshape(-1)
    if np.abs(comp).max(initial=0) >= 2**31 or np.abs(wdata).max(initial=0) > 255:
        return None
    mult = ((np.asarray(sx.data, np.float32).reshape(-1)[0]
             * np.broadcast_to(np.asarray(sw.data, np.float32).reshape(-1), (C,))) / np.asarray(sy.data, np.float32).reshape(-1)[0]).astype(np.float32)
    lo, hi = (0, 255) if y_dtype == "uint8" else (-128, 127)
    zero_y = int(np.asarray(zy.data).reshape(-1)[0]) if zy is not None else 0
    # slack: the flat loop's last positions (the micro-kernel's: whole groups of 64, each row read
    # as 64 bytes) read up to s * OH * Wp + taps past a plane's start
    slack = max(0, strides[0] * (OH * Wp + 64) + (KH - 1) * dil[0] * Wp + 64 - Hp * Wp) + 64
    padded_size = N * C * Hp * Wp + slack
    return dict(locals())


def _node_plan(planner, node, graph) -> dict | None:
    """`planner` (_vnni_plan or _dw_plan) of a QLinearConv node, its inputs read as quant.py reads them."""
    x, sx, zx, w, sw, zw, sy, zy, bias = (node_input(node, graph, k) for k in range(9))
    y = graph.values[node.outputs[0]]
    if len(x.shape) != 4 or len(y.shape) != 4 or len(w.shape) != 4:
        return None
    pads = conv_pads(node, list(x.shape[2:]), list(w.shape[2:]), list(node.attr("strides", [1, 1])),
                      list(node.attr("dilations", [1, 1])), list(y.shape[2:]))
    return planner(node, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads)


def depthwise_quad_consumer(node, graph):
    """The QLinearConv that alone reads the output of this depthwise QLinearConv where the depthwise
    kernel can write that output straight into the conv's channel quads (Int8DwQuadSpec), else None:
    the reader is a 1x1, stride 1, unpadded conv on the VNNI kernel (its quads are then the
    depthwise output's pixels in order, channel c at byte c % 4 of quad c // 4), the depthwise takes
    the VNNI rows path with uint8 output, C is a multiple of 4 (every quad whole) and the reader's
    input zero point is the depthwise output's. MobileNet's depthwise -> projection pairs: the
    compaction of the depthwise's padded grid and the projection's QuadPad copy both go."""
    if node.op != "QLinearConv" or node.domain or not vnni_target():
        return None
    y = node.outputs[0]
    users = graph.consumers().get(y, [])
    if y in graph.outputs or len(users) != 1:
        return None
    user = users[0]
    if user.op != "QLinearConv" or user.domain or user.inputs[0] != y or y in user.inputs[1:]:
        return None
    dw = _node_plan(_dw_plan, node, graph)
    if dw is None or not dw["rows"] or dw["y_dtype"] != "uint8" or dw["C"] % 4:
        return None
    conv = _node_plan(_vnni_plan, user, graph)
    if conv is None or (conv["KH"], conv["KW"], conv["s"], conv["pt"], conv["pl"]) != (1, 1, 1, 0, 0):
        return None
    if (conv["OH"], conv["OW"], conv["Hps"], conv["Wps"]) != (conv["H"], conv["W"], conv["H"], conv["W"]):
        return None
    if conv["x_dtype"] != "uint8" or conv["zero_x"] != dw["zero_y"]:
        return None
    return user


def lower_qlinear_depthwise(node, graph, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads) -> list | None:
    """A depthwise QLinearConv (group = C = output channels, 2-D): the input copied into planes padded
    with z_x, then per (image, channel) plane the int32 sums of w' (x - z_x) (w' = w - z_w) as
    sum w' x + (bias - z_x sum w'), requantised as QLinearConv does, over the plane's flat padded
    grid: on VNNI one `vpdpbusd` a kernel row (ukernel_int8.Int8DwSpec; int8 inputs copied + 128),
    elsewhere one loop with the taps unrolled that vectorises in int32 lanes."""
    plan = _dw_plan(node, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads)
    if plan is None:
        return None
    (N, C, H, W, OH, OW, KH, KW, strides, dil, pt, pl, Hp, Wp, wdata, x_dtype, y_dtype, rows, shift, pad_dtype,
     zero_x, comp, mult, lo, hi, zero_y) = (plan[k] for k in (
        "N", "C", "H", "W", "OH", "OW", "KH", "KW", "strides", "dil", "pt", "pl", "Hp", "Wp", "wdata", "x_dtype",
        "y_dtype", "rows", "shift", "pad_dtype", "zero_x", "comp", "mult", "lo", "hi", "zero_y"))
    from .scratch import scratch_value
    slack = plan["slack"]
    padded = scratch_value(graph, node, (plan["padded_size"],), pad_dtype, tag="dwpad")
    fill = f"np.{pad_dtype}({zero_x + shift})"
    producer = graph.producers().get(x.name)
    if producer is not None and _same((conv_into_depthwise(producer, graph) or (None,))[0], node):
        # the conv before wrote rows pt .. pt + H - 1 (padding columns included): the rest is filled
        pad = Source().line(NOALIAS_MARK).line(kernel_header(1)).indent()
        pad.line("for item in range(begin, end):").indent()
        pad.line(f"ob = item * {Hp * Wp}")
        pad.line(f"for i in range({pt * Wp}):").indent().line(f"p0[ob + i] = {fill}").dedent()
        pad.line(f"for i in range({(pt + H) * Wp}, {Hp * Wp}):").indent().line(f"p0[ob + i] = {fill}").dedent()
        pad.dedent()
        pad.line(f"if end == {N * C}:").indent()
        pad.line(f"for i in range({slack}):").indent()
        pad.line(f"p0[{N * C * Hp * Wp} + i] = {fill}")
        pad_call = KernelCall(Kernel("QDwBorder", pad.text(), (pad_dtype,)), [padded], N * C, node.name,
                              precision="int8 (depthwise, input written by the conv before)")
    else:
        pad_call = None
    copy = "p0[ib + ww]" if not shift else "np.uint8(np.int32(p0[ib + ww]) + 128)"
    pad = Source().line(NOALIAS_MARK).line(kernel_header(2)).indent()
    pad.line("for item in range(begin, end):").indent()
    pad.line(f"for hh in range({Hp}):").indent()
    pad.line(f"h = hh - {pt}")
    pad.line(f"ob = (item * {Hp} + hh) * {Wp}")
    pad.line(f"if h >= 0 and h < {H}:").indent()
    pad.line(f"ib = (item * {H} + h) * {W}")
    # the row: pad columns, then a plain copy (vectorised), then pad columns
    wend = min(Wp, pl + W)
    pad.line(f"for ww in range({pl}):").indent().line(f"p1[ob + ww] = {fill}").dedent()
    pad.line(f"for ww in range({wend - pl}):").indent().line(f"p1[ob + {pl} + ww] = {copy}").dedent()
    pad.line(f"for ww in range({wend}, {Wp}):").indent().line(f"p1[ob + ww] = {fill}").dedent()
    pad.dedent()
    pad.line("else:").indent()
    pad.line(f"for ww in range({Wp}):").indent()
    pad.line(f"p1[ob + ww] = {fill}")
    pad.dedent().dedent().dedent().dedent()
    pad.line(f"if end == {N * C}:").indent()
    pad.line(f"for i in range({slack}):").indent()
    pad.line(f"p1[{N * C * Hp * Wp} + i] = {fill}")
    pad_kernel = Kernel("QDwPad", pad.text(), (x_dtype, pad_dtype))

    # Flat over each plane's padded grid: output position p = oh * Wp + ow reads x at s*p + tap offset
    # (one loop of OH * Wp iterations that vectorises, where a row of 7 or 14 would not); the
    # columns ow >= OW are computed and dropped when the rows are copied out.
    flat = OH * Wp
    consumer = depthwise_quad_consumer(node, graph) if rows else None
    if consumer is not None:
        # the 1x1 conv's quads (the scratch value it names, sized as it sizes it): pixel p of quad q
        # at ((n * Cq + q) * OH * OW + p) * 4; groups of 64 grid positions with build-time tables of
        # their output lanes and first output pixel
        conv = _node_plan(_vnni_plan, consumer, graph)
        Cq = C // 4
        quads = scratch_value(graph, consumer, (N * Cq * conv["plane"] * 4 + conv["slack"],), np.uint8, tag="quads")
        groups = -(-flat // 64)
        pos = np.arange(groups * 64).reshape(groups, 64)
        valid = (pos < flat) & (pos % Wp < OW)
        masks = (valid.astype(np.uint64) << np.arange(64, dtype=np.uint64)).sum(axis=1, dtype=np.uint64).view(np.int64)
        starts = np.concatenate([[0], np.cumsum(valid.sum(axis=1))[:-1]]).astype(np.int64)
        uk = Int8DwQuadSpec(kh=KH, kw=KW, wp=Wp, xplane=Hp * Wp, s=strides[0], d=dil[0], zy=zero_y)
        wrows = np.zeros((C, KH, 4), np.int8)
        wrows[:, :, :KW] = wdata.reshape(C, KH, KW)
        src = Source()
        for line in uk.declaration("dwquad").splitlines():
            src.line(line)
        src.line(NOALIAS_MARK).line(kernel_header(7)).indent()
        src.line("for item in range(begin, end):").indent()
        src.line(f"q = item % {Cq}").line(f"n = item // {Cq}")
        src.line(f"dwquad(p0, (n * {C} + q * 4) * {Hp * Wp}, p1, q * {4 * KH * 4}, p6, item * {conv['plane'] * 4}, "
                 f"{groups}, p2, p3, q * 4, p4, p5)")
        kernel = Kernel("QDwConvQuads", src.text(), ("uint8", "int8", "int32", "float32", "int64", "int64", "uint8"))
        label = "int8 (depthwise, vnni, quads out)"
        return [pad_call or KernelCall(pad_kernel, [x.name, padded], N * C, node.name, precision=label),
                KernelCall(kernel, [padded, wrows.reshape(-1), comp.astype(np.int32), mult, masks, starts, quads],
                           N * Cq, node.name, precision=label)]
    sflat = scratch_value(graph, node, (N * C * flat,), y.dtype, tag="dwflat")
    if rows:
        rows_uk = Int8DwSpec(kh=KH, kw=KW, wp=Wp, s=strides[0], d=dil[0], out="u8" if y_dtype == "uint8" else "s8",
                             zy=zero_y)
        # each kernel row's 4 bytes of weights (zero past kw) and the multiplier's bits (an i64 argument)
        wrows = np.zeros((C, KH, 4), np.int8)
        wrows[:, :, :KW] = wdata.reshape(C, KH, KW)
        src = Source()
        for line in rows_uk.declaration("dwrow").splitlines():
            src.line(line)
        src.line(NOALIAS_MARK).line(kernel_header(6)).indent()
        src.line("for item in range(begin, end):").indent()
        src.line(f"c = item % {C}")
        src.line(f"fb = item * {flat}").line(f"yb = item * {OH * OW}")
        src.line(f"dwrow(p0, item * {Hp * Wp}, p1, c * {KH * 4}, p4, fb, {flat}, np.int64(p2[c]), np.int64(p3[c]))")
        src.line(f"for oh in range({OH}):").indent()
        src.line(f"for ow in range({OW}):").indent()
        src.line(f"p5[yb + oh * {OW} + ow] = p4[fb + oh * {Wp} + ow]")
        conv = Kernel("QDwConv", src.text(), ("uint8", "int8", "int32", "int32", y_dtype, y_dtype))
        label = "int8 (depthwise, vnni)"
        return [pad_call or KernelCall(pad_kernel, [x.name, padded], N * C, node.name, precision=label),
                KernelCall(conv, [padded, wrows.reshape(-1), comp.astype(np.int32), mult.view(np.int32), sflat, y.name],
                           N * C, node.name, precision=label, n_outputs=2)]
    src = Source().line(NOALIAS_MARK).line(kernel_header(6)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"c = item % {C}")
    src.line(f"xb = item * {Hp * Wp}").line(f"fb = item * {flat}").line(f"yb = item * {OH * OW}")
    src.line("cz = p2[c]").line("m = p3[c]")
    for t in range(KH * KW):
        src.line(f"w{t} = np.int32(p1[c * {KH * KW} + {t}])")
    src.line(f"for p in range({flat}):").indent()
    src.line(f"i = xb + p * {strides[0]}")
    terms = [f"w{kh * KW + kw} * np.int32(p0[i + {kh * dil[0] * Wp + kw * dil[1]}])" for kh in range(KH) for kw in range(KW)]
    src.line("acc = cz + " + " + ".join(terms))
    src.line(f"v = np.rint(np.float32(acc) * m) + np.float32({zero_y})")
    src.line(f"p4[fb + p] = np.{y_dtype}(np.int32(min(max(v, np.float32({lo})), np.float32({hi}))))").dedent()
    src.line(f"for oh in range({OH}):").indent()
    src.line(f"for ow in range({OW}):").indent()
    src.line(f"p5[yb + oh * {OW} + ow] = p4[fb + oh * {Wp} + ow]")
    conv = Kernel("QDwConv", src.text(), (x_dtype, "int32", "int32", "float32", y_dtype, y_dtype))
    label = "int8 (depthwise)"
    return [pad_call or KernelCall(pad_kernel, [x.name, padded], N * C, node.name, precision=label),
            KernelCall(conv, [padded, wdata.astype(np.int32).reshape(-1), comp.astype(np.int32), mult, sflat, y.name],
                       N * C, node.name, precision=label, n_outputs=2)]
