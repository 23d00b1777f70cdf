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

The same per-channel affine after an InstanceNormalization folds into its scale and bias:

    IN(x; s, b) * g + h  =  IN(x; s * g, b * g + h)      (g, h constants per channel or scalars)

which is how torch exports GroupNorm with one group per channel (wav2vec2's feature
encoder): InstanceNormalization with s = 1, b = 0, then Mul by gamma and Add of beta, two
more passes over the tensor. A Mul, an Add or both (in that order) fold, when each is the
only reader of the value before it and its constant has size 1 on every dim but the
channel dim (1).
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
        return fold_instance_norm_affine(graph)
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
    return fold_instance_norm_affine(drop_unused_values(result))


def _per_channel(graph: Graph, node: Node, x: str, channels: int, rank: int) -> np.ndarray | None:
    """The other operand of a Mul/Add reading `x`, as [channels] float64, when it is a constant
    broadcast along the channel dim (1) only; else None."""
    if node.domain or len(node.inputs) != 2 or node.inputs[0] == node.inputs[1]:
        return None
    other = node.inputs[1] if node.inputs[0] == x else node.inputs[0]
    value = graph.values[other]
    if not value.is_const or len(value.shape) > rank:
        return None
    shape = (1,) * (rank - len(value.shape)) + tuple(value.shape)
    if any(d != 1 for k, d in enumerate(shape) if k != 1) or shape[1] not in (1, channels):
        return None
    data = np.asarray(value.data, np.float64).reshape(-1)
    return np.broadcast_to(data, (channels,)).copy()


def _instance_norm_plans(graph: Graph) -> list:
    """(norm, absorbed Mul/Add nodes, new scale, new bias) of each InstanceNormalization whose
    output goes through a per-channel Mul and/or Add by constants."""
    from ._rewrite import only_reader
    consumers = graph.consumers()
    plans = []
    for norm in graph.nodes:
        if norm.op != "InstanceNormalization" or norm.domain or len(norm.inputs) < 3:
            continue
        params = [graph.values[i] for i in norm.inputs[1:3]]
        y = graph.values[norm.outputs[0]]
        if not all(p.is_const for p in params) or len(y.shape) < 3 or np.dtype(y.dtype) != np.float32:
            continue
        scale, bias = (np.asarray(p.data, np.float64).reshape(-1) for p in params)
        channels, rank = int(y.shape[1]), len(y.shape)
        absorbed, last = [], norm.outputs[0]
        for op in ("Mul", "Add"):
            nxt = only_reader(graph, consumers, last)
            if nxt is None or nxt.op != op or tuple(graph.values[nxt.outputs[0]].shape) != tuple(y.shape):
                continue
            k = _per_channel(graph, nxt, last, channels, rank)
            if k is None:
                continue
            if op == "Mul":
                scale, bias = scale * k, bias * k
            else:
                bias = bias + k
            absorbed.append(nxt)
            last = nxt.outputs[0]
        if absorbed:
            plans.append((norm, absorbed, scale, bias))
    return plans


def fold_instance_norm_affine(graph: Graph) -> Graph:
    plans = _instance_norm_plans(graph)
    if not plans:
        return graph
    result = graph.copy()
    by_name = {n.name: n for n in result.nodes}
    removed = set()
    for norm, absorbed, scale, bias in plans:
        node = by_name[norm.name]
        dtype = graph.values[norm.inputs[1]].dtype
        s_name, b_name = result.unique_name(f"{node.name}_scale_affine"), result.unique_name(f"{node.name}_B_affine")
        result.values[s_name] = Value(s_name, dtype, scale.shape, scale.astype(dtype))
        result.values[b_name] = Value(b_name, dtype, bias.shape, bias.astype(dtype))
        node.inputs = [node.inputs[0], s_name, b_name]
        node.outputs = [absorbed[-1].outputs[0]]
        removed.update(n.name for n in absorbed)
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
    affine = [n for n in before.nodes if n.op in ("Mul", "Add") and not n.domain and n.name not in remaining
              and n.inputs and any(producers.get(i) is not None and producers[i].op in ("InstanceNormalization", "Mul")
                                   for i in n.inputs)]
    parts = [f"{len(hosts)} BatchNormalization folded into {'/'.join(sorted(set(hosts)))}"] if hosts else []
    if affine:
        parts.append(f"{len(affine)} per-channel Mul/Add folded into InstanceNormalization")
    return "; ".join(parts)
