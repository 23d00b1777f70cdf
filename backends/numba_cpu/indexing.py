"""Data movement and indexing: Cast, Expand, Tile, Slice, Pad, Split, Gather,
GatherElements, GatherND, ScatterElements, ScatterND, TensorScatter, Trilu, OneHot, EyeLike,
DepthToSpace, SpaceToDepth, Einsum, ReverseSequence, Dropout (inference).

Most of these are one loop nest over the output whose input index is affine
in the loop variables (Slice: start + i * step; Expand and Tile: broadcast
strides; DepthToSpace: a permuted view), so they share `affine_copy`. Pure
moves use unsigned pointers of the element size (`copy_type`): one kernel
serves every dtype of a width. Shape-deciding inputs (Slice's starts, Pad's
pads, Split's sizes...) must be constants: the kernel is specialised to them.
Indices read at run time are wrapped once if negative and clamped to the
dim, so a bad index cannot read or write outside a buffer.
"""
from __future__ import annotations

import re
import string

import numpy as np

from cuvil.errors import UnsupportedOpError

from .elementwise import (check_dtypes, compute_type, elementwise_kernel, is_narrow, load, loop_nest, pointer_type,
                          store, with_helpers)
from .kernel import (Kernel, KernelCall, Lowered, Source, const_input, dims_strides, kernel_header, literal,
                     session_threads)
from .transpose import copy_type


def _bits(value, dtype) -> str:
    """A literal of `value` in dtype, written as the bits of its copy type."""
    dtype = np.dtype(dtype)
    ctype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    return literal(int(np.asarray(value).astype(dtype).reshape(()).view(ctype)), ctype)


def affine_copy(family, node, in_value, out_value, in_strides, base=0, out_shape=None) -> Lowered:
    """out[i...] = in[base + sum(i_k * in_strides[k])] over the output's shape
    (or over `out_shape`, a view of the output with as many dims as in_strides)."""
    ctype = copy_type(node, out_value.dtype)
    out_shape = [int(d) for d in (out_value.shape if out_shape is None else out_shape)]
    src = Source().line(kernel_header(2)).indent()
    indices, work = loop_nest(src, out_shape, [list(in_strides), dims_strides(out_shape)])
    read = indices[0] if not base else (f"{base} + {indices[0]}" if indices[0] != "0" else str(base))
    src.line(f"p1[{indices[1]}] = p0[{read}]")
    if out_value.size == 0:
        work = 0
    kernel = Kernel(family, src.text(), (ctype, ctype))
    return Lowered([KernelCall(kernel, [in_value.name, out_value.name], work, node.name)])


def _broadcast_copy(family, node, x, y, in_shape, out_shape) -> Lowered:
    ctype = copy_type(node, y.dtype)
    kernel, work = elementwise_kernel(family, "a", [in_shape], [ctype], out_shape, ctype)
    return Lowered([KernelCall(kernel, [x.name, y.name], work if y.size else 0, node.name)])


# -- Cast, Expand, Tile -----------------------------------------------------------------------

def lower_cast(node, graph) -> Lowered:
    """Cast and CastLike: the output's dtype is the target (floats to ints truncate)."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y], float16=True)
    if np.dtype(x.dtype) == np.dtype(y.dtype):
        return affine_copy("Copy", node, x, y, dims_strides(x.shape))
    kernel, work = elementwise_kernel("Cast", "a", [x.shape], [x.dtype], y.shape, y.dtype,
                                      saturate=bool(node.attr("saturate", 1)), value_dtype=x.dtype,
                                      round_mode=str(node.attr("round_mode", "up")))
    return Lowered([KernelCall(kernel, [x.name, y.name], work if y.size else 0, node.name)])


def lower_expand(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    return _broadcast_copy("Expand", node, x, y, x.shape, y.shape)


def lower_tile(node, graph) -> Lowered:
    """Tile is a broadcast of x viewed as (1, d0, 1, d1, ...) to (r0, d0, r1, d1, ...)."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    repeats = [int(r) for r in const_input(node, graph, 1, "repeats").reshape(-1)]
    in_shape, out_shape = [], []
    for d, r in zip(x.shape, repeats):
        in_shape += [1, int(d)]
        out_shape += [r, int(d)]
    return _broadcast_copy("Tile", node, x, y, in_shape, out_shape)


# -- Slice ------------------------------------------------------------------------------------

