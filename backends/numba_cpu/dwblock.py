"""DepthwiseBlock (domain "cuvil", made by passes/fuse_depthwise_block.py): a depthwise conv with
the 1x1 conv before it ("expand") and/or after it ("project"), in bands of rows that stay in L2.

    t = act1(W1 @ x + b1)                       expanded channels (C1 = W1's rows); absent: t = x
    u[c] = act2(b2[c] + dw(t[c], w2[c]))        stride s (1 or 2), kernel KH x KW
    y = act3(W3 @ u + b3) [+ r]                 projected channels; absent: y = u

One band is R output rows of every channel. Its input rows, (R - 1)*s + KH of t,
are computed into scratch laid out [C1][band rows][W] by the GEMM micro-kernels
(bias and activation in registers, like a pointwise conv's); the depthwise
conv reads them from there with the DwRowSpec micro-kernel (one call per output
row, or pair of rows with stride 1, and channel) and writes the band of u into
scratch [C1][R][OW], which the project GEMM reads as its B (channels are its
k). Each piece of scratch is written and read back while it is in L2: t and u
never exist as a whole. The KH - s rows of t two bands share stay in the
scratch: each band moves them to the top and computes only its new rows.

bf16 blocks with an expand conv go through a band a block of MR expanded channels (one micro-tile
of W1's rows) at a time (_blocked_band): the block's new rows of t, then its depthwise rows, so the
rows of t are read back from L1 (T_BLOCK_BYTES caps R for that), and t's scratch holds one block's
band plus a halo store of the KH - s rows of every channel the next band shares (MobileNetV2 bf16,
1 thread, CPU time at load 9: 2.270 -> 2.228 ms; bit-identical: the same sums in the same order).
With stride 2 and a bf16 x, x's rows are copied into the pairs phase-split (even columns, then
odd), so t's rows are too and the depthwise taps are plain loads (dwphase.py, PHASE_ROWS; the
same bits as the rows that shuffle lanes).

Work items are (image, run of consecutive bands), each with scratch of its own
(one for all when the library runs on one thread), so the results do not
depend on which thread computes what.

Activations stored in 16 bits (bf16 / fp16, passes/assign_precision.py `narrow_activations`):
x, r and y may hold 16-bit values. Without expand / project the depthwise rows read x / write
y in 16 bits themselves (ukernel_lowp.DwRow16Spec); the project GEMM writes the band of y into a
float32 piece of the scratch, adds the residual (widened) and rounds it once into y, or, in a
bf16 block whose y (and r) are bf16 and whose project K fits one k pass, writes y from its
accumulators with the residual added in registers (dwblock_out16.py: the same float32 sums, the
rounding `vcvtneps2bf16` with AVX512-BF16).

bf16 (a block that passes/assign_precision.py marked bf16; lowp_product gives the method:
"dpbf16" = `vdpbf16ps` with AVX512-BF16, else "widen" = the pairs split into float32 FMAs): both
1x1 convs run on ukernel_lowp's micro-kernel, W1 and W3 rounded to bf16 once at build time and
packed in pair panels (dwblock_pairs.PairGemm). Their B operands live in a 16-bit scratch in the VNNI pair
layout the micro-kernel reads, channels as k: the band's new rows of x copied into channel pairs
(lowp.PairCopySpec; a float32 x, a graph input, rounded into them by lowp.PairCvtSpec), and u
written by the depthwise rows straight into channel pairs (ukernel_lowp.DwRowPairSpec: each
value rounded once to bf16). t stays float32: the expand GEMM stores its float32 sums and the
depthwise taps (float32 FMAs, DwRowSpec) read them as they are, with no rounding of t (a bf16 t,
half the scratch bytes, was not tried). An odd channel count gets a zero weight column and a zero
(or repeated) partner channel. Error, with u = 2^-8 (one bf16 rounding to nearest), gamma(n) = n 2^-24 / (1 -
n 2^-24) (a float32 sum of n terms, one rounding per accumulation: vdpbf16ps rounds each of its
two products' additions), |.| * |.| the convolution of magnitudes, and e_x the error x holds:

    t:  |dt| <= |W1| * e_x + (r + gamma(C0 + 1)) (|W1| * (|x| + e_x) + |b1|)
           r = u (W1's rounding; x is exact in bf16), 2u + u^2 when x is rounded too (float32 x)
    u (before its rounding):  |du| <= |w2| * |dt| + gamma(KH KW + 1) (|w2| * (|t| + |dt|) + |b2|)
    u's bf16 pairs:           e_u = |du| + u (|u| + |du|) [+ 2^-126: vcvtneps2bf16 flushes a subnormal,
                               ukernel_lowp.store_rounding]
    y (before its store):     |dy| <= |W3| * e_u + (u + gamma(C1 + 1)) (|W3| * (|u| + e_u) + |b3|)
                               [+ e_r + gamma(1) (|y| + |dy|) with a residual r]
    y stored in bf16:          e_y = |dy| + u (|y| + |dy|) [+ 2^-126: rounded by vcvtneps2bf16 in
                               the project GEMM's registers, dwblock_out16.py]

Relu / Clip are 1-Lipschitz and leave the bounds as they are. tests/test_precision_depthwise.py
checks every case against onnxruntime's float32 values with this bound. fp16 blocks keep the
float32 1x1 convs on float32 t and u (x widened into a float32 piece of the scratch, exact: lowp.
CvtSpec), whose only errors are the roundings of the stored x, r and y.
"""
from __future__ import annotations

