"""A bf16 DepthwiseBlock's project conv writing its 16-bit y from the accumulators (PairGemmOut16).

PairGemm (dwblock_pairs.py) stores float32 sums: the project GEMM of a block whose y is stored in
bf16 wrote a band of y into a float32 piece of the scratch, a second loop added the residual
there and a third rounded it into y (three passes over the band). Here each micro-tile runs its
whole k loop in one call and computes, in registers (ukernel_lowp.LowpOut16Spec, as convgemm's
1x1 convs do),

    y16[i, j] = round16( act( (acc[i, j] + b3[i]) + r16[i, j] ) )      (r16 the residual, if any)

acc = sum over the channel pairs of u in the same order as PairGemm's k passes (those store and
reload their float32 partial sums, which is exact), so acc, the bias and the residual's sum are
the same float32 values as before. Only the order of act and the residual differs, so a block
takes this path when its project conv has no activation or no residual (MobileNetV2's has none).
The rounding is ukernel_lowp.store_rounding's: `vcvtneps2bf16` where the product is `vdpbf16ps`
(flushes a float32 subnormal to zero: |error| <= u |y| + 2^-126 per output, the bound in
dwblock.py's docstring gets the 2^-126), the exact RNE elsewhere.
"""
from __future__ import annotations

import numpy as np

from .ukernel_lowp import store_rounding
from .epilogue import Epilogue, register_activation
from .gemm import bf16_k_pass, ceil_div, choose_tile
from .kernel import Source, lowering_target
from .lowp_pack import bf16_bits, pack_a_pairs
from .ukernel_lowp import LowpOut16Spec


def takes_out16(project_epilogue: Epilogue, y_fmt: str, r_fmt: str | None, K: int) -> bool:
    """Whether a bf16 block's project conv (K input channels) writes y with PairGemmOut16: y stored
    in bf16, a residual (if any) stored in bf16 too (read as C's layout), no activation after a
    residual (LowpOut16Spec adds the residual before the activation; the block's graph adds it
    after), and K in one of PairGemm's k passes (bf16_k_pass: 256 k at most). With more, the
    whole-K micro-panel of B no longer stays in L1 while the tiles of rows read it: MobileNetV2's
    7 x 7 block 960 -> 320 ran 0.173 -> 0.194 ms this way (1 thread, per-step minima of 60
    profiles, load 7), while the blocks of K <= 192 gained 1-9 us each."""
    Kp = K + K % 2
    return (y_fmt == "bf16" and r_fmt in (None, "bf16") and (r_fmt is None or not project_epilogue.active)
            and bf16_k_pass(Kp) >= Kp)


class PairGemmOut16:
    """y16[M x npx] = round16(act(W @ B + bias) [+ r16]) for B in u's channel pairs (rows `ldb`
    apart, 16-bit elements, read as PairGemm reads them, the same 2 NR elements of slack) and y,
    r rows `ldc` apart (the same layout). W rounded to bf16 and packed in pair panels of the whole
    K (one pass: the micro-kernel keeps its sums in registers)."""

    def __init__(self, tag: str, weights: np.ndarray, bias_name: str, graph, epilogue: Epilogue, n_typical: int,
                 method: str, residual: bool):
        self.tag = tag
        self.M, K = weights.shape
        self.Kp = K + K % 2
        self.MR, self.NR = choose_tile(self.M, n_typical)
        bits = np.zeros((self.M, self.Kp), np.uint16)
        bits[:, :K] = bf16_bits(weights)
        self.panels = pack_a_pairs(bits, self.MR).ravel()
        self.bias = np.zeros(ceil_div(self.M, self.MR) * self.MR, dtype=np.float32)
        if bias_name:
            self.bias[:self.M] = np.asarray(graph.values[bias_name].data, dtype=np.float32).reshape(self.M)
        self.residual = residual
        cvt = store_rounding("bf16", lowering_target())
        self.specs = {mr: (f"{tag}{i}", LowpOut16Spec(mr=mr, nr=self.NR, dtype="bf16", method=method, a_packed=1,
                                                      a_panel=self.MR, bias=1, residual=int(residual), cvt=cvt,
                                                      **register_activation(epilogue)))
                      for i, mr in enumerate(sorted({self.MR, self.M % self.MR} - {0}))}

    def declare(self, src: Source) -> None:
        for name, spec in self.specs.values():
            for line in spec.declaration(name).splitlines():
                src.line(line)

    def emit_rows(self, src: Source, pa, pb, boff, ldb, py, yoff, ldc, pbias, pr, npx, m_lo, m_hi) -> None:
        """Rows [m_lo, m_hi) of y (m_lo a multiple of MR; m_hi too unless it is M), row m at
        y[yoff + (m - m_lo) ldc], its residual at r[yoff + (m - m_lo) ldc] (pr: r's pointer, or
        any 16-bit one when there is none)."""
        t, MR, NR = self.tag, self.MR, self.NR
        src.line(f"for {t}n0 in range(0, {npx}, {NR}):").indent()
        src.line(f"{t}nv = min({NR}, {npx} - {t}n0)")
        src.line(f"{t}mask = np.int64(-1) if {t}nv >= {NR} else (np.int64(1) << {t}nv) - np.int64(1)")

        def call(mr):
            name = self.specs[mr][0]
            src.line(f"{t}o = {yoff} + ({t}m - {m_lo}) * {ldc} + {t}n0")
            src.line(f"{name}({pa}, {t}m * {self.Kp}, 0, {pb}, {boff} + 2 * {t}n0, {ldb}, {py}, {t}o, {ldc}, "
                     f"{self.Kp // 2}, {t}mask, 0, {pbias}, {t}m, {pr}, {t}o)")
        row_tiles(src, t, m_lo, m_hi, self.M, MR, call)
        src.dedent()


def row_tiles(src: Source, t: str, m_lo, m_hi, M: int, MR: int, call) -> None:
    """The loop over rows [m_lo, m_hi) of the GEMM's A in micro-tiles of MR rows (`{t}m` the
    first row; call(mr) emits one micro-kernel call), the last tile M % MR rows where M is not
    a multiple of MR (every block but the last ends on a whole tile)."""
    src.line(f"{t}m = {m_lo}")
    src.line(f"while {t}m + {MR} <= {m_hi}:").indent()
    call(MR)
    src.line(f"{t}m += {MR}").dedent()
    if M % MR:
        src.line(f"if {t}m < {m_hi}:").indent()
        call(M % MR)
        src.dedent()
