"""Elementwise ops with numpy broadcasting: one loop nest over the output,
dims collapsed where every operand is contiguous, innermost loop unit-stride
so LLVM vectorises it. Unary, binary and fused chains share this generator:
an op is just an expression over its operands.
"""
from __future__ import annotations

import re

import numpy as np

from cuvil.errors import UnsupportedOpError
from cuvil.ops import IN_PLACE_OPS

# Element types kernels reach only through load/store (bool, float16, float8, int4...): narrow.py.
from .narrow import (BIT_HELPERS, SMALL_FLOATS, SMALL_INTS, compute_type, is_narrow, load,  # noqa: F401
                     pointer_type, store, with_helpers)
from ..numba_cpu.kernel import (Kernel, KernelCall, Lowered, Source, broadcast_strides,
                                dims_strides, index_expr, kernel_header, literal, with_strided_form)

# Expressions over operand names a, b (c for Where; a, b, c... for the
# variadic ops). `F(x)` is a typed literal of the output dtype, filled in by
# `render`. Bool operands arrive as Numba booleans (see `load`).
# vexp, vlog, vsigmoid, vtanh, verf (vmath.py) are vectorisable float32 versions of the libm
# functions (which are scalar calls LLVM cannot vectorise); float64 gets libm.
UNARY = {
    "Relu": "a if a > F(0) else F(0)",
    "Neg": "-a",
    "Abs": "abs(a)",
    "Sqrt": "math.sqrt(a)",
    "Exp": "vexp(a)",
    "Log": "vlog(a)",
    "Tanh": "vtanh(a)",
    "Erf": "verf(a)",
    "Sigmoid": "vsigmoid(a)",
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
    "Tan": "math.tan(a)",
    "Asin": "math.asin(a)",
    "Acos": "math.acos(a)",
    "Atan": "math.atan(a)",
    "Sinh": "math.sinh(a)",
    "Cosh": "math.cosh(a)",
    "Asinh": "math.asinh(a)",
    "Acosh": "math.acosh(a)",
    "Atanh": "math.atanh(a)",
    "Sign": "F(1) if a > F(0) else (F(-1) if a < F(0) else F(0))",
    # np.rint rounds half to even, as ONNX's Round does.
    "Round": "np.rint(a)",
    # NaN tests read the bits: fastmath lets LLVM assume `a != a` is false.
    "IsNaN": "is_nan(a)",
    "BitwiseNot": "~a",
    "Mish": "a * math.tanh((a + math.log1p(math.exp(-a))) if a > F(0) else math.log1p(math.exp(a)))",
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
    "BitwiseAnd": "a & b",
    "BitwiseOr": "a | b",
    "BitwiseXor": "a ^ b",
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



_KERNEL_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                  "float32", "float64"}


def check_dtypes(node, values, float16: bool = False) -> None:
    """Kernels are Numba code: strings and complex have no kernel; the narrow
    types (float16, bfloat16, float8, float4, int4...) only in generators that
    read and write them through load/store (float16=True)."""
    for v in values:
        if np.dtype(v.dtype).name not in _KERNEL_DTYPES and not (float16 and is_narrow(v.dtype)):
            raise UnsupportedOpError(f"node '{node.name}' ({node.op}): dtype {np.dtype(v.dtype).name} of '{v.name}' is not supported",
                                     hint=f"supported dtypes: {', '.join(sorted(_KERNEL_DTYPES))}")


def operand_name(k: int) -> str:
    return "abcdefgh"[k] if k < 8 else f"x{k}"