import numpy as np

from .ukernel import LOADC_EPILOGUE, UKSpec
from cuvil.ir import Node

from .dwblock_out16 import PairGemmOut16, takes_out16
from .dwblock_pairs import SPLIT_PIXELS, PairGemm, lower_by_channels
from .dwphase import PhaseRowCalls, PlaneRowCalls, emit_phase_copy, plane_eligible
from .dwstride import RowCalls, fmt, packed_weights
from .ukernel_lowp import store_rounding
from .epilogue import Epilogue, epilogue_of, register_epilogue
from .gemm import TileLoops, ceil_div, choose_tile, lowp_label, lowp_product, pack_a_panels
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, lowering_target, session_threads, work_items
from .lowp import CvtSpec, PairCopySpec, PairCvtSpec, StridedPairCopySpec, best_method
from .narrow import load, pointer_type, with_helpers
from .scratch import scratch_value

BAND_BYTES = 256 << 10   # a band's scratch (t's rows and u's) stays well inside a 1-2 MiB L2
MIN_BANDS = 4
# bf16 blocks (x and u in pairs): as few bands as their scratch allows, at least one per thread (not
# MIN_BANDS / work_items()), of balanced heights: a band is the N of both GEMMs, and short bands
# leave their micro-tiles' columns idle (MobileNetV2's 7 x 7 blocks in 4 bands of 14 pixels: 0.171
# ms a block against 0.090 ms in one band, AMD Zen 5, 1 thread). The scratch may grow to
# BAND_BYTES_PAIRS less the bytes of x and y (at least BAND_BYTES): the step then holds no more
# than max(x + y + BAND_BYTES, BAND_BYTES_PAIRS), so the small late blocks get tall bands without
# raising the arena's peak, which the large early tensors set.
BAND_BYTES_PAIRS = 768 << 10
# bf16 blocks with an expand conv: t computed and read one micro-tile of expanded channels at a time
# (_blocked_band), its rows of a band in at most this many bytes (they stay in L1 between the expand
# GEMM's stores and the depthwise rows' loads)
T_BLOCK_BYTES = 32 << 10
# bf16 stride-2 blocks with an expand conv from a bf16 x: t's rows phase-split, the depthwise taps
# plain loads (dwphase.py); False: the shuffling rows (the tests compare the two bit for bit)
PHASE_ROWS = True
# bf16 blocks with an expand conv whose (stride-1, same-size) plane of at most dwphase.PLANE_MAX
# outputs is one band: a channel's depthwise plane in one call, its outputs flat (dwphase.py)
PLANE_ROWS = True


