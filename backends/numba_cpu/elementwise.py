"""Elementwise ops with numpy broadcasting: one loop nest over the output,
dims collapsed where every operand is contiguous, innermost loop unit-stride
so LLVM vectorises it. Unary, binary and fused chains share this generator:
an op is just an expression over its operands.
"""
from __future__ import annotations

import numpy as np

from ..numba_cpu.kernel import (Kernel, KernelCall, Lowered, Source, broadcast_strides,
                                dims_strides, index_expr, kernel_header, literal)

# Expressions over operand names a, b (c for Where). `F(x)` is a typed literal
# of the output dtype, filled in by `render`.
UNARY = {
    "Relu": "a if a > F(0) else F(0)",
    "Neg": "-a",
    "Abs": "abs(a)",
    "Sqrt": "math.sqrt(a)",
    "Exp": "math.exp(a)",
    "Log": "math.log(a)",
    "Tanh": "math.tanh(a)",
    "Erf": "math.erf(a)",
    "Sigmoid": "F(1) / (F(1) + math.exp(-a))",
    "Reciprocal": "F(1) / a",
    "Floor": "math.floor(a)",
    "Ceil": "math.ceil(a)",
    "Sin": "math.sin(a)",
    "Cos": "math.cos(a)",
    "Identity": "a",
    "Softplus": "math.log(math.exp(a) + F(1))",
    "Softsign": "a / (F(1) + abs(a))",
    "Not": "not a",
}

BINARY = {
    "Add": "a + b",
    "Sub": "a - b",
    "Mul": "a * b",
    "Div": "a / b",
    "Max": "a if a >= b else b",
    "Min": "a if a <= b else b",
    "Pow": "a ** b",
    "Equal": "a == b",
    "Less": "a < b",
    "Greater": "a > b",
    "LessOrEqual": "a <= b",
    "GreaterOrEqual": "a >= b",
    "And": "a and b",
    "Or": "a or b",
    "Xor": "a != b",
}

def _collapse(out_shape, operand_strides):
    """Merge adjacent dims where every operand (and the output) stays linear."""
    dims = list(out_shape)
    strides = [list(s) for s in operand_strides]
    i = len(dims) - 2
    while i >= 0:
        if all(s[i] == s[i + 1] * dims[i + 1] for s in strides):
            dims[i] *= dims[i + 1]
            del dims[i + 1]
            for s in strides:
                s[i] = s[i + 1]
                del s[i + 1]
        i -= 1
    # Drop size-1 dims (they contribute nothing to any index).
    keep = [k for k, d in enumerate(dims) if d != 1] or [len(dims) - 1]
    return [dims[k] for k in keep], [[s[k] for k in keep] for s in strides]


# Rank-1 loops are split in blocks so the work range has a useful granularity.
_BLOCK = 2048


