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

Where a layer's attention is the one transformers writes (scores = MatMul(Q, K') [* or / a
scalar] [+ mask], Softmax on the last axis [, Where(IsNaN(p), 0, p)], MatMul(p, V'), with K' and V'
the present key and value as repeat_kv and a transpose make them, checked by evaluating their
chains on a probe: K' = c * repeat(K, heads / kv_heads)^T, V' = repeat(V, heads / kv_heads)), the
layer becomes one GroupQueryAttention (com.microsoft, the kernel of onnxruntime-genai's decoders:
backends/numba_cpu/gqa.py) over the cache: it writes the new rows in place and reads keys 0 ..
write + i only, once per kv head, with scale = c times the scores' scalar; the graph's mask is
dropped (a generation library's mask is ones for the rows written, zeros after: the causal window
by real position is all of it). seqlens_k = write + S - 1 (int32), total_sequence_length = C.
No copy of the cache then (repeat_kv's Expand and the Transpose of K each copied all C rows of
every layer per token). A layer not of that form keeps its own attention over the C rows with
the TensorScatter and the bias above.

Not in the pass registry (cuvil.yaml cannot name it): the generation build runs it on each entry
right after import, with the decoder's layout (which inputs are past keys, the mask's name).
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import ModelError
from cuvil.ir import Graph, Node, Value

from ._rewrite import drop_unused_values
from .eliminate_dead import eliminate_dead

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


_SHAPE_OPS = ("Unsqueeze", "Squeeze", "Expand", "Reshape", "Transpose", "Identity", "Mul", "Div")


def _evaluate(g: Graph, value: str, leaves, probes: dict, path: list):
    """`value` computed from one of `leaves` (fed `probes[leaf]`) through shape ops and scalar
    Mul / Div only, with numpy; (leaf, array), or None when it is computed otherwise. The nodes
    passed go to `path`."""
    producers = g.producers()
    found = []

    def run(name):
        if name in leaves:
            found.append(name)
            return probes[name]
        v = g.values[name]
        if v.is_const:
            return np.asarray(v.data)
        node = producers.get(name)
        if node is None or node.op not in _SHAPE_OPS or node.domain not in ("", "ai.onnx"):
            raise LookupError(name)
        path.append(node)
        x = run(node.inputs[0])
        if node.op in ("Mul", "Div"):
            other = g.values[node.inputs[1]]
            if not other.is_const or other.size != 1:
                raise LookupError(name)
            c = float(np.asarray(other.data).reshape(-1)[0])
            return x * c if node.op == "Mul" else x / c
        if node.op == "Identity":
            return x
        if node.op == "Transpose":
            return np.transpose(x, node.attr("perm", list(reversed(range(x.ndim)))))
        shape = [int(d) for d in v.shape]
        if node.op == "Expand":
            return np.broadcast_to(x, shape)
        return x.reshape(shape)         # Reshape, Unsqueeze, Squeeze: the output's static shape says it

    try:
        result = run(value)
    except LookupError:
        return None
    return (found[0], result) if len(set(found)) == 1 else None


