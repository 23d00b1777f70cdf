"""eliminate_identity: remove nodes that hand their input on unchanged.

Identity, inference-mode Dropout, Reshape/Flatten/Squeeze/Unsqueeze to the
input's own shape, Transpose with the identity permutation, Cast to the same
dtype, and Relu of a Relu. Readers of the removed output read the input
instead. A node whose output is a graph output is kept: something must still
write that tensor.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph
from cuvil.ops import RESHAPE_OPS, is_random_dropout

from ._rewrite import drop_unused_values, replace_uses



def _is_identity(node, graph: Graph, producers) -> bool:
    if not node.inputs or not node.inputs[0] or not node.outputs or not node.outputs[0]:
        return False
    src, dst = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    if node.op == "Identity":
        return True
    if node.op == "Dropout":
        mask_used = len(node.outputs) > 1 and node.outputs[1]
        return not mask_used and not is_random_dropout(node, graph)
    if node.op in RESHAPE_OPS:
        return tuple(src.shape) == tuple(dst.shape)
    if node.op == "Transpose":
        perm = node.attr("perm")
        return perm is not None and list(perm) == list(range(len(perm)))
    if node.op == "Cast":
        return np.dtype(src.dtype) == np.dtype(dst.dtype)
    if node.op == "Relu":
        producer = producers.get(node.inputs[0])
        return producer is not None and producer.op == "Relu"
    return False


def eliminate_identity(graph: Graph) -> Graph:
    producers = graph.producers()
    doomed = [n for n in graph.nodes if _is_identity(n, graph, producers) and n.outputs[0] not in graph.outputs]
    if not doomed:
        return graph
    result = graph.copy()
    doomed_names = {n.name for n in doomed}
    kept = []
    for node in result.nodes:
        if node.name in doomed_names:
            replace_uses(result, node.outputs[0], node.inputs[0])
        else:
            kept.append(node)
    result.nodes = kept
    return drop_unused_values(result)
