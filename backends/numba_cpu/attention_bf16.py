"""FusedAttention in a bf16 build: its two products on the bf16 micro-kernel (ukernel_lowp.py).

The node is marked `precision: bf16` by passes/assign_precision.py; attention.py's docstring has the
algorithm and the error bound. Per work item (batch, run of blocks of query rows), with Kt
packed into float32 as the float32 kernel packs it (attention.Geometry.emit_kt_pack):

    Kt pairs    Kt rows 2kp, 2kp+1 rounded to bf16 and interleaved (lowp.PairCvtSpec): the VNNI pair
                layout B is read in, k = d; D odd: a last pair of row D-1 and a zero row
    V pairs     V rows 2sp, 2sp+1 likewise (k = s); S odd: a zero row S
    per block   Q's rows rounded to bf16 (lowp.CvtSpec; D odd: a zero column D), S = Q Kt on
                the micro-kernel (float32 sums) into the float32 rows of S, the softmax in
                float32 in place (as the float32 kernel's), P's rows rounded once to bf16 (S odd:
                a zero column S), O = P V on the micro-kernel into the output rows in place.

Scratch: a float32 slot (packed Kt, then a block's rows of S) and a bf16 slot (Kt and V pairs, a
block's rows of Q and of P) per work item (one on one thread), so no result depends on which
thread ran what. The micro-kernels read B's last column tile in full (bf16 loads are not
masked): what lies past a pair row's S (or Dv) columns only reaches C lanes the mask drops, and the
bf16 slot ends with 2 NR elements of slack for the last row's reads.
"""
from __future__ import annotations

import numpy as np

from .attention import PAD, Geometry, lower_attention
from .gemm import TileLoops, bf16_k_pass, ceil_div, lowp_label, lowp_product
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header
from .lowp import CvtSpec, PairCvtSpec
from .scratch import scratch_value
from .ukernel import TBlockSpec
from .ukernel_lowp import LowpUKSpec


class _PairProduct(TileLoops):
    """C[rows x N] = A[rows x K] @ B[K x N] on the bf16 micro-kernel (`method`): A rows of Kp = K
    rounded up to even bf16 `lda` apart, B in pair rows `ldb` apart (both in 16-bit elements), C
    float32 rows `ldc` apart; rows a multiple of MR except `rem` (compile time) at the end."""

    def __init__(self, tag: str, tile: tuple[int, int], N: int, K: int, rem_rows: int, method: str):
        MR, NR = tile
        self.N, self.rem = N, rem_rows
        # B loads are never masked: one kernel per row count serves full and masked column tiles
        names = {mr: f"{tag}{i}" for i, mr in enumerate(sorted({MR, rem_rows} - {0}))}
        specs = {(mr, masked): (names[mr], LowpUKSpec(mr=mr, nr=NR, dtype="bf16", method=method, a_packed=0))
                 for mr in names for masked in (0, 1)}
        super().__init__(tag, MR, NR, K + K % 2, specs)
        self.kc = bf16_k_pass(self.K)   # whole pairs a pass

    def declare(self, src: Source) -> None:
        for name, spec in sorted(set(self.specs.values())):
            for line in spec.declaration(name).splitlines():
                src.line(line)

    def emit(self, src: Source, rows, a, aoff, lda, b, boff, ldb, c, coff, ldc) -> None:
        t = self.tag

        def call(mr, m, masked):
            name = self.specs[(mr, masked)][0]
            src.line(f"{name}({a}, {aoff} + {m} * {lda} + {t}k0, {lda}, {b}, {boff} + ({t}k0 >> 1) * {ldb} + 2 * {t}n0, "
                     f"{ldb}, {c}, {coff} + {m} * {ldc} + {t}n0, {ldc}, {t}kc >> 1, {t}mask, {t}flags, {c}, 0)")
        self.loops(src, self.N, rows, self.rem, f"min({t}k0, 1)", call)


def _pairs(src: Source, rows: int, src_ptr: str, soff: str, stride, dst: str, doff: str, ld: int, n: int) -> None:
    """Lines writing rows 0..rows-1 (float32, `stride` apart from src_ptr[soff]) as bf16 pair rows of n
    columns, `ld` apart from dst[doff]; an odd last row is paired with zeros."""
    src.line(f"for kp in range({rows // 2}):").indent()
    src.line(f"pcvt({src_ptr}, {soff} + 2 * kp * {stride}, {stride}, {dst}, {doff} + kp * {ld}, {n})").dedent()
    if rows % 2:
        last = f"{doff} + {rows // 2 * ld}"
        src.line(f"pcvt({src_ptr}, {soff} + {rows - 1} * {stride}, 0, {dst}, {last}, {n})")
        src.line(f"for j in range({n}):").indent().line(f"{dst}[{last} + 2 * j + 1] = np.uint16(0)").dedent()


