"""Row kernels on the GPU: Softmax, LogSoftmax, LayerNormalization, reductions over trailing
axes, GlobalAveragePool and GlobalMaxPool; and the registry entry of attention.py's and
elementwise.py's generators.

Each op here reduces contiguous rows (the last axis, the trailing dims of a LayerNormalization,
the H x W plane of a channel). A row belongs to a group of threads (`RowLayout`):

- short rows (n <= 128): a power of two of lanes within a warp, up to 4 elements each, several
  rows per warp;
- rows up to 4096 when there are enough of them to fill the GPU: a warp per row;
- else a block per row (64..512 threads, about 8 elements each).

Thread `lane` of a group handles the elements lane, lane + G, lane + 2G... (G threads per row),
so a warp's loads are consecutive. When a thread has at most 32 elements (16 in blocks of 512
threads) they stay in registers between the passes (max, then exp and sum, then the scaled
store; or the mean, the variance of the deviations, the normalised store); longer rows are read
again from global memory (L2) in each pass. The reductions across the group are warps.py's butterflies: fixed order, the same
bits every run, no atomics. Rows past the last (the tail of the last block) compute a copy of
the last row and store nothing, so every thread takes part in every reduction.

Softmax and LogSoftmax over a non-trailing axis (the channels of N x C x H x W) take a thread per
(outer, inner) column instead: adjacent threads walk adjacent columns, so each step of the walk
along the axis is one coalesced load.

Other dtypes and reductions over non-trailing axes lower as the CPU generators do, as portable
GPU threads (a thread per output element for the reductions already).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from backends.numba_cpu import norm as cpu_norm, pool as cpu_pool, reduce as cpu_reduce, softmax as cpu_softmax
from backends.numba_cpu.kernel import Source

from . import attention, elementwise
from .kernel import BLOCK, KernelCall, Lowered, blocks, gpu_kernel
from .warps import LANE_XOR, WARP, allreduce, next_pow2, portable_lowering

# Multiprocessors to fill (an H200 has 132, an A100 108): a warp per row only when the rows give
# every one of them a few warps.
SMS = 132
_F32 = np.dtype(np.float32)
_LOWEST = "float32(-3.4028234663852886e38)"   # not -inf: fastmath assumes there are no infinities


@dataclass(frozen=True)
class RowLayout:
    """`rows` rows of `n` elements, `group` threads per row, `per` elements per thread."""
    rows: int
    n: int
    group: int
    rows_per_block: int

    @property
    def per(self) -> int:
        return -(-self.n // self.group)

    @property
    def block(self) -> int:
        return self.group * self.rows_per_block

    @property
    def work(self) -> int:
        return blocks(self.rows, self.rows_per_block) * self.block

    @property
    def in_registers(self) -> bool:
        # 32 elements a thread at 256 threads, 16 at 512 (whose threads have 128 registers at most)
        return self.per * self.block <= 8192


def row_layout(rows: int, n: int) -> RowLayout:
    if n <= 128:
        group = min(WARP, next_pow2(-(-n // 4)))
    elif n <= 4096 and rows >= 4 * SMS:
        group = WARP
    else:
        return RowLayout(rows, n, min(512, max(64, next_pow2(-(-n // 8)))), 1)
    # Up to 256 threads a block, fewer when the rows would not give every multiprocessor two blocks;
    # whole warps (a shuffle names all 32 lanes).
    rows_per_block = max(WARP // group, min(256 // group, rows // (2 * SMS)))
    return RowLayout(rows, n, group, 1 << (rows_per_block.bit_length() - 1))


class RowKernel:
    """The source of a row kernel: the prologue placing the thread in its row, loops over the
    thread's elements, reductions across the row's threads."""

    def __init__(self, layout: RowLayout, n_args: int, reductions: int, registers: bool):
        self.layout = layout
        self.registers = registers and layout.in_registers
        self.src = src = Source()
        src.line(f"def kernel({', '.join(f'p{k}' for k in range(n_args))}, n):").indent()
        G, L = layout.group, layout
        if G > WARP:
            for r in range(reductions):
                src.line(f"partial{r} = cuda.shared.array({G // WARP}, float32)")
            src.line("lane = cuda.threadIdx.x").line("row = cuda.blockIdx.x").line("live = True")
        else:
            src.line(f"lane = cuda.threadIdx.x % {G}")
            src.line(f"row = cuda.blockIdx.x * {L.rows_per_block} + cuda.threadIdx.x // {G}")
            src.line(f"live = row < {L.rows}")
            src.line("if not live:").indent().line(f"row = {L.rows - 1}").dedent()
        src.line(f"base = row * {L.n}")
        if self.registers:
            src.line(f"v = cuda.local.array({L.per}, float32)")
            self.each("v[k] = p0[base + j]")
        self.reductions = 0

    def x(self) -> str:
        """The thread's element k of the row (inside `each`)."""
        return "v[k]" if self.registers else "p0[base + j]"

    def each(self, *body: str, live_only: bool = False) -> None:
        """Lines run for each element j = lane + k * group of the row that the thread has."""
        src, L = self.src, self.layout
        if live_only:
            src.line("if live:").indent()
        src.line(f"for k in range({L.per}):").indent()
        src.line(f"j = lane + k * {L.group}")
        src.line(f"if j < {L.n}:").indent()
        for line in body:
            src.line(line)
        src.dedent().dedent()
        if live_only:
            src.dedent()

    def allreduce(self, var: str, op: str) -> None:
        allreduce(self.src, var, op, self.layout.group, f"partial{self.reductions}")
        self.reductions += 1

    def text(self) -> str:
        return LANE_XOR + "\n\n" + self.src.text()


