"""Small helpers shared by the passes: rewiring uses of a value, reading constants,
and the questions every fusion asks (who reads this value? is it a scalar?)."""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph, Node, Value


def replace_uses(graph: Graph, old: str, new: str) -> None:
    """Make every node (and the graph outputs) read `new` where they read `old`."""
    for node in graph.nodes:
        node.inputs = [new if i == old else i for i in node.inputs]
    graph.outputs = [new if o == old else o for o in graph.outputs]


def drop_unused_values(graph: Graph) -> Graph:
    used = set(graph.inputs) | set(graph.outputs)
    for node in graph.nodes:
        used.update(i for i in node.inputs if i)
        used.update(o for o in node.outputs if o)
    graph.values = {k: v for k, v in graph.values.items() if k in used}
    return graph


def only_reader(graph: Graph, consumers, value: str) -> Node | None:
    """The single node reading `value`, or None when it has several readers or is a graph output
    (a value that something else still needs cannot disappear into a fused node)."""
    users = consumers.get(value, [])
    if value in graph.outputs or len(users) != 1:
        return None
    return users[0]


def const_data(graph: Graph, name: str) -> np.ndarray | None:
    """The data of a constant input, or None (a runtime value, or an omitted optional input)."""
    if not name:
        return None
    value = graph.values[name]
    return np.asarray(value.data) if value.is_const else None


def scalar(graph: Graph, name: str) -> float | None:
    """The value of a one-element constant, else None."""
    data = const_data(graph, name)
    if data is None or data.size != 1:
        return None
    return float(data.reshape(-1)[0])


def add_constant(graph: Graph, base: str, array: np.ndarray) -> str:
    """Add a constant value under a fresh name derived from `base`; returns the name."""
    name = graph.unique_name(base)
    array = np.asarray(array)
    graph.values[name] = Value(name, array.dtype, tuple(array.shape), array)
    return name


def add_value(graph: Graph, base: str, dtype, shape) -> str:
    name = graph.unique_name(base)
    graph.values[name] = Value(name, np.dtype(dtype), tuple(int(d) for d in shape))
    return name


def is_float(graph: Graph, name: str) -> bool:
    return np.dtype(graph.values[name].dtype).kind == "f"


def node_names(graph: Graph) -> set[str]:
    return {n.name for n in graph.nodes}


def unique_node_name(taken: set[str], base: str) -> str:
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name
