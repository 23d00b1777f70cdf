"""fuse_attention: MatMul -> [Mul|Div by a scalar] -> Softmax -> MatMul becomes one FusedAttention op.

    FusedAttention(q, k, v[, mask])   (domain "cuvil"; backends/numba_cpu/attention.py; not ONNX's
                                       opset-23 Attention, which the frontend expands into these ops)
        O = softmax(Q @ Kt * scale [+ mask]) @ V

Scaled dot-product attention as exporters write it: the scores S = Q K^T of
every head, a scale, a softmax over the keys, the weighted sum of V. Apart,
each step writes its whole tensor (batch x heads x T x S scores) and the next
reads it back, and the head-splitting Transposes around them copy Q, K, V and
the output once more. The fused kernel computes a block of query rows at a
time with the scores in scratch that stays in L2, and reads Q, K and V (and
writes O) through strides, so a Transpose that feeds Q, K or V (or reads O)
and nothing else is absorbed too.

Fires when: each tensor of the chain MatMul -> [scale] -> [mask] -> Softmax
is read by the next node alone, and the Softmax's by the second MatMul alone
(as its A), none of them a graph output; the Softmax runs over the last
axis; the scale is a Mul or Div by a float constant with one element; the
mask is an Add of a float32 tensor that broadcasts to the scores' shape
(BERT's [B, 1, 1, S] padding mask, a [T, S] causal one: a constant or not);
all tensors are float32 with the same batch axes (no broadcasting) and Q, K
and V have rank >= 3. Anything else between the MatMul and the Softmax
(GPT-2's Where, a second Add) leaves the chain as it is.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph, Node

from ._rewrite import drop_unused_values, only_reader, scalar


def _plain(node: Node | None, op: str) -> bool:
    return node is not None and node.op == op and node.domain in ("", "ai.onnx")


def _broadcasts_to(value, shape) -> bool:
    """Whether `value` broadcasts (numpy rules) to `shape` without changing it."""
    if len(value.shape) > len(shape):
        return False
    return all(d in (1, t) for d, t in zip(reversed(value.shape), reversed(shape)))


def _absorbed_input(graph: Graph, name: str, reader: Node, producers, consumers, unit_last: bool):
    """(tensor, perm, the Transpose node or None): a Transpose read by `reader` alone becomes a perm;
    with unit_last, only one that keeps the last axis last (unit stride along it)."""
    rank = len(graph.values[name].shape)
    node = producers.get(name)
    if _plain(node, "Transpose") and only_reader(graph, consumers, name) is reader:
        perm = [int(p) for p in node.attr("perm", list(reversed(range(rank))))]
        if not unit_last or perm[-1] == rank - 1:
            return node.inputs[0], perm, node
    return name, list(range(rank)), None


def _scores(graph: Graph, value: str, reader: Node, producers, consumers):
    """(MatMul, scale node or None, scale, "Mul" | "Div" | "") when `value` is MatMul [-> Mul|Div by a
    scalar], each read by the next alone and the last by `reader`; else None."""
    node = producers.get(value)
    if only_reader(graph, consumers, value) is not reader or node is None:
        return None
    if _plain(node, "MatMul"):
        return node, None, 1.0, ""
    if not (_plain(node, "Mul") or _plain(node, "Div")):
        return None
    a, b = node.inputs
    c = scalar(graph, b)
    if c is None and node.op == "Mul":
        a, c = b, scalar(graph, a)
    first = producers.get(a)
    if c is None or not _plain(first, "MatMul") or only_reader(graph, consumers, a) is not node:
        return None
    return first, node, c, node.op


def _match(graph: Graph, softmax: Node, producers, consumers):
    """The nodes and attributes of one attention around `softmax`, or None."""
    x = graph.values[softmax.inputs[0]]
    rank = len(x.shape)
    axis = int(softmax.attr("axis", -1 if graph.opset >= 13 else 1))
    if rank < 3 or axis % rank != rank - 1 or np.dtype(x.dtype) != np.float32:
        return None
    second = only_reader(graph, consumers, softmax.outputs[0])
    if not _plain(second, "MatMul") or second.inputs[0] != softmax.outputs[0]:
        return None
    # Walk back from the Softmax: [Add mask] <- [Mul|Div scale] <- MatMul, each read by the next alone.
    mask_node, mask = None, ""
    scores = _scores(graph, softmax.inputs[0], softmax, producers, consumers)
    node = producers.get(softmax.inputs[0])
    if scores is None and _plain(node, "Add") and only_reader(graph, consumers, softmax.inputs[0]) is softmax:
        for inner, other in (node.inputs, node.inputs[::-1]):
            scores = _scores(graph, inner, node, producers, consumers)
            if scores is not None:
                mask_node, mask = node, other
                break
        if mask_node is None or not _broadcasts_to(graph.values[mask], x.shape) \
                or np.dtype(graph.values[mask].dtype) != np.float32:
            return None
    if scores is None:
        return None
    first, scale_node, scale, scale_op = scores
    if not _plain(first, "MatMul"):
        return None
    shapes = [graph.values[n].shape for n in (*first.inputs, second.inputs[1], second.outputs[0])]
    if any(len(s) != rank for s in shapes) or len({tuple(s[:-2]) for s in shapes}) != 1:
        return None
    if any(np.dtype(graph.values[n].dtype) != np.float32 for n in (*first.inputs, second.inputs[1])):
        return None
    q, q_perm, tq = _absorbed_input(graph, first.inputs[0], first, producers, consumers, True)
    k, k_perm, tk = _absorbed_input(graph, first.inputs[1], first, producers, consumers, False)
    v, v_perm, tv = _absorbed_input(graph, second.inputs[1], second, producers, consumers, True)
    out, out_perm, tout = second.outputs[0], list(range(rank)), None
    reader = only_reader(graph, consumers, out)
    if _plain(reader, "Transpose"):
        perm = [int(p) for p in reader.attr("perm", list(reversed(range(rank))))]
        if perm[-1] == rank - 1:
            out, out_perm, tout = reader.outputs[0], perm, reader
    nodes = [n for n in (tq, tk, tv, first, scale_node, mask_node, softmax, second, tout) if n is not None]
    attrs = {"scale": scale, "scale_op": scale_op, "q_perm": q_perm, "k_perm": k_perm, "v_perm": v_perm,
             "out_perm": out_perm}
    return Node("FusedAttention", softmax.name, [q, k, v] + ([mask] if mask else []), [out], attrs, domain="cuvil"), nodes


def fuse_attention(graph: Graph) -> Graph:
    producers, consumers = graph.producers(), graph.consumers()
    fused = {}   # name of the last node of a chain -> (FusedAttention node, names of the chain's nodes)
    claimed = set()
    for node in graph.nodes:
        if not _plain(node, "Softmax"):
            continue
        match = _match(graph, node, producers, consumers)
        if match is None or any(n.name in claimed for n in match[1]):
            continue
        attention, chain = match
        claimed.update(n.name for n in chain)
        order = {n.name: i for i, n in enumerate(graph.nodes)}
        last = max(chain, key=lambda n: order[n.name])
        fused[last.name] = attention
    if not fused:
        return graph
    result = graph.copy()
    nodes = []
    for node in result.nodes:
        if node.name in fused:
            nodes.append(fused[node.name])
        elif node.name not in claimed:
            nodes.append(node)
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    fused = [n for n in after.nodes if n.op == "FusedAttention" and n.domain == "cuvil"]
    if not fused:
        return ""
    transposes = sum(1 for n in before.nodes if n.op == "Transpose") - sum(1 for n in after.nodes if n.op == "Transpose")
    return (f"{len(fused)} MatMul -> Softmax -> MatMul chain{'s' if len(fused) != 1 else ''} into FusedAttention"
            + (f" ({transposes} Transpose{'s' if transposes != 1 else ''} absorbed as strides)" if transposes else ""))
