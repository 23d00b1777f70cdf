"""GPU Gemm and MatMul (and their fused forms): one product generator for both.

    out[b, m, n] = act(alpha * sum_k A[b, m, k] * B[b, k, n] + beta * C[b, m, n] + R[b, m, n])

As on the CPU (numba_cpu/gemm.py), every operand is read through element strides (batch dims,
rows, cols): transposes, 1-D operands and batch broadcasting are only strides. A constant B is
packed at build time with alpha folded in, a constant C with beta folded in. The epilogue (C,
the residual R, the activation) is applied to the accumulators as they are stored.

Two kernels, chosen by shape:

- tile: a shared-memory tiled SGEMM. A block of 256 threads computes a BM x BN tile of the
  output, each thread a TM x TN register block whose rows and columns are strided by the
  thread grid (so its shared-memory reads are conflict-free and each of its stores is
  coalesced across the warp). A and B are staged through shared memory BK values of k at a
  time, double-buffered: the next tile's global loads are issued before the current tile's
  FMAs and stored after them, one barrier per step. Each operand is loaded with consecutive
  threads on its contiguous dim (coalesced); a k-major tile's rows are padded so its stores to
  shared memory hit distinct banks. The tile size is the one that keeps most SMs busy
  (TILES, `choose_tile`); where even small tiles are too few (a few hundred rows, a long K:
  BERT's 128 x 768 x 3072 makes 24 tiles of 64 x 64), k is split over blocks, each writing
  its partial product to a scratch value, and a second kernel adds the splits in order (no
  atomics: the same bits every run) and applies the epilogue. A constant B is packed as K x N
  row-major.
- gemv: for few output rows (M <= GEMV_ROWS: batch-1 inference) a tile would leave most of
  its threads idle and the GPU most of its SMs. One warp per output column (all M rows):
  its lanes stride over k, read B's column contiguously (a constant B is packed N x K),
  and the 32 partial sums are reduced in shared memory by a fixed tree (deterministic).
  When B is contiguous along n instead (a run-time B), the block's 32 lanes are 32 columns
  and its 8 warps 8 interleaved slices of k, reduced across warps. A product with few
  columns (N <= GEMV_ROWS) is computed as its transpose, out^T = B^T A^T, by the same kernel.

The batch index is the outer part of the block index; the grid is 1-D (kernel.py's contract).

On an H200 (float32; cuBLAS through torch.matmul, TF32 off): 4096^3 in 5.3 ms (cuBLAS 2.7 ms),
128 x 768 x 3072 (split 6) 50 us (24 us), 1 x 4096 x 4096 23 us (23 us), 4 x 4096 x 4096 42 us
(65 us), 12 x 128 x 128 x 64 batched 7 us (17 us).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from backends.numba_cpu.epilogue import Epilogue, epilogue_of
from backends.numba_cpu.gemm import Operand, ceil_div
from backends.numba_cpu.kernel import Source, broadcast_strides, dims_strides, literal
from backends.numba_cpu.scratch import scratch_value
from cuvil.errors import UnsupportedOpError

from .kernel import KernelCall, Lowered, gpu_kernel

SMS = 132           # streaming multiprocessors of an H100/H200 (an A100 has 108): the blocks a wave runs
THREADS = 256       # threads per block of both kernels: 8 warps
WARPS = THREADS // 32
GEMV_ROWS = 8       # at most this many output rows (or columns): the gemv kernel
GEMV_UNROLL = 4     # loads of B a gemv thread issues before using them (memory-level parallelism)


@dataclass(frozen=True)
class Tile:
    """A tile kernel's shape: a BM x BN output tile per block, BK values of k per step, a TM x TN
    register block per thread. `speed`: its relative FLOP rate per SM (the larger register
    blocks reuse each shared-memory load more). `unroll`: the loop over the BK values of a step is
    written out (constant shared-memory offsets: 1.6x faster on the 64 x 64 tile of an H200, but
    168 registers instead of 128 on the 128 x 128 tile, one block per SM, 13 % slower)."""
    BM: int
    BN: int
    BK: int
    TM: int
    TN: int
    speed: float
    unroll: bool

    @property
    def threads(self) -> int:
        return (self.BM // self.TM) * (self.BN // self.TN)


TILES = (Tile(128, 128, 8, 8, 8, 1.0, False), Tile(64, 64, 16, 4, 4, 0.75, True), Tile(32, 64, 16, 2, 4, 0.5, True))
K_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)   # splits of k the tile kernel may take (fewest first: ties keep fewer)
MIN_SPLIT_K = 256                       # k values a split keeps at least (its tile's loads to amortise)
SPLIT_COST = 0.95                       # the second pass's share of the time, as a factor on the score


def choose_tile(M: int, N: int, K: int, n_batch: int) -> tuple[Tile, int]:
    """The tile and the number of k splits with the best speed x SM utilisation x the share of
    the tiles inside the output: a large GEMM takes 128 x 128 tiles, and one whose tiles are too
    few to fill the GPU (a few hundred rows, a long K) smaller tiles and splits of k. A split costs
    a little (its partial sums are written, read and added by a second kernel), so it is taken
    only where it fills more SMs."""
    def score(choice):
        tile, splits = choice
        blocks = n_batch * ceil_div(M, tile.BM) * ceil_div(N, tile.BN) * splits
        inside = M / (ceil_div(M, tile.BM) * tile.BM) * N / (ceil_div(N, tile.BN) * tile.BN)
        return tile.speed * inside * min(1.0, blocks / SMS) * (SPLIT_COST if splits > 1 else 1.0)
    choices = [(tile, splits) for tile in TILES for splits in K_SPLITS
               if splits == 1 or (K // splits >= MIN_SPLIT_K and split_k(K, splits, tile.BK)[1] == splits)]
    return max(choices, key=score)


def split_k(K: int, splits: int, BK: int) -> tuple[int, int]:
    """(k values per split, a multiple of BK; the splits that takes)."""
    per_split = ceil_div(ceil_div(K, splits), BK) * BK
    return per_split, ceil_div(K, per_split)


@dataclass(frozen=True)
class Product:
    """One (batched) product as a kernel sees it: sizes, and each operand's strides and pointer.
    `c` and `r` (bias and residual) are optional; `out` may be strided (a transposed product)."""
    M: int
    N: int
    K: int
    batch: tuple
    a: Operand
    b: Operand
    out: Operand
    c: Operand | None = None
    r: Operand | None = None
    alpha: float = 1.0
    beta: float = 1.0
    epilogue: Epilogue = Epilogue()
    ptr: tuple = ("p0", "p1", None, None, "p2")   # pointers of a, b, c, r, out

    @property
    def n_batch(self) -> int:
        return int(np.prod(self.batch, dtype=np.int64)) if self.batch else 1

    def transposed(self) -> Product:
        """out^T = B^T @ A^T: the same product with rows and columns exchanged."""
        def t(op):
            return None if op is None else Operand(op.batch, op.cols, op.rows)
        pa, pb, pc, pr, po = self.ptr
        return replace(self, M=self.N, N=self.M, a=t(self.b), b=t(self.a), out=t(self.out), c=t(self.c),
                       r=t(self.r), ptr=(pb, pa, pc, pr, po))


F = lambda v: literal(v, np.float32)


def stride_term(var: str, stride: int) -> str | None:
    if stride == 0:
        return None
    return var if stride == 1 else f"{var} * {stride}"


def add_terms(*terms) -> str:
    kept = [str(t) for t in terms if t is not None and str(t) != "0"]
    return " + ".join(kept) if kept else "0"


def batch_offsets(src: Source, var: str, p: Product) -> dict:
    """Emit `<x>_off`, each operand's offset for flat batch index `var`; {operand: expression}."""
    operands = {name: op for name, op, ptr in zip("abcro", (p.a, p.b, p.c, p.r, p.out), p.ptr)
                if op is not None and ptr is not None}
    terms = {name: [] for name in operands}
    rest = var
    for d in range(len(p.batch) - 1, -1, -1):
        size = p.batch[d]
        if size == 1:
            continue
        if all(p.batch[e] == 1 for e in range(d)):
            index = rest
        else:
            index = f"bi{d}"
            src.line(f"{index} = {rest} % {size}")
            src.line(f"bq{d} = {rest} // {size}")
            rest = f"bq{d}"
        for name, op in operands.items():
            terms[name].append(stride_term(index, op.batch[d]))
    offsets = {}
    for name in operands:
        expr = add_terms(*terms[name])
        if expr != "0":
            src.line(f"{name}_off = {expr}")
            expr = f"{name}_off"
        offsets[name] = expr
    return offsets


