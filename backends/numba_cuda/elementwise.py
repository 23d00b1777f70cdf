"""Elementwise ops and FusedElementwise programs on the GPU: one thread per output element.

Thread i writes output element i (the output is C-contiguous); each operand's element is found
by index arithmetic with static strides: the output's dims are merged where every operand stays
linear (numba_cpu/elementwise.py's `_collapse`), an operand laid out like the output reads
element i itself, and a broadcast one reads at sum(coordinate_k * stride_k) over the merged dims
(0 strides dropped). Adjacent threads read adjacent elements of every operand that varies along
the last merged dim, so the loads coalesce.

The expressions are the CPU backend's (numba_cpu/elementwise.py's tables, fused.py's program
steps), so both targets compute the same thing. The GPU kernels take float32 values, bool
conditions (Where) and bool results (comparisons); other dtypes lower as the CPU generator
does, as portable GPU threads.
"""
from __future__ import annotations

import numpy as np

from backends.numba_cpu import elementwise as cpu_ew, fused as cpu_fused
from backends.numba_cpu.elementwise import BINARY, UNARY, VARIADIC, render
from backends.numba_cpu.kernel import Source, broadcast_strides, dims_strides, index_expr
from backends.numba_cpu.narrow import load, pointer_type, store
from cuvil.ops import IN_PLACE_OPS

from .kernel import BLOCK, KernelCall, Lowered, gpu_kernel
from .warps import portable_lowering

_F32, _BOOL = np.dtype(np.float32), np.dtype(np.bool_)

# CPU expressions with a GPU form of their own: Numba CUDA has no numpy ufuncs. math.floor and
# round give integers in Numba, exact for floats below 2**23 (those above are integers already);
# round rounds half to even, as ONNX's Round does.
_GPU_FORMS = {
    UNARY["Floor"]: "(a if abs(a) >= F(8388608) else float32(math.floor(a)))",
    UNARY["Ceil"]: "(a if abs(a) >= F(8388608) else float32(math.ceil(a)))",
    UNARY["Round"]: "(a if abs(a) >= F(8388608) else float32(round(a)))",
}


def gpu_expression(expr: str) -> str:
    """A CPU expression (F(...) literals rendered) as the GPU computes it."""
    return render(_GPU_FORMS.get(expr, expr), np.float32)

# Ops whose expression takes and gives bools, and those that compare floats into a bool.
_LOGICAL = {"And", "Or", "Xor", "Not"}
_COMPARE = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"}


def element_indices(src: Source, out_shape, in_shapes) -> list[str]:
    """Lines computing, for thread `i` (the output element), each operand's flat index."""
    out_strides = dims_strides(out_shape)
    operand_strides = [broadcast_strides(s, out_shape) for s in in_shapes] + [out_strides]
    dims, strides = cpu_ew._collapse(out_shape, operand_strides) if len(out_shape) else ([1], [[0]] * len(operand_strides))
    linear = strides[-1]
    need = [any(s[k] != 0 for s in strides[:-1] if s != linear) for k in range(len(dims))]
    first = next((k for k, used in enumerate(need) if used), len(dims))
    if first < len(dims):
        src.line("r = i")
        for k in reversed(range(first, len(dims))):
            if k == 0:
                src.line("c0 = r")
            else:
                if need[k]:
                    src.line(f"c{k} = r % {dims[k]}")
                if k > first:
                    src.line(f"r = r // {dims[k]}")
    names = [f"c{k}" for k in range(len(dims))]
    return ["i" if s == linear else index_expr(names, s) for s in strides[:-1]]


def elementwise_source(out_shape, operands, lines, result: str, out_dtype) -> str:
    """A kernel over the output's elements: operand k (shape, dtype) is loaded into `x<k>`, then
    `lines` run, then `result` is stored."""
    src = Source().line(f"def kernel({', '.join(f'p{k}' for k in range(len(operands) + 1))}, n):").indent()
    src.line("i = cuda.grid(1)")
    src.line("if i < n:").indent()
    indices = element_indices(src, out_shape, [shape for shape, _ in operands])
    for k, ((_, dtype), index) in enumerate(zip(operands, indices)):
        src.line(f"x{k} = {load(f'p{k}', index, dtype)}")
    for line in lines:
        src.line(line)
    src.line(store(f"p{len(operands)}", "i", result, out_dtype))
    return src.text()


