"""eliminate_dead: drop nodes none of whose outputs reach a graph output,
and constants nothing reads any more."""
from __future__ import annotations

from cuvil.ir import Graph


def eliminate_dead(graph: Graph) -> Graph:
    live = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if any(out in live for out in node.outputs if out):
            kept.append(node)
            live.update(i for i in node.inputs if i)
    if len(kept) == len(graph.nodes) and all(v.name in live or not v.is_const for v in graph.values.values()):
        return graph
    result = graph.copy()
    result.nodes = [n for n in result.nodes if any(o in live for o in n.outputs if o)]
    defined = set(result.inputs) | {o for n in result.nodes for o in n.outputs if o}
    used = live | defined
    result.values = {k: v for k, v in result.values.items() if k in used}
    return result
