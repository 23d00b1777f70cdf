"""PrologueConv (domain "cuvil", passes/fuse_conv_prologue.py): Conv(f(x)), f a one-input
elementwise program (after an InstanceNormalization when the node has `norm_epsilon`), lowered as
the Conv whose input copy (ConvPad) applies them (convprologue.py), or, on a conv path without one,
as the InstanceNormalization and FusedElementwise kernels into scratch tensors, then the Conv.

Inputs: x, W, B ("" when the conv has none), and with `norm_epsilon` the normalisation's scale
and bias."""
from __future__ import annotations

import numpy as np

from cuvil.ir import Node, Value

from . import convprologue, fused
from .conv import lower_conv
from .kernel import Lowered
from .norm import lower_instance_normalization


def lower_prologue_conv(node, graph) -> Lowered:
    x = graph.values[node.inputs[0]]
    program = list(node.attr("program") or [])
    eps = node.attr("norm_epsilon")
    dtype = np.dtype(x.dtype)
    norm = convprologue.Norm(node.inputs[3], node.inputs[4], float(eps)) if eps is not None else None
    # f(x): a scratch tensor, which only the fallback writes (a ConvPad that applies f reads x).
    fx = f"__prologue__{node.name}"
    graph.values[fx] = Value(fx, dtype, tuple(x.shape))
    attrs = {k: v for k, v in node.attrs.items() if k not in ("program", "norm_epsilon")}
    conv_inputs = [fx, node.inputs[1]] + ([node.inputs[2]] if len(node.inputs) > 2 and node.inputs[2] else [])
    conv = Node("Conv", node.name, conv_inputs, list(node.outputs), attrs)
    prologue = convprologue.Prologue(convprologue.program_expression(node, program, dtype, "a_in"), norm)
    with convprologue.applying(fx, prologue) as used:
        lowered = lower_conv(conv, graph)
    if used:
        for call in lowered.calls:
            call.args = [node.inputs[0] if isinstance(a, str) and a == fx else a for a in call.args]
        del graph.values[fx]
        return lowered
    calls, src = [], node.inputs[0]
    if norm is not None:
        normed = f"__prologue_norm__{node.name}"
        graph.values[normed] = Value(normed, dtype, tuple(x.shape))
        calls += lower_instance_normalization(
            Node("InstanceNormalization", f"{node.name}__norm", [src, norm.scale, norm.bias], [normed],
                 {"epsilon": norm.epsilon}), graph).calls
        src = normed
    elementwise = Node("FusedElementwise", f"{node.name}__prologue", [src], [fx], {"program": program}, domain="cuvil")
    return Lowered(calls + fused.lower_fused_elementwise(elementwise, graph).calls + lowered.calls)
