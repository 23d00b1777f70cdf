"""PrologueConv (domain "cuvil", passes/fuse_conv_prologue.py): Conv(f(x)), f a one-input
elementwise program, lowered as the Conv whose input copy (ConvPad) applies f (convprologue.py),
or, on a conv path without one, as FusedElementwise into a scratch tensor and then the Conv."""
from __future__ import annotations

import numpy as np

from cuvil.ir import Node, Value

from . import convprologue, fused
from .conv import lower_conv
from .kernel import Lowered


def lower_prologue_conv(node, graph) -> Lowered:
    x = graph.values[node.inputs[0]]
    program = list(node.attr("program") or [])
    dtype = np.dtype(x.dtype)
    # f(x): a scratch tensor, which only the fallback writes (a ConvPad that applies f reads x).
    fx = f"__prologue__{node.name}"
    graph.values[fx] = Value(fx, dtype, tuple(x.shape))
    attrs = {k: v for k, v in node.attrs.items() if k != "program"}
    conv = Node("Conv", node.name, [fx] + list(node.inputs[1:]), list(node.outputs), attrs)
    lines = convprologue.program_expression(node, program, dtype, "a_in")
    with convprologue.applying(fx, lines) as used:
        lowered = lower_conv(conv, graph)
    if used:
        for call in lowered.calls:
            call.args = [node.inputs[0] if isinstance(a, str) and a == fx else a for a in call.args]
        del graph.values[fx]
        return lowered
    elementwise = Node("FusedElementwise", f"{node.name}__prologue", [node.inputs[0]], [fx], {"program": program},
                       domain="cuvil")
    return Lowered(fused.lower_fused_elementwise(elementwise, graph).calls + lowered.calls)