def slice_params(node, graph, shape):
    """Per-dim (start, step) of a Slice, clamped as ONNX specifies."""
    rank = len(shape)
    if graph.opset < 10 or (len(node.inputs) < 2 and node.attr("starts") is not None):
        starts, ends = node.attr("starts"), node.attr("ends")
        axes, steps = node.attr("axes"), None
    else:
        starts = const_input(node, graph, 1, "starts")
        ends = const_input(node, graph, 2, "ends")
        axes = const_input(node, graph, 3, "axes")
        steps = const_input(node, graph, 4, "steps")
    starts = [int(s) for s in np.asarray(starts).reshape(-1)]
    ends = [int(e) for e in np.asarray(ends).reshape(-1)]
    axes = list(range(len(starts))) if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    steps = [1] * len(starts) if steps is None else [int(s) for s in np.asarray(steps).reshape(-1)]
    begin = [0] * rank
    step = [1] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = a + rank if a < 0 else a
        d = int(shape[a])
        if s < 0:
            s += d
        if st > 0:
            s = min(max(s, 0), d)
        else:
            s = min(max(s, -1), d - 1)
        begin[a], step[a] = s, st
    return begin, step


def lower_slice(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    begin, step = slice_params(node, graph, x.shape)
    strides = dims_strides(x.shape)
    base = sum(b * s for b, s in zip(begin, strides)) if y.size else 0
    return affine_copy("Slice", node, x, y, [st * s for st, s in zip(step, strides)], base)


# -- DepthToSpace / SpaceToDepth ---------------------------------------------------------------

def _permuted_view_copy(family, node, x, y, view_shape, perm) -> Lowered:
    """y = transpose(x viewed as view_shape, perm), read in y's order."""
    view_strides = dims_strides(view_shape)
    return affine_copy(family, node, x, y, [view_strides[p] for p in perm], out_shape=[view_shape[p] for p in perm])


def lower_depth_to_space(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    b = int(node.attr("blocksize"))
    n, c, h, w = (int(d) for d in x.shape)
    if str(node.attr("mode", "DCR")) == "CRD":
        view, perm = (n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3)
    else:
        view, perm = (n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2)
    return _permuted_view_copy("DepthToSpace", node, x, y, view, perm)


def lower_space_to_depth(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    b = int(node.attr("blocksize"))
    n, c, h, w = (int(d) for d in x.shape)
    perm = (0, 1, 3, 5, 2, 4) if str(node.attr("mode", "DCR")) == "CRD" else (0, 3, 5, 1, 2, 4)
    return _permuted_view_copy("SpaceToDepth", node, x, y, (n, c, h // b, b, w // b, b), perm)


# -- Pad ----------------------------------------------------------------------------------------

def lower_pad(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x], float16=True)
    rank = len(x.shape)
    mode = str(node.attr("mode", "constant"))
    value_pointer = None
    if graph.opset < 11:
        pads = [int(p) for p in node.attr("pads")]
        value = float(node.attr("value", 0.0))
    else:
        pads = [int(p) for p in const_input(node, graph, 1, "pads").reshape(-1)]
        value = 0
        if len(node.inputs) > 2 and node.inputs[2]:
            cv = graph.values[node.inputs[2]]
            if cv.is_const:
                value = np.asarray(cv.data).reshape(-1)[0] if cv.size else 0
            else:
                value_pointer = cv.name
        axes = const_input(node, graph, 3, "axes")
        if axes is not None:
            axes = [int(a) + rank if int(a) < 0 else int(a) for a in axes.reshape(-1)]
            full = [0] * (2 * rank)
            for k, a in enumerate(axes):
                full[a], full[rank + a] = pads[k], pads[len(axes) + k]
            pads = full
    if x.size == 0 and mode != "constant" and y.size:
        raise UnsupportedOpError(f"node '{node.name}' (Pad): mode '{mode}' of an empty input")
    ctype = copy_type(node, y.dtype)
    in_shape = [int(d) for d in x.shape]
    out_shape = [int(d) for d in y.shape]
    in_strides = dims_strides(in_shape)
    out_strides = dims_strides(out_shape)
    n_args = 3 if value_pointer else 2
    src = Source().line(kernel_header(n_args)).indent()
    out_p = f"p{n_args - 1}"
    src.line("cval = p1[0]" if value_pointer else f"cval = {_bits(value, y.dtype)}")
    names = [f"i{k}" for k in range(rank)]
    for k in range(rank):
        loop = "range(begin, end)" if k == 0 else f"range({out_shape[k]})"
        src.line(f"for i{k} in {loop}:").indent()
        d, before = in_shape[k], pads[k]
        src.line(f"s{k} = i{k} - {before}" if before else f"s{k} = i{k}")
        if mode == "edge":
            src.line(f"s{k} = 0 if s{k} < 0 else ({d - 1} if s{k} > {d - 1} else s{k})")
        elif mode == "wrap":
            src.line(f"s{k} = s{k} % {max(d, 1)}")
        elif mode == "reflect":
            if d == 1:
                src.line(f"s{k} = 0")
            else:
                period = 2 * (d - 1)
                src.line(f"s{k} = s{k} % {period}")
                src.line(f"s{k} = s{k} if s{k} < {d} else {period} - s{k}")
        elif mode == "constant":
            inside = f"s{k} >= 0 and s{k} < {d}"
            src.line(f"ok{k} = {inside}" if k == 0 else f"ok{k} = ok{k - 1} and {inside}")
        else:
            raise UnsupportedOpError(f"node '{node.name}' (Pad): mode '{mode}' is not supported")
    dst = " + ".join(f"{n}*{s}" if s != 1 else n for n, s in zip(names, out_strides)) or "0"
    read = " + ".join(f"s{k}*{s}" if s != 1 else f"s{k}" for k, s in enumerate(in_strides)) or "0"
    if mode == "constant":
        src.line(f"if ok{rank - 1}:").indent().line(f"{out_p}[{dst}] = p0[{read}]").dedent()
        src.line("else:").indent().line(f"{out_p}[{dst}] = cval").dedent()
    else:
        src.line(f"{out_p}[{dst}] = p0[{read}]")
    args = [x.name] + ([value_pointer] if value_pointer else []) + [y.name]
    kernel = Kernel(f"Pad_{mode}", src.text(), (ctype,) * n_args)
    work = out_shape[0] if y.size else 0
    return Lowered([KernelCall(kernel, args, work, node.name)])


# -- Split ----------------------------------------------------------------------------------------

def lower_split(node, graph) -> Lowered:
    """Every output is one contiguous run per outer row; one kernel writes them all."""
    x = graph.values[node.inputs[0]]
    outs = [graph.values[o] for o in node.outputs]
    rank = len(x.shape)
    axis = int(node.attr("axis", 0))
    axis = axis + rank if axis < 0 else axis
    outer = int(np.prod([int(d) for d in x.shape[:axis]], dtype=np.int64))
    inner = int(np.prod([int(d) for d in x.shape[axis + 1:]], dtype=np.int64))
    row = int(x.shape[axis]) * inner
    ctype = copy_type(node, x.dtype)
    src = Source().line(kernel_header(1 + len(outs))).indent()
    src.line("for r in range(begin, end):").indent()
    offset = 0
    for k, out in enumerate(outs):
        length = int(out.shape[axis]) * inner
        if length:
            src.line(f"for j in range({length}):").indent()
            src.line(f"p{k + 1}[r * {length} + j] = p0[r * {row} + {offset} + j]" if offset else
                     f"p{k + 1}[r * {length} + j] = p0[r * {row} + j]").dedent()
        offset += length
    src.line("pass")
    kernel = Kernel("Split", src.text(), (ctype,) * (1 + len(outs)))
    work = outer if x.size else 0
    return Lowered([KernelCall(kernel, [x.name] + [o.name for o in outs], work, node.name, n_outputs=len(outs))])


# -- Gather family ------------------------------------------------------------------------------

def _index(var: str, dim: int) -> list[str]:
    """Source lines normalising index `var` into [0, dim): negative wraps once, then clamped."""
    return [f"{var} = np.int64({var})",
            f"if {var} < 0:", f"    {var} += {dim}",
            f"if {var} < 0:", f"    {var} = 0",
            f"if {var} > {max(dim - 1, 0)}:", f"    {var} = {max(dim - 1, 0)}"]


def lower_gather(node, graph) -> Lowered:
    data, indices, y = (graph.values[n] for n in (node.inputs[0], node.inputs[1], node.outputs[0]))
    rank = len(data.shape)
    axis = int(node.attr("axis", 0))
    axis = axis + rank if axis < 0 else axis
    outer = int(np.prod([int(d) for d in data.shape[:axis]], dtype=np.int64))
    dim = int(data.shape[axis])
    inner = int(np.prod([int(d) for d in data.shape[axis + 1:]], dtype=np.int64))
    nidx = indices.size
    ctype = copy_type(node, data.dtype)
    src = Source().line(kernel_header(3)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"o = w // {nidx}").line(f"i = w % {nidx}")
    src.line("idx = p1[i]")
    for line in _index("idx", dim):
        src.line(line)
    src.line(f"s = (o * {dim} + idx) * {inner}")
    src.line(f"d = w * {inner}")
    src.line(f"for j in range({inner}):").indent().line("p2[d + j] = p0[s + j]")
    kernel = Kernel("Gather", src.text(), (ctype, np.dtype(indices.dtype).name, ctype))
    work = outer * nidx if y.size else 0
    return Lowered([KernelCall(kernel, [data.name, indices.name, y.name], work, node.name)])


def lower_gather_elements(node, graph) -> Lowered:
    data, indices, y = (graph.values[n] for n in (node.inputs[0], node.inputs[1], node.outputs[0]))
    rank = len(data.shape)
    axis = int(node.attr("axis", 0))
    axis = axis + rank if axis < 0 else axis
    ctype = copy_type(node, data.dtype)
    shape = [int(d) for d in indices.shape]
    data_strides = dims_strides(data.shape)
    along = data_strides[axis]
    data_strides = [0 if k == axis else s for k, s in enumerate(data_strides)]
    src = Source().line(kernel_header(3)).indent()
    idx_exprs, work = loop_nest(src, shape, [data_strides, dims_strides(shape)])
    src.line(f"idx = p1[{idx_exprs[1]}]")
    for line in _index("idx", int(data.shape[axis])):
        src.line(line)
    src.line(f"p2[{idx_exprs[1]}] = p0[{idx_exprs[0]} + idx * {along}]")
    kernel = Kernel("GatherElements", src.text(), (ctype, np.dtype(indices.dtype).name, ctype))
    return Lowered([KernelCall(kernel, [data.name, indices.name, y.name], work if y.size else 0, node.name)])


def lower_gather_nd(node, graph) -> Lowered:
    data, indices, y = (graph.values[n] for n in (node.inputs[0], node.inputs[1], node.outputs[0]))
    b = int(node.attr("batch_dims", 0))
    dshape = [int(d) for d in data.shape]
    ishape = [int(d) for d in indices.shape]
    m = ishape[-1]
    dstrides = dims_strides(dshape)
    per_batch_tuples = int(np.prod(ishape[b:-1], dtype=np.int64))
    batch_size = int(np.prod(dshape[b:], dtype=np.int64))
    chunk = int(np.prod(dshape[b + m:], dtype=np.int64))
    tuples = int(np.prod(ishape[:-1], dtype=np.int64))
    ctype = copy_type(node, data.dtype)
    src = Source().line(kernel_header(3)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"s = (w // {per_batch_tuples}) * {batch_size}" if b else "s = 0")
    for j in range(m):
        src.line(f"k{j} = p1[w * {m} + {j}]")
        for line in _index(f"k{j}", dshape[b + j]):
            src.line(line)
        src.line(f"s += k{j} * {dstrides[b + j]}")
    src.line(f"for j in range({chunk}):").indent().line(f"p2[w * {chunk} + j] = p0[s + j]")
    kernel = Kernel("GatherND", src.text(), (ctype, np.dtype(indices.dtype).name, ctype))
    return Lowered([KernelCall(kernel, [data.name, indices.name, y.name], tuples if y.size else 0, node.name)])


# -- Scatter family ---------------------------------------------------------------------------
# Updates may hit any element, several times, and must be applied in index order (a sum of
# floats rounds by its order, and with reduction "none" the last write wins). The work is
# split by *destination*: part w owns rows [lo, hi) of the output's first dim, copies them
# from data and applies, in index order, the updates that land in them. Every part reads all
# indices (cheap next to the updates' rows) but only its own updates, and no two parts write
# one element, so any thread count gives the serial result. One part per session thread.

_COMBINE = {"none": "u", "add": "o + u", "mul": "o * u", "max": "u if u > o else o", "min": "u if u < o else o"}

# Below this many bytes of updates one part does it all: each extra part rescans the indices.
_PARTITION_BYTES = 1 << 16


def _scatter_combine(node, dtype) -> str:
    reduction = str(node.attr("reduction", "none"))
    if reduction not in _COMBINE:
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): reduction '{reduction}' is not supported",
                                 hint=f"supported: {', '.join(_COMBINE)}")
    if reduction == "none":
        return "u"
    if np.dtype(dtype).kind == "b":
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): reduction '{reduction}' of bools is not supported")
    return _COMBINE[reduction]


def _scatter_parts(rows: int, updates) -> int:
    if rows <= 1 or updates.nbytes < _PARTITION_BYTES:
        return 1
    return max(1, min(session_threads(), rows))


def _splat(graph, updates) -> str | None:
    """A literal of the one value a constant `updates` holds everywhere (exporters scatter a
    ConstantOfShape of the lowest float to mark the touched elements), else None: the kernel
    then need not read, nor the library hold, a tensor of it."""
    if not updates.is_const or updates.size == 0 or is_narrow(updates.dtype) or np.dtype(updates.dtype).kind == "b":
        return None
    data = np.asarray(updates.data)
    first = data.reshape(-1)[0]
    if not np.all(data == first) or (data.dtype.kind == "f" and np.isnan(first)):
        return None
    return literal(first, data.dtype)


def _rows_of_part(src: Source, rows: int, parts: int, row_size: int):
    """Source setting lo, hi (part w's rows) and copying those rows of data (p0) to the output."""
    src.line(f"lo = w * {rows} // {parts}").line(f"hi = (w + 1) * {rows} // {parts}")
    src.line(f"for c in range(lo * {row_size}, hi * {row_size}):").indent().line("p_out[c] = p0[c]").dedent()


def _scatter_kernel(family, node, data, indices, y, splat, body, parts):
    """Wrap `body` (lines run for part w, with the output pointer called p_out) as a kernel."""
    pt = pointer_type(data.dtype)
    n_args = 3 if splat is not None else 4
    src = Source().line(kernel_header(n_args)).indent()
    src.line(f"p_out = p{n_args - 1}")
    src.line("for w in range(begin, end):").indent()
    body(src)
    types = (pt, np.dtype(indices.dtype).name) + (() if splat is not None else (pt,)) + (pt,)
    kernel = Kernel(family, with_helpers(src.text()), types, self_sized=parts > 1)
    args = [data.name, indices.name] + ([] if splat is not None else [node.inputs[2]]) + [y.name]
    return Lowered([KernelCall(kernel, args, parts if y.size else 0, node.name)])


def lower_scatter_elements(node, graph) -> Lowered:
    """ScatterElements (and opset 9-10 Scatter): y = data, then y[.., idx, ..] = update, in index order."""
    data, indices, updates = (graph.values[n] for n in node.inputs[:3])
    y = graph.values[node.outputs[0]]
    check_dtypes(node, [data], float16=True)
    rank = len(data.shape)
    axis = int(node.attr("axis", 0))
    axis = axis + rank if axis < 0 else axis
    combine = _scatter_combine(node, data.dtype)
    splat = _splat(graph, updates)
    shape = [int(d) for d in indices.shape]
    data_strides = dims_strides(data.shape)
    idx_strides = dims_strides(shape)
    rows = int(data.shape[0]) if rank else 1
    row_size = data.size // rows if rows else 0
    parts = _scatter_parts(rows, updates)

    def body(src):
        _rows_of_part(src, rows, parts, row_size)
        if not indices.size:
            return
        # Along axis 0 an update's row is its index: every part reads all of them. Along another
        # axis it is the update's own first coordinate: a part visits its rows alone.
        first = "lo, min(hi, {})".format(shape[0]) if axis != 0 else str(shape[0])
        src.line(f"for i0 in range({first}):").indent()
        for k, d in enumerate(shape[1:], 1):
            src.line(f"for i{k} in range({d}):").indent()
        flat = " + ".join(f"i{k} * {s}" for k, s in enumerate(idx_strides)) or "0"
        src.line(f"idx = p1[{flat}]")
        for line in _index("idx", int(data.shape[axis])):
            src.line(line)
        if axis == 0:
            src.line("if idx < lo or idx >= hi:").indent().line("continue").dedent()
        target = " + ".join(("idx" if k == axis else f"i{k}") + f" * {s}" for k, s in enumerate(data_strides))
        src.line(f"t = {target}")
        src.line(f"u = {splat if splat is not None else load('p2', flat, data.dtype)}")
        src.line(f"o = {load('p_out', 't', data.dtype)}")
        src.line(store("p_out", "t", combine, data.dtype))

    return _scatter_kernel("ScatterElements", node, data, indices, y, splat, body, parts)


def lower_scatter_nd(node, graph) -> Lowered:
    """ScatterND: y = data, then y[indices[q]] (a slice of `chunk` elements) combined with
    updates[q], for q in order."""
    data, indices, updates = (graph.values[n] for n in node.inputs[:3])
    y = graph.values[node.outputs[0]]
    check_dtypes(node, [data], float16=True)
    combine = _scatter_combine(node, data.dtype)
    splat = _splat(graph, updates)
    dshape = [int(d) for d in data.shape]
    ishape = [int(d) for d in indices.shape]
    m = ishape[-1]
    dstrides = dims_strides(dshape)
    chunk = int(np.prod(dshape[m:], dtype=np.int64))
    tuples = int(np.prod(ishape[:-1], dtype=np.int64))
    rows = dshape[0] if dshape else 1
    row_size = data.size // rows if rows else 0
    parts = _scatter_parts(rows, updates) if m else 1

    def body(src):
        _rows_of_part(src, rows, parts, row_size)
        src.line(f"for q in range({tuples}):").indent()
        src.line("s = 0")
        for j in range(m):
            src.line(f"k{j} = p1[q * {m} + {j}]")
            for line in _index(f"k{j}", dshape[j]):
                src.line(line)
            if j == 0:
                src.line("if k0 < lo or k0 >= hi:").indent().line("continue").dedent()
            src.line(f"s += k{j} * {dstrides[j]}")
        if m == 0:  # the whole tensor is one slice: part 0 owns it
            src.line("if lo != 0:").indent().line("continue").dedent()
        src.line(f"for j in range({chunk}):").indent()
        src.line(f"u = {splat if splat is not None else load('p2', f'q * {chunk} + j', data.dtype)}")
        src.line(f"o = {load('p_out', 's + j', data.dtype)}")
        src.line(store("p_out", "s + j", combine, data.dtype))

    return _scatter_kernel("ScatterND", node, data, indices, y, splat, body, parts)


def lower_tensor_scatter(node, graph) -> Lowered:
    """TensorScatter (opset 24; a KV cache update): y = past, then for each batch b the S rows of
    `update` along `axis` written at rows write_indices[b] + s of y (mode "linear"; "circular"
    wraps them modulo the axis length). One work item per outer row block (batch x heads).

    When y is past's own buffer (a generation library binds one buffer to both) nothing is
    copied: only the S new rows are written. A write index is clamped to [0, L - S] ("linear")
    so that a wrong one cannot write outside the cache."""
    past, update = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    indices = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else ""
    y = graph.values[node.outputs[0]]
    shape = [int(d) for d in past.shape]
    rank = len(shape)
    axis = int(node.attr("axis", -2))
    axis = axis + rank if axis < 0 else axis
    mode = node.attr("mode", "linear")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if rank < 2 or not 1 <= axis < rank or mode not in ("linear", "circular"):
        raise UnsupportedOpError(f"node '{node.name}' (TensorScatter): axis {node.attr('axis', -2)} of a rank-{rank} "
                                 f"cache, mode {mode!r}", hint="the axis is not the batch axis; mode linear or circular")
    L, S = shape[axis], int(update.shape[axis])
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    per_batch = outer // shape[0] if shape[0] else 1
    ctype = copy_type(node, past.dtype)
    src = Source().line(kernel_header(4 if indices else 3)).indent()
    out = "p3" if indices else "p2"
    src.line("for o in range(begin, end):").indent()
    if indices:
        src.line(f"start = np.int64(p2[o // {per_batch}])")
        if mode == "linear":
            src.line(f"if start > {L - S}:").indent().line(f"start = {L - S}").dedent()
            src.line("if start < 0:").indent().line("start = 0").dedent()
        else:
            src.line(f"start = start % {L}")
    else:
        src.line("start = 0")
    src.line(f"base = o * {L * inner}")
    src.line(f"if not same_buffer(p0, {out}):").indent()
    src.line(f"for t in range({L * inner}):").indent().line(f"{out}[base + t] = p0[base + t]").dedent().dedent()
    src.line(f"for s in range({S}):").indent()
    row = "start + s" if mode == "linear" else f"(start + s) % {L}"
    src.line(f"dst = base + ({row}) * {inner}").line(f"sr = (o * {S} + s) * {inner}")
    src.line(f"for t in range({inner}):").indent().line(f"{out}[dst + t] = p1[sr + t]").dedent()
    types = (ctype, ctype) + (("int64",) if indices else ()) + (ctype,)
    if indices and np.dtype(graph.values[indices].dtype) != np.int64:
        raise UnsupportedOpError(f"node '{node.name}' (TensorScatter): write_indices must be int64")
    kernel = Kernel("TensorScatter", src.text(), types)
    args = [past.name, update.name] + ([indices] if indices else []) + [y.name]
    return Lowered([KernelCall(kernel, args, outer if y.size else 0, node.name)])


# -- Trilu, EyeLike, OneHot ---------------------------------------------------------------------

def lower_trilu(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    k_data = const_input(node, graph, 1, "k")
    k = int(k_data.reshape(-1)[0]) if k_data is not None else 0
    upper = bool(node.attr("upper", 1))
    shape = [int(d) for d in x.shape]
    n, m = shape[-2], shape[-1]
    batch = int(np.prod(shape[:-2], dtype=np.int64))
    ctype = copy_type(node, x.dtype)
    keep = f"j - i >= {k}" if upper else f"j - i <= {k}"
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"i = w % {n}")
    src.line(f"for j in range({m}):").indent()
    src.line(f"p1[w * {m} + j] = p0[w * {m} + j] if {keep} else {literal(0, ctype)}")
    kernel = Kernel("Trilu", src.text(), (ctype, ctype))
    return Lowered([KernelCall(kernel, [x.name, y.name], batch * n if y.size else 0, node.name)])


def lower_eye_like(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    n, m = (int(d) for d in y.shape)
    k = int(node.attr("k", 0))
    ctype = copy_type(node, y.dtype)
    src = Source().line(kernel_header(2)).indent()
    src.line("for i in range(begin, end):").indent()
    src.line(f"for j in range({m}):").indent()
    src.line(f"p1[i * {m} + j] = {_bits(1, y.dtype)} if j - i == {k} else {literal(0, ctype)}")
    kernel = Kernel("EyeLike", src.text(), (copy_type(node, x.dtype), ctype))
    return Lowered([KernelCall(kernel, [x.name, y.name], n if y.size else 0, node.name)])


def lower_one_hot(node, graph) -> Lowered:
    indices, values, y = graph.values[node.inputs[0]], graph.values[node.inputs[2]], graph.values[node.outputs[0]]
    depth = int(np.asarray(const_input(node, graph, 1, "depth")).reshape(-1)[0])
    rank = len(y.shape)
    axis = int(node.attr("axis", -1))
    axis = axis + rank if axis < 0 else axis
    outer = int(np.prod([int(d) for d in y.shape[:axis]], dtype=np.int64))
    inner = int(np.prod([int(d) for d in y.shape[axis + 1:]], dtype=np.int64))
    ctype = copy_type(node, y.dtype)
    src = Source().line(kernel_header(3)).indent()
    src.line("off = p1[0]").line("on = p1[1]")
    src.line("for o in range(begin, end):").indent()
    src.line(f"for j in range({inner}):").indent()
    src.line(f"idx = np.int64(p0[o * {inner} + j])")
    src.line(f"if idx < 0:").indent().line(f"idx += {depth}").dedent()
    src.line(f"for d in range({depth}):").indent()
    src.line(f"p2[(o * {depth} + d) * {inner} + j] = on if d == idx else off")
    kernel = Kernel("OneHot", src.text(), (np.dtype(indices.dtype).name, ctype, ctype))
    return Lowered([KernelCall(kernel, [indices.name, values.name, y.name], outer if y.size else 0, node.name)])


# -- Einsum ---------------------------------------------------------------------------------------

def _parse_einsum(equation: str, ranks: list[int]):
    """Operand subscripts and output subscripts, '...' expanded to capital letters."""
    equation = equation.replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    ell_rank = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    ell = string.ascii_uppercase[:ell_rank]
    expanded = []
    for t, r in zip(terms, ranks):
        if "..." in t:
            n = r - len(t.replace("...", ""))
            t = t.replace("...", ell[ell_rank - n:])
        expanded.append(t)
    if "->" in equation:
        out = rhs.replace("...", ell)
    else:
        counts = {}
        for t in expanded:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = ell + "".join(sorted(c for c in counts if counts[c] == 1 and c not in ell))
    return expanded, out


def lower_einsum(node, graph) -> Lowered:
    ins = [graph.values[n] for n in node.inputs]
    y = graph.values[node.outputs[0]]
    check_dtypes(node, ins + [y], float16=True)
    terms, out = _parse_einsum(str(node.attr("equation")), [len(v.shape) for v in ins])
    sizes = {}
    for t, v in zip(terms, ins):
        for c, d in zip(t, v.shape):
            sizes[c] = max(sizes.get(c, 1), int(d))
    summed = [c for c in dict.fromkeys("".join(terms)) if c not in out]
    loop_vars = {c: f"x_{c}" for c in sizes}
    src = Source().line(kernel_header(len(ins) + 1)).indent()
    ct = compute_type(y.dtype)
    out_strides = dims_strides([sizes[c] for c in out])
    if out:
        src.line(f"for {loop_vars[out[0]]} in range(begin, end):").indent()
        for c in out[1:]:
            src.line(f"for {loop_vars[c]} in range({sizes[c]}):").indent()
    else:
        src.line("for _w in range(begin, end):").indent()
    src.line(f"acc = {literal(0, ct)}")
    depth = src.depth
    for c in summed:
        src.line(f"for {loop_vars[c]} in range({sizes[c]}):").indent()
    factors = []
    for k, (t, v) in enumerate(zip(terms, ins)):
        strides = dims_strides(v.shape)
        # a letter repeated within one operand (a diagonal) uses the sum of its strides
        per_letter = {}
        for c, s, d in zip(t, strides, v.shape):
            per_letter[c] = per_letter.get(c, 0) + (0 if int(d) == 1 and sizes[c] != 1 else s)
        idx = " + ".join(f"{loop_vars[c]} * {s}" for c, s in per_letter.items() if s) or "0"
        factors.append(load(f"p{k}", idx, v.dtype))
    src.line(f"acc += {' * '.join(factors)}")
    src.depth = depth
    dst = " + ".join(f"{loop_vars[c]} * {s}" for c, s in zip(out, out_strides)) or "0"
    src.line(store(f"p{len(ins)}", dst, "acc", y.dtype))
    work = sizes[out[0]] if out else 1
    kernel = Kernel("Einsum", with_helpers(src.text()), tuple(pointer_type(v.dtype) for v in ins + [y]))
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [y.name], work if y.size else 0, node.name)])


