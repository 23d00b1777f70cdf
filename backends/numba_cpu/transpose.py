"""Transpose: out[i_0, ..., i_{r-1}] = in[...] with out dim j = in dim perm[j].

Input dims that stay adjacent and in order in the output are merged, and
size-1 dims dropped, so e.g. NCHW -> NHWC is a 3-D (N, HW, C) <- (N, C, HW)
transpose. One loop nest walks the output in order, the innermost loop over
its last dim (unit stride in the output). The kernel only moves bytes, so
its pointers are unsigned integers of the element size: every dtype of the
same width shares one kernel.

A float32 plane transpose, (M, A, B) -> (M, B, A) with A, B >= 16 (NCHW <->
NHWC), moves 16 x 16 blocks with vector loads, lane shuffles and vector stores
(ukernel.TBlockSpec) instead: ConvNeXt's 48 x 56 x 56 NHWC -> NCHW one-node
0.099 -> 0.023 ms CPU time per call (onnxruntime 0.039), NCHW -> NHWC 0.039 ->
0.020 (0.030).
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .narrow import is_narrow  # float16, bfloat16, float8, int4...: bytes like any other
from .kernel import Kernel, KernelCall, Lowered, Source, dims_strides, index_expr, kernel_header
from .ukernel import TBLOCK, TBlockSpec

# When the outermost output dim is this small, the work range runs over the
# two outermost dims together so threads still get a share each.
_SMALL_OUTER = 64


def copy_type(node, dtype) -> str:
    """The unsigned integer type of dtype's width: pure data movement needs no more."""
    dtype = np.dtype(dtype)
    names = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
    if (dtype.kind not in "biuf" and not is_narrow(dtype)) or dtype.itemsize not in names:
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): dtype {dtype} is not supported")
    return names[dtype.itemsize]


def collapse_transpose(in_shape, perm) -> tuple[list[int], list[int]]:
    """(input dims, perm) with size-1 dims dropped and runs of input dims that
    stay consecutive in the output merged into one."""
    keep = [d for d in range(len(in_shape)) if in_shape[d] != 1]
    renumber = {d: k for k, d in enumerate(keep)}
    dims = [int(in_shape[d]) for d in keep]
    perm = [renumber[p] for p in perm if p in renumber]
    # Group the output order into runs p, p+1, ..., each becoming one dim.
    runs = []
    for p in perm:
        if runs and runs[-1][-1] + 1 == p:
            runs[-1].append(p)
        else:
            runs.append([p])
    order = sorted(range(len(runs)), key=lambda r: runs[r][0])  # the runs in input order
    merged_dims = [int(np.prod([dims[p] for p in runs[r]])) for r in order]
    position = {r: k for k, r in enumerate(order)}
    return merged_dims, [position[r] for r in range(len(runs))]


def lower_transpose(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    rank = len(x.shape)
    perm = [int(p) for p in node.attr("perm", list(range(rank))[::-1])]
    perm = [p + rank if p < 0 else p for p in perm]
    ctype = copy_type(node, x.dtype)
    dims, perm = collapse_transpose(x.shape, perm)
    if not dims:
        dims, perm = [1], [0]
    if swaps_last_two(perm) and np.dtype(x.dtype) == np.float32 and min(dims[-2:]) >= TBLOCK:
        return lower_plane_transpose(node, dims)
    out_dims = [dims[p] for p in perm]
    in_strides = dims_strides(dims)
    src_strides = [in_strides[p] for p in perm]  # input stride of each output dim
    dst_strides = dims_strides(out_dims)

    src = Source().line(kernel_header(2)).indent()
    names = [f"i{k}" for k in range(len(out_dims))]
    fuse = len(out_dims) >= 3 and out_dims[0] < _SMALL_OUTER
    if fuse:
        work = out_dims[0] * out_dims[1]
        src.line("for w in range(begin, end):").indent()
        src.line(f"i0 = w // {out_dims[1]}")
        src.line(f"i1 = w % {out_dims[1]}")
        first_inner = 2
    else:
        work = out_dims[0]
        src.line("for i0 in range(begin, end):").indent()
        first_inner = 1
    for k in range(first_inner, len(out_dims)):
        src.line(f"for {names[k]} in range({out_dims[k]}):").indent()
    src.line(f"p1[{index_expr(names, dst_strides)}] = p0[{index_expr(names, src_strides)}]")
    if y.size == 0:
        work = 0
    kernel = Kernel("Transpose", src.text(), (ctype, ctype))
    return Lowered([KernelCall(kernel, [x.name, y.name], work, node.name)])


def swaps_last_two(perm) -> bool:
    """Whether a collapsed perm keeps its leading dims and swaps the last two (NCHW <-> NHWC)."""
    r = len(perm)
    return r >= 2 and list(perm) == list(range(r - 2)) + [r - 1, r - 2]


def lower_plane_transpose(node, dims) -> Lowered:
    """(M, A, B) -> (M, B, A), float32, A and B >= 16: 16 x 16 blocks by the shuffle micro-kernel
    (TBlockSpec), the rows and columns past the last whole block by a scalar loop. A work item is
    (m, 16 consecutive output rows b): it reads 16 input columns over all A rows and writes 16
    whole output rows."""
    M, A, B = int(np.prod(dims[:-2], dtype=np.int64)), int(dims[-2]), int(dims[-1])
    blocks_b = -(-B // TBLOCK)
    full_a = A - A % TBLOCK
    src = Source()
    for line in TBlockSpec().declaration("tblock").splitlines():
        src.line(line)
    src.line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"m = item // {blocks_b}").line(f"b0 = (item % {blocks_b}) * {TBLOCK}")
    src.line(f"base = m * {A * B}")
    src.line(f"if b0 + {TBLOCK} <= {B}:").indent()
    src.line(f"for a0 in range(0, {full_a}, {TBLOCK}):").indent()
    src.line(f"tblock(p0, base + a0 * {B} + b0, {B}, p1, base + b0 * {A} + a0, {A})").dedent()
    if full_a < A:
        src.line(f"for b in range(b0, b0 + {TBLOCK}):").indent()
        src.line(f"for a in range({full_a}, {A}):").indent()
        src.line(f"p1[base + b * {A} + a] = p0[base + a * {B} + b]").dedent().dedent()
    src.dedent().line("else:").indent()
    src.line(f"for b in range(b0, {B}):").indent()
    src.line(f"for a in range({A}):").indent()
    src.line(f"p1[base + b * {A} + a] = p0[base + a * {B} + b]").dedent().dedent().dedent()
    kernel = Kernel("Transpose", src.text(), ("float32", "float32"))
    return Lowered([KernelCall(kernel, [node.inputs[0], node.outputs[0]], M * blocks_b, node.name)])
