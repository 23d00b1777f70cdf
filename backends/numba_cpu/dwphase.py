"""Stride-2 depthwise rows of a bf16 DepthwiseBlock over phase-split rows of t (DwRowPhaseSpec).

A stride-2 depthwise row reads the taps' columns 2 ow + kw - p_l: with t's rows as they are, each
group of L outputs loads ceil(KW / 2) runs of 2L floats and picks every other lane by a shuffle
(`vpermt2ps`, ukernel.dwrow_ir). In a bf16 block with an expand conv, t is made by a 1x1 conv,
which maps columns to columns: when the block copies each row of x into its channel pairs with
the even columns first and the odd ones after (lowp.StridedPairCopySpec, twice a row), every row
of t comes out phase-split,

    row r of t:  [ t(r, 0), t(r, 2), ..., t(r, 2 We - 2) | t(r, 1), t(r, 3), ..., t(r, 2 Wo - 1) ]
                  We = ceil(W / 2) even columns            Wo = floor(W / 2) odd columns

and tap kw of output ow reads column c = 2 ow + kw - p_l at a fixed offset in one half: the even
half at ow + (kw - p_l) / 2 (c even), the odd half at ow + (kw - p_l - 1) / 2 (c odd). Every tap is
one load of L consecutive floats (masked where it runs past the half: the image's zero padding),
no shuffles. A call computes `rows` (1 or 2) output rows: two rows read 2 + KH input rows, the
one they share (2 r0 + 2 for KH = 3) loaded once.

    y[yoff + 2 (q OW + ow)] = bf16(act(bias + sum_{kh, kw} w[kh, kw] t(r0 + 2 q + kh, 2 ow + kw - p_l)))

y as DwRowPairSpec's (one half of bf16 channel pairs, u for the project GEMM). The taps, their
order of summation (kh, then kw) and the rounding are DwRowPairSpec's: the same bits. The rows are
ukernel_lowp.DwRowPhaseSpec (IR: ukernel.dwrow_phase_ir); this module emits their calls
(PhaseRowCalls) and the phase-split copy of x (emit_phase_copy).

MobileNetV2 bf16, 1 thread, per-step minima of 50 single-run profiles (benchmarks/profile_ab.py,
load 7): the 112 -> 56 block (Conv_7) 0.220 -> 0.193 ms, 56 -> 28 (Conv_18) 0.103 -> 0.097, 28 -> 14
(Conv_35) 0.047 -> 0.043; its stride-2 depthwise rows had taken 75 / 36 / 11 us of them (the
blocks built without those rows), 4x the float32 FMA peak's time.

Small stride-1 planes (PlaneRowCalls, ukernel_lowp.DwPlanePairSpec): a 7 x 7 plane's depthwise
conv a channel's plane a call, its 49 outputs flat in 4 vectors (a vector a row took 7 vectors of
16 lanes for 7 outputs each, in 4 calls). The same bits. MobileNetV2's 7 x 7 blocks (Conv_80,
Conv_86, Conv_92), per-step minima of 50 profiles, load 6: 0.092 / 0.092 / 0.133 -> 0.089 / 0.088
/ 0.126 ms at 1 thread, 0.058 / 0.057 / 0.081 -> 0.050 / 0.050 / 0.073 at 2.
"""
from __future__ import annotations

from .epilogue import register_activation
from .ukernel_lowp import DwPlanePairSpec, DwRowPhaseSpec


class PhaseRowCalls:
    """dwstride.RowCalls' interface for DwRowPhaseSpec rows (y in bf16 channel pairs): the output
    rows [lo, hi) of a channel in pairs of rows, then the last one."""

    def __init__(self, H, W, OW, KH, KW, p_t, p_l, epilogue, method: str):
        fields = dict(H=H, W=W, OW=OW, KH=KH, KW=KW, p_l=p_l, stride=2, x_fmt="f32", y_fmt="bf16", method=method,
                      **register_activation(epilogue))
        self.row, self.pair = DwRowPhaseSpec(**fields), DwRowPhaseSpec(rows=2, **fields)
        self.p_t, self.OW = p_t, OW

    def declare(self, src) -> None:
        for spec, var in ((self.row, "dwrow"), (self.pair, "dwrows2")):
            for line in spec.declaration(var).splitlines():
                src.line(line)

    def emit(self, src, x, xo, w, wo, y, yo, lo, hi) -> None:
        """As RowCalls.emit: channel's input plane at x[xo] (phase-split rows W apart), output rows
        at y[yo + 2 oh OW] (pairs)."""
        p_t, OW2 = self.p_t, 2 * self.OW
        src.line(f"for oh in range({lo}, {hi} - 1, 2):").indent()
        src.line(f"dwrows2({x}, {xo}, 2 * oh - {p_t}, {w}, {wo}, {y}, {yo} + oh * {OW2})").dedent()
        src.line(f"if ({hi} - {lo}) % 2:").indent()
        src.line(f"dwrow({x}, {xo}, 2 * ({hi} - 1) - {p_t}, {w}, {wo}, {y}, {yo} + ({hi} - 1) * {OW2})").dedent()


def emit_phase_copy(src, copy: str, x, xoff: str, xs: str, pairs, doff: str, row0: str, row1: str, W: int) -> None:
    """x's rows [row0, row1) of a channel pair (the first at x[xoff], the second xs further on) into
    pair rows at pairs[doff], each row phase-split (even columns, then odd: see the module
    docstring) by two calls of `copy` (lowp.StridedPairCopySpec, stride 2)."""
    We, Wo = (W + 1) // 2, W // 2
    src.line(f"for rr in range({row1} - {row0}):").indent()
    src.line(f"{copy}({x}, {xoff} + rr * {W}, {xs}, {pairs}, {doff} + rr * {2 * W}, {We})")
    if Wo:
        src.line(f"{copy}({x}, {xoff} + rr * {W} + 1, {xs}, {pairs}, {doff} + rr * {2 * W} + {2 * We}, {Wo})")
    src.dedent()


# stride 1, output plane as large as the input: planes of at most this many outputs are computed
# flat, a channel's whole plane a call (PlaneRowCalls)
PLANE_MAX = 64


def plane_eligible(H, W, OH, OW, KH, KW, s) -> bool:
    return s == 1 and (OH, OW) == (H, W) and H * W <= PLANE_MAX and KH <= 7 and KW <= 7


class PlaneRowCalls:
    """dwstride.RowCalls' interface for a whole small plane a call (DwPlanePairSpec: the outputs
    flat, 4 vectors for a 7 x 7 plane where rows take 7), y in bf16 channel pairs. emit's rows
    [lo, hi) must be the whole plane."""

    def __init__(self, H, W, KH, KW, p_t, p_l, epilogue, method: str):
        self.plane = DwPlanePairSpec(H=H, W=W, OW=W, KH=KH, KW=KW, p_l=p_l, p_t=p_t, stride=1, x_fmt="f32",
                                     y_fmt="bf16", method=method, **register_activation(epilogue))

    def declare(self, src) -> None:
        for line in self.plane.declaration("dwplane").splitlines():
            src.line(line)

    def emit(self, src, x, xo, w, wo, y, yo, lo, hi) -> None:
        """The plane whose row r is at x[xo + r W] (lo = 0, hi = H: the whole plane), outputs at
        y[yo + 2 j]."""
        src.line(f"dwplane({x}, {xo}, 0, {w}, {wo}, {y}, {yo})")
