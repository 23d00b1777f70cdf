"""fuse_activation: an activation (and a residual Add before it) become the epilogue
of the Conv, Gemm or MatMul that feeds them.

    act(Conv(x, W, b) + r)  ->  cuvil.FusedConv(x, W, b, r; activation=act, has_residual=1)

The result is written once, while it is still in registers, instead of being
written by the Conv, read and written again by the Add, and again by the
activation. The fused ops are in the "cuvil" domain and keep the attributes
of the op they extend, plus

    activation         "", "Relu", "Clip", "Sigmoid", "HardSwish", "HardSigmoid", "LeakyRelu", "Tanh"
    activation_params  Clip [min, max], LeakyRelu [alpha], HardSigmoid [alpha, beta]; [] otherwise
    has_residual       1 when the last input is added before the activation

A Reshape (Flatten, Squeeze, Unsqueeze) right after the anchor is looked
through: exporters write a linear layer on (batch, seq, d) as Reshape -> Gemm
-> Reshape, and its residual Add comes after the second Reshape. The fused
node then works in the anchor's shape (the residual is viewed as it, which
costs nothing) and the Reshape follows it.

Does not fire when an intermediate result is read by anything else (or is a
graph output), when a Clip bound is not a constant, when the residual has
another shape than the output (no broadcasting), or for an activation before
the Add (act(op) + r is not an epilogue of this form).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict

from cuvil.ir import Graph, Node
from cuvil.ops import EPILOGUE_ACTIVATIONS, EPILOGUE_ANCHORS, RESHAPE_OPS

from ._rewrite import (add_constant, add_value, const_data, drop_unused_values, is_float, node_names, only_reader,
                       unique_node_name)

ANCHORS = EPILOGUE_ANCHORS
ACTIVATIONS = EPILOGUE_ACTIVATIONS


def _known_activations(names):
    unknown = [a for a in names if a not in ACTIVATIONS]
    if unknown:
        raise ValueError(f"unknown activation {unknown[0]!r} (known: {', '.join(ACTIVATIONS)})")
    return names


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    residual: bool = True        # also fuse an Add of a same-shaped tensor before the activation
    # The activations that may be fused.
    activations: Annotated[list[str], AfterValidator(_known_activations)] = list(ACTIVATIONS)


def activation_params(graph: Graph, node: Node) -> list[float] | None:
    """The contract's activation_params of an activation node, or None when they are not constants."""
    if node.op == "LeakyRelu":
        return [float(node.attr("alpha", 0.01))]
    if node.op == "HardSigmoid":
        return [float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))]
    if node.op != "Clip":
        return []
    bounds = [node.attr("min", -np.inf), node.attr("max", np.inf)]
    for k in (1, 2):
        if len(node.inputs) > k and node.inputs[k]:
            data = const_data(graph, node.inputs[k])
            if data is None or data.size != 1:
                return None
            bounds[k - 1] = data.reshape(-1)[0]
    return [float(b) for b in bounds]


@dataclass
class _Plan:
    absorbed: list            # the nodes after the anchor that the fused node replaces, in order
    residual: str | None      # the tensor added before the activation
    act: Node | None          # the activation
    view: Node | None = None  # a Reshape-like node between the anchor and the rest (looked through)


def _plan(graph: Graph, anchor: Node, consumers, options: Options) -> _Plan | None:
    if anchor.op not in ANCHORS or anchor.domain or not is_float(graph, anchor.outputs[0]):
        return None
    dtype = np.dtype(graph.values[anchor.outputs[0]].dtype)
    plan = _Plan([], None, None)
    nxt = only_reader(graph, consumers, anchor.outputs[0])
    # A view between them (a linear layer on (batch, seq, d) is Reshape -> Gemm -> Reshape) is
    # looked through: the epilogue works on the anchor's shape, the view moves after it.
    if nxt is not None and nxt.op in RESHAPE_OPS and not nxt.domain:
        plan.view, nxt = nxt, only_reader(graph, consumers, nxt.outputs[0])
    shape = tuple(graph.values[(plan.view or anchor).outputs[0]].shape)
    last = (plan.view or anchor).outputs[0]
    if nxt is not None and options.residual and nxt.op == "Add" and not nxt.domain and len(nxt.inputs) == 2 \
            and nxt.inputs[0] != nxt.inputs[1]:
        other = nxt.inputs[1] if nxt.inputs[0] == last else nxt.inputs[0]
        value = graph.values[other]
        if tuple(value.shape) == shape and np.dtype(value.dtype) == dtype:
            plan.absorbed.append(nxt)
            plan.residual = other
            nxt = only_reader(graph, consumers, nxt.outputs[0])
    if nxt is not None and nxt.op in options.activations and not nxt.domain \
            and tuple(graph.values[nxt.outputs[0]].shape) == shape and activation_params(graph, nxt) is not None:
        plan.absorbed.append(nxt)
        plan.act = nxt
    return plan if plan.absorbed else None


