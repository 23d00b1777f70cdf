"""simplify_shapes: chains of shape-only ops collapse to one Reshape.

    Unsqueeze(Flatten(Reshape(x)))  ->  Reshape(x, <final shape>)
    Reshape(x) to x's own shape     ->  x
    Transpose that only moves dims of size 1  ->  Reshape (the bytes are already in order)

With static shapes every Reshape, Flatten, Squeeze and Unsqueeze is a
reinterpretation of the same bytes, fully described by its output shape, so a
chain of them is one Reshape of the chain's first input; intermediate results
nothing else reads disappear. (Shape arithmetic such as Shape/Gather/Concat
feeding a Reshape was already folded by the frontend, which knows every shape.)

Does not fire on a shape op that writes a graph output from a graph input of
the same shape (something must still write the output), nor on a Transpose
that really moves data.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph, Node
from cuvil.ops import RESHAPE_OPS

from ._rewrite import add_constant, drop_unused_values, replace_uses



def _moves_only_unit_dims(shape, perm) -> bool:
    kept = [p for p in perm if shape[p] != 1]
    return kept == sorted(kept)


def _is_view(node: Node, graph: Graph) -> bool:
    if node.domain:
        return False
    if node.op in RESHAPE_OPS:
        return True
    if node.op == "Transpose":
        shape = graph.values[node.inputs[0]].shape
        perm = node.attr("perm") or list(reversed(range(len(shape))))
        return _moves_only_unit_dims(shape, list(perm))
    return False


def simplify_shapes(graph: Graph) -> Graph:
    producers = graph.producers()
    views = {n.name for n in graph.nodes if _is_view(n, graph)}

    def rewritten(node):
        if node.name not in views:
            return False
        from_view = producers.get(node.inputs[0]) is not None and producers[node.inputs[0]].name in views
        same = graph.values[node.inputs[0]].shape == graph.values[node.outputs[0]].shape
        return node.name in views and (from_view or node.op == "Transpose" or
                                       same and node.outputs[0] not in graph.outputs)

    if not any(rewritten(n) for n in graph.nodes):
        return graph
    result = graph.copy()
    source = {}  # view output -> the first value of its chain of views
    kept = []
    for node in result.nodes:
        if node.name not in views:
            kept.append(node)
            continue
        src = source.get(node.inputs[0], node.inputs[0])
        out = node.outputs[0]
        source[out] = src
        out_shape = result.values[out].shape
        if result.values[src].shape == out_shape and out not in result.outputs:
            replace_uses(result, out, src)
        elif rewritten(node):
            shape = add_constant(result, f"{node.name}_shape", np.array(out_shape, np.int64))
            kept.append(Node("Reshape", node.name, [src, shape], [out], {"allowzero": 1} if 0 in out_shape else {}))
        else:
            kept.append(node)
    # Views whose readers now read the chain's source are not needed any more.
    while True:
        read = {i for n in kept for i in n.inputs} | set(result.outputs)
        unread = [n for n in kept if n.name in views and n.outputs[0] not in read]
        if not unread:
            break
        kept = [n for n in kept if n not in unread]
    result.nodes = kept
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    ops = lambda g: sum(1 for n in g.nodes if n.op in RESHAPE_OPS | {"Transpose"})
    removed = ops(before) - ops(after)
    turned = sum(1 for n in before.nodes if n.op == "Transpose") - sum(1 for n in after.nodes if n.op == "Transpose")
    parts = [f"{removed} shape ops removed"] if removed > 0 else []
    if turned > 0:
        parts.append(f"{turned} Transpose turned into a view")
    return ", ".join(parts)
