"""CIR: the small, explicit graph every pass and backend works on.

A Graph holds Values (typed, statically shaped tensors; constants carry their
numpy data) and Nodes (an ONNX op name, its attributes under their ONNX names,
input and output value names) in topological order. No ONNX protobuf object
lives past the frontend.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from .errors import ModelError


@dataclass
class Value:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    data: np.ndarray | None = None  # set for constants (weights, folded values)
    # A data-dependent shape (NonZero, Unique...): `shape` is then an upper bound (the bytes its
    # buffer holds) and this names the int64[rank] value the producing kernel writes the actual
    # shape into; the tensor is the buffer's C-contiguous prefix (docs/dynamic_shapes.md).
    shape_from: str | None = None

    @property
    def is_const(self) -> bool:
        return self.data is not None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclass
class Node:
    op: str
    name: str
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    domain: str = ""

    def attr(self, key, default=None):
        return self.attrs.get(key, default)


@dataclass
class Graph:
    name: str
    values: dict[str, Value]
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    opset: int = 17
    # Graph inputs and outputs of sequence or optional type, each as the tensors of `inputs` /
    # `outputs` it crosses the C ABI as (frontends/sequences.py); empty for a model of tensors only.
    structure: dict = field(default_factory=dict)

    def copy(self) -> "Graph":
        """A copy whose node list and value table can be edited freely (constant data is shared)."""
        return Graph(
            name=self.name,
            values={k: dataclasses.replace(v) for k, v in self.values.items()},
            nodes=[dataclasses.replace(n, inputs=list(n.inputs), outputs=list(n.outputs), attrs=dict(n.attrs))
                   for n in self.nodes],
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            opset=self.opset,
            structure=self.structure,
        )

    def producers(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.inputs:
                if name:
                    users.setdefault(name, []).append(node)
        return users

    def constants(self) -> list[Value]:
        return [v for v in self.values.values() if v.is_const]

    def unique_name(self, base: str) -> str:
        name, i = base, 0
        while name in self.values:
            i += 1
            name = f"{base}_{i}"
        return name

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return dict(sorted(counts.items()))


def verify(graph: Graph) -> None:
    """Check the invariants every pass must keep: unique node names, defined inputs, topological
    order, static shapes and dtypes on every value, graph outputs produced."""
    defined = {name for name, v in graph.values.items() if v.is_const} | set(graph.inputs)
    for name in graph.inputs:
        if name not in graph.values:
            raise ModelError(f"graph input '{name}' has no value entry")
    names = set()
    for node in graph.nodes:
        if node.name in names:  # the passes tell nodes apart by name
            raise ModelError(f"node name '{node.name}' is used twice (again by a {node.op} node)")
        names.add(node.name)
        for name in node.inputs:
            if name and name not in defined:
                raise ModelError(f"node '{node.name}' ({node.op}) reads '{name}', which is not defined before it")
        for name in node.outputs:
            if not name:
                continue
            if name in defined:
                raise ModelError(f"value '{name}' is defined twice (again by node '{node.name}')")
            value = graph.values.get(name)
            if value is None:
                raise ModelError(f"node '{node.name}' ({node.op}) output '{name}' has no value entry")
            if any((not isinstance(d, (int, np.integer))) or d < 0 for d in value.shape):
                raise ModelError(f"value '{name}' has a non-static shape {value.shape}")
            defined.add(name)
    for name in graph.outputs:
        if name not in defined:
            raise ModelError(f"graph output '{name}' is never produced")
    for value in graph.values.values():
        if value.shape_from is not None:
            dims = graph.values.get(value.shape_from)
            if dims is None or np.dtype(dims.dtype) != np.int64 or tuple(dims.shape) != (len(value.shape),):
                raise ModelError(f"value '{value.name}' takes its shape from '{value.shape_from}', which is not an "
                                 f"int64[{len(value.shape)}] value")


def to_onnx(graph: Graph):
    """Write a CIR graph back as an onnx.ModelProto (for tests and debugging:
    onnxruntime runs a graph before and after a pass)."""
    from onnx import helper, numpy_helper

    def info(name):
        v = graph.values[name]
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(v.dtype)), list(v.shape))

    used = {i for n in graph.nodes for i in n.inputs if i} | set(graph.outputs)
    inits = [numpy_helper.from_array(np.asarray(v.data), v.name) for v in graph.values.values()
             if v.is_const and v.name in used]
    nodes = []
    for n in graph.nodes:
        attrs = {k: (numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v) for k, v in n.attrs.items()}
        nodes.append(helper.make_node(n.op, n.inputs, n.outputs, name=n.name, domain=n.domain or None, **attrs))
    g = helper.make_graph(nodes, graph.name, [info(i) for i in graph.inputs], [info(o) for o in graph.outputs], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", graph.opset)])
    model.ir_version = min(model.ir_version, 10)
    return model
