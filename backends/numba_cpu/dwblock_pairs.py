"""bf16 DepthwiseBlocks (backends/numba_cpu/dwblock.py, a block marked bf16): the 1x1 convs' GEMM
on bf16 channel pairs (PairGemm), and the block split by channels instead of row bands
(lower_by_channels) for small planes on several threads.

lower_by_channels: two calls, each the whole plane of an image:

    1. items (image, block of expanded channels [m_lo, m_hi), whole micro-tile panels): x's
       channel pairs (all C0 channels, the whole plane) into the item's 16-bit scratch;
       t[m_lo:m_hi] = act1(W1[m_lo:m_hi] @ x + b1) into its float32 scratch; the depthwise rows
       of those channels write u in channel pairs into one buffer of the plane all items share
       (blocks of whole pairs: the items write disjoint pair rows)
    2. items (image, block of output channels): y[block] = act3(W3[block] @ u + b3) [+ r]

With row bands a 7 x 7 plane on two threads runs as two bands of 4 and 3 rows: the first
computes 5 rows of t (its halo), the second 4, so the slower thread holds ~0.64 of the block's
work, and each GEMM sees 21-28 columns. Split by channels, each item's GEMMs see the whole
plane's columns and nothing is computed twice; the price is u's round trip through L2 between
the calls (the whole plane's u: 94 KB for MobileNetV2's 960 x 7 x 7). The sums and roundings
are the banded kernel's (the bound in dwblock.py holds as it is): only who computes what changes.
"""
from __future__ import annotations

import numpy as np

from .dwblock_out16 import PairGemmOut16, row_tiles, takes_out16
from .dwphase import PhaseRowCalls, PlaneRowCalls, emit_phase_copy, plane_eligible
from .dwstride import RowCalls, fmt, packed_weights
from .ukernel_lowp import store_rounding
from .epilogue import Epilogue, register_epilogue
from .gemm import TileLoops, bf16_k_pass, ceil_div, choose_tile, lowp_label
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, lowering_target
from .lowp import CvtSpec, PairCopySpec, PairCvtSpec, StridedPairCopySpec, best_method
from .lowp_pack import bf16_bits, pack_a_pairs
from .narrow import load, pointer_type, with_helpers
from .scratch import scratch_value
from .ukernel import LOADC_EPILOGUE
from .ukernel_lowp import LowpUKSpec

# On several threads, a bf16 block whose plane's share per thread (its rows over the threads) holds
# fewer pixels than this is split by channels instead (see the module docstring): MobileNetV2's 14 x 14
# and 7 x 7 blocks on two threads
SPLIT_PIXELS = 128
ITEMS_PER_THREAD = 2   # channel blocks per thread in each call (whole panels, balanced)
PLANE_ROWS = True      # small planes' depthwise rows a plane a call (dwphase.PlaneRowCalls), as dwblock.PLANE_ROWS
PHASE_ROWS = True      # stride-2 rows on phase-split t (dwphase.PhaseRowCalls), as dwblock.PHASE_ROWS


