"""write_kv_in_place: a torch-exported decoder's Concat-grown KV cache becomes writes into a
static cache of max_context rows, with the positions not yet written masked out.

Why: torch's exporters (torch.onnx.export, dynamo and TorchScript) write a transformers decoder's
cache as growth: present = Concat(past [B, kv, P, D], new [B, kv, S, D], axis=2), P + S rows.
A generation library (cuvil/generation.py) keeps one buffer of C = max_context rows per past /
present pair for a session's life and binds it to both; so each entry is imported with
P = C - S (the graph's own shapes and masks then agree: attention_mask [1, C], keys [.., C, D])
and this rewrite makes the static form of it:

    present = Concat(past, new)       ->  present = TensorScatter(past, new, write) (axis 2)
                                          past: [B, kv, C, D], the same buffer as present
    write = ReduceSum(attention_mask) - S        (the mask holds ones for the past + S rows)

TensorScatter (opset 24) writes the S new rows at write .. write + S - 1; when past and present
are one buffer nothing else is copied (backends/numba_cpu/indexing.py). The rows after
write + S hold nothing yet (zeros, or a longer prompt's padding), and the graph, imported with
P = C - S, believes query row i sits at position C - S + i: its own causal mask lets row i see
every key up to C - S + i. So before each Softmax over the cache's keys the scores get

    bias[i, j] = 0 if j <= write + i else -1e30          ([S, C], float32)

added (to the graph's own additive mask when the Softmax reads Add(scores, mask), else on the
scores): row i sees keys 0 .. write + i, the real causal window. The graph's own mask only ever
masks more than that where it masks padding (attention_mask zeros: positions >= write + S), which
this bias masks too; -1e30 on top of a -inf or float-min mask stays finite or -inf, never NaN.
Positions come from position_ids (the caller's), never from the static shapes.

Not in the pass registry (cuvil.yaml cannot name it): the generation build runs it on each entry
right after import, with the decoder's layout (which inputs are past keys, the mask's name).
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import ModelError
from cuvil.ir import Graph, Node, Value

from ._rewrite import drop_unused_values

MASKED = -1e30
_PASS_THROUGH = ("Identity",)


def _forward_closure(graph: Graph, sources) -> set[str]:
    """Every value computed from `sources` (themselves included)."""
    reached = set(sources)
    for node in graph.nodes:
        if any(i in reached for i in node.inputs if i):
            reached.update(o for o in node.outputs if o)
    return reached


def _bypass_copies(g: Graph, pasts) -> None:
    """Drop Identity and one-input Concat nodes reading a past input (the TorchScript exporter
    writes `past` -> Concat([past]) -> Concat(_, new)): their readers read the past itself."""
    while True:
        outputs = set(g.outputs)
        node = next((n for n in g.nodes if n.inputs and n.inputs[0] in pasts and n.outputs[0] not in outputs
                     and (n.op in _PASS_THROUGH or (n.op == "Concat" and len(n.inputs) == 1))), None)
        if node is None:
            return
        g.nodes.remove(node)
        for other in g.nodes:
            other.inputs = [node.inputs[0] if i == node.outputs[0] else i for i in other.inputs]


def _add_node(g: Graph, nodes: list, op: str, inputs, dtype, shape, attrs=None) -> str:
    name = g.unique_name(f"cuvil_kv/{op.lower()}")
    g.values[name] = Value(name, np.dtype(dtype), tuple(int(d) for d in shape))
    nodes.append(Node(op, name, list(inputs), [name], dict(attrs or {})))
    return name


def _const(g: Graph, base: str, data) -> str:
    name = g.unique_name(f"cuvil_kv/{base}")
    data = np.asarray(data)
    g.values[name] = Value(name, data.dtype, tuple(data.shape), data)
    return name


def write_kv_in_place(graph: Graph, pairs, keys, attention_mask: str, where: str = "model") -> Graph:
    """The graph with each (past, present) pair of `pairs` (present = Concat(past, new) on axis 2)
    written in place, and the Softmax over the keys of each present in `keys` masked causally by
    real position (the module docstring). Raises ModelError naming the node or input whose form
    is not this one."""
    g = graph.copy()
    pasts = {p for p, _ in pairs}
    _bypass_copies(g, pasts)
    producers, consumers = g.producers(), g.consumers()
    hint = ("torch.onnx.export of a transformers decoder with past_key_values flattened to "
            "past_key_values.N.key / .value inputs and present.N.key / .value outputs (docs/generation.md)")
    concats = {}
    for past, present in pairs:
        node = producers.get(present)
        if node is None or node.op != "Concat" or len(node.inputs) != 2 or node.inputs[0] != past:
            found = f"{node.op} node '{node.name}'" if node is not None else "no node"
            raise ModelError(f"{where}: the cache output {present!r} is written by {found}, not Concat({past}, new)",
                             hint=f"generation takes KV caches grown as Concat(past, new) on the sequence axis ({hint}) "
                                  f"or onnxruntime-genai's GroupQueryAttention")
        rank = len(g.values[past].shape)
        axis = int(node.attr("axis", 0))
        if rank != 4 or axis % rank != 2:
            raise ModelError(f"{where}: node '{node.name}' concatenates the cache {past!r} on axis {axis}, not the "
                             f"sequence axis 2 of [batch, kv_heads, sequence, head_size]", hint=hint)
        readers = [n.name for n in consumers.get(past, []) if n is not node]
        if readers or past in g.outputs:
            raise ModelError(f"{where}: the cache input {past!r} is read by node(s) {readers} besides the Concat "
                             f"'{node.name}'", hint="only the Concat that grows the cache may read past: the cache "
                                                    "is written in place")
        concats[node.name] = (past, present)
    if not concats:
        return graph

    mask = g.values[attention_mask]
    S = int(g.values[concats[next(iter(concats))][1]].shape[2]) - int(g.values[pairs[0][0]].shape[2])
    C = int(mask.shape[-1])
    head = []    # nodes computing the write row and the bias once, before everything else
    mask64 = attention_mask
    if np.dtype(mask.dtype) != np.int64:
        mask64 = _add_node(g, head, "Cast", [attention_mask], np.int64, mask.shape, {"to": 7})
    total = _add_node(g, head, "ReduceSum", [mask64, _const(g, "axes", np.array([-1], np.int64))], np.int64, (1,),
                      {"keepdims": 0})
    write = _add_node(g, head, "Sub", [total, _const(g, "tokens", np.array(S, np.int64))], np.int64, (1,))
    last = _add_node(g, head, "Add", [_const(g, "rows", np.arange(S, dtype=np.int64).reshape(S, 1)), write],
                     np.int64, (S, 1))
    future = _add_node(g, head, "Greater", [_const(g, "columns", np.arange(C, dtype=np.int64).reshape(1, C)), last],
                       np.bool_, (S, C))
    bias = _add_node(g, head, "Where", [future, _const(g, "masked", np.array(MASKED, np.float32)),
                                        _const(g, "visible", np.array(0.0, np.float32))], np.float32, (S, C))

    nodes = []
    for node in g.nodes:
        if node.name in concats:
            past, present = concats[node.name]
            g.values[past].shape = g.values[present].shape
            nodes.append(Node("TensorScatter", node.name, [past, node.inputs[1], write], [present],
                              {"axis": 2, "mode": "linear"}))
        else:
            nodes.append(node)
    g.nodes = head + nodes

    # the Softmax nodes the keys reach (the scores over the cache), each masked by real position
    softmaxes, frontier = [], set(keys)
    for node in g.nodes:
        if any(i in frontier for i in node.inputs if i):
            if node.op == "Softmax":
                softmaxes.append(node)
            else:
                frontier.update(o for o in node.outputs if o)
    if not softmaxes:
        raise ModelError(f"{where}: no Softmax reads the keys of {sorted(keys)[:2]}...: the attention is not "
                         f"MatMul/Softmax over the cache", hint=hint)
    cached = _forward_closure(g, [p for _, p in pairs])
    producers = g.producers()
    masked: dict[str, str] = {}
    for node in softmaxes:
        scores = g.values[node.inputs[0]]
        rank = len(scores.shape)
        if int(node.attr("axis", -1)) % rank != rank - 1 or scores.shape[-1] != C or scores.shape[-2] != S:
            raise ModelError(f"{where}: Softmax '{node.name}' over the cache's keys has scores {list(scores.shape)} "
                             f"(axis {node.attr('axis', -1)}), not [..., {S} queries, {C} keys] on the last axis",
                             hint=hint)
        add = producers.get(node.inputs[0])
        other = None
        if add is not None and add.op == "Add" and len(add.inputs) == 2:
            other = next((k for k, i in enumerate(add.inputs) if i not in cached), None)
        index = next(k for k, n in enumerate(g.nodes) if n is (add if other is not None else node))
        if other is not None:
            graph_mask = add.inputs[other]
            shape = np.broadcast_shapes(g.values[graph_mask].shape, (S, C))
            if np.broadcast_shapes(shape, scores.shape) == tuple(scores.shape) \
                    and g.values[graph_mask].dtype == np.float32:
                if graph_mask not in masked:
                    extra = []
                    masked[graph_mask] = _add_node(g, extra, "Add", [graph_mask, bias], np.float32, shape)
                    g.nodes[index:index] = extra
                add.inputs[other] = masked[graph_mask]
                continue
            index = next(k for k, n in enumerate(g.nodes) if n is node)
        extra = []
        node.inputs[0] = _add_node(g, extra, "Add", [node.inputs[0], bias], scores.dtype, scores.shape)
        g.nodes[index:index] = extra
    return drop_unused_values(g)
