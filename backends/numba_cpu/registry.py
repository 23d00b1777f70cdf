"""Every op Cuvil can compile, and the generator that lowers it to kernels.

One readable table, no registration by import side effect. An op missing
here is a CuvilError naming the op, the node and this list.
"""
from __future__ import annotations

from cuvil.errors import UnsupportedOpError

from . import batchnorm, concat, conv, elementwise as ew, gemm, pool, softmax, transpose
from .views import lower_view

GENERATORS = {
    # elementwise (elementwise.py)
    **{op: ew.lower_elementwise for op in ew.UNARY if op != "Identity"},
    **{op: ew.lower_elementwise for op in ew.BINARY},
    "Clip": ew.lower_clip,
    "LeakyRelu": ew.lower_leaky_relu,
    "HardSigmoid": ew.lower_hard_sigmoid,
    "HardSwish": ew.lower_hard_swish,
    "Where": ew.lower_where,
    # views: the output shares the input's bytes (views.py)
    "Identity": lower_view,
    "Reshape": lower_view,
    "Flatten": lower_view,
    "Squeeze": lower_view,
    "Unsqueeze": lower_view,
    "Dropout": lower_view,
    # dense linear algebra (gemm.py, conv.py)
    "Gemm": gemm.lower_gemm,
    "MatMul": gemm.lower_matmul,
    "Conv": conv.lower_conv,
    # normalisation, pooling, layout (batchnorm.py, pool.py, softmax.py, transpose.py, concat.py)
    "BatchNormalization": batchnorm.lower_batchnorm,
    "MaxPool": pool.lower_maxpool,
    "AveragePool": pool.lower_averagepool,
    "GlobalAveragePool": pool.lower_global_averagepool,
    "GlobalMaxPool": pool.lower_global_maxpool,
    "Softmax": softmax.lower_softmax,
    "Transpose": transpose.lower_transpose,
    "Concat": concat.lower_concat,
}


def supported_ops() -> list[str]:
    return sorted(GENERATORS)


def generator_for(node):
    if node.domain not in ("", "ai.onnx"):
        raise UnsupportedOpError(f"node '{node.name}': op {node.domain}::{node.op} is not supported",
                                 hint="only the default ONNX domain is supported")
    gen = GENERATORS.get(node.op)
    if gen is None:
        raise UnsupportedOpError(f"node '{node.name}': op {node.op} is not supported",
                                 hint=f"supported ops: {', '.join(supported_ops())}")
    return gen


def lower(graph) -> list:
    """The schedule: kernel calls and views in the graph's (topological) node order."""
    schedule = []
    for node in graph.nodes:
        schedule.extend(generator_for(node)(node, graph).calls)
    return schedule
