"""Depthwise 2-D convolutions with stride 1, many taps or narrow rows: 16 channels in the vector lanes.

The row kernel (dwstride.py, DwRowSpec) puts a row's outputs in the lanes: a 7 x 7
plane is too narrow for it (the direct kernel's flat loop then: ConvNeXt's last stage,
384 channels of 7 x 7 with 7 x 7 taps, ran 4.8 x onnxruntime's time), and with 7 x 7
taps each output row reads 7 rows x 7 shifted vectors. Here a work item is (image,
block of 16 channels):

    xT[r][w][c] = x[c0 + c][r - p_t][w]       rows of zeros above and below (r < p_t, r >= p_t + H)
    yT[oh][ow][c] = b[c] + sum_{kh, kw} w[c][kh][kw] * xT[oh + kh][ow + kw - p_l][c]
    y[c0 + c][oh][ow] = yT[oh][ow][c]

xT and yT live in the item's scratch; the two transposes are 16 x 16 shuffle blocks
(ukernel.TBlockSpec), the positions past the last whole block one float at a time;
each output row is one call of the DwLanesSpec micro-kernel (ukernel.DwLanesSpec; its IR is here) per piece of at most
MAX_OUT_WIDTH outputs: their accumulators stay in registers, each tap's weights are
one vector load, and the taps outside the row's columns are left out at compile
time. Channels past C (a last partial block) are zeros in, not written out. `prefer`
is the selection rule against the row kernel.
"""
from __future__ import annotations

import numpy as np

from .kernel import Kernel, KernelCall, Source, kernel_header, literal, session_threads
from .dwstride import MIN_OUT_WIDTH_S1
from .scratch import scratch_value
from .ukernel import DWLANES, TBLOCK, DwLanesSpec, IRBuilder, TBlockSpec, lanes_for

LANES = DWLANES      # channels per work item (one zmm; two ymm or four xmm on narrower targets)
MAX_OUT_WIDTH = 16   # accumulators of one call: one vector per output on AVX-512
MAX_ROW = 64         # wider rows: the item's scratch (input and output of 16 channels) outgrows L2
MANY_TAPS = 25       # see prefer


def dwlanes_ir(spec: DwLanesSpec, vector_bits: int) -> str:
    L = min(lanes_for(vector_bits), LANES)
    V = LANES // L
    vt = f"<{L} x float>"
    T = spec.KH * spec.KW
    ir = IRBuilder()

    def load(base: str, offset: int) -> str:
        ptr, val = ir.tmp("p"), ir.tmp("v")
        ir(f"{ptr} = getelementptr float, ptr {base}, i64 {offset}")
        ir(f"{val} = load {vt}, ptr {ptr}, align 4")
        return val

    acc = {(ow, v): None for ow in range(spec.OW) for v in range(V)}
    for v in range(V):
        bias = load("%wb", T * LANES + v * L)
        for ow in range(spec.OW):
            acc[ow, v] = bias
    for kh in range(spec.KH):
        for kw in range(spec.KW):
            for v in range(V):
                wv = load("%wb", (kh * spec.KW + kw) * LANES + v * L)
                for ow in range(spec.OW):
                    iw = spec.ow0 + ow + kw - spec.p_l
                    if 0 <= iw < spec.W:
                        xv = load("%xb", (kh * spec.W + iw - spec.ow0) * LANES + v * L)
                        out = ir.tmp("f")
                        ir(f"{out} = call {vt} @llvm.fma.v{L}f32({vt} {wv}, {vt} {xv}, {vt} {acc[ow, v]})")
                        acc[ow, v] = out
    for (ow, v), val in acc.items():
        ptr = ir.tmp("p")
        ir(f"{ptr} = getelementptr float, ptr %yb, i64 {ow * LANES + v * L}")
        ir(f"store {vt} {val}, ptr {ptr}, align 4")
    body = "\n".join(ir.lines)
    return (f"define i32 @{spec.name}(ptr noalias %x, i64 %xoff, ptr noalias %w, i64 %woff, ptr noalias %y, "
            f"i64 %yoff) #0 {{\nentry:\n"
            f"  %xb = getelementptr float, ptr %x, i64 %xoff\n  %wb = getelementptr float, ptr %w, i64 %woff\n"
            f"  %yb = getelementptr float, ptr %y, i64 %yoff\n{body}\n  ret i32 0\n}}\n\n"
            f"declare {vt} @llvm.fma.v{L}f32({vt}, {vt}, {vt})\n\nattributes #0 = {{ nounwind }}\n")