class PairGemm(TileLoops):
    """bf16 (a block marked bf16, passes/assign_precision.py): out[M x npx] = act(A @ B + bias) on
    ukernel_lowp's micro-kernel (`vdpbf16ps`, or "widen" FMAs without AVX512-BF16). A is rounded
    to bf16 and packed at build time in pair panels (lowp_pack.pack_a_pairs per pass of
    bf16_k_pass(K) k, passes one after the other; K padded to even with a zero column); B is read
    in the VNNI pair layout, pair row kp at b[boff + kp*ldb + 2j + h] (16-bit elements), columns
    past npx up to the tile's NR read but not stored (the buffer needs 2 NR elements of slack);
    out is float32, rows `ldc` apart."""

    def __init__(self, tag: str, weights: np.ndarray, bias_name: str, graph, epilogue: Epilogue, n_typical: int,
                 method: str):
        self.M, K = weights.shape
        Kp = K + K % 2
        MR, NR = choose_tile(self.M, n_typical)
        kc = bf16_k_pass(Kp)
        bits = np.zeros((self.M, Kp), np.uint16)
        bits[:, :K] = bf16_bits(weights)
        self.panels = np.concatenate([pack_a_pairs(bits[:, k0:k0 + kc], MR).ravel() for k0 in range(0, Kp, kc)])
        self.bias = np.zeros(ceil_div(self.M, MR) * MR, dtype=np.float32)
        if bias_name:
            self.bias[:self.M] = np.asarray(graph.values[bias_name].data, dtype=np.float32).reshape(self.M)
        fields = register_epilogue(True, epilogue)
        specs = {}
        for i, mr in enumerate(sorted({MR, self.M % MR} - {0})):
            spec = (f"{tag}{i}", LowpUKSpec(mr=mr, nr=NR, dtype="bf16", method=method, a_packed=1, a_panel=MR,
                                            **fields))
            specs[(mr, 0)] = specs[(mr, 1)] = spec   # B loads are never masked (the slack)
        super().__init__(tag, MR, NR, Kp, specs)
        self.kc = kc

    def declare(self, src: Source) -> None:
        for name, spec in sorted(set(self.specs.values())):
            for line in spec.declaration(name).splitlines():
                src.line(line)

    def emit(self, src: Source, pa, pb, boff, ldb, pc, coff, ldc, pbias, npx) -> None:
        t, panels = self.tag, ceil_div(self.M, self.MR) * self.MR

        def call(mr, m, masked):
            name = self.specs[(mr, masked)][0]
            src.line(f"{name}({pa}, {t}k0 * {panels} + {m} * {t}kc, 0, {pb}, {boff} + ({t}k0 >> 1) * {ldb} + 2 * {t}n0, "
                     f"{ldb}, {pc}, {coff} + {m} * {ldc} + {t}n0, {ldc}, {t}kc >> 1, {t}mask, {t}flags, {pbias}, {m})")
        self.loops(src, npx, self.M, self.M % self.MR,
                   f"min({t}k0, 1) + {LOADC_EPILOGUE} * ({t}k0 + {self.kc} >= {self.K})", call)

    def emit_rows(self, src: Source, pa, pb, boff, ldb, pc, coff, ldc, pbias, npx, m_lo, m_hi) -> None:
        """As emit, for the rows [m_lo, m_hi) only (m_lo a multiple of MR; m_hi too unless it is M),
        row m stored at out[coff + (m - m_lo)*ldc]."""
        t, MR, NR, K, kc = self.tag, self.MR, self.NR, self.K, self.kc
        panels = ceil_div(self.M, MR) * MR
        src.line(f"for {t}n0 in range(0, {npx}, {NR}):").indent()
        src.line(f"{t}nv = min({NR}, {npx} - {t}n0)")
        src.line(f"{t}mask = np.int64(-1) if {t}nv >= {NR} else (np.int64(1) << {t}nv) - np.int64(1)")
        src.line(f"for {t}k0 in range(0, {K}, {kc}):").indent()
        src.line(f"{t}kc = min({kc}, {K} - {t}k0)")
        src.line(f"{t}flags = min({t}k0, 1) + {LOADC_EPILOGUE} * ({t}k0 + {kc} >= {K})")

        def call(mr):
            name = self.specs[(mr, 0)][0]
            src.line(f"{name}({pa}, {t}k0 * {panels} + {t}m * {t}kc, 0, {pb}, {boff} + ({t}k0 >> 1) * {ldb} + 2 * {t}n0, "
                     f"{ldb}, {pc}, {coff} + ({t}m - {m_lo}) * {ldc} + {t}n0, {ldc}, {t}kc >> 1, {t}mask, {t}flags, "
                     f"{pbias}, {t}m)")
        row_tiles(src, t, m_lo, m_hi, self.M, MR, call)
        src.dedent().dedent()


def _blocks(M: int, MR: int, items: int) -> tuple[int, int]:
    """(blocks, rows per block): M rows in about `items` blocks of whole MR panels, balanced."""
    panels = ceil_div(M, MR)
    per = ceil_div(panels, min(panels, items))
    return ceil_div(panels, per), per * MR