def _epilogue(node, prefix: str) -> Epilogue:
    """The node's `{prefix}activation` as an Epilogue (checked like a FusedConv's)."""
    attrs = {"activation": node.attr(f"{prefix}activation", ""),
             "activation_params": node.attr(f"{prefix}activation_params", [])}
    return epilogue_of(Node("FusedConv", node.name, [], [], attrs, domain="cuvil"))[0]


class _Gemm(TileLoops):
    """out[M x npx] = act(A @ B + bias) for one band, A packed at build time (M x K), B rows `ldb`
    apart, out rows `ldc` apart, bias and activation in the last pass's epilogue."""

    def __init__(self, tag: str, weights: np.ndarray, bias_name: str, graph, epilogue: Epilogue, n_typical: int):
        self.M, K = weights.shape
        MR, NR = choose_tile(self.M, n_typical)
        self.panels = pack_a_panels(weights, MR)
        self.bias = np.zeros(ceil_div(self.M, MR) * MR, dtype=np.float32)
        if bias_name:   # (none: zeros, which the micro-kernel's epilogue adds)
            self.bias[:self.M] = np.asarray(graph.values[bias_name].data, dtype=np.float32).reshape(self.M)
        fields = register_epilogue(True, epilogue)
        keys = [(mr, masked) for mr in sorted({MR, self.M % MR} - {0}) for masked in (0, 1)]
        super().__init__(tag, MR, NR, K, {(mr, masked): (f"{tag}{i}", UKSpec(mr=mr, nr=NR, a_packed=1, a_panel=MR,
                                                                             b_masked=masked, **fields))
                                          for i, (mr, masked) in enumerate(keys)})

    def emit(self, src: Source, pa, pb, boff, ldb, pc, coff, ldc, pbias, npx) -> None:
        t, panels = self.tag, ceil_div(self.M, self.MR) * self.MR

        def call(mr, m, masked):
            name = self.specs[(mr, masked)][0]
            src.line(f"{name}({pa}, {t}k0 * {panels} + {m} * {t}kc, 0, {pb}, {boff} + {t}k0 * {ldb} + {t}n0, {ldb}, "
                     f"{pc}, {coff} + {m} * {ldc} + {t}n0, {ldc}, {t}kc, {t}mask, {t}flags, {pbias}, {m})")
        self.loops(src, npx, self.M, self.M % self.MR,
                   f"min({t}k0, 1) + {LOADC_EPILOGUE} * ({t}k0 + {self.kc} >= {self.K})", call)