def prefer(dtype, X, W, B, group, kernel, strides, dilations, Y, epilogue) -> bool:
    """Depthwise, stride 1, no dilation, rows of at most MAX_ROW outputs, at least one whole block
    of channels, nothing after the bias (no activation, no residual); and either more than
    MANY_TAPS taps or rows too narrow for DwRowSpec (dwstride.MIN_OUT_WIDTH_S1). One node, CPU
    time per call against the row kernel (AMD Zen 4, 1 thread): 7 x 7 taps 0.234 -> 0.162 ms at
    48 x 56 x 56, 0.122 -> 0.078 at 96 x 28 x 28, 0.059 -> 0.040 at 192 x 14 x 14, and against the
    direct kernel 0.149 -> 0.021 at 384 x 7 x 7; 3 x 3 taps at 7 x 7 0.035 -> 0.018. With 3 x 3
    taps on rows the row kernel takes, the two transposes cost more than its idle lanes (96 x 56 x
    56: 0.073 -> 0.110 ms), 5 x 5 came out level: those stay on the row kernel."""
    C = int(X.shape[1]) if len(X.shape) == 4 else 0
    if not (np.dtype(dtype) == np.float32 and len(X.shape) == 4 and W.is_const and (B is None or B.is_const)
            and group == C and C >= LANES and tuple(W.shape[:2]) == (C, 1) and list(strides) == [1, 1]
            and list(dilations) == [1, 1] and 1 <= int(Y.shape[3]) <= MAX_ROW
            and epilogue.residual is None and not epilogue.activation):
        return False
    return kernel[0] * kernel[1] > MANY_TAPS or int(Y.shape[3]) < MIN_OUT_WIDTH_S1


