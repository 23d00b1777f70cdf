"""fold_batchnorm: fold an inference BatchNormalization into the Conv that feeds it.

    BN(y) = (y - mean) * s + beta,  s = gamma / sqrt(var + eps)   (per channel)
    Conv:  W' = W * s[oc],  b' = (b - mean) * s + beta

Fires only when every BN parameter and the weight are constants and the
producer's output feeds nothing but the BN.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph, Node, Value

from ._rewrite import drop_unused_values


def _bn_params(bn: Node, graph: Graph):
    if len(bn.outputs) > 1 and any(bn.outputs[1:]) or bn.attr("training_mode", 0):
        return None
    params = [graph.values[i] for i in bn.inputs[1:5]]
    if len(params) != 4 or not all(p.is_const for p in params):
        return None
    gamma, beta, mean, var = (np.asarray(p.data, np.float64) for p in params)
    scale = gamma / np.sqrt(var + float(bn.attr("epsilon", 1e-5)))
    return scale, beta - mean * scale


def fold_batchnorm(graph: Graph) -> Graph:
    producers, consumers = graph.producers(), graph.consumers()
    plans = []
    for bn in graph.nodes:
        if bn.op != "BatchNormalization":
            continue
        src = producers.get(bn.inputs[0])
        if src is None or src.op != "Conv" or len(consumers.get(bn.inputs[0], [])) != 1 \
                or bn.inputs[0] in graph.outputs:
            continue
        weight = graph.values[src.inputs[1]]
        bias = graph.values[src.inputs[2]] if len(src.inputs) > 2 and src.inputs[2] else None
        if not weight.is_const or (bias is not None and not bias.is_const):
            continue
        params = _bn_params(bn, graph)
        if params is not None:
            plans.append((src, bn, params))
    if not plans:
        return graph
    result = graph.copy()
    by_name = {n.name: n for n in result.nodes}
    removed = set()
    for src, bn, (scale, shift) in plans:
        conv = by_name[src.name]
        w = graph.values[src.inputs[1]]
        oc = w.shape[0]
        new_w = (np.asarray(w.data, np.float64) * scale.reshape((oc,) + (1,) * (len(w.shape) - 1))).astype(w.dtype)
        old_b = np.asarray(graph.values[src.inputs[2]].data, np.float64) if len(src.inputs) > 2 and src.inputs[2] \
            else np.zeros(oc)
        new_b = (old_b * scale + shift).astype(w.dtype)
        w_name, b_name = result.unique_name(f"{conv.name}_W_bn"), result.unique_name(f"{conv.name}_B_bn")
        result.values[w_name] = Value(w_name, w.dtype, w.shape, new_w)
        result.values[b_name] = Value(b_name, w.dtype, (oc,), new_b)
        conv.inputs = [conv.inputs[0], w_name, b_name]
        # The Conv now writes the BN's output (whose name may be a graph output).
        conv.outputs = [bn.outputs[0]]
        removed.add(bn.name)
    result.nodes = [n for n in result.nodes if n.name not in removed]
    return drop_unused_values(result)
