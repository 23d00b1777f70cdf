"""GPU convolution: Conv and FusedConv (NCHW, 1-D/2-D/3-D, groups, strides, pads, dilations,
auto_pad, optional bias, fused activation + residual).

    Y[b, oc, o] = act(B[oc] + sum_{ic in group(oc), k} W[oc, ic, k] * X[b, ic, o*s - p + k*d] + R[b, oc, o])

Two kernel designs:

* Implicit GEMM (every conv but the depthwise ones), per group g:
  Y_g[M, N] = W_g[M, K] @ im2col(X)_g[K, N] with M = output channels of the group,
  N = batch x output pixels, K = input channels of the group x kernel taps. A block computes
  a BM x BN tile of Y_g, each thread a TM x TN register block (rows ty + i*BM/TM, columns
  tx + j*BN/TN: a warp's shared-memory reads are conflict-free and its stores coalesce along
  the pixels). K advances BK at a time through double-buffered shared memory, the next tiles
  being fetched into registers while the current ones are multiplied. The weights are packed
  at build time as [G, Kpad, Mpad] (K-major, zero-padded to whole tiles), so a block reads its
  A tile as coalesced rows without bounds checks. The B tile is im2col computed on the fly:
  each thread owns one column (pixel) of the tile, decoded once into its window's origin, and
  a row k = (channel, tap) is one entry of a table packed at build time (the tap's input
  offset and displacements: no integer division in the loop); taps in the padding read 0
  (cf. cuDNN's precomputed-offset implicit GEMM). A 1x1 stride-1 unpadded conv
  reads X[k, pixel] directly (a plain GEMM over the NCHW input viewed as [C, H*W]).
  When the tiles are too few to fill the GPU (late layers: 512 channels x 7x7), K is split
  over more blocks: each writes its partial tile to a scratch [S, N, OC, pixels] and a second
  kernel sums the S partials in order (deterministic) and applies the epilogue. Otherwise
  the bias / residual / activation epilogue is fused into the tile's store.

* Depthwise (one input channel per group: group == C, any channel multiplier): a thread per
  DW_COLUMNS outputs along W (consecutive threads along W: coalesced loads and stores), the
  taps unrolled with their bounds checks, the weights in registers, each input column loaded
  once for the outputs that share it.

Weights computed at run time (not constants) are read by the implicit GEMM in their ONNX
layout [OC, IC/group, *kernel], with bounds checks instead of padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.numba_cpu.conv import conv_geometry
from backends.numba_cpu.epilogue import Epilogue, epilogue_of
from backends.numba_cpu.kernel import Source, broadcast_strides, dims_strides
from cuvil.errors import UnsupportedOpError
from cuvil.ir import Value

from .gemm import double_buffered
from .kernel import BLOCK, KernelCall, Lowered, gpu_kernel

SMS = 132          # streaming multiprocessors of an H100/H200 (an A100 has 108): the blocks to fill
WARPS_PER_SM = 8   # batch-1 convs are latency-bound: K is split until the GPU holds this many warps per SM
MIN_SPLIT_TILES = 4  # a K split spans at least this many BK steps (else the partial sums cost more than they save)
MAX_SPLITS = 16
DW_COLUMNS = 4     # outputs along W per depthwise thread (their taps share input loads)
DW_WEIGHT_REGS = 32  # a depthwise kernel with at most this many taps keeps its weights in registers


@dataclass(frozen=True)
class Tile:
    """An implicit-GEMM block tile: BM x BN outputs, TM x TN per thread, BK deep per step."""
    bm: int
    bn: int
    tm: int
    tn: int
    bk: int

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


# Largest first. Every tile has threads a multiple of BN (one B column per thread) and
# BK x BM, BK x BN multiples of threads (whole loads per thread).
TILES = (Tile(128, 64, 8, 4, 8), Tile(64, 64, 4, 4, 8), Tile(64, 32, 4, 4, 8), Tile(32, 32, 4, 4, 8))


def ceil_div(a, b):
    return -(-a // b)


def _unsupported(node, why):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}")


@dataclass
class ConvShape:
    """A conv's static geometry (spatial lists per spatial dim) and its epilogue."""
    batch: int
    C: int
    OC: int
    group: int
    in_spatial: list
    out_spatial: list
    kernel: list
    strides: list
    dilations: list
    pads: list               # begin pads
    has_bias: bool
    res_strides: tuple | None  # residual's element strides over (N, OC, *out_spatial), or None
    epilogue: Epilogue

    def __post_init__(self):
        self.icg, self.ocg = self.C // self.group, self.OC // self.group
        self.in_plane = int(np.prod(self.in_spatial))
        self.out_plane = int(np.prod(self.out_spatial))
        self.taps = int(np.prod(self.kernel))
        self.K = self.icg * self.taps
        self.N = self.batch * self.out_plane
        self.pointwise = (all(k == 1 for k in self.kernel) and all(s == 1 for s in self.strides)
                          and not any(self.pads) and self.in_spatial == self.out_spatial)


