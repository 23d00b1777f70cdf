"""fuse_conv_prologue: an elementwise program of one input whose only reader is a Conv becomes the
conv's prologue, computed while the conv copies its input.

    Conv(FusedElementwise(x; program), W, b)  ->  cuvil.PrologueConv(x, W, b; program, Conv's attributes)

Between two convs of wav2vec2's feature encoder (and after Whisper's first conv) sits a Gelu,
which fuse_patterns makes a FusedElementwise: a pass that reads the first conv's output and writes
its Gelu, which the second conv's ConvPad step reads again to copy into its phase images. The
PrologueConv's ConvPad applies the program to each value it copies (backends/numba_cpu/
convprologue.py): one pass over the tensor instead of two, and one step fewer. A conv that takes no
phase images runs the program first into a scratch tensor, as before.

An InstanceNormalization (constant scale and bias) whose output only that program reads joins too
(`norm_epsilon`, its scale and bias as inputs 3 and 4; B is input 2, "" when the conv has none):
wav2vec2's GroupNorm, then Gelu, then the second conv. The ConvPad computes each (image, channel)
plane's moments, then normalises, applies the program and copies: the normalised tensor and its
Gelu are never stored.

Fires only on a float32 FusedElementwise with exactly one input, of the output's shape, read by a
plain Conv (domain "") as its input 0, its output read by nothing else and not a graph output.
CPU only (the pipeline leaves it out of GPU builds), and float32 builds only: assign_precision
marks Conv nodes, not this one.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph, Node

from ._rewrite import drop_unused_values, only_reader


def _prologue(graph: Graph, node: Node, consumers) -> Node | None:
    """The Conv that takes `node`'s program as its prologue, or None."""
    if node.domain != "cuvil" or node.op != "FusedElementwise" or len(node.inputs) != 1 or len(node.outputs) != 1:
        return None
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    if x.is_const or np.dtype(x.dtype) != np.float32 or np.dtype(y.dtype) != np.float32 \
            or tuple(x.shape) != tuple(y.shape) or not node.attr("program"):
        return None
    conv = only_reader(graph, consumers, node.outputs[0])
    if conv is None or conv.domain != "" or conv.op != "Conv" or conv.inputs[0] != node.outputs[0] \
            or node.outputs[0] in conv.inputs[1:]:
        return None
    return conv


def _norm(graph: Graph, node: Node, producers, consumers) -> Node | None:
    """The InstanceNormalization whose output only the program `node` reads, with constant scale
    and bias (fold_batchnorm has folded GroupNorm's affine into them), or None."""
    norm = producers.get(node.inputs[0])
    if norm is None or norm.domain != "" or norm.op != "InstanceNormalization" or len(norm.inputs) != 3 \
            or only_reader(graph, consumers, norm.outputs[0]) is not node:
        return None
    x = graph.values[norm.inputs[0]]
    if np.dtype(x.dtype) != np.float32 or len(x.shape) < 3 \
            or not all(graph.values[i].is_const for i in norm.inputs[1:]):
        return None
    return norm


def fuse_conv_prologue(graph: Graph) -> Graph:
    producers, consumers = graph.producers(), graph.consumers()
    plans = {}
    for node in graph.nodes:
        conv = _prologue(graph, node, consumers)
        if conv is not None:
            plans[conv.name] = (node, _norm(graph, node, producers, consumers))
    if not plans:
        return graph
    result = graph.copy()
    doomed = {n.name for pair in plans.values() for n in pair if n is not None}
    nodes = []
    for node in result.nodes:
        if node.name in doomed:
            continue
        if node.name in plans:
            e, norm = plans[node.name]
            attrs = {**node.attrs, "program": list(e.attr("program"))}
            inputs = [e.inputs[0]] + list(node.inputs[1:])
            if norm is not None:
                attrs["norm_epsilon"] = float(norm.attr("epsilon", 1e-5))
                inputs = [norm.inputs[0], node.inputs[1], node.inputs[2] if len(node.inputs) > 2 else "",
                          norm.inputs[1], norm.inputs[2]]
            node = Node("PrologueConv", node.name, inputs, list(node.outputs), attrs, domain="cuvil")
        nodes.append(node)
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    fused = [n for n in after.nodes if n.op == "PrologueConv"]
    norms = sum(1 for n in fused if n.attr("norm_epsilon") is not None)
    return (f"{len(fused)} FusedElementwise ({norms} after an InstanceNormalization) computed as their Conv's "
            f"prologue (PrologueConv)") if fused else ""