def _fuse_attention(g: Graph, present_k: str, values: dict, cached: set, where: str):
    """The layer whose keys are `present_k` as one GroupQueryAttention (module docstring), or a
    reason (str) why its attention is not of that form. `values`: present value -> Concat node."""
    producers, consumers = g.producers(), g.consumers()
    concat_k = producers[present_k]
    frontier, softmaxes = {present_k}, []
    for node in g.nodes:
        if any(i in frontier for i in node.inputs if i):
            if node.op == "Softmax":
                softmaxes.append(node)
            else:
                frontier.update(o for o in node.outputs if o)
    if len(softmaxes) != 1:
        return f"the keys reach {len(softmaxes)} Softmax nodes"
    softmax = softmaxes[0]
    chain = [softmax]
    node, scale = producers.get(softmax.inputs[0]), 1.0
    if node is not None and node.op == "Add" and len(node.inputs) == 2 and \
            sum(i not in cached for i in node.inputs) == 1:
        chain.append(node)
        node = producers.get(next(i for i in node.inputs if i in cached))
    if node is not None and node.op in ("Mul", "Div") and len(node.inputs) == 2:
        c = g.values[node.inputs[1]]
        if c.is_const and c.size == 1 and float(np.asarray(c.data).reshape(-1)[0]) != 0:
            c = float(np.asarray(c.data).reshape(-1)[0])
            scale = c if node.op == "Mul" else 1.0 / c
            chain.append(node)
            node = producers.get(node.inputs[0])
    if node is None or node.op != "MatMul":
        return "the scores are not MatMul [* scale] [+ mask] before the Softmax"
    scores_mm = node
    chain.append(node)
    query, k_side = scores_mm.inputs
    # after the Softmax: [Where(IsNaN(p), 0, p)] then MatMul(p, V')
    probs = softmax.outputs[0]
    readers = consumers.get(probs, [])
    if len(readers) == 2 and {r.op for r in readers} == {"IsNaN", "Where"}:
        isnan = next(r for r in readers if r.op == "IsNaN")
        guard = next(r for r in readers if r.op == "Where")
        zero = g.values[guard.inputs[1]]
        if guard.inputs[0] != isnan.outputs[0] or guard.inputs[2] != probs or not zero.is_const \
                or np.any(np.asarray(zero.data) != 0):
            return "the Softmax's output is guarded other than Where(IsNaN(p), 0, p)"
        chain += [isnan, guard]
        probs = guard.outputs[0]
        readers = consumers.get(probs, [])
    if len(readers) != 1 or readers[0].op != "MatMul" or readers[0].inputs[0] != probs:
        return "the probabilities are not read by one MatMul(p, V)"
    out_mm = readers[0]
    out = out_mm.outputs[0]
    kv = g.values[present_k].shape
    q, o = g.values[query].shape, g.values[out].shape
    if len(q) != 4 or len(kv) != 4 or q[0] != 1 or q[1] % kv[1] or tuple(o) != tuple(q) or q[3] != kv[3]:
        return f"query {list(q)} / keys {list(kv)} / output {list(o)} are not [1, heads, S, head] over [1, kv, C, head]"
    heads, rep = int(q[1]), int(q[1]) // int(kv[1])
    rng = np.random.default_rng(0)
    probe = rng.standard_normal(kv).astype(np.float64)
    k_path, v_path = [], []
    got = _evaluate(g, k_side, {present_k}, {present_k: probe}, k_path)
    want = np.swapaxes(np.repeat(probe, rep, axis=1), -1, -2)
    if got is None or got[1].shape != want.shape:
        return "the keys reach the scores' MatMul through more than repeat_kv and a transpose"
    k_scale = float(np.vdot(got[1], want) / np.vdot(want, want))
    if not np.allclose(got[1], k_scale * want, rtol=1e-6, atol=0):
        return "the keys reach the scores' MatMul other than as repeat_kv(K) transposed"
    got = _evaluate(g, out_mm.inputs[1], set(values), {v: probe for v in values}, v_path)
    if got is None or not np.allclose(got[1], np.repeat(probe, rep, axis=1), rtol=1e-6, atol=0):
        return "the values reach the output's MatMul other than as repeat_kv(V)"
    present_v = got[0]
    concat_v = values[present_v]
    chain += k_path + v_path + [out_mm]
    inside = {n.name for n in chain} | {concat_k.name, concat_v.name}
    for node in chain:
        for o in node.outputs:
            if o != out and (o in g.outputs or any(r.name not in inside for r in consumers.get(o, []))):
                return f"'{o}' (of node '{node.name}') is read outside the attention"
    for present in (present_k, present_v):
        if any(r.name not in inside for r in consumers.get(present, [])):
            return f"{present!r} is read outside the attention"
    return {"chain": chain, "query": query, "out": out, "scale": k_scale * scale, "heads": heads,
            "kv_heads": int(kv[1]), "concat_k": concat_k, "concat_v": concat_v, "out_mm": out_mm}