def loop_nest(src: Source, out_shape, operand_strides):
    """Open a loop nest over out_shape; returns the index expression of each operand.

    The outermost loop runs over [begin, end); returns (indices, work)."""
    total = int(np.prod(out_shape, dtype=np.int64)) if len(out_shape) else 1
    dims, strides = _collapse(out_shape, operand_strides) if out_shape else ([1], [[0] for _ in operand_strides])
    if not dims:
        dims, strides = [1], [[0] for _ in operand_strides]
    if len(dims) == 1:
        n = dims[0]
        blocks = -(-n // _BLOCK)
        src.line("for blk in range(begin, end):").indent()
        if blocks == 1:
            src.line(f"for i0 in range({n}):").indent()
        else:
            src.line(f"for i0 in range(blk * {_BLOCK}, min(blk * {_BLOCK} + {_BLOCK}, {n})):").indent()
        return [index_expr(["i0"], s) for s in strides], blocks
    names = [f"i{k}" for k in range(len(dims))]
    src.line(f"for i0 in range(begin, end):").indent()
    for k in range(1, len(dims)):
        src.line(f"for i{k} in range({dims[k]}):").indent()
    assert total == int(np.prod(dims))
    return [index_expr(names, s) for s in strides], dims[0]


def render(expr: str, dtype) -> str:
    """Replace F(x) by a typed literal of dtype."""
    import re
    return re.sub(r"F\(([^()]*)\)", lambda m: literal(float(m.group(1)), dtype) if np.dtype(dtype).kind == "f"
                  else literal(int(float(m.group(1))), dtype), expr)


def elementwise_kernel(family: str, expr: str, in_shapes, in_dtypes, out_shape, out_dtype) -> tuple[Kernel, int]:
    """A kernel computing `out = expr(a, b, c...)` with broadcasting."""
    names = "abcdefgh"
    operand_strides = [broadcast_strides(s, out_shape) for s in in_shapes] + [dims_strides(out_shape)]
    src = Source().line(kernel_header(len(in_shapes) + 1)).indent()
    indices, work = loop_nest(src, out_shape, operand_strides)
    for k, idx in enumerate(indices[:-1]):
        src.line(f"{names[k]} = p{k}[{idx}]")
    out = len(in_shapes)
    value = render(expr, out_dtype)
    if np.dtype(out_dtype).kind == "b":
        src.line(f"p{out}[{indices[-1]}] = {value}")
    else:
        src.line(f"p{out}[{indices[-1]}] = np.{np.dtype(out_dtype).name}({value})")
    kernel = Kernel(family, src.text(), tuple(np.dtype(d).name for d in list(in_dtypes) + [out_dtype]))
    return kernel, work


def lower_elementwise(node, graph) -> Lowered:
    ins = [graph.values[i] for i in node.inputs if i]
    out = graph.values[node.outputs[0]]
    if node.op in UNARY:
        expr = UNARY[node.op]
    elif node.op in BINARY:
        expr = BINARY[node.op]
        if node.op == "Div" and np.dtype(ins[0].dtype).kind in "iu":
            # ONNX integer Div truncates toward zero like C; Python's // floors.
            expr = "(a // b) if ((a >= 0) == (b > 0)) or (a % b == 0) else (a // b + 1)"
    else:
        raise KeyError(node.op)
    kernel, work = elementwise_kernel(node.op, expr, [v.shape for v in ins], [v.dtype for v in ins], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [out.name], work, node.name)])


def lower_clip(node, graph) -> Lowered:
    x = graph.values[node.inputs[0]]
    out = graph.values[node.outputs[0]]
    lo, hi = node.attr("min"), node.attr("max")
    for pos in (1, 2):
        if len(node.inputs) > pos and node.inputs[pos]:
            v = graph.values[node.inputs[pos]]
            if not v.is_const:
                from cuvil.errors import UnsupportedOpError
                raise UnsupportedOpError(f"node '{node.name}' (Clip): a non-constant {'min' if pos == 1 else 'max'} is not supported")
            if pos == 1:
                lo = v.data.item()
            else:
                hi = v.data.item()
    expr = "a"
    if lo is not None:
        expr = f"({expr} if {expr} > F({float(lo)}) else F({float(lo)}))"
    if hi is not None:
        expr = f"({expr} if {expr} < F({float(hi)}) else F({float(hi)}))"
    kernel, work = elementwise_kernel("Clip", expr, [x.shape], [x.dtype], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [x.name, out.name], work, node.name)])


def lower_leaky_relu(node, graph) -> Lowered:
    x, out = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    alpha = float(node.attr("alpha", 0.01))
    kernel, work = elementwise_kernel("LeakyRelu", f"a if a >= F(0) else a * F({alpha})", [x.shape], [x.dtype], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [x.name, out.name], work, node.name)])


def lower_hard_sigmoid(node, graph) -> Lowered:
    x, out = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    alpha, beta = float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))
    expr = f"min(max(a * F({alpha}) + F({beta}), F(0)), F(1))"
    kernel, work = elementwise_kernel("HardSigmoid", expr, [x.shape], [x.dtype], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [x.name, out.name], work, node.name)])


def lower_hard_swish(node, graph) -> Lowered:
    x, out = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    expr = "a * min(max(a * F(0.16666666666666666) + F(0.5), F(0)), F(1))"
    kernel, work = elementwise_kernel("HardSwish", expr, [x.shape], [x.dtype], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [x.name, out.name], work, node.name)])


def lower_where(node, graph) -> Lowered:
    ins = [graph.values[i] for i in node.inputs]
    out = graph.values[node.outputs[0]]
    kernel, work = elementwise_kernel("Where", "b if a else c", [v.shape for v in ins], [v.dtype for v in ins], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [out.name], work, node.name)])
