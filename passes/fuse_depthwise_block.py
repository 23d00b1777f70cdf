"""fuse_depthwise_block: a depthwise conv with the 1x1 conv before it and/or after it becomes one op.

    DepthwiseBlock(x, w1, b1, w2, b2, w3, b3, r)        (domain "cuvil")
        t = act1(conv1x1(x, w1) + b1)          "expand" (absent: t = x)
        u = act2(depthwise(t, w2) + b2)
        y = act3(conv1x1(u, w3) + b3 [+ r])    "project" (absent: y = u)

MobileNet-style blocks widen the channels 6x with a 1x1 conv, filter each
channel with a 3x3 depthwise conv and narrow them again with a 1x1 conv. At
large resolutions the wide tensors do not fit the L2 cache (MobileNetV2's
first: 96 x 112 x 112 floats, 4.8 MB), so each conv reads back from L3 or
memory what the one before just wrote there. The fused kernel
(backends/numba_cpu/dwblock.py) computes the block in bands of rows that
stay in L2; t and u never exist as a whole.

The expand conv joins when t has at least `min_bytes` bytes, the project
conv when u has; the op exists when one of them joins. A bf16 build sets
min_bytes to 0 unless its pass_options say otherwise (cuvil/pipeline.py
FUSE_ALL_BLOCKS: there the block's 1x1 convs pass u in bf16 channel pairs,
where separate convs copy their inputs into pairs). The depthwise conv:
as many groups as channels, constant weights, equal strides of 1 or 2,
dilation 1, explicit pads, a kernel of at most 7x7, an output row of at most
128 values, no residual. The 1x1 convs: group 1, stride 1, no padding,
constant weights, read by (or reading) the depthwise conv alone. Activations
are none, Relu or Clip (the kernels apply them in registers); only the
project conv may add a residual (the same shape as its output), and then
without an activation.
"""
from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from cuvil.ir import Graph, Node
from cuvil.ops import REGISTER_ACTIVATIONS

from ._rewrite import drop_unused_values, only_reader

# The kernels' limits (passes do not import the backend): the activations the micro-kernels apply in
# registers (ukernel.EPILOGUE_ACTIVATIONS) and the depthwise rows' kernel and row sizes (dwstride.py).
ACTIVATIONS = ("",) + REGISTER_ACTIVATIONS
MAX_KERNEL = 7
MAX_OUT_WIDTH = 128


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # A 1x1 conv joins when the tensor between it and the depthwise conv has at least this many
    # bytes (default: 1 MiB, an L2 cache); smaller ones stay in L2 between the convs anyway.
    min_bytes: int = 1 << 20


def _conv(node: Node | None) -> bool:
    return node is not None and (node.op == "Conv" and node.domain == "" or
                                 node.op == "FusedConv" and node.domain == "cuvil")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def _activation(node: Node) -> str | None:
    """The node's activation when the fused kernel applies it (None otherwise)."""
    act = _text(node.attr("activation", "")) if node.domain == "cuvil" else ""
    return act if act in ACTIVATIONS else None


def _residual(node: Node) -> bool:
    return node.domain == "cuvil" and bool(int(node.attr("has_residual", 0)))


def _ints(node: Node, key: str, default) -> list[int]:
    value = node.attr(key)
    return [int(v) for v in value] if value is not None else list(default)


def _plain(node: Node, graph: Graph, w_shape_ok) -> bool:
    """Float32, 2-D, constant weights (and bias) of an accepted shape, explicit pads, dilation 1, an
    activation the kernels apply."""
    if len(node.inputs) < 2 or _text(node.attr("auto_pad", "NOTSET")) not in ("NOTSET", "") \
            or _activation(node) is None:
        return False
    x, w = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    if len(x.shape) != 4 or np.dtype(x.dtype) != np.float32 or not w.is_const or not w_shape_ok(tuple(w.shape)):
        return False
    bias = node.inputs[2] if len(node.inputs) > 2 + _residual(node) else ""
    if bias and not graph.values[bias].is_const:
        return False
    return _ints(node, "dilations", [1, 1]) == [1, 1]


def _pointwise(node: Node, graph: Graph) -> bool:
    return _plain(node, graph, lambda s: s[2:] == (1, 1)) and int(node.attr("group", 1)) == 1 \
        and _ints(node, "strides", [1, 1]) == [1, 1] and not any(_ints(node, "pads", [0] * 4))


