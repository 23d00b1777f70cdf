"""assign_precision: which nodes compute in the variant's reduced precision (bf16 or fp16).

The variant's `precision` (cuvil.yaml, `cuvil.compile(precision=...)`, `enable_fp16=True`) adds
this pass to the end of the pass list with that precision. It marks a node (attribute
`precision` = "bf16" | "fp16") when the node's work is a product with a constant weight
matrix, where halving the operand bytes halves the weight traffic and the target's 16-bit
instructions double the products per cycle:

    Gemm, MatMul, FusedGemm, FusedMatMul with a constant 2-D B        -> the precision
    Conv, FusedConv with constant 4-D weights, not depthwise          -> the precision
    LSTM with a constant recurrence matrix R                          -> the precision
    FusedAttention on float32 q, k, v (bf16 only)                     -> bf16
    DepthwiseBlock with a constant expand or project weight, bf16 only -> bf16
    everything else                                                   -> float32

A marked conv computes in the precision where it runs as an implicit GEMM
(backends/numba_cpu/convgemm.py, 1x1 convs included; bf16 1x1 convs on small planes as the
transposed GEMM of conv1x1t.py) or, bf16 only, as bf16 Winograd F(2x2, 3x3)
(a 3x3 stride-1 conv the `winograd` pass marked, even channel count:
backends/numba_cpu/winograd_bf16.py; U and V rounded once to bf16, float32 sums; its error
1.4-1.6x the implicit GEMM's); a conv the backend gives to a float32 Winograd transform (fp16
with an explicit `passes:` list naming winograd) or to a direct kernel (tiny convs), or a bf16
grouped conv with an odd channel count per group, stays float32 and shows so in `cuvil explain`. Depthwise convs are not marked: one
product per tap and channel, no weight matrix to halve. A marked DepthwiseBlock (bf16) runs its
expand and project 1x1 convs on the bf16 micro-kernel, its depthwise taps in float32
(backends/numba_cpu/dwblock.py, where its error bound is); an fp16 build leaves blocks unmarked
(their 1x1 convs stay float32). A marked LSTM multiplies its state h by R
in the precision where its steps run in two halves of the hidden units (batch <= 6, no sequence
lengths, an even hidden size: backends/numba_cpu/rnn.py), the product that streams R once per step
and so is bound by R's bytes; h is rounded to 16 bits once per step for that product, the cell's
update (gates, c, h) and the input projection stay float32. A marked FusedAttention
(passes/fuse_attention.py) computes S = Q Kt and O = P V on the bf16 micro-kernel with Q, Kt, P
and V rounded to bf16 once each and its softmax in float32 (backends/numba_cpu/attention_bf16.py;
its error bound is in attention.py's docstring); there is no fp16 attention kernel, so fp16
builds leave it float32.

Everything else stays in float32 because it is numerically sensitive or gains nothing:
reductions and their accumulators, Softmax / LayerNorm / normalisation statistics, exp and
log, and elementwise work on float32 activations. A product computes its sums in float32
(its operands are rounded to 16 bits once: relative error <= 2u + u^2 per product, u = 2^-8
for bf16 and 2^-11 for fp16, plus the float32 summation's own); its inputs and outputs stay
float32 tensors. Nodes named in `keep_fp32`, or of an op type named there, are not marked.

The backend honours a mark where it has the kernel (backends/numba_cpu/gemm.py: A read by rows,
B packed at build time); `cuvil explain` shows each marked node and the kernel it got.

Activations in 16 bits (`narrow_activations`, on by default): a tensor between nodes is stored
in the precision's format (bf16: bfloat16, fp16: float16; its Value's dtype changes, so the
memory plan gives it half the bytes) when its producer writes that format and every reader
reads it:

    writers  a marked Conv / FusedConv on 4-D tensors (output), MaxPool without Indices,
             a depthwise Conv / FusedConv (output), a DepthwiseBlock (output)
    readers  a marked Conv / FusedConv on 4-D tensors (X, and a residual), MaxPool without
             Indices, GlobalAveragePool, a depthwise Conv / FusedConv (X), a DepthwiseBlock
             (x, and a residual)

A depthwise conv (group = channels, constant 4-D weights, one input channel per group) is not
marked (it computes in float32: one product per tap and channel, memory-bound), but it reads
and writes the 16-bit tensors around it (backends/numba_cpu/dwstride.py: widened on load,
rounded once on the store), and so does a DepthwiseBlock (passes/fuse_depthwise_block.py;
backends/numba_cpu/dwblock.py: its inner tensor t stays float32, u too unless the block is marked
bf16, when u is rounded once into bf16 channel pairs for the project GEMM). Without them the
tensors on either side of a MobileNet block's depthwise conv, the largest of the model, would
stay float32.

Graph inputs and outputs stay float32 (the C ABI is unchanged). A marked conv rounds its X to
16 bits to multiply it anyway, so storing X in 16 bits adds no error there; what is new is the
rounding of a residual (u |R| in the sum before the activation), of GlobalAveragePool's inputs
(u |x|, then averaged), and MaxPool commutes with a monotone rounding (no error). A reader whose
kernel cannot take the 16-bit tensor (a marked conv the backend gives to a float32 kernel)
widens it into a float32 copy first (backends/numba_cpu/conv.py): correct, only slower.
"""
from __future__ import annotations

from typing import Literal

import numpy as np

from pydantic import BaseModel, ConfigDict

from cuvil.ir import Graph
from cuvil.ops import FUSED_DOMAIN, PRODUCTS

