"""Softmax, numerically stable: y = exp(x - max) / sum(exp(x - max)).

The input is viewed as outer x n x inner, softmax running over n:
- opset >= 13: n is the `axis` dim (default -1);
- opset < 13: the input is coerced to 2-D at `axis` (default 1), so n is the
  product of the dims from axis on and inner is 1.

inner == 1 (the common case): one row per work item, three unit-stride passes.
inner > 1 (e.g. over the channels of N x C x H x W): the work items are
(outer, column block) pairs and every pass runs over a row of the block, so
it stays unit-stride. With no scratch memory the output holds the running
max in its last row, then the exponentials; the per-column sums are then a
column walk over the block, which is in cache.
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .elementwise import check_dtypes, pointer_type
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, literal

# Columns per work item when softmax runs over a non-innermost axis.
_COLUMNS = 256


def softmax_layout(shape, axis: int, opset: int) -> tuple[int, int, int]:
    """(outer, n, inner) of a Softmax over `shape`."""
    rank = len(shape)
    if rank == 0:
        return 1, 1, 1
    if axis < 0:
        axis += rank
    dims = [int(d) for d in shape]
    outer = int(np.prod(dims[:axis], dtype=np.int64))
    if opset < 13:
        return outer, int(np.prod(dims[axis:], dtype=np.int64)), 1
    return outer, dims[axis], int(np.prod(dims[axis + 1:], dtype=np.int64))


def _rows_kernel(n: int, dtype) -> Kernel:
    zero = literal(0, dtype)
    src = Source().line(kernel_header(2)).indent()
    src.line("for r in range(begin, end):").indent()
    src.line(f"base = r * {n}")
    src.line("m = p0[base]")
    src.line(f"for i in range({n}):").indent().line("m = vmax(m, p0[base + i])").dedent()
    src.line(f"s = {zero}")
    src.line(f"for i in range({n}):").indent()
    src.line("e = vexp(p0[base + i] - m)").line("p1[base + i] = e").line("s += e").dedent()
    src.line(f"inv = {literal(1, dtype)} / s")
    src.line(f"for i in range({n}):").indent().line("p1[base + i] = p1[base + i] * inv").dedent()
    return Kernel("Softmax", src.text(), (pointer_type(dtype),) * 2)


def _columns_kernel(n: int, inner: int, dtype) -> tuple[Kernel, int]:
    blocks = -(-inner // _COLUMNS)
    last = (n - 1) * inner
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    if blocks == 1:
        src.line(f"base = w * {n * inner}").line("c0 = 0").line(f"c1 = {inner}")
    else:
        src.line(f"base = (w // {blocks}) * {n * inner}")
        src.line(f"c0 = (w % {blocks}) * {_COLUMNS}")
        src.line(f"c1 = min(c0 + {_COLUMNS}, {inner})")
    # 1. the column maxima, into the last row of the output
    src.line("for c in range(c0, c1):").indent().line(f"p1[base + {last} + c] = p0[base + c]").dedent()
    src.line(f"for k in range(1, {n}):").indent()
    src.line(f"row = base + k * {inner}")
    src.line("for c in range(c0, c1):").indent()
    src.line("v = p0[row + c]").line(f"m = p1[base + {last} + c]").line(f"p1[base + {last} + c] = v if v > m else m")
    src.dedent().dedent()
    # 2. the exponentials, the last row last (it holds the maxima until then)
    src.line(f"for k in range({n - 1}):").indent()
    src.line(f"row = base + k * {inner}")
    src.line("for c in range(c0, c1):").indent()
    src.line(f"p1[row + c] = vexp(p0[row + c] - p1[base + {last} + c])")
    src.dedent().dedent()
    src.line("for c in range(c0, c1):").indent()
    src.line(f"p1[base + {last} + c] = vexp(p0[base + {last} + c] - p1[base + {last} + c])").dedent()
    # 3. normalise each column
    src.line("for c in range(c0, c1):").indent()
    src.line(f"s = {literal(0, dtype)}")
    src.line(f"for k in range({n}):").indent().line(f"s += p1[base + k * {inner} + c]").dedent()
    src.line(f"inv = {literal(1, dtype)} / s")
    src.line(f"for k in range({n}):").indent().line(f"p1[base + k * {inner} + c] = p1[base + k * {inner} + c] * inv")
    return Kernel("Softmax", src.text(), (pointer_type(dtype),) * 2), blocks


def lower_softmax(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y])
    if np.dtype(x.dtype).kind != "f":
        raise UnsupportedOpError(f"node '{node.name}' (Softmax): dtype {np.dtype(x.dtype).name} is not supported",
                                 hint="Softmax takes float32 or float64")
    default_axis = -1 if graph.opset >= 13 else 1
    outer, n, inner = softmax_layout(x.shape, int(node.attr("axis", default_axis)), graph.opset)
    if inner == 1:
        kernel, work = _rows_kernel(max(n, 1), x.dtype), outer
    else:
        kernel, blocks = _columns_kernel(max(n, 1), inner, x.dtype)
        work = outer * blocks
    if x.size == 0:
        work = 0  # nothing to compute; the call stays so the output is still written (not copied)
    return Lowered([KernelCall(kernel, [x.name, y.name], work, node.name)])
