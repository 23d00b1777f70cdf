"""fold_constants: evaluate at build time every node whose inputs are all constants.

The ONNX frontend already folds what the model holds; this pass folds what
other passes expose (e.g. a Transpose of a weight once the weight is known).
Nodes are evaluated one at a time by cuvil/evaluate.py (ONNX's reference evaluator, and
onnxruntime's arithmetic for QuantizeLinear/DequantizeLinear).
"""
from __future__ import annotations

import numpy as np

from cuvil.evaluate import evaluate_exact
from cuvil.ir import Graph, Value
from cuvil.ops import RANDOM_OPS, is_random_dropout

from ._rewrite import drop_unused_values

def _nondeterministic(node, graph) -> bool:
    """A random op, or a training Dropout: its values are drawn at run time, never folded."""
    return node.op in RANDOM_OPS or is_random_dropout(node, graph)


def evaluate_node(node, graph: Graph) -> list[np.ndarray]:
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator
    exact = evaluate_exact(node.op, node.domain, [graph.values[i].data if i else None for i in node.inputs], node.attrs)
    if exact is not None:
        return exact
    inits = [numpy_helper.from_array(np.asarray(graph.values[i].data), i) for i in dict.fromkeys(node.inputs) if i]
    attrs = {k: (numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v) for k, v in node.attrs.items()}
    proto = helper.make_node(node.op, node.inputs, node.outputs, domain=node.domain or None, **attrs)
    outputs = [helper.make_empty_tensor_value_info(o) for o in node.outputs if o]
    model = helper.make_model(helper.make_graph([proto], "fold", [], outputs, inits),
                              opset_imports=[helper.make_opsetid("", graph.opset)])
    return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, {})]


def fold_constants(graph: Graph) -> Graph:
    foldable = [n for n in graph.nodes if n.inputs and not _nondeterministic(n, graph) and n.domain == ""
                and all(graph.values[i].is_const for i in n.inputs if i)]
    if not foldable:
        return graph
    result = graph.copy()
    kept = []
    for node in result.nodes:
        if node.inputs and not _nondeterministic(node, result) and node.domain == "" \
                and all(result.values[i].is_const for i in node.inputs if i):
            for name, arr in zip([o for o in node.outputs if o], evaluate_node(node, result)):
                declared = result.values[name]
                result.values[name] = Value(name, np.dtype(declared.dtype), tuple(declared.shape),
                                            arr.astype(declared.dtype).reshape(declared.shape))
        else:
            kept.append(node)
    result.nodes = kept
    return drop_unused_values(result)
