"""GPU weight products in bf16 / fp16 (a Gemm / MatMul / FusedGemm / FusedMatMul whose constant B
passes/assign_precision.py marked): 16-bit operands, float32 sums, the float32 epilogue.

    out[m, n] = act(sum_k r(A[m, k]) r(B[k, n]) + C[m, n] + R[m, n])     r: round to bf16 / fp16 (nearest even)

B (alpha folded in) is rounded and packed at build time, two consecutive k per 32-bit word
(mma.pack_pairs: k even in the low half), which is the register layout of both mma operands.
A stays float32 in memory and is rounded when a block stages it into shared memory
(cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32). The error of one output against the float32 product:
each operand's rounding is a relative u (bf16 u = 2^-8, fp16 u = 2^-11), so each product is off
by at most (2u + u^2) |a||b|; the sum adds float32's own (see docs/cuda.md for the whole bound).

Two kernels, chosen by shape as gemm.py chooses between its own:

- tile (M > GEMV_ROWS): a block of 8 warps computes a BM x BN tile of the output, each warp a
  WM x WN part of it as (WM / 16) x (WN / 8) fragments of `mma.sync.aligned.m16n8k16.row.col.f32.
  {bf16.bf16|f16.f16}.f32` (mma.py), float32 accumulators in registers. A and B are staged in
  shared memory BK values of k per step, as 32-bit k pairs indexed [k pair, row] (the row
  stride is BM + 8 words, so the 32 lanes' fragment reads - 8 rows x 4 k pairs - hit 32
  distinct banks), double-buffered like gemm.py's float32 tile: the next step's global loads
  are issued before the current step's mmas and stored after them. A fragment register of A
  holds (row g [+ 8], k pair t [+ 4]) and one of B (k pair t [+ 4], column g), g = lane >> 2,
  t = lane % 4 (A_REGS, B_REGS; tests check them against mma.a_element / b_element; the kernel
  source names them lg, lt). B's
  packed rows are padded to whole steps and its columns to whole tiles: no guards on its loads.
  Split k, when tiles are too few to fill the GPU, as gemm.py does it (the same second kernel).
- gemv (M <= GEMV_ROWS, batch-1 inference: bound by the bytes of B): gemm.py's gemv with lanes
  over k, reading B packed N x ceil(K/2) words (half the bytes of float32), each word widened
  to two float32 in registers and multiplied by float32 FMAs; A is not rounded (the error is
  then u |b| per product, within the bound above). No tensor core: a GEMV has no reuse of B.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from backends.numba_cpu.epilogue import Epilogue
from backends.numba_cpu.gemm import ceil_div
from backends.numba_cpu.kernel import Source
from backends.numba_cpu.scratch import scratch_value

from . import gemm
from .gemm import (F, GEMV_ROWS, GEMV_UNROLL, THREADS, WARPS, Product, add_terms, batch_offsets, kernel_header,
                   pointer_count, store_output, stride_term)
from .kernel import KernelCall, gpu_kernel
from .mma import FORMATS, pack_pairs

PAD = 8        # words of padding per shared-memory row: a row stride of 8 (mod 32) banks

# Fragment registers as (row offset, k pair offset) from (g, t): A's four, B's two (column g).
A_REGS = ((0, 0), (8, 0), (0, 4), (8, 4))
B_REGS = (0, 4)
# Accumulator element i of a fragment as (row offset from g, column offset from 2 t).
C_ELEMS = ((0, 0), (0, 1), (8, 0), (8, 1))


@dataclass(frozen=True)
class TcTile:
    """A tensor-core tile: BM x BN per block of 8 warps (WARPS_M x WARPS_N), WM x WN per warp, BK
    values of k per step. `speed`: its relative rate (larger warp tiles reuse each fragment more)."""
    BM: int
    BN: int
    BK: int
    WM: int
    WN: int
    speed: float

    @property
    def warps_n(self) -> int:
        return self.BN // self.WN


TC_TILES = (TcTile(128, 128, 32, 64, 32, 1.0), TcTile(64, 64, 32, 32, 16, 0.7), TcTile(32, 64, 32, 16, 16, 0.5))


def format_of(node) -> str | None:
    """The mma type name ("bf16" | "f16") of a product marked with a reduced precision, else None."""
    return FORMATS.get(node.attr("precision"))


def label(fmt: str, how: str) -> str:
    """How a call computes, for `cuvil explain` (KernelCall.precision)."""
    return f"{'bf16' if fmt == 'bf16' else 'fp16'} ({how})"


def choose_tc_tile(M: int, N: int, K: int, n_batch: int) -> tuple[TcTile, int]:
    """gemm.choose_tile's choice (speed x SM utilisation x the share of the tile inside the output,
    splitting k where the tiles are too few) over the tensor-core tiles."""
    def score(choice):
        tile, splits = choice
        blocks = n_batch * ceil_div(M, tile.BM) * ceil_div(N, tile.BN) * splits
        inside = M / (ceil_div(M, tile.BM) * tile.BM) * N / (ceil_div(N, tile.BN) * tile.BN)
        return tile.speed * inside * min(1.0, blocks / gemm.SMS) * (gemm.SPLIT_COST if splits > 1 else 1.0)
    choices = [(tile, splits) for tile in TC_TILES for splits in gemm.K_SPLITS
               if splits == 1 or (K // splits >= gemm.MIN_SPLIT_K and gemm.split_k(K, splits, tile.BK)[1] == splits)]
    return max(choices, key=score)


def pack_b_tile(data: np.ndarray, tile: TcTile, k_total: int, fmt: str) -> np.ndarray:
    """K x N float B -> [k_total / 2, ceil(N / BN) BN] uint32 k pairs, zero-padded."""
    K, N = data.shape
    padded = np.zeros((k_total, ceil_div(N, tile.BN) * tile.BN), np.float32)
    padded[:K, :N] = data
    return pack_pairs(padded, fmt)


def pack_b_gemv(data: np.ndarray, fmt: str) -> np.ndarray:
    """K x N float B -> [N, ceil(K / 2)] uint32 k pairs: each column's words contiguous."""
    return np.ascontiguousarray(pack_pairs(data, fmt).T)