def _bsnh(g: Graph, nodes: list, value: str) -> str:
    """[1, N, S, H] -> [1, S, N * H] (GroupQueryAttention's layout)."""
    _, n, s, h = g.values[value].shape
    t = _add_node(g, nodes, "Transpose", [value], np.float32, (1, s, n, h), {"perm": [0, 2, 1, 3]})
    return _add_node(g, nodes, "Reshape", [t, _const(g, "shape", np.array([1, s, n * h], np.int64))],
                     np.float32, (1, s, n * h))


def write_kv_in_place(graph: Graph, pairs, keys, attention_mask: str, where: str = "model", fuse: bool = True) -> Graph:
    """The graph with each (past, present) pair of `pairs` (present = Concat(past, new) on axis 2)
    written in place, and the Softmax over the keys of each present in `keys` masked causally by
    real position (the module docstring); with `fuse`, each layer of transformers' attention form
    becomes one GroupQueryAttention (without: every layer keeps its own attention). Raises
    ModelError naming the node or input whose form is not this one."""
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

    # layers of transformers' attention form: one GroupQueryAttention each
    seqlens = _add_node(g, head, "Cast", [_add_node(g, head, "Sub", [total, _const(g, "one", np.array(1, np.int64))],
                                                    np.int64, (1,))], np.int32, (1,), {"to": 6})
    context = _const(g, "context", np.array(C, np.int32))
    g.nodes = head + g.nodes
    cached = _forward_closure(g, [p for _, p in pairs])
    by_present = {present: g.producers()[present] for _, present in pairs}
    value_concats = {p: n for p, n in by_present.items() if p not in keys}
    fused = []
    for present_k in keys if fuse else ():
        found = _fuse_attention(g, present_k, value_concats, cached, where)
        if isinstance(found, str):
            continue
        nodes = []
        q = _bsnh(g, nodes, found["query"])
        k = _bsnh(g, nodes, found["concat_k"].inputs[1])
        v = _bsnh(g, nodes, found["concat_v"].inputs[1])
        past_k, past_v = found["concat_k"].inputs[0], found["concat_v"].inputs[0]
        present_v = found["concat_v"].outputs[0]
        for past, present in ((past_k, present_k), (past_v, present_v)):
            g.values[past].shape = g.values[present].shape
        _, heads, S_, hs = g.values[found["out"]].shape
        flat = g.unique_name(f"{found['out']}/gqa")
        g.values[flat] = Value(flat, np.dtype(np.float32), (1, S_, heads * hs))
        nodes.append(Node("GroupQueryAttention", found["out_mm"].name + "/gqa",
                          [q, k, v, past_k, past_v, seqlens, context], [flat, present_k, present_v],
                          {"num_heads": found["heads"], "kv_num_heads": found["kv_heads"], "scale": found["scale"],
                           "do_rotary": 0}, domain="com.microsoft"))
        split = _add_node(g, nodes, "Reshape", [flat, _const(g, "shape", np.array([1, S_, heads, hs], np.int64))],
                          np.float32, (1, S_, heads, hs))
        nodes.append(Node("Transpose", found["out_mm"].name, [split], [found["out"]], {"perm": [0, 2, 1, 3]}))
        drop = {n.name for n in found["chain"]} | {found["concat_k"].name, found["concat_v"].name}
        index = next(i for i, n in enumerate(g.nodes) if n is found["out_mm"])
        g.nodes = [n for n in g.nodes[:index] if n.name not in drop] + nodes + \
            [n for n in g.nodes[index + 1:] if n.name not in drop]
        fused.append(found["concat_k"].name)
        fused.append(found["concat_v"].name)
    for name in fused:
        concats.pop(name)
    keys = [k for k in keys if by_present[k].name in concats]
    if not concats:
        return drop_unused_values(eliminate_dead(g))

    nodes = []
    for node in g.nodes:
        if node.name in concats:
            past, present = concats[node.name]
            g.values[past].shape = g.values[present].shape
            nodes.append(Node("TensorScatter", node.name, [past, node.inputs[1], write], [present],
                              {"axis": 2, "mode": "linear"}))
        else:
            nodes.append(node)
    g.nodes = nodes

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
    return drop_unused_values(eliminate_dead(g))
