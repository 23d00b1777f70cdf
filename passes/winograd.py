"""winograd: mark the 3x3 stride-1 convolutions the backend may run by Winograd's minimal filtering.

A marked Conv or FusedConv (attribute `winograd` = 1: group 1, 3x3 kernel, stride 1,
dilation 1, constant weights) runs as F(4x4, 3x3) or F(2x2, 3x3) when its shape pays
(enough channels and output tiles; backends/numba_cpu/winograd.py), else as before; with
`select: measure` the build times those candidates and takes the fastest (cuvil/select.py).
That needs 2.25-4x fewer multiply-adds than the direct kernels, at two costs a user may
not want, which disabling this pass (`disable_passes: [winograd]`) avoids:

- memory: the loaded library holds the transformed weights, 16/9 or 4 times the marked convs'
  weights, computed by its first session_create and shared by its sessions, and each session
  the transformed inputs and outputs while a conv runs;
- rounding: F(4x4, 3x3) computes through the points 0, +-1, +-2, a few times the direct
  sum's error (a 256-channel conv in float32: ~7e-6 of the largest output).

A bf16 build keeps this pass: a conv marked both bf16 (passes/assign_precision.py) and here
runs as bf16 Winograd F(2x2, 3x3) (backends/numba_cpu/winograd_bf16.py: U rounded to bf16 at
build time and held in place of W, 16/9 of the direct bf16 conv's weight bytes; GEMMs on the bf16
micro-kernel; error 1.4-1.6x the direct bf16 conv's, where F(4x4) in bf16 measured ~20x), or,
when that declines (an odd channel count), as the direct bf16 conv, never in float32. An fp16
build leaves this pass out unless its `passes:` list names it (cuvil/pipeline.py,
REDUCED_WITHOUT_WINOGRAD): its transformed weights would be float32, held next to the 16-bit
weights the reduced precision is for.
"""
from __future__ import annotations

from cuvil.ir import Graph


def _marks(node, graph) -> bool:
    if not (node.op == "Conv" and node.domain == "" or node.op == "FusedConv" and node.domain == "cuvil"):
        return False
    w = graph.values.get(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or not w.is_const or len(w.shape) != 4 or tuple(w.shape[2:]) != (3, 3):
        return False
    return int(node.attr("group", 1)) == 1 and all(int(s) == 1 for s in (node.attr("strides") or [1, 1])) \
        and all(int(d) == 1 for d in (node.attr("dilations") or [1, 1]))


def winograd(graph: Graph) -> Graph:
    g = graph.copy()
    for node in g.nodes:
        if _marks(node, g):
            node.attrs["winograd"] = 1
    return g


def describe(before: Graph, after: Graph) -> str:
    marked = sum(1 for n in after.nodes if n.attr("winograd", 0)) - sum(1 for n in before.nodes if n.attr("winograd", 0))
    return f"{marked} Conv marked for Winograd" if marked else ""
