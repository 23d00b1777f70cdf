"""Kernels of ops whose output shapes depend on the data: NonZero, Unique, NonMaxSuppression, Compress.

Each output of data-dependent shape has a buffer of its upper-bound shape (frontends/data_dependent.py)
and a dims value, the node's extra output, that the kernel fills with the actual shape; the kernel
writes the tensor C-contiguously at the start of the buffer. One work item: the kernels count
before they write, so they run serially.
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .elementwise import check_dtypes, load, pointer_type
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header
from .narrow import with_helpers
from .scratch import scratch_value
from .transpose import copy_type


def _dims_of(node, graph, out_pos):
    """The dims value of output `out_pos` (None when its shape is static)."""
    name = node.outputs[out_pos] if out_pos < len(node.outputs) else ""
    return graph.values[name].shape_from if name else None


class _Args:
    """A kernel's pointer arguments as they are added: value names and numpy pointer types."""

    def __init__(self):
        self.names, self.types = [], []

    def add(self, name, ptype) -> str:
        self.names.append(name)
        self.types.append(ptype)
        return f"p{len(self.names) - 1}"


def _outer_m_inner(shape, axis):
    shape = [int(d) for d in shape]
    if axis is None:
        return 1, int(np.prod(shape, dtype=np.int64)), 1
    return (int(np.prod(shape[:axis], dtype=np.int64)), shape[axis], int(np.prod(shape[axis + 1:], dtype=np.int64)))


def _axis(node, rank):
    axis = node.attr("axis")
    return None if axis is None else int(axis) % rank


# -- NonZero ------------------------------------------------------------------------------------

def lower_nonzero(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x], float16=True)
    dims = _dims_of(node, graph, 0)
    shape = [int(d) for d in x.shape]
    n, rank = x.size, len(shape)
    args = _Args()
    px = args.add(x.name, pointer_type(x.dtype))
    py = args.add(y.name, "int64")
    pd = args.add(dims, "int64")
    test = load(px, "i", x.dtype) if np.dtype(x.dtype).kind == "b" else f"{load(px, 'i', x.dtype)} != 0"
    src = Source().line(kernel_header(3)).indent()
    src.line("cnt = 0")
    src.line(f"for i in range({n}):").indent()
    src.line(f"if {test}:").indent().line("cnt += 1").dedent().dedent()
    src.line("t = 0")
    src.line(f"for i in range({n}):").indent()
    src.line(f"if {test}:").indent()
    src.line("r = i")
    for d in reversed(range(rank)):
        src.line(f"{py}[{d} * cnt + t] = r % {shape[d]}").line(f"r = r // {shape[d]}")
    src.line("t += 1").dedent().dedent()
    src.line(f"{pd}[0] = {rank}").line(f"{pd}[1] = cnt")
    kernel = Kernel("NonZero", with_helpers(src.text()), tuple(args.types))
    return Lowered([KernelCall(kernel, args.names, 1, node.name, n_outputs=2)])


# -- Compress -----------------------------------------------------------------------------------

def lower_compress(node, graph) -> Lowered:
    x, cond, y = (graph.values[n] for n in (node.inputs[0], node.inputs[1], node.outputs[0]))
    dims = _dims_of(node, graph, 0)
    axis = _axis(node, len(x.shape))
    outer, m, inner = _outer_m_inner(x.shape, axis)
    length = min(m, cond.size)
    args = _Args()
    px = args.add(x.name, copy_type(node, x.dtype))
    pc = args.add(cond.name, pointer_type(cond.dtype))
    py = args.add(y.name, copy_type(node, x.dtype))
    pd = args.add(dims, "int64") if dims else None
    src = Source().line(kernel_header(len(args.names))).indent()
    src.line("cnt = 0")
    src.line(f"for k in range({length}):").indent()
    src.line(f"if {load(pc, 'k', cond.dtype)}:").indent().line("cnt += 1").dedent().dedent()
    src.line("t = 0")
    src.line(f"for k in range({length}):").indent()
    src.line(f"if {load(pc, 'k', cond.dtype)}:").indent()
    src.line(f"for o in range({outer}):").indent()
    src.line(f"for j in range({inner}):").indent()
    src.line(f"{py}[(o * cnt + t) * {inner} + j] = {px}[(o * {m} + k) * {inner} + j]").dedent().dedent()
    src.line("t += 1").dedent().dedent()
    if pd:
        for d, size in enumerate(x.shape if axis is not None else (0,)):
            src.line(f"{pd}[{d}] = " + ("cnt" if axis is None or d == axis else f"{int(size)}"))
    kernel = Kernel("Compress", src.text(), tuple(args.types))
    return Lowered([KernelCall(kernel, args.names, 1, node.name, n_outputs=len(args.names) - 2)])


