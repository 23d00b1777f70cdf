"""Data movement on the GPU, one thread per element: Transpose, Slice, Split, Concat, Gather.

The CPU generators copy a row or a plane per work item (numba_cpu/transpose.py, indexing.py,
concat.py); on the GPU that would leave most threads idle, so here each output element is a
thread whose source index is affine in its own multi-index, with the shapes and strides baked
in. Elements are copied as unsigned integers of their size (numba_cpu/transpose.py copy_type),
so every dtype moves bit for bit.
"""
from __future__ import annotations

import numpy as np

from backends.numba_cpu.indexing import slice_params
from backends.numba_cpu.kernel import dims_strides
from backends.numba_cpu.transpose import collapse_transpose, copy_type

from .kernel import BLOCK, KernelCall, Lowered, gpu_kernel


def _decompose(out_shape, var="i") -> list[str]:
    """Lines splitting flat index `var` into o0, o1, ... over out_shape (row-major)."""
    strides = dims_strides(out_shape)
    lines, rest = [], var
    for axis, stride in enumerate(strides):
        if axis == len(strides) - 1:
            lines.append(f"    o{axis} = {rest}")
        else:
            lines.append(f"    o{axis} = {rest} // {stride}")
            lines.append(f"    r{axis} = {rest} - o{axis} * {stride}")
            rest = f"r{axis}"
    return lines


def _affine(strides, base=0) -> str:
    terms = [f"o{k} * {s}" if s != 1 else f"o{k}" for k, s in enumerate(strides) if s != 0]
    if base:
        terms.insert(0, str(base))
    return " + ".join(terms) or "0"


def affine_copy(family, node, x, y, out_shape, in_strides, base=0) -> Lowered:
    """y[i] = x[base + sum(o_k * in_strides[k])] for i over out_shape."""
    ctype = copy_type(node, y.dtype)
    n = int(np.prod(out_shape, dtype=np.int64))
    lines = ["def kernel(p0, p1, n):", "    i = cuda.grid(1)", "    if i >= n:", "        return",
             *_decompose(out_shape), f"    p1[i] = p0[{_affine(in_strides, base)}]"]
    kernel = gpu_kernel(family, "\n".join(lines) + "\n", (ctype, ctype), BLOCK)
    return Lowered([KernelCall(kernel, [x.name, y.name], n, node.name)])


def lower_transpose(node, graph):
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    rank = len(x.shape)
    perm = [int(p) for p in node.attr("perm", list(range(rank))[::-1])]
    perm = [p + rank if p < 0 else p for p in perm]
    dims, perm = collapse_transpose(x.shape, perm)
    if not dims:
        dims, perm = [1], [0]
    in_strides = dims_strides(dims)
    return affine_copy("Transpose", node, x, y, [dims[p] for p in perm], [in_strides[p] for p in perm])


def lower_slice(node, graph):
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    if not y.size:
        return None
    begin, step = slice_params(node, graph, x.shape)
    strides = dims_strides(x.shape)
    base = sum(b * s for b, s in zip(begin, strides))
    return affine_copy("Slice", node, x, y, [int(d) for d in y.shape], [st * s for st, s in zip(step, strides)], base)


def _axis(node, rank, default=0) -> int:
    axis = int(node.attr("axis", default))
    return axis + rank if axis < 0 else axis