def _blocked_band(src: Source, p: dict, gx, rows, y: str, yo: str, H, Wd, C0, C1, KH, KW, s, p_t, BR, halo,
                  ldx, n_bands, phase: bool = False) -> None:
    """One band of a bf16 block with an expand conv, a block of gx.MR expanded channels at a time:
    x's new rows into channel pairs (once a band), then per block the rows of t this band shares
    with the last one back from the halo store (`halo` rows per channel, at sh), the block's new
    rows of t by the expand GEMM (rows [m_lo, m_hi) of W1) into the block's scratch (at so, its
    channel c at so + (c - m_lo) BR W), the depthwise rows of those channels into u's pairs, and
    the last `halo` rows of each channel into the halo store for the next band (the depthwise rows
    of channel c write y[yo], yo an expression of c). The block's rows of
    t are written and read while in L1 (T_BLOCK_BYTES); the sums are those of the unblocked band,
    in the same order (bit-identical). `phase`: x's rows copied phase-split (dwphase.py), so t's
    rows are too, for the stride-2 rows of dwphase.PhaseRowCalls."""
    MR, C0p = gx.MR, C0 + C0 % 2
    src.line(f"top = oh0 * {s} - {p_t}")
    src.line("lo = max(top, 0)").line(f"hi = min((oh1 - 1) * {s} - {p_t} + {KH}, {H})")
    src.line("new = max(lo, have_hi)")
    src.line("if new < hi:").indent()   # x's new rows [new, hi) in channel pairs
    plane = H * Wd
    src.line(f"for cp in range({C0p // 2}):").indent()
    src.line("c = 2 * cp").line(f"xs = {plane} if c + 1 < {C0} else 0" if C0 % 2 else f"xs = {plane}")
    if phase:
        emit_phase_copy(src, "to_pairs_s2", p["x"], f"(n * {C0} + c) * {plane} + new * {Wd}", "xs", p["pairs"],
                        f"sxp + cp * {ldx}", "new", "hi", Wd)
        src.dedent().dedent()
    else:
        src.line(f"to_pairs({p['x']}, (n * {C0} + c) * {plane} + new * {Wd}, xs, {p['pairs']}, sxp + cp * {ldx}, "
                 f"(hi - new) * {Wd})").dedent().dedent()
    sc = p["scratch"]
    src.line(f"for m_lo in range(0, {C1}, {MR}):").indent()
    src.line(f"m_hi = min(m_lo + {MR}, {C1})")
    if halo and n_bands > 1:
        src.line("if lo < have_hi:").indent()   # rows [have_hi - halo, have_hi) of each channel at sh + c halo W
        src.line("for c in range(m_lo, m_hi):").indent()
        src.line(f"hs = sh + c * {halo * Wd} + (lo - have_hi + {halo}) * {Wd}")
        src.line(f"ts = so + (c - m_lo) * {BR * Wd} + (lo - top) * {Wd}")
        src.line(f"for j in range((have_hi - lo) * {Wd}):").indent()
        src.line(f"{sc}[ts + j] = {sc}[hs + j]").dedent().dedent().dedent()
    src.line("if new < hi:").indent()
    gx.emit_rows(src, p["a1"], p["pairs"], "sxp", ldx, sc, f"so + (new - top) * {Wd}", BR * Wd, p["b1"],
                 f"(hi - new) * {Wd}", "m_lo", "m_hi")
    src.dedent()
    src.line("for c in range(m_lo, m_hi):").indent()
    src.line(f"xo = so + (c - m_lo) * {BR * Wd} - top * {Wd}").line(f"yo = {yo}")
    rows.emit(src, sc, "xo", p["w2"], f"c * {KH * KW + 1}", y, "yo", "oh0", "oh1")
    if halo and n_bands > 1:   # the last rows for the run's next band
        src.line("if band + 1 < b_hi:").indent()
        src.line(f"keep = max(lo, hi - {halo})")
        src.line(f"hs = sh + c * {halo * Wd} + (keep - hi + {halo}) * {Wd}")
        src.line(f"ts = so + (c - m_lo) * {BR * Wd} + (keep - top) * {Wd}")
        src.line(f"for j in range((hi - keep) * {Wd}):").indent()
        src.line(f"{sc}[hs + j] = {sc}[ts + j]").dedent().dedent()
    src.dedent().dedent()
    src.line("have_hi = hi")


