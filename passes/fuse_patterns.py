"""fuse_patterns: functions that exporters write as many small ops become one op.

    LayerNorm  (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) * gamma + beta
               -> LayerNormalization(x, gamma, beta; axis, epsilon)
    RMSNorm    x / sqrt(mean(x^2) + eps) * gamma  (T5's and LLaMA's norm; the division may be
               x * (1 / sqrt(.)) or x * Reciprocal(sqrt(.)))
               -> SimplifiedLayerNormalization(x, gamma; axis, epsilon)  (onnxruntime's op, in
               the default domain; cuvil/contrib.py)
    Softmax    exp(x - max(x)) / sum(exp(x - max(x)))  (max optional)  -> Softmax(x; axis)
    GELU       x/2 * (1 + erf(x / sqrt 2)), or the tanh form           -> Gelu
    SiLU       x * sigmoid(x)                                          -> FusedElementwise [Silu]
    HardSwish  x * clip(x + 3, 0, 6) / 6                               -> HardSwish
    HardSigmoid clip(x + 3, 0, 6) / 6                                  -> HardSigmoid(1/6, 1/2)

One kernel then reads the input once, instead of 5 to 10 kernels each
writing a tensor. LayerNorm and Softmax are matched by structure (the
reductions are the anchor). The unary functions are written in many
equivalent ways (x*0.5 or x/2, the product in either order, Pow(x, 3) or
x*x*x), so they are matched by what they compute: a *unary region* is a set of
elementwise nodes whose only non-constant input is one value x, whose
constants are scalars and whose intermediate results are read inside the
region alone; the check evaluates it (in float64) at fixed points spanning
[-1000, 1000] and compares with each candidate function. A region of that
form agreeing with a candidate at all of them computes that function.

Gelu is an ONNX op from opset 20 and HardSwish from opset 14: for older
models the function becomes a one-step FusedElementwise (the same kernel).
Does not fire when an intermediate is read outside the pattern, when the
reduction is not over the last axes (LayerNorm, RMSNorm) or not over one axis
(Softmax), when RMSNorm's input is not float32 (the op's kernel is float32 only),
or when a region's function is none of the candidates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict

from cuvil.ir import Graph, Node

from ._rewrite import add_constant, const_data, drop_unused_values, scalar
from .fuse_elementwise import fused_node

PATTERNS = ("layernorm", "rmsnorm", "softmax", "gelu", "silu", "hardswish", "hardsigmoid")


def _known_patterns(names):
    unknown = [p for p in names if p not in PATTERNS]
    if unknown:
        raise ValueError(f"unknown pattern {unknown[0]!r} (known: {', '.join(PATTERNS)})")
    return names


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    patterns: Annotated[list[str], AfterValidator(_known_patterns)] = list(PATTERNS)


@dataclass
class Match:
    kind: str
    root: Node
    nodes: set[str]          # names of every node the pattern replaces (the root included)
    replacement: Node | None = None  # built by the matcher
    constants: dict = None   # name base -> array, added to the graph when the match is applied


class _Context:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.producers = graph.producers()
        self.consumers = graph.consumers()

    def made_by(self, value: str, *ops) -> Node | None:
        node = self.producers.get(value)
        return node if node is not None and node.op in ops and not node.domain else None

    def private(self, nodes: list[Node], root: Node) -> bool:
        """Every output of every non-root node is read by pattern nodes only (and is no graph output)."""
        names = {n.name for n in nodes}
        for n in nodes:
            if n is root:
                continue
            for out in n.outputs:
                if out in self.graph.outputs or any(u.name not in names for u in self.consumers.get(out, [])):
                    return False
        return True


def _axes(ctx: _Context, node: Node, rank: int) -> list[int] | None:
    """The reduction axes of a Reduce* node (attribute or constant input), as sorted positive ints."""
    if int(node.attr("keepdims", 1)) != 1:
        return None
    axes = node.attr("axes")
    if len(node.inputs) > 1 and node.inputs[1]:
        data = const_data(ctx.graph, node.inputs[1])
        if data is None:
            return None
        axes = data.reshape(-1).tolist()
    if axes is None or len(axes) == 0:
        return None
    return sorted(int(a) % rank for a in axes)


def _other(node: Node, value: str) -> str | None:
    """The input of a binary node that is not `value` (None if `value` is not an input)."""
    if len(node.inputs) != 2 or value not in node.inputs:
        return None
    return node.inputs[1] if node.inputs[0] == value else node.inputs[0]


# -- LayerNorm -----------------------------------------------------------------------------

def _normalized_param(ctx, name, x_shape, axis, dtype):
    """gamma/beta as an array of the normalized shape, when it broadcasts over those dims only."""
    data = const_data(ctx.graph, name)
    norm_shape = tuple(x_shape[axis:])
    if data is None:
        return None
    padded = (1,) * (len(x_shape) - data.ndim) + tuple(data.shape)
    if len(padded) != len(x_shape) or any(d != 1 for d in padded[:axis]):
        return None
    try:
        return np.ascontiguousarray(np.broadcast_to(data.reshape(padded[axis:]), norm_shape)).astype(dtype)
    except ValueError:
        return None


def _match_layernorm(ctx: _Context, root: Node) -> Match | None:
    g = ctx.graph
    node, beta, gamma = root, None, None
    if node.op == "Add" and not node.domain:                  # ... + beta
        for k in (0, 1):
            inner = ctx.made_by(node.inputs[k], "Mul", "Div")
            if inner is not None and const_data(g, node.inputs[1 - k]) is not None:
                beta, node = node.inputs[1 - k], inner
                break
        else:
            return None
    chain = [root] if beta else []
    gamma, inner = _scaled(ctx, node, _normalizer)             # ... * gamma
    if gamma is not None:
        chain, node = chain + [node], inner
    found = _normalizer(ctx, node)
    if found is None:
        return None
    x, eps, axis, parts = found
    nodes = chain + [node] + parts
    if not ctx.private(nodes, root):
        return None
    x_value = g.values[x]
    dtype = np.dtype(x_value.dtype)
    if dtype.kind != "f" or tuple(g.values[root.outputs[0]].shape) != tuple(x_value.shape):
        return None
    constants = {}
    for key, name, default in (("scale", gamma, 1.0), ("bias", beta, None)):
        if name is None:
            if default is not None:
                constants[key] = np.full(x_value.shape[axis:], default, dtype)
            continue
        array = _normalized_param(ctx, name, x_value.shape, axis, dtype)
        if array is None:
            return None
        constants[key] = array
    replacement = Node("LayerNormalization", root.name, [x], [root.outputs[0]],
                       {"axis": axis, "epsilon": eps})
    return Match("layernorm", root, {n.name for n in nodes}, replacement, constants)


def _scaled(ctx: _Context, node: Node, normalizer) -> tuple:
    """(gamma, inner) when `node` is Mul(inner, gamma) with gamma a constant and `normalizer(ctx,
    inner)` a match (LayerNorm's and RMSNorm's scale), else (None, None)."""
    if node.op == "Mul":
        for k in (0, 1):
            inner = ctx.made_by(node.inputs[k], "Div", "Mul")
            if inner is not None and const_data(ctx.graph, node.inputs[1 - k]) is not None and normalizer(ctx, inner):
                return node.inputs[1 - k], inner
    return None, None


def _mean_square_plus_eps(ctx: _Context, add: Node, d: str):
    """(ReduceMean node, eps, square node) when `add` is ReduceMean(d * d or d ^ 2) + eps (LayerNorm's
    variance and RMSNorm's mean square), else None."""
    g = ctx.graph
    var, eps = None, None
    for k in (0, 1):
        if scalar(g, add.inputs[1 - k]) is not None:
            var, eps = ctx.made_by(add.inputs[k], "ReduceMean"), scalar(g, add.inputs[1 - k])
    if var is None:
        return None
    square = ctx.made_by(var.inputs[0], "Pow", "Mul")
    if square is None or not (square.op == "Pow" and square.inputs[0] == d and scalar(g, square.inputs[1]) == 2.0
                              or square.op == "Mul" and square.inputs == [d, d]):
        return None
    return var, eps, square


def _normalizer(ctx: _Context, node: Node):
    """(x, eps, axis, nodes) when `node` computes (x - mean) / sqrt(var + eps), else None."""
    g = ctx.graph
    if node.op == "Div":
        d, denom = node.inputs
        sqrt = ctx.made_by(denom, "Sqrt")
        extra = []
    elif node.op == "Mul":
        for d, r in (node.inputs, node.inputs[::-1]):
            recip = ctx.made_by(r, "Reciprocal")
            if recip is not None:
                break
        else:
            return None
        sqrt, extra = ctx.made_by(recip.inputs[0], "Sqrt"), [recip]
    else:
        return None
    sub = ctx.made_by(d, "Sub")
    if sqrt is None or sub is None:
        return None
    x, mean = sub.inputs
    mean_node = ctx.made_by(mean, "ReduceMean")
    add = ctx.made_by(sqrt.inputs[0], "Add")
    if mean_node is None or add is None or mean_node.inputs[0] != x:
        return None
    found = _mean_square_plus_eps(ctx, add, d)
    if found is None:
        return None
    var, eps, square = found
    rank = len(g.values[x].shape)
    axes, var_axes = _axes(ctx, mean_node, rank), _axes(ctx, var, rank)
    if axes is None or axes != var_axes or axes != list(range(rank - len(axes), rank)):
        return None
    return x, eps, axes[0], [sub, mean_node, square, var, add, sqrt] + extra


# -- RMSNorm ------------------------------------------------------------------------------

def _inverse_root(ctx: _Context, value: str):
    """(sqrt node, extra nodes) when `value` is 1 / sqrt(.) as Reciprocal(Sqrt) or Div(1, Sqrt)."""
    recip = ctx.made_by(value, "Reciprocal")
    if recip is not None:
        sqrt = ctx.made_by(recip.inputs[0], "Sqrt")
        return (sqrt, [recip]) if sqrt is not None else None
    div = ctx.made_by(value, "Div")
    if div is not None and scalar(ctx.graph, div.inputs[0]) == 1.0:
        sqrt = ctx.made_by(div.inputs[1], "Sqrt")
        return (sqrt, [div]) if sqrt is not None else None
    return None


def _rms_normalizer(ctx: _Context, node: Node):
    """(x, eps, axis, nodes) when `node` computes x / sqrt(mean(x^2) + eps), else None."""
    g = ctx.graph
    if node.op == "Div":
        x, sqrt, extra = node.inputs[0], ctx.made_by(node.inputs[1], "Sqrt"), []
    elif node.op == "Mul":
        for x, r in (node.inputs, node.inputs[::-1]):
            found = _inverse_root(ctx, r)
            if found is not None:
                sqrt, extra = found
                break
        else:
            return None
    else:
        return None
    add = ctx.made_by(sqrt.inputs[0], "Add") if sqrt is not None else None
    if add is None:
        return None
    found = _mean_square_plus_eps(ctx, add, x)
    if found is None:
        return None
    var, eps, square = found
    rank = len(g.values[x].shape)
    axes = _axes(ctx, var, rank)
    if axes is None or axes != list(range(rank - len(axes), rank)):
        return None
    return x, eps, axes[0], [square, var, add, sqrt] + extra


def _match_rmsnorm(ctx: _Context, root: Node) -> Match | None:
    g = ctx.graph
    node, gamma, chain = root, None, []
    if not root.domain:                                        # ... * gamma
        gamma, inner = _scaled(ctx, root, _rms_normalizer)
        if gamma is not None:
            chain, node = [root], inner
    found = _rms_normalizer(ctx, node)
    if found is None:
        return None
    x, eps, axis, parts = found
    nodes = chain + [node] + parts
    if not ctx.private(nodes, root):
        return None
    x_value = g.values[x]
    if np.dtype(x_value.dtype) != np.float32 or tuple(g.values[root.outputs[0]].shape) != tuple(x_value.shape):
        return None
    scale = (np.ones(x_value.shape[axis:], np.float32) if gamma is None
             else _normalized_param(ctx, gamma, x_value.shape, axis, np.float32))
    if scale is None:
        return None
    replacement = Node("SimplifiedLayerNormalization", root.name, [x], [root.outputs[0]],
                       {"axis": axis, "epsilon": eps})
    return Match("rmsnorm", root, {n.name for n in nodes}, replacement, {"scale": scale})


# -- Softmax ---------------------------------------------------------------------------------

def _match_softmax(ctx: _Context, root: Node) -> Match | None:
    g = ctx.graph
    if root.op != "Div" or root.domain or g.opset < 13:
        return None
    e, s = root.inputs
    exp, total = ctx.made_by(e, "Exp"), ctx.made_by(s, "ReduceSum")
    if exp is None or total is None or total.inputs[0] != e:
        return None
    rank = len(g.values[e].shape)
    axes = _axes(ctx, total, rank)
    if axes is None or len(axes) != 1:
        return None
    x, nodes = exp.inputs[0], [root, exp, total]
    sub = ctx.made_by(x, "Sub")
    if sub is not None:
        peak = ctx.made_by(sub.inputs[1], "ReduceMax")
        if peak is not None and peak.inputs[0] == sub.inputs[0] and _axes(ctx, peak, rank) == axes:
            x, nodes = sub.inputs[0], nodes + [sub, peak]
    if not ctx.private(nodes, root) or np.dtype(g.values[x].dtype).kind != "f":
        return None
    return Match("softmax", root, {n.name for n in nodes}, Node("Softmax", root.name, [x], [root.outputs[0]],
                                                                  {"axis": axes[0]}))


# -- unary functions, matched by what they compute --------------------------------------------

_ERF = np.vectorize(math.erf, otypes=[np.float64])
_PROBES = np.concatenate([np.linspace(-8, 8, 161), [-1000.0, -100.0, -30.0, -12.5, 12.5, 30.0, 100.0, 1000.0]])


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


FUNCTIONS = {
    "gelu": lambda x: 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x * _sigmoid(x),
    "hardswish": lambda x: x * np.clip(x + 3.0, 0.0, 6.0) / 6.0,
    "hardsigmoid": lambda x: np.clip(x + 3.0, 0.0, 6.0) / 6.0,
}

_UNARY_NP = {
    "Relu": lambda a: np.maximum(a, 0.0), "Neg": np.negative, "Abs": np.abs, "Sqrt": np.sqrt, "Exp": np.exp,
    "Log": np.log, "Tanh": np.tanh, "Erf": _ERF, "Sigmoid": _sigmoid, "Reciprocal": lambda a: 1.0 / a,
    "HardSwish": FUNCTIONS["hardswish"], "Identity": lambda a: a,
}
_BINARY_NP = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
              "Max": np.maximum, "Min": np.minimum}
