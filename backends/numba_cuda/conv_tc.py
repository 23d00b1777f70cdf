"""GPU convolutions in bf16 / fp16 (a Conv / FusedConv whose constant weights assign_precision
marked): conv.py's implicit GEMM on tensor cores, 16-bit operands, float32 sums and epilogue.

    Y_g[M, N] = W_g[M, K] @ im2col(X)_g[K, N]       M = output channels of group g, N = batch x pixels,
                                                    K = input channels of the group x kernel taps

The product is gemm_tc.py's tile with the roles it gives A and B: A is the weights, rounded and
packed at build time as [G, Kpad / 2, Mpad] k pairs (two consecutive k in one word, the even one
in the low half: mma.pack_pairs), read as coalesced rows; B is the im2col tile, gathered as
conv.py gathers it (each thread owns one pixel column, decoded once; a row k = (channel, tap) is
an entry of the tap table; padding reads 0) two k rows at a time and rounded into one word as it
is stored to shared memory (cvt.rn.bf16x2.f32). The warps' fragments and mmas are gemm_tc's
(warp_lines, mma_step, output_elements); the epilogue (bias, residual, activation) and the split-k
second kernel are conv.py's. Depthwise convs are not marked and stay conv.py's float32 kernel.
The error is gemm_tc.py's: (2u + u^2) per product of magnitudes plus the float32 sums.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from backends.numba_cpu.kernel import Source, dims_strides
from cuvil.ir import Value

from . import conv
from .conv import ceil_div, tap_table
from .gemm import double_buffered
from .gemm_tc import TC_TILES, THREADS, TcTile, format_of, label, mma_step, output_elements, pack_pairs, warp_lines
from .kernel import KernelCall, gpu_kernel


def choose_tc_tile(shape) -> tuple[TcTile, int]:
    """conv.choose_tile over the tensor-core tiles: the largest that does not pad M much, K split
    until the GPU holds conv.WARPS_PER_SM warps per SM."""
    fitting = [t for t in TC_TILES if t.BM <= max(32, shape.ocg)] or [TC_TILES[-1]]
    for tile in fitting:
        k_steps = ceil_div(shape.K, tile.BK)
        blocks = ceil_div(shape.ocg, tile.BM) * ceil_div(shape.N, tile.BN) * shape.group
        wanted = ceil_div(conv.SMS * conv.WARPS_PER_SM * 32, blocks * THREADS)
        splits = max(1, min(wanted, conv.MAX_SPLITS, k_steps // conv.MIN_SPLIT_TILES))
        splits = ceil_div(k_steps, ceil_div(k_steps, splits))   # no empty split
        if blocks * splits >= conv.SMS:
            break
    return tile, splits


def pack_weights(w: np.ndarray, shape, tile: TcTile, fmt: str) -> np.ndarray:
    """W [OC, IC/group, *kernel] -> [G, Kpad / 2, Mpad] uint32 k pairs, zero-padded to whole tiles."""
    G, M, K = shape.group, shape.ocg, shape.K
    k_pad, m_pad = ceil_div(K, tile.BK) * tile.BK, ceil_div(M, tile.BM) * tile.BM
    padded = np.zeros((G, k_pad, m_pad), np.float32)
    padded[:, :K, :M] = w.reshape(G, M, K).transpose(0, 2, 1)
    return np.ascontiguousarray(np.stack([pack_pairs(padded[g], fmt) for g in range(G)]))


def implicit_gemm_kernel(shape, tile: TcTile, splits: int, fmt: str):
    """The kernel and its work. Pointers: X, the packed weights, the tap table (but for a pointwise
    conv), then [bias], [residual], Y when splits == 1, else the partial sums [S, N, OC, pixels]."""
    s, t = shape, tile
    M, N, K, G = s.ocg, s.N, s.K, s.group
    KP = t.BK // 2
    m_tiles, n_tiles = ceil_div(M, t.BM), ceil_div(N, t.BN)
    k_steps = ceil_div(K, t.BK)
    per_split = ceil_div(k_steps, splits)
    k_pad, m_pad = k_steps * t.BK, m_tiles * t.BM
    nd = len(s.in_spatial)
    row = 1 + nd
    in_strides = dims_strides(s.in_spatial)

    ptr = iter(f"p{i}" for i in range(16))
    x, w = next(ptr), next(ptr)
    table = "" if s.pointwise else next(ptr)
    bias = res = ""
    if splits == 1:
        bias = next(ptr) if s.has_bias else ""
        res = next(ptr) if s.res_strides is not None else ""
    y = next(ptr)
    n_ptrs = int(y[1:]) + 1
    arg_types = [np.float32] * n_ptrs
    arg_types[1] = np.uint32
    if table:
        arg_types[2] = np.int32

    src = Source().line(f"def kernel({', '.join(f'p{i}' for i in range(n_ptrs))}, n):").indent()
    src.line("tid = cuda.threadIdx.x")
    src.line("blk = cuda.blockIdx.x")
    src.line(f"nt = blk % {n_tiles}").line(f"blk //= {n_tiles}")
    src.line(f"mt = blk % {m_tiles}").line(f"blk //= {m_tiles}")
    src.line(f"grp = blk % {G}").line(f"split = blk // {G}")
    src.line(f"m0 = mt * {t.BM}").line(f"n0 = nt * {t.BN}")
    src.line(f"kt0 = split * {per_split}")
    src.line(f"kt_count = min({k_steps} - kt0, {per_split})")
    warp_lines(src, t)
    # This thread's B column (conv.py's decode): its pixel, and the input offset of its window's origin.
    src.line(f"bcol = tid % {t.BN}")
    src.line("col = n0 + bcol")
    src.line(f"col_ok = col < {N}")
    src.line(f"pix = col % {s.out_plane}")
    src.line(f"xb = (col // {s.out_plane}) * {s.C * s.in_plane} + grp * {s.icg * s.in_plane}")
    if s.pointwise:
        src.line("xb += pix")
    else:
        conv.spatial_decode(src, "pix", s.out_spatial, "o")
        for d in range(nd):
            src.line(f"i{d}0 = o{d} * {s.strides[d]} - {s.pads[d]}")
            src.line(f"xb += i{d}0 * {in_strides[d]}")
    src.line(f"bkp = tid // {t.BN}")
    src.line(f"akp = tid // {t.BM}").line(f"am = tid % {t.BM}")
    a_items = [f"akp + {r * THREADS // t.BM}" for r in range(t.BM * KP // THREADS)]
    b_items = [f"bkp + {r * THREADS // t.BN}" for r in range(t.BN * KP // THREADS)]

    def load_tiles(kt: str):
        src.line(f"kp0 = ({kt}) * {KP}")
        for r, kp in enumerate(a_items):
            src.line(f"ra{r} = {w}[(grp * {k_pad // 2} + kp0 + {kp}) * {m_pad} + m0 + am]")
        for r, kp in enumerate(b_items):
            for half in (0, 1):
                src.line(f"kb = 2 * (kp0 + {kp}) + {half}")
                if s.pointwise:
                    src.line(f"rb{r}_{half} = {x}[xb + kb * {s.in_plane}] if col_ok and kb < {K} else float32(0)")
                    continue
                conv.gather_line(src, s, x, table, row, f"rb{r}_{half}")

    def store_tiles(buf: str):
        for r, kp in enumerate(a_items):
            src.line(f"sh_a[{buf}, {kp}, am] = ra{r}")
        for r, kp in enumerate(b_items):
            src.line(f"sh_b[{buf}, {kp}, bcol] = pack_{fmt}x2(rb{r}_0, rb{r}_1)")

    accs = [acc for acc, _, _ in output_elements(t)]
    src.line(" = ".join(accs) + " = float32(0)")
    double_buffered(src, "kt_count", lambda: load_tiles("kt0"), lambda: load_tiles("kt0 + step + 1"),
                    lambda: mma_step(src, t, fmt), store_tiles)

    for acc, m_in, n_in in output_elements(t):
        src.line(f"m = m0 + {m_in}")
        src.line(f"nn = n0 + {n_in}")
        src.line(f"if m < {M} and nn < {N}:").indent()
        src.line(f"oc = grp * {M} + m")
        src.line(f"bb = nn // {s.out_plane}").line(f"pp = nn % {s.out_plane}")
        if splits == 1:
            v = conv.epilogue_lines(src, s, acc, "bb", "oc", "pp", "", bias, res)
            src.line(f"{y}[(bb * {s.OC} + oc) * {s.out_plane} + pp] = {v}")
        else:
            src.line(f"{y}[((split * {s.batch} + bb) * {s.OC} + oc) * {s.out_plane} + pp] = {acc}")
        src.dedent()
    family = "ConvMma" if splits == 1 else "ConvMmaSplitK"
    blocks = m_tiles * n_tiles * G * splits
    return gpu_kernel(family, src.text(), arg_types, THREADS), blocks * THREADS


def conv_calls(shape, x_name: str, w: np.ndarray, tail: list, graph, node, fmt: str) -> list:
    """The calls of a marked conv (tail: [bias], [residual], Y as conv.lower_conv lists them)."""
    tile, splits = choose_tc_tile(shape)
    head = [x_name, pack_weights(w, shape, tile, fmt)]
    if not shape.pointwise:
        head.append(tap_table(shape, SimpleNamespace(bk=tile.BK)))
    how = label(fmt, "mma.sync m16n8k16")
    if splits == 1:
        kernel, work = implicit_gemm_kernel(shape, tile, 1, fmt)
        return [KernelCall(kernel, head + tail, work, node.name, precision=how)]
    scratch = graph.unique_name(f"{tail[-1]}__splitk")
    graph.values[scratch] = Value(scratch, np.dtype(np.float32), (splits * shape.batch * shape.OC * shape.out_plane,))
    kernel, work = implicit_gemm_kernel(shape, tile, splits, fmt)
    sums, sum_work = conv.split_sum_kernel(shape, splits)
    return [KernelCall(kernel, head + [scratch], work, node.name, precision=how),
            KernelCall(sums, [scratch] + tail, sum_work, node.name, precision=how)]


def lower_conv(node, graph):
    """conv.lower_conv, a marked conv taken here."""
    return conv.lower_conv(node, graph, reduced=(format_of, conv_calls))


# conv.py's generators with the marked convs taken here (registry.py lets these override conv's)
GENERATORS: dict = {"Conv": lower_conv, "FusedConv": lower_conv}
