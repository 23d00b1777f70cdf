"""fold_batchnorm: fold an inference BatchNormalization into the Conv, ConvTranspose, Gemm or MatMul
that feeds it.

    BN(y) = (y - mean) * s + beta,  s = gamma / sqrt(var + eps)   (per channel)
    Conv:   W' = W * s[oc],                 b' = (b - mean) * s + beta
    ConvTranspose: W[c, j, ...]' = W * s[g*M/group + j] (c in group g),  b' as Conv's
    Gemm:   B' = B * s[n] (column n of op(B)),  C' = (beta_gemm * C - mean) * s + beta,  beta_gemm' = 1
    MatMul: (2-D, x @ B) becomes Gemm(x, B * s[n], (0 - mean) * s + beta)

Fires only when every BN parameter and the weight (and Gemm's C) are
constants, the producer's output feeds nothing but the BN, and the BN
normalises the producer's output channels (dim 1, which for a 2-D Gemm or
MatMul is the column).
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


def _const(graph, node, k):
    """Input k's value if it is a constant, None if omitted, False if a runtime value."""
    if len(node.inputs) <= k or not node.inputs[k]:
        return None
    value = graph.values[node.inputs[k]]
    return value if value.is_const else False


def _foldable(src: Node, graph: Graph) -> bool:
    weight, bias = _const(graph, src, 1), _const(graph, src, 2)
    if src.op in ("Conv", "ConvTranspose"):
        return bool(weight) and bias is not False
    if src.op == "Gemm":
        return bool(weight) and bias is not False and len(graph.values[src.outputs[0]].shape) == 2
    if src.op == "MatMul":
        return bool(weight) and len(weight.shape) == 2 and len(graph.values[src.inputs[0]].shape) == 2
    return False


def fold_batchnorm(graph: Graph) -> Graph:
    producers, consumers = graph.producers(), graph.consumers()
    plans = []
    for bn in graph.nodes:
        if bn.op != "BatchNormalization" or bn.domain:
            continue
        src = producers.get(bn.inputs[0])
        if src is None or src.domain or len(consumers.get(bn.inputs[0], [])) != 1 or bn.inputs[0] in graph.outputs \
                or not _foldable(src, graph):
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
        node = by_name[src.name]
        w = graph.values[src.inputs[1]]
        data = np.asarray(w.data, np.float64)
        if src.op == "Conv":
            oc = w.shape[0]
            new_w = data * scale.reshape((oc,) + (1,) * (len(w.shape) - 1))
            old_b = _bias(graph, src, (oc,))
            new_b = old_b * scale + shift
        elif src.op == "ConvTranspose":
            # W is [C, M/group, k...]: output channel g*M/group + j reads column j of group g's rows
            group = int(src.attr("group", 1))
            C, mg = w.shape[0], w.shape[1]
            per_group = scale.reshape(group, 1, mg, *(1,) * (len(w.shape) - 2))
            new_w = (data.reshape(group, C // group, *w.shape[1:]) * per_group).reshape(w.shape)
            new_b = _bias(graph, src, (group * mg,)) * scale + shift
        else:
            trans_b = src.op == "Gemm" and int(src.attr("transB", 0))
            new_w = data * (scale[:, None] if trans_b else scale[None, :])
            beta = float(src.attr("beta", 1.0)) if src.op == "Gemm" else 1.0
            new_b = beta * _bias(graph, src, (len(scale),)) * scale + shift
            node.attrs = {**(node.attrs if src.op == "Gemm" else {}), "beta": 1.0}
            node.op = "Gemm"
        w_name, b_name = result.unique_name(f"{node.name}_W_bn"), result.unique_name(f"{node.name}_B_bn")
        result.values[w_name] = Value(w_name, w.dtype, w.shape, new_w.astype(w.dtype))
        result.values[b_name] = Value(b_name, w.dtype, new_b.shape, new_b.astype(w.dtype))
        node.inputs = [node.inputs[0], w_name, b_name]
        # The producer now writes the BN's output (whose name may be a graph output).
        node.outputs = [bn.outputs[0]]
        removed.add(bn.name)
    result.nodes = [n for n in result.nodes if n.name not in removed]
    return drop_unused_values(result)


def _bias(graph: Graph, src: Node, channels: tuple) -> np.ndarray:
    """The producer's bias (Conv's B, Gemm's C) as float64, zeros when it has none. Gemm's C may be
    (M, N): the result then keeps that shape."""
    if len(src.inputs) > 2 and src.inputs[2]:
        return np.asarray(graph.values[src.inputs[2]].data, np.float64)
    return np.zeros(channels)


def describe(before: Graph, after: Graph) -> str:
    producers, remaining = before.producers(), {n.name for n in after.nodes}
    hosts = [producers[bn.inputs[0]].op for bn in before.nodes
             if bn.op == "BatchNormalization" and bn.name not in remaining and bn.inputs[0] in producers]
    if not hosts:
        return ""
    return f"{len(hosts)} BatchNormalization folded into {'/'.join(sorted(set(hosts)))}"