_REGION_OPS = set(_UNARY_NP) | set(_BINARY_NP) | {"Clip", "HardSigmoid", "LeakyRelu"}
_MAX_REGION = 12


def _evaluate(ctx: _Context, nodes: list[Node], x: str, probes: np.ndarray) -> np.ndarray | None:
    g = ctx.graph
    env = {x: probes}

    def get(name):
        if name in env:
            return env[name]
        return float(scalar(g, name))

    for n in nodes:
        if n.op in _UNARY_NP:
            env[n.outputs[0]] = _UNARY_NP[n.op](get(n.inputs[0]))
        elif n.op in _BINARY_NP:
            env[n.outputs[0]] = _BINARY_NP[n.op](get(n.inputs[0]), get(n.inputs[1]))
        elif n.op == "Clip":
            lo = get(n.inputs[1]) if len(n.inputs) > 1 and n.inputs[1] else n.attr("min", -np.inf)
            hi = get(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] else n.attr("max", np.inf)
            env[n.outputs[0]] = np.clip(get(n.inputs[0]), lo, hi)
        elif n.op == "HardSigmoid":
            a = get(n.inputs[0])
            env[n.outputs[0]] = np.clip(a * n.attr("alpha", 0.2) + n.attr("beta", 0.5), 0.0, 1.0)
        elif n.op == "LeakyRelu":
            a = get(n.inputs[0])
            env[n.outputs[0]] = np.where(a >= 0, a, a * n.attr("alpha", 0.01))
        else:
            return None
    return np.broadcast_to(env[nodes[-1].outputs[0]], probes.shape)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    both_nan = np.isnan(got) & np.isnan(want)
    close = np.abs(got - want) <= 1e-6 * np.maximum(1.0, np.abs(want))
    return bool(np.all(both_nan | close))