def lower_conv(node, graph, reduced=None) -> Lowered:
    """Conv, and FusedConv (domain "cuvil"): y = act(conv(x) + bias + residual). `reduced`: conv_tc.py's
    (format_of, calls), which take the convs assign_precision marked (constant weights, not depthwise)."""
    epilogue, inputs = epilogue_of(node)
    X = graph.values[inputs[0]]
    W = graph.values[inputs[1]]
    B = graph.values[inputs[2]] if len(inputs) > 2 and inputs[2] else None
    Y = graph.values[node.outputs[0]]
    if np.dtype(Y.dtype) != np.float32 or np.dtype(X.dtype) != np.float32:
        raise _unsupported(node, f"{np.dtype(Y.dtype).name} convolution is not supported on the GPU yet (float32 only)")
    if len(X.shape) < 3:
        raise _unsupported(node, f"input rank {len(X.shape)} is not supported (N, C and at least one spatial dim)")
    group = int(node.attr("group", 1))
    C, OC = int(X.shape[1]), int(W.shape[0])
    if C % group or OC % group or W.shape[1] != C // group:
        raise _unsupported(node, f"W shape {W.shape} does not match {C} input channels in {group} groups")
    kernel, strides, dilations, pads = conv_geometry(node, X.shape[2:], W.shape[2:])
    if list(kernel) != list(W.shape[2:]):
        raise _unsupported(node, f"kernel_shape {kernel} does not match W shape {W.shape}")
    res_arg, res_strides = None, None
    if epilogue.residual is not None:
        R = graph.values[epilogue.residual]
        res_arg = np.ascontiguousarray(np.asarray(R.data, dtype=np.float32)) if R.is_const else R.name
        res_strides = tuple(broadcast_strides(R.shape, Y.shape))
    shape = ConvShape(int(X.shape[0]), C, OC, group, [int(v) for v in X.shape[2:]], [int(v) for v in Y.shape[2:]],
                      list(kernel), list(strides), list(dilations), list(pads), B is not None, res_strides, epilogue)
    tail = ([B.name] if B is not None else []) + ([res_arg] if res_arg is not None else []) + [Y.name]
    if shape.icg == 1 and group > 1:
        kernel_obj, work = depthwise_kernel(shape)
        return Lowered([KernelCall(kernel_obj, [X.name, W.name] + tail, work, node.name)])
    fmt = reduced[0](node) if reduced is not None and W.is_const else None
    if fmt:
        return Lowered(reduced[1](shape, X.name, np.asarray(W.data, dtype=np.float32), tail, graph, node, fmt))
    tile, splits = choose_tile(shape)
    weights = pack_weights(np.asarray(W.data, dtype=np.float32), shape, tile) if W.is_const else W.name
    head = [X.name, weights] + ([] if shape.pointwise else [tap_table(shape, tile)])
    if splits == 1:
        kernel_obj, work = implicit_gemm_kernel(shape, tile, 1, W.is_const)
        return Lowered([KernelCall(kernel_obj, head + tail, work, node.name)])
    scratch = graph.unique_name(f"{Y.name}__splitk")
    graph.values[scratch] = Value(scratch, np.dtype(np.float32), (splits * shape.batch * OC * shape.out_plane,))
    kernel_obj, work = implicit_gemm_kernel(shape, tile, splits, W.is_const)
    sum_obj, sum_work = split_sum_kernel(shape, splits)
    return Lowered([KernelCall(kernel_obj, head + [scratch], work, node.name),
                    KernelCall(sum_obj, [scratch] + tail, sum_work, node.name)])