def packed_weights(W, B, C: int, KH: int, KW: int) -> np.ndarray:
    """[channel block][tap, then the bias][16 channels], channels past C zero."""
    blocks = -(-C // LANES)
    packed = np.zeros((blocks * LANES, KH * KW + 1), dtype=np.float32)
    packed[:C, :-1] = np.asarray(W, dtype=np.float32).reshape(C, KH * KW)
    if B is not None:
        packed[:C, -1] = np.asarray(B, dtype=np.float32).reshape(C)
    return np.ascontiguousarray(packed.reshape(blocks, LANES, KH * KW + 1).transpose(0, 2, 1))


def lower_dw_lanes(node, graph, X, W, B, Y, kernel, pads) -> KernelCall:
    N, C, H, Wd = (int(v) for v in X.shape)
    OH, OW = (int(v) for v in Y.shape[2:])
    KH, KW = (int(k) for k in kernel)
    p_t, p_l = int(pads[0]), int(pads[1])
    PH = OH + KH - 1                    # rows of xT: the input's, with p_t zero rows above and the rest below
    HW, OHW, row = H * Wd, OH * OW, Wd * LANES
    blocks = -(-C // LANES)
    T = KH * KW
    pieces = -(-OW // MAX_OUT_WIDTH)                 # a row in pieces of at most MAX_OUT_WIDTH outputs
    width = -(-OW // pieces)
    specs = [DwLanesSpec(W=Wd, OW=min(width, OW - ow0), KH=KH, KW=KW, p_l=p_l, ow0=ow0) for ow0 in range(0, OW, width)]
    slot = PH * row + OHW * LANES
    one_slot = session_threads() == 1
    scratch = scratch_value(graph, node, ((1 if one_slot else N * blocks) * slot,), np.float32, tag="dwlanes")
    zero = literal(0, np.float32)

    src = Source()
    for line in TBlockSpec().declaration("tblock").splitlines():
        src.line(line)
    for k, spec in enumerate(specs):
        for line in spec.declaration(f"dwlanes{k}").splitlines():
            src.line(line)
    # Pointers: p0 x, p1 packed weights, p2 scratch, p3 y
    src.line(kernel_header(4)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {blocks}").line(f"cb = item % {blocks}").line(f"c0 = cb * {LANES}")
    src.line("so = 0" if one_slot else f"so = item * {slot}")
    src.line(f"xo = n * {C * HW} + c0 * {HW}").line(f"yo = n * {C * OHW} + c0 * {OHW}")
    src.line(f"xs = so + {p_t * row}").line(f"ys = so + {PH * row}")
    src.line(f"for i in range({p_t * row}):").indent().line(f"p2[so + i] = {zero}").dedent()
    src.line(f"for i in range({(p_t + H) * row}, {PH * row}):").indent().line(f"p2[so + i] = {zero}").dedent()
    whole_in = f"tblock(p0, xo + q0, {HW}, p2, xs + q0 * {LANES}, {LANES})"
    whole_out = f"tblock(p2, ys + q0 * {LANES}, {LANES}, p3, yo + q0, {OHW})"
    gather_in = f"p2[xs + q * {LANES} + c] = p0[xo + c * {HW} + q]"
    scatter_out = f"p3[yo + c * {OHW} + q] = p2[ys + q * {LANES} + c]"
    partial = C % LANES != 0
    if partial:   # a last block with fewer channels: the missing lanes are zeros
        src.line(f"if c0 + {LANES} > {C}:").indent()
        src.line(f"for i in range({HW * LANES}):").indent().line(f"p2[xs + i] = {zero}").dedent()
        src.line(f"for q in range({HW}):").indent().line(f"for c in range({C} - c0):").indent()
        src.line(gather_in).dedent().dedent().dedent().line("else:").indent()
    _tile_loop(src, HW, whole_in, gather_in)
    if partial:
        src.dedent()
    src.line(f"for oh in range({OH}):").indent()
    for k, spec in enumerate(specs):
        src.line(f"dwlanes{k}(p2, so + oh * {row} + {spec.ow0 * LANES}, p1, cb * {(T + 1) * LANES}, "
                 f"p2, ys + oh * {OW * LANES} + {spec.ow0 * LANES})")
    src.dedent()
    if partial:
        src.line(f"if c0 + {LANES} > {C}:").indent()
        src.line(f"for q in range({OHW}):").indent().line(f"for c in range({C} - c0):").indent()
        src.line(scatter_out).dedent().dedent().dedent().line("else:").indent()
    _tile_loop(src, OHW, whole_out, scatter_out)
    if partial:
        src.dedent()
    packed = packed_weights(W.data, None if B is None else B.data, C, KH, KW)
    kernel_obj = Kernel("Conv", src.text(), ("float32",) * 4, self_sized=True)
    return KernelCall(kernel_obj, [X.name, packed, scratch, Y.name], N * blocks, node.name, n_outputs=2)


def _tile_loop(src: Source, count: int, tile_call: str, one_float: str) -> None:
    """16 whole channels over `count` positions: 16 x 16 tiles, then the positions past the last one."""
    full = count - count % TBLOCK
    if full:
        src.line(f"for q0 in range(0, {full}, {TBLOCK}):").indent().line(tile_call).dedent()
    if full < count:
        src.line(f"for q in range({full}, {count}):").indent().line(f"for c in range({LANES}):").indent()
        src.line(one_float).dedent().dedent()
