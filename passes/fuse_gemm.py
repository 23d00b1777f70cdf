"""fuse_gemm: MatMul followed by a bias Add becomes one Gemm.

    Add(MatMul(A, B), C)  ->  Gemm(A, B, C)         A: (M, K), B: (K, N), C broadcast to (M, N)

Exporters write a linear layer on a batch of sequences (x: (..., K)) as
MatMul + Add; Gemm adds the bias as it writes each output tile, which saves
one pass over the output and one intermediate tensor. An A of rank > 2 is
viewed as (M, K) around the Gemm (Reshape costs nothing: it is a view), when
the bias is a constant over the last dim only.

Does not fire when the MatMul's output is read by anything but the Add, when
B is not 2-D, when the bias would broadcast the output to a larger shape, or
for non-float tensors.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph, Node

from ._rewrite import add_constant, add_value, drop_unused_values, is_float, node_names, only_reader, unique_node_name


def _bias_shape_ok(bias_shape, out_shape) -> bool:
    """Whether `bias` broadcasts to `out_shape` without changing it (unidirectional broadcast)."""
    if len(bias_shape) > len(out_shape):
        return False
    return all(b in (1, o) for b, o in zip(reversed(bias_shape), reversed(out_shape)))


def _plan(graph: Graph, add: Node, consumers, producers):
    """(matmul, bias name) when `add` is a bias Add of a MatMul that can become a Gemm, else None."""
    if add.op != "Add" or add.domain or len(add.inputs) != 2:
        return None
    for k in (0, 1):
        mm = producers.get(add.inputs[k])
        bias = add.inputs[1 - k]
        if mm is None or mm.op != "MatMul" or mm.domain or add.inputs[0] == add.inputs[1]:
            continue
        if only_reader(graph, consumers, mm.outputs[0]) is not add:
            continue
        a, b = graph.values[mm.inputs[0]], graph.values[mm.inputs[1]]
        out, c = graph.values[add.outputs[0]], graph.values[bias]
        if not all(is_float(graph, n) for n in (a.name, b.name, c.name)) or len(b.shape) != 2 or len(a.shape) < 2:
            continue
        if tuple(out.shape) != tuple(graph.values[mm.outputs[0]].shape) or not _bias_shape_ok(c.shape, out.shape):
            continue
        if len(a.shape) > 2 and not (c.is_const and all(d == 1 for d in c.shape[:-1])):
            continue
        return mm, bias
    return None


def fuse_gemm(graph: Graph) -> Graph:
    consumers, producers = graph.consumers(), graph.producers()
    plans = {add.name: p for add in graph.nodes if (p := _plan(graph, add, consumers, producers))}
    if not plans:
        return graph
    result = graph.copy()
    taken = node_names(result)
    doomed = {mm.name for mm, _ in plans.values()}
    nodes = []
    for node in result.nodes:
        if node.name in doomed:
            continue
        if node.name not in plans:
            nodes.append(node)
            continue
        mm, bias = plans[node.name]
        a, out = result.values[mm.inputs[0]], result.values[node.outputs[0]]
        if len(a.shape) == 2:
            nodes.append(Node("Gemm", mm.name, [mm.inputs[0], mm.inputs[1], bias], [node.outputs[0]]))
            continue
        # (..., K) @ (K, N) + c  ==  view((M, K)) @ (K, N) + c[-1], viewed back as (..., N).
        m, k, n = int(np.prod(a.shape[:-1])), a.shape[-1], out.shape[-1]
        c = np.asarray(result.values[bias].data).reshape(-1)
        bias_2d = add_constant(result, f"{bias}_row", c)
        a_shape = add_constant(result, f"{mm.name}_a_shape", np.array([m, k], np.int64))
        y_shape = add_constant(result, f"{mm.name}_y_shape", np.array(out.shape, np.int64))
        a_2d = add_value(result, f"{mm.inputs[0]}_2d", a.dtype, (m, k))
        y_2d = add_value(result, f"{node.outputs[0]}_2d", out.dtype, (m, n))
        nodes += [Node("Reshape", unique_node_name(taken, f"{mm.name}_a_2d"), [a.name, a_shape], [a_2d]),
                  Node("Gemm", mm.name, [a_2d, mm.inputs[1], bias_2d], [y_2d]),
                  Node("Reshape", unique_node_name(taken, f"{mm.name}_y_nd"), [y_2d, y_shape], [node.outputs[0]])]
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    fused = before.op_counts().get("MatMul", 0) - after.op_counts().get("MatMul", 0)
    return f"{fused} MatMul + bias Add fused into Gemm" if fused else ""