def _float32(*values) -> bool:
    return all(np.dtype(v.dtype) == _F32 for v in values)


# -- Softmax, LogSoftmax ---------------------------------------------------------------------------

def _softmax_rows(op: str, layout: RowLayout) -> str:
    k = RowKernel(layout, 2, 2, registers=True)
    src, x = k.src, k.x()
    src.line(f"m = {_LOWEST}")
    k.each(f"m = max(m, {x})")
    k.allreduce("m", "max")
    src.line("s = float32(0)")
    if op == "Softmax" and k.registers:
        k.each("e = math.exp(v[k] - m)", "v[k] = e", "s += e")
    else:
        k.each(f"s += math.exp({x} - m)")
    k.allreduce("s", "sum")
    if op == "Softmax":
        src.line("inv = float32(1) / s")
        k.each(f"p1[base + j] = {'v[k]' if k.registers else f'math.exp({x} - m)'} * inv", live_only=True)
    else:
        src.line("shift = m + math.log(s)")
        k.each(f"p1[base + j] = {x} - shift", live_only=True)
    return k.text()


def _softmax_columns(op: str, n: int, inner: int) -> str:
    """A thread per (outer, inner) column of an outer x n x inner tensor."""
    src = Source().line("def kernel(p0, p1, n):").indent()
    src.line("i = cuda.grid(1)").line("if i < n:").indent()
    src.line(f"base = (i // {inner}) * {n * inner} + i % {inner}")
    src.line("m = p0[base]")
    src.line(f"for k in range(1, {n}):").indent().line(f"m = max(m, p0[base + k * {inner}])").dedent()
    src.line("s = float32(0)")
    src.line(f"for k in range({n}):").indent()
    if op == "Softmax":
        src.line(f"e = math.exp(p0[base + k * {inner}] - m)").line(f"p1[base + k * {inner}] = e").line("s += e").dedent()
        src.line("inv = float32(1) / s")
        src.line(f"for k in range({n}):").indent().line(f"p1[base + k * {inner}] = p1[base + k * {inner}] * inv")
    else:
        src.line(f"s += math.exp(p0[base + k * {inner}] - m)").dedent()
        src.line("shift = m + math.log(s)")
        src.line(f"for k in range({n}):").indent().line(f"p1[base + k * {inner}] = p0[base + k * {inner}] - shift")
    return src.text()


