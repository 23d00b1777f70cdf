"""The semantic hash of an imported graph, and the canonical form every step after the import reads.

graph_hash is blind to value and node names and to node order: every value is hashed from the
op, attributes and input hashes that make it (a Merkle hash of the dataflow graph), graph inputs
by position, name, dtype and shape, constants by their bytes, and the graph by its outputs' names
and hashes. A re-export that renames internal values or reorders nodes hashes the same; a changed
weight, op or attribute does not. `cuvil serve`'s semantic diff (serve/builder.py) and the build's
step keys (build.py) both use it.

`canonical` rewrites a graph so that two graphs with the same identity are the same graph, name
for name: nodes not on a path to an output dropped, the rest in one topological order chosen by
their hashes, constants with the same bytes merged, and every value but the graph's inputs and
outputs (the C ABI's names) renamed from that order (`<Op>_<k>` nodes, `v<k>` values, `c<k>`
constants). The import's file names, doc strings, producer and node order are gone; what is left
is what the library computes. The steps after the import are keyed by `identity` of this graph,
so the same model from an ONNX file, from TensorFlow through tf2onnx, or written by hand with other
names builds the same library, from the same cache entries.

A graph with subgraphs (If / Loop / Scan bodies, which name values of the outer graph) is kept as
imported and its identity covers its names too: equal identities must mean equal graphs.
"""
from __future__ import annotations

import hashlib
import heapq
import json

import numpy as np

from .ir import Graph, Node, Value


def _sha(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _array_sha(arr: np.ndarray) -> str:
    """sha256 of an array's contents: its bytes, or for a string tensor (dtype object, whose bytes
    are pointers) its elements' UTF-8 text."""
    if arr.dtype == object:
        items = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in arr.reshape(-1)]
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()
    return hashlib.sha256(arr.tobytes()).hexdigest()


def _canonical_attr(value, subgraph_hash):
    """An attribute value as plain JSON-able data: arrays by their bytes, subgraphs by their hash."""
    if isinstance(value, np.ndarray):
        return ["array", _dtype(value.dtype), list(value.shape), _array_sha(value)]
    if isinstance(value, (list, tuple)):
        return [_canonical_attr(v, subgraph_hash) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical_attr(v, subgraph_hash) for k, v in sorted(value.items())}
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", hashlib.sha256(bytes(value)).hexdigest()]
    if isinstance(value, np.generic):
        return value.item()
    if _is_graph(value):  # a CIR subgraph (If / Loop bodies)
        return ["graph", subgraph_hash(value)]
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def _dtype(dtype) -> str:
    """A dtype's key: its name too, since ml_dtypes' narrow types share one `.str` (int4 and uint4,
    the float8 variants: '|V1')."""
    dtype = np.dtype(dtype)
    return f"{dtype.str}:{dtype.name}"


def _is_graph(value) -> bool:
    return hasattr(value, "nodes") and hasattr(value, "values")


def _node_hash(node, hashes) -> str:
    attrs = {k: _canonical_attr(a, graph_hash) for k, a in sorted(node.attrs.items())}
    inputs = [hashes.get(i, _sha("outer", i)) for i in node.inputs]  # "outer": a subgraph's captured value
    return _sha("node", node.domain, node.op, attrs, inputs)


def _value_hashes(graph) -> tuple[dict[str, str], dict[int, str]]:
    """The hash of every value, and of every node (by its index in graph.nodes)."""
    hashes = {"": "absent"}
    for position, name in enumerate(graph.inputs):
        v = graph.values[name]
        hashes[name] = _sha("input", position, name, _dtype(v.dtype), list(v.shape))
    for name, v in graph.values.items():
        if v.is_const and name not in hashes:
            data = np.ascontiguousarray(v.data)
            hashes[name] = _sha("const", _dtype(data.dtype), list(data.shape), _array_sha(data))
    nodes = {}
    for k, node in enumerate(graph.nodes):  # topological order: every input is hashed before it is read
        nodes[k] = _node_hash(node, hashes)
        for index, out in enumerate(node.outputs):
            if out:
                hashes[out] = _sha(nodes[k], index)
    return hashes, nodes


def graph_hash(graph) -> str:
    """The semantic hash of a CIR graph: see the module docstring."""
    hashes, _ = _value_hashes(graph)
    return _sha("graph", [(name, hashes[name]) for name in graph.outputs])


def _has_subgraphs(graph) -> bool:
    def inside(value):
        if _is_graph(value):
            return True
        return isinstance(value, (list, tuple)) and any(inside(v) for v in value)
    return any(inside(a) for node in graph.nodes for a in node.attrs.values())


def _exact_digest(graph) -> str:
    """sha256 of everything in a graph, names and node order included."""
    from . import ir_io
    return hashlib.sha256(ir_io.dumps(graph)).hexdigest()


def identity(graph) -> str:
    """What the steps after the import are keyed by: the semantic hash of a canonical graph, with
    its opset and every input (used or not); for a graph `canonical` keeps as imported, a digest
    of all of it."""
    if _has_subgraphs(graph) or _duplicates(graph):
        return _sha("exact", _exact_digest(graph))
    inputs = [(n, _dtype(graph.values[n].dtype), list(graph.values[n].shape)) for n in graph.inputs]
    if graph.structure:  # sequence / optional inputs and outputs: their tensors are part of the ABI
        return _sha("semantic", graph_hash(graph), graph.opset, inputs, graph.structure)
    return _sha("semantic", graph_hash(graph), graph.opset, inputs)