def elementwise_kernel(family: str, expr: str, in_shapes, in_dtypes, out_shape, out_dtype,
                       saturate: bool = True, value_dtype=None, round_mode: str = "up",
                       out_strides=None) -> tuple[Kernel, int]:
    """A kernel computing `out = expr(a, b, c...)` with broadcasting; the output laid out by
    `out_strides` (elements; default: contiguous), a layout its input's bytes cannot share."""
    operand_strides = [broadcast_strides(s, out_shape) for s in in_shapes] + \
        [list(out_strides) if out_strides is not None else dims_strides(out_shape)]
    src = Source().line(kernel_header(len(in_shapes) + 1)).indent()
    indices, work = loop_nest(src, out_shape, operand_strides)
    for k, (idx, dtype) in enumerate(zip(indices[:-1], in_dtypes)):
        src.line(f"{operand_name(k)} = {load(f'p{k}', idx, dtype)}")
    out = len(in_shapes)
    src.line(store(f"p{out}", indices[-1], render(expr, compute_type(out_dtype)), out_dtype, saturate, value_dtype,
                   round_mode))
    kernel = Kernel(family, with_helpers(src.text()), tuple(pointer_type(d) for d in list(in_dtypes) + [out_dtype]),
                    in_place=family in IN_PLACE_OPS and out_strides is None)
    return kernel, work


def elementwise_call(family: str, expr: str, ins, out, node: str, **options) -> KernelCall:
    """The call (for `node`) of elementwise_kernel over values `ins` -> `out`, with the Strided form that writes
    the batch blocks of `out` a Concat row apart where `out` feeds one (concat.py)."""
    shapes, dtypes = [v.shape for v in ins], [v.dtype for v in ins]
    kernel, work = elementwise_kernel(family, expr, shapes, dtypes, out.shape, out.dtype, **options)
    call = KernelCall(kernel, [v.name for v in ins] + [out.name], work, node)

    def strided(row):
        out_strides = [row] + dims_strides(out.shape)[1:]
        return elementwise_kernel(family, expr, shapes, dtypes, out.shape, out.dtype, out_strides=out_strides,
                                  **options)
    return with_strided_form(call, out, strided)


def _variadic(op: str, n: int) -> str:
    """Max, Min, Sum and Mean take one or more inputs."""
    names = [operand_name(k) for k in range(n)]
    if n == 1:
        return "a"
    if op in ("Max", "Min"):
        return f"{op.lower()}({', '.join(names)})"
    total = " + ".join(names)
    return total if op == "Sum" else f"({total}) / F({n})"


_SMALL_POWERS = {1.0: "a", 2.0: "a * a", 3.0: "a * a * a"}


def _small_exponent(value) -> float | None:
    """The exponent when it is a constant with one value in _SMALL_POWERS (then a product), else None."""
    if not value.is_const or np.asarray(value.data).size != 1:
        return None
    exponent = float(np.asarray(value.data).reshape(-1)[0])
    return exponent if exponent in _SMALL_POWERS else None


def lower_elementwise(node, graph) -> Lowered:
    ins = [graph.values[i] for i in node.inputs if i]
    out = graph.values[node.outputs[0]]
    check_dtypes(node, ins + [out], float16=True)
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
        elif node.op == "Pow" and _small_exponent(ins[1]) is not None:
            # x ** 2 would be a libm powf call per element (T5's norms spent 12 % of the model there)
            expr = _SMALL_POWERS[_small_exponent(ins[1])]
    else:
        raise KeyError(node.op)
    return Lowered([elementwise_call(node.op, expr, ins, out, node.name)])


def lower_clip(node, graph) -> Lowered:
    """Clip: bounds from attributes (opset < 11) or from optional inputs (opset >= 11).
    Constant bounds are baked in; a bound computed at run time is a scalar operand."""
    x = graph.values[node.inputs[0]]
    out = graph.values[node.outputs[0]]
    check_dtypes(node, [x, out], float16=True)
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
            bound = literal(bound, compute_type(out.dtype))
        expr = f"({expr} if {expr} {keep} {bound} else {bound})"
    return Lowered([elementwise_call("Clip", expr, operands, out, node.name)])


def _unary(node, graph, family, expr) -> Lowered:
    x, out = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, out], float16=True)
    return Lowered([elementwise_call(family, expr, [x], out, node.name)])


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
    check_dtypes(node, ins + [out], float16=True)
    kernel, work = elementwise_kernel("Where", "b if a else c", [v.shape for v in ins], [v.dtype for v in ins], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [out.name], work, node.name)])