def store_output(src: Source, p: Product, off: dict, acc: str, m: str, n: str) -> None:
    """Write the output element (m, n) from accumulator `acc`, the epilogue applied."""
    pa, pb, pc, pr, po = p.ptr
    terms = [acc if p.alpha == 1.0 else f"{acc} * {F(p.alpha)}"]
    if p.c is not None:
        value = f"{pc}[{add_terms(off['c'], stride_term(m, p.c.rows), stride_term(n, p.c.cols))}]"
        terms.append(value if p.beta == 1.0 else f"{value} * {F(p.beta)}")
    if p.r is not None:
        terms.append(f"{pr}[{add_terms(off['r'], stride_term(m, p.r.rows), stride_term(n, p.r.cols))}]")
    src.line(f"v = {' + '.join(terms)}")
    src.line(f"{po}[{add_terms(off['o'], stride_term(m, p.out.rows), stride_term(n, p.out.cols))}] = {p.epilogue.expr('v', np.float32)}")


def kernel_header(src: Source, n_ptrs: int) -> None:
    src.line(f"def kernel({', '.join(f'p{i}' for i in range(n_ptrs))}, n):").indent()
    src.line("tid = cuda.threadIdx.x")
    src.line("bid = cuda.blockIdx.x")


def pointer_count(p: Product) -> int:
    return 3 + (p.c is not None) + (p.r is not None)


