"""assign_precision: which nodes compute in the variant's reduced precision (bf16 or fp16).

The variant's `precision` (cuvil.yaml, `cuvil.compile(precision=...)`, `enable_fp16=True`) adds
this pass to the end of the pass list with that precision. It marks a node (attribute
`precision` = "bf16" | "fp16") when the node's work is a product with a constant weight
matrix, where halving the operand bytes halves the weight traffic and the target's 16-bit
instructions double the products per cycle:

    Gemm, MatMul, FusedGemm, FusedMatMul with a constant 2-D B        -> the precision
    Conv, FusedConv with constant 4-D weights, not depthwise          -> the precision
    LSTM with a constant recurrence matrix R                          -> the precision
    everything else                                                   -> float32

A marked conv computes in the precision where it runs as an implicit GEMM
(backends/numba_cpu/convgemm.py, 1x1 convs included); a conv the backend gives to a Winograd
transform or to a direct kernel (tiny convs), or a bf16 grouped conv with an odd channel count
per group, stays float32 and shows so in `cuvil explain`. Depthwise convs are not marked: one
product per tap and channel, no weight matrix to halve. A marked LSTM multiplies its state h by R
in the precision where its steps run in two halves of the hidden units (batch <= 6, no sequence
lengths, an even hidden size: backends/numba_cpu/rnn.py), the product that streams R once per step
and so is bound by R's bytes; h is rounded to 16 bits once per step for that product, the cell's
update (gates, c, h) and the input projection stay float32.

Everything else stays in float32 because it is numerically sensitive or gains nothing:
reductions and their accumulators, Softmax / LayerNorm / normalisation statistics, exp and
log, and elementwise work on float32 activations. A product computes its sums in float32
(its operands are rounded to 16 bits once: relative error <= 2u + u^2 per product, u = 2^-8
for bf16 and 2^-11 for fp16, plus the float32 summation's own); its inputs and outputs stay
float32 tensors. Nodes named in `keep_fp32`, or of an op type named there, are not marked.

The backend honours a mark where it has the kernel (backends/numba_cpu/gemm.py: A read by rows,
B packed at build time); `cuvil explain` shows each marked node and the kernel it got.
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


def _marks(node, graph: Graph, keep: set) -> bool:
    if node.name in keep or node.op in keep:
        return False
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


def assign_precision(graph: Graph, options: Options = Options()) -> Graph:
    if options.precision not in REDUCED:
        return graph
    keep = set(options.keep_fp32)
    marked = [n.name for n in graph.nodes if _marks(n, graph, keep)]
    if not marked:
        return graph
    g = graph.copy()
    chosen = set(marked)
    for node in g.nodes:
        if node.name in chosen:
            node.attrs["precision"] = options.precision
    return g


def describe(before: Graph, after: Graph) -> str:
    marked = [n for n in after.nodes if n.attr("precision") in REDUCED]
    return (f"{len(marked)} weight products in {marked[0].attr('precision')}, "
            f"{len(after.nodes) - len(marked)} nodes in float32") if marked else ""
