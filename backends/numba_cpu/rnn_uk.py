"""The matrix products of LSTM, GRU and RNN on vector micro-kernels, for float32
nodes whose weights are constants (rnn.py falls back to its dot-product loops
otherwise).

A recurrent step is a matrix-vector product h . R^T over the G*H gate rows of R
(for LSTM with H=128: 256 KB of R per step, streamed from L2). Rather than dot
products of h with rows of R (reduced across lanes), the broadcast form reads
R^T, with no horizontal sums:

    pre[g0:g0+64] += sum_k h[k] * RT[k, g0:g0+64]

with four 16-float accumulators per batch row held in registers across the
k loop (ukernel.py's micro-kernel without its B prefetches, up to 6 batch rows
sharing each load of R). R is
packed at build time into panels of 64 gate rows, each panel k-major and
contiguous ([panel, k, 64]: what `pack_b_panels` gives for R^T), so a step
reads R as one sequential stream. The input projection x . W^T + b of every
step is a small GEMM on ukernel.py's micro-kernel (6 input rows per tile),
with W^T packed the same way.

Measured (LSTM 64->128, 2 layers, 32 steps, batch 1, one core): a step's
h . R^T runs at ~1.5 us, close to the time L2 takes to deliver 256 KB
(~1.36 us at the ~190 GB/s one core reads from L2), so the recurrences
(~95 us of the model's ~135 us) are bound by R's bytes, not by arithmetic.
On two threads each step is split in halves of the hidden units (rnn.py's
_unit_split), each thread streaming its 128 KB of R from its own L2: the
model's two recurrences 2 x 63 -> 2 x 44 us (per-step profile).
"""
from __future__ import annotations

import numpy as np

from .kernel import Source

NR = 64        # gate rows per panel (4 zmm vectors on AVX-512)
MR = 6         # input rows / batch rows per micro-tile (6 x 64: 24 accumulators)
KC = 256       # k values per micro-kernel call of the projection (the W micro-panel stays in L1/L2)


def panels(matrix: np.ndarray) -> np.ndarray:
    """[rows, K] (gate rows of W or R) -> flat [ceil(rows/NR), K, NR] panels of its transpose,
    zero padded: the layout the micro-kernel reads B in."""
    from .gemm import pack_b_panels
    return pack_b_panels(np.ascontiguousarray(np.asarray(matrix, np.float32).T), NR).reshape(-1)


def lowp_panels(matrix: np.ndarray, fmt: str) -> np.ndarray:
    """`panels` in 16 bits (uint16, rounded to nearest even): bf16 in the pair layout the bf16
    micro-kernels read ([panel, K/2, 2 NR], K even), float16 as `panels`. The element offset of
    panel p, k is p*K*NR + k*NR in either layout (k even for bf16)."""
    from .gemm import pack_b_lowp
    return pack_b_lowp(np.ascontiguousarray(np.asarray(matrix, np.float32).T), NR, fmt).reshape(-1)


def n_panels(rows: int) -> int:
    return -(-rows // NR)


class MicroKernels:
    """The micro-kernels a kernel calls (one per tile height), declared at module level.

    `prefetch_b=False` for the recurrence: a step's R (256 KB for H=128) comes from L2 as one
    sequential stream the hardware prefetchers follow, and the micro-kernel's software prefetches
    of B only compete with its loads (a C loop of the same shape: 1.60 against 1.47 us per step
    of h . R^T, H=128, 4H=512)."""

    def __init__(self, prefetch_b: bool = True, lowp: tuple[str, str] | None = None):
        self.specs = {}
        self.prefetch_b = int(prefetch_b)
        # (format, method): 16-bit A (rows) and B (lowp_panels) on ukernel_lowp's micro-kernels,
        # float32 sums; offsets count 16-bit elements, bf16 k in pairs (kc even).
        self.lowp = lowp

    def name(self, mr: int) -> str:
        from .ukernel import UKSpec
        from .ukernel_lowp import LowpUKSpec
        if mr not in self.specs:
            self.specs[mr] = (f"uk{mr}", LowpUKSpec(mr=mr, nr=NR, dtype=self.lowp[0], method=self.lowp[1], a_packed=0)
                              if self.lowp else UKSpec(mr=mr, nr=NR, a_packed=0, prefetch_b=self.prefetch_b))
        return self.specs[mr][0]

    def header(self) -> Source:
        head = Source()
        for mr in sorted(self.specs):
            name, spec = self.specs[mr]
            for line in spec.declaration(name).splitlines():
                head.line(line)
        return head

    def call(self, src: Source, mr, a, aoff, lda, b, boff, c, coff, ldc, kc, mask, loadc):
        """C[mr rows, 64] (+)= A[mr rows, kc] . B[kc, 64]: a source line (mr a literal int)."""
        ldb, bias = NR, a
        if self.lowp:   # (the bias pointer, unused, must be a float32 one)
            bias = c
            if self.lowp[0] == "bf16":
                assert isinstance(kc, int) and kc % 2 == 0, kc
                ldb, kc = 2 * NR, kc // 2
        src.line(f"{self.name(mr)}({a}, {aoff}, {lda}, {b}, {boff}, {ldb}, {c}, {coff}, {ldc}, {kc}, {mask}, {loadc}, {bias}, 0)")

    def rows(self, src: Source, M: int, a, abase, lda, b, boff, c, cbase, ldc, kc, mask, loadc):
        """All M rows (a compile-time count) in tiles of MR rows, then the remainder."""
        full = M // MR
        if full:
            src.line(f"for m in range(0, {full * MR}, {MR}):").indent()
            self.call(src, MR, a, f"{abase} + m*{lda}", lda, b, boff, c, f"{cbase} + m*{ldc}", ldc, kc, mask, loadc)
            src.dedent()
        if M % MR:
            m = full * MR
            self.call(src, M % MR, a, f"{abase} + {m * lda}", lda, b, boff, c, f"{cbase} + {m * ldc}", ldc, kc,
                      mask, loadc)

    def tiles(self, src: Source, count_var, a, aoff, lda, b, boff, c, coff, ldc, kc, nvalid: int, loadc, counts):
        """C[rows, :nvalid] (+)= A . B for `count_var` rows (one of `counts`, literal ints): a call
        per possible count, chosen at run time when there are several."""
        mask = -1 if nvalid >= NR else (1 << nvalid) - 1
        counts = sorted(set(counts), reverse=True)
        for i, n in enumerate(counts):
            if len(counts) > 1:
                kw = "if" if i == 0 else ("elif" if i < len(counts) - 1 else "else")
                src.line(f"{kw} {count_var} == {n}:" if kw != "else" else "else:").indent()
            self.call(src, n, a, aoff, lda, b, boff, c, coff, ldc, kc, mask, loadc)
            if len(counts) > 1:
                src.dedent()
