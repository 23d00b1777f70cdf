"""fuse_expand_depthwise: a 1x1 conv whose only reader is a depthwise conv becomes one op.

    ExpandDepthwise(x, w1, b1, w2, b2)  =  dw(act1(conv1x1(x, w1) + b1), w2) + b2, then act2

(domain "cuvil"). MobileNet-style blocks widen the channels 6x with the 1x1
conv ("expand") and filter each channel with a 3x3 depthwise conv; at large
resolutions the wide intermediate does not fit the L2 cache (MobileNetV2's
first: 96 x 112 x 112 floats, 4.8 MB), so the depthwise conv reads back from
L3 or memory what the expand conv just wrote there. The fused kernel
(backends/numba_cpu/expanddw.py) computes the expanded channels in bands of
rows that stay in L2 and filters each band right away; the intermediate
never exists.

Fires when: the 1x1 conv has group 1, stride 1, no padding and constant
weights; the depthwise conv has as many groups as channels, constant
weights, equal strides of 1 or 2, dilation 1, explicit pads and a kernel of
at most 7x7 with an output row of at most 128 values; neither has a residual;
both activations are none, Relu or Clip (the ones the kernels apply in
registers); the intermediate is read by the depthwise conv alone and has at
least `min_bytes` bytes (smaller ones stay in L2 between the two convs
anyway: fusing them buys nothing there).
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from cuvil.ir import Graph, Node

from ._rewrite import drop_unused_values, only_reader

ACTIVATIONS = ("", "Relu", "Clip")
MAX_KERNEL = 7
MAX_OUT_WIDTH = 128


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # Fuse only when the expanded tensor has at least this many bytes (default: 1 MiB, an L2 cache).
    min_bytes: int = 1 << 20


def _conv(node: Node) -> bool:
    return node.op == "Conv" and node.domain == "" or node.op == "FusedConv" and node.domain == "cuvil"


def _activation(node: Node) -> str | None:
    """The node's activation when the fused kernel applies it (None otherwise)."""
    if node.domain != "cuvil":
        return ""
    if int(node.attr("has_residual", 0)):
        return None
    act = node.attr("activation", "") or ""
    act = act.decode() if isinstance(act, bytes) else act
    return act if act in ACTIVATIONS else None


def _ints(node: Node, key: str, default) -> list[int]:
    value = node.attr(key)
    return [int(v) for v in value] if value is not None else list(default)


def _plain(node: Node, graph: Graph, w_shape_ok) -> bool:
    """Float32, 2-D, constant weights (and bias) of an accepted shape, explicit pads, dilation 1."""
    auto_pad = node.attr("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if len(node.inputs) < 2 or auto_pad not in ("NOTSET", "") or _activation(node) is None:
        return False
    x, w = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    if len(x.shape) != 4 or np.dtype(x.dtype) != np.float32 or not w.is_const or not w_shape_ok(tuple(w.shape)):
        return False
    if len(node.inputs) > 2 and node.inputs[2] and not graph.values[node.inputs[2]].is_const:
        return False
    return _ints(node, "dilations", [1, 1]) == [1, 1]


def _plan(graph: Graph, dw: Node, producers, consumers, min_bytes: int) -> Node | None:
    """The 1x1 conv `dw` fuses with, or None."""
    if not _conv(dw) or len(dw.inputs) < 2:
        return None
    pw = producers.get(dw.inputs[0])
    if pw is None or not _conv(pw) or only_reader(graph, consumers, pw.outputs[0]) is not dw:
        return None
    mid = graph.values[pw.outputs[0]]
    if len(mid.shape) != 4:
        return None
    C = mid.shape[1]
    if not _plain(pw, graph, lambda s: s[2:] == (1, 1)) or int(pw.attr("group", 1)) != 1 \
            or _ints(pw, "strides", [1, 1]) != [1, 1] or any(_ints(pw, "pads", [0] * 4)):
        return None
    if not _plain(dw, graph, lambda s: s[:2] == (C, 1) and max(s[2:]) <= MAX_KERNEL) or int(dw.attr("group", 1)) != C:
        return None
    strides = _ints(dw, "strides", [1, 1])
    if strides not in ([1, 1], [2, 2]) or graph.values[dw.outputs[0]].shape[3] > MAX_OUT_WIDTH:
        return None
    if mid.nbytes < min_bytes:
        return None
    return pw


def _fused(pw: Node, dw: Node, graph: Graph) -> Node:
    def bias(node):
        return node.inputs[2] if len(node.inputs) > 2 else ""

    def act(node):
        params = node.attr("activation_params") if node.domain == "cuvil" else None
        return _activation(node), [float(v) for v in (params or [])]

    act1, params1 = act(pw)
    act2, params2 = act(dw)
    kernel = list(graph.values[dw.inputs[1]].shape[2:])
    return Node("ExpandDepthwise", dw.name, [pw.inputs[0], pw.inputs[1], bias(pw), dw.inputs[1], bias(dw)],
                [dw.outputs[0]],
                {"expand_activation": act1, "expand_activation_params": params1, "activation": act2,
                 "activation_params": params2, "kernel_shape": kernel, "strides": _ints(dw, "strides", [1, 1]),
                 "pads": _ints(dw, "pads", [0, 0, 0, 0]), "expand_node": pw.name},
                domain="cuvil")


def fuse_expand_depthwise(graph: Graph, options: Options = Options()) -> Graph:
    producers, consumers = graph.producers(), graph.consumers()
    plans = {dw.name: pw for dw in graph.nodes if (pw := _plan(graph, dw, producers, consumers, options.min_bytes))}
    if not plans:
        return graph
    result = graph.copy()
    doomed = {pw.name for pw in plans.values()}
    nodes = []
    for node in result.nodes:
        if node.name in doomed:
            continue
        nodes.append(_fused(plans[node.name], node, result) if node.name in plans else node)
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    fused = after.op_counts().get("ExpandDepthwise", 0) - before.op_counts().get("ExpandDepthwise", 0)
    return f"{fused} 1x1 Conv + depthwise Conv fused into ExpandDepthwise" if fused else ""
