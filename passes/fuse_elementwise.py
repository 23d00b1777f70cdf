"""fuse_elementwise: chains and trees of elementwise ops become one loop.

    Relu(Add(Mul(x, s), y))  ->  cuvil.FusedElementwise(x, s, y; program=["Mul x0 x1", "Add t0 x2", "Relu t1"])

Each op of the group computes one value per output element, so the group is
one loop over the output that loads each input once, keeps every
intermediate in a register and stores only the result: a chain of n ops
reads and writes memory once instead of n times, and its intermediates need
no arena space.

The program (attribute `program`, a list of strings) is one step per entry,
`<Op> <operand> ... [key=value ...]`: operands are `x<k>` (input k of the
node, broadcast numpy-style to the output) or `t<j>` (the result of step j);
the last step is the output. Ops are ONNX ops under their ONNX names
(attributes under their ONNX names too: `Clip t0 min=0.0 max=6.0`), plus
`Silu` (x * sigmoid(x)). `backends/numba_cpu/fused.py` lowers it.

A producer joins its reader's group when every reader of its output is in the
group (so nothing outside needs the intermediate), its output has as many
elements as the group's output (a small tensor broadcast into a large one
would be recomputed per element), and the group stays within `max_ops` ops
and `max_inputs` distinct inputs. Only float tensors of one dtype fuse.
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cuvil.ir import Graph, Node
from cuvil.ops import FUSIBLE, FUSIBLE_BINARY, FUSIBLE_UNARY, FUSIBLE_WITH_ATTRS

from ._rewrite import drop_unused_values, scalar

DOMAIN = "cuvil"
OP = "FusedElementwise"

# The ops a program computes, and the attributes it keeps for those with some: cuvil/ops.py.
UNARY, BINARY, WITH_ATTRS = FUSIBLE_UNARY, FUSIBLE_BINARY, FUSIBLE_WITH_ATTRS


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    max_ops: int = Field(16, ge=2)      # ops in one fused loop
    max_inputs: int = Field(8, ge=1)    # distinct tensors one fused loop reads


def fused_node(name: str, inputs: list[str], output: str, program: list[str]) -> Node:
    return Node(OP, name, list(inputs), [output], {"program": list(program)}, domain=DOMAIN)


def parse_step(step: str) -> tuple[str, list[str], dict]:
    """'Clip t0 min=0.0' -> ('Clip', ['t0'], {'min': 0.0})."""
    op, *rest = step.split()
    operands = [r for r in rest if "=" not in r]
    attrs = {}
    for item in (r for r in rest if "=" in r):
        key, text = item.split("=", 1)
        try:
            attrs[key] = float(text)
        except ValueError:
            attrs[key] = text
    return op, operands, attrs


def _format_attrs(attrs: dict) -> str:
    return "".join(f" {k}={v!r}" if isinstance(v, float) else f" {k}={v}" for k, v in attrs.items())


def _step_attrs(node: Node, graph: Graph) -> dict | None:
    """The attributes a program step keeps for `node`, or None when the node cannot be a step."""
    if node.op == "Clip":
        attrs = {}
        for key, k in (("min", 1), ("max", 2)):
            if len(node.inputs) > k and node.inputs[k]:
                bound = scalar(graph, node.inputs[k])
                if bound is None:
                    return None
                attrs[key] = bound
            elif node.attr(key) is not None:
                attrs[key] = float(node.attr(key))
        return attrs
    defaults = WITH_ATTRS.get(node.op, {})
    attrs = {}
    for key, default in defaults.items():
        value = node.attr(key, default)
        if isinstance(value, bytes):
            value = value.decode()
        attrs[key] = float(value) if isinstance(default, float) else value
    return attrs


def _data_inputs(node: Node) -> list[str]:
    """The tensor operands of a step (Clip's bounds become attributes)."""
    return list(node.inputs[:1]) if node.op == "Clip" else [i for i in node.inputs if i]


def _fusible(node: Node, graph: Graph) -> bool:
    if node.op == OP and node.domain == DOMAIN:
        return True
    if node.domain or node.op not in FUSIBLE or len(node.outputs) != 1:
        return False
    if node.op in BINARY and len(node.inputs) != 2 or node.op in UNARY and len(node.inputs) != 1:
        return False
    names = _data_inputs(node) + node.outputs
    dtypes = {np.dtype(graph.values[n].dtype) for n in names}
    return len(dtypes) == 1 and next(iter(dtypes)).kind == "f" and _step_attrs(node, graph) is not None


def _group(graph: Graph, root: Node, fusible, consumers, producers, index, options: Options) -> list[Node]:
    """Grow a group from its root: absorb producers while they qualify (latest first)."""
    size = graph.values[root.outputs[0]].size
    members = {root.name: root}
    ops = lambda: sum(len(n.attrs["program"]) if n.op == OP else 1 for n in members.values())
    while True:
        outside = {i for n in members.values() for i in _data_inputs(n)} - {n.outputs[0] for n in members.values()}
        candidates = sorted((producers[v] for v in outside if v in producers and producers[v].name in fusible),
                            key=lambda n: -index[n.name])
        added = False
        for cand in candidates:
            out = cand.outputs[0]
            if cand.name in members or out in graph.outputs or graph.values[out].size != size:
                continue
            if any(u.name not in members for u in consumers.get(out, [])):
                continue
            extra = len(cand.attrs["program"]) if cand.op == OP else 1
            if ops() + extra > options.max_ops:
                continue
            trial = {**members, cand.name: cand}
            if len(_external_inputs(graph, trial.values())) > options.max_inputs:
                continue
            members = trial
            added = True
            break
        if not added:
            return sorted(members.values(), key=lambda n: index[n.name])


def _external_inputs(graph: Graph, members) -> list[str]:
    """The tensors a group reads from outside (one-element constants become literals)."""
    produced = {n.outputs[0] for n in members}
    seen = []
    for n in members:
        for i in _data_inputs(n):
            if i not in produced and i not in seen and scalar(graph, i) is None:
                seen.append(i)
    return seen


def build_program(graph: Graph, members: list[Node]) -> tuple[list[str], list[str]]:
    """(node inputs, program) of a group given in topological order; the last member is the root."""
    inputs = _external_inputs(graph, members)
    names = {v: f"x{k}" for k, v in enumerate(inputs)}
    program = []
    for n in members:
        if n.op == OP:  # a fused node joins by inlining its program
            local = {f"x{k}": names.get(v) or repr(scalar(graph, v)) for k, v in enumerate(n.inputs)}
            base = len(program)
            for step in n.attrs["program"]:
                op, operands, attrs = parse_step(step)
                mapped = [local.get(o) or (f"t{base + int(o[1:])}" if o.startswith("t") else o) for o in operands]
                program.append(" ".join([op, *mapped]) + _format_attrs(attrs))
        else:
            operands = [names.get(i) or repr(scalar(graph, i)) for i in _data_inputs(n)]
            program.append(" ".join([n.op, *operands]) + _format_attrs(_step_attrs(n, graph)))
        names[n.outputs[0]] = f"t{len(program) - 1}"
    return inputs, program


def fuse_elementwise(graph: Graph, options: Options = Options()) -> Graph:
    fusible = {n.name for n in graph.nodes if _fusible(n, graph)}
    consumers, producers = graph.consumers(), graph.producers()
    index = {n.name: k for k, n in enumerate(graph.nodes)}
    groups, grouped = [], set()
    for node in reversed(graph.nodes):
        if node.name not in fusible or node.name in grouped:
            continue
        members = _group(graph, node, fusible, consumers, producers, index, options)
        grouped.update(n.name for n in members)
        if len(members) > 1:
            groups.append(members)
    if not groups:
        return graph
    result = graph.copy()
    replace = {}
    for members in groups:
        inputs, program = build_program(graph, members)
        root = members[-1]
        replace[root.name] = fused_node(root.name, inputs, root.outputs[0], program)
        replace.update({n.name: None for n in members[:-1]})
    result.nodes = [replace.get(n.name, n) for n in result.nodes if replace.get(n.name, n) is not None]
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    def programs(graph):
        return {(n.name, tuple(n.attrs["program"])) for n in graph.nodes if n.op == OP and n.domain == DOMAIN}
    new = programs(after) - programs(before)
    if not new:
        return ""
    sizes = [len(program) for _, program in new]
    return f"{sum(sizes)} elementwise ops fused into {len(new)} loops (largest: {max(sizes)} ops)"