# -- Unique -------------------------------------------------------------------------------------

def _compare(src, px, dtype, outer, m, inner, a, b):
    """Source setting `c` to -1, 0 or 1 as item `a` is before, equal to or after item `b`
    (items are the slices along the axis, compared lexicographically)."""
    src.line("c = 0")
    src.line(f"for co in range({outer}):").indent()
    src.line(f"for cj in range({inner}):").indent()
    src.line(f"va = {load(px, f'(co * {m} + {a}) * {inner} + cj', dtype)}")
    src.line(f"vb = {load(px, f'(co * {m} + {b}) * {inner} + cj', dtype)}")
    src.line("if va < vb:").indent().line("c = -1").line("break").dedent()
    src.line("if va > vb:").indent().line("c = 1").line("break").dedent()
    src.dedent()
    src.line("if c != 0:").indent().line("break").dedent()
    src.dedent()


def lower_unique(node, graph) -> Lowered:
    """A stable merge sort of the items (slices along `axis`, or the elements), then one pass over
    the sorted order: runs of equal items are the unique values, each run's first item (the
    lowest index: the sort is stable) its index. sorted=0 renumbers them by first occurrence."""
    x = graph.values[node.inputs[0]]
    check_dtypes(node, [x], float16=True)
    if np.dtype(x.dtype).kind == "b":
        raise UnsupportedOpError(f"node '{node.name}' (Unique): bool input is not supported")
    axis = _axis(node, len(x.shape))
    outer, m, inner = _outer_m_inner(x.shape, axis)
    is_sorted = bool(node.attr("sorted", 1))
    outs = list(node.outputs[:4]) + [""] * (4 - len(node.outputs[:4]))
    scratch = scratch_value(graph, node, (5 * max(m, 1),), np.int64)
    # omitted optional outputs still get written: into scratch buffers of their size
    buffers = []
    for k, name in enumerate(outs):
        if name:
            buffers.append(name)
        elif k == 0:
            buffers.append(scratch_value(graph, node, x.shape, x.dtype, tag="unique0"))
        else:
            buffers.append(scratch_value(graph, node, (m,), np.int64, tag=f"unique{k}"))
    dims = [_dims_of(node, graph, k) if outs[k] else None for k in range(4)]
    args = _Args()
    px = args.add(x.name, pointer_type(x.dtype))
    py = args.add(buffers[0], pointer_type(x.dtype))
    first, inverse, counts = (args.add(b, "int64") for b in buffers[1:])
    s = args.add(scratch, "int64")
    dim_ptrs = [args.add(d, "int64") if d else None for d in dims]
    raw_x = "rx"
    src = Source().line(kernel_header(len(args.names))).indent()
    # the copy reads x's raw bits (a narrow dtype is compared widened, copied as it is)
    src.line(f"{raw_x} = {px}")
    src.line(f"for i in range({m}):").indent().line(f"{s}[i] = i").dedent()
    src.line("src = 0").line(f"dst = {m}").line("width = 1")
    src.line(f"while width < {m}:").indent()
    src.line("lo = 0")
    src.line(f"while lo < {m}:").indent()
    src.line(f"mid = min(lo + width, {m})").line(f"hi = min(lo + 2 * width, {m})")
    src.line("i = lo").line("j = mid").line("k = lo")
    src.line("while k < hi:").indent()
    src.line("left = i < mid")
    src.line("if left and j < hi:").indent()
    src.line(f"a = {s}[src + i]").line(f"b = {s}[src + j]")
    _compare(src, px, x.dtype, outer, m, inner, "a", "b")
    src.line("left = c <= 0").dedent()
    src.line("if left:").indent().line(f"{s}[dst + k] = {s}[src + i]").line("i += 1").dedent()
    src.line("else:").indent().line(f"{s}[dst + k] = {s}[src + j]").line("j += 1").dedent()
    src.line("k += 1").dedent()
    src.line("lo += 2 * width").dedent()
    src.line("tmp = src").line("src = dst").line("dst = tmp").line("width *= 2").dedent()
    # runs of equal items: group ids (by original item) at s[2m:3m]
    src.line("u = 0")
    src.line(f"for r in range({m}):").indent()
    src.line(f"k = {s}[src + r]")
    src.line("new = r == 0")
    src.line("if r > 0:").indent()
    src.line(f"a = {s}[src + r - 1]")
    _compare(src, px, x.dtype, outer, m, inner, "a", "k")
    src.line("new = c != 0").dedent()
    src.line("if new:").indent().line(f"{first}[u] = k").line(f"{counts}[u] = 0").line("u += 1").dedent()
    src.line(f"{s}[{2 * m} + k] = u - 1")
    src.line(f"{counts}[u - 1] += 1").dedent()
    if is_sorted:
        src.line(f"for i in range({m}):").indent().line(f"{inverse}[i] = {s}[{2 * m} + i]").dedent()
    else:
        # renumber the groups by first occurrence: new id of group g at s[3m + g]
        src.line("nxt = 0")
        src.line(f"for i in range({m}):").indent()
        src.line(f"g = {s}[{2 * m} + i]")
        src.line(f"if {first}[g] == i:").indent().line(f"{s}[{3 * m} + g] = nxt").line("nxt += 1").dedent()
        src.line(f"{inverse}[i] = {s}[{3 * m} + g]").dedent()
        src.line("for g in range(u):").indent()
        src.line(f"ng = {s}[{3 * m} + g]")
        src.line(f"{s}[ng] = {first}[g]")
        src.line(f"{s}[{m} + ng] = {counts}[g]").dedent()
        src.line("for g in range(u):").indent()
        src.line(f"{first}[g] = {s}[g]").line(f"{counts}[g] = {s}[{m} + g]").dedent()
    src.line("for t in range(u):").indent()
    src.line(f"k = {first}[t]")
    src.line(f"for o in range({outer}):").indent()
    src.line(f"for j in range({inner}):").indent()
    src.line(f"{py}[(o * u + t) * {inner} + j] = {raw_x}[(o * {m} + k) * {inner} + j]").dedent().dedent().dedent()
    if dim_ptrs[0]:
        for d, size in enumerate(x.shape if axis is not None else (0,)):
            src.line(f"{dim_ptrs[0]}[{d}] = " + ("u" if axis is None or d == axis else f"{int(size)}"))
    for k in (1, 3):
        if dim_ptrs[k]:
            src.line(f"{dim_ptrs[k]}[0] = u")
    kernel = Kernel("Unique", with_helpers(src.text()), tuple(args.types))
    return Lowered([KernelCall(kernel, args.names, 1, node.name, n_outputs=len(args.names) - 1)])