def lower_by_channels(node, graph, method: str, threads: int, epilogues: tuple) -> Lowered:
    """The block as two calls split by channels (see the module docstring): x (float32 or bf16),
    both 1x1 convs present, u in bf16 pairs. `epilogues`: (expand, depthwise, project) Epilogues."""
    x_name, w1_name, b1_name, w2_name, b2_name, w3_name, b3_name, r_name = node.inputs
    X, W2, Y = (graph.values[n] for n in (x_name, w2_name, node.outputs[0]))
    N, C0, H, Wd = (int(v) for v in X.shape)
    C1, C2 = int(W2.shape[0]), int(Y.shape[1])
    KH, KW = (int(v) for v in W2.shape[2:])
    OH, OW = (int(v) for v in Y.shape[2:])
    s = int(node.attr("strides")[0])
    p_t, p_l = (int(v) for v in node.attr("pads")[:2])
    HW, OHW = H * Wd, OH * OW
    C0p, C1p = C0 + C0 % 2, C1 + C1 % 2
    ex_epi, dw_epi, pj_epi = epilogues
    w1 = np.asarray(graph.values[w1_name].data, dtype=np.float32).reshape(C1, C0)
    w3 = np.asarray(graph.values[w3_name].data, dtype=np.float32).reshape(C2, C1)
    gx = PairGemm("ex", w1, b1_name, graph, ex_epi, HW, method)
    r_dtype = graph.values[r_name].dtype if r_name else None
    out16 = takes_out16(pj_epi, fmt(Y), fmt(graph.values[r_name]) if r_name else None, C1)
    gp = (PairGemmOut16("pj", w3, b3_name, graph, pj_epi, OHW, method, bool(r_name)) if out16 else
          PairGemm("pj", w3, b3_name, graph, pj_epi, OHW, method))
    blocks1, rows1 = _blocks(C1, gx.MR, ITEMS_PER_THREAD * threads)
    blocks2, rows2 = _blocks(C2, gp.MR, ITEMS_PER_THREAD * threads)
    ldx, ldu = 2 * HW, 2 * OHW
    xp_elems = C0p // 2 * ldx + 2 * gx.NR
    u_elems = C1p // 2 * ldu
    work1, work2 = N * blocks1, N * blocks2
    t_scratch = scratch_value(graph, node, (work1 * rows1 * HW,), np.float32, tag="t_channels")
    x_scratch = scratch_value(graph, node, (work1 * xp_elems,), np.uint16, tag="x_pairs")
    u_pairs = scratch_value(graph, node, (N * u_elems + 2 * gp.NR,), np.uint16, tag="u_pairs")
    label = lowp_label(("bf16", method))

    # 1: x's pairs, t and u of a block of expanded channels. Pointers: x, W1 panels, b1, depthwise
    # weights, t scratch, x pairs, u pairs.
    # (stride 2 from a bf16 x: x's rows copied phase-split, t's rows too: dwphase.PhaseRowCalls)
    phase = PHASE_ROWS and s == 2 and fmt(X) == "bf16" and KW <= 7
    rows = (PlaneRowCalls(H, Wd, KH, KW, p_t, p_l, dw_epi, store_rounding("bf16", lowering_target()))
            if PLANE_ROWS and plane_eligible(H, Wd, OH, OW, KH, KW, s) else
            PhaseRowCalls(H, Wd, OW, KH, KW, p_t, p_l, dw_epi, store_rounding("bf16", lowering_target())) if phase else
            RowCalls(H, Wd, OW, KH, KW, p_t, p_l, s, dw_epi, "f32", "bf16pairs"))
    src = Source()
    rows.declare(src)
    copy = StridedPairCopySpec(stride=2) if phase else PairCopySpec() if fmt(X) == "bf16" else PairCvtSpec()
    for line in copy.declaration("to_pairs").splitlines():
        src.line(line)
    gx.declare(src)
    src.line(kernel_header(7)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {blocks1}").line(f"m_lo = (item % {blocks1}) * {rows1}").line(f"m_hi = min(m_lo + {rows1}, {C1})")
    src.line(f"st = item * {rows1 * HW}").line(f"sxp = item * {xp_elems}").line(f"su = n * {u_elems}")
    src.line(f"for cp in range({C0p // 2}):").indent()
    src.line("c = 2 * cp").line(f"xs = {HW} if c + 1 < {C0} else 0" if C0 % 2 else f"xs = {HW}")
    if phase:
        emit_phase_copy(src, "to_pairs", "p0", f"(n * {C0} + c) * {HW}", "xs", "p5", f"sxp + cp * {ldx}", 0, H, Wd)
        src.dedent()
    else:
        src.line(f"to_pairs(p0, (n * {C0} + c) * {HW}, xs, p5, sxp + cp * {ldx}, {HW})").dedent()
    gx.emit_rows(src, "p1", "p5", "sxp", ldx, "p4", "st", HW, "p2", HW, "m_lo", "m_hi")
    if C1 % 2:   # the last pair's second channel: zeros (times zero weights), never written
        src.line(f"if m_hi == {C1}:").indent()
        src.line(f"for j in range({ldu}):").indent()
        src.line(f"p6[su + {(C1p // 2 - 1) * ldu} + j] = np.uint16(0)").dedent().dedent()
    src.line("for c in range(m_lo, m_hi):").indent()
    src.line(f"xo = st + (c - m_lo) * {HW}").line(f"yo = su + (c >> 1) * {ldu} + (c & 1)")
    rows.emit(src, "p4", "xo", "p3", f"c * {KH * KW + 1}", "p6", "yo", 0, OH)
    kernel1 = Kernel("DepthwiseBlock", src.text(),
                     (pointer_type(X.dtype), "uint16", "float32", "float32", "float32", "uint16", "uint16"))
    w2 = packed_weights(W2.data, graph.values[b2_name].data if b2_name else None, C1)
    call1 = KernelCall(kernel1, [x_name, gx.panels, gx.bias, w2, t_scratch, x_scratch, u_pairs], work1, node.name,
                       n_outputs=3, precision=label)

    # 2: y's block of output channels. Pointers: u pairs, W3 panels, b3, [r], [float32 y piece], y.
    y_wide = fmt(Y) != "f32" and not out16
    ptrs = ["u", "a3", "b3"] + (["r"] if r_name else []) + (["sy"] if y_wide else []) + ["y"]
    p = {key: f"p{i}" for i, key in enumerate(ptrs)}
    src = Source()
    gp.declare(src)
    if y_wide:
        method_out = best_method("f32", fmt(Y), lowering_target())
        for line in CvtSpec("f32", fmt(Y), method_out).declaration("cvt_out").splitlines():
            src.line(line)
    src.line(kernel_header(len(ptrs))).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {blocks2}").line(f"m_lo = (item % {blocks2}) * {rows2}").line(f"m_hi = min(m_lo + {rows2}, {C2})")
    src.line(f"su = n * {u_elems}").line(f"yb = (n * {C2} + m_lo) * {OHW}")
    if out16:   # y (and its residual) rounded in registers (dwblock_out16.py)
        gp.emit_rows(src, p["a3"], p["u"], "su", ldu, p["y"], "yb", OHW, p["b3"], p["r"] if r_name else p["y"], OHW,
                     "m_lo", "m_hi")
    elif y_wide:   # into the item's float32 piece, the residual added there, rounded into y
        src.line(f"sy = item * {rows2 * OHW}")
        gp.emit_rows(src, p["a3"], p["u"], "su", ldu, p["sy"], "sy", OHW, p["b3"], OHW, "m_lo", "m_hi")
        if r_name:
            src.line(f"for j in range((m_hi - m_lo) * {OHW}):").indent()
            src.line(f"{p['sy']}[sy + j] += {load(p['r'], 'yb + j', r_dtype)}").dedent()
        src.line(f"cvt_out({p['sy']}, sy, {p['y']}, yb, (m_hi - m_lo) * {OHW})")
    else:
        gp.emit_rows(src, p["a3"], p["u"], "su", ldu, p["y"], "yb", OHW, p["b3"], OHW, "m_lo", "m_hi")
        if r_name:
            src.line(f"for j in range((m_hi - m_lo) * {OHW}):").indent()
            src.line(f"{p['y']}[yb + j] += {load(p['r'], 'yb + j', r_dtype)}").dedent()
    stored = {"r": r_dtype, "y": Y.dtype}
    types = tuple(pointer_type(stored[k]) if k in stored else "uint16" if k in ("u", "a3") else "float32" for k in ptrs)
    args = {"u": u_pairs, "a3": gp.panels, "b3": gp.bias, "r": r_name, "y": node.outputs[0]}
    if y_wide:
        args["sy"] = scratch_value(graph, node, (work2 * rows2 * OHW,), np.float32, tag="y_channels")
    kernel2 = Kernel("DepthwiseBlock", with_helpers(src.text()), types)
    call2 = KernelCall(kernel2, [args[k] for k in ptrs], work2, node.name, n_outputs=1 + y_wide, precision=label)
    return Lowered([call1, call2])