def _rows_to_bf16(src: Source, src_ptr: str, soff: str, stride, dst: str, doff: str, ld: int, n: int) -> None:
    """Lines rounding the block's `rows` rows of n float32 (`stride` apart) to bf16 rows `ld` apart
    (n odd: a zero column n, the pair the micro-kernel reads with the zero row of B)."""
    src.line("for i in range(rows):").indent()
    src.line(f"cvt({src_ptr}, {soff} + i * {stride}, {dst}, {doff} + i * {ld}, {n})")
    if n % 2:
        src.line(f"{dst}[{doff} + i * {ld} + {n}] = np.uint16(0)")
    src.dedent()


def lower_fused_attention(node, graph) -> Lowered:
    """FusedAttention: these products where the node is marked bf16 (and the target has a method:
    every target has "widen"), else attention.py's float32 kernel."""
    lowp = lowp_product(node)
    if lowp is None or lowp[0] != "bf16":
        return lower_attention(node, graph)
    return lower_attention_bf16(node, graph, lowp)


def lower_attention_bf16(node, graph, lowp: tuple[str, str]) -> Lowered:
    # Packing Kt and V in pairs costs more than the float32 kernel's Kt copy: Geometry's fewest even
    # items (whole batches where they divide among the threads) pack least (encoder, 4 heads,
    # 2 threads: 0.0292 -> 0.0278 ms)
    g = Geometry(node, graph)
    method = lowp[1]
    prod_s = _PairProduct("us", g.s_tile, g.S, g.D, g.last_rows % g.s_tile[0], method)
    prod_o = _PairProduct("uo", g.o_tile, g.Dv, g.S, g.last_rows % g.o_tile[0], method)
    Dp, Sp = prod_s.K, prod_o.K                      # D and S in whole pairs
    ldk = 2 * g.SP                                   # a pair row of Kt: SP columns
    ldv = 2 * ceil_div(g.Dv, PAD) * PAD              # a pair row of V
    lda_q, lda_p = ceil_div(Dp, PAD) * PAD, ceil_div(Sp, PAD) * PAD   # rows of Q and P in bf16
    # bf16 slot: Kt pairs | V pairs | the block's Q rows | its P rows | slack for B's full-tile reads
    kt_at, v_at = 0, Dp // 2 * ldk
    q_at = v_at + Sp // 2 * ldv
    p_at = q_at + g.RB * lda_q
    hslot = p_at + g.RB * lda_p + 2 * max(g.s_tile[1], g.o_tile[1])
    hslot = ceil_div(hslot, 2 * PAD) * 2 * PAD
    scratch = scratch_value(graph, node, (g.slots() * g.slot,), np.float32, tag="attention")
    half = scratch_value(graph, node, (g.slots() * hslot,), np.uint16, tag="attention_bf16")

    src = Source()
    for line in (TBlockSpec().declaration("tblock") + CvtSpec("f32", "bf16").declaration("cvt")
                 + PairCvtSpec().declaration("pcvt")).splitlines():
        src.line(line)
    prod_s.declare(src)
    prod_o.declare(src)
    # Pointers: p0 q, p1 k, p2 v, [mask], scratch, bf16 scratch, out (what the kernel writes comes last)
    MK, SC, H, OUT = ("p3", "p4", "p5", "p6") if g.mask_name else ("", "p3", "p4", "p5")
    src.line(kernel_header(7 if g.mask_name else 6)).indent()
    g.emit_item_head(src)
    src.line("ho = 0" if g.one_slot else f"ho = item * {hslot}")
    g.emit_kt_pack(src, SC)
    _pairs(src, g.D, SC, "so", g.SP, H, f"ho + {kt_at}", ldk, g.S)
    _pairs(src, g.S, "p2", "vb", g.vs[-2], H, f"ho + {v_at}", ldv, g.Dv)
    src.line(f"for blk in range(run * {g.n_blocks} // {g.runs}, (run + 1) * {g.n_blocks} // {g.runs}):").indent()
    src.line(f"r0 = blk * {g.RB}").line(f"rows = min({g.RB}, {g.T} - r0)")
    src.line(f"sb = so + {g.D * g.SP}")
    _rows_to_bf16(src, "p0", f"qb + r0 * {g.qs[-2]}", g.qs[-2], H, f"ho + {q_at}", lda_q, g.D)
    # S = Q[r0:r0+rows] @ Kt
    prod_s.emit(src, "rows", H, f"ho + {q_at}", lda_q, H, f"ho + {kt_at}", ldk, SC, "sb", g.SP)
    g.emit_softmax(src, node, SC, MK)
    _rows_to_bf16(src, SC, "sb", g.SP, H, f"ho + {p_at}", lda_p, g.S)
    # O[r0:r0+rows] = P @ V
    prod_o.emit(src, "rows", H, f"ho + {p_at}", lda_p, H, f"ho + {v_at}", ldv, OUT, f"ob + r0 * {g.os[-2]}", g.os[-2])
    args = [g.q_name, g.k_name, g.v_name] + ([g.mask_name] if g.mask_name else []) + [scratch, half, g.out_name]
    types = ("float32",) * (len(args) - 2) + ("uint16", "float32")
    kernel = Kernel("FusedAttention", src.text(), types)
    return Lowered([KernelCall(kernel, args, g.work, node.name, n_outputs=3, precision=lowp_label(lowp))])
