"""Small helpers shared by the passes: rewiring uses of a value."""
from __future__ import annotations

from cuvil.ir import Graph


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