CONVS = {("", "Conv"), (FUSED_DOMAIN, "FusedConv")}

REDUCED = ("bf16", "fp16")


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    keep_fp32: list[str] = []    # node names or op types that stay float32
    narrow_activations: bool = True   # store activations between 16-bit readers/writers in 16 bits


def stored_dtype(precision: str) -> np.dtype:
    """The dtype of an activation stored in `precision` ("bf16" | "fp16")."""
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if precision == "bf16" else np.dtype(np.float16)


def _marks(node, graph: Graph, keep: set, precision: str) -> bool:
    if node.name in keep or node.op in keep:
        return False
    if (node.domain, node.op) == (FUSED_DOMAIN, "FusedAttention"):
        # bf16 only: its products have a bf16 kernel (backends/numba_cpu/attention_bf16.py), no fp16 one
        return precision == "bf16" and all(graph.values[name].dtype == np.float32 for name in node.inputs[:3])
    if (node.domain, node.op) == (FUSED_DOMAIN, "DepthwiseBlock"):   # its 1x1 convs' weights (bf16 only)
        return precision == "bf16" and any(node.inputs[k] and graph.values[node.inputs[k]].is_const for k in (1, 5))
    if (node.domain, node.op) in CONVS:
        w = graph.values.get(node.inputs[1])
        return w is not None and w.is_const and len(w.shape) == 4 and w.shape[1] > 1 \
            and graph.values[node.inputs[0]].dtype.kind == "f"
    if (node.domain, node.op) == ("", "LSTM"):
        r = graph.values.get(node.inputs[2])
        return r is not None and r.is_const and graph.values[node.inputs[0]].dtype == np.float32
    if (node.domain, node.op) not in PRODUCTS:
        return False
    b = graph.values.get(node.inputs[1]) if len(node.inputs) > 1 else None
    return b is not None and b.is_const and len(b.shape) == 2 and graph.values[node.inputs[0]].dtype.kind == "f"


def _depthwise(node, graph: Graph) -> bool:
    """A depthwise Conv / FusedConv on 4-D float tensors with constant weights (group = channels)."""
    if (node.domain, node.op) not in CONVS or len(node.inputs) < 2:
        return False
    x, w = graph.values[node.inputs[0]], graph.values.get(node.inputs[1])
    return w is not None and w.is_const and len(w.shape) == 4 and len(x.shape) == 4 and w.shape[1] == 1 \
        and int(node.attr("group", 1)) == x.shape[1] == w.shape[0] and x.dtype.kind == "f"


def _narrow_ports(node, graph: Graph) -> tuple[set, set]:
    """The input and output positions of a node (marked already) that read / write 16-bit activations."""
    if (node.domain, node.op) in CONVS and node.attr("precision") in REDUCED \
            and len(graph.values[node.inputs[0]].shape) == 4:
        reads = {0} | ({len(node.inputs) - 1} if node.domain == FUSED_DOMAIN and node.attr("has_residual", 0) else set())
        return reads, {0}
    if _depthwise(node, graph):
        return {0}, {0}
    if (node.domain, node.op) == (FUSED_DOMAIN, "DepthwiseBlock"):
        return {0} | ({7} if len(node.inputs) > 7 and node.inputs[7] else set()), {0}
    if (node.domain, node.op) == ("", "MaxPool") and len([o for o in node.outputs if o]) == 1:
        return {0}, {0}
    if (node.domain, node.op) == ("", "GlobalAveragePool"):
        return {0}, set()
    return set(), set()


def narrowed_values(graph: Graph) -> list[str]:
    """The float32 activations whose producer writes 16 bits and whose readers all read them."""
    external = set(graph.inputs) | set(graph.outputs)
    writes, reads_all = {}, {}
    for node in graph.nodes:
        reads, outs = _narrow_ports(node, graph)
        for k, name in enumerate(node.outputs):
            if name:
                writes[name] = k in outs
        for k, name in enumerate(node.inputs):
            if name:
                reads_all[name] = reads_all.get(name, True) and k in reads
    return [name for name, ok in writes.items()
            if ok and reads_all.get(name) and name not in external and graph.values[name].dtype == np.float32]


def assign_precision(graph: Graph, options: Options = Options()) -> Graph:
    if options.precision not in REDUCED:
        return graph
    keep = set(options.keep_fp32)
    marked = [n.name for n in graph.nodes if _marks(n, graph, keep, options.precision)]
    if not marked:
        return graph
    g = graph.copy()
    chosen = set(marked)
    for node in g.nodes:
        if node.name in chosen:
            node.attrs["precision"] = options.precision
    if options.narrow_activations:
        for name in narrowed_values(g):
            g.values[name].dtype = stored_dtype(options.precision)
    return g


def describe(before: Graph, after: Graph) -> str:
    marked = [n for n in after.nodes if n.attr("precision") in REDUCED]
    if not marked:
        return ""
    precision = marked[0].attr("precision")
    stored = [name for name, v in after.values.items() if v.dtype == stored_dtype(precision)
              and name in before.values and before.values[name].dtype == np.float32]
    attentions = sum(1 for n in marked if (n.domain, n.op) == (FUSED_DOMAIN, "FusedAttention"))
    products = f"{len(marked) - attentions} weight products" + (f" and {attentions} attentions" if attentions else "")
    return (f"{products} in {precision}, {len(after.nodes) - len(marked)} nodes in float32"
            + (f", {len(stored)} activations stored in {precision}" if stored else ""))
