"""GroupQueryAttention and RotaryEmbedding (com.microsoft; shapes and checks in cuvil/contrib.py).

GroupQueryAttention is two calls, one after the other (the driver's barrier between them):

1. `GQAKV`, one work item per (batch, kv head): when present is not past's buffer, past rows
   [0, past_seqlen) are copied into present (when the caller binds one buffer to both, nothing is
   copied: the cache is updated in place); then the S new key rows (rotated) and value rows are
   written at rows past_seqlen .. past_seqlen + S - 1 of present.
2. `GQA`, one work item per (batch, group of heads sharing a kv head, run of query rows): the
   query rows rotated into scratch, scores q.k * scale over rows 0 .. min(past_seqlen + i,
   seqlens_k) of present only (the work follows the real length, never the cache's), each key
   row read once for the group's heads; softmax (max, vexp,
   sum, 1/sum), then the value rows weighted by the probabilities (each read once for the group)
   into the output rows [B, S, N H].

past_seqlen = seqlens_k[b] + 1 - S (0 for a first prompt, S == total_sequence_length), clamped so
that a wrong seqlens_k cannot write outside present; the rotary position of row i is
past_seqlen + i (a first prompt's padding rows past seqlens_k too, as onnxruntime 1.32 does).
Rotary (half = R / 2): non-interleaved pairs (x[i], x[i + half]), interleaved (x[2i], x[2i + 1]);
y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin; dims past R pass through.

Only the present outputs are read after call 1, never past: one buffer bound to past and present
is correct (tests/test_llm_ops.py runs the library so).
"""
from __future__ import annotations

import numpy as np

from cuvil import contrib

from .emit import NOALIAS_MARK
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, literal, session_threads
from .scratch import scratch_value

F32 = np.float32
SINGLE_ITEM_FLOATS = 8192   # new key/value floats up to which GQAKV is one work item


def _rotate_lines(src, form, x, xbase, y, ybase, pos, cos, sin):
    """Lines writing y[ybase + i] = rotary(x[xbase + i]) at position `pos`."""
    H, R = form["H"], form["rotary_dim"]
    half = R // 2
    if not form["do_rotary"]:
        src.line(f"for i in range({H}):").indent().line(f"{y}[{ybase} + i] = {x}[{xbase} + i]").dedent()
        return
    src.line(f"cb = {pos} * {half}")
    src.line(f"for i in range({half}):").indent()
    src.line(f"c = {cos}[cb + i]").line(f"sn = {sin}[cb + i]")
    a, b = ("2 * i", "2 * i + 1") if form["interleaved"] else ("i", f"i + {half}")
    src.line(f"x1 = {x}[{xbase} + {a}]").line(f"x2 = {x}[{xbase} + {b}]")
    src.line(f"{y}[{ybase} + {a}] = (x1 * c - x2 * sn)")
    src.line(f"{y}[{ybase} + {b}] = (x2 * c + x1 * sn)")
    src.dedent()
    if R < H:
        src.line(f"for i in range({R}, {H}):").indent().line(f"{y}[{ybase} + i] = {x}[{xbase} + i]").dedent()


def _past_lines(src, form, seqlens, b):
    """Lines setting `past` (past_seqlen, clamped into present) and `total` for batch `b`."""
    S, present = form["S"], form["present"]
    src.line(f"total = np.int64({seqlens}[{b}]) + 1")
    if form["first_prompt"]:
        src.line("past = 0")
    else:
        src.line(f"past = total - {S}")
        src.line(f"if past > {present - S}:").indent().line(f"past = {present - S}").dedent()
        src.line("if past < 0:").indent().line("past = 0").dedent()


def _position_lines(src, form, max_pos):
    src.line("pos = past + s")
    src.line(f"if pos > {max_pos - 1}:").indent().line(f"pos = {max_pos - 1}").dedent()


def _sources(form):
    """(query row width, offset of K, offset of V, key/value row width) in the sources: one packed
    row per token, or query, key and value apart."""
    N, Nkv, H = form["heads"], form["kv_heads"], form["H"]
    if form["packed"]:
        D = (N + 2 * Nkv) * H
        return D, N * H, (N + Nkv) * H, D
    return N * H, 0, 0, Nkv * H