# -- NonMaxSuppression --------------------------------------------------------------------------

def lower_non_max_suppression(node, graph) -> Lowered:
    """onnxruntime's selection: per batch and class, candidates above score_threshold taken in
    order of score (ties: the lower box index first); one is kept unless its IoU with a box
    already kept for the class is above iou_threshold; at most max_output_boxes_per_class."""
    boxes, scores = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    y = graph.values[node.outputs[0]]
    dims = _dims_of(node, graph, 0)
    check_dtypes(node, [boxes, scores])
    if np.dtype(boxes.dtype) != np.float32 or np.dtype(scores.dtype) != np.float32:
        raise UnsupportedOpError(f"node '{node.name}' (NonMaxSuppression): boxes and scores must be float32")
    nb, nbox, nc = int(boxes.shape[0]), int(boxes.shape[1]), int(scores.shape[1])
    center = int(node.attr("center_point_box", 0))
    optional = [node.inputs[k] if len(node.inputs) > k and node.inputs[k] else None for k in (2, 3, 4)]
    args = _Args()
    pb = args.add(boxes.name, "float32")
    ps = args.add(scores.name, "float32")
    p_limit = args.add(optional[0], pointer_type(graph.values[optional[0]].dtype)) if optional[0] else None
    p_iou = args.add(optional[1], "float32") if optional[1] else None
    p_score = args.add(optional[2], "float32") if optional[2] else None
    taken = scratch_value(graph, node, (max(nbox, 1),), np.int64)
    py = args.add(y.name, "int64")
    pt = args.add(taken, "int64")
    pd = args.add(dims, "int64")
    src = Source().line(kernel_header(len(args.names))).indent()
    src.line(f"limit = np.int64({p_limit}[0])" if p_limit else "limit = np.int64(0)")
    src.line(f"limit = min(limit, {nbox})")
    src.line(f"iou_t = {p_iou}[0]" if p_iou else "iou_t = np.float32(0.0)")
    src.line("cnt = 0")
    src.line(f"for b in range({nb}):").indent()
    src.line(f"for cl in range({nc}):").indent()
    src.line(f"sbase = (b * {nc} + cl) * {nbox}")
    src.line(f"for i in range({nbox}):").indent()
    cond = f"{ps}[sbase + i] > {p_score}[0]" if p_score else "True"
    src.line(f"{pt}[i] = 0 if {cond} else 1").dedent()
    src.line("kept = 0").line("start = cnt")
    src.line("while kept < limit:").indent()
    src.line("best = -1").line("bs = np.float32(0.0)")
    src.line(f"for i in range({nbox}):").indent()
    src.line(f"if {pt}[i] == 0 and (best < 0 or {ps}[sbase + i] > bs):").indent()
    src.line("best = i").line(f"bs = {ps}[sbase + i]").dedent().dedent()
    src.line("if best < 0:").indent().line("break").dedent()
    src.line(f"{pt}[best] = 1")
    src.line("keep = True")
    src.line("for q in range(start, cnt):").indent()
    src.line(f"other = {py}[q * 3 + 2]")
    for tag, idx in (("a", "best"), ("b", "other")):
        base = f"(b * {nbox} + {idx}) * 4"
        if center:
            src.line(f"{tag}x1 = {pb}[{base}] - {pb}[{base} + 2] / 2").line(f"{tag}x2 = {pb}[{base}] + {pb}[{base} + 2] / 2")
            src.line(f"{tag}y1 = {pb}[{base} + 1] - {pb}[{base} + 3] / 2")
            src.line(f"{tag}y2 = {pb}[{base} + 1] + {pb}[{base} + 3] / 2")
        else:
            src.line(f"{tag}y1 = min({pb}[{base}], {pb}[{base} + 2])").line(f"{tag}y2 = max({pb}[{base}], {pb}[{base} + 2])")
            src.line(f"{tag}x1 = min({pb}[{base} + 1], {pb}[{base} + 3])")
            src.line(f"{tag}x2 = max({pb}[{base} + 1], {pb}[{base} + 3])")
    src.line("iw = min(ax2, bx2) - max(ax1, bx1)").line("ih = min(ay2, by2) - max(ay1, by1)")
    src.line("area_a = (ax2 - ax1) * (ay2 - ay1)").line("area_b = (bx2 - bx1) * (by2 - by1)")
    src.line("if iw > 0 and ih > 0 and area_a > 0 and area_b > 0:").indent()
    src.line("inter = iw * ih")
    src.line("union = area_a + area_b - inter")
    src.line("if union > 0 and inter / union > iou_t:").indent().line("keep = False").line("break")
    src.dedent().dedent().dedent()
    src.line("if keep:").indent()
    src.line(f"{py}[cnt * 3] = b").line(f"{py}[cnt * 3 + 1] = cl").line(f"{py}[cnt * 3 + 2] = best")
    src.line("cnt += 1").line("kept += 1").dedent()
    src.dedent().dedent().dedent()
    src.line(f"{pd}[0] = cnt").line(f"{pd}[1] = 3")
    kernel = Kernel("NonMaxSuppression", src.text(), tuple(args.types))
    return Lowered([KernelCall(kernel, args.names, 1, node.name, n_outputs=3)])