# -- Dropout --------------------------------------------------------------------------------------

def lower_dropout(node, graph) -> Lowered:
    """Inference Dropout: the output is the input (a view) and the optional mask
    is all true. Training mode with a non-zero ratio draws its mask (rng.py)."""
    from .kernel import View
    from .rng import dropout_ratio, lower_training_dropout
    ratio = dropout_ratio(node, graph)
    if ratio is not None:
        return lower_training_dropout(node, graph, ratio)
    calls = [View(node.inputs[0], node.outputs[0], node.name)]
    if len(node.outputs) > 1 and node.outputs[1]:
        mask = graph.values[node.outputs[1]]
        src = Source().line(kernel_header(1)).indent()
        src.line("for i in range(begin, end):").indent().line("p0[i] = np.uint8(1)")
        calls.append(KernelCall(Kernel("DropoutMask", src.text(), ("uint8",)), [mask.name], mask.size, node.name))
    return Lowered(calls)


# -- ReverseSequence -------------------------------------------------------------------------------

def lower_reverse_sequence(node, graph) -> Lowered:
    """y[b, t] = x[b, lens[b] - 1 - t] for t < lens[b], else x[b, t] (batch and
    time are axes 0/1 in either order; the lengths are read at run time)."""
    x, lens, y = graph.values[node.inputs[0]], graph.values[node.inputs[1]], graph.values[node.outputs[0]]
    batch_axis, time_axis = int(node.attr("batch_axis", 1)), int(node.attr("time_axis", 0))
    shape = [int(d) for d in x.shape]
    strides = dims_strides(shape)
    inner = int(np.prod(shape[2:], dtype=np.int64))
    n_batch, n_time = shape[batch_axis], shape[time_axis]
    sb, st = strides[batch_axis], strides[time_axis]
    ctype = copy_type(node, x.dtype)
    src = Source().line(kernel_header(3)).indent()
    src.line("for b in range(begin, end):").indent()
    src.line("n = np.int64(p1[b])")
    src.line(f"n = 0 if n < 0 else ({n_time} if n > {n_time} else n)")
    src.line(f"for t in range({n_time}):").indent()
    src.line("s = n - 1 - t if t < n else t")
    src.line(f"for j in range({inner}):").indent()
    src.line(f"p2[b * {sb} + t * {st} + j] = p0[b * {sb} + s * {st} + j]")
    kernel = Kernel("ReverseSequence", src.text(), (ctype, np.dtype(lens.dtype).name, ctype))
    return Lowered([KernelCall(kernel, [x.name, lens.name, y.name], n_batch if y.size else 0, node.name)])
