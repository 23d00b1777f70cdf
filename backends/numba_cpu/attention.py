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
scratch slot; with more, the runs are as many as the threads want (blocks
get smaller when there are fewer than threads) and each item has a slot of
its own, so no result depends on which thread ran what.
"""
from __future__ import annotations

import math

import numpy as np

from .ukernel import TBLOCK, TBlockSpec, UKSpec

from .gemm import TileLoops, ceil_div, choose_tile
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


def lower_attention(node, graph) -> Lowered:
    q_name, k_name, v_name = node.inputs[:3]
    mask_name = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] else ""
    out_name = node.outputs[0]
    q, k, v, out = (graph.values[n] for n in (q_name, k_name, v_name, out_name))
    (qshape, qs), (kshape, ks), (vshape, vs) = (operand(x.shape, node.attr(f"{p}_perm"))
                                                 for x, p in ((q, "q"), (k, "k"), (v, "v")))
    os_ = output_strides(out.shape, node.attr("out_perm"))
    T, D = qshape[-2:]
    S, Dv = kshape[-1], vshape[-1]
    batch = qshape[:-2]
    nb = math.prod(batch)
    # The mask's strides along the scores' axes [.., T, S]: 0 where it broadcasts.
    ms = broadcast_strides(graph.values[mask_name].shape, batch + [T, S]) if mask_name else None
    assert qs[-1] == 1 and vs[-1] == 1 and os_[-1] == 1, "fuse_attention checks the unit strides"

    SP = ceil_div(S, PAD) * PAD
    if (4 * SP) % ALIAS_BYTES == 0:
        # Rows a multiple of 1 KB apart (S = 241..256, 497..512...) fall in a few L1 sets: one more vector
        # breaks the stride. Whisper's 6 heads x 250 tokens: 0.615 -> 0.457 ms one-node, from C
        # (onnxruntime 0.46 ms); 240 tokens (960 B apart) ran 0.420 ms before and after.
        SP += PAD
    s_tile, o_tile = choose_tile(T, S), choose_tile(T, Dv)
    step = math.lcm(s_tile[0], o_tile[0])               # blocks of whole tiles of both products
    RB = max(step, BLOCK_BYTES // (4 * SP) // step * step)
    one_slot = session_threads() == 1
    if not one_slot and nb * ceil_div(T, RB) < work_items():   # smaller blocks: something for every thread
        RB = max(step, ceil_div(ceil_div(T, ceil_div(work_items(), nb)), step) * step)
    RB = min(RB, ceil_div(T, step) * step)
    n_blocks = ceil_div(T, RB)
    # Work items: (batch, run of consecutive blocks); one run per batch on one thread, else as many
    # as the threads want (each item packs its batch's Kt once, into a slot of its own).
    runs = 1 if one_slot else min(n_blocks, ceil_div(work_items(), nb))
    work = nb * runs
    slot = D * SP + RB * SP
    scratch = scratch_value(graph, node, ((1 if one_slot else work) * slot,), np.float32, tag="attention")

    # Every block but the last has RB rows (whole tiles of both products); the last may end in a partial tile.
    last_rows = T - (n_blocks - 1) * RB
    prod_s = _Product("us", s_tile, S, D, last_rows % s_tile[0])
    prod_o = _Product("uo", o_tile, Dv, S, last_rows % o_tile[0])

    scale = float(node.attr("scale", 1.0))
    scale_op = node.attr("scale_op", "")
    F = lambda x: literal(x, np.float32)

    src = Source()
    for line in TBlockSpec().declaration("tblock").splitlines():
        src.line(line)
    prod_s.declare(src)
    prod_o.declare(src)
    # Pointers: p0 q, p1 k, p2 v, [mask], scratch, out (what the kernel writes comes last)
    MK, SC, OUT = ("p3", "p4", "p5") if mask_name else ("", "p3", "p4")
    src.line(kernel_header(6 if mask_name else 5)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {runs}").line(f"run = item % {runs}")
    src.line("so = 0" if one_slot else f"so = item * {slot}")
    # The batch axes' offsets of each operand.
    operands = [("qb", qs), ("kb", ks), ("vb", vs), ("ob", os_)] + ([("mb", ms)] if mask_name else [])
    for name, _ in operands:
        src.line(f"{name} = 0")
    if batch:
        src.line("rest = n")
        for axis in reversed(range(len(batch))):
            src.line(f"i{axis} = rest % {batch[axis]}").line(f"rest = rest // {batch[axis]}")
            for name, strides in operands:
                if strides[axis]:
                    src.line(f"{name} += i{axis} * {strides[axis]}")
    # Kt [D][S] of this batch into the slot's first D*SP floats.
    ks_d, ks_s = ks[-2], ks[-1]
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
    src.line(f"for blk in range(run * {n_blocks} // {runs}, (run + 1) * {n_blocks} // {runs}):").indent()
    src.line(f"r0 = blk * {RB}").line(f"rows = min({RB}, {T} - r0)")
    src.line(f"sb = so + {D * SP}")
    # S = Q[r0:r0+rows] @ Kt
    prod_s.emit(src, "rows", "p0", f"qb + r0 * {qs[-2]}", qs[-2], SC, "so", SP, SC, "sb", SP)
    # P = softmax(S * scale + mask) row by row
    src.line("for i in range(rows):").indent()
    src.line(f"ro = sb + i * {SP}")
    sj = f"{SC}[ro + j]"
    scaled = {"Mul": f"{sj} * {F(scale)}", "Div": f"{sj} / {F(scale)}", "": sj}[scale_op]
    if mask_name:
        src.line(f"mo = mb + (r0 + i) * {ms[-2]}")
        scaled += f" + {MK}[mo + j * {ms[-1]}]"
    src.line("j = 0").line(f"m = {scaled}")
    src.line(f"for j in range({S}):").indent()
    if scale_op or mask_name:
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
    # O[r0:r0+rows] = P @ V
    prod_o.emit(src, "rows", SC, "sb", SP, "p2", "vb", vs[-2], OUT, f"ob + r0 * {os_[-2]}", os_[-2])
    args = [q_name, k_name, v_name] + ([mask_name] if mask_name else []) + [scratch, out_name]
    kernel = Kernel("FusedAttention", src.text(), ("float32",) * len(args))
    return Lowered([KernelCall(kernel, args, work, node.name, n_outputs=2)])
