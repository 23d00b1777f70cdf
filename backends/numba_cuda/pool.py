"""MaxPool and AveragePool on the GPU: one thread per output element, any spatial rank.

The CPU kernels work per (n, c) plane (a few hundred items for a ResNet stem); here every
output element is a thread, its window's taps unrolled by Numba over static bounds, the taps
outside the input skipped. The semantics are the CPU generator's (numba_cpu/pool.py): the
same geometry (auto_pad, ceil_mode through the graph's output shape), MaxPool from the
lowest float, AveragePool by a per-output reciprocal divisor packed at build time. float32
only; MaxPool's Indices output and other dtypes stay on the portable path (return None).
"""
from __future__ import annotations

import numpy as np

from backends.numba_cpu import pool as cpu_pool
from backends.numba_cpu.kernel import dims_strides, literal

from .kernel import BLOCK, KernelCall, Lowered, gpu_kernel


def _source(op: str, x, y, geometry) -> str:
    kernel, strides, dilations, pad_begin, _ = geometry
    in_spatial, out_spatial = [int(d) for d in x.shape[2:]], [int(d) for d in y.shape[2:]]
    rank = len(in_spatial)
    in_plane, out_plane = int(np.prod(in_spatial)), int(np.prod(out_spatial))
    x_strides, y_strides = dims_strides(in_spatial), dims_strides(out_spatial)
    is_max = op == "MaxPool"
    out_ptr = "p1" if is_max else "p2"
    lines = ["def kernel(" + ("p0, p1, n):" if is_max else "p0, p1, p2, n):"),
             "    i = cuda.grid(1)",
             "    if i >= n:",
             "        return",
             f"    plane = i // {out_plane}",
             f"    r = i - plane * {out_plane}",
             f"    xb = plane * {in_plane}"]
    for axis in range(rank):
        lines.append(f"    o{axis} = r // {y_strides[axis]}")
        lines.append(f"    r = r - o{axis} * {y_strides[axis]}")
    lines.append(f"    acc = {literal(np.finfo(np.float32).min, np.float32) if is_max else 'float32(0)'}")
    depth = 1
    for axis in range(rank):
        pad = "    " * depth
        lines.append(f"{pad}for k{axis} in range({kernel[axis]}):")
        depth += 1
        pad = "    " * depth
        lines.append(f"{pad}h{axis} = o{axis} * {strides[axis]} + k{axis} * {dilations[axis]} - {pad_begin[axis]}")
        lines.append(f"{pad}if h{axis} >= 0 and h{axis} < {in_spatial[axis]}:")
        depth += 1
    pad = "    " * depth
    index = " + ".join(["xb"] + [f"h{a} * {x_strides[a]}" for a in range(rank)])
    lines.append(f"{pad}v = p0[{index}]")
    lines.append(f"{pad}acc = max(acc, v)" if is_max else f"{pad}acc += v")
    lines.append(f"    {out_ptr}[i] = acc" if is_max else f"    {out_ptr}[i] = acc * p1[i - plane * {out_plane}]")
    return "\n".join(lines) + "\n"


def lower_maxpool(node, graph):
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    if (len(node.outputs) > 1 and node.outputs[1]) or np.dtype(x.dtype) != np.float32:
        return None
    geometry = cpu_pool.pool_geometry(node, x.shape[2:], y.shape[2:])
    kernel = gpu_kernel("MaxPool", _source("MaxPool", x, y, geometry), ("float32", "float32"), BLOCK)
    return Lowered([KernelCall(kernel, [x.name, y.name], int(np.prod(y.shape)), node.name)])


def lower_averagepool(node, graph):
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    if np.dtype(x.dtype) != np.float32:
        return None
    cpu = cpu_pool.lower_averagepool(node, graph).calls[0]   # its reciprocal divisors
    reciprocal = cpu.args[1]
    geometry = cpu_pool.pool_geometry(node, x.shape[2:], y.shape[2:])
    kernel = gpu_kernel("AveragePool", _source("AveragePool", x, y, geometry), ("float32",) * 3, BLOCK)
    return Lowered([KernelCall(kernel, [x.name, reciprocal, y.name], int(np.prod(y.shape)), node.name)])


GENERATORS = {"MaxPool": lower_maxpool, "AveragePool": lower_averagepool}