def fuse_activation(graph: Graph, options: Options = Options()) -> Graph:
    consumers = graph.consumers()
    plans, claimed = {}, set()
    for node in graph.nodes:
        plan = _plan(graph, node, consumers, options)
        if plan is None or any(n.name in claimed for n in plan.absorbed):
            continue
        plans[node.name] = plan
        claimed.update(n.name for n in plan.absorbed + ([plan.view] if plan.view else []))
    if not plans:
        return graph
    result = graph.copy()
    taken = node_names(result)
    by_name = {n.name: n for n in result.nodes}
    # The fused node takes the place of the last node it absorbs: every input it reads
    # (the residual included) is defined by then.
    placed_at = {plan.absorbed[-1].name: anchor for anchor, plan in plans.items()}
    nodes = []
    for node in result.nodes:
        if node.name in plans or node.name in claimed and node.name not in placed_at:
            continue
        if node.name not in placed_at:
            nodes.append(node)
            continue
        anchor = by_name[placed_at[node.name]]
        plan = plans[anchor.name]
        out = plan.absorbed[-1].outputs[0]
        fused = Node(ANCHORS[anchor.op], anchor.name, list(anchor.inputs), [out],
                     {**anchor.attrs, "activation": plan.act.op if plan.act else "",
                      "activation_params": activation_params(graph, plan.act) if plan.act else [],
                      "has_residual": int(plan.residual is not None)}, domain="cuvil")
        residual = plan.residual
        if plan.view is not None:
            # residual viewed as the anchor's shape -> fused -> viewed back as the chain's output.
            inner = result.values[anchor.outputs[0]]
            inner_shape = add_constant(result, f"{anchor.name}_shape", np.array(inner.shape, np.int64))
            if residual is not None:
                viewed = add_value(result, f"{residual}_as_{anchor.name}", inner.dtype, inner.shape)
                nodes.append(Node("Reshape", unique_node_name(taken, f"{anchor.name}_residual_view"),
                                  [residual, inner_shape], [viewed]))
                residual = viewed
            fused.outputs = [add_value(result, f"{out}_{anchor.name}", inner.dtype, inner.shape)]
            out_shape = add_constant(result, f"{out}_shape", np.array(result.values[out].shape, np.int64))
        if residual is not None:
            fused.inputs.append(residual)
        nodes.append(fused)
        if plan.view is not None:
            nodes.append(Node("Reshape", plan.view.name, [fused.outputs[0], out_shape], [out]))
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    def epilogues(graph):
        acts, residuals = {}, 0
        for n in graph.nodes:
            if n.domain == "cuvil" and n.op in ANCHORS.values():
                if n.attr("activation"):
                    acts[n.attr("activation")] = acts.get(n.attr("activation"), 0) + 1
                residuals += int(n.attr("has_residual", 0))
        return acts, residuals
    (acts_b, res_b), (acts_a, res_a) = epilogues(before), epilogues(after)
    parts = [f"{acts_a[a] - acts_b.get(a, 0)} {a}" for a in sorted(acts_a) if acts_a[a] > acts_b.get(a, 0)]
    if res_a > res_b:
        parts.append(f"{res_a - res_b} residual Add")
    hosts = sorted({n.op.replace("Fused", "") for n in after.nodes if n.domain == "cuvil" and n.op in ANCHORS.values()})
    return f"{', '.join(parts)} fused into {'/'.join(hosts)} epilogues" if parts else ""
