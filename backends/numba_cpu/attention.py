"""FusedAttention (domain "cuvil", made by passes/fuse_attention.py): softmax(Q K^T * scale + mask) V in one kernel.

    S = Q @ Kt                      Q [.., T, D], Kt [.., D, S]  (Kt: K already transposed, as MatMul reads it)
    P = softmax(S * scale + M)      over the last axis ("Div": S / scale); M (optional) broadcasts to S
    O = P @ V                       V [.., S, Dv], O [.., T, Dv]

The leading axes are batch axes (batch x heads), the same for all four. Each
operand is a tensor read (or written) through a permutation: `q_perm` says
Q = transpose(q, q_perm), likewise `k_perm` (for Kt) and `v_perm`, and the
output is transpose(O, out_perm): the head-splitting Transposes around an
attention become strides here and never run. Q, V and O need unit stride
along their last axis (the micro-kernels' A rows, B rows and C rows); Kt is
packed per batch into scratch [D][S] (from any strides; K rows [S][D] as
exported, by 16 x 16 block transposes: ukernel.TBlockSpec).

A work item is (batch, run of consecutive blocks of query rows); its scratch
holds the batch's packed Kt and one block's rows of S and P (RB x S, about
BLOCK_BYTES, so they stay in L2 between the two products). Per block: S by
the GEMM micro-kernel with A = Q's rows in place, the softmax in place over
each row (scale, vmax, vexp, sum, 1/sum, as the Softmax kernel computes it),
then O's rows by the micro-kernel with A = P, B = V's rows in place, C = the
output rows in place. With one thread there is one run per batch and one
scratch slot; with more, each item has a slot of its own, so no result
depends on which thread ran what, and the runs are the fewest that the
threads finish together (even_split: whole batches where they divide among
the threads), else as many as the threads want (wanted_split: blocks get
smaller when there are fewer than threads). Blocks are whole tiles of both
products, so no result depends on the blocking either.

bf16 builds (the node marked `precision: bf16` by passes/assign_precision.py; attention_bf16.py):
both products on the bf16 micro-kernel (`vdpbf16ps` with AVX512-BF16, "widen" elsewhere), float32
sums: Kt and V rounded once to bf16 and packed per batch in the pair layout, Q's rows rounded once
per block, the softmax in float32 on S as above, P rounded once to bf16 as the second product's A.
fp16 builds keep the float32 kernel (no fp16 attention kernel). The error against a float32
engine (onnxruntime), u = 2^-8 (bf16), u32 = 2^-24, gamma(n) = n u32 / (1 - n u32), c the scale
(1/scale for "Div"), z = c S + M, for query row i:

- S: q and k each rounded once (relative u), their product exact in float32, D products summed
  in float32 by both engines, so |S^ - S| <= (2u + u^2 + 2 gamma(D + 1)(1 + u)^2) sum_d |q_id| |k_dj|.
  The scale, the mask's add and x - max each round once more in float32 in both engines:
  E_ij = |c| (that bound) + 4 u32 (|c S_ij| + |z_ij|) + 2 u32 (|z_ij| + max_j |z_ij|) bounds
  the perturbation of softmax's argument; E_i = max_j E_ij.
- softmax: P_j = e^z_j / sum_k e^z_k, so perturbing every z_k by at most E_i scales each P_j by
  a factor in [e^-2E_i, e^2E_i]; vexp (within 4 ulp), the sum (gamma(S)), 1/sum and the product
  add a relative 2 gamma(S + 12) for both engines: P^_j <= w_i P_j, w_i = e^(2 E_i)(1 + 2 gamma(S + 12)).
- O: P^ and V each rounded once (relative u) and S products summed in float32 by both engines:
  |O^_ic - O_ort,ic| <= w_i sum_j P_j |V_jc| (w_i (1 + u)^2 - 1 + gamma(S + 1)(w_i (1 + u)^2 + 1)),
  P the exact softmax (P_ort <= w_i P too).
vdpbf16ps treats bf16 subnormals (|x| < 2^-126) as zero: an absolute 2^-126 per operand, far
below the bound. tests/test_precision_attention.py checks it element by element against
onnxruntime (the errors measured are 2-6 % of it: the e^(2E) factor is a worst case over
the row).
"""
from __future__ import annotations

import math

import numpy as np

from .ukernel import TBLOCK, TBlockSpec, UKSpec

from .gemm import IMBALANCE_OK, TileLoops, ceil_div, choose_tile, slowest_share
from .kernel import (Kernel, KernelCall, Lowered, Source, broadcast_strides, dims_strides, kernel_header, literal,
                     session_threads, work_items)
from .scratch import scratch_value

