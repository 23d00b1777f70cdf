"""ExpandDepthwise (domain "cuvil", made by passes/fuse_expand_depthwise.py): a 1x1 conv and
the depthwise conv that reads it, in bands of rows that stay in L2.

    t = act1(W1 @ x + b1)                      the expanded channels (C1 = W1's rows)
    y[c] = act2(b2[c] + dw(t[c], w2[c]))       stride s (1 or 2), kernel KH x KW

One band is R output rows of every channel. Its input rows, (R - 1)*s + KH of t,
are computed into a slot of scratch laid out [C1][band rows][W] by the GEMM
micro-kernels (bias and activation in registers, like a pointwise conv's), and
the depthwise conv reads them from there with the DwRowSpec micro-kernel, one
call per output row and channel: the slot is written and read back while it
is in L2, and t never exists as a whole. The KH - s rows two bands share stay in
the slot: each band moves them to the top and computes only its new rows.

Work items are (image, run of consecutive bands), each with a slot of its own
(one slot for all when the library runs on one thread), so the results do not
depend on which thread computes what.
"""
from __future__ import annotations

import numpy as np

from backends.native.ukernel import LOADC_EPILOGUE, DwRowSpec, UKSpec
from cuvil.ir import Node, Value

from . import conv
from .epilogue import Epilogue, epilogue_of, register_activation, register_epilogue
from .gemm import UK_KC, _ceil_div, choose_tile, pack_a_panels
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, session_threads, work_items
from .scratch import scratch_value

BAND_BYTES = 256 << 10   # one slot (every channel's rows of a band) stays well inside a 1-2 MiB L2
MIN_BANDS = 4


def _epilogue(node, prefix: str) -> Epilogue:
    """The node's `{prefix}activation` as an Epilogue (checked like a FusedConv's)."""
    attrs = {"activation": node.attr(f"{prefix}activation", ""),
             "activation_params": node.attr(f"{prefix}activation_params", [])}
    return epilogue_of(Node("FusedConv", node.name, [], [], attrs, domain="cuvil"))[0]


def _split(node, graph) -> Lowered:
    """The two convs the node stands for, lowered one after the other (shapes the fused kernel
    does not take)."""
    x, w1, b1, w2, b2 = node.inputs
    C1 = graph.values[w1].shape[0]
    N, _, H, Wd = graph.values[x].shape
    mid = graph.unique_name(f"{node.name}__expanded")
    graph.values[mid] = Value(mid, np.dtype(np.float32), (N, C1, H, Wd))

    def attrs(prefix):
        return {"activation": node.attr(f"{prefix}activation", ""),
                "activation_params": node.attr(f"{prefix}activation_params", [])}
    pw = Node("FusedConv", node.attr("expand_node", f"{node.name}_expand"), [x, w1] + ([b1] if b1 else []), [mid],
              attrs("expand_"), domain="cuvil")
    dw = Node("FusedConv", node.name, [mid, w2] + ([b2] if b2 else []), list(node.outputs),
              {**attrs(""), "group": C1, "kernel_shape": node.attr("kernel_shape"), "strides": node.attr("strides"),
               "pads": node.attr("pads")}, domain="cuvil")
    return Lowered(conv.lower_conv(pw, graph).calls + conv.lower_conv(dw, graph).calls)