def lower_depthwise_block(node, graph) -> Lowered:
    x_name, w1_name, b1_name, w2_name, b2_name, w3_name, b3_name, r_name = node.inputs
    X, W2, Y = (graph.values[n] for n in (x_name, w2_name, node.outputs[0]))
    N, C0, H, Wd = (int(v) for v in X.shape)
    C1 = int(W2.shape[0])
    C2 = int(Y.shape[1])
    KH, KW = (int(v) for v in W2.shape[2:])
    OH, OW = (int(v) for v in Y.shape[2:])
    s = int(node.attr("strides")[0])
    p_t, p_l = (int(v) for v in node.attr("pads")[:2])
    expand, project = bool(w1_name), bool(w3_name)
    # bf16 (the block marked bf16): the 1x1 convs on the bf16 micro-kernel, their B in channel
    # pairs in the 16-bit scratch (x's new rows copied / rounded into pairs; u written in pairs by
    # the depthwise rows)
    lowp = lowp_product(node)
    method = lowp[1] if lowp and lowp[0] == "bf16" else None
    x_pairs = expand and method is not None
    u_pairs = project and method is not None
    # 16-bit x read by a float32 expand GEMM / y written by the project GEMM: float32 pieces of the scratch
    x_wide = expand and fmt(X) != "f32" and not x_pairs
    # a bf16 y written by the project GEMM from its accumulators, the residual added there (dwblock_out16.py)
    out16 = u_pairs and takes_out16(_epilogue(node, "project_"), fmt(Y), fmt(graph.values[r_name]) if r_name else None, C1)
    y_wide = project and fmt(Y) != "f32" and not out16
    C0p, C1p = C0 + C0 % 2, C1 + C1 % 2   # channel pairs (a last odd channel gets a zero weight)

    # Bands of R output rows: t's rows of a band (BR of them) and u's (and the float32 pieces of
    # x and y, or the pairs of x and u) fit BAND_BYTES; at least MIN_BANDS bands (and on several
    # threads at least one per work item).
    threads = session_threads()
    one_slot = threads == 1
    # bf16 expand: t computed and read a block of MR expanded channels at a time (see _blocked_band)
    blocked = x_pairs
    halo = max(0, KH - s)   # rows of t two bands share
    MRb = choose_tile(C1, ceil_div(OH, ceil_div(threads, N)) * s * Wd)[0] if blocked else 0
    t_rows = MRb if blocked else C1   # channels of t's scratch a band's rows take
    row_bytes = (4 * t_rows * (s * Wd if expand else 0) + (2 * C1p if u_pairs else 4 * C1) * (OW if project else 0)
                 + (4 * C0 * s * Wd if x_wide else 0) + (2 * C0p * s * Wd if x_pairs else 0) + 4 * (C2 * OW if y_wide else 0))
    fixed_bytes = (4 * (C1 + t_rows if blocked else C1) + (4 * C0 if x_wide else 0)) * halo * Wd if expand else 0
    if method:   # (bf16: see BAND_BYTES_PAIRS)
        budget = max(BAND_BYTES, BAND_BYTES_PAIRS - X.nbytes - Y.nbytes)
        R = max(1, min(ceil_div(OH, ceil_div(threads, N)), (budget - fixed_bytes) // row_bytes))
        if blocked:   # a block's rows of t stay in L1
            R = max(1, min(R, (T_BLOCK_BYTES // (4 * MRb * Wd) - KH) // s + 1))
        R = ceil_div(OH, ceil_div(OH, R))   # the same band count, heights balanced
        items = threads
    else:
        R = max(1, min(ceil_div(OH, MIN_BANDS if one_slot else max(MIN_BANDS, work_items())),
                       (BAND_BYTES - fixed_bytes) // row_bytes))
        items = work_items()
    BR = (R - 1) * s + KH
    n_bands = ceil_div(OH, R)
    runs = 1 if one_slot else min(n_bands, max(1, ceil_div(items, N)))
    if method and expand and project and runs > 1 and ceil_div(OH, ceil_div(threads, N)) * OW < SPLIT_PIXELS:
        # a small plane shared by several threads (see dwblock_pairs.py)
        return lower_by_channels(node, graph, method, threads,
                                 (_epilogue(node, "expand_"), _epilogue(node, ""), _epilogue(node, "project_")))
    gx = gp = None
    if expand:
        w1 = np.asarray(graph.values[w1_name].data, dtype=np.float32).reshape(C1, C0)
        gx = (PairGemm("ex", w1, b1_name, graph, _epilogue(node, "expand_"), R * s * Wd, method) if x_pairs else
              _Gemm("ex", w1, b1_name, graph, _epilogue(node, "expand_"), R * s * Wd))
    if project:
        w3 = np.asarray(graph.values[w3_name].data, dtype=np.float32).reshape(C2, C1)
        gp = (PairGemmOut16("pj", w3, b3_name, graph, _epilogue(node, "project_"), R * OW, method, bool(r_name))
              if out16 else
              PairGemm("pj", w3, b3_name, graph, _epilogue(node, "project_"), R * OW, method) if u_pairs else
              _Gemm("pj", w3, b3_name, graph, _epilogue(node, "project_"), R * OW))
    work = N * runs
    t_floats = (gx.MR * BR + (C1 * halo if n_bands > 1 else 0)) * Wd if blocked else C1 * BR * Wd if expand else 0
    u_floats = C1 * R * OW if project and not u_pairs else 0
    x_floats = C0 * BR * Wd if x_wide else 0
    slot = t_floats + u_floats + x_floats + (C2 * R * OW if y_wide else 0)
    scratch = scratch_value(graph, node, (max(1, (1 if one_slot else work) * slot),), np.float32, tag="bands")
    # The 16-bit scratch: x's pairs (rows of 2 BR W) then u's (rows of 2 R OW), each followed by the
    # 2 NR elements its GEMM's last tile reads past its last row.
    ldx, ldu = 2 * BR * Wd, 2 * R * OW   # 16-bit elements per pair row of x / u
    xp_elems = C0p // 2 * ldx + 2 * gx.NR if x_pairs else 0
    up_elems = C1p // 2 * ldu + 2 * gp.NR if u_pairs else 0
    pair_slot = xp_elems + up_elems
    pairs = (scratch_value(graph, node, ((1 if one_slot else work) * pair_slot,), np.uint16, tag="pairs")
             if pair_slot else None)

    # Pointers, in order: x, [expand panels, bias], depthwise weights, [project panels, bias],
    # [residual], scratch, [pairs], y.
    ptrs = {"x": x_name}
    if expand:
        ptrs.update(a1=gx.panels, b1=gx.bias)
    ptrs["w2"] = packed_weights(W2.data, graph.values[b2_name].data if b2_name else None, C1)
    if project:
        ptrs.update(a3=gp.panels, b3=gp.bias)
        if r_name:
            ptrs["r"] = r_name
    ptrs["scratch"] = scratch
    if pairs:
        ptrs["pairs"] = pairs
    ptrs["y"] = node.outputs[0]
    p = {key: f"p{i}" for i, key in enumerate(ptrs)}
    stored = {"x": X.dtype, "y": Y.dtype, **({"r": graph.values[r_name].dtype} if "r" in ptrs else {})}
    sixteen = {"pairs"} | ({"a1"} if x_pairs else set()) | ({"a3"} if u_pairs else set())
    types = tuple(pointer_type(stored[key]) if key in stored else "uint16" if key in sixteen else "float32"
                  for key in ptrs)

    # stride 2 with t made by the bf16 expand GEMM from a bf16 x: t's rows phase-split (dwphase.py)
    phase = PHASE_ROWS and s == 2 and x_pairs and u_pairs and fmt(X) == "bf16" and KW <= 7
    # a small plane in one band (the late blocks' 7 x 7): each channel's plane one call, outputs flat
    plane = PLANE_ROWS and x_pairs and u_pairs and n_bands == 1 and plane_eligible(H, Wd, OH, OW, KH, KW, s)
    rows = (PhaseRowCalls(H, Wd, OW, KH, KW, p_t, p_l, _epilogue(node, ""), store_rounding("bf16", lowering_target()))
            if phase else
            PlaneRowCalls(H, Wd, KH, KW, p_t, p_l, _epilogue(node, ""), store_rounding("bf16", lowering_target()))
            if plane else
            RowCalls(H, Wd, OW, KH, KW, p_t, p_l, s, _epilogue(node, ""), "f32" if expand else fmt(X),
                     "bf16pairs" if u_pairs else "f32" if project else fmt(Y)))

    src = Source()
    rows.declare(src)
    for wide, var, spec in ((x_wide, "cvt_in", lambda: CvtSpec(fmt(X), "f32", best_method(fmt(X), "f32", lowering_target()))),
                            (y_wide, "cvt_out", lambda: CvtSpec("f32", fmt(Y), best_method("f32", fmt(Y), lowering_target()))),
                            (x_pairs, "to_pairs", lambda: PairCopySpec() if fmt(X) == "bf16" else PairCvtSpec())):
        if wide:
            for line in spec().declaration(var).splitlines():
                src.line(line)
    if phase:
        for line in StridedPairCopySpec(stride=2).declaration("to_pairs_s2").splitlines():
            src.line(line)
    if expand:
        gx.declare(src)
    if project:
        gp.declare(src)
    src.line(kernel_header(len(ptrs))).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {runs}").line(f"run = item % {runs}")
    src.line("so = 0" if one_slot else f"so = item * {slot}")
    if project and not u_pairs:
        src.line(f"su = so + {t_floats}")   # u's scratch
    if x_wide:
        src.line(f"sx = so + {t_floats + u_floats}")   # the band's new rows of x, widened
    if y_wide:
        src.line(f"sy = so + {t_floats + u_floats + x_floats}")   # the band of y before its rounding
    if pairs:
        src.line("sp = 0" if one_slot else f"sp = item * {pair_slot}")
        if x_pairs:
            src.line("sxp = sp")   # the band's new rows of x in channel pairs
        if u_pairs:
            src.line(f"sup = sp + {xp_elems}")   # the band of u in channel pairs
            if C1 % 2:   # the last pair's second channel: zeros (times zero weights), never written
                src.line(f"for j in range({ldu}):").indent()
                src.line(f"{p['pairs']}[sup + {(C1p // 2 - 1) * ldu} + j] = np.uint16(0)").dedent()
    src.line(f"b_lo = run * {n_bands} // {runs}").line(f"b_hi = (run + 1) * {n_bands} // {runs}")
    if expand:   # t's scratch holds its rows [base, have_hi) from its top on
        src.line("base = 0").line("have_hi = 0")
    if blocked and halo and n_bands > 1:
        src.line(f"sh = so + {gx.MR * BR * Wd}")   # the halo store: rows of t the next band shares
    src.line("for band in range(b_lo, b_hi):").indent()
    src.line(f"oh0 = band * {R}").line(f"oh1 = min(oh0 + {R}, {OH})")
    if u_pairs:   # where the depthwise rows write channel c: u's pairs, u's float32 scratch, or y
        dw_y, dw_yo = p["pairs"], f"sup + (c >> 1) * {ldu} + (c & 1) - oh0 * {2 * OW}"
    else:
        dw_y, dw_yo = (p["scratch"], f"su + c * {R * OW} - oh0 * {OW}") if project else (p["y"], f"(n * {C1} + c) * {OH * OW}")
    if blocked:
        _blocked_band(src, p, gx, rows, dw_y, dw_yo, H, Wd, C0, C1, KH, KW, s, p_t, BR, halo, ldx, n_bands, phase)
    if expand and not blocked:
        src.line(f"top = oh0 * {s} - {p_t}")
        src.line("lo = max(top, 0)").line(f"hi = min((oh1 - 1) * {s} - {p_t} + {KH}, {H})")
        # The rows [lo, have_hi) this band shares with the last one (rows from `base` on) move to
        # the top of t's scratch: forward, as top > base.
        src.line("new = lo")
        src.line("if lo < have_hi:").indent()
        src.line("new = have_hi")
        src.line(f"for c in range({C1}):").indent()
        src.line(f"src = so + c * {BR * Wd} + (lo - base) * {Wd}")
        src.line(f"dst = so + c * {BR * Wd} + (lo - top) * {Wd}")
        src.line(f"for j in range((have_hi - lo) * {Wd}):").indent()
        src.line(f"{p['scratch']}[dst + j] = {p['scratch']}[src + j]")
        src.dedent().dedent().dedent()
        # The new rows: t[C1 x pixels] = W1 @ x[C0 x pixels], pixels the flat run of rows [new, hi).
        src.line("if new < hi:").indent()
        if x_pairs:   # channels 2cp, 2cp + 1 of the rows interleaved (a last odd channel with itself)
            plane = H * Wd
            src.line(f"for cp in range({C0p // 2}):").indent()
            src.line("c = 2 * cp").line(f"xs = {plane} if c + 1 < {C0} else 0" if C0 % 2 else f"xs = {plane}")
            src.line(f"to_pairs({p['x']}, (n * {C0} + c) * {plane} + new * {Wd}, xs, {p['pairs']}, sxp + cp * {ldx}, "
                     f"(hi - new) * {Wd})").dedent()
            gx.emit(src, p["a1"], p["pairs"], "sxp", ldx, p["scratch"], f"so + (new - top) * {Wd}", BR * Wd, p["b1"],
                    f"(hi - new) * {Wd}")
        elif x_wide:
            src.line(f"for c in range({C0}):").indent()
            src.line(f"cvt_in({p['x']}, (n * {C0} + c) * {H * Wd} + new * {Wd}, {p['scratch']}, sx + c * {BR * Wd}, "
                     f"(hi - new) * {Wd})").dedent()
            gx.emit(src, p["a1"], p["scratch"], "sx", BR * Wd, p["scratch"],
                    f"so + (new - top) * {Wd}", BR * Wd, p["b1"], f"(hi - new) * {Wd}")
        else:
            gx.emit(src, p["a1"], p["x"], f"n * {C0 * H * Wd} + new * {Wd}", H * Wd, p["scratch"],
                    f"so + (new - top) * {Wd}", BR * Wd, p["b1"], f"(hi - new) * {Wd}")
        src.dedent()
        src.line("base = top").line("have_hi = hi")
    # The depthwise conv over the band: input row r of channel c at xo + r*W, output row oh at yo + oh*OW
    # (u's pairs: channel c is half c % 2 of pair row c // 2, its row oh at yo + 2 oh OW).
    src.line(f"for c in range({0 if blocked else C1}):").indent()   # (blocked: in _blocked_band)
    src.line(f"xo = so + c * {BR * Wd} - top * {Wd}" if expand else f"xo = (n * {C1} + c) * {H * Wd}")
    src.line(f"yo = {dw_yo}")
    rows.emit(src, p["scratch"] if expand else p["x"], "xo", p["w2"], f"c * {KH * KW + 1}", dw_y, "yo", "oh0", "oh1")
    src.dedent()
    if project:
        # y[:, band rows] = W3 @ u (channels of u are k, its R*OW pixels apart), then the residual.
        src.line(f"npx = (oh1 - oh0) * {OW}")
        b_ptr, b_off, b_ld = (p["pairs"], "sup", ldu) if u_pairs else (p["scratch"], "su", R * OW)
        if out16:   # y (and its residual) rounded in registers
            gp.emit_rows(src, p["a3"], b_ptr, b_off, b_ld, p["y"], f"n * {C2 * OH * OW} + oh0 * {OW}", OH * OW,
                         p["b3"], p["r"] if r_name else p["y"], "npx", 0, C2)
        elif y_wide:   # into the float32 piece sy (rows R*OW apart), residual added there, rounded into y
            gp.emit(src, p["a3"], b_ptr, b_off, b_ld, p["scratch"], "sy", R * OW, p["b3"], "npx")
            src.line(f"for c in range({C2}):").indent()
            src.line(f"yb = (n * {C2} + c) * {OH * OW} + oh0 * {OW}").line(f"cb = sy + c * {R * OW}")
            if r_name:
                src.line("for j in range(npx):").indent()
                src.line(f"{p['scratch']}[cb + j] += {load(p['r'], 'yb + j', stored['r'])}").dedent()
            src.line(f"cvt_out({p['scratch']}, cb, {p['y']}, yb, npx)").dedent()
        else:
            gp.emit(src, p["a3"], b_ptr, b_off, b_ld, p["y"], f"n * {C2 * OH * OW} + oh0 * {OW}", OH * OW,
                    p["b3"], "npx")
            if r_name:
                src.line(f"for c in range({C2}):").indent()
                src.line(f"yb = (n * {C2} + c) * {OH * OW} + oh0 * {OW}")
                src.line("for j in range(npx):").indent()
                src.line(f"{p['y']}[yb + j] += {load(p['r'], 'yb + j', stored['r'])}")
                src.dedent().dedent()
    kernel = Kernel("DepthwiseBlock", with_helpers(src.text()), types)
    label = lowp_label(("bf16", method)) if method and (expand or project) else ""
    return Lowered([KernelCall(kernel, list(ptrs.values()), work, node.name, n_outputs=2 + bool(pairs),
                               precision=label)])
