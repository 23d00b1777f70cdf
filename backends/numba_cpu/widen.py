"""Narrow floats (float16, bfloat16) for generators that compute in float32 only: the node's narrow
float inputs are converted to float32 (constants at build time, others by a Cast kernel into
working memory), the float32 kernel runs, and its outputs are rounded back (a Cast kernel).

This is what onnxruntime's CPU provider does for most float16 ops (MLAS computes in float32), so
the results are the float32 results rounded once to the narrow type.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cuvil.ir import Node, Value

from .indexing import lower_cast
from .kernel import Lowered
from .scratch import scratch_value

WIDENED = ("float16", "bfloat16")


def _narrow(graph, name) -> bool:
    return bool(name) and np.dtype(graph.values[name].dtype).name in WIDENED


def in_float32(generator, reads_narrow=None):
    """`generator` for nodes whose float inputs and outputs may be float16 / bfloat16. A node that
    passes/assign_precision.py marked bf16/fp16, or one `reads_narrow(node, graph)` says the
    generator takes as it is (a depthwise conv on 16-bit activations), goes to `generator` as it
    is: its kernels read and write the 16-bit activations themselves (`narrow_activations`), and
    widening them here would undo that."""
    def lower(node, graph) -> Lowered:
        if node.attr("precision") in ("bf16", "fp16") or (reads_narrow is not None and reads_narrow(node, graph)) or \
                not any(_narrow(graph, n) for n in [*node.inputs, *node.outputs]):
            return generator(node, graph)
        calls, inputs, outputs = [], [], []
        for k, name in enumerate(node.inputs):
            if not _narrow(graph, name):
                inputs.append(name)
                continue
            v = graph.values[name]
            if v.is_const:
                wide = f"__f32__{name}"
                graph.values[wide] = Value(wide, np.dtype(np.float32), tuple(v.shape),
                                           np.asarray(v.data).astype(np.float32))
            else:
                wide = scratch_value(graph, node, v.shape, np.float32, tag=f"f32_in{k}")
                calls += lower_cast(Node("Cast", f"{node.name}/to_f32_{k}", [name], [wide], {"to": 1}), graph).calls
            inputs.append(wide)
        back = []
        for k, name in enumerate(node.outputs):
            if not _narrow(graph, name):
                outputs.append(name)
                continue
            v = graph.values[name]
            wide = scratch_value(graph, node, v.shape, np.float32, tag=f"f32_out{k}")
            outputs.append(wide)
            back.append(Node("Cast", f"{node.name}/from_f32_{k}", [wide], [name], {"to": 0}))
        calls += generator(dataclasses.replace(node, inputs=inputs, outputs=outputs), graph).calls
        for cast in back:
            calls += lower_cast(cast, graph).calls
        return Lowered(calls)
    return lower