def choose_tile(shape: ConvShape) -> tuple[Tile, int]:
    """The block tile and the number of K splits: the largest tile (the fewest loads per FMA) that
    does not pad M much and, with K split until the GPU holds WARPS_PER_SM warps per SM, gives
    every SM a block. Splits are capped (MAX_SPLITS, MIN_SPLIT_TILES steps each)."""
    fitting = [t for t in TILES if t.bm <= max(32, shape.ocg)] or [TILES[-1]]
    for tile in fitting:
        k_steps = ceil_div(shape.K, tile.bk)
        blocks = ceil_div(shape.ocg, tile.bm) * ceil_div(shape.N, tile.bn) * shape.group
        wanted = ceil_div(SMS * WARPS_PER_SM * 32, blocks * tile.threads)
        splits = max(1, min(wanted, MAX_SPLITS, k_steps // MIN_SPLIT_TILES))
        splits = ceil_div(k_steps, ceil_div(k_steps, splits))   # no empty split
        if blocks * splits >= SMS:
            break
    return tile, splits


def pack_weights(w: np.ndarray, shape: ConvShape, tile: Tile) -> np.ndarray:
    """W [OC, IC/group, *kernel] -> [G, Kpad, Mpad]: each group's W_g transposed (K-major),
    zero-padded to whole BK x BM tiles."""
    G, M, K = shape.group, shape.ocg, shape.K
    k_pad, m_pad = ceil_div(K, tile.bk) * tile.bk, ceil_div(M, tile.bm) * tile.bm
    packed = np.zeros((G, k_pad, m_pad), dtype=np.float32)
    packed[:, :K, :M] = w.reshape(G, M, K).transpose(0, 2, 1)
    return packed


def spatial_decode(src: Source, flat: str, dims: list, prefix: str) -> list[str]:
    """Lines that split the flat index `flat` over `dims` (last fastest) into prefix0, prefix1...;
    returns those names."""
    names = [f"{prefix}{d}" for d in range(len(dims))]
    rest = f"({flat})"
    for d in range(len(dims) - 1, 0, -1):
        src.line(f"{names[d]} = {rest} % {dims[d]}")
        src.line(f"{prefix}r{d} = {rest} // {dims[d]}")
        rest = f"{prefix}r{d}"
    src.line(f"{names[0]} = {rest}")
    return names


def _residual_index(src: Source, shape: ConvShape, b: str, oc: str, p: str, tag: str) -> str:
    """An expression of the residual's element index at output (b, oc, flat pixel p), with any
    lines it needs written first."""
    sn, sc, *spatial = shape.res_strides
    terms = [f"{b} * {sn}" if sn else "", f"{oc} * {sc}" if sc else ""]
    flat = _flat_stride(spatial, shape.out_spatial)
    if flat is not None:
        terms.append(f"({p}) * {flat}" if flat else "")
    else:
        coords = spatial_decode(src, p, shape.out_spatial, f"ro{tag}_")
        terms += [f"{c} * {s}" for c, s in zip(coords, spatial) if s]
    return " + ".join(t for t in terms if t) or "0"


def _flat_stride(strides, dims):
    """The stride of the flat spatial index when the spatial strides read linearly (0: broadcast),
    else None."""
    if all(v == 0 for v in strides):
        return 0
    if all(strides[i] == strides[i + 1] * dims[i + 1] for i in range(len(dims) - 1)):
        return strides[-1]
    return None


def epilogue_lines(src: Source, shape: ConvShape, value: str, b: str, oc: str, p: str, tag: str,
                    bias_ptr: str, res_ptr: str) -> str:
    """Lines that add bias and residual to `value` and apply the activation; returns the result's name."""
    out = f"v{tag}"
    src.line(f"{out} = {value}" + (f" + {bias_ptr}[{oc}]" if shape.has_bias else ""))
    if shape.res_strides is not None:
        src.line(f"{out} += {res_ptr}[{_residual_index(src, shape, b, oc, p, tag)}]")
    if shape.epilogue.active:
        src.line(f"{out} = {shape.epilogue.expr(out, np.float32)}")
    return out


def tap_table(shape: ConvShape, tile: Tile) -> np.ndarray:
    """The im2col row table, [Kpad, 1 + spatial dims] int32: for row k = (channel, tap), the input
    offset of that tap from the pixel's window origin, then the tap's displacement along each
    spatial dim (for the padding checks). Rows past K have a displacement that no input holds, so
    they read 0 like the padding."""
    s = shape
    k_pad = ceil_div(s.K, tile.bk) * tile.bk
    table = np.zeros((k_pad, 1 + len(s.kernel)), dtype=np.int32)
    table[s.K:, 1] = 1 << 24
    in_strides = dims_strides(s.in_spatial)
    for k in range(s.K):
        ic, tap = divmod(k, s.taps)
        disp = [kd * dil for kd, dil in zip(np.unravel_index(tap, s.kernel), s.dilations)]
        table[k] = [ic * s.in_plane + sum(v * st for v, st in zip(disp, in_strides))] + disp
    return table


def gather_line(src: Source, s, x: str, table: str, row: int, dest: str) -> None:
    """Lines that read element `kb` of the current pixel's im2col column (the pixel's input base
    `xb`, its first input position i<d>0) through the tap table (per k: the input offset, then the
    tap's offset per spatial dim) into `dest`, zero in the padding or past the last column."""
    nd = len(s.in_spatial)
    src.line(f"e = kb * {row}")
    conds = ["col_ok"]
    for d in range(nd):
        src.line(f"i{d} = i{d}0 + {table}[e + {1 + d}]")
        conds.append(f"0 <= i{d} < {s.in_spatial[d]}")
    src.line(f"{dest} = {x}[xb + {table}[e]] if {' and '.join(conds)} else float32(0)")


def implicit_gemm_kernel(shape: ConvShape, tile: Tile, splits: int, packed: bool):
    """The implicit-GEMM kernel and its work. Pointers: X, W (packed [G, Kpad, Mpad] or ONNX layout),
    the tap table (but for a pointwise conv), then [bias], [residual], Y when splits == 1, else the
    partial sums' scratch [S, N, OC, pixels]."""
    s, t = shape, tile
    M, N, K, G = s.ocg, s.N, s.K, s.group
    threads = t.threads
    cols_t, rows_t = t.bn // t.tn, t.bm // t.tm       # threads along a tile's columns / rows
    m_tiles, n_tiles = ceil_div(M, t.bm), ceil_div(N, t.bn)
    k_steps = ceil_div(K, t.bk)
    per_split = ceil_div(k_steps, splits)
    k_pad, m_pad = k_steps * t.bk, m_tiles * t.bm
    a_loads, b_loads = t.bk * t.bm // threads, t.bk * t.bn // threads
    b_row_step = threads // t.bn
    nd = len(s.in_spatial)
    row = 1 + nd                                       # ints per tap-table row
    in_strides = dims_strides(s.in_spatial)

    ptr = iter(f"p{i}" for i in range(16))
    x, w = next(ptr), next(ptr)
    table = "" if s.pointwise else next(ptr)
    if splits == 1:
        bias = next(ptr) if s.has_bias else ""
        res = next(ptr) if s.res_strides is not None else ""
    y = next(ptr)
    n_ptrs = int(y[1:]) + 1
    arg_types = [np.float32] * n_ptrs
    if table:
        arg_types[2] = np.int32

    src = Source().line(f"def kernel({', '.join(f'p{i}' for i in range(n_ptrs))}, n):").indent()
    src.line(f"a_sm = cuda.shared.array((2, {t.bk}, {t.bm}), float32)")
    src.line(f"b_sm = cuda.shared.array((2, {t.bk}, {t.bn}), float32)")
    src.line("tid = cuda.threadIdx.x")
    src.line("blk = cuda.blockIdx.x")
    src.line(f"nt = blk % {n_tiles}").line(f"blk //= {n_tiles}")
    src.line(f"mt = blk % {m_tiles}").line(f"blk //= {m_tiles}")
    src.line(f"g = blk % {G}").line(f"split = blk // {G}")
    src.line(f"m0 = mt * {t.bm}").line(f"n0 = nt * {t.bn}")
    src.line(f"kt0 = split * {per_split}")
    src.line(f"kt_count = min({k_steps} - kt0, {per_split})")
    # This thread's B column: its pixel decoded once, into the input offset of its window's origin.
    src.line(f"col = n0 + tid % {t.bn}")
    src.line(f"col_ok = col < {N}")
    src.line(f"pix = col % {s.out_plane}")
    src.line(f"xb = (col // {s.out_plane}) * {s.C * s.in_plane} + g * {s.icg * s.in_plane}")
    if s.pointwise:
        src.line("xb += pix")
    else:
        spatial_decode(src, "pix", s.out_spatial, "o")
        for d in range(nd):
            src.line(f"i{d}0 = o{d} * {s.strides[d]} - {s.pads[d]}")
            src.line(f"xb += i{d}0 * {in_strides[d]}")
    src.line(f"brow = tid // {t.bn}")
    src.line(f"arow = tid // {t.bm}").line(f"acol = tid % {t.bm}")
    src.line(f"tx = tid % {cols_t}").line(f"ty = tid // {cols_t}")

    def load_tiles(kt: str):
        """Lines that fetch the A and B tiles of K step `kt` into registers ra*, rb*."""
        src.line(f"k0 = ({kt}) * {t.bk}")
        for r in range(a_loads):
            kk = f"arow + {r * threads // t.bm}"
            if packed:
                src.line(f"ra{r} = {w}[(g * {k_pad} + k0 + {kk}) * {m_pad} + m0 + acol]")
            else:
                src.line(f"ka = k0 + {kk}").line("ma = m0 + acol")
                src.line(f"ra{r} = {w}[(g * {M} + ma) * {K} + ka] if ma < {M} and ka < {K} else float32(0)")
        for r in range(b_loads):
            src.line(f"kb = k0 + brow + {r * b_row_step}")
            if s.pointwise:
                src.line(f"rb{r} = {x}[xb + kb * {s.in_plane}] if col_ok and kb < {K} else float32(0)")
                continue
            gather_line(src, s, x, table, row, f"rb{r}")

    def store_tiles(buf: str):
        for r in range(a_loads):
            src.line(f"a_sm[{buf}, arow + {r * threads // t.bm}, acol] = ra{r}")
        for r in range(b_loads):
            src.line(f"b_sm[{buf}, brow + {r * b_row_step}, tid % {t.bn}] = rb{r}")

    for i in range(t.tm):
        for j in range(t.tn):
            src.line(f"c{i}_{j} = float32(0)")
    def compute():
        # The register block is unrolled (scalars: registers); the K step is a loop that LLVM
        # unrolls as it sees fit (unrolled here it costs 4x the compile time and 1.7x the registers).
        src.line(f"for kk in range({t.bk}):").indent()
        for i in range(t.tm):
            src.line(f"a{i} = a_sm[cur, kk, ty + {i * rows_t}]")
        for j in range(t.tn):
            src.line(f"b{j} = b_sm[cur, kk, tx + {j * cols_t}]")
        for i in range(t.tm):
            for j in range(t.tn):
                src.line(f"c{i}_{j} += a{i} * b{j}")
        src.dedent()

    double_buffered(src, "kt_count", lambda: load_tiles("kt0"), lambda: load_tiles("kt0 + step + 1"), compute,
                    store_tiles)

    # The store: columns j (pixels) outer, so that their decode is shared by the rows.
    for j in range(t.tn):
        src.line(f"n_{j} = n0 + tx + {j * cols_t}")
        src.line(f"if n_{j} < {N}:").indent()
        src.line(f"b_{j} = n_{j} // {s.out_plane}").line(f"p_{j} = n_{j} % {s.out_plane}")
        for i in range(t.tm):
            src.line(f"m = m0 + ty + {i * rows_t}")
            src.line(f"if m < {M}:").indent()
            src.line(f"oc = g * {M} + m")
            if splits == 1:
                v = epilogue_lines(src, s, f"c{i}_{j}", f"b_{j}", "oc", f"p_{j}", "", bias, res)
                src.line(f"{y}[(b_{j} * {s.OC} + oc) * {s.out_plane} + p_{j}] = {v}")
            else:
                src.line(f"{y}[((split * {s.batch} + b_{j}) * {s.OC} + oc) * {s.out_plane} + p_{j}] = c{i}_{j}")
            src.dedent()
        src.dedent()
    family = "ConvImplicitGemm" if splits == 1 else "ConvImplicitGemmSplitK"
    blocks = m_tiles * n_tiles * G * splits
    return gpu_kernel(family, src.text(), arg_types, threads), blocks * threads


def split_sum_kernel(shape: ConvShape, splits: int):
    """The sum of the K splits' partials, in split order, with the epilogue: one thread per output.
    Pointers: scratch, [bias], [residual], Y."""
    s = shape
    total = s.batch * s.OC * s.out_plane
    n_ptrs = 2 + s.has_bias + (s.res_strides is not None)
    bias = "p1" if s.has_bias else ""
    res = f"p{1 + s.has_bias}" if s.res_strides is not None else ""
    src = Source().line(f"def kernel({', '.join(f'p{i}' for i in range(n_ptrs))}, n):").indent()
    src.line("i = cuda.grid(1)")
    src.line("if i < n:").indent()
    src.line("acc = p0[i]")
    for k in range(1, splits):
        src.line(f"acc += p0[i + {k * total}]")
    src.line(f"p = i % {s.out_plane}").line(f"oc = (i // {s.out_plane}) % {s.OC}").line(f"b = i // {s.OC * s.out_plane}")
    v = epilogue_lines(src, s, "acc", "b", "oc", "p", "", bias, res)
    src.line(f"p{n_ptrs - 1}[i] = {v}")
    return gpu_kernel("ConvSplitKSum", src.text(), [np.float32] * n_ptrs, BLOCK), total


def depthwise_kernel(shape: ConvShape):
    """A conv with one input channel per group: each thread computes DW_COLUMNS consecutive outputs
    along the last spatial dim (consecutive threads: the next columns, so loads and stores stay
    coalesced). Its weights sit in registers; each input column its taps read is loaded once
    (stride 1, 3 taps, 4 outputs: 6 loads for 12 FMAs), 0 in the padding.
    Pointers: X, W (ONNX layout [OC, 1, *kernel]), [bias], [residual], Y."""
    s = shape
    nd = len(s.in_spatial)
    in_strides = dims_strides(s.in_spatial)
    kernel_strides = dims_strides(s.kernel)
    OW, IW, KW, SW, DW, PW = s.out_spatial[-1], s.in_spatial[-1], s.kernel[-1], s.strides[-1], s.dilations[-1], s.pads[-1]
    q_cols = min(DW_COLUMNS, OW)
    col_blocks = ceil_div(OW, q_cols)
    lead = s.out_plane // OW                      # output rows (all leading spatial dims)
    total = s.batch * s.OC * lead * col_blocks
    in_registers = s.taps <= DW_WEIGHT_REGS
    n_ptrs = 3 + s.has_bias + (s.res_strides is not None)
    bias = "p2" if s.has_bias else ""
    res = f"p{2 + s.has_bias}" if s.res_strides is not None else ""
    src = Source().line(f"def kernel({', '.join(f'p{i}' for i in range(n_ptrs))}, n):").indent()
    src.line("i = cuda.grid(1)")
    src.line("if i < n:").indent()
    src.line(f"cb = i % {col_blocks}").line(f"rest = i // {col_blocks}")
    src.line(f"orow = rest % {lead}").line(f"rest //= {lead}")
    src.line(f"oc = rest % {s.OC}").line(f"b = rest // {s.OC}")
    coords = spatial_decode(src, "orow", s.out_spatial[:-1], "o") if nd > 1 else []
    src.line(f"ow0 = cb * {q_cols}")
    src.line(f"xb = (b * {s.C} + oc // {s.ocg}) * {s.in_plane}")
    src.line(f"wb = oc * {s.taps}")
    if in_registers:
        for t in range(s.taps):
            src.line(f"w{t} = p1[wb + {t}]")
    for q in range(q_cols):
        src.line(f"acc{q} = float32(0)")
    src.line(f"iw0 = ow0 * {SW} - {PW}")

    def weight(t):
        return f"w{t}" if in_registers else f"p1[wb + {t}]"

    def taps(d: int, x_off: str, w_off: int):
        """Nested, unrolled loops over the leading kernel dims with their bounds checks; the last
        dim loads each input column once."""
        if d == nd - 1:
            cols = sorted({q * SW + kw * DW for q in range(q_cols) for kw in range(KW)})
            for c in cols:
                src.line(f"iw = iw0 + {c}")
                src.line(f"x{c} = p0[{x_off} + iw] if 0 <= iw < {IW} else float32(0)")
            for q in range(q_cols):
                for kw in range(KW):
                    src.line(f"acc{q} += {weight(w_off + kw)} * x{q * SW + kw * DW}")
            return
        for k in range(s.kernel[d]):
            src.line(f"i{d} = {coords[d]} * {s.strides[d]} + {k * s.dilations[d] - s.pads[d]}")
            src.line(f"if 0 <= i{d} < {s.in_spatial[d]}:").indent()
            src.line(f"x{d}_ = {x_off} + i{d} * {in_strides[d]}")
            taps(d + 1, f"x{d}_", w_off + k * kernel_strides[d])
            src.dedent()

    taps(0, "xb", 0)
    src.line(f"yb = ((b * {s.OC} + oc) * {lead} + orow) * {OW} + ow0")
    for q in range(q_cols):
        guard = OW % q_cols != 0
        if guard:
            src.line(f"if ow0 + {q} < {OW}:").indent()
        v = epilogue_lines(src, s, f"acc{q}", "b", "oc", f"orow * {OW} + ow0 + {q}", "", bias, res)
        src.line(f"p{n_ptrs - 1}[yb + {q}] = {v}")
        if guard:
            src.dedent()
    return gpu_kernel("ConvDepthwise", src.text(), [np.float32] * n_ptrs, BLOCK), total


GENERATORS = {"Conv": lower_conv, "FusedConv": lower_conv}