def block_tile(src: Source, p: Product, tiles_m: int, tiles_n: int, splits: int, per_split: int) -> dict:
    """Lines that decode a tiled kernel's block index into its output tile (tm, tn; m0, n0), its
    split of k (ks, k_base: splits > 1) and its batch; returns the operands' batch offsets (the
    output's moved to its split's partial product)."""
    src.line(f"tn = bid % {tiles_n}")
    src.line(f"rest = bid // {tiles_n}")
    src.line(f"tm = rest % {tiles_m}")
    if splits > 1:
        src.line(f"rest = rest // {tiles_m}")
        src.line(f"ks = rest % {splits}")
        src.line(f"k_base = ks * {per_split}")
        off = batch_offsets(src.line(f"bt = rest // {splits}"), "bt", p) if p.n_batch > 1 else dict.fromkeys("abcro", "0")
        off["o"] = add_terms(off["o"], f"ks * {p.n_batch * p.M * p.N}")
    else:
        off = batch_offsets(src.line(f"bt = rest // {tiles_m}"), "bt", p) if p.n_batch > 1 else dict.fromkeys("abcro", "0")
    return off


def double_buffered(src: Source, steps: str, load_first, load_next, compute, store) -> None:
    """The k loop of every tiled kernel (GEMM and implicit-GEMM conv, float32 and tensor-core):
    the first k step's tiles are loaded and stored into shared buffer 0; then per step, the next
    step's global loads are issued before the current buffer is computed on and stored into the
    other buffer after it, one barrier a step. `load_first`, `load_next` and `compute` write their
    lines; `store(buffer)` stores the loaded registers into shared buffer `buffer`."""
    load_first()
    store("0")
    src.line("cuda.syncthreads()")
    src.line(f"for step in range({steps}):").indent()
    src.line("cur = step % 2")
    src.line(f"more = step + 1 < {steps}")
    src.line("if more:").indent()
    load_next()
    src.dedent()
    compute()
    src.line("if more:").indent()
    store("1 - cur")
    src.dedent()
    src.line("cuda.syncthreads()")
    src.dedent()


