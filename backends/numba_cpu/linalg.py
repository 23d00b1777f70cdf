"""Det: the determinant of each n x n matrix of the input's last two dims, by Gaussian elimination
with partial pivoting (LAPACK getrf's order, which onnxruntime's Eigen and numpy's LAPACK also use):
det = sign of the row swaps * the product of the pivots. A work item is one matrix, eliminated in
its own n*n slice of working memory."""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, literal
from .scratch import scratch_value


def lower_det(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    dtype = np.dtype(x.dtype)
    if dtype not in (np.float32, np.float64):
        raise UnsupportedOpError(f"node '{node.name}' (Det): dtype {dtype.name} is not supported (float32, float64)")
    if len(x.shape) < 2 or x.shape[-1] != x.shape[-2]:
        raise UnsupportedOpError(f"node '{node.name}' (Det): the input's last two dims must be square, not {list(x.shape)}")
    n = int(x.shape[-1])
    count = int(np.prod(x.shape[:-2], dtype=np.int64))
    work = scratch_value(graph, node, (max(count, 1) * n * n,), dtype)
    zero, one = literal(0, dtype), literal(1, dtype)
    src = Source().line(kernel_header(3)).indent()
    src.line("for m in range(begin, end):").indent()
    src.line(f"a = m * {n * n}")
    src.line(f"for i in range({n * n}):").indent().line("p2[a + i] = p0[a + i]").dedent()
    src.line(f"det = {one}")
    src.line(f"for c in range({n}):").indent()
    src.line("piv = c").line(f"best = abs(p2[a + c * {n} + c])")
    src.line(f"for r in range(c + 1, {n}):").indent()
    src.line(f"v = abs(p2[a + r * {n} + c])")
    src.line("if v > best:").indent().line("best = v").line("piv = r").dedent().dedent()
    src.line(f"if p2[a + piv * {n} + c] == {zero}:").indent().line(f"det = {zero}").line("break").dedent()
    src.line("if piv != c:").indent()
    src.line("det = -det")
    src.line(f"for k in range({n}):").indent()
    src.line(f"t = p2[a + c * {n} + k]").line(f"p2[a + c * {n} + k] = p2[a + piv * {n} + k]")
    src.line(f"p2[a + piv * {n} + k] = t").dedent().dedent()
    src.line(f"d = p2[a + c * {n} + c]")
    src.line("det *= d")
    src.line(f"for r in range(c + 1, {n}):").indent()
    src.line(f"f = p2[a + r * {n} + c] / d")
    src.line(f"for k in range(c + 1, {n}):").indent()
    src.line(f"p2[a + r * {n} + k] -= f * p2[a + c * {n} + k]").dedent().dedent().dedent()
    src.line("p1[m] = det")
    kernel = Kernel("Det", src.text(), (dtype.name,) * 3)
    return Lowered([KernelCall(kernel, [x.name, y.name, work], count, node.name, n_outputs=2)])
