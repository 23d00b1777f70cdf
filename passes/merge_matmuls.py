"""merge_matmuls: sibling products of one input with constant weights become one product and a Split.

    MatMul(x, W1), MatMul(x, W2), MatMul(x, W3)
        ->  Split(MatMul(x, [W1 | W2 | W3]), [N1, N2, N3], axis=-1)

    Gemm(x, W1, b1), Gemm(x, W2, b2), ...  ->  Split(Gemm(x, [W1 | W2], [b1 | b2]), axis=-1)

Attention projects one input three times (q, k and v) with weights of the same
K. One GEMM of width N1 + N2 + N3 does the same arithmetic as the three in one
kernel call, and gives the thread pool one larger job; the Split that hands each
reader its part is one copy of the result (the backend has no views at an
offset, so a Split on the last axis is a copy).

Each output element is the same dot product over the same K, in the same order
(the micro-kernels' passes over k depend on K only), so Cuvil's float32 build
gives the same bits as without the pass, as long as the merged product and the
separate ones take the same kernel family (the micro-kernel wants N >= 16 and
M*N*K >= 4096: a merge of smaller products can move them onto it, and the last
bit can change).

Not in any opt level: on the BERT-style encoder of benchmarks/bench.py it gains
a few microseconds per layer at T=16 (more at 2 threads) and loses about as much
at T=128, where the Split copies 384 KiB per layer and the separate GEMMs are
already at the FMA peak (docs/performance.md). Name it in `passes:` to use it,
after eliminate_common (the siblings then read one value) and the fusions.

Merges MatMul, Gemm and their cuvil-domain epilogue forms (FusedMatMul,
FusedGemm) when the nodes have the same op, domain and attributes (a Gemm's
transB is folded into its weight), all weights are constant and 2-D, and
biases are constants (all present or all absent). Does not fire on a fused
node with a residual (each sibling adds another tensor), on batched or runtime
weights, on a 1-D input, or for non-float tensors.
"""
from __future__ import annotations

import json

import numpy as np

from cuvil.ir import Graph, Node
from cuvil.ops import PRODUCTS

from ._rewrite import add_constant, add_value, const_data, drop_unused_values, is_float, node_names, unique_node_name



def _weight(graph: Graph, node: Node) -> np.ndarray | None:
    """The node's B as a constant [K, N] matrix, or None."""
    b = const_data(graph, node.inputs[1])
    if b is None or b.ndim != 2:
        return None
    return b.T if node.op.endswith("Gemm") and int(node.attr("transB", 0)) else b


def _bias(graph: Graph, node: Node, rows: int, cols: int) -> np.ndarray | None | bool:
    """A Gemm's constant C broadcast to (1, N) (or (M, N) when it varies over rows); None when it has
    none; False when it cannot be merged (a runtime C)."""
    if not node.op.endswith("Gemm") or len(node.inputs) < 3 or not node.inputs[2]:
        return None
    c = const_data(graph, node.inputs[2])
    if c is None:
        return False
    c = c.reshape((1,) * (2 - c.ndim) + c.shape) if c.ndim < 2 else c
    return np.broadcast_to(c, (c.shape[0] if c.shape[0] == rows else 1, cols))


def _key(graph: Graph, node: Node) -> str | None:
    """What siblings must share to be merged (op, attributes, input, K, bias or not); None for a node
    that cannot be merged."""
    if (node.domain, node.op) not in PRODUCTS or len(node.outputs) != 1:
        return None
    if int(node.attr("has_residual", 0)):
        return None
    a = graph.values[node.inputs[0]]
    w = _weight(graph, node)
    if w is None or len(a.shape) < 2 or not is_float(graph, a.name) or w.dtype != np.dtype(a.dtype):
        return None
    y = graph.values[node.outputs[0]]
    bias = _bias(graph, node, y.shape[0], w.shape[1])
    if bias is False:
        return None
    attrs = {k: v for k, v in node.attrs.items() if k != "transB"}
    return json.dumps([node.domain, node.op, node.inputs[0], int(w.shape[0]), bias is not None,
                       sorted(attrs.items())], default=str)


def _groups(graph: Graph) -> list[list[Node]]:
    groups: dict[str, list[Node]] = {}
    for node in graph.nodes:
        key = _key(graph, node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    return [g for g in groups.values() if len(g) > 1]


def _split_node(graph: Graph, name: str, merged: str, widths: list[int], outputs: list[str]) -> Node:
    if graph.opset >= 13:
        sizes = add_constant(graph, f"{name}_sizes", np.array(widths, np.int64))
        return Node("Split", name, [merged, sizes], outputs, {"axis": -1})
    return Node("Split", name, [merged], outputs, {"axis": -1, "split": list(widths)})


def merge_matmuls(graph: Graph) -> Graph:
    groups = _groups(graph)
    if not groups:
        return graph
    result = graph.copy()
    taken = node_names(result)
    replaced: dict[str, list[Node]] = {}     # first node of a group -> the nodes that take its place
    doomed = set()
    for group in groups:
        first = group[0]
        weights = [_weight(result, n) for n in group]
        widths = [int(w.shape[1]) for w in weights]
        outs = [result.values[n.outputs[0]] for n in group]
        w_name = add_constant(result, f"{first.inputs[1]}_merged", np.concatenate(weights, axis=1))
        inputs = [first.inputs[0], w_name]
        if first.op.endswith("Gemm") and len(first.inputs) > 2 and first.inputs[2]:
            rows = outs[0].shape[0]
            biases = [_bias(result, n, rows, w) for n, w in zip(group, widths)]
            if len({b.shape[0] for b in biases}) > 1:
                biases = [np.broadcast_to(b, (rows, b.shape[1])) for b in biases]
            inputs.append(add_constant(result, f"{first.inputs[2]}_merged", np.concatenate(biases, axis=1)))
        shape = tuple(outs[0].shape[:-1]) + (sum(widths),)
        merged = add_value(result, f"{first.outputs[0]}_merged", outs[0].dtype, shape)
        attrs = {k: v for k, v in first.attrs.items() if k != "transB"}
        product = Node(first.op, unique_node_name(taken, f"{first.name}_merged"), inputs, [merged], attrs,
                       first.domain)
        split = _split_node(result, unique_node_name(taken, f"{first.name}_split"), merged, widths,
                            [o.name for o in outs])
        replaced[first.name] = [product, split]
        doomed.update(n.name for n in group)
    nodes = []
    for node in result.nodes:
        if node.name in replaced:
            nodes += replaced[node.name]
        elif node.name not in doomed:
            nodes.append(node)
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    merged = after.op_counts().get("Split", 0) - before.op_counts().get("Split", 0)
    gone = sum(before.op_counts().get(op, 0) - after.op_counts().get(op, 0) for _, op in PRODUCTS)
    return f"{gone + merged} products of a shared input merged into {merged} (+ {merged} Split)" if merged else ""