BLOCK_BYTES = 64 << 10   # a block's rows of S (then P): L2-resident between the products
PAD = 16                 # rows of S and packed Kt are a multiple of this many floats apart
ALIAS_BYTES = 1024       # ... but not a multiple of this many bytes (see lower_attention)


def operand(shape, perm):
    """(logical shape, logical strides) of transpose(tensor of `shape`, perm)."""
    strides = dims_strides(shape)
    return [int(shape[p]) for p in perm], [strides[p] for p in perm]


def output_strides(shape, out_perm) -> list[int]:
    """Strides of O's logical axes when the output tensor (of `shape`) is transpose(O, out_perm)."""
    strides, logical = dims_strides(shape), [0] * len(shape)
    for k, p in enumerate(out_perm):
        logical[p] = strides[k]
    return logical


class _Product(TileLoops):
    """C[rows x N] = A[rows x K] @ B[K x N] on the micro-kernel, A rows `lda` apart in place, B rows
    `ldb` apart, C rows `ldc` apart; rows a multiple of MR except `rem` (compile time) at the end."""

    def __init__(self, tag: str, tile: tuple[int, int], N: int, K: int, rem_rows: int):
        MR, NR = tile
        self.N, self.rem = N, rem_rows
        keys = [(mr, masked) for mr in sorted({MR, rem_rows} - {0}) for masked in (0, 1)]
        super().__init__(tag, MR, NR, K, {key: (f"{tag}{i}", UKSpec(mr=key[0], nr=NR, a_packed=0, b_masked=key[1]))
                                          for i, key in enumerate(keys)})

    def emit(self, src: Source, rows, a, aoff, lda, b, boff, ldb, c, coff, ldc) -> None:
        t = self.tag

        def call(mr, m, masked):
            name = self.specs[(mr, masked)][0]
            src.line(f"{name}({a}, {aoff} + {m} * {lda} + {t}k0, {lda}, {b}, {boff} + {t}k0 * {ldb} + {t}n0, {ldb}, "
                     f"{c}, {coff} + {m} * {ldc} + {t}n0, {ldc}, {t}kc, {t}mask, {t}flags, {c}, 0)")
        self.loops(src, self.N, rows, self.rem, f"min({t}k0, 1)", call)


