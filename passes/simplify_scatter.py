"""simplify_scatter: a ScatterElements whose indices repeat one index along every row becomes
the row scatter it is, a ScatterND.

torch's exporters write a segment reduction over dim 0 (`scatter_reduce(0, dst[:, None].expand(-1, F),
msg, "amax")`, GraphSAGE's max aggregation, GAT's segment max) as

    ScatterElements(data [N, F], Expand(dst [E, 1], [E, F]), updates [E, F]; axis=0, reduction)

which materialises E x F int64 indices (25.6 MB at 100k edges, 32 features) and reads one
per element. Since indices[e, f] = dst[e] for every f, it is

    ScatterND(data, dst [E, 1], updates; reduction)

element for element, in the same order: both apply, for each destination element, the
updates of e = 0, 1, ... in turn, so even a floating-point sum rounds the same. The Expand is
left to eliminate_dead when nothing else reads it.

Does not fire for an axis other than 0, indices not made by an Expand of an [E, 1, ..., 1]
tensor, int32 indices (ScatterND takes int64), or updates whose rows are not data's rows.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph, Node

from ._rewrite import add_constant, add_value, drop_unused_values, node_names, unique_node_name


def _row_indices(graph: Graph, node: Node, producers) -> str | None:
    """The [E, 1, ..., 1] tensor the indices of `node` expand, when the rewrite applies."""
    if node.op != "ScatterElements" or node.domain or len(node.inputs) != 3:
        return None
    data, indices, updates = (graph.values[n] for n in node.inputs)
    rank = len(data.shape)
    if int(node.attr("axis", 0)) % max(rank, 1) != 0 or rank < 2 or np.dtype(indices.dtype) != np.int64:
        return None
    if tuple(indices.shape) != tuple(updates.shape) or tuple(updates.shape[1:]) != tuple(data.shape[1:]):
        return None
    expand = producers.get(node.inputs[1])
    if expand is None or expand.op != "Expand" or expand.domain:
        return None
    source = graph.values[expand.inputs[0]]
    if tuple(source.shape) != (indices.shape[0],) + (1,) * (rank - 1):
        return None
    return source.name


def simplify_scatter(graph: Graph) -> Graph:
    producers = graph.producers()
    found = {n.name: rows for n in graph.nodes if (rows := _row_indices(graph, n, producers)) is not None}
    if not found:
        return graph
    result = graph.copy()
    taken = node_names(result)
    nodes = []
    for node in result.nodes:
        rows = found.get(node.name)
        if rows is None:
            nodes.append(node)
            continue
        source = result.values[rows]
        if len(source.shape) != 2:  # [E, 1, ..., 1] -> [E, 1]
            shape = add_constant(result, f"{node.name}_rows_shape", np.array([source.shape[0], 1], np.int64))
            flat = add_value(result, f"{rows}_rows", np.int64, (source.shape[0], 1))
            nodes.append(Node("Reshape", unique_node_name(taken, f"{node.name}_rows"), [rows, shape], [flat]))
            rows = flat
        attrs = {"reduction": node.attrs["reduction"]} if "reduction" in node.attrs else {}
        nodes.append(Node("ScatterND", node.name, [node.inputs[0], rows, node.inputs[2]], list(node.outputs), attrs))
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    count = sum(n.op == "ScatterElements" for n in before.nodes) - sum(n.op == "ScatterElements" for n in after.nodes)
    return f"{count} ScatterElements over expanded row indices -> ScatterND" if count else ""
