"""eliminate_common: common subexpression elimination.

Two nodes with the same op, domain, attributes and inputs compute the same
tensors (every op Cuvil compiles is deterministic); the later one is removed
and its readers read the earlier one's outputs. Constants with identical
bytes count as the same input.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from cuvil.ir import Graph

from ._rewrite import drop_unused_values, replace_uses


def _canon(value):
    if isinstance(value, np.ndarray):
        return ["array", value.dtype.str, list(value.shape), hashlib.sha256(value.tobytes()).hexdigest()]
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def eliminate_common(graph: Graph) -> Graph:
    const_id = {}
    for v in graph.constants():
        const_id[v.name] = "const:" + json.dumps(_canon(np.asarray(v.data)))
    seen, renames, kept = {}, {}, []
    result = graph.copy()
    for node in result.nodes:
        node.inputs = [renames.get(i, i) for i in node.inputs]
        key = json.dumps([node.op, node.domain, [const_id.get(i, i) for i in node.inputs],
                          sorted((k, _canon(v)) for k, v in node.attrs.items()), len(node.outputs)], default=str)
        first = seen.get(key)
        if first is None or any(o in result.outputs for o in node.outputs):
            seen.setdefault(key, node)
            kept.append(node)
            continue
        for mine, theirs in zip(node.outputs, first.outputs):
            if mine:
                renames[mine] = theirs
    if len(kept) == len(result.nodes):
        return graph
    for old, new in renames.items():
        replace_uses(result, old, new)
    result.nodes = kept
    return drop_unused_values(result)