def run_rows(T: int, RB: int, runs: int) -> list[int]:
    """The query rows of each of a batch's `runs` runs of consecutive blocks of RB rows (the last
    block the rest of T), cut as the kernel's block loop cuts them."""
    n_blocks = ceil_div(T, RB)
    return [min(T, (r + 1) * n_blocks // runs * RB) - r * n_blocks // runs * RB for r in range(runs)]


def even_split(T: int, nb: int, step: int, rb_most: int, most_runs: int) -> tuple[int, int] | None:
    """(RB, runs): the fewest work items (nb batches x runs) that the session's threads finish
    within IMBALANCE_OK of an even share, as the pool hands them out, with the largest blocks
    (multiples of `step` rows, at most rb_most) among those; None when no split up to most_runs
    runs a batch does. Every item packs its batch's Kt, so fewer items pack less.
    DeiT / ViT (3 heads x 197-198 rows) at 2 threads: 3 runs of 72, 72, 54 rows a head left
    the slowest thread 9 % over an even share; 2 runs of 96 and 102 (blocks of 48) give 1.01 and
    6 packs, not 9. Whisper (6 heads x 250): whole heads, 6 packs, not 12."""
    threads = session_threads()
    for runs in range(1, most_runs + 1):
        fits = [RB for RB in range(step, rb_most + 1, step)
                if ceil_div(T, RB) >= runs and slowest_share(run_rows(T, RB, runs) * nb, threads) <= IMBALANCE_OK]
        if fits:
            return max(fits), runs
    return None


def wanted_split(T: int, nb: int, step: int, RB: int) -> tuple[int, int]:
    """(RB, runs) for as many work items as work_items() wants: runs of blocks of at most RB rows,
    smaller blocks (multiples of `step`) where there are too few for every thread."""
    if nb * ceil_div(T, RB) < work_items():
        RB = min(RB, max(step, ceil_div(ceil_div(T, ceil_div(work_items(), nb)), step) * step))
    return RB, min(ceil_div(T, RB), ceil_div(work_items(), nb))


class Geometry:
    """The shapes, strides and blocking of one FusedAttention node (float32 and bf16 kernels alike)."""

    def __init__(self, node, graph):
        self.q_name, self.k_name, self.v_name = node.inputs[:3]
        self.mask_name = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] else ""
        self.out_name = node.outputs[0]
        q, k, v, out = (graph.values[n] for n in (self.q_name, self.k_name, self.v_name, self.out_name))
        (qshape, self.qs), (kshape, self.ks), (vshape, self.vs) = (
            operand(x.shape, node.attr(f"{p}_perm")) for x, p in ((q, "q"), (k, "k"), (v, "v")))
        self.os = output_strides(out.shape, node.attr("out_perm"))
        self.T, self.D = qshape[-2:]
        self.S, self.Dv = kshape[-1], vshape[-1]
        self.batch = qshape[:-2]
        self.nb = math.prod(self.batch)
        T, S, Dv = self.T, self.S, self.Dv
        # The mask's strides along the scores' axes [.., T, S]: 0 where it broadcasts.
        self.ms = broadcast_strides(graph.values[self.mask_name].shape, self.batch + [T, S]) if self.mask_name else None
        assert self.qs[-1] == 1 and self.vs[-1] == 1 and self.os[-1] == 1, "fuse_attention checks the unit strides"

        SP = ceil_div(S, PAD) * PAD
        if (4 * SP) % ALIAS_BYTES == 0:
            # Rows a multiple of 1 KB apart (S = 241..256, 497..512...) fall in a few L1 sets: one more vector
            # breaks the stride. Whisper's 6 heads x 250 tokens: 0.615 -> 0.457 ms one-node, from C
            # (onnxruntime 0.46 ms); 240 tokens (960 B apart) ran 0.420 ms before and after.
            SP += PAD
        self.SP = SP
        self.s_tile, self.o_tile = choose_tile(T, S), choose_tile(T, Dv)
        step = math.lcm(self.s_tile[0], self.o_tile[0])    # blocks of whole tiles of both products
        RB = min(max(step, BLOCK_BYTES // (4 * SP) // step * step), ceil_div(T, step) * step)
        self.one_slot = session_threads() == 1
        # Work items: (batch, run of consecutive blocks), each packing its batch's Kt once into a slot of
        # its own. One run per batch on one thread; else the fewest items the threads finish together,
        # else as many as the threads want.
        self.RB, self.runs = (RB, 1) if self.one_slot else (
            even_split(T, self.nb, step, RB, ceil_div(work_items(), self.nb)) or wanted_split(T, self.nb, step, RB))
        RB = self.RB
        self.n_blocks = ceil_div(T, RB)
        self.work = self.nb * self.runs
        self.slot = self.D * SP + RB * SP
        # Every block but the last has RB rows (whole tiles of both products); the last may end in a partial tile.
        self.last_rows = T - (self.n_blocks - 1) * RB

    def slots(self) -> int:
        """Scratch slots: one on one thread, one per work item else."""
        return 1 if self.one_slot else self.work

    def emit_item_head(self, src: Source) -> None:
        """The item loop's first lines: n (the batch), run, so (the float32 slot's offset) and the
        batch axes' offsets of each operand (qb, kb, vb, ob, mb)."""
        g = self
        src.line("for item in range(begin, end):").indent()
        src.line(f"n = item // {g.runs}").line(f"run = item % {g.runs}")
        src.line("so = 0" if g.one_slot else f"so = item * {g.slot}")
        operands = [("qb", g.qs), ("kb", g.ks), ("vb", g.vs), ("ob", g.os)] + ([("mb", g.ms)] if g.mask_name else [])
        for name, _ in operands:
            src.line(f"{name} = 0")
        if g.batch:
            src.line("rest = n")
            for axis in reversed(range(len(g.batch))):
                src.line(f"i{axis} = rest % {g.batch[axis]}").line(f"rest = rest // {g.batch[axis]}")
                for name, strides in operands:
                    if strides[axis]:
                        src.line(f"{name} += i{axis} * {strides[axis]}")

    def emit_kt_pack(self, src: Source, SC: str) -> None:
        """Kt [D][S] of this batch (float32) into the slot's first D*SP floats of SC."""
        D, S, SP = self.D, self.S, self.SP
        ks_d, ks_s = self.ks[-2], self.ks[-1]
        pack = f"{SC}[so + d * {SP} + s] = p1[kb + d * {ks_d} + s * {ks_s}]"
        if ks_s == 1:   # rows of Kt are contiguous already: copy them
            src.line(f"for d in range({D}):").indent().line(f"for s in range({S}):").indent().line(pack)
            src.dedent().dedent()
        elif ks_d == 1 and min(S, D) >= TBLOCK:
            # K rows [S][D] contiguous along d: 16 x 16 blocks by the shuffle micro-kernel, the rows and
            # columns past the last whole block one float at a time.
            S16, D16 = S - S % TBLOCK, D - D % TBLOCK
            src.line(f"for s0 in range(0, {S16}, {TBLOCK}):").indent()
            src.line(f"for d0 in range(0, {D16}, {TBLOCK}):").indent()
            src.line(f"tblock(p1, kb + s0 * {ks_s} + d0, {ks_s}, {SC}, so + d0 * {SP} + s0, {SP})").dedent()
            if D16 < D:
                src.line(f"for s in range(s0, s0 + {TBLOCK}):").indent()
                src.line(f"for d in range({D16}, {D}):").indent().line(pack).dedent().dedent()
            src.dedent()
            if S16 < S:
                src.line(f"for s in range({S16}, {S}):").indent()
                src.line(f"for d in range({D}):").indent().line(pack).dedent().dedent()
        else:           # read along d (contiguous when K is [.., S, D] in memory), write along s
            src.line(f"for s in range({S}):").indent().line(f"for d in range({D}):").indent().line(pack)
            src.dedent().dedent()

    def emit_softmax(self, src: Source, node, SC: str, MK: str) -> None:
        """P = softmax(S * scale + mask) in place, row by row, over the block's rows of S at SC[sb...]."""
        S, SP = self.S, self.SP
        scale = float(node.attr("scale", 1.0))
        scale_op = node.attr("scale_op", "")
        F = lambda x: literal(x, np.float32)
        src.line("for i in range(rows):").indent()
        src.line(f"ro = sb + i * {SP}")
        sj = f"{SC}[ro + j]"
        scaled = {"Mul": f"{sj} * {F(scale)}", "Div": f"{sj} / {F(scale)}", "": sj}[scale_op]
        if self.mask_name:
            src.line(f"mo = mb + (r0 + i) * {self.ms[-2]}")
            scaled += f" + {MK}[mo + j * {self.ms[-1]}]"
        src.line("j = 0").line(f"m = {scaled}")
        src.line(f"for j in range({S}):").indent()
        if scale_op or self.mask_name:
            src.line(f"x = {scaled}").line(f"{sj} = x").line("m = vmax(m, x)")
        else:
            src.line(f"m = vmax(m, {sj})")
        src.dedent()
        src.line(f"total = {F(0)}")
        src.line(f"for j in range({S}):").indent()
        src.line(f"e = vexp({sj} - m)").line(f"{sj} = e").line("total += e").dedent()
        src.line(f"inv = {F(1)} / total")
        src.line(f"for j in range({S}):").indent().line(f"{sj} = {sj} * inv").dedent()
        src.dedent()


def lower_attention(node, graph) -> Lowered:
    """The float32 kernel (attention_bf16.lower_fused_attention sends a bf16-marked node elsewhere)."""
    g = Geometry(node, graph)
    scratch = scratch_value(graph, node, (g.slots() * g.slot,), np.float32, tag="attention")
    prod_s = _Product("us", g.s_tile, g.S, g.D, g.last_rows % g.s_tile[0])
    prod_o = _Product("uo", g.o_tile, g.Dv, g.S, g.last_rows % g.o_tile[0])

    src = Source()
    for line in TBlockSpec().declaration("tblock").splitlines():
        src.line(line)
    prod_s.declare(src)
    prod_o.declare(src)
    # Pointers: p0 q, p1 k, p2 v, [mask], scratch, out (what the kernel writes comes last)
    MK, SC, OUT = ("p3", "p4", "p5") if g.mask_name else ("", "p3", "p4")
    src.line(kernel_header(6 if g.mask_name else 5)).indent()
    g.emit_item_head(src)
    g.emit_kt_pack(src, SC)
    src.line(f"for blk in range(run * {g.n_blocks} // {g.runs}, (run + 1) * {g.n_blocks} // {g.runs}):").indent()
    src.line(f"r0 = blk * {g.RB}").line(f"rows = min({g.RB}, {g.T} - r0)")
    src.line(f"sb = so + {g.D * g.SP}")
    # S = Q[r0:r0+rows] @ Kt
    prod_s.emit(src, "rows", "p0", f"qb + r0 * {g.qs[-2]}", g.qs[-2], SC, "so", g.SP, SC, "sb", g.SP)
    g.emit_softmax(src, node, SC, MK)
    # O[r0:r0+rows] = P @ V
    prod_o.emit(src, "rows", SC, "sb", g.SP, "p2", "vb", g.vs[-2], OUT, f"ob + r0 * {g.os[-2]}", g.os[-2])
    args = [g.q_name, g.k_name, g.v_name] + ([g.mask_name] if g.mask_name else []) + [scratch, g.out_name]
    kernel = Kernel("FusedAttention", src.text(), ("float32",) * len(args))
    return Lowered([KernelCall(kernel, args, g.work, node.name, n_outputs=2)])