def _depthwise(node: Node, graph: Graph) -> bool:
    if not _conv(node) or _residual(node) or len(node.inputs) < 2:
        return False
    x = graph.values[node.inputs[0]]
    if len(x.shape) != 4:
        return False
    C = x.shape[1]
    return _plain(node, graph, lambda s: s[:2] == (C, 1) and max(s[2:]) <= MAX_KERNEL) \
        and int(node.attr("group", 1)) == C and _ints(node, "strides", [1, 1]) in ([1, 1], [2, 2]) \
        and graph.values[node.outputs[0]].shape[3] <= MAX_OUT_WIDTH


def _plan(graph: Graph, dw: Node, producers, consumers, min_bytes: int):
    """(expand conv or None, project conv or None) for depthwise conv `dw`; None when neither joins."""
    if not _depthwise(dw, graph):
        return None
    expand = producers.get(dw.inputs[0])
    if not (_conv(expand) and only_reader(graph, consumers, expand.outputs[0]) is dw and not _residual(expand)
            and _pointwise(expand, graph) and graph.values[dw.inputs[0]].nbytes >= min_bytes):
        expand = None
    project = only_reader(graph, consumers, dw.outputs[0])
    if _conv(project) and project.inputs[0] == dw.outputs[0] and _pointwise(project, graph) \
            and graph.values[dw.outputs[0]].nbytes >= min_bytes:
        if _residual(project):
            out, r = graph.values[project.outputs[0]], graph.values[project.inputs[-1]]
            if _activation(project) or tuple(r.shape) != tuple(out.shape) or r.name == dw.outputs[0]:
                project = None
    else:
        project = None
    return (expand, project) if expand or project else None


def _part(node: Node | None, prefix: str) -> dict:
    """The conv's activation as the block's `{prefix}activation` attributes."""
    if node is None:
        return {}
    params = node.attr("activation_params") if node.domain == "cuvil" else None
    return {f"{prefix}activation": _activation(node), f"{prefix}activation_params": [float(v) for v in (params or [])]}


def _fused(expand: Node | None, dw: Node, project: Node | None, graph: Graph) -> Node:
    def bias(node):
        if node is None:
            return ""
        return node.inputs[2] if len(node.inputs) > 2 + _residual(node) else ""

    x = expand.inputs[0] if expand else dw.inputs[0]
    inputs = [x, expand.inputs[1] if expand else "", bias(expand), dw.inputs[1], bias(dw),
              project.inputs[1] if project else "", bias(project),
              project.inputs[-1] if project is not None and _residual(project) else ""]
    attrs = {**_part(expand, "expand_"), **_part(dw, ""), **_part(project, "project_"),
             "kernel_shape": list(graph.values[dw.inputs[1]].shape[2:]), "strides": _ints(dw, "strides", [1, 1]),
             "pads": _ints(dw, "pads", [0, 0, 0, 0])}
    return Node("DepthwiseBlock", dw.name, inputs, [(project or dw).outputs[0]], attrs, domain="cuvil")


def fuse_depthwise_block(graph: Graph, options: Options = Options()) -> Graph:
    producers, consumers = graph.producers(), graph.consumers()
    plans, claimed = {}, set()
    for dw in graph.nodes:
        plan = _plan(graph, dw, producers, consumers, options.min_bytes)
        if plan is not None and plan[0] is not None and plan[0].name in claimed:
            plan = (None, plan[1]) if plan[1] is not None else None   # the last block's project conv
        if plan is not None:
            plans[dw.name] = plan
            claimed.update(n.name for n in plan if n is not None)
    if not plans:
        return graph
    result = graph.copy()
    # The block takes the place of its last conv: its inputs (a residual too) exist there.
    last = {(project.name if project else dw_name): dw_name for dw_name, (_, project) in plans.items()}
    doomed = {n.name for expand, project in plans.values() for n in (expand, project) if n is not None} | set(plans)
    by_name = {n.name: n for n in result.nodes}
    nodes = []
    for node in result.nodes:
        if node.name in last:
            dw = by_name[last[node.name]]
            expand, project = plans[dw.name]
            node = _fused(expand, dw, project, result)
        elif node.name in doomed:
            continue
        nodes.append(node)
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    blocks = [n for n in after.nodes if n.op == "DepthwiseBlock"]
    if not blocks:
        return ""
    expands = sum(1 for n in blocks if n.inputs[1])
    projects = sum(1 for n in blocks if n.inputs[5])
    return f"{len(blocks)} depthwise Conv fused with the 1x1 Conv before ({expands}) / after ({projects}) into DepthwiseBlock"
