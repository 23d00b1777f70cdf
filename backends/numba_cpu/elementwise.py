"""Elementwise ops with numpy broadcasting: one loop nest over the output,
dims collapsed where every operand is contiguous, innermost loop unit-stride
so LLVM vectorises it. Unary, binary and fused chains share this generator:
an op is just an expression over its operands.
"""
from __future__ import annotations

import re

import numpy as np

from cuvil.errors import UnsupportedOpError

from ..numba_cpu.kernel import (Kernel, KernelCall, Lowered, Source, broadcast_strides,
                                dims_strides, index_expr, kernel_header, literal)

# Expressions over operand names a, b (c for Where; a, b, c... for the
# variadic ops). `F(x)` is a typed literal of the output dtype, filled in by
# `render`. Bool operands arrive as Numba booleans (see `load`).
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
    # math.floor/ceil return Python ints in Numba (wrong past 2**63, and for inf/nan).
    "Floor": "np.floor(a)",
    "Ceil": "np.ceil(a)",
    "Sin": "math.sin(a)",
    "Cos": "math.cos(a)",
    "Identity": "a",
    # log(1 + exp(a)) overflows for a > 88 in float32; this form does not.
    "Softplus": "(a + math.log1p(math.exp(-a))) if a > F(0) else math.log1p(math.exp(a))",
    "Softsign": "a / (F(1) + abs(a))",
    "Not": "not a",
}

BINARY = {
    "Add": "a + b",
    "Sub": "a - b",
    "Mul": "a * b",
    "Div": "a / b",
    "Max": "max(a, b)",
    "Min": "min(a, b)",
    "Pow": "a ** b",
    "Equal": "a == b",
    "Less": "a < b",
    "Greater": "a > b",
    "LessOrEqual": "a <= b",
    "GreaterOrEqual": "a >= b",
    "And": "a and b",
    "Or": "a or b",
    "Xor": "a != b",
    "PRelu": "a if a >= F(0) else a * b",
    # Variadic (one or more inputs): the expression is built for the input count.
    "Sum": "a + b",
    "Mean": "(a + b) / F(2)",
}

VARIADIC = {"Max", "Min", "Sum", "Mean"}

# ONNX integer Div truncates toward zero like C; Python's // floors.
_INT_DIV = "(a // b) if ((a >= 0) == (b > 0)) or (a % b == 0) else (a // b + 1)"
# Numba's int ** int raises on a negative exponent; ONNX runtimes compute pow in
# floating point and truncate, which this does.
_INT_POW = "math.pow(np.float64(a), np.float64(b))"


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
    """Replace F(x) by a typed literal of dtype (integers are parsed exactly, so
    int64 bounds such as 9223372036854775807 survive)."""
    def typed(match):
        text = match.group(1).strip()
        if np.dtype(dtype).kind == "f":
            return literal(float(text), dtype)
        try:
            return literal(int(text), dtype)
        except ValueError:
            return literal(int(float(text)), dtype)
    return re.sub(r"F\(([^()]*)\)", typed, expr)


# Numba's CPointer(boolean) loads an i8 but stores an i1 (an LLVM type error),
# so kernels see bool tensors as uint8 bytes; the graph dtype stays bool.
def pointer_type(dtype) -> str:
    """The numpy dtype name a kernel's pointer to values of `dtype` has."""
    dtype = np.dtype(dtype)
    return "uint8" if dtype.kind == "b" else dtype.name


def load(pointer: str, index: str, dtype) -> str:
    """Source reading one element; bools come back as Numba booleans."""
    if np.dtype(dtype).kind == "b":
        return f"{pointer}[{index}] != np.uint8(0)"
    return f"{pointer}[{index}]"