def _kv_call(node, form, key, value, past_k, past_v, seqlens, cos, sin, pres_k, pres_v) -> KernelCall:
    B, S, H, Nkv, P, C = form["B"], form["S"], form["H"], form["kv_heads"], form["past"], form["present"]
    _, koff, voff, kvd = _sources(form)
    args = [key, value] + ([past_k, past_v] if P else []) + [seqlens] + ([cos, sin] if form["do_rotary"] else [])
    names = {a: f"p{i}" for i, a in enumerate(["k", "v"] + (["pk", "pv"] if P else []) + ["sl"]
                                                + (["cos", "sin"] if form["do_rotary"] else []))}
    pk_, pv_ = f"p{len(args)}", f"p{len(args) + 1}"
    types = ["float32", "float32"] + (["float32"] * 2 if P else []) + ["int32"] + \
        (["float32"] * 2 if form["do_rotary"] else []) + ["float32", "float32"]
    max_pos = int(form["cos"].shape[0]) if form["do_rotary"] else 1
    # A decode step writes a row or two per kv head: one work item for all (the driver runs a
    # single item on the calling thread; waking the pool would cost more than the rows).
    single = S * B * Nkv * H <= SINGLE_ITEM_FLOATS
    items = B * Nkv
    src = Source().line(kernel_header(len(types))).indent()
    src.line(f"for item in range(begin * {items}, end * {items}):" if single else "for item in range(begin, end):")
    src.indent()
    src.line(f"b = item // {Nkv}").line(f"j = item % {Nkv}")
    _past_lines(src, form, names["sl"], "b")
    src.line(f"pres = item * {C * H}")
    if P:
        # the caller's own buffer for past and present: the rows are already there
        for past, pres in ((names["pk"], pk_), (names["pv"], pv_)):
            src.line(f"if not same_buffer({past}, {pres}):").indent()
            src.line(f"keep = past if past < {P} else {P}")
            src.line(f"for t in range(keep * {H}):").indent().line(f"{pres}[pres + t] = {past}[item * {P * H} + t]")
            src.dedent().dedent()
    src.line(f"for s in range({S}):").indent()
    src.line(f"row = (b * {S} + s) * {kvd}")
    src.line(f"dst = pres + (past + s) * {H}")
    src.line(f"ks = row + {koff} + j * {H}").line(f"vs = row + {voff} + j * {H}")
    if form["do_rotary"]:
        _position_lines(src, form, max_pos)
    _rotate_lines(src, form, names["k"], "ks", pk_, "dst", "pos", names.get("cos"), names.get("sin"))
    src.line(f"for i in range({H}):").indent().line(f"{pv_}[dst + i] = {names['v']}[vs + i]").dedent()
    kernel = Kernel("GQAKV", src.text(), tuple(types))
    return KernelCall(kernel, args + [pres_k, pres_v], 1 if single else items, node.name, n_outputs=2)


