"""FusedAttention on the GPU: O = softmax(Q Kt * scale [+ mask]) V in one kernel, flash-attention style.

The op and its operands are numba_cpu/attention.py's (made by passes/fuse_attention.py): Q, K, V
and O read and written through permutations (the head-splitting Transposes become strides), the
optional mask broadcast to the scores [.., T, S].

A block of 128 threads takes one batch (batch x heads) and a tile of TQ = 8 x RT query rows: its
threads are 8 row groups of 16 key lanes (a half-warp each), thread (g, l) owning rows
g*RT .. g*RT + RT-1. The Q tile goes to shared memory once; then, for each block of SB = 16 x KT
keys, the block stages that block's K (transposed, keys along the rows, XOR-swizzled by the
head dim so both the staging stores and the reads miss bank conflicts) and V in shared memory,
and each thread computes an RT x KT tile of scores in registers (keys l, l + 16...: one shared
load of Q and of K feeds RT x KT products), updates its rows' online softmax (the block's max
across the 16 lanes of the row group, the rescale of what was summed so far), writes its
probabilities to shared memory, and accumulates an RT x DT tile of O = P V (output dims l,
l + 16...). Every exchange between lanes is warps.py's butterfly: fixed order, so the same
inputs give the same bits. Neither the scores nor P ever reach global memory, and each staged
K and V element serves TQ query rows.

Shared memory stays within the 48 KiB of a static allocation (head dims up to 128: fewer rows or
keys per block as they grow); more rows per thread (more reuse) only while the blocks still
give every multiprocessor two.
"""
from __future__ import annotations

import math

from backends.numba_cpu.attention import operand, output_strides
from backends.numba_cpu.kernel import Source, broadcast_strides
from cuvil.errors import UnsupportedOpError

from .kernel import KernelCall, Lowered, gpu_kernel
from .warps import LANE_XOR, allreduce

NT = 128                     # threads per block
LANES = 16                   # key (and output-dim) lanes of a row group
GROUPS = NT // LANES         # row groups per block
UNROLL = 8                   # staging loads in flight per thread
SHARED_FLOATS = 48 * 1024 // 4
SMS = 132                    # multiprocessors to fill (an H200's)
_LOWEST = "float32(-3.4028234663852886e38)"   # the running max's start (fastmath: no infinities)