def lower_expand_depthwise(node, graph) -> Lowered:
    x_name, w1_name, b1_name, w2_name, b2_name = node.inputs
    X, W1, W2, Y = (graph.values[n] for n in (x_name, w1_name, w2_name, node.outputs[0]))
    N, C0, H, Wd = (int(v) for v in X.shape)
    C1 = int(W1.shape[0])
    KH, KW = (int(v) for v in W2.shape[2:])
    OH, OW = (int(v) for v in Y.shape[2:])
    s = int(node.attr("strides")[0])
    p_t, p_l = (int(v) for v in node.attr("pads")[:2])
    if C0 > UK_KC or np.dtype(X.dtype) != np.float32:
        return _split(node, graph)
    expand, dw_epilogue = _epilogue(node, "expand_"), _epilogue(node, "")

    # Bands of R output rows; a slot holds BR input rows of every channel.
    # At least MIN_BANDS bands (a work item per run of bands: one per item on several threads).
    one_slot = session_threads() == 1
    R = max(1, min(_ceil_div(OH, MIN_BANDS if one_slot else max(MIN_BANDS, work_items())),
                   (BAND_BYTES // (4 * C1 * Wd) - KH) // s + 1))
    BR = (R - 1) * s + KH
    n_bands = _ceil_div(OH, R)
    runs = 1 if one_slot else min(n_bands, max(1, _ceil_div(work_items(), N)))
    work = N * runs
    slot = C1 * BR * Wd
    scratch = scratch_value(graph, node, ((1 if one_slot else work) * slot,), np.float32, tag="bands")

    # Expand weights in micro-kernel panels (one pass over k: C0 <= UK_KC), its bias (zeros when
    # none: the micro-kernel's epilogue then adds 0); depthwise weights and bias per channel.
    MR, NR = choose_tile(C1, BR * Wd)
    a = pack_a_panels(np.asarray(W1.data, dtype=np.float32).reshape(C1, C0), MR)
    b1 = np.zeros(_ceil_div(C1, MR) * MR, dtype=np.float32)
    if b1_name:
        b1[:C1] = np.asarray(graph.values[b1_name].data, dtype=np.float32).reshape(C1)
    taps = KH * KW
    w2 = np.zeros((C1, taps + 1), dtype=np.float32)
    w2[:, :taps] = np.asarray(W2.data, dtype=np.float32).reshape(C1, taps)
    if b2_name:
        w2[:, taps] = np.asarray(graph.values[b2_name].data, dtype=np.float32).reshape(C1)

    uk = register_epilogue(True, expand)
    specs = {(mr, masked): UKSpec(mr=mr, nr=NR, a_packed=1, a_panel=MR, b_masked=masked, **uk)
             for mr in sorted({MR, C1 % MR} - {0}) for masked in (0, 1)}
    names = {key: f"uk{i}" for i, key in enumerate(specs)}
    row = DwRowSpec(H=H, W=Wd, OW=OW, KH=KH, KW=KW, p_l=p_l, stride=s, **register_activation(dw_epilogue))
    pair = DwRowSpec(H=H, W=Wd, OW=OW, KH=KH, KW=KW, p_l=p_l, stride=s, rows=2, **register_activation(dw_epilogue))

    src = Source()
    for key, spec in specs.items():
        for line in spec.declaration(names[key]).splitlines():
            src.line(line)
    for line in row.declaration("dwrow").splitlines() + (pair.declaration("dwrows2").splitlines() if s == 1 else []):
        src.line(line)
    # Pointers: x, expand panels, expand bias, depthwise weights, scratch (slots), y.
    src.line(kernel_header(6)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {runs}").line(f"run = item % {runs}")
    src.line("so = 0" if one_slot else f"so = item * {slot}")
    src.line(f"b_lo = run * {n_bands} // {runs}").line(f"b_hi = (run + 1) * {n_bands} // {runs}")
    src.line("base = 0").line("have_lo = 0").line("have_hi = 0")
    src.line("for band in range(b_lo, b_hi):").indent()
    src.line(f"oh0 = band * {R}").line(f"oh1 = min(oh0 + {R}, {OH})")
    src.line(f"top = oh0 * {s} - {p_t}")
    src.line("lo = max(top, 0)").line(f"hi = min((oh1 - 1) * {s} - {p_t} + {KH}, {H})")
    # The rows this band shares with the last one move to the top of the slot (forward: top > base).
    src.line("keep = max(lo, have_lo)")
    src.line("new = lo")
    src.line("if keep < have_hi:").indent()
    src.line("new = have_hi")
    src.line("if top != base:").indent()
    src.line(f"for c in range({C1}):").indent()
    src.line(f"src = so + c * {BR * Wd} + (keep - base) * {Wd}")
    src.line(f"dst = so + c * {BR * Wd} + (keep - top) * {Wd}")
    src.line(f"for j in range((have_hi - keep) * {Wd}):").indent()
    src.line("p4[dst + j] = p4[src + j]")
    src.dedent().dedent().dedent().dedent()
    # The new rows: out[C1 x pixels] = W1 @ x[C0 x pixels], pixels the flat run of rows [new, hi).
    src.line("if new < hi:").indent()
    src.line(f"npx = (hi - new) * {Wd}")
    src.line(f"xb = n * {C0 * H * Wd} + new * {Wd}")
    src.line(f"ob = so + (new - top) * {Wd}")
    src.line(f"for n0 in range(0, npx, {NR}):").indent()
    src.line(f"nv = min({NR}, npx - n0)")
    src.line(f"mask = np.int64(-1) if nv >= {NR} else (np.int64(1) << nv) - np.int64(1)")
    src.line(f"edge = nv < {NR}")

    def call(mr, m, masked):
        src.line(f"{names[(mr, masked)]}(p1, {m} * {C0}, 0, p0, xb + n0, {H * Wd}, p4, ob + {m} * {BR * Wd} + n0, "
                 f"{BR * Wd}, {C0}, mask, {LOADC_EPILOGUE}, p2, {m})")

    for masked, test in ((0, "if not edge:"), (1, "else:")):
        src.line(test).indent()
        src.line(f"for m in range(0, {C1 - C1 % MR}, {MR}):").indent()
        call(MR, "m", masked)
        src.dedent()
        if C1 % MR:
            call(C1 % MR, C1 - C1 % MR, masked)
        src.dedent()
    src.dedent().dedent()
    src.line("base = top").line("have_lo = lo").line("have_hi = hi")
    # The depthwise conv over the band: row r of the input is at slot row r - top.
    src.line(f"for c in range({C1}):").indent()
    src.line(f"xo = so + c * {BR * Wd} - top * {Wd}")
    src.line(f"yo = (n * {C1} + c) * {OH * OW}")
    if s == 1:   # pairs of rows (the input rows loaded feed both), then the last one
        src.line("for oh in range(oh0, oh1 - 1, 2):").indent()
        src.line(f"dwrows2(p4, xo, oh - {p_t}, p3, c * {taps + 1}, p5, yo + oh * {OW})").dedent()
        src.line("if (oh1 - oh0) % 2:").indent()
        src.line(f"dwrow(p4, xo, oh1 - 1 - {p_t}, p3, c * {taps + 1}, p5, yo + (oh1 - 1) * {OW})")
    else:
        src.line("for oh in range(oh0, oh1):").indent()
        src.line(f"dwrow(p4, xo, oh * {s} - {p_t}, p3, c * {taps + 1}, p5, yo + oh * {OW})")
    kernel = Kernel("ExpandDepthwise", src.text(), ("float32",) * 6)
    return Lowered([KernelCall(kernel, [x_name, a, b1, w2, scratch, node.outputs[0]], work, node.name, n_outputs=2)])