def lower_softmax(node, graph) -> Lowered:
    """Softmax and LogSoftmax (numba_cpu/softmax.py's layout: the opset < 13 flattening too)."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    cpu = cpu_softmax.lower_softmax if node.op == "Softmax" else cpu_reduce.lower_log_softmax
    if not _float32(x, y) or x.size == 0:
        return portable_lowering(node, graph, cpu)
    default_axis = -1 if graph.opset >= 13 else 1
    outer, n, inner = cpu_softmax.softmax_layout(x.shape, int(node.attr("axis", default_axis)), graph.opset)
    if inner == 1:
        layout = row_layout(outer, n)
        kernel = gpu_kernel(node.op, _softmax_rows(node.op, layout), ("float32",) * 2, layout.block)
        work = layout.work
    else:
        kernel = gpu_kernel(node.op, _softmax_columns(node.op, n, inner), ("float32",) * 2, BLOCK)
        work = outer * inner
    return Lowered([KernelCall(kernel, [x.name, y.name], work, node.name)])


# -- LayerNormalization -----------------------------------------------------------------------------

def lower_layer_normalization(node, graph) -> Lowered:
    """y = (x - mean) * inv * Scale + B over the rows X.shape[axis:], inv = 1 / sqrt(var + epsilon),
    var the mean square deviation (two passes over the registers); Mean and InvStdDev when asked."""
    X = graph.values[node.inputs[0]]
    S = graph.values[node.inputs[1]]
    Bv = graph.values[node.inputs[2]] if len(node.inputs) > 2 and node.inputs[2] else None
    outputs = [name if k < len(node.outputs) else "" for k, name in enumerate(node.outputs[:3])]
    values = [X, S] + ([Bv] if Bv is not None else []) + [graph.values[o] for o in outputs if o]
    if not _float32(*values) or X.size == 0:
        return portable_lowering(node, graph, cpu_norm.lower_layer_normalization)
    rank = len(X.shape)
    axis = int(node.attr("axis", -1)) % rank
    eps = float(node.attr("epsilon", 1e-5))
    rows = int(np.prod(X.shape[:axis], dtype=np.int64))
    size = int(np.prod(X.shape[axis:], dtype=np.int64))
    args = [X.name, cpu_norm._per_element(node, S, X.shape[axis:], _F32)]
    if Bv is not None:
        args.append(cpu_norm._per_element(node, Bv, X.shape[axis:], _F32))
    n_in = len(args)
    args += [o for o in outputs if o]
    layout = row_layout(rows, size)
    k = RowKernel(layout, len(args), 2, registers=True)
    src, x = k.src, k.x()
    src.line("acc = float32(0)")
    k.each(f"acc += {x}")
    k.allreduce("acc", "sum")
    src.line(f"mean = acc * float32({1.0 / size!r})")
    src.line("acc = float32(0)")
    k.each(f"d = {x} - mean", "acc += d * d")
    k.allreduce("acc", "sum")
    src.line(f"inv = float32(1) / math.sqrt(acc * float32({1.0 / size!r}) + float32({eps!r}))")
    out = n_in
    if outputs[0]:
        shift = " + p2[j]" if Bv is not None else ""
        k.each(f"p{out}[base + j] = ({x} - mean) * inv * p1[j]{shift}", live_only=True)
        out += 1
    stats = [(f"p{out + i}", value) for i, value in enumerate(v for name, v in zip(outputs[1:], ("mean", "inv")) if name)]
    if stats:
        src.line("if live and lane == 0:").indent()
        for pointer, value in stats:
            src.line(f"{pointer}[row] = {value}")
        src.dedent()
    kernel = gpu_kernel("LayerNormalization", k.text(), ("float32",) * len(args), layout.block)
    return Lowered([KernelCall(kernel, args, layout.work, node.name, n_outputs=len(args) - n_in)])


# -- reductions over trailing axes, global pooling -------------------------------------------------

# op: (initial value, update of `acc` by `x`, the reduction across threads, the final value)
_REDUCTIONS = {
    "ReduceSum": ("float32(0)", "acc += {x}", "sum", "acc"),
    "ReduceMean": ("float32(0)", "acc += {x}", "sum", "acc / float32({n})"),
    "ReduceMax": (_LOWEST, "acc = max(acc, {x})", "max", "acc"),
    "ReduceMin": ("float32(3.4028234663852886e38)", "acc = min(acc, {x})", "min", "acc"),
    "ReduceL1": ("float32(0)", "acc += abs({x})", "sum", "acc"),
    "ReduceL2": ("float32(0)", "acc += {x} * {x}", "sum", "math.sqrt(acc)"),
    "ReduceSumSquare": ("float32(0)", "acc += {x} * {x}", "sum", "acc"),
    "GlobalAveragePool": ("float32(0)", "acc += {x}", "sum", "acc / float32({n})"),
    "GlobalMaxPool": (_LOWEST, "acc = max(acc, {x})", "max", "acc"),
}


def _reduce_rows(op: str, layout: RowLayout) -> str:
    init, update, across, final = _REDUCTIONS[op]
    k = RowKernel(layout, 2, 1, registers=False)
    k.src.line(f"acc = {init}")
    k.each("x = p0[base + j]", update.format(x="x"))
    k.allreduce("acc", across)
    k.src.line("if live and lane == 0:").indent().line(f"p1[row] = {final.format(n=layout.n)}")
    return k.text()


def _trailing_rows(shape, axes) -> tuple[int, int] | None:
    """(rows, n) when the reduced axes are the trailing dims (size-1 dims aside), else None."""
    dims = [(int(d), a in axes) for a, d in enumerate(shape) if int(d) != 1]
    reduced = [d for d, r in dims if r]
    if not reduced or any(r for _, r in dims[:len(dims) - len(reduced)]):
        return None
    return int(np.prod([d for d, r in dims if not r], dtype=np.int64)), int(np.prod(reduced, dtype=np.int64))


def _lower_rows(node, graph, x, y, shape_rows) -> Lowered:
    rows, n = shape_rows
    layout = row_layout(rows, n)
    kernel = gpu_kernel(node.op, _reduce_rows(node.op, layout), ("float32",) * 2, layout.block)
    return Lowered([KernelCall(kernel, [x.name, y.name], layout.work, node.name)])


def lower_reduce(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    axes = cpu_reduce.reduce_axes(node, graph)
    trailing = _trailing_rows(x.shape, axes) if axes and _float32(x, y) and x.size else None
    if trailing is None:
        return portable_lowering(node, graph, cpu_reduce.lower_reduce)
    return _lower_rows(node, graph, x, y, trailing)


def lower_global_pool(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    cpu = cpu_pool.lower_global_averagepool if node.op == "GlobalAveragePool" else cpu_pool.lower_global_maxpool
    if not _float32(x, y) or len(x.shape) < 3 or x.size == 0:
        return portable_lowering(node, graph, cpu)
    planes = int(x.shape[0]) * int(x.shape[1])
    return _lower_rows(node, graph, x, y, (planes, int(math.prod(x.shape[2:]))))


GENERATORS: dict = {
    "Softmax": lower_softmax,
    "LogSoftmax": lower_softmax,
    "LayerNormalization": lower_layer_normalization,
    **{op: lower_reduce for op in _REDUCTIONS if op.startswith("Reduce")},
    "GlobalAveragePool": lower_global_pool,
    "GlobalMaxPool": lower_global_pool,
    **attention.GENERATORS,
    **elementwise.GENERATORS,
}