def _call(node, family, values, out, lines, result, in_place) -> Lowered:
    operands = [(v.shape, v.dtype) for v in values]
    source = elementwise_source(out.shape, operands, lines, result, out.dtype)
    kernel = gpu_kernel(family, source, [pointer_type(v.dtype) for v in values + [out]], BLOCK, in_place=in_place)
    work = int(out.size)
    return Lowered([KernelCall(kernel, [v.name for v in values] + [out.name], work, node.name)])


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _step_attrs(node, graph) -> dict | None:
    """The attributes of a one-step program for `node` (fused.py's `_expression`), None when
    they are not constants (a Clip bound computed at run time)."""
    if node.op == "Clip":
        attrs = {}
        for pos, key in ((1, "min"), (2, "max")):
            if len(node.inputs) > pos and node.inputs[pos]:
                v = graph.values[node.inputs[pos]]
                if not v.is_const:
                    return None
                attrs[key] = float(np.asarray(v.data).reshape(-1)[0])
            elif node.attr(key) is not None:
                attrs[key] = float(node.attr(key))
        return attrs
    if node.op == "Gelu":
        return {"approximate": _text(node.attr("approximate", "none"))}
    return {key: float(node.attr(key)) for key in ("alpha", "beta") if node.attr(key) is not None}


def _expression(node, graph, n_inputs: int) -> str | None:
    """The node's expression over a, b, c... (F(...) literals unrendered), or None."""
    op = node.op
    if op == "Where":
        return "b if a else c"
    if op in VARIADIC:
        return cpu_ew._variadic(op, n_inputs)
    if op in ("IsNaN", "BitwiseNot") or op.startswith("Bitwise"):
        return None
    attrs = _step_attrs(node, graph)
    if attrs is None:
        return None
    operands = [f"x{k}" for k in range(n_inputs)]
    return cpu_fused._expression(node, op, operands, attrs)


def _gpu_dtypes(op, ins, out) -> bool:
    """Whether the GPU kernel takes these dtypes: float32 values, bool where the op means one."""
    kinds = [np.dtype(v.dtype) for v in ins]
    result = np.dtype(out.dtype)
    if op in _LOGICAL:
        return all(k == _BOOL for k in kinds) and result == _BOOL
    if op in _COMPARE:
        return all(k == _F32 for k in kinds) and result == _BOOL
    if op == "Where":
        return kinds[0] == _BOOL and kinds[1] == kinds[2] == _F32 and result == _F32
    return all(k == _F32 for k in kinds) and result == _F32


def lower_elementwise(node, graph) -> Lowered:
    """A plain elementwise op (numba_cpu/elementwise.py's UNARY, BINARY, variadic ones, Clip,
    Where and the activations with attributes)."""
    ins = [graph.values[i] for i in node.inputs if i]
    out = graph.values[node.outputs[0]]
    if node.op == "Clip":
        ins = ins[:1]   # constant bounds are baked in (a computed bound goes to the portable kernel)
    expr = _expression(node, graph, len(ins)) if _gpu_dtypes(node.op, ins, out) else None
    if expr is None:
        return portable_lowering(node, graph, _cpu_generator(node))
    names = [cpu_ew.operand_name(k) for k in range(len(ins))]
    lines = [f"{name} = x{k}" for k, name in enumerate(names)]
    lines.append(f"y = {gpu_expression(expr)}")
    return _call(node, node.op, ins, out, lines, "y", node.op in IN_PLACE_OPS)


def _cpu_generator(node):
    from backends.numba_cpu.registry import GENERATORS
    return GENERATORS[node.op]


def lower_fused_elementwise(node, graph) -> Lowered:
    """FusedElementwise: the program's steps (fused.py) in registers, one store."""
    ins = [graph.values[i] for i in node.inputs]
    out = graph.values[node.outputs[0]]
    if any(np.dtype(v.dtype) != _F32 for v in ins + [out]):
        return portable_lowering(node, graph, cpu_fused.lower_fused_elementwise)
    program = list(node.attr("program") or [])
    lines = []
    for j, step in enumerate(program):
        op, operands, attrs = cpu_fused._parse(step)
        for name, operand in zip("ab", operands):
            value = f"float32({float(operand)!r})" if cpu_fused._is_number(operand) else operand
            lines.append(f"{name} = {value}")
        lines.append(f"t{j} = {gpu_expression(cpu_fused._expression(node, op, operands, attrs))}")
    return _call(node, "FusedElementwise", ins, out, lines, f"t{len(program) - 1}", True)


_ATTRIBUTE_OPS = ("Clip", "Where", "LeakyRelu", "HardSigmoid", "HardSwish", "Elu", "Gelu")

GENERATORS = {
    **{op: lower_elementwise for op in UNARY if op != "Identity"},
    **{op: lower_elementwise for op in BINARY},
    **{op: lower_elementwise for op in _ATTRIBUTE_OPS},
    "FusedElementwise": lower_fused_elementwise,
}