def warp_lines(src: Source, tile: TcTile) -> None:
    """A tile kernel's lane coordinates (lg = groupID, lt = threadID_in_group), its warp's corner
    (wm, wn) in the block tile, and the shared arrays sh_a, sh_b [buffer, k pair, row]."""
    src.line("lane = tid % 32")
    src.line("lg = lane // 4")
    src.line("lt = lane % 4")
    src.line(f"wm = tid // 32 // {tile.warps_n} * {tile.WM}")
    src.line(f"wn = tid // 32 % {tile.warps_n} * {tile.WN}")
    src.line(f"sh_a = cuda.shared.array((2, {tile.BK // 2}, {tile.BM + PAD}), uint32)")
    src.line(f"sh_b = cuda.shared.array((2, {tile.BK // 2}, {tile.BN + PAD}), uint32)")


def accumulators(i: int, j: int) -> list[str]:
    """The four accumulator names of the warp's fragment (i along m, j along n)."""
    return [f"c{i}_{j}_{e}" for e in range(4)]


def mma_step(src: Source, tile: TcTile, fmt: str) -> None:
    """One step's products: per 16 values of k, the warp's A and B fragments read from buffer `cur`
    (registers as A_REGS / B_REGS place them) and one mma per (i, j) fragment pair."""
    MF, NF = tile.WM // 16, tile.WN // 8
    for k16 in range(tile.BK // 16):
        kp0 = k16 * 8
        for i in range(MF):
            for reg, (dr, dk) in enumerate(A_REGS):
                src.line(f"a{i}_{reg} = sh_a[cur, {add_terms('lt', kp0 + dk)}, {add_terms('wm', 'lg', i * 16 + dr)}]")
        for j in range(NF):
            for reg, dk in enumerate(B_REGS):
                src.line(f"b{j}_{reg} = sh_b[cur, {add_terms('lt', kp0 + dk)}, {add_terms('wn', 'lg', j * 8)}]")
        for i in range(MF):
            for j in range(NF):
                a = ", ".join(f"a{i}_{reg}" for reg in range(4))
                acc = ", ".join(accumulators(i, j))
                src.line(f"{acc} = mma_{fmt}({a}, b{j}_0, b{j}_1, {acc})")


def output_elements(tile: TcTile):
    """(accumulator, row in the block tile, column in the block tile) of every element the lane
    holds (C_ELEMS)."""
    for i in range(tile.WM // 16):
        for j in range(tile.WN // 8):
            for acc, (dr, dc) in zip(accumulators(i, j), C_ELEMS):
                yield acc, add_terms("wm", "lg", i * 16 + dr), add_terms("wn", "2 * lt", j * 8 + dc)


def tile_kernel(family: str, p: Product, tile: TcTile, fmt: str, splits: int = 1):
    """The tensor-core tile kernel of product p (its B packed by pack_b_tile) and its work."""
    BM, BN, BK, WM, WN = tile.BM, tile.BN, tile.BK, tile.WM, tile.WN
    assert (BM // WM) * (BN // WN) == WARPS and WM % 16 == 0 and WN % 8 == 0 and BK % 16 == 0
    MF, NF, KP = WM // 16, WN // 8, BK // 2
    per_split, splits = gemm.split_k(p.K, splits, BK)
    tiles_m, tiles_n, steps = ceil_div(p.M, BM), ceil_div(p.N, BN), per_split // BK
    n_pad = tiles_n * BN
    src = Source()
    kernel_header(src, pointer_count(p))
    off = gemm.block_tile(src, p, tiles_m, tiles_n, splits, per_split)
    src.line(f"m0 = tm * {BM}")
    src.line(f"n0 = tn * {BN}")
    warp_lines(src, tile)

    # A's loads: rows x k pairs of the step, consecutive threads along A's contiguous dim; each
    # item is two float32 (k even, k odd) kept in registers until they are rounded into shared memory.
    pa, pb = p.ptr[0], p.ptr[1]
    k_contiguous = p.a.cols == 1 and p.a.rows != 1
    if k_contiguous:
        src.line(f"a_kp = tid % {KP}")
        src.line(f"a_r = tid // {KP}")
        a_items = [("a_kp", add_terms("a_r", j * (THREADS // KP))) for j in range(BM * KP // THREADS)]
    else:
        src.line(f"a_r = tid % {BM}")
        src.line(f"a_kp = tid // {BM}")
        a_items = [(add_terms("a_kp", j * (THREADS // BM)), "a_r") for j in range(BM * KP // THREADS)]
    src.line(f"b_n = tid % {BN}")
    src.line(f"b_kp = tid // {BN}")
    b_items = [(add_terms("b_kp", j * (THREADS // BN)), "b_n") for j in range(BN * KP // THREADS)]
    k_guard = per_split * splits != p.K

    def load(k0):
        for j, (kp, r) in enumerate(a_items):
            gr = f"(m0 + {r})"
            for half in (0, 1):
                gk = f"({k0} + 2 * ({kp}) + {half})"
                guards = ([f"{gr} < {p.M}"] if p.M % BM else []) + ([f"{gk} < {p.K}"] if k_guard else [])
                value = f"{pa}[{add_terms(off['a'], stride_term(gr, p.a.rows), stride_term(gk, p.a.cols))}]"
                if guards:
                    value = f"{value} if {' and '.join(guards)} else {F(0)}"
                src.line(f"ga{j}_{half} = {value}")
        for j, (kp, n) in enumerate(b_items):
            src.line(f"gb{j} = {pb}[(({k0}) // 2 + {kp}) * {n_pad} + n0 + {n}]")

    def store(buffer):
        for j, (kp, r) in enumerate(a_items):
            src.line(f"sh_a[{buffer}, {kp}, {r}] = pack_{fmt}x2(ga{j}_0, ga{j}_1)")
        for j, (kp, n) in enumerate(b_items):
            src.line(f"sh_b[{buffer}, {kp}, {n}] = gb{j}")

    src.line(" = ".join(name for i in range(MF) for j in range(NF) for name in accumulators(i, j)) + f" = {F(0)}")
    k_base = "k_base" if splits > 1 else "0"
    gemm.double_buffered(src, str(steps), lambda: load(k_base), lambda: load(add_terms(k_base, f"(step + 1) * {BK}")),
                         lambda: mma_step(src, tile, fmt), store)

    for acc, row, col in output_elements(tile):
        src.line(f"m = m0 + {row}")
        src.line(f"n = n0 + {col}")
        guards = ([f"m < {p.M}"] if p.M % BM else []) + ([f"n < {p.N}"] if p.N % BN else [])
        if guards:
            src.line(f"if {' and '.join(guards)}:").indent()
        store_output(src, p, off, acc, "m", "n")
        if guards:
            src.dedent()
    types = ["float32", "uint32"] + ["float32"] * (pointer_count(p) - 2)
    work = p.n_batch * tiles_m * tiles_n * splits * THREADS
    return gpu_kernel(family, src.text(), types, THREADS), work


def gemv_kernel(family: str, p: Product, fmt: str):
    """gemm.gemv_kernel with lanes over k, B read as packed k pairs (pack_b_gemv), widened in registers."""
    assert p.M <= GEMV_ROWS
    words = ceil_div(p.K, 2)
    col_blocks = ceil_div(p.N, WARPS)
    pa, pb = p.ptr[0], p.ptr[1]
    src = Source()
    kernel_header(src, pointer_count(p))
    src.line(f"cb = bid % {col_blocks}")
    off = batch_offsets(src.line(f"bt = bid // {col_blocks}"), "bt", p) if p.n_batch > 1 else dict.fromkeys("abcro", "0")
    src.line("s = tid % 32")
    src.line(f"n = cb * {WARPS} + tid // 32")
    src.line(f"red = cuda.shared.array(({p.M}, {THREADS}), float32)")
    src.line(" = ".join(f"acc{m}" for m in range(p.M)) + f" = {F(0)}")
    src.line(f"if n < {p.N}:").indent()
    src.line(f"bcol = n * {words}")

    def fma(w_exprs, odd_tail: bool):
        for u, w in enumerate(w_exprs):
            src.line(f"b{u} = {pb}[{add_terms('bcol', w)}]")
        for u, w in enumerate(w_exprs):
            src.line(f"lo{u} = {fmt}_lo(b{u})")
            src.line(f"hi{u} = {fmt}_hi(b{u})")
            for m in range(p.M):
                row = add_terms(off["a"], m * p.a.rows)
                lo = f"{pa}[{add_terms(row, stride_term(f'2 * {w}', p.a.cols))}]"
                hi = f"{pa}[{add_terms(row, stride_term(f'(2 * {w} + 1)', p.a.cols))}]"
                if odd_tail:     # the last word's odd k is padding: A has no element there
                    hi = f"({hi} if 2 * {w} + 1 < {p.K} else {F(0)})"
                src.line(f"acc{m} += {lo} * lo{u} + {hi} * hi{u}")

    full = p.K // 2                    # words with both k inside A
    chunk = 32 * GEMV_UNROLL
    if full // chunk:
        src.line(f"for wc in range({full // chunk}):").indent()
        src.line(f"w = wc * {chunk} + s")
        fma([f"(w + {u * 32})" if u else "w" for u in range(GEMV_UNROLL)], odd_tail=False)
        src.dedent()
    if words > full // chunk * chunk:
        src.line(f"for w in range({full // chunk * chunk} + s, {words}, 32):").indent()
        fma(["w"], odd_tail=p.K % 2 == 1)
        src.dedent()
    src.dedent()
    gemm.reduce_and_store(src, p, off, slices=32, stride=1)
    types = ["float32", "uint32"] + ["float32"] * (pointer_count(p) - 2)
    return gpu_kernel(family, src.text(), types, THREADS), p.n_batch * col_blocks * THREADS


def product_calls(family: str, p: Product, args: list, graph, node, fmt: str) -> list:
    """The calls of a marked product; args[1] is B as a K x N float array (alpha folded in),
    packed here for the kernel the shape takes."""
    data = np.asarray(args[1], dtype=np.float32).reshape(p.K, p.N)
    if p.M <= GEMV_ROWS:
        kernel, work = gemv_kernel(f"{family}_gemv16", p, fmt)
        return [KernelCall(kernel, [args[0], pack_b_gemv(data, fmt), *args[2:]], work, node.name,
                           precision=label(fmt, "16-bit B, float32 FMA"))]
    tile, splits = choose_tc_tile(p.M, p.N, p.K, p.n_batch)
    per_split, splits = gemm.split_k(p.K, splits, tile.BK)
    args = [args[0], pack_b_tile(data, tile, per_split * splits, fmt), *args[2:]]
    how = label(fmt, "mma.sync m16n8k16")
    if splits == 1:
        kernel, work = tile_kernel(f"{family}_mma", p, tile, fmt)
        return [KernelCall(kernel, args, work, node.name, precision=how)]
    partial = scratch_value(graph, node, (splits * p.n_batch * p.M * p.N,), np.float32, tag="splitk")
    products = replace(p, c=None, r=None, alpha=1.0, beta=1.0, epilogue=Epilogue(), ptr=(*p.ptr[:2], None, None, "p2"))
    kernel, work = tile_kernel(f"{family}_mma", products, tile, fmt, splits)
    less = lambda ptr: None if ptr is None else f"p{int(ptr[1:]) - 1}"
    sums, sum_work = gemm.split_sum_kernel(f"{family}_splitk", replace(p, ptr=(None, None, *map(less, p.ptr[2:]))), splits)
    return [KernelCall(kernel, args[:2] + [partial], work, node.name, precision=how),
            KernelCall(sums, [partial] + args[2:], sum_work, node.name, precision=how)]



def lower_gemm(node, graph):
    """gemm.lower_gemm, a marked product (constant B) taken here."""
    return gemm.lower_gemm(node, graph, reduced=(format_of, product_calls))


def lower_matmul(node, graph):
    """gemm.lower_matmul, a marked product (constant B) taken here."""
    return gemm.lower_matmul(node, graph, reduced=(format_of, product_calls))


# gemm.py's generators with the marked products taken here (registry.py lets these override gemm's)
GENERATORS: dict = {"Gemm": lower_gemm, "FusedGemm": lower_gemm, "MatMul": lower_matmul, "FusedMatMul": lower_matmul}