def tile_kernel(family: str, p: Product, tile: Tile, splits: int = 1):
    """The tiled SGEMM kernel of product p and its work (blocks x threads). With `splits` > 1 each
    block sums one split of k, and the output is the stack of the splits' partial products (the
    epilogue is left to `split_sum_kernel`)."""
    BM, BN, BK, TM, TN = tile.BM, tile.BN, tile.BK, tile.TM, tile.TN
    T = tile.threads
    assert T == THREADS and T % BM == 0 and T % BN == 0 and T % BK == 0
    tyn, txn = BM // TM, BN // TN         # threads along m and n; thread (ty, tx) owns rows ty + i*tyn
    row = lambda i: add_terms("ty", i * tyn)
    col = lambda j: add_terms("tx", j * txn)
    per_split, splits = split_k(p.K, splits, BK)
    tiles_m, tiles_n, steps = ceil_div(p.M, BM), ceil_div(p.N, BN), per_split // BK
    src = Source()
    kernel_header(src, pointer_count(p))
    off = block_tile(src, p, tiles_m, tiles_n, splits, per_split)
    src.line(f"m0 = tm * {BM}")
    src.line(f"n0 = tn * {BN}")
    src.line(f"ty = tid // {txn}")
    src.line(f"tx = tid % {txn}")

    # Loading: operand x's tile (rows x BK values of k, stored k-major in shared memory as
    # sh_x[buffer, k, row]); consecutive threads take consecutive elements along x's contiguous dim.
    loads = []

    def loader(name, ptr, base, rows, size, k_stride, row_stride):
        per_thread = rows * BK // T
        k_major = k_stride == 1 and row_stride != 1   # contiguous along k: threads walk k first
        pad = 32 // BK if k_major else 0              # rows of the tile a warp stores: distinct banks
        if k_major:
            src.line(f"{name}_k = tid % {BK}")
            src.line(f"{name}_r = tid // {BK}")
            items = [(f"{name}_k", add_terms(f"{name}_r", j * (T // BK))) for j in range(per_thread)]
        else:
            src.line(f"{name}_r = tid % {rows}")
            src.line(f"{name}_k = tid // {rows}")
            items = [(add_terms(f"{name}_k", j * (T // rows)), f"{name}_r") for j in range(per_thread)]
        src.line(f"sh_{name} = cuda.shared.array((2, {BK}, {rows + pad}), float32)")
        loads.append((name, ptr, base, rows, size, k_stride, row_stride, items))

    loader("a", p.ptr[0], "m0", BM, p.M, p.a.cols, p.a.rows)
    loader("b", p.ptr[1], "n0", BN, p.N, p.b.rows, p.b.cols)

    def load(k0):
        for name, ptr, base, rows, size, k_stride, row_stride, items in loads:
            for j, (k, r) in enumerate(items):
                gk, gr = f"({k0} + {k})", f"({base} + {r})"
                guards = ([f"{gr} < {size}"] if size % rows else []) + ([f"{gk} < {p.K}"] if per_split * splits != p.K else [])
                value = f"{ptr}[{add_terms(off[name], stride_term(gr, row_stride), stride_term(gk, k_stride))}]"
                if guards:
                    value = f"{value} if {' and '.join(guards)} else {F(0)}"
                src.line(f"g{name}{j} = {value}")

    def store(buffer):
        for name, *_, items in loads:
            for j, (k, r) in enumerate(items):
                src.line(f"sh_{name}[{buffer}, {k}, {r}] = g{name}{j}")

    for i in range(TM):
        src.line(" = ".join(f"c{i}_{j}" for j in range(TN)) + f" = {F(0)}")
    def compute():
        if not tile.unroll:
            src.line(f"for kk in range({BK}):").indent()
        for kk in (range(BK) if tile.unroll else ["kk"]):
            for i in range(TM):
                src.line(f"ra{i} = sh_a[cur, {kk}, {row(i)}]")
            for j in range(TN):
                src.line(f"rb{j} = sh_b[cur, {kk}, {col(j)}]")
            for i in range(TM):
                for j in range(TN):
                    src.line(f"c{i}_{j} += ra{i} * rb{j}")
        if not tile.unroll:
            src.dedent()

    k_base = "k_base" if splits > 1 else "0"
    double_buffered(src, str(steps), lambda: load(k_base), lambda: load(add_terms(k_base, f"(step + 1) * {BK}")),
                    compute, store)

    for i in range(TM):
        src.line(f"m = m0 + {row(i)}")
        if p.M % BM:
            src.line(f"if m < {p.M}:").indent()
        for j in range(TN):
            src.line(f"n = n0 + {col(j)}")
            if p.N % BN:
                src.line(f"if n < {p.N}:").indent()
            store_output(src, p, off, f"c{i}_{j}", "m", "n")
            if p.N % BN:
                src.dedent()
        if p.M % BM:
            src.dedent()
    work = p.n_batch * tiles_m * tiles_n * splits * T
    return gpu_kernel(family, src.text(), ["float32"] * pointer_count(p), T), work


def split_sum_kernel(family: str, p: Product, splits: int):
    """The second pass of a split-k product: each thread adds one output element's partial sums
    in split order (the same bits every run) and applies the epilogue. Pointers: the partial
    sums, then p's C, R and output."""
    size = p.n_batch * p.M * p.N
    src = Source()
    src.line(f"def kernel({', '.join(f'p{i}' for i in range(pointer_count(p) - 1))}, n):").indent()
    src.line("i = cuda.grid(1)")
    src.line("if i < n:").indent()
    partials = [f"p0[{add_terms('i', s * size)}]" for s in range(splits)]
    src.line(f"acc = {' + '.join(partials)}")
    src.line(f"col = i % {p.N}")
    src.line(f"row = i // {p.N} % {p.M}")
    off = batch_offsets(src.line(f"bt = i // {p.M * p.N}"), "bt", p) if p.n_batch > 1 else dict.fromkeys("abcro", "0")
    store_output(src, p, off, "acc", "row", "col")
    return gpu_kernel(family, src.text(), ["float32"] * (pointer_count(p) - 1), THREADS), size


def gemv_kernel(family: str, p: Product):
    """The gemv kernel of product p (M <= GEMV_ROWS) and its work (blocks x threads)."""
    assert p.M <= GEMV_ROWS
    lanes_over_k = p.b.rows == 1 or p.b.cols != 1   # B contiguous along k (or along neither)
    cols = WARPS if lanes_over_k else 32           # output columns per block
    slices = 32 if lanes_over_k else WARPS         # threads sharing one column's k range
    col_blocks = ceil_div(p.N, cols)
    pa, pb = p.ptr[0], p.ptr[1]
    src = Source()
    kernel_header(src, pointer_count(p))
    src.line(f"cb = bid % {col_blocks}")
    off = batch_offsets(src.line(f"bt = bid // {col_blocks}"), "bt", p) if p.n_batch > 1 else dict.fromkeys("abcro", "0")
    if lanes_over_k:
        src.line("s = tid % 32")
        src.line(f"n = cb * {cols} + tid // 32")
    else:
        src.line("s = tid // 32")
        src.line(f"n = cb * {cols} + tid % 32")
    src.line(f"red = cuda.shared.array(({p.M}, {THREADS}), float32)")
    src.line(" = ".join(f"acc{m}" for m in range(p.M)) + f" = {F(0)}")
    src.line(f"if n < {p.N}:").indent()
    src.line(f"bcol = {add_terms(off['b'], stride_term('n', p.b.cols))}")

    def fma(k_exprs):
        for u, k in enumerate(k_exprs):
            src.line(f"b{u} = {pb}[{add_terms('bcol', stride_term(k, p.b.rows))}]")
        for u, k in enumerate(k_exprs):
            for m in range(p.M):
                a = f"{pa}[{add_terms(off['a'], m * p.a.rows, stride_term(k, p.a.cols))}]"
                src.line(f"acc{m} += {a} * b{u}")

    chunk = slices * GEMV_UNROLL
    if p.K // chunk:
        src.line(f"for kc in range({p.K // chunk}):").indent()
        src.line(f"k = kc * {chunk} + s")
        fma([f"(k + {u * slices})" if u else "k" for u in range(GEMV_UNROLL)])
        src.dedent()
    if p.K % chunk:
        src.line(f"for k in range({p.K // chunk * chunk} + s, {p.K}, {slices}):").indent()
        fma(["k"])
        src.dedent()
    src.dedent()
    reduce_and_store(src, p, off, slices, 1 if lanes_over_k else 32)
    work = p.n_batch * col_blocks * THREADS
    return gpu_kernel(family, src.text(), ["float32"] * pointer_count(p), THREADS), work


def reduce_and_store(src: Source, p: Product, off: dict, slices: int, stride: int) -> None:
    """A gemv's end: the `slices` partial sums acc<m> of each column (threads `stride` apart in tid)
    added by a fixed tree in shared memory `red`, and slice m stores row m of the column."""
    for m in range(p.M):
        src.line(f"red[{m}, tid] = acc{m}")
    src.line("cuda.syncthreads()")
    # A fixed tree over the slices: slice s adds slice s + half, halving until slice 0 holds the sum.
    half = slices // 2
    while half:
        src.line(f"if s < {half}:").indent()
        for m in range(p.M):
            src.line(f"red[{m}, tid] += red[{m}, tid + {half * stride}]")
        src.dedent()
        src.line("cuda.syncthreads()")
        half //= 2
    src.line(f"if s < {p.M} and n < {p.N}:").indent()
    src.line(f"v0 = red[s, tid - s * {stride}]")
    store_output(src, p, off, "v0", "s", "n")


def uses_gemv(M: int, N: int) -> bool:
    """Whether an M x N product takes the gemv kernel (as it is, or transposed)."""
    return M <= GEMV_ROWS or N <= GEMV_ROWS


def product_calls(family: str, p: Product, args: list, graph, node) -> list:
    """The kernel calls of product p (args: its pointers' values) by its shape: gemv for few rows
    or columns, else tiles, the k splits (if any) summed by a second kernel through a scratch
    value."""
    if uses_gemv(p.M, p.N):
        kernel, work = gemv_kernel(f"{family}_gemv", p if p.M <= GEMV_ROWS else p.transposed())
        return [KernelCall(kernel, args, work, node.name)]
    tile, splits = choose_tile(p.M, p.N, p.K, p.n_batch)
    if splits == 1:
        kernel, work = tile_kernel(f"{family}_tile", p, tile)
        return [KernelCall(kernel, args, work, node.name)]
    partial = scratch_value(graph, node, (splits * p.n_batch * p.M * p.N,), np.float32, tag="splitk")
    products = replace(p, c=None, r=None, alpha=1.0, beta=1.0, epilogue=Epilogue(), ptr=(*p.ptr[:2], None, None, "p2"))
    kernel, work = tile_kernel(f"{family}_tile", products, tile, splits)
    # The second kernel's pointers: the partial sums, then C, R and the output, each one less.
    less = lambda ptr: None if ptr is None else f"p{int(ptr[1:]) - 1}"
    sums, sum_work = split_sum_kernel(f"{family}_splitk", replace(p, ptr=(None, None, *map(less, p.ptr[2:]))), splits)
    return [KernelCall(kernel, args[:2] + [partial], work, node.name),
            KernelCall(sums, [partial] + args[2:], sum_work, node.name)]


def _pack_b(data: np.ndarray, gemv: bool) -> tuple[np.ndarray, Operand]:
    """A constant K x N B as the kernel reads it: N x K for the gemv kernel (each warp's column
    contiguous), K x N for tiles (each tile row contiguous)."""
    K, N = data.shape
    if gemv:
        return np.ascontiguousarray(data.T, dtype=np.float32), Operand((), 1, K)
    return np.ascontiguousarray(data, dtype=np.float32), Operand((), N, 1)


def _float32(node, value) -> None:
    if np.dtype(value.dtype) != np.float32:
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): {np.dtype(value.dtype).name} products have no "
                                 f"GPU kernel yet (float32 only)")


def _residual(graph, name: str):
    R = graph.values[name]
    return (np.ascontiguousarray(R.data, dtype=np.float32) if R.is_const else R.name), R


def lower_gemm(node, graph, reduced=None) -> Lowered:
    """Y = act(alpha * A' @ B' + beta * C (+ R)), A' = A^T if transA, B' = B^T if transB; C and R broadcast
    to (M, N). Also FusedGemm (domain "cuvil", see numba_cpu/epilogue.py). `reduced`: gemm_tc.py's
    (format_of, product_calls), which take the products assign_precision marked."""
    epilogue, inputs = epilogue_of(node)
    A, B = graph.values[inputs[0]], graph.values[inputs[1]]
    C = graph.values[inputs[2]] if len(inputs) > 2 and inputs[2] else None
    Y = graph.values[node.outputs[0]]
    _float32(node, Y)
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    trans_a, trans_b = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    M, N = Y.shape
    K = A.shape[0] if trans_a else A.shape[1]
    a = Operand((), 1, M) if trans_a else Operand((), K, 1)
    args: list = [A.name]
    fmt = _marked_format(node, B, reduced)
    if B.is_const:
        data = np.asarray(B.data.T if trans_b else B.data, dtype=np.float64) * alpha
        if fmt:       # packed by gemm_tc for the kernel it chooses
            args.append(data.astype(np.float32))
            b = Operand((), N, 1)
        else:
            packed, b = _pack_b(data, uses_gemv(M, N))
            args.append(packed)
        alpha = 1.0
    else:
        args.append(B.name)
        b = Operand((), 1, K) if trans_b else Operand((), N, 1)
    c = r = None
    if C is not None and beta != 0.0 and C.size:
        if C.is_const:
            args.append(np.ascontiguousarray(np.asarray(C.data, dtype=np.float64) * beta, dtype=np.float32))
            beta = 1.0
        else:
            args.append(C.name)
        c = Operand((), *broadcast_strides(C.shape, (M, N)))
    if epilogue.residual is not None:
        arg, R = _residual(graph, epilogue.residual)
        args.append(arg)
        r = Operand((), *broadcast_strides(R.shape, (M, N)))
    args.append(Y.name)
    ptrs = [f"p{i}" for i in range(len(args))]
    p = Product(M, N, K, (), a, b, Operand((), N, 1), c, r, alpha, beta, epilogue,
                (ptrs[0], ptrs[1], ptrs[2] if c else None, ptrs[-2] if r else None, ptrs[-1]))
    return Lowered(_calls(node.op.replace("Fused", ""), p, args, graph, node, fmt, reduced))


def _marked_format(node, B, reduced) -> str | None:
    """The 16-bit format of a product assign_precision marked (constant B) that `reduced` takes, else None."""
    return reduced[0](node) if reduced is not None and B.is_const else None


def _calls(family: str, p: Product, args: list, graph, node, fmt: str | None, reduced) -> list:
    if fmt is None:
        return product_calls(family, p, args, graph, node)
    return reduced[1](family, p, args, graph, node, fmt)


def _linear(strides, dims) -> bool:
    """Whether dims with these strides can be read as one flat dim (stride strides[-1])."""
    return all(strides[i] == strides[i + 1] * dims[i + 1] for i in range(len(dims) - 1))


def lower_matmul(node, graph, reduced=None) -> Lowered:
    """numpy matmul: 1-D operands are promoted (and the added dim dropped), leading dims broadcast.
    Also FusedMatMul (domain "cuvil"): Y = act(A @ B + R). `reduced`: as lower_gemm's."""
    epilogue, inputs = epilogue_of(node)
    A, B = graph.values[inputs[0]], graph.values[inputs[1]]
    Y = graph.values[node.outputs[0]]
    _float32(node, Y)
    a_shape = (1,) + tuple(A.shape) if len(A.shape) == 1 else tuple(A.shape)
    b_shape = tuple(B.shape) + (1,) if len(B.shape) == 1 else tuple(B.shape)
    M, K = a_shape[-2:]
    N = b_shape[-1]
    batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    args: list = [A.name, B.name]
    r_strides = None
    if epilogue.residual is not None:
        arg, R = _residual(graph, epilogue.residual)
        args.append(arg)
        # R's strides over the canonical output (batch..., M, N): dims numpy matmul drops get stride 0.
        r_strides = list(broadcast_strides(R.shape, Y.shape))
        if len(B.shape) == 1:
            r_strides.append(0)
        if len(A.shape) == 1:
            r_strides.insert(len(r_strides) - 1, 0)
    # B shared by every batch and A contiguous: one product with the batch dims folded into M.
    fold = batch and all(d == 1 for d in b_shape[:-2]) and tuple(a_shape[:-2]) == batch
    if fold and r_strides is not None:
        fold = _linear(r_strides[:-1], list(batch) + [M]) or all(v == 0 for v in r_strides[:-1])
    if fold:
        M, batch = M * int(np.prod(batch)), ()
    r = None
    if r_strides is not None:
        r = Operand(tuple(r_strides[:-2]) if batch else (), r_strides[-2], r_strides[-1])
    a_batch = tuple(s * M * K for s in broadcast_strides(a_shape[:-2], batch)) if batch else ()
    b_batch = tuple(s * K * N for s in broadcast_strides(b_shape[:-2], batch)) if batch else ()
    o_batch = tuple(s * M * N for s in dims_strides(batch)) if batch else ()
    b = Operand(b_batch, N, 1)
    fmt = _marked_format(node, B, reduced) if not any(b_batch) else None
    if fmt:           # packed by gemm_tc for the kernel it chooses
        args[1] = np.asarray(B.data, dtype=np.float32).reshape(K, N)
    elif B.is_const and not any(b_batch):
        args[1], b = _pack_b(np.asarray(B.data, dtype=np.float32).reshape(K, N), uses_gemv(M, N))
        b = Operand(b_batch, b.rows, b.cols)
    args.append(Y.name)
    p = Product(M, N, K, batch, Operand(a_batch, K, 1), b, Operand(o_batch, N, 1), None, r,
                epilogue=epilogue, ptr=("p0", "p1", None, "p2" if r else None, f"p{len(args) - 1}"))
    return Lowered(_calls("MatMul", p, args, graph, node, fmt, reduced))


GENERATORS: dict = {"Gemm": lower_gemm, "FusedGemm": lower_gemm, "MatMul": lower_matmul, "FusedMatMul": lower_matmul}