def _region_op(ctx: _Context, node: Node | None) -> bool:
    if node is None or node.domain or node.op not in _REGION_OPS or len(node.outputs) != 1:
        return False
    return np.dtype(ctx.graph.values[node.outputs[0]].dtype).kind == "f"


def _match_unary(ctx: _Context, root: Node, wanted: set[str]) -> Match | None:
    g = ctx.graph
    if not _region_op(ctx, root):
        return None
    # The cone: elementwise nodes upstream of the root (bounded), in topological order.
    cone, frontier = {root.name: root}, [root]
    while frontier and len(cone) < _MAX_REGION:
        node = frontier.pop()
        for i in node.inputs:
            p = ctx.producers.get(i)
            if i and p is not None and p.name not in cone and _region_op(ctx, p) and len(cone) < _MAX_REGION:
                cone[p.name] = p
                frontier.append(p)
    order = {n.name: k for k, n in enumerate(g.nodes)}
    ordered = sorted(cone.values(), key=lambda n: order[n.name])
    candidates = [i for n in ordered for i in n.inputs if i and scalar(g, i) is None]
    for x in dict.fromkeys(candidates):          # farthest first: the largest region wins
        if g.values[x].shape != g.values[root.outputs[0]].shape:
            continue
        depends = {x}
        region = []
        for n in ordered:
            if any(i in depends for i in n.inputs):
                depends.add(n.outputs[0])
                region.append(n)
        if len(region) < 2 or region[-1] is not root:
            continue
        inside = {x} | {n.outputs[0] for n in region}
        if any(i and i not in inside and scalar(g, i) is None for n in region for i in n.inputs):
            continue
        if not ctx.private(region, root):
            continue
        with np.errstate(all="ignore"):
            got = _evaluate(ctx, region, x, _PROBES)
            if got is None:
                continue
            for kind in FUNCTIONS:
                if kind.split("_")[0] in wanted and _same(got, FUNCTIONS[kind](_PROBES)):
                    return Match(kind, root, {n.name for n in region}, _unary_node(g, kind, root, x))
    return None