def _live(graph) -> list[int]:
    """Indices of the nodes on a path to a graph output."""
    producer = {out: k for k, node in enumerate(graph.nodes) for out in node.outputs if out}
    live, stack = set(), [producer[o] for o in graph.outputs if o in producer]
    while stack:
        k = stack.pop()
        if k in live:
            continue
        live.add(k)
        stack.extend(producer[i] for i in graph.nodes[k].inputs if i in producer)
    return sorted(live)


def _duplicates(graph) -> bool:
    """Whether two live nodes compute the same thing (the same hash): their order and names could
    then not be told apart, and `canonical` keeps the graph as it is."""
    _, nodes = _value_hashes(graph)
    live = [nodes[k] for k in _live(graph)]
    return len(set(live)) != len(live)


def canonical(graph) -> Graph:
    """The graph in its canonical form (see the module docstring); a graph with subgraphs or
    duplicate nodes is returned as it is."""
    return _canonicalize(graph)[0]


def original_names(graph) -> dict[str, str]:
    """Each canonical node and value name of `canonical(graph)` -> its name in `graph` (for the
    messages of errors raised after the import: they name what the user's file names)."""
    return _canonicalize(graph)[1]


def rename_in_message(error, names: dict[str, str]):
    """A CuvilError whose message and hint name `names`' originals instead of canonical names
    (quoted names: node 'Conv_3' -> node 'conv1')."""
    if not names:
        return error
    error.message, error.hint = rename_in_text(error.message, names), rename_in_text(error.hint, names)
    error.args = (str(error),)
    return error


def rename_in_text(text, names: dict[str, str]):
    """`text` with each quoted canonical name replaced by its original (see rename_in_message)."""
    import re
    if not text or not names:
        return text
    return re.sub(r"'([^'\s]+)'", lambda m: f"'{names.get(m.group(1), m.group(1))}'", text)


def _canonicalize(graph) -> tuple[Graph, dict[str, str]]:
    if _has_subgraphs(graph) or _duplicates(graph):
        return graph, {}
    hashes, node_hashes = _value_hashes(graph)
    live = _live(graph)
    producer = {out: k for k in live for out in graph.nodes[k].outputs if out}
    waiting = {k: len({i for i in graph.nodes[k].inputs if i in producer}) for k in live}
    readers: dict[int, list[int]] = {}
    for k in live:
        for i in {i for i in graph.nodes[k].inputs if i in producer}:
            readers.setdefault(producer[i], []).append(k)
    ready = [(node_hashes[k], k) for k in live if waiting[k] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(k)
        for r in readers.get(k, []):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, (node_hashes[r], r))
    kept = set(graph.inputs) | set(graph.outputs)
    rename = {name: name for name in kept}
    const_names: dict[str, str] = {}      # a constant's hash -> its canonical name
    counters = {"c": 0, "v": 0}

    def fresh(prefix: str) -> str:        # the next c<k> / v<k> that is not an input's or output's name
        while True:
            name = f"{prefix}{counters[prefix]}"
            counters[prefix] += 1
            if name not in kept:
                return name

    def name_of_input(name: str) -> str:
        if not name or name in rename:
            return rename.get(name, name)
        if hashes[name] not in const_names:   # constants with the same bytes are one value
            const_names[hashes[name]] = fresh("c")
        rename[name] = const_names[hashes[name]]
        return rename[name]

    values: dict[str, Value] = {n: Value(n, graph.values[n].dtype, graph.values[n].shape, graph.values[n].data)
                                for n in graph.inputs}
    nodes, originals = [], {}
    for position, k in enumerate(order):
        node = graph.nodes[k]
        inputs = [name_of_input(i) for i in node.inputs]
        for old, new in zip(node.inputs, inputs):
            if old and new not in values:
                v = graph.values[old]
                values[new] = Value(new, v.dtype, v.shape, v.data)
        outputs = []
        for out in node.outputs:
            if out and out not in rename:
                rename[out] = fresh("v")
            new = rename.get(out, out)
            if out:
                v = graph.values[out]
                values[new] = Value(new, v.dtype, v.shape, v.data)
            outputs.append(new)
        nodes.append(Node(node.op, f"{node.op}_{position}", inputs, outputs, dict(node.attrs), node.domain))
        originals[f"{node.op}_{position}"] = node.name
    for name in graph.outputs:   # an output that is an input or a constant (no node writes it)
        if name not in values:
            v = graph.values[name]
            values[name] = Value(name, v.dtype, v.shape, v.data)
    for old, new in rename.items():
        if old != new:
            originals.setdefault(new, old)
    for old, new in rename.items():   # a data-dependent shape: its dims value under its new name
        source = graph.values.get(old)
        if source is not None and source.shape_from is not None and new in values:
            values[new].shape_from = rename.get(source.shape_from, source.shape_from)
    return Graph("model", values, nodes, list(graph.inputs), list(graph.outputs), graph.opset,
                 graph.structure), originals
