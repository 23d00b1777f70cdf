"""FusedElementwise (domain "cuvil"): a program of elementwise steps as one loop.

The program (see passes/fuse_elementwise.py) is one step per string,
`<Op> <operand> ... [key=value ...]`, operands `x<k>` (input k, broadcast to
the output), `t<j>` (step j's result) or a number. The kernel is
elementwise.py's loop nest over the output; its body loads each input once,
computes every step into a local and stores the last one:

    x0 = p0[i0*64 + i1]; x1 = p1[i1]
    a = x0; b = x1; t0 = a + b
    a = t0; t1 = a if a > F(0) else F(0)
    p2[i0*64 + i1] = np.float32(t1)
"""
from __future__ import annotations

import math

import numpy as np

from cuvil.errors import UnsupportedOpError

from .elementwise import BINARY, UNARY, check_dtypes, loop_nest, render
from .kernel import Kernel, KernelCall, Lowered, Source, broadcast_strides, dims_strides, kernel_header, literal

_SQRT_HALF = repr(1 / math.sqrt(2))
_SQRT_2_OVER_PI = repr(math.sqrt(2 / math.pi))

# Steps beyond elementwise.py's tables, as expressions over `a` (and `b`);
# attributes are filled in by `_expression`.
_EXTRA = {
    "Silu": "a / (F(1) + math.exp(-a))",
    "HardSwish": "a * min(max(a * F(0.16666666666666666) + F(0.5), F(0)), F(1))",
    "LeakyRelu": "a if a >= F(0) else a * F({alpha})",
    "HardSigmoid": "min(max(a * F({alpha}) + F({beta}), F(0)), F(1))",
    "Elu": "a if a >= F(0) else F({alpha}) * (math.exp(a) - F(1))",
    "Gelu:none": f"F(0.5) * a * (F(1) + math.erf(a * F({_SQRT_HALF})))",
    "Gelu:tanh": f"F(0.5) * a * (F(1) + math.tanh(F({_SQRT_2_OVER_PI}) * (a + F(0.044715) * a * a * a)))",
}


def _parse(step: str):
    op, *rest = step.split()
    operands = [r for r in rest if "=" not in r]
    attrs = dict(r.split("=", 1) for r in rest if "=" in r)
    return op, operands, attrs


def _expression(node, op: str, operands: list[str], attrs: dict) -> str:
    """The step as an expression over `a` (and `b`), with F(...) literals of the output dtype."""
    if op == "Clip":
        expr = "a"
        for key, keep in (("min", ">"), ("max", "<")):
            if key in attrs:
                expr = f"({expr} if {expr} {keep} F({float(attrs[key])!r}) else F({float(attrs[key])!r}))"
        return expr
    if op == "Pow" and _is_number(operands[1]) and float(operands[1]) in (1.0, 2.0, 3.0, 0.5):
        # Small constant exponents as multiplications (x ** 2 would be a libm pow call).
        return {1.0: "a", 2.0: "a * a", 3.0: "a * a * a", 0.5: "math.sqrt(a)"}[float(operands[1])]
    if op == "Gelu":
        op = f"Gelu:{attrs.get('approximate', 'none')}"
    if op in _EXTRA:
        params = {k: repr(float(v)) for k, v in attrs.items() if k != "approximate"}
        params.setdefault("alpha", repr({"LeakyRelu": 0.01, "HardSigmoid": 0.2}.get(op, 1.0)))
        params.setdefault("beta", repr(0.5))
        return _EXTRA[op].format(**params)
    if op in UNARY and len(operands) == 1:
        return UNARY[op]
    if op in BINARY and len(operands) == 2 and op not in ("Sum", "Mean"):
        return BINARY[op]
    raise UnsupportedOpError(f"node '{node.name}' (FusedElementwise): step '{op}' with {len(operands)} operands "
                             f"is not supported")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return not text.startswith(("x", "t"))


def program_lines(node, program: list[str], dtype) -> list[str]:
    """The lines computing a program's steps (t0, t1, ...) from its inputs x0, x1, ...: the last
    step's value is t{len(program) - 1} (also convprologue.py's, in a conv's input copy)."""
    lines = []
    for j, step in enumerate(program):
        op, operands, attrs = _parse(step)
        for name, operand in zip("ab", operands):
            value = literal(float(operand), dtype) if _is_number(operand) else operand
            lines.append(f"{name} = {value}")
        lines.append(f"t{j} = {render(_expression(node, op, operands, attrs), dtype)}")
    return lines


def lower_fused_elementwise(node, graph) -> Lowered:
    ins = [graph.values[i] for i in node.inputs]
    out = graph.values[node.outputs[0]]
    check_dtypes(node, ins + [out])
    dtype = np.dtype(out.dtype)
    if dtype.kind != "f" or any(np.dtype(v.dtype) != dtype for v in ins):
        raise UnsupportedOpError(f"node '{node.name}' (FusedElementwise): every tensor must have one float dtype")
    operand_strides = [broadcast_strides(v.shape, out.shape) for v in ins] + [dims_strides(out.shape)]
    src = Source().line(kernel_header(len(ins) + 1)).indent()
    indices, work = loop_nest(src, out.shape, operand_strides)
    for k, idx in enumerate(indices[:-1]):
        src.line(f"x{k} = p{k}[{idx}]")
    program = list(node.attr("program") or [])
    if not program:
        raise UnsupportedOpError(f"node '{node.name}' (FusedElementwise): the program is empty")
    for line in program_lines(node, program, dtype):
        src.line(line)
    src.line(f"p{len(ins)}[{indices[-1]}] = np.{dtype.name}(t{len(program) - 1})")
    kernel = Kernel("FusedElementwise", src.text(), tuple(dtype.name for _ in range(len(ins) + 1)), in_place=True)
    return Lowered([KernelCall(kernel, [v.name for v in ins] + [out.name], work, node.name)])
