"""Gemm and MatMul: one matrix-multiply kernel generator for both (and for 1x1 convs).

    out[b, m, n] = alpha * sum_k A[b, m, k] * B[b, k, n]  (+ beta * C[b, m, n])

Every operand is read through element strides (batch dims, rows, cols), so
transposes, 1-D operands, batch broadcasting and group offsets are only
strides; nothing is copied at run time. Two loop shapes:

- axpy (the default): a block of RB output rows is accumulated in place,
  KB values of k at a time: `out[m, n] += a[m, k0]*B[k0, n] + ... + a[m, k0+KB-1]*B[k0+KB-1, n]`
  with the inner loop unit-stride over n, so LLVM vectorises it and each
  output element is loaded and stored once per KB products. A constant B is
  packed at build time as row-major [K, N] with alpha folded in.
- dot: when B is contiguous along k but not along n (B^T stored, or N == 1)
  and A is contiguous along k, each output is a dot product over k, four
  columns at a time, reduced in vector registers.

The work range runs over (batch, n-block, row-block) items: with M == 1
(GEMV) the N dimension is split in blocks so threads have something to share.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuvil.errors import UnsupportedOpError
from cuvil.ir import Value

from .ukernel import LOADC_EPILOGUE

from .epilogue import Epilogue, epilogue_of, register_epilogue
from .kernel import (Kernel, KernelCall, Lowered, Source, broadcast_strides, dims_strides, kernel_header, l1d_ways,
                     literal, one_weight_layout, session_threads, work_items)
from .scratch import scratch_value

ROW_BLOCK = 4      # output rows accumulated together (share each B load)
K_BLOCK = 4        # k values fused in one pass over an output row (RB * KB scalars of A live in registers)
K_BLOCK_GEMV = 8   # with a single row, fuse more k per pass: fewer loads/stores of the output
N_BLOCK_GEMV = 256  # with a single row, the work range splits N in blocks of this size
N_TILE = 1024      # wider rows are split in tiles that keep the output block and B panel in cache
DOT_COLS = 4       # output columns reduced together in the dot form


@dataclass(frozen=True)
class Operand:
    """How a kernel reads a matrix: element strides along the batch dims, rows and cols."""
    batch: tuple
    rows: int
    cols: int


def _term(var, stride):
    if stride == 0 or var == "0":
        return None
    return var if stride == 1 else f"{var}*{stride}"


def _sum(*terms) -> str:
    """`a + b + ...` skipping None/zero terms; '0' when empty."""
    kept = [str(t) for t in terms if t is not None and t != 0 and t != "0"]
    return " + ".join(kept) if kept else "0"


def ceil_div(a, b):
    return -(-a // b)


def _decode_batch(src: Source, var: str, batch_shape, operands: dict[str, tuple]) -> dict[str, str]:
    """Emit `<name>_off` = the batch offset of each operand for flat batch index `var`."""
    offs = {name: [] for name in operands}
    rest = var
    dims = list(batch_shape)
    for d in range(len(dims) - 1, -1, -1):
        size = dims[d]
        if size == 1:
            continue
        index = f"bi{d}"
        outer = all(dims[e] == 1 for e in range(d))
        if outer:
            src.line(f"{index} = {rest}")
        else:
            src.line(f"{index} = {rest} % {size}")
            src.line(f"bq{d} = {rest} // {size}")
            rest = f"bq{d}"
        for name, strides in operands.items():
            offs[name].append(_term(index, strides[d]))
    names = {}
    for name in operands:
        expr = _sum(*offs[name])
        src.line(f"{name}_off = {expr}")
        names[name] = f"{name}_off"
    return names


def gemm_kernel(family: str, dtype, M: int, N: int, K: int, batch_shape, a: Operand, b: Operand,
                c: Operand | None, out: Operand, alpha: float = 1.0, beta: float = 1.0,
                residual: Operand | None = None, epilogue: Epilogue | None = None) -> tuple[Kernel, int]:
    """A kernel `kernel(A, B, [C,] [R,] out, begin, end)` computing
    out = act(alpha*A@B (+ beta*C) (+ R)), batched.

    `out.cols` must be 1 (each output row is contiguous). Returns the kernel and its work size."""
    assert out.cols == 1
    dtype = np.dtype(dtype)
    epilogue = epilogue or Epilogue()
    batch_shape = tuple(int(d) for d in batch_shape)
    n_batch = int(np.prod(batch_shape, dtype=np.int64)) if batch_shape else 1
    dot = a.cols == 1 and b.rows == 1 and (b.cols != 1 or N == 1) and K > 1
    n_ptrs = 3 + (c is not None) + (residual is not None)
    src = Source().line(kernel_header(n_ptrs)).indent()
    pa, pb = "p0", "p1"
    pc = "p2" if c is not None else None
    pr = f"p{2 + (c is not None)}" if residual is not None else None
    po = f"p{n_ptrs - 1}"
    if dot:
        rb, n_block = 1, (min(N, N_BLOCK_GEMV) if M == 1 else N)
    else:
        rb = ROW_BLOCK if M >= ROW_BLOCK else M
        if M == 1:
            n_block = min(N, N_BLOCK_GEMV)
        else:
            tiles = ceil_div(N, N_TILE)
            n_block = N if tiles == 1 else ceil_div(ceil_div(N, tiles), 16) * 16
    row_blocks = ceil_div(M, rb)
    n_blocks = ceil_div(N, n_block)
    work = n_batch * n_blocks * row_blocks

    # Decode the item: ((batch * n_blocks) + nb) * row_blocks + blk.
    src.line("for item in range(begin, end):").indent()
    rest = "item"
    if row_blocks > 1:
        src.line(f"blk = item % {row_blocks}")
        if n_blocks * n_batch > 1:
            src.line(f"rest = item // {row_blocks}")
        rest = "rest"
    else:
        src.line("blk = 0")
    if n_blocks > 1:
        src.line(f"nb = {rest} % {n_blocks}" if n_batch > 1 else f"nb = {rest}")
        if n_batch > 1:
            src.line(f"rest = {rest} // {n_blocks}")
            rest = "rest"
        src.line(f"n_lo = nb * {n_block}")
        src.line(f"n_hi = min(n_lo + {n_block}, {N})")
    else:
        src.line("n_lo = 0")
        src.line(f"n_hi = {N}")
    if n_batch > 1:
        operands = {"a": a.batch, "b": b.batch, "o": out.batch}
        if c is not None:
            operands["c"] = c.batch
        if residual is not None:
            operands["r"] = residual.batch
        off = _decode_batch(src, rest, batch_shape, operands)
    else:
        off = {"a": "0", "b": "0", "o": "0", "c": "0", "r": "0"}

    F = lambda v: literal(v, dtype)
    scale_a = "" if alpha == 1.0 else f" * {F(alpha)}"
    scale_c = "" if beta == 1.0 else f" * {F(beta)}"

    def c_value(row_var, col_var):
        terms = []
        if c is not None:
            terms.append(f"{pc}[{_sum(off['c'], _term(row_var, c.rows), _term(col_var, c.cols))}]{scale_c}")
        if residual is not None:
            terms.append(f"{pr}[{_sum(off['r'], _term(row_var, residual.rows), _term(col_var, residual.cols))}]")
        return " + ".join(terms) if terms else None

    act = (lambda x: epilogue.expr(x, dtype)) if epilogue.active else None
    if dot:
        _dot_body(src, pa, pb, po, K, a, b, c_value, out, off, F, alpha, act)
    else:
        full = M // rb
        if full == row_blocks:
            _axpy_body(src, rb, K, pa, pb, po, a, b, out, off, scale_a, c_value, M, act)
        else:
            src.line(f"if blk < {full}:").indent()
            _axpy_body(src, rb, K, pa, pb, po, a, b, out, off, scale_a, c_value, M, act)
            src.dedent().line("else:").indent()
            _axpy_body(src, M % rb, K, pa, pb, po, a, b, out, off, scale_a, c_value, M, act)
            src.dedent()
    types = [dtype.name] * n_ptrs
    return Kernel(family, src.text(), tuple(types), self_sized=True), work


# -- micro-kernel GEMM (backends/numba_cpu/ukernel.py) -------------------------------------------------

UK_MR = 6        # rows of a micro-tile (the default tile; see choose_tile)
UK_NR = 64       # columns of a micro-tile (4 zmm vectors on AVX-512)
# Tiles (rows x columns) with 24 accumulators on AVX-512, and their relative speed measured on
# this machine with hot caches (rows: B rows read in place or packed; taps: convolutions).
UK_TILES = {"rows": {(6, 64): 1.0, (8, 48): 0.99, (12, 32): 1.03},
            "taps": {(6, 64): 1.0, (8, 48): 1.06, (12, 32): 1.04}}


def choose_tile(M: int, N: int, mode: str = "rows") -> tuple[int, int]:
    """The micro-tile that wastes least on edge tiles (partial rows and columns) for an M x N output,
    weighted by the tile's speed. Fewer than 12 rows: 6 x 64 (its edge kernels keep the most
    accumulators per row)."""
    if M < 12 or (mode == "rows" and one_weight_layout()):
        # (the second: entries of several row counts read one packed copy of each weight)
        return UK_MR, UK_NR

    def score(tile):
        mr, nr = tile
        return UK_TILES[mode][tile] * M / (ceil_div(M, mr) * mr) * N / (ceil_div(N, nr) * nr)
    return max(sorted(UK_TILES[mode]), key=score)


UK_KC_FEW_ROWS = 64  # k values per pass when 2-3 row tiles (M <= UK_FEW_ROWS) read the same B panel
UK_FEW_ROWS = 16
UK_KC = 256      # k values per pass (the B micro-panel kc x NR stays in L1/L2, the C tile is reloaded per pass)
UK_NR_STEP = 16  # column granularity of edge micro-kernels (one AVX-512 vector)
UK_A_BLOCK_BYTES = 256 << 10  # rows of A per block: rows x kc floats stay in L2
L2_RESIDENT_BYTES = 1 << 20  # an operand this small stays in L2 between the work items reading it
UK_MIN_SPLIT_FLOPS = 1 << 21  # smaller GEMMs are one work item: splitting them costs more than it saves
GEMV_SPLIT_BYTES = 256 << 10  # a matrix-vector product with this much B splits over threads anyway (bound by
                              # B's bytes, not FLOPs: each thread streams its columns from its own L2)
MODEL_L2_BYTES = 2 << 20      # a model whose constants all fit in (one core's) L2 reads its GEMV weights from L2
# Packed float32 weights over L2_RESIDENT_BYTES, or of a model over MODEL_L2_BYTES (its 384 x 384
# projections, 0.6 MB each, come from past L2 too: DistilBERT b1 2.5 % faster, the zoo encoder 6 %;
# fifth session): each row tile prefetches B this many k rows ahead
# (64 x NR floats: 12 KiB for NR = 48, ~150-200 ns of the tile's FMAs, a DRAM access) instead of the
# micro-kernel's 8. The first row tile over each micro-panel brings it in from the L3 or memory; 8 rows
# ahead (~20 ns) left it waiting on DRAM. A chain of 16 distinct [128, 768] @ [768, 768] products
# (38 MB of weights, past the L3), 1 thread: 6 % faster (T = 16 rows: 1.8x); one product (weights in the
# L3): no change. 32 and 128 rows were slower than 64 (docs/performance.md, 2026-12-07 fourth session).
STREAM_PREFETCH_B_ROWS = 64
# bf16 Winograd GEMMs whose A (one position's U, M x K bf16) is larger than this prefetch it far ahead
# (ukernel_lowp.LowpStreamedSpec's prefetch_a): ResNet-18's 14 x 14 and 7 x 7 stages (128 / 512 KB a position,
# 2 / 8.4 MB a conv, past L2 and, in a whole bf16 ResNet-18's 38.8 MB of weights, past L3: 1 thread,
# their WinoGemm steps 0.29 -> 0.26 and 0.37 -> 0.30 ms); the 56 / 28 stages' U (8 / 32 KB a position,
# re-read by each band) ran as fast with it as without (docs/performance.md, fifth session).
STREAM_A_BYTES = 64 << 10
STREAM_PREFETCH_A_PAIRS = 256   # k pairs ahead (~12 KB); 128 and 512 measured within the noise of it


def split_work(want: int, n_cols: int, m_tiles: int, a_bytes: int, b_bytes: int) -> tuple[int, int, int, int]:
    """Work items of a GEMM as (column blocks, column tiles per block, row blocks, row tiles per
    block), about `want` items. Every column block reads all of A and every row block all of B, so
    columns are split first, unless a split with (nearly) as many items moves a quarter fewer bytes:
    a conv with large weights and few output columns (stage 4 of a ResNet) splits its rows, so its
    weights stream from memory once, not once per column block.

    Then the split is balanced: blocks are whole tiles, so 43 row tiles in 8 blocks of 6 leave one
    block of 1, and two threads taking the items in turn finish 24 and 19 tiles (10 % lost). Among
    splits of want..4*want items moving at most a quarter more bytes
    from memory, the one whose items two (then four) threads share best, as the driver hands them
    out, is chosen.
    Blocks only group whole tiles, so results do not depend on the split."""
    def split(n_try, m_try=None):
        per_n = ceil_div(n_cols, n_try)
        n_blocks = ceil_div(n_cols, per_n)
        m_blocks = min(m_tiles, ceil_div(want, n_blocks) if m_try is None else m_try)
        per_m = ceil_div(m_tiles, m_blocks)
        return n_blocks, per_n, ceil_div(m_tiles, per_m), per_m

    def traffic(c):
        return c[0] * a_bytes + c[2] * b_bytes

    columns_first = split(min(n_cols, want))
    target = min(want, columns_first[0] * columns_first[2])
    enough = [split(n_try) for n_try in range(min(n_cols, want), 0, -1)]
    best = min((c for c in enough if 4 * c[0] * c[2] >= 3 * target), key=traffic)
    base = best if 4 * traffic(best) < 3 * traffic(columns_first) else columns_first
    if base[0] * base[2] < 2:
        return base
    # Re-reading an operand that stays in L2 costs little: it counts an eighth.
    def memory(c):
        return sum(blocks * (nbytes if nbytes > L2_RESIDENT_BYTES else nbytes // 8)
                   for blocks, nbytes in ((c[0], a_bytes), (c[2], b_bytes)))
    limit = 5 * memory(base) // 4
    cands = {split(n_try, m_try) for n_try in range(1, min(n_cols, 4 * want) + 1)
             for m_try in range(1, min(m_tiles, 4 * want) + 1)}
    cands = [c for c in cands if base[0] * base[2] <= c[0] * c[2] <= 4 * want and memory(c) <= limit]

    def key(c):
        return (round(_imbalance(c, n_cols, m_tiles, 2), 2), round(_imbalance(c, n_cols, m_tiles, 4), 2),
                c[0] * c[2], traffic(c), c)
    return min(cands + [base], key=key)


def _imbalance(c, n_cols: int, m_tiles: int, threads: int) -> float:
    """Time of the slowest of `threads` threads running split c's items as the driver hands them
    out (each thread its contiguous share in order, then what is left of the others'), over a
    perfect share; an item's time is its number of tiles."""
    n_blocks, per_n, m_blocks, per_m = c
    sizes = [min(per_n, n_cols - nb * per_n) * min(per_m, m_tiles - mb * per_m)
             for nb in range(n_blocks) for mb in range(m_blocks)]
    return slowest_share(sizes, threads)


# A split whose slowest thread takes this much more than an even share is even enough (conv1d,
# attention).
IMBALANCE_OK = 1.02


def slowest_share(sizes: list[int], threads: int) -> float:
    """The slowest thread's time over an even share when `threads` threads run items of these
    sizes as the driver's pool hands them out: each its contiguous range in order, then one by
    one what is left of the others' ranges."""
    work = len(sizes)
    nxt = [work * r // threads for r in range(threads)]
    end = [work * (r + 1) // threads for r in range(threads)]
    free = [0] * threads
    while any(nxt[r] < end[r] for r in range(threads)):
        t = free.index(min(free))
        r = next(r % threads for r in range(t, t + threads) if nxt[r % threads] < end[r % threads])
        free[t] += sizes[nxt[r]]
        nxt[r] += 1
    return max(free) * threads / sum(sizes)


def uk_eligible(dtype, M, N, K, a: Operand, b: Operand | None) -> bool:
    """Whether the micro-kernel path applies: float32, A contiguous along k or m, B rows contiguous
    (or packed at build time), and N wide enough to fill vectors."""
    if np.dtype(dtype) != np.float32 or N < 16 or K < 2 or M * N * K < 4096:
        return False
    if not (a.cols == 1 or a.rows == 1):
        return False
    return b is None or b.cols == 1


def pack_b_panels(data: np.ndarray, nr: int = UK_NR) -> np.ndarray:
    """[K, N] -> [ceil(N/nr), K, nr] panels, zero padded, in data's dtype: the layout micro-kernels
    read B in (float32, or float16 bits for the fp16 ones)."""
    K, N = data.shape
    n_panels = ceil_div(N, nr)
    padded = np.zeros((K, n_panels * nr), dtype=data.dtype)
    padded[:, :N] = data
    return np.ascontiguousarray(padded.reshape(K, n_panels, nr).transpose(1, 0, 2))


def uk_k_pass(K: int) -> int:
    """k values per pass of the micro-kernel GEMM (passes of balanced sizes, at most UK_KC)."""
    kc = min(K, UK_KC)
    return ceil_div(K, ceil_div(K, kc))


def bf16_k_pass(K: int) -> int:
    """k values per pass of a bf16 GEMM reading A in pair panels (K even): uk_k_pass's, in whole
    pairs. What packs such panels (winograd_bf16.py) splits k in the same passes."""
    return max(2, uk_k_pass(K) // 2 * 2)


class TileLoops:
    """The loops of a GEMM on micro-tiles inside a fused kernel's source (DepthwiseBlock's 1x1
    convs, Attention's two products): column tiles of NR (the last one masked), passes over k,
    tiles of MR rows and a partial tile of `rem` rows at the end. `specs`: {(mr, b_masked):
    (name, UKSpec)}, the micro-kernels the loops call; `call(mr, m, masked)` writes one call."""

    def __init__(self, tag: str, MR: int, NR: int, K: int, specs: dict):
        self.tag, self.MR, self.NR, self.K, self.specs = tag, MR, NR, K, specs
        self.kc = uk_k_pass(K)

    def declare(self, src: Source) -> None:
        for name, spec in self.specs.values():
            for line in spec.declaration(name).splitlines():
                src.line(line)

    def loops(self, src: Source, N, rows, rem: int, flags: str, call) -> None:
        """`rows`: an int, or an expression whose value less `rem` is a multiple of MR; `flags`: the
        micro-kernel's loadc argument (an expression of {tag}k0)."""
        t, MR, NR, K, kc = self.tag, self.MR, self.NR, self.K, self.kc
        full = rows - rem if isinstance(rows, int) else f"{t}full"
        if not isinstance(rows, int):
            src.line(f"{t}full = {rows} - {rows} % {MR}")
        src.line(f"for {t}n0 in range(0, {N}, {NR}):").indent()
        src.line(f"{t}nv = min({NR}, {N} - {t}n0)")
        src.line(f"{t}mask = np.int64(-1) if {t}nv >= {NR} else (np.int64(1) << {t}nv) - np.int64(1)")
        src.line(f"for {t}k0 in range(0, {K}, {kc}):").indent()
        src.line(f"{t}kc = min({kc}, {K} - {t}k0)")
        src.line(f"{t}flags = {flags}")
        for masked, test in ((0, f"if {t}nv == {NR}:"), (1, "else:")):
            src.line(test).indent()
            src.line(f"for {t}m in range(0, {full}, {MR}):").indent()
            call(MR, f"{t}m", masked)
            src.dedent()
            if rem and isinstance(rows, int):
                call(rem, full, masked)
            elif rem:
                src.line(f"if {t}full < {rows}:").indent()
                call(rem, f"{t}full", masked)
                src.dedent()
            src.dedent()
        src.dedent().dedent()


# Rows of A this many bytes apart (or a multiple) map to the same L1 sets: a tile's MR rows, read
# in place, then compete for the ways of one set, with the lines the prefetcher brings and B's,
# and the GEMM slows by 20-30 % where L1 has 8 ways (AMD Zen 4, K = 1024, 1 thread: 128x256x1024
# 69-81 GFLOP/s against 98-115 at K = 1040); Sapphire Rapids' 12 ways showed no such loss.
A_ALIAS_BYTES = 4096
A_ALIAS_MAX_WAYS = 8    # targets with this many L1 ways or fewer pack such an A
A_PACK_MIN_PANELS = 4   # ... and the copy pays only when each row panel is read this many times


def packs_a_at_run_time(M: int, N: int, K: int) -> bool:
    """Whether a GEMM reading a row-major A (row stride K) in place should pack it first: its
    rows alias in L1, and every panel of rows is read once per column panel, enough times that
    the copy pays (100x64x2048, one column panel: 112 -> 72 GFLOP/s packed; 512x512x1024:
    70 -> 97)."""
    MR, NR = choose_tile(M, N)
    return (l1d_ways() <= A_ALIAS_MAX_WAYS and M >= 2 * MR and (4 * K) % A_ALIAS_BYTES == 0
            and ceil_div(N, NR) >= A_PACK_MIN_PANELS)


def pack_a_kernel(M: int, K: int, MR: int) -> tuple[Kernel, int]:
    """The layout of `pack_a_panels`, at run time, for a row-major M x K activation.
    Pointers: A, packed (ceil(M/MR)*MR*K floats). One work item per panel of MR rows."""
    kc = uk_k_pass(K)
    rows_padded = ceil_div(M, MR) * MR
    src = Source().line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"for k0 in range(0, {K}, {kc}):").indent()
    src.line(f"kc = min({kc}, {K} - k0)")
    src.line(f"base = k0 * {rows_padded} + item * {MR} * kc")
    # Whole panels without a branch in the k loop (LLVM vectorises it as an interleaved store).
    src.line(f"if (item + 1) * {MR} <= {M}:").indent()
    for r in range(MR):
        src.line(f"s{r} = (item * {MR} + {r}) * {K} + k0")
    src.line("for k in range(kc):").indent()
    for r in range(MR):
        src.line(f"p1[base + k * {MR} + {r}] = p0[s{r} + k]")
    src.dedent().dedent().line("else:").indent()
    src.line("for k in range(kc):").indent()
    for r in range(MR):
        src.line(f"row = item * {MR} + {r}")
        src.line(f"p1[base + k * {MR} + {r}] = p0[row * {K} + k0 + k] if row < {M} else np.float32(0)")
    return Kernel("APack", src.text(), ("float32", "float32")), ceil_div(M, MR)


# -- reduced precision: the products assign_precision marks (bf16 / fp16 operands, float32 sums) --

LOWP_FORMATS = {"bf16": "bf16", "fp16": "f16"}   # a node's `precision` -> the micro-kernels' format
PRECISION_OF = {fmt: precision for precision, fmt in LOWP_FORMATS.items()}


def lowp_product(node) -> tuple[str, str] | None:
    """(format, method) for a product marked with a reduced `precision`, or None: unmarked, or the
    target has no method for it (fp16 without F16C), so it computes in float32."""
    from .kernel import lowering_target
    from .ukernel_lowp import method_for
    fmt = LOWP_FORMATS.get(node.attr("precision"))
    if fmt is None:
        return None
    target = lowering_target()
    if target is None:
        return (fmt, "widen") if fmt == "bf16" else None
    method = method_for(fmt, target)
    return (fmt, method) if method else None


def lowp_label(lowp: tuple[str, str] | None) -> str:
    """How a call computes, for `cuvil explain`: "bf16 (dpbf16)", "fp16 (f16c)"; "" for float32."""
    if lowp is None:
        return ""
    return f"{PRECISION_OF[lowp[0]]} ({lowp[1]})"


def lowp_k(K: int, fmt: str) -> int:
    """K as the micro-kernels read it: bf16 in whole pairs (a zero column of A, a zero row of B)."""
    return K + K % 2 if fmt == "bf16" else K


def pack_b_lowp(data: np.ndarray, nr: int, fmt: str) -> np.ndarray:
    """[K, N] float weights -> 16-bit panels (uint16 bits, rounded to nearest even): bf16 in the VNNI
    pair layout [ceil(N/nr), K/2, 2 nr], float16 as pack_b_panels' [ceil(N/nr), K, nr]."""
    from .lowp_pack import bf16_bits, f16_bits, pack_b_pairs
    if fmt == "bf16":
        return pack_b_pairs(bf16_bits(data.astype(np.float32)), nr)
    return pack_b_panels(f16_bits(data.astype(np.float32)), nr)


def lowp_a_calls(graph, node, A_name: str, M: int, K: int, fmt: str) -> tuple[list, str, Operand]:
    """The call converting A's M rows of K float32 to the 16-bit format (rounded to nearest even;
    bf16 rows padded with a zero to whole pairs) into a scratch value, its name, and how the GEMM
    reads it. The value is named after A: a later product of the same A (attention's Q, K and V
    projections of one tensor) reads the conversion an earlier one made, and no call is added
    (the arena keeps the value from its first write to its last reader)."""
    from .lowp import CvtSpec
    Kp = lowp_k(K, fmt)
    converted = f"__{fmt}_a__{A_name}"
    if converted in graph.values:
        if tuple(graph.values[converted].shape) == (M, Kp):
            return [], converted, Operand((), Kp, 1)
        converted = f"__{fmt}_a__{node.name}"   # (A read as other rows: a conversion of its own)
    graph.values[converted] = Value(converted, np.dtype(np.uint16), (M, Kp))
    src = Source()
    for line in CvtSpec("f32", fmt).declaration("cvt").splitlines():
        src.line(line)
    src.line(kernel_header(2)).indent()
    src.line("for m in range(begin, end):").indent()
    src.line(f"cvt(p0, m * {K}, p1, m * {Kp}, {K})")
    if Kp != K:
        src.line(f"p1[m * {Kp} + {K}] = np.uint16(0)")
    kernel = Kernel(f"Cvt_{fmt}", src.text(), ("float32", "uint16"))
    label = f"{PRECISION_OF[fmt]} (A converted)"
    return [KernelCall(kernel, [A_name, converted], M, node.name, precision=label)], converted, Operand((), Kp, 1)


def _packed_a_calls(graph, node, A_name: str, M: int, N: int, K: int) -> tuple[list, str, bool]:
    """When `packs_a_at_run_time`: the call packing A into a scratch value, that value's name and
    True (the GEMM reads A as panels); else no call, A's own name and False."""
    if not packs_a_at_run_time(M, N, K):
        return [], A_name, False
    MR = choose_tile(M, N)[0]
    packed = scratch_value(graph, node, (ceil_div(M, MR) * MR * K,), np.float32, tag="apanels")
    kernel, work = pack_a_kernel(M, K, MR)
    return [KernelCall(kernel, [A_name, packed], work, node.name)], packed, True


def pack_a_panels(data: np.ndarray, mr: int = UK_MR) -> np.ndarray:
    """[..., M, K] -> [..., pass over k, ceil(M/mr) panels, k in pass, mr], zero padded: the
    micro-kernel calls of one pass read one contiguous run of A, panel after panel."""
    *lead, M, K = data.shape
    n_panels = ceil_div(M, mr)
    kc = uk_k_pass(K)
    padded = np.zeros((*lead, n_panels * mr, K), dtype=np.float32)
    padded[..., :M, :] = data
    panels = padded.reshape(*lead, n_panels, mr, K)
    parts = [np.swapaxes(panels[..., k0:k0 + kc], -1, -2).reshape(*lead, -1) for k0 in range(0, K, kc)]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


def uk_gemm_kernel(family: str, M: int, N: int, K: int, batch_shape, a: Operand, b: Operand | None,
                   c: Operand | None, out: Operand, beta: float = 1.0, residual: Operand | None = None,
                   epilogue: Epilogue | None = None, threads_hint: int | None = None,
                   a_panels: bool = False, tile: tuple[int, int] | None = None,
                   accumulate: bool = False, b_in_l2: bool = False, self_sized: bool = True,
                   lowp: tuple[str, str] | None = None, b_streams: bool = False) -> tuple[Kernel, int]:
    """out = act(A @ B (+ beta*C) (+ R)) through LLVM-IR micro-kernels; with `accumulate`,
    out = act(out + A @ B (+ beta*C)): the output holds a residual on entry (see kernel.InPlace).

    Pointers: A, B, [C], [R], out. `b` None: B is packed at build time by `pack_b_panels`
    (alpha folded in); else B is read in place, rows contiguous. A(i, k) is
    `a[i*a.rows + k*a.cols]` with a.cols == 1 (rows) or a.rows == 1 (columns); with `a_panels`, A is
    packed at build time by `pack_a_panels` and `a` gives its batch strides and rows = K.
    `b_in_l2`: B comes from L2 (see gemv_weights_in_l2): no software prefetches of it, which only
    compete with the loads there; `b_streams`: packed B comes from past L2 at each call, however small
    (see weights_stream). `self_sized`: the work items are sized for the threads (see
    split_work), so the driver hands each out alone (schedule.Kernel.self_sized).

    `lowp` = (format, method): A and B are 16-bit ("bf16" | "f16", ukernel_lowp.LowpUKSpec), B packed
    at build time by `pack_b_lowp`, A read by rows from a buffer of K_pad columns (lowp_k(K)), C
    and the sums in float32. Or (bf16 only, Winograd's batched GEMMs) A in pair panels
    (`a_panels`: lowp_pack.pack_a_pairs per pass of bf16_k_pass(K) k, passes one after the other)
    and B read in place in the VNNI pair layout: b.rows is the distance of two pair rows and
    b.batch the batch strides, in 16-bit elements; B's last column panel is read in full (NR
    columns, bf16 loads are not masked), so its buffer needs 2 NR elements of slack."""
    from .ukernel import UKSpec
    from .ukernel_lowp import LowpStreamedSpec, LowpUKSpec
    assert lowp is None or (b is None and not a_panels and not batch_shape and a.cols == 1) \
        or (lowp[0] == "bf16" and a_panels and b is not None and b.cols == 1 and K % 2 == 0)
    pairs_in_place = bool(lowp) and b is not None
    Kp = lowp_k(K, lowp[0]) if lowp else K
    assert out.cols == 1
    dtype = np.dtype(np.float32)
    epilogue = epilogue or Epilogue()
    batch_shape = tuple(int(d) for d in batch_shape)
    n_batch = int(np.prod(batch_shape, dtype=np.int64)) if batch_shape else 1
    MR, NR = tile or choose_tile(M, N)
    n_ptrs = 3 + (c is not None) + (residual is not None)
    pc = "p2" if c is not None else None
    pr = f"p{2 + (c is not None)}" if residual is not None else None
    po = f"p{n_ptrs - 1}"

    # A as the micro-kernel reads it.
    if a_panels:
        a_packed, a_panel, lda, a_k = 1, MR, 0, MR
    elif a.cols == 1:
        a_packed, a_panel, lda, a_k = 0, 0, a.rows, 1
    else:
        a_packed, a_panel, lda, a_k = 1, a.cols, 0, a.cols
    ldb = NR if b is None else b.rows
    if lowp and lowp[0] == "bf16" and b is None:
        ldb = 2 * NR   # k pairs: each packed row holds two k of NR columns
    specs = {}
    # B's software prefetch distance (ukernel.UKSpec.prefetch_b): none from L2; far ahead for packed
    # weights too large for L2, or of a model too large for it (`b_streams`: the other products'
    # weights evicted them since the last call), which the first row tile over each micro-panel reads
    # from L3 or DRAM (a GEMV, M = 1, keeps 8: on a chain of 768 x 768 GEMVs the far prefetch won 3 %
    # at 38 MB and lost 7 % at 151 MB). bf16 weights that stream take the same distance in pair rows
    # (ukernel_lowp.LowpStreamedSpec: the same bytes and instructions ahead); the other 16-bit kernels
    # prefetch nothing (DistilBERT bf16 b1, 1 thread: 11 % faster with it, fifth session).
    streams = b is None and M > 1 and (b_streams or 4 * K * N > L2_RESIDENT_BYTES)
    prefetch_b = 0 if b_in_l2 else STREAM_PREFETCH_B_ROWS if streams else 1
    # bf16 Winograd's U (A in panels, each read once a band) streams from L3 or memory where one
    # position's matrix is large: prefetched far ahead (ukernel_lowp.LowpStreamedSpec's prefetch_a)
    stream_a = bool(lowp) and a_panels and 2 * M * K > STREAM_A_BYTES

    # The last column panel is computed by a kernel only as wide as its columns need (whole vectors).
    edge_nr = min(NR, ceil_div(N % NR, UK_NR_STEP) * UK_NR_STEP) if N % NR else NR

    # The epilogue runs in the micro-kernel's registers when it is a per-row bias (a conv's) and a
    # Relu or Clip: the last pass stores final values once, no loop reads the tile back.
    row_bias = c is not None and c.cols == 0 and c.rows == 1 and beta == 1.0
    uk_epilogue = register_epilogue(row_bias, epilogue, residual is not None or (c is not None and not row_bias))
    in_registers = uk_epilogue is not None
    uk_epilogue = uk_epilogue or {}

    def spec(mr, edge_n):
        key = (mr, edge_nr if edge_n else NR, edge_n and b is not None)
        if key not in specs and lowp:
            stream = {"prefetch_b": STREAM_PREFETCH_B_ROWS} if streams and lowp[1] in ("dpbf16", "widen") else {}
            if stream_a:
                stream["prefetch_a"] = STREAM_PREFETCH_A_PAIRS
            specs[key] = (f"uk{len(specs)}", (LowpStreamedSpec if stream else LowpUKSpec)(
                mr=mr, nr=key[1], dtype=lowp[0], method=lowp[1], a_packed=a_packed, a_panel=a_panel,
                **uk_epilogue, **stream))
        elif key not in specs:
            specs[key] = (f"uk{len(specs)}", UKSpec(mr=mr, nr=key[1], a_packed=a_packed, a_panel=a_panel,
                                                    b_masked=int(key[2]), prefetch_b=prefetch_b,
                                                    prefetch_c=int(accumulate), **uk_epilogue))
        return specs[key][0]

    # Work items: (batch, n block, m block); blocks of whole micro-tiles.
    n_panels = ceil_div(N, NR)
    m_tiles = ceil_div(M, MR)
    threads_hint = work_items() if threads_hint is None else threads_hint
    gemv_split = M == 1 and session_threads() > 1 and 4 * K * N >= GEMV_SPLIT_BYTES
    want = max(1, ceil_div(threads_hint, n_batch)) if 2 * M * N * K >= UK_MIN_SPLIT_FLOPS or gemv_split else 1
    n_blocks, ppb, m_blocks, tpb = split_work(want, n_panels, m_tiles, 4 * M * K, 4 * K * N)
    work = n_batch * n_blocks * m_blocks
    # A few row tiles (a 16-token encoder) share each B panel: in short passes the panel's part
    # stays in L1 from one tile to the next (T=16 encoder, 1 thread: 171.6 -> 163.7 us at 64 k).
    kc_max = uk_k_pass(Kp) if a_panels or not MR < M <= UK_FEW_ROWS else min(Kp, UK_KC_FEW_ROWS)
    if lowp and lowp[0] == "bf16":
        kc_max = bf16_k_pass(Kp) if a_panels else max(2, kc_max // 2 * 2)   # whole k pairs a pass

    body = Source().indent()
    body.line("for item in range(begin, end):").indent()
    body.line(f"mb = item % {m_blocks}")
    body.line(f"rest = item // {m_blocks}")
    body.line(f"nb = rest % {n_blocks}")
    body.line(f"rest = rest // {n_blocks}")
    if n_batch > 1:
        operands = {"a": a.batch, "o": out.batch}
        if b is not None:
            operands["b"] = b.batch
        if c is not None:
            operands["c"] = c.batch
        if residual is not None:
            operands["r"] = residual.batch
        off = _decode_batch(body, "rest", batch_shape, operands)
        off.setdefault("b", "0")
    else:
        off = {"a": "0", "b": "0", "o": "0", "c": "0", "r": "0"}
    body.line(f"m_lo = mb * {tpb * MR}").line(f"m_hi = min(m_lo + {tpb * MR}, {M})")
    body.line(f"p_lo = nb * {ppb}").line(f"p_hi = min(p_lo + {ppb}, {n_panels})")
    body.line(f"for k0 in range(0, {Kp}, {kc_max}):").indent()
    body.line(f"kc = min({kc_max}, {Kp} - k0)")
    # bf16 micro-kernels count k pairs
    k_arg = "kc >> 1" if lowp and lowp[0] == "bf16" else "kc"
    body.line("lc = 1" if accumulate else "lc = min(k0, 1)")
    body.line(f"last = 1 if k0 + {kc_max} >= {Kp} else 0")
    # Rows in blocks whose A (rows x kc) stays in L2 while the item's panels go by.
    mc = max(MR, UK_A_BLOCK_BYTES // (kc_max * 4) // MR * MR)
    body.line(f"for mb0 in range(m_lo, m_hi, {mc}):").indent()
    body.line(f"mb1 = min(mb0 + {mc}, m_hi)")
    body.line("for pn in range(p_lo, p_hi):").indent()
    body.line(f"n0 = pn * {NR}")
    body.line(f"nv = min({NR}, {N} - n0)")
    body.line(f"mask = np.int64(-1) if nv >= {NR} else (np.int64(1) << nv) - np.int64(1)")
    if b is None:
        body.line(f"boff = pn * {Kp * NR} + k0 * {NR}")
    elif pairs_in_place:   # pass k0 starts at pair row k0 / 2, column n0 at 2 n0
        body.line(f"boff = {_sum(off['b'], _term('(k0 >> 1)', b.rows))} + 2 * n0")
    else:
        body.line(f"boff = {_sum(off['b'], _term('k0', b.rows))} + n0")

    F = lambda v: literal(v, dtype)
    scale_c = "" if beta == 1.0 else f" * {F(beta)}"
    has_epi = (c is not None or residual is not None or epilogue.active) and not in_registers

    def call(mr, edge_n):
        name = spec(mr, edge_n)
        if a_panels:   # pass k0 starts at k0 * (rows of panels); panel m // MR of it at m * kc
            a_off = _sum(off["a"], _term("k0", ceil_div(M, MR) * MR), "m*kc")
        else:
            a_off = _sum(off["a"], _term("m", a.rows), _term("k0", a_k))
        loadc, bias = "lc", f"{po}, 0" if lowp else "p0, 0"   # no bias: any float32 pointer
        if in_registers:
            loadc = f"lc + {LOADC_EPILOGUE} * last"
            if c is not None:
                bias = f"{pc}, {_sum(off['c'], 'm')}"
        body.line(f"{name}(p0, {a_off}, {lda}, p1, boff, {ldb}, {po}, {_sum(off['o'], _term('m', out.rows))} + n0, "
                  f"{out.rows}, {k_arg}, mask, {loadc}, {bias})")
        if has_epi:
            body.line("if last:").indent()
            body.line(f"for r in range(m, m + {mr}):").indent()
            body.line(f"ob = {_sum(off['o'], _term('r', out.rows))}")
            if c is not None:
                body.line(f"cb = {_sum(off['c'], _term('r', c.rows))}")
            if residual is not None:
                body.line(f"rb = {_sum(off['r'], _term('r', residual.rows))}")
            body.line("for j in range(n0, n0 + nv):").indent()
            terms = [f"{po}[ob + j]"]
            if c is not None:
                terms.append(f"{pc}[{_sum('cb', _term('j', c.cols))}]{scale_c}")
            if residual is not None:
                terms.append(f"{pr}[{_sum('rb', _term('j', residual.cols))}]")
            body.line(f"v = {' + '.join(terms)}")
            body.line(f"{po}[ob + j] = {epilogue.expr('v', dtype) if epilogue.active else 'v'}")
            body.dedent().dedent().dedent()

    def m_loop(edge_n):
        body.line("m = mb0")
        body.line(f"while m + {MR} <= mb1:").indent()
        call(MR, edge_n)
        body.line(f"m += {MR}")
        body.dedent()
        if M % MR:
            body.line("if m < mb1:").indent()
            call(M % MR, edge_n)
            body.dedent()

    if N % NR and (b is not None or edge_nr < NR):
        body.line(f"if nv == {NR}:").indent()
        m_loop(False)
        body.dedent().line("else:").indent()
        m_loop(True)
        body.dedent()
    else:
        m_loop(False)

    head = Source()
    for name, uk in sorted(specs.values()):
        for line in uk.declaration(name).splitlines():
            head.line(line)
    head.line(kernel_header(n_ptrs))
    text = head.text() + body.text()
    types = ["uint16", "uint16"] * bool(lowp) + [dtype.name] * (n_ptrs - 2 * bool(lowp))
    return Kernel(family, text, tuple(types), self_sized=self_sized), work


def _axpy_body(src, rows, K, pa, pb, po, a, b, out, off, scale_a, c_value, M, act=None):
    """Rows m0..m0+rows-1 of the output (m0 = blk*ROW_BLOCK), columns [n_lo, n_hi); the activation
    (if any) is applied to the block while it is in L1."""
    kb = K_BLOCK_GEMV if M == 1 else K_BLOCK
    kb = min(kb, K)
    src.line(f"m0 = blk * {ROW_BLOCK}" if M > rows or M >= ROW_BLOCK else "m0 = 0")
    for r in range(rows):
        src.line(f"o{r} = {_sum(off['o'], _term(f'(m0 + {r})' if r else 'm0', out.rows))}")
    # Initialise with C (or zero).
    src.line("for n in range(n_lo, n_hi):").indent()
    for r in range(rows):
        value = c_value(f"(m0 + {r})" if r else "m0", "n") or "0"
        src.line(f"{po}[o{r} + n] = {value}")
    src.dedent()

    def block(k0_expr, nk):
        for r in range(rows):
            row = f"(m0 + {r})" if r else "m0"
            for j in range(nk):
                k = f"({k0_expr} + {j})" if j else k0_expr
                src.line(f"a{r}_{j} = {pa}[{_sum(off['a'], _term(row, a.rows), _term(k, a.cols))}]{scale_a}")
        src.line(f"bb = {_sum(off['b'], _term(k0_expr, b.rows))}")
        src.line("for n in range(n_lo, n_hi):").indent()
        for j in range(nk):
            src.line(f"b{j} = {pb}[{_sum('bb', j * b.rows, _term('n', b.cols))}]")
        for r in range(rows):
            terms = " + ".join(f"a{r}_{j} * b{j}" for j in range(nk))
            src.line(f"{po}[o{r} + n] += {terms}")
        src.dedent()

    full = K // kb
    if full == 1:
        block("0", kb)
    elif full > 1:
        src.line(f"for kb in range({full}):").indent()
        src.line(f"k0 = kb * {kb}")
        block("k0", kb)
        src.dedent()
    if K % kb:
        block(str(full * kb), K % kb)
    if act is not None:
        src.line("for n in range(n_lo, n_hi):").indent()
        for r in range(rows):
            src.line(f"v{r} = {po}[o{r} + n]")
            src.line(f"{po}[o{r} + n] = {act(f'v{r}')}")
        src.dedent()


def _dot_body(src, pa, pb, po, K, a, b, c_value, out, off, F, alpha, act=None):
    """One output row (m = blk) x columns [n_lo, n_hi): dot products over k, DOT_COLS columns at a time."""
    src.line(f"arow = {_sum(off['a'], _term('blk', a.rows))}")
    src.line(f"orow = {_sum(off['o'], _term('blk', out.rows))}")
    scale = "" if alpha == 1.0 else f" * {F(alpha)}"

    def finish(col, acc):
        value = f"{acc}{scale}"
        extra = c_value('blk', col)
        if extra:
            value = f"{value} + {extra}"
        if act is not None:
            src.line(f"v = {value}")
            value = act("v")
        src.line(f"{po}[orow + {col}] = {value}")

    src.line("n = n_lo")
    src.line(f"while n + {DOT_COLS} <= n_hi:").indent()
    for j in range(DOT_COLS):
        src.line(f"bcol{j} = {_sum(off['b'], _term(f'(n + {j})' if j else 'n', b.cols))}")
        src.line(f"acc{j} = {F(0)}")
    src.line(f"for k in range({K}):").indent()
    src.line(f"av = {pa}[arow + k]")
    for j in range(DOT_COLS):
        src.line(f"acc{j} += av * {pb}[bcol{j} + k]")
    src.dedent()
    for j in range(DOT_COLS):
        finish(f"(n + {j})" if j else "n", f"acc{j}")
    src.line(f"n += {DOT_COLS}")
    src.dedent()
    src.line("while n < n_hi:").indent()
    src.line(f"bcol = {_sum(off['b'], _term('n', b.cols))}")
    src.line(f"acc = {F(0)}")
    src.line(f"for k in range({K}):").indent()
    src.line(f"acc += {pa}[arow + k] * {pb}[bcol + k]")
    src.dedent()
    finish("n", "acc")
    src.line("n += 1")
    src.dedent()


def _unsupported(node, why):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}")


def _float_dtype(node, value):
    dtype = np.dtype(value.dtype)
    if dtype.kind != "f":
        raise _unsupported(node, f"{dtype.name} inputs are not supported (float only)")
    return dtype


def _residual_arg(graph, name, dtype):
    """A residual operand: its value name, or (constant) its data as a packed array."""
    R = graph.values[name]
    if R.is_const:
        return np.ascontiguousarray(np.asarray(R.data).astype(dtype)), R
    return R.name, R


def gemv_weights_in_l2(graph, M: int) -> bool:
    """Whether a matrix-vector product (M == 1) of this model finds its constant B in L2: all the
    model's constants fit in one core's L2, so they stay there between calls (an MLP's 1.1 MB).
    Its micro-kernel then issues no B prefetches (MLP 256-512-256-64-1: 7.1 -> 6.6 us a call)."""
    return M == 1 and not weights_stream(graph)


def weights_stream(graph) -> bool:
    """Whether the model's constants are too large to stay in one core's L2 between calls: each
    product's packed weights then come from the L3 or memory however small they are themselves,
    and are prefetched STREAM_PREFETCH_B_ROWS ahead (uk_gemm_kernel's `b_streams`)."""
    return sum(v.nbytes for v in graph.values.values() if v.is_const) > MODEL_L2_BYTES


def lower_gemm(node, graph) -> Lowered:
    """Y = act(alpha * A' @ B' + beta * C (+ R)), A' = A^T if transA, B' = B^T if transB; C and R broadcast to (M, N).

    Also FusedGemm (domain "cuvil"): see epilogue.py."""
    epilogue, inputs = epilogue_of(node)
    A = graph.values[inputs[0]]
    B = graph.values[inputs[1]]
    C = graph.values[inputs[2]] if len(inputs) > 2 and inputs[2] else None
    Y = graph.values[node.outputs[0]]
    dtype = _float_dtype(node, Y)
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    trans_a, trans_b = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    M, N = Y.shape
    K = A.shape[0] if trans_a else A.shape[1]
    a = Operand((), 1, M) if trans_a else Operand((), K, 1)
    args: list = [A.name]
    use_uk, lowp = False, None
    if B.is_const:
        packed = np.asarray(B.data.T if trans_b else B.data, dtype=np.float64) * alpha
        use_uk = uk_eligible(dtype, M, N, K, a, None)
        lowp = lowp_product(node) if use_uk and not trans_a else None
        if lowp:
            args.append(pack_b_lowp(packed, choose_tile(M, N)[1], lowp[0]))
        else:
            args.append(pack_b_panels(packed.astype(dtype), choose_tile(M, N)[1]) if use_uk
                        else np.ascontiguousarray(packed.astype(dtype)))
        b, alpha_left = Operand((), N, 1), 1.0
    else:
        args.append(B.name)
        b, alpha_left = (Operand((), 1, K) if trans_b else Operand((), N, 1)), alpha
    c_op = None
    if C is not None and beta != 0.0 and C.size:
        if C.is_const:
            # Pre-scaled by beta; the kernel reads it through broadcast strides, so it keeps its own shape.
            c_data = np.asarray(C.data, dtype=np.float64) * beta
            args.append(np.ascontiguousarray(c_data.astype(dtype)))
            strides = broadcast_strides(c_data.shape, (M, N))
            c_op, beta_left = Operand((), strides[0], strides[1]), 1.0
        else:
            args.append(C.name)
            strides = broadcast_strides(C.shape, (M, N))
            c_op, beta_left = Operand((), strides[0], strides[1]), beta
    else:
        beta_left = 1.0
    r_op = None
    if epilogue.residual is not None:
        arg, R = _residual_arg(graph, epilogue.residual, dtype)
        args.append(arg)
        strides = broadcast_strides(R.shape, (M, N))
        r_op = Operand((), strides[0], strides[1])
    args.append(Y.name)
    family = node.op.replace("Fused", "")
    if not use_uk and alpha_left == 1.0 and uk_eligible(dtype, M, N, K, a, b):
        use_uk, b_in = True, b
    else:
        b_in = None
    pack = []
    if use_uk:
        a_panels = False
        if lowp:
            pack, args[0], a = lowp_a_calls(graph, node, A.name, M, K, lowp[0])
        elif b_in is None and not trans_a:
            pack, args[0], a_panels = _packed_a_calls(graph, node, A.name, M, N, K)
        kernel, work = uk_gemm_kernel(family, M, N, K, (), a, b_in, c_op, Operand((), N, 1), beta_left,
                                      residual=r_op, epilogue=epilogue, a_panels=a_panels,
                                      b_in_l2=b_in is None and gemv_weights_in_l2(graph, M), lowp=lowp,
                                      b_streams=b_in is None and weights_stream(graph))
    else:
        kernel, work = gemm_kernel(family, dtype, M, N, K, (), a, b, c_op, Operand((), N, 1),
                                   alpha_left, beta_left, residual=r_op, epilogue=epilogue)
    return Lowered(pack + [KernelCall(kernel, args, work, node.name, precision=lowp_label(lowp))])


def _linear(strides, dims) -> bool:
    """Whether dims with these strides can be read as one flat dim (stride strides[-1])."""
    return all(strides[i] == strides[i + 1] * dims[i + 1] for i in range(len(dims) - 1))


def lower_matmul(node, graph) -> Lowered:
    """numpy matmul: 1-D operands are promoted (and the added dim dropped), leading dims broadcast.

    Also FusedMatMul (domain "cuvil"): y = act(A @ B + R), see epilogue.py."""
    epilogue, inputs = epilogue_of(node)
    A = graph.values[inputs[0]]
    B = graph.values[inputs[1]]
    Y = graph.values[node.outputs[0]]
    dtype = _float_dtype(node, Y)
    a_shape = (1,) + tuple(A.shape) if len(A.shape) == 1 else tuple(A.shape)
    b_shape = tuple(B.shape) + (1,) if len(B.shape) == 1 else tuple(B.shape)
    M, K = a_shape[-2:]
    N = b_shape[-1]
    batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    args = [A.name, B.name]
    r_strides = None
    if epilogue.residual is not None:
        arg, R = _residual_arg(graph, epilogue.residual, dtype)
        args.append(arg)
        # Strides of R over the canonical output (batch..., M, N): dims numpy matmul drops get stride 0.
        s = list(broadcast_strides(R.shape, Y.shape))
        if len(B.shape) == 1:
            s.append(0)
        if len(A.shape) == 1:
            s.insert(len(s) - 1, 0)
        r_strides = s
    fold = batch and all(d == 1 for d in b_shape[:-2]) and tuple(a_shape[:-2]) == batch
    if fold and r_strides is not None:
        fold = _linear(r_strides[:-1], list(batch) + [M]) or all(v == 0 for v in r_strides[:-1])
    r_op = None
    if fold:
        # B is shared by every batch and A is contiguous: one GEMM with the batch dims folded into M.
        M, batch = M * int(np.prod(batch)), ()
        if r_strides is not None:
            r_op = Operand((), r_strides[-2], r_strides[-1])
    elif r_strides is not None:
        r_op = Operand(tuple(r_strides[:-2]), r_strides[-2], r_strides[-1])
    a_batch = tuple(broadcast_strides(a_shape[:-2], batch)) if batch else ()
    b_batch = tuple(broadcast_strides(b_shape[:-2], batch)) if batch else ()
    a_batch = tuple(s * M * K for s in a_batch)
    b_batch = tuple(s * K * N for s in b_batch)
    o_batch = tuple(s * M * N for s in dims_strides(batch)) if batch else ()
    a_op, b_op, o_op = Operand(a_batch, K, 1), Operand(b_batch, N, 1), Operand(o_batch, N, 1)
    pack = []
    if B.is_const and not any(b_batch) and len(B.shape) >= 2 and uk_eligible(dtype, M, N, K, a_op, None):
        # Constant weights: packed into micro-kernel panels at build time.
        lowp = lowp_product(node) if not batch else None
        weights = np.asarray(B.data, dtype=np.float32).reshape(K, N)
        args[1] = pack_b_lowp(weights, choose_tile(M, N)[1], lowp[0]) if lowp \
            else pack_b_panels(weights, choose_tile(M, N)[1])
        a_panels = False
        if lowp:
            pack, args[0], a_op = lowp_a_calls(graph, node, A.name, M, K, lowp[0])
        elif not batch:
            pack, args[0], a_panels = _packed_a_calls(graph, node, A.name, M, N, K)
        kernel, work = uk_gemm_kernel("MatMul", M, N, K, batch, a_op, None, None, o_op,
                                      residual=r_op, epilogue=epilogue, a_panels=a_panels,
                                      b_in_l2=gemv_weights_in_l2(graph, M), lowp=lowp,
                                      b_streams=weights_stream(graph))
    elif uk_eligible(dtype, M, N, K, a_op, b_op):
        lowp = None
        kernel, work = uk_gemm_kernel("MatMul", M, N, K, batch, a_op, b_op, None, o_op,
                                      residual=r_op, epilogue=epilogue)
    else:
        lowp = None
        kernel, work = gemm_kernel("MatMul", dtype, M, N, K, batch, a_op, b_op, None, o_op,
                                   residual=r_op, epilogue=epilogue)
    return Lowered(pack + [KernelCall(kernel, args + [Y.name], work, node.name, precision=lowp_label(lowp))])