def lower_split(node, graph):
    """One thread per input element, writing it to the output its coordinate on the axis falls in."""
    x = graph.values[node.inputs[0]]
    outs = [graph.values[o] for o in node.outputs]
    if not x.size or any(not o.size for o in outs):
        return None
    axis = _axis(node, len(x.shape))
    inner = int(np.prod([int(d) for d in x.shape[axis + 1:]], dtype=np.int64))
    dim = int(x.shape[axis])
    ctype = copy_type(node, x.dtype)
    lines = [f"def kernel(p0, {', '.join(f'p{k + 1}' for k in range(len(outs)))}, n):",
             "    i = cuda.grid(1)", "    if i >= n:", "        return",
             f"    o = i // {dim * inner}", f"    c = (i // {inner}) % {dim}", f"    r = i % {inner}",
             "    v = p0[i]"]
    start = 0
    for k, out in enumerate(outs):
        size = int(out.shape[axis])
        keyword = "if" if k == 0 else "elif"
        lines += [f"    {keyword} c < {start + size}:",
                  f"        p{k + 1}[(o * {size} + c - {start}) * {inner} + r] = v"]
        start += size
    kernel = gpu_kernel("Split", "\n".join(lines) + "\n", (ctype,) * (1 + len(outs)), BLOCK)
    return Lowered([KernelCall(kernel, [x.name] + [o.name for o in outs], int(x.size), node.name,
                               n_outputs=len(outs))])


def lower_concat(node, graph):
    """One thread per output element, reading it from the input its coordinate falls in."""
    ins = [graph.values[n] for n in node.inputs if n]
    y = graph.values[node.outputs[0]]
    ins = [v for v in ins if v.size]
    if not y.size or not ins:
        return None
    axis = _axis(node, len(y.shape))
    inner = int(np.prod([int(d) for d in y.shape[axis + 1:]], dtype=np.int64))
    dim = int(y.shape[axis])
    ctype = copy_type(node, y.dtype)
    out_ptr = f"p{len(ins)}"
    lines = [f"def kernel({', '.join(f'p{k}' for k in range(len(ins) + 1))}, n):",
             "    i = cuda.grid(1)", "    if i >= n:", "        return",
             f"    o = i // {dim * inner}", f"    c = (i // {inner}) % {dim}", f"    r = i % {inner}"]
    start = 0
    for k, v in enumerate(ins):
        size = int(v.shape[axis])
        keyword = "if" if k == 0 else "elif"
        lines += [f"    {keyword} c < {start + size}:",
                  f"        {out_ptr}[i] = p{k}[(o * {size} + c - {start}) * {inner} + r]"]
        start += size
    kernel = gpu_kernel("Concat", "\n".join(lines) + "\n", (ctype,) * (len(ins) + 1), BLOCK)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [y.name], int(y.size), node.name)])


def lower_gather(node, graph):
    """y[o, j, r] = data[o, wrap(indices[j]), r], one thread per output element; indices out of
    range are clamped as on the CPU (numba_cpu/indexing.py)."""
    data, indices, y = (graph.values[n] for n in (node.inputs[0], node.inputs[1], node.outputs[0]))
    if not y.size:
        return None
    axis = _axis(node, len(data.shape))
    dim = int(data.shape[axis])
    inner = int(np.prod([int(d) for d in data.shape[axis + 1:]], dtype=np.int64))
    nidx = max(int(indices.size), 1)
    ctype = copy_type(node, data.dtype)
    lines = ["def kernel(p0, p1, p2, n):", "    i = cuda.grid(1)", "    if i >= n:", "        return",
             f"    o = i // {nidx * inner}", f"    j = (i // {inner}) % {nidx}", f"    r = i % {inner}",
             "    idx = int64(p1[j])", "    if idx < 0:", f"        idx += {dim}",
             "    if idx < 0:", "        idx = 0", f"    if idx > {max(dim - 1, 0)}:", f"        idx = {max(dim - 1, 0)}",
             f"    p2[i] = p0[(o * {dim} + idx) * {inner} + r]"]
    kernel = gpu_kernel("Gather", "\n".join(lines) + "\n", (ctype, np.dtype(indices.dtype).name, ctype), BLOCK)
    return Lowered([KernelCall(kernel, [data.name, indices.name, y.name], int(y.size), node.name)])


GENERATORS = {"Transpose": lower_transpose, "Slice": lower_slice, "Split": lower_split, "Concat": lower_concat,
              "Gather": lower_gather}