def store(pointer: str, index: str, value: str, dtype) -> str:
    """Source writing one element, converted to dtype (bools as one 0/1 byte)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return f"{pointer}[{index}] = np.uint8(1) if ({value}) else np.uint8(0)"
    return f"{pointer}[{index}] = np.{dtype.name}({value})"


_KERNEL_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                  "float32", "float64"}


def check_dtypes(node, values) -> None:
    """Kernels are Numba code: float16, bfloat16, strings and complex have no kernel yet."""
    for v in values:
        if np.dtype(v.dtype).name not in _KERNEL_DTYPES:
            raise UnsupportedOpError(f"node '{node.name}' ({node.op}): dtype {np.dtype(v.dtype).name} of '{v.name}' is not supported",
                                     hint=f"supported dtypes: {', '.join(sorted(_KERNEL_DTYPES))}")


def operand_name(k: int) -> str:
    return "abcdefgh"[k] if k < 8 else f"x{k}"


def elementwise_kernel(family: str, expr: str, in_shapes, in_dtypes, out_shape, out_dtype) -> tuple[Kernel, int]:
    """A kernel computing `out = expr(a, b, c...)` with broadcasting."""
    operand_strides = [broadcast_strides(s, out_shape) for s in in_shapes] + [dims_strides(out_shape)]
    src = Source().line(kernel_header(len(in_shapes) + 1)).indent()
    indices, work = loop_nest(src, out_shape, operand_strides)
    for k, (idx, dtype) in enumerate(zip(indices[:-1], in_dtypes)):
        src.line(f"{operand_name(k)} = {load(f'p{k}', idx, dtype)}")
    out = len(in_shapes)
    src.line(store(f"p{out}", indices[-1], render(expr, out_dtype), out_dtype))
    kernel = Kernel(family, src.text(), tuple(pointer_type(d) for d in list(in_dtypes) + [out_dtype]))
    return kernel, work


def _variadic(op: str, n: int) -> str:
    """Max, Min, Sum and Mean take one or more inputs."""
    names = [operand_name(k) for k in range(n)]
    if n == 1:
        return "a"
    if op in ("Max", "Min"):
        return f"{op.lower()}({', '.join(names)})"
    total = " + ".join(names)
    return total if op == "Sum" else f"({total}) / F({n})"


def lower_elementwise(node, graph) -> Lowered:
    ins = [graph.values[i] for i in node.inputs if i]
    out = graph.values[node.outputs[0]]
    check_dtypes(node, ins + [out])
    if node.op in VARIADIC:
        expr = _variadic(node.op, len(ins))
    elif node.op in UNARY:
        expr = UNARY[node.op]
    elif node.op in BINARY:
        expr = BINARY[node.op]
        integer = np.dtype(ins[0].dtype).kind in "iu"
        if node.op == "Div" and integer:
            expr = _INT_DIV
        elif node.op == "Pow" and (integer or np.dtype(ins[1].dtype).kind in "iu"):
            expr = _INT_POW
    else:
        raise KeyError(node.op)
    kernel, work = elementwise_kernel(node.op, expr, [v.shape for v in ins], [v.dtype for v in ins], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [out.name], work, node.name)])


def lower_clip(node, graph) -> Lowered:
    """Clip: bounds from attributes (opset < 11) or from optional inputs (opset >= 11).
    Constant bounds are baked in; a bound computed at run time is a scalar operand."""
    x = graph.values[node.inputs[0]]
    out = graph.values[node.outputs[0]]
    check_dtypes(node, [x, out])
    bounds = {"min": node.attr("min"), "max": node.attr("max")}
    operands = [x]
    for pos, key in ((1, "min"), (2, "max")):
        if len(node.inputs) > pos and node.inputs[pos]:
            v = graph.values[node.inputs[pos]]
            if v.is_const:
                bounds[key] = np.asarray(v.data).reshape(-1)[0].item()
            else:
                bounds[key] = operand_name(len(operands))
                operands.append(v)
    expr = "a"
    for key, keep in (("min", ">"), ("max", "<")):
        bound = bounds[key]
        if bound is None:
            continue
        if not isinstance(bound, str):
            bound = literal(bound, out.dtype)
        expr = f"({expr} if {expr} {keep} {bound} else {bound})"
    kernel, work = elementwise_kernel("Clip", expr, [v.shape for v in operands], [v.dtype for v in operands],
                                      out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [v.name for v in operands] + [out.name], work, node.name)])


def _unary(node, graph, family, expr) -> Lowered:
    x, out = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, out])
    kernel, work = elementwise_kernel(family, expr, [x.shape], [x.dtype], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [x.name, out.name], work, node.name)])


def lower_leaky_relu(node, graph) -> Lowered:
    alpha = float(node.attr("alpha", 0.01))
    return _unary(node, graph, "LeakyRelu", f"a if a >= F(0) else a * F({alpha!r})")


def lower_hard_sigmoid(node, graph) -> Lowered:
    alpha, beta = float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))
    return _unary(node, graph, "HardSigmoid", f"min(max(a * F({alpha!r}) + F({beta!r}), F(0)), F(1))")


def lower_hard_swish(node, graph) -> Lowered:
    return _unary(node, graph, "HardSwish", "a * min(max(a * F(0.16666666666666666) + F(0.5), F(0)), F(1))")


def lower_where(node, graph) -> Lowered:
    ins = [graph.values[i] for i in node.inputs]
    out = graph.values[node.outputs[0]]
    check_dtypes(node, ins + [out])
    kernel, work = elementwise_kernel("Where", "b if a else c", [v.shape for v in ins], [v.dtype for v in ins], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [out.name], work, node.name)])
