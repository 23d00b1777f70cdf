"""Working memory for a node's kernels (a stop-gap until kernel calls can ask for it).

`scratch_value` adds an internal value to the graph; a kernel call names it
like any other value, among its outputs, and the memory planner places it in
the arena, live from the first to the last call that names it. The name is
derived from the node, so lowering the same graph twice reuses it. The
proper mechanism (a `Scratch(nbytes)` argument the planner allocates for the
call) would keep generators from touching the graph.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Value


def scratch_value(graph, node, shape, dtype, tag="scratch") -> str:
    name = f"__{tag}__{node.name}"
    graph.values[name] = Value(name, np.dtype(dtype), tuple(int(d) for d in shape))
    return name
