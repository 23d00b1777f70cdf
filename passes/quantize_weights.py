"""quantize_weights: `precision: int4` — weight-only, group-wise quantisation of the constant weight
matrices of MatMul and Gemm into MatMulNBits nodes (com.microsoft), the IR form onnxruntime's
`MatMulNBitsQuantizer` writes, so Cuvil's own quantisation and an imported quantised model share
one lowering (backends/numba_cpu/nbits.py). Activations stay float32.

Why: at batch 1 (one decode step of a language model) every product reads its whole weight matrix
for a few multiply-adds per weight; 4 bits instead of 32 per weight is up to 8x less traffic.

For W [K, N] and groups of `group_size` consecutive k in one column (cuvil/nbits.py quantize):

    symmetric:  scale = w_e / -2^(bits-1)  (w_e: the group's value of largest magnitude),
                q = clamp(round(w / scale) + 2^(bits-1), 0, 2^bits - 1)      (onnxruntime's choice)
    asymmetric: scale = (max(w, 0) - min(w, 0)) / (2^bits - 1), zp = round(-min(w, 0) / scale),
                q = clamp(round(w / scale) + zp, 0, 2^bits - 1)
    W ~ (q - zp) * scale,   |w - (q - zp) scale| <= scale / 2 inside the range

The scales are rounded to float16 first (when every one is a normal float16) and the codes chosen
for the rounded scales, so the library stores them in 2 bytes: 4.5 bits per weight at group 32.

Rewrites (each only with a constant float32 2-D weight whose K is even):
    MatMul(A, W)                                 -> MatMulNBits(A, ...)
    MatMul(A, W) -> Add(., c), c constant [N]    -> MatMulNBits(A, ..., bias=c)    (the Add's output)
    Gemm(A, B, C) with transA=0, C of N values   -> MatMulNBits(A, ..., bias=beta*C), W = alpha*op(B)
Not rewritten: weights computed at run time, batched (3-D) weights, nodes named in `keep_fp32`.
MatMulNBits nodes the model already has keep their codes; `imported_scales: fp16` rounds their
float32 scales to float16 (stored in 2 bytes; each weight moves by at most 2^-11 of itself).
"""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from cuvil import nbits
from cuvil.ir import Graph, Node, Value


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bits: Literal[4, 8] = 4
    group_size: Literal[16, 32, 64, 128, 256] = 32
    symmetric: bool = True
    keep_fp32: list[str] = []       # node names (or op types) left in float32
    # "fp16": the float32 scales of MatMulNBits nodes the model already has (an imported quantised
    # file) are rounded to float16, which the library then stores in 2 bytes (4.5 bits per weight at
    # block 32 instead of 5): each weight changes by at most 2^-11 of itself. "keep": as the file has them.
    imported_scales: Literal["keep", "fp16"] = "keep"