def lower_elu(node, graph) -> Lowered:
    alpha = float(node.attr("alpha", 1.0))
    return _unary(node, graph, "Elu", f"a if a >= F(0) else F({alpha!r}) * (math.exp(a) - F(1))")


def lower_selu(node, graph) -> Lowered:
    alpha = float(node.attr("alpha", 1.67326319217681884765625))
    gamma = float(node.attr("gamma", 1.05070102519989013671875))
    return _unary(node, graph, "Selu", f"F({gamma!r}) * (a if a > F(0) else F({alpha!r}) * (math.exp(a) - F(1)))")


def lower_celu(node, graph) -> Lowered:
    alpha = float(node.attr("alpha", 1.0))
    return _unary(node, graph, "Celu",
                  f"max(F(0), a) + min(F(0), F({alpha!r}) * (math.exp(a / F({alpha!r})) - F(1)))")


def lower_thresholded_relu(node, graph) -> Lowered:
    alpha = float(node.attr("alpha", 1.0))
    return _unary(node, graph, "ThresholdedRelu", f"a if a > F({alpha!r}) else F(0)")


def lower_shrink(node, graph) -> Lowered:
    bias, lambd = float(node.attr("bias", 0.0)), float(node.attr("lambd", 0.5))
    return _unary(node, graph, "Shrink",
                  f"a + F({bias!r}) if a < F({-lambd!r}) else (a - F({bias!r}) if a > F({lambd!r}) else F(0))")


def lower_swish(node, graph) -> Lowered:
    alpha = float(node.attr("alpha", 1.0))
    return _unary(node, graph, "Swish", f"a / (F(1) + math.exp(-F({alpha!r}) * a))")


def lower_is_inf(node, graph) -> Lowered:
    negative, positive = bool(node.attr("detect_negative", 1)), bool(node.attr("detect_positive", 1))
    # +inf and -inf by their bits (fastmath lets LLVM assume there are no infinities)
    tests = ([f"_f64_bits(np.float64(a)) == {0x7FF0000000000000}"] if positive else []) + \
        ([f"_f64_bits(np.float64(a)) == {-0x10000000000000}"] if negative else [])
    return _unary(node, graph, "IsInf", " or ".join(tests) or "False")


def lower_mod(node, graph) -> Lowered:
    """fmod=0: the result has the divisor's sign (numpy's mod); fmod=1: the dividend's (C fmod)."""
    ins = [graph.values[i] for i in node.inputs]
    out = graph.values[node.outputs[0]]
    check_dtypes(node, ins + [out], float16=True)
    integer = np.dtype(out.dtype).kind in "iu"
    if node.attr("fmod", 0):
        expr = f"a - b * ({_INT_DIV})" if integer else "np.fmod(a, b)"
    else:
        expr = "a % b" if integer else "np.remainder(a, b)"
    kernel, work = elementwise_kernel("Mod", expr, [v.shape for v in ins], [v.dtype for v in ins], out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [out.name], work, node.name)])


def lower_bit_shift(node, graph) -> Lowered:
    """Shifts by a negative count or by the width or more give 0 (as numpy's do)."""
    ins = [graph.values[i] for i in node.inputs]
    out = graph.values[node.outputs[0]]
    check_dtypes(node, ins + [out])
    bits = np.dtype(out.dtype).itemsize * 8
    if str(node.attr("direction")) == "LEFT":
        expr = f"(a << b) if (b >= F(0) and b < F({bits})) else F(0)"
    else:
        fill = "(F(-1) if a < F(0) else F(0))" if np.dtype(out.dtype).kind == "i" else "F(0)"
        expr = f"(a >> b) if (b >= F(0) and b < F({bits})) else {fill}"
    kernel, work = elementwise_kernel("BitShift", expr, [v.shape for v in ins], [v.dtype for v in ins],
                                      out.shape, out.dtype)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [out.name], work, node.name)])