def _split(form) -> tuple[int, int]:
    """(heads per item, runs of query rows per (batch, head group)). An item takes the heads that
    share a key/value head together, so each key and value row is read once for all of them; with
    more threads than (batch, kv head) pairs the groups are split, then the rows are dealt
    round-robin into runs (a causal prefill's long and short rows mix in every run)."""
    threads = session_threads()
    want = 4 * threads if threads > 1 else 1
    group = form["heads"] // form["kv_heads"]
    per_item = group
    while per_item % 2 == 0 and form["B"] * form["heads"] // per_item < want:
        per_item //= 2
    items = form["B"] * form["heads"] // per_item
    return per_item, max(1, min(form["S"], -(-want // items)))


def _attention_call(node, graph, form, query, seqlens, cos, sin, pres_k, pres_v, out) -> KernelCall:
    B, S, H, N, Nkv, C = form["B"], form["S"], form["H"], form["heads"], form["kv_heads"], form["present"]
    qd, _, _, _ = _sources(form)
    group = N // Nkv
    GS, runs = _split(form)
    items = B * (N // GS) * runs
    # per item: its heads' query rows, scores, output accumulators and 1/sum
    slot = -(-(GS * (2 * H + C + 1)) // 16) * 16
    scratch = scratch_value(graph, node, (items * slot,), F32, tag="gqa")
    rot = form["do_rotary"]
    args = [query, pres_k, pres_v, seqlens] + ([cos, sin] if rot else []) + [scratch, out]
    types = ("float32", "float32", "float32", "int32") + (("float32", "float32") if rot else ()) + ("float32", "float32")
    cs, sn = ("p4", "p5") if rot else (None, None)
    ws, po = f"p{len(args) - 2}", f"p{len(args) - 1}"
    max_pos = int(form["cos"].shape[0]) if rot else 1
    zero = literal(0, F32)
    # query, cache, tables, scratch and output are distinct buffers (present is never the query's
    # or the output's): LLVM may keep the accumulators in registers across the key/value rows
    src = Source().line(NOALIAS_MARK).line(kernel_header(len(args))).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"run = item % {runs}").line(f"bg = item // {runs}")
    src.line(f"b = bg // {N // GS}").line(f"h0 = (bg % {N // GS}) * {GS}")
    src.line(f"kv = (b * {Nkv} + h0 // {group}) * {C * H}")
    src.line(f"w = item * {slot}").line(f"sc = w + {GS * H}").line(f"acc = sc + {GS * C}").line(f"iv = acc + {GS * H}")
    _past_lines(src, form, "p3", "b")
    src.line(f"for s in range(run, {S}, {runs}):").indent()
    if rot:
        _position_lines(src, form, max_pos)
    src.line(f"for g in range({GS}):").indent()
    src.line(f"qs = (b * {S} + s) * {qd} + (h0 + g) * {H}").line(f"qw = w + g * {H}")
    _rotate_lines(src, form, "p0", "qs", ws, "qw", "pos", cs, sn)
    src.dedent()
    # a first prompt's padding rows attend to the real rows only (onnxruntime's product covers
    # seqlens_k + 1 columns); otherwise past + s + 1 <= total already
    src.line("n = past + s + 1")
    src.line("if n > total:").indent().line("n = total").dedent()
    src.line("if n < 1:").indent().line("n = 1").dedent()
    # scores: each key row read once for the item's heads
    src.line("for t in range(n):").indent()
    src.line(f"kr = kv + t * {H}")
    src.line(f"for g in range({GS}):").indent()
    src.line(f"d = {zero}").line(f"qw = w + g * {H}")
    src.line(f"for i in range({H}):").indent().line(f"d += {ws}[qw + i] * p1[kr + i]").dedent()
    src.line(f"{ws}[sc + g * {C} + t] = d * {literal(form['scale'], F32)}")
    src.dedent().dedent()
    # softmax of each head's scores
    src.line(f"for g in range({GS}):").indent()
    src.line(f"r0 = sc + g * {C}")
    src.line(f"m = {ws}[r0]")
    src.line("for t in range(n):").indent().line(f"m = vmax(m, {ws}[r0 + t])").dedent()
    src.line(f"tot = {zero}")
    src.line("for t in range(n):").indent()
    src.line(f"e = math.exp({ws}[r0 + t] - m)").line(f"{ws}[r0 + t] = e").line("tot += e").dedent()
    src.line(f"{ws}[iv + g] = {literal(1, F32)} / tot")
    src.line(f"for i in range({H}):").indent().line(f"{ws}[acc + g * {H} + i] = {zero}").dedent()
    src.dedent()
    # the value rows, each read once for the item's heads
    src.line("for t in range(n):").indent()
    src.line(f"vr = kv + t * {H}")
    src.line(f"for g in range({GS}):").indent()
    src.line(f"pt = {ws}[sc + g * {C} + t] * {ws}[iv + g]").line(f"ag = acc + g * {H}")
    src.line(f"for i in range({H}):").indent().line(f"{ws}[ag + i] += pt * p2[vr + i]").dedent()
    src.dedent().dedent()
    src.line(f"for g in range({GS}):").indent()
    src.line(f"o = (b * {S} + s) * {N * H} + (h0 + g) * {H}")
    src.line(f"for i in range({H}):").indent().line(f"{po}[o + i] = {ws}[acc + g * {H} + i]").dedent()
    kernel = Kernel("GQA", src.text(), types)
    return KernelCall(kernel, args, items, node.name, n_outputs=2)


def lower_group_query_attention(node, graph) -> Lowered:
    form = contrib.gqa_form(node, graph.values)
    ins = list(node.inputs) + [""] * (len(contrib.GQA_INPUTS) - len(node.inputs))
    query, key, value, past_k, past_v, seqlens = ins[:6]
    cos, sin = ins[7], ins[8]
    if form["packed"]:
        key = value = query
    out, pres_k, pres_v = node.outputs[:3]
    calls = []
    if not pres_k or not pres_v:
        # onnxruntime always writes present; without it here the new rows still need a home
        pres_k = pres_k or scratch_value(graph, node, (form["B"], form["kv_heads"], form["present"], form["H"]), F32, "gqak")
        pres_v = pres_v or scratch_value(graph, node, (form["B"], form["kv_heads"], form["present"], form["H"]), F32, "gqav")
    calls.append(_kv_call(node, form, key, value, past_k, past_v, seqlens, cos, sin, pres_k, pres_v))
    calls.append(_attention_call(node, graph, form, query, seqlens, cos, sin, pres_k, pres_v, out))
    return Lowered(calls)


def lower_rotary_embedding(node, graph) -> Lowered:
    """RotaryEmbedding: one work item per (batch, position) row; each head rotated in place of its
    own slot of the output (the input is read once)."""
    form = contrib.rotary_form(node, graph.values)
    x, pos, cos, sin = node.inputs[:4]
    y = node.outputs[0]
    B, S, N, H = form["B"], form["S"], form["N"], form["H"]
    max_pos = int(form["cos"].shape[0])
    pos_dtype = np.dtype(graph.values[pos].dtype).name
    rform = dict(form, do_rotary=True)
    src = Source().line(kernel_header(5)).indent()
    src.line("for r in range(begin, end):").indent()
    src.line(f"b = r // {S}").line(f"s = r % {S}")
    src.line("pos = np.int64(p1[0]) + s" if form["start_only"] else "pos = np.int64(p1[r])")
    src.line(f"if pos > {max_pos - 1}:").indent().line(f"pos = {max_pos - 1}").dedent()
    src.line("if pos < 0:").indent().line("pos = 0").dedent()
    src.line(f"for h in range({N}):").indent()
    if form["layout"] == "bsnh":
        src.line(f"base = r * {N * H} + h * {H}")
    else:
        src.line(f"base = ((b * {N} + h) * {S} + s) * {H}")
    _rotate_lines(src, rform, "p0", "base", "p4", "base", "pos", "p2", "p3")
    kernel = Kernel("RotaryEmbedding", src.text(), ("float32", pos_dtype, "float32", "float32", "float32"))
    return Lowered([KernelCall(kernel, [x, pos, cos, sin, y], B * S, node.name)])