def _f16_safe(w: np.ndarray, bits: int, group: int) -> bool:
    """Whether float16 scales can hold this weight's groups (normal, finite): else float32 scales."""
    K = w.shape[0]
    pad = np.zeros((-(-K // group) * group, w.shape[1]), np.float32)
    pad[:K] = w
    amax = np.abs(pad.reshape(-1, group, w.shape[1])).max(axis=1)
    scale = amax[amax > 0] / (1 << (bits - 1))
    return bool(scale.size == 0 or (scale.min() >= 2.0 ** -14 * 2 and scale.max() < 6e4))


def _weight(graph: Graph, name: str) -> np.ndarray | None:
    value = graph.values.get(name)
    if value is None or not value.is_const or np.dtype(value.dtype) != np.float32 or len(value.shape) != 2:
        return None
    return np.asarray(value.data, np.float32)


def _bias_add(graph: Graph, node: Node, consumers: dict, N: int):
    """The Add that adds a constant [N] vector to the node's output, when it is its only reader."""
    users = consumers.get(node.outputs[0], [])
    if len(users) != 1 or users[0].op != "Add" or users[0].domain != "" or node.outputs[0] in graph.outputs:
        return None, None
    add = users[0]
    other = add.inputs[1] if add.inputs[0] == node.outputs[0] else add.inputs[0]
    value = graph.values[other]
    if not value.is_const or np.dtype(value.dtype) != np.float32 or value.size != N or value.shape[-1:] != (N,):
        return None, None
    if graph.values[add.outputs[0]].shape != graph.values[node.outputs[0]].shape:
        return None, None
    return add, np.asarray(value.data, np.float32).reshape(N)


def _candidate(graph: Graph, node: Node, consumers: dict):
    """(W [K, N], bias or None, the node whose output the product replaces, nodes it replaces) or None."""
    if node.domain != "" or node.op not in ("MatMul", "Gemm"):
        return None
    a = graph.values[node.inputs[0]]
    if np.dtype(a.dtype) != np.float32 or a.is_const:
        return None
    w = _weight(graph, node.inputs[1])
    if w is None:
        return None
    bias, last, replaced = None, node, [node]
    if node.op == "Gemm":
        if node.attr("transA", 0) or len(a.shape) != 2:
            return None
        w = (w.T if node.attr("transB", 0) else w) * np.float32(node.attr("alpha", 1.0))
        if len(node.inputs) > 2 and node.inputs[2]:
            c = graph.values[node.inputs[2]]
            if not c.is_const or c.size not in (1, w.shape[1]) or (c.shape and c.shape[-1] not in (1, w.shape[1])) \
                    or len(c.shape) > 1 and c.shape[0] != 1:
                return None
            bias = np.broadcast_to(np.asarray(c.data, np.float32).reshape(-1), (w.shape[1],)) \
                * np.float32(node.attr("beta", 1.0))
    else:
        if len(a.shape) < 1 or a.shape[-1] != w.shape[0]:
            return None
        add, bias = _bias_add(graph, node, consumers, w.shape[1])
        if add is not None:
            last, replaced = add, [node, add]
    if w.shape[0] % 2:
        return None
    return w, bias, last, replaced


def _round_imported_scales(graph: Graph) -> Graph:
    """The graph with every MatMulNBits node's float32 scales rounded to float16 (nodes whose scales
    fall outside float16's normal range keep theirs)."""
    out = None
    for node in graph.nodes:
        if node.domain != nbits.DOMAIN or node.op != nbits.OP or len(node.inputs) < 3:
            continue
        scales = graph.values[node.inputs[2]]
        if not scales.is_const or np.dtype(scales.dtype) != np.float32:
            continue
        data = np.asarray(scales.data, np.float32)
        magnitude = np.abs(data[data != 0])
        if magnitude.size and (magnitude.min() < 2.0 ** -14 or magnitude.max() > 65504):
            continue
        rounded = data.astype(np.float16).astype(np.float32)
        if np.array_equal(rounded, data):
            continue
        out = out or graph.copy()
        name = out.unique_name(f"{node.inputs[2]}_fp16")
        out.values[name] = Value(name, np.dtype(np.float32), tuple(data.shape), rounded)
        target = next(n for n in out.nodes if n.name == node.name)
        target.inputs[2] = name
    if out is None:
        return graph
    used = {i for n in out.nodes for i in n.inputs if i} | set(out.outputs)
    for name in [v.name for v in out.values.values() if v.is_const and v.name not in used]:
        del out.values[name]
    return out


def quantize_weights(graph: Graph, options: Options | None = None) -> Graph:
    options = options or Options()
    if options.imported_scales == "fp16":
        graph = _round_imported_scales(graph)
    consumers = graph.consumers()
    plan = {}
    for node in graph.nodes:
        if node.name in options.keep_fp32 or node.op in options.keep_fp32:
            continue
        found = _candidate(graph, node, consumers)
        if found is not None and not any(r.name in plan for r in found[3]):
            plan[node.name] = found
    if not plan:
        return graph
    out = graph.copy()
    drop, insert = set(), {}
    for name, (w, bias, last, replaced) in plan.items():
        node = next(n for n in graph.nodes if n.name == name)
        scale_dtype = np.float16 if _f16_safe(w, options.bits, options.group_size) else np.float32
        weight = nbits.quantize(w, options.bits, options.group_size, options.symmetric, scale_dtype)
        arrays = nbits.encode(weight)
        inputs = [node.inputs[0]]
        for key in ("B", "scales", "zero_points"):
            if key in arrays:
                cname = out.unique_name(f"{name}_{key}_q{options.bits}")
                out.values[cname] = Value(cname, arrays[key].dtype, tuple(arrays[key].shape), arrays[key])
                inputs.append(cname)
            else:
                inputs.append("")
        inputs.append("")                                   # g_idx
        if bias is not None:
            cname = out.unique_name(f"{name}_bias")
            bias = np.ascontiguousarray(bias, np.float32)
            out.values[cname] = Value(cname, np.dtype(np.float32), bias.shape, bias)
            inputs.append(cname)
        while inputs and inputs[-1] == "":
            inputs.pop()
        insert[name] = Node(op=nbits.OP, name=f"{name}_q{options.bits}", inputs=inputs,
                            outputs=[last.outputs[0]], domain=nbits.DOMAIN,
                            attrs={"K": w.shape[0], "N": w.shape[1], "bits": options.bits,
                                   "block_size": options.group_size})
        drop.update(r.name for r in replaced)
        for r in replaced[:-1]:                             # the MatMul's own output, now unused
            out.values.pop(r.outputs[0], None)
    nodes = []
    for node in out.nodes:
        if node.name in insert:
            nodes.append(insert[node.name])
        elif node.name not in drop:
            nodes.append(node)
    out.nodes = nodes
    # the float weights nobody reads any more leave the graph
    used = {i for n in out.nodes for i in n.inputs if i} | set(out.outputs)
    for name in [v.name for v in out.values.values() if v.is_const and v.name not in used]:
        del out.values[name]
    return out


def describe(before: Graph, after: Graph) -> str:
    made = [n for n in after.nodes if n.domain == nbits.DOMAIN and n.op == nbits.OP] 
    had = sum(1 for n in before.nodes if n.domain == nbits.DOMAIN and n.op == nbits.OP)
    params = sum(int(n.attrs["K"]) * int(n.attrs["N"]) for n in made)
    return f"{len(made) - had} products to MatMulNBits ({params:,} weights quantised)"