def _tiles(nb: int, T: int, S: int, D: int, Dv: int):
    """(rows, keys) per thread with the shared arrays within SHARED_FLOATS, or None."""
    DW = -(-Dv // LANES) * LANES
    for rt in (4, 2, 1):
        if rt > 1 and nb * -(-T // (GROUPS * rt)) < 2 * SMS:
            continue
        for kt in ((4, 2) if S > 2 * LANES else (2,)):
            tq, sb = GROUPS * rt, LANES * kt
            if tq * D + D * sb + sb * DW + tq * sb <= SHARED_FLOATS:
                return rt, kt
    return None


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
    ms = broadcast_strides(graph.values[mask_name].shape, batch + [T, S]) if mask_name else None
    tiles = _tiles(nb, T, S, D, Dv)
    if tiles is None:
        raise UnsupportedOpError(f"node '{node.name}' (FusedAttention): head dims {D}/{Dv} need more shared "
                                 "memory than one block has", hint="the GPU kernel takes head dims up to 128")
    RT, KT = tiles
    TQ, SB, DT = GROUPS * RT, LANES * KT, -(-Dv // LANES)
    DW = DT * LANES
    QB, KB = -(-T // TQ), -(-S // SB)
    scale = float(node.attr("scale", 1.0))
    factor = {"Mul": scale, "Div": 1.0 / scale, "": 1.0}[node.attr("scale_op", "")]
    MK, OUT = ("p3", "p4") if mask_name else ("", "p3")
    rows, keys, dims = range(RT), range(KT), range(DT)

    src = Source()
    src.line(f"def kernel(p0, p1, p2, {'p3, p4' if mask_name else 'p3'}, n):").indent()
    src.line(f"qsh = cuda.shared.array({TQ * D}, float32)")
    src.line(f"ksh = cuda.shared.array({D * SB}, float32)")
    src.line(f"vsh = cuda.shared.array({SB * DW}, float32)")
    src.line(f"psh = cuda.shared.array({TQ * SB}, float32)")
    src.line("t = cuda.threadIdx.x").line(f"kl = t % {LANES}").line(f"rg = t // {LANES}")
    src.line(f"bn = cuda.blockIdx.x // {QB}").line(f"r0 = (cuda.blockIdx.x % {QB}) * {TQ}")
    operands = [("qb", qs), ("kb", ks), ("vb", vs), ("ob", os_)] + ([("mb", ms)] if mask_name else [])
    for name, _ in operands:
        src.line(f"{name} = 0")
    if batch:
        src.line("rest = bn")
        for axis in reversed(range(len(batch))):
            src.line(f"i{axis} = rest % {batch[axis]}").line(f"rest = rest // {batch[axis]}")
            for name, strides in operands:
                if strides[axis]:
                    src.line(f"{name} += i{axis} * {strides[axis]}")

    def staged(count, split, value, valid, dest):
        """Copy `count` elements into shared memory, the block's threads taking e = t, t + NT...:
        element e is (a, b) = (e // split, e % split), loaded as `value` where `valid` holds (else 0)
        and stored at `dest`, UNROLL loads in flight per thread. The loop over the chunks has a
        trip count that depends on `n` (always positive) so that LLVM keeps it a loop: fully
        unrolled, every load of a stage would be in flight at once with its 64-bit address
        (255 registers and spills)."""
        iters = -(-count // NT)
        chunks = -(-iters // UNROLL)
        ragged = iters * NT > count or chunks * UNROLL > iters
        src.line(f"for ch in range({chunks} if n > 0 else 0):").indent()
        for u in range(UNROLL):
            names = {"a": f"a{u}", "b": f"b{u}", "e": f"e{u}"}
            src.line(f"e{u} = t + (ch * {UNROLL} + {u}) * {NT}").line(f"a{u} = e{u} // {split}").line(f"b{u} = e{u} % {split}")
            cond = ([f"e{u} < {count}"] if ragged else []) + ([valid.format(**names)] if valid else [])
            load = value.format(**names)
            src.line(f"g{u} = {load} if {' and '.join(cond)} else float32(0)" if cond else f"g{u} = {load}")
        for u in range(UNROLL):
            names = {"a": f"a{u}", "b": f"b{u}", "e": f"e{u}"}
            if ragged:
                src.line(f"if e{u} < {count}:").indent().line(f"{dest.format(**names)} = g{u}").dedent()
            else:
                src.line(f"{dest.format(**names)} = g{u}")
        src.dedent()

    # The block's Q rows (zeros past T), and the registers: each row's running max and sum, its O tile.
    staged(TQ * D, D, f"p0[qb + (r0 + {{a}}) * {qs[-2]} + {{b}}]", f"r0 + {{a}} < {T}", "qsh[{e}]")
    for i in rows:
        src.line(f"m{i} = {_LOWEST}").line(f"l{i} = float32(0)")
        for dd in dims:
            src.line(f"o{i}_{dd} = float32(0)")

    src.line(f"for kblk in range({KB}):").indent()
    src.line(f"k0 = kblk * {SB}")
    src.line("cuda.syncthreads()")   # the previous key block's K, V and P are no longer read
    # K transposed: ksh[d][key ^ (d % 32)], zeros past S; read along whichever of d, s is contiguous.
    ks_d, ks_s = ks[-2], ks[-1]
    if ks_s == 1 and ks_d != 1:   # keys contiguous: e = d * SB + key
        staged(SB * D, SB, f"p1[kb + {{a}} * {ks_d} + k0 + {{b}}]", f"k0 + {{b}} < {S}",
               f"ksh[{{a}} * {SB} + ({{b}} ^ ({{a}} & 31))]")
    else:                         # head dims contiguous: e = key * D + d
        staged(SB * D, D, f"p1[kb + {{b}} * {ks_d} + (k0 + {{a}}) * {ks_s}]", f"k0 + {{a}} < {S}",
               f"ksh[{{b}} * {SB} + ({{a}} ^ ({{b}} & 31))]")
    staged(SB * DW, DW, f"p2[vb + (k0 + {{a}}) * {vs[-2]} + {{b}}]", f"k0 + {{a}} < {S} and {{b}} < {Dv}", "vsh[{e}]")
    src.line("cuda.syncthreads()")
    # Scores: the thread's RT rows x KT keys (keys kl, kl + 16...).
    for i in rows:
        for j in keys:
            src.line(f"s{i}_{j} = float32(0)")
    src.line(f"for d in range({D}):").indent()
    src.line("sw = d & 31")
    for j in keys:
        src.line(f"kv{j} = ksh[d * {SB} + ((kl + {LANES * j}) ^ sw)]")
    for i in rows:
        src.line(f"q{i} = qsh[(rg * {RT} + {i}) * {D} + d]")
        for j in keys:
            src.line(f"s{i}_{j} += q{i} * kv{j}")
    src.dedent()
    # Online softmax per row: scale and mask, the block's max across the row group, P to shared memory.
    for i in rows:
        src.line(f"row = min(r0 + rg * {RT} + {i}, {T - 1})")
        for j in keys:
            src.line(f"key = k0 + kl + {LANES * j}")
            score = f"s{i}_{j} * float32({factor!r})"
            if mask_name:
                score += f" + {MK}[mb + row * {ms[-2]} + key * {ms[-1]}]"
            src.line(f"s{i}_{j} = {score} if key < {S} else {_LOWEST}")
        src.line(f"bm = s{i}_0")
        for j in keys[1:]:
            src.line(f"bm = max(bm, s{i}_{j})")
        allreduce(src, "bm", "max", LANES)
        src.line(f"mn = max(m{i}, bm)").line(f"alpha = math.exp(m{i} - mn)").line(f"m{i} = mn")
        src.line(f"l{i} = l{i} * alpha")
        for dd in dims:
            src.line(f"o{i}_{dd} = o{i}_{dd} * alpha")
        for j in keys:
            src.line(f"p = math.exp(s{i}_{j} - mn) if k0 + kl + {LANES * j} < {S} else float32(0)")
            src.line(f"psh[(rg * {RT} + {i}) * {SB} + kl + {LANES * j}] = p").line(f"l{i} += p")
    src.line("cuda.syncthreads()")   # P of each row group visible to its lanes
    # O += P V: the thread's RT rows x DT output dims (kl, kl + 16...).
    src.line(f"for c in range({SB}):").indent()
    for dd in dims:
        src.line(f"v{dd} = vsh[c * {DW} + kl + {LANES * dd}]")
    for i in rows:
        src.line(f"pr = psh[(rg * {RT} + {i}) * {SB} + c]")
        for dd in dims:
            src.line(f"o{i}_{dd} += pr * v{dd}")
    src.dedent().dedent()
    # O = the tile / (the row's sum over its 16 lanes)
    for i in rows:
        src.line(f"total = l{i}")
        allreduce(src, "total", "sum", LANES)
        src.line("inv = float32(1) / total")
        src.line(f"row = r0 + rg * {RT} + {i}")
        src.line(f"if row < {T}:").indent()
        for dd in dims:
            if LANES * (dd + 1) > Dv:
                src.line(f"if kl + {LANES * dd} < {Dv}:").indent()
                src.line(f"{OUT}[ob + row * {os_[-2]} + kl + {LANES * dd}] = o{i}_{dd} * inv").dedent()
            else:
                src.line(f"{OUT}[ob + row * {os_[-2]} + kl + {LANES * dd}] = o{i}_{dd} * inv")
        src.dedent()
    args = [q_name, k_name, v_name] + ([mask_name] if mask_name else []) + [out_name]
    kernel = gpu_kernel("FusedAttention", LANE_XOR + "\n\n" + src.text(), ("float32",) * len(args), NT)
    return Lowered([KernelCall(kernel, args, nb * QB * NT, node.name)])


GENERATORS = {"FusedAttention": lower_attention}