def _unary_node(g: Graph, kind: str, root: Node, x: str) -> Node:
    out = root.outputs[0]
    if kind in ("gelu", "gelu_tanh"):
        approximate = "tanh" if kind == "gelu_tanh" else "none"
        if g.opset >= 20:
            return Node("Gelu", root.name, [x], [out], {"approximate": approximate})
        return fused_node(root.name, [x], out, [f"Gelu x0 approximate={approximate}"])
    if kind == "hardswish":
        if g.opset >= 14:
            return Node("HardSwish", root.name, [x], [out])
        return fused_node(root.name, [x], out, ["HardSwish x0"])
    if kind == "hardsigmoid":
        return Node("HardSigmoid", root.name, [x], [out], {"alpha": 1.0 / 6.0, "beta": 0.5})
    return fused_node(root.name, [x], out, ["Silu x0"])


# -- the pass ------------------------------------------------------------------------------------

def fuse_patterns(graph: Graph, options: Options = Options()) -> Graph:
    ctx = _Context(graph)
    wanted = set(options.patterns)
    matches, claimed = [], set()
    # From the last node back, so the root of a pattern is seen before its insides.
    for root in reversed(graph.nodes):
        if root.name in claimed:
            continue
        match = None
        if "layernorm" in wanted:
            match = _match_layernorm(ctx, root)
        if match is None and "rmsnorm" in wanted:
            match = _match_rmsnorm(ctx, root)
        if match is None and "softmax" in wanted:
            match = _match_softmax(ctx, root)
        if match is None and wanted & {"gelu", "silu", "hardswish", "hardsigmoid"}:
            match = _match_unary(ctx, root, wanted)
        if match is not None and not match.nodes & claimed:
            matches.append(match)
            claimed |= match.nodes
    if not matches:
        return graph
    result = graph.copy()
    by_root = {}
    for match in matches:
        node = match.replacement
        for key in ("scale", "bias"):
            if match.constants and key in match.constants:
                node.inputs.append(add_constant(result, f"{node.name}_{key}", match.constants[key]))
        by_root[match.root.name] = node
    result.nodes = [by_root.get(n.name, n) for n in result.nodes if n.name not in claimed or n.name in by_root]
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    removed = len(before.nodes) - len(after.nodes)
    made = []
    counts_b, counts_a = before.op_counts(), after.op_counts()
    for op in ("LayerNormalization", "SimplifiedLayerNormalization", "Softmax", "Gelu", "HardSwish", "HardSigmoid"):
        if counts_a.get(op, 0) > counts_b.get(op, 0):
            made.append(f"{counts_a[op] - counts_b.get(op, 0)} {op}")
    fused = lambda g: [n.attrs["program"][0].split()[0] for n in g.nodes if n.op == "FusedElementwise"
                       and len(n.attrs["program"]) == 1]
    steps_b, steps_a = fused(before), fused(after)
    for step in sorted(set(steps_a)):
        if steps_a.count(step) > steps_b.count(step):
            made.append(f"{steps_a.count(step) - steps_b.count(step)} {step} (FusedElementwise)")
    return f"{', '.join(made)} from {removed + sum(int(m.split()[0]) for m in made)} nodes" if made else ""
