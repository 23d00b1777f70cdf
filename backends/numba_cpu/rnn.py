"""LSTM, GRU and RNN (ONNX opsets 7-22): forward, reverse, bidirectional,
initial states, sequence lengths, peepholes, clip, activations, layout 0/1.

    LSTM  i = f(x.Wi + h.Ri + Pi*c + bi)   f = f(x.Wf + h.Rf + Pf*c + bf)
          g = g(x.Wc + h.Rc + bc)          c' = f*c + i*g
          o = f(x.Wo + h.Ro + Po*c' + bo)  h' = o*h(c')
    GRU   z = f(x.Wz + h.Rz + bz)          r = f(x.Wr + h.Rr + br)
          n = g(x.Wh + (r*h).Rh + bh)              (linear_before_reset=0)
          n = g(x.Wh + Wbh + r*(h.Rh + Rbh))       (linear_before_reset=1)
          h' = (1 - z)*n + z*h
    RNN   h' = f(x.Wi + h.Ri + bi)

b = Wb + Rb (summed at build time when B is a constant); clip applies to
every pre-activation. Two kinds of kernel call, as onnxruntime splits it:

1. The input projection x.W^T + b of every step at once, into scratch, each
   row of W read once for several input rows (the GEMM part).
2. Per direction, the recurrence. A work item is a block of batch rows; a
   step first adds h.R^T to the step's projections in place, then runs the
   cell's elementwise update over the units, a loop that vectorises
   (math.exp and math.tanh become vmath.py's vector versions). All of h is
   read before any of it is written.

float32 nodes with constant weights run both products on vector micro-kernels
over W^T and R^T packed at build time (rnn_uk.py: broadcast-FMA form, R read
as one sequential stream per step, batch rows in tiles of 6). An LSTM whose
batch fits one tile (batch 1: the latency case) runs each step as two halves
of the hidden units, which a library with threads runs on two threads at once,
each half's R staying in its core's L2 (see _unit_split). Otherwise
(float64, weights given at run time) they are dot products over unit-stride
rows of W and R, each row used for every row of a block while in cache.

The states live in Y_h / Y_c when the node has them, else in scratch, as
does GRU's r*h (see scratch.py).
"""
from __future__ import annotations

import re

import numpy as np

from cuvil.errors import UnsupportedOpError

from .ukernel import SyncSpec

from . import rnn_uk
from .gemm import PRECISION_OF, lowp_label
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, literal, session_threads
from .scratch import scratch_value

# Gates per cell, in ONNX's row order of W, R and B.
_GATES = {"LSTM": "iofc", "GRU": "zrh", "RNN": "i"}
_DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}

# Activation -> (expression over {x}, {alpha}, {beta}; default alpha; default beta).
# Literal numbers are written F(...) and become typed literals. math.exp and math.tanh
# become vmath.py's vectorisable versions when the kernel is compiled (emit.py), so the
# loop applying them vectorises.
_ACTIVATIONS = {
    "relu": ("({x} if {x} > F(0) else F(0))", None, None),
    "tanh": ("math.tanh({x})", None, None),
    "sigmoid": ("(F(1) / (F(1) + math.exp(-{x})))", None, None),
    "affine": ("({alpha} * {x} + {beta})", 1.0, 0.0),
    "leakyrelu": ("({x} if {x} >= F(0) else {alpha} * {x})", 0.01, None),
    "thresholdedrelu": ("({x} if {x} > {alpha} else F(0))", 1.0, None),
    "scaledtanh": ("({alpha} * math.tanh({beta} * {x}))", 1.0, 1.0),
    "hardsigmoid": ("min(max({alpha} * {x} + {beta}, F(0)), F(1))", 0.2, 0.5),
    "elu": ("({x} if {x} >= F(0) else {alpha} * (math.exp({x}) - F(1)))", 1.0, None),
    "softsign": ("({x} / (F(1) + abs({x})))", None, None),
    "softplus": ("(({x} + math.log1p(math.exp(-{x}))) if {x} > F(0) else math.log1p(math.exp({x})))", None, None),
}


def _unsupported(node, why, hint=None):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}", hint=hint)


def _typed(expr: str, dtype) -> str:
    return re.sub(r"F\(([^()]*)\)", lambda m: literal(float(m.group(1)), dtype), expr)


def _activations(node, cell, num_directions, dtype):
    """Per direction, one expression over {x} per activation slot (f, g, h); ONNX's
    alpha/beta lists are consumed in order by the functions that take them (onnxruntime's
    rule)."""
    names = node.attr("activations")
    per_dir = len(_DEFAULT_ACTIVATIONS[cell])
    if not names:
        names = _DEFAULT_ACTIVATIONS[cell] * num_directions
    names = list(names)
    if len(names) == per_dir and num_directions == 2:
        names = names * 2
    if len(names) != per_dir * num_directions:
        raise _unsupported(node, f"{len(names)} activations given, {per_dir * num_directions} expected")
    alphas = list(node.attr("activation_alpha") or [])
    betas = list(node.attr("activation_beta") or [])
    exprs = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATIONS:
            raise _unsupported(node, f"activation {name} is not supported",
                               hint=f"supported: {', '.join(sorted(_ACTIVATIONS))}")
        template, alpha, beta = _ACTIVATIONS[key]
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        template = template.replace("{alpha}", literal(alpha or 0.0, dtype)).replace("{beta}", literal(beta or 0.0, dtype))
        exprs.append(_typed(template, dtype))
    return [exprs[d * per_dir:(d + 1) * per_dir] for d in range(num_directions)]


# Batch rows per recurrence work item: each row of R is read once per step for all of them.
_BATCH_BLOCK = 8
# Input rows per pass over W in the input projection.
_ROW_BLOCK = 4
# Counters of a split recurrence (see _unit_split), per direction: the halves' owner flags, then
# each half's progress on a cache line of its own (only its thread writes it).
_SYNC_LINE = 16                                 # float32 words per cache line
_SYNC_OWNER, _SYNC_PROGRESS = 0, _SYNC_LINE     # words of half 0's (half 1's next) owner flag; of half 0's progress
_SYNC_WORDS = 3 * _SYNC_LINE
# How long a thread waits for the other half's thread to claim it before running it too (time-stamp
# counter ticks, ~3 us): a pool worker spinning for work starts its item within a microsecond.
_ADOPT_TICKS = 10000


def _balanced_block(B: int, most: int) -> int:
    """Batch rows per recurrence work item (micro-kernel rows, at most `most`): the fewest blocks,
    one per thread at least while rows last, rounded up to a multiple of the library's threads,
    and rows spread evenly over them. A step is bound by the micro-kernel's products of its
    rows, and every block streams all of R, so 8 rows on two threads run as 4 + 4 (each thread
    streaming R once for half the products), not 6 + 2 (the 6-row thread's products take ~1.5x
    the 4-row one's, and the other waits). A row's sums do not depend on its block."""
    threads = session_threads()
    n = -(-B // most)
    n = min(B, -(-n // threads) * threads)
    return -(-B // n)


def _unit_split(spec) -> int | None:
    """An LSTM whose batch is one work item runs each step as two halves of the hidden units: the
    first unit of the second half (None: no split). A half is its units' gate rows of R (H=128:
    128 KB) and their update; with several threads (`spec.threaded`) the halves run on two
    threads at once, each half's R staying in its thread's L2 (see _split_steps).

    Half u's product sums h's units in its own half first, then the other's: that first part does
    not wait for the other thread's h, and the order (fixed per unit) is the same on any thread
    count, so results are identical for any thread count."""
    if not (spec.uk_recurrence and spec.cell == "LSTM" and spec.seq is None and spec.B <= rnn_uk.MR):
        return None
    panels = rnn_uk.n_panels(spec.H)
    if panels < 2:
        return None
    return rnn_uk.NR * -(-panels // 2)


def _lowp_recurrence(node, spec) -> tuple[str, str] | None:
    """(format, method) of a split LSTM recurrence in reduced precision, or None (float32)."""
    from .gemm import lowp_product
    lowp = lowp_product(node)
    if not lowp or not spec.split or spec.H % 2 or lowp[1] not in ("dpbf16", "widen", "f16c"):
        return None
    return lowp


def lower_lstm(node, graph) -> Lowered:
    return _lower_rnn(node, graph, "LSTM")


def lower_gru(node, graph) -> Lowered:
    return _lower_rnn(node, graph, "GRU")


def lower_rnn(node, graph) -> Lowered:
    return _lower_rnn(node, graph, "RNN")


def _input(node, graph, k):
    name = node.inputs[k] if len(node.inputs) > k else ""
    return graph.values[name] if name else None


def _output(node, k):
    return node.outputs[k] if len(node.outputs) > k and node.outputs[k] else None


class _Args:
    """Kernel pointer arguments by role: `bind` returns the pointer's name in the source."""

    def __init__(self):
        self.values, self.types, self.role = [], [], {}

    def bind(self, key, value, dtype):
        self.role[key] = f"p{len(self.values)}"
        self.values.append(value)
        self.types.append(np.dtype(dtype).name)
        return self.role[key]


class _Spec:
    """Everything the generated source depends on, for one node (and one direction)."""

    def __init__(self, node, graph, cell):
        X, W, R, Bv = (_input(node, graph, k) for k in range(4))
        self.X, self.W, self.R, self.Bv = X, W, R, Bv
        self.seq, self.h0 = _input(node, graph, 4), _input(node, graph, 5)
        self.c0 = _input(node, graph, 6) if cell == "LSTM" else None
        self.P = _input(node, graph, 7) if cell == "LSTM" else None
        self.cell = cell
        self.dtype = np.dtype(X.dtype)
        if self.dtype.name not in ("float32", "float64"):
            raise _unsupported(node, f"dtype {self.dtype.name} is not supported (float32, float64)")
        self.layout = int(node.attr("layout", 0))
        self.direction = node.attr("direction", "forward")
        if self.direction not in ("forward", "reverse", "bidirectional"):
            raise _unsupported(node, f"direction {self.direction!r} is not supported")
        self.D = 2 if self.direction == "bidirectional" else 1
        if self.layout == 0:
            self.T, self.B, self.I = X.shape
        else:
            self.B, self.T, self.I = X.shape
        self.G = len(_GATES[cell])
        self.H = H = int(node.attr("hidden_size", R.shape[-1]))
        self.GH = self.G * H
        if tuple(W.shape) != (self.D, self.GH, self.I) or tuple(R.shape) != (self.D, self.GH, H):
            raise _unsupported(node, f"W {W.shape} / R {R.shape} do not match {self.D} direction(s), {self.G} gates, "
                                     f"hidden {H}, input {self.I}")
        self.clip = node.attr("clip")
        self.lbr = int(node.attr("linear_before_reset", 0)) if cell == "GRU" else 0
        self.input_forget = int(node.attr("input_forget", 0)) if cell == "LSTM" else 0
        self.acts = _activations(node, cell, self.D, self.dtype)
        # float32 with constant weights: the products run on the micro-kernels (rnn_uk.py).
        self.uk_projection = self.dtype == np.float32 and W.is_const
        self.uk_recurrence = self.dtype == np.float32 and R.is_const
        self.block = _balanced_block(self.B, rnn_uk.MR) if self.uk_recurrence else _BATCH_BLOCK
        # Sequence lengths equal to T everywhere are no lengths at all.
        if self.seq is not None and self.seq.is_const and np.all(np.asarray(self.seq.data) == self.T):
            self.seq = None
        self.split = _unit_split(self)
        # A marked LSTM (passes/assign_precision.py) whose steps run in unit halves multiplies h by
        # R in bf16 / fp16 (R's bytes, which bound a step, halved): R packed in 16 bits, h
        # converted after each step's update into a 16-bit copy (`h16`); sums and the cell's
        # update stay float32. Others stay float32.
        self.lowp = _lowp_recurrence(node, self)
        self.h16 = scratch_value(graph, node, (self.D * self.B * 2 * H,), np.uint16, tag="h16") if self.lowp else None
        self.threaded = bool(self.split) and session_threads() > 1
        self.bias_packed = None
        if Bv is not None and Bv.is_const:
            self.bias_packed = _pack_bias(np.asarray(Bv.data, np.float64), cell, self.D, H, self.lbr).astype(self.dtype)
        self.Y, self.Yh = _output(node, 0), _output(node, 1)
        self.Yc = _output(node, 2) if cell == "LSTM" else None
        # Scratch: the projections x.W + b of every step (a step adds h.R to its own, in place:
        # the pre-activations), then per (direction, batch row) GRU's r*h (or r) and the states
        # the node has no output for; a step split in unit halves keeps h in two slots (steps
        # alternate between them) and its directions' counters last, a cache line each.
        self.proj = self.D * self.T * self.B * self.GH
        h_slots = ["h", "h1"] if self.split else [] if self.Yh else ["h"]
        slots = (["q"] if cell == "GRU" else []) + h_slots + (["c"] if cell == "LSTM" and not self.Yc else [])
        self.slot = {name: k * H for k, name in enumerate(slots)}
        self.S = len(slots) * H
        size = self.proj + self.D * self.B * self.S
        self.sync = -(-size // _SYNC_LINE) * _SYNC_LINE
        if self.threaded:
            size = self.sync + self.D * _SYNC_WORDS
        self.scratch = scratch_value(graph, node, (size,), self.dtype)

    def lit(self, v):
        return literal(v, self.dtype)

    def x_row(self, t, b):  # X[t, b, :] or X[b, t, :]
        if self.layout == 0:
            return f"({t})*{self.B * self.I} + ({b})*{self.I}"
        return f"({b})*{self.T * self.I} + ({t})*{self.I}"

    def y_row(self, d, t, b):  # Y[t, d, b, :] or Y[b, t, d, :]
        D, B, H, T = self.D, self.B, self.H, self.T
        if self.layout == 0:
            return f"({t})*{D * B * H} + {d * B * H} + ({b})*{H}"
        return f"({b})*{T * D * H} + ({t})*{D * H} + {d * H}"

    def state_row(self, d, b):  # Y_h, Y_c, initial_h, initial_c: [d, b, :] or [b, d, :]
        if self.layout == 0:
            return f"{d * self.B * self.H} + ({b})*{self.H}"
        return f"({b})*{self.D * self.H} + {d * self.H}"


def _lower_rnn(node, graph, cell) -> Lowered:
    spec = _Spec(node, graph, cell)
    calls = [_projection_call(spec, node)]
    for d in range(spec.D):
        calls.append(_recurrence_call(spec, node, d))
    return Lowered(calls)


def _pack_bias(B, cell, D, H, lbr):
    """Wb + Rb per direction; GRU with linear_before_reset keeps Rbh apart (it is scaled by r)."""
    G = len(_GATES[cell])
    Wb, Rb = B[:, :G * H], B[:, G * H:]
    total = Wb + Rb
    if cell == "GRU" and lbr:
        total[:, 2 * H:] = Wb[:, 2 * H:]
        return np.ascontiguousarray(np.concatenate([total, Rb[:, 2 * H:]], axis=1))
    return np.ascontiguousarray(total)


# ---------------------------------------------------------------- input projection

def _bias_segments(spec, pB):
    """The bias of gate row g in direction d, by segments: (first gate row, end, expression)."""
    GH, H = spec.GH, spec.H
    if pB is None:
        return [(0, GH, spec.lit(0))]
    if spec.bias_packed is not None:
        width = spec.bias_packed.shape[1]
        return [(0, GH, f"{pB}[d*{width} + g]")]
    summed = f"({pB}[d*{2 * GH} + g] + {pB}[d*{2 * GH} + {GH} + g])"
    return [(0, 2 * H, summed), (2 * H, GH, f"{pB}[d*{2 * GH} + g]")] if spec.lbr else [(0, GH, summed)]


def _projection_call(spec, node) -> KernelCall:
    if spec.uk_projection:
        return _projection_uk_call(spec, node)
    return _projection_dot_call(spec, node)


def _clear_counters(spec, src, pS):
    """The split recurrence's counters start at zero: the work item 0 of the projection clears them."""
    if spec.threaded:
        src.line("if begin == 0:").indent()
        src.line(f"for w in range({spec.sync}, {spec.sync + spec.D * _SYNC_WORDS}):").indent()
        src.line(f"{pS}[w] = {spec.lit(0)}").dedent().dedent()


def _panel_of_item(spec, src, i):
    """pn = the panel of 64 gate rows that projection item i (within its direction) computes. For
    a split recurrence whose gates are whole panels, the panels of the first half's units come
    first: with two threads, each then writes the pre-activations its half of the steps reads."""
    Q = rnn_uk.n_panels(spec.H)
    if not spec.split or spec.H % rnn_uk.NR:
        src.line(f"pn = {i}")
        return
    q0 = spec.split // rnn_uk.NR        # panels of a gate in the first half
    src.line(f"pi = {i}")
    src.line(f"if pi < {spec.G * q0}:").indent().line(f"pn = (pi // {q0})*{Q} + pi % {q0}").dedent()
    src.line("else:").indent().line(f"pn = ((pi - {spec.G * q0}) // {Q - q0})*{Q} + {q0} + (pi - {spec.G * q0}) % {Q - q0}")
    src.dedent()


def _projection_uk_call(spec, node) -> KernelCall:
    """scratch[d, t, b, :] = x[t, b] . W[d]^T + bias through the micro-kernel: work items are
    (direction, panel of 64 gate rows); an item writes the bias into its columns of every row,
    then accumulates 6 input rows at a time against the panel (W^T packed at build time)."""
    D, T, B, I, GH = spec.D, spec.T, spec.B, spec.I, spec.GH
    W = np.asarray(spec.W.data, np.float32)
    P = rnn_uk.n_panels(GH)
    args = _Args()
    pX = args.bind("X", spec.X.name, np.float32)
    pW = args.bind("W", np.concatenate([rnn_uk.panels(W[d]) for d in range(D)]), np.float32)
    pB = None
    if spec.Bv is not None:
        pB = args.bind("B", spec.bias_packed if spec.bias_packed is not None else spec.Bv.name, np.float32)
    pS = args.bind("S", spec.scratch, np.float32)
    rows = T * B
    uk = rnn_uk.MicroKernels()
    body = Source().indent()
    _clear_counters(spec, body, pS)
    body.line("for item in range(begin, end):").indent()
    body.line(f"d = item // {P}" if D > 1 else "d = 0")
    _panel_of_item(spec, body, f"item % {P}")
    body.line(f"n0 = pn*{rnn_uk.NR}")
    body.line(f"nv = min({rnn_uk.NR}, {GH} - n0)")
    body.line("mask = np.int64(-1) if nv >= 64 else (np.int64(1) << nv) - np.int64(1)")
    body.line(f"for r in range({rows}):").indent()
    body.line(f"o = (d*{rows} + r)*{GH}")
    for lo, hi, bias in _bias_segments(spec, pB):
        body.line(f"for g in range(max(n0, {lo}), min(n0 + nv, {hi})):").indent()
        body.line(f"{pS}[o + g] = {bias}").dedent()
    body.dedent()
    body.line(f"wb = d*{P * I * rnn_uk.NR} + pn*{I * rnn_uk.NR}")
    # Rows with a uniform stride in X and in the scratch: all T*B (layout 0), or per batch row
    # the T steps (layout 1).
    if spec.layout == 0 or B == 1:
        runs, M, lda, ldc = [("0", f"d*{rows * GH}")], rows, I, GH
    else:
        runs, M, lda, ldc = [(f"{b * T * I}", f"d*{rows * GH} + {b * GH}") for b in range(B)], T, I, B * GH
    for k0 in range(0, I, rnn_uk.KC):
        kc = min(rnn_uk.KC, I - k0)
        for abase, cbase in runs:
            uk.rows(body, M, pX, f"{abase} + {k0}", lda, pW, f"wb + {k0 * rnn_uk.NR}", pS, f"{cbase} + n0", ldc,
                    kc, "mask", 1)
    src = uk.header().line(kernel_header(len(args.values)))
    src.lines += body.lines
    kernel = Kernel(f"{spec.cell}Projection", src.text(), tuple(args.types))
    # (a reduced-precision recurrence: the projection, one GEMM over every step, stays float32)
    label = f"float32 (input projection; h . R in {PRECISION_OF[spec.lowp[0]]})" if spec.lowp else ""
    return KernelCall(kernel, list(args.values), D * P, node.name, n_outputs=1, precision=label)


def _projection_dot_call(spec, node) -> KernelCall:
    """scratch[d, t, b, :] = x[t, b] . W[d]^T + bias (all biases but GRU's Rbh with
    linear_before_reset), for every step at once: _ROW_BLOCK input rows share each pass over a
    row of W. Work items: (direction, block of rows)."""
    D, T, B, I, GH = spec.D, spec.T, spec.B, spec.I, spec.GH
    args = _Args()
    pX = args.bind("X", spec.X.name, spec.dtype)
    pW = args.bind("W", spec.W.name, spec.dtype)
    pB = None
    if spec.Bv is not None:
        pB = args.bind("B", spec.bias_packed if spec.bias_packed is not None else spec.Bv.name, spec.dtype)
    pS = args.bind("S", spec.scratch, spec.dtype)
    rows = T * B
    nblk = -(-rows // _ROW_BLOCK)
    src = Source().line(kernel_header(len(args.values))).indent()
    _clear_counters(spec, src, pS)
    src.line("for item in range(begin, end):").indent()
    src.line(f"d = item // {nblk}" if D > 1 else "d = 0")
    src.line(f"r0 = (item % {nblk})*{_ROW_BLOCK}")
    for i in range(_ROW_BLOCK):
        # The last block repeats the last row (same values, same item).
        src.line(f"row{i} = min(r0 + {i}, {rows - 1})")
        if spec.layout == 0:
            src.line(f"x{i} = row{i}*{I}")
        else:
            src.line(f"x{i} = {spec.x_row(f'row{i} // {B}', f'row{i} % {B}')}")
        src.line(f"o{i} = (d*{rows} + row{i})*{GH}")
    for lo, hi, bias in _bias_segments(spec, pB):
        src.line(f"for g in range({lo}, {hi}):").indent()
        src.line(f"wo = d*{GH * I} + g*{I}")
        src.line(f"bv = {bias}")
        for i in range(_ROW_BLOCK):
            src.line(f"a{i} = bv")
        src.line(f"for k in range({I}):").indent()
        src.line(f"wv = {pW}[wo + k]")
        for i in range(_ROW_BLOCK):
            src.line(f"a{i} += {pX}[x{i} + k] * wv")
        src.dedent()
        for i in range(_ROW_BLOCK):
            src.line(f"{pS}[o{i} + g] = a{i}")
        src.dedent()
    kernel = Kernel(f"{spec.cell}Projection", src.text(), tuple(args.types))
    return KernelCall(kernel, list(args.values), D * nblk, node.name, n_outputs=1)


# ---------------------------------------------------------------- recurrence

class _Step:
    """Source helpers for one direction's recurrence kernel."""

    def __init__(self, spec, d, args, src):
        self.spec, self.d, self.args, self.src = spec, d, args, src
        self.role = args.role
        self.reverse = spec.direction == "reverse" or d == 1
        self.pS = self.role["S"]
        self.split = spec.split

    def activate(self, k, x, out):
        self.src.line(f"{out} = {self.spec.acts[self.d][k].replace('{x}', x)}")

    def state(self, which):
        """(pointer, base offset) of the h or c state of row b (a split step writes h into the
        slot of its parity, `hw`)."""
        if which == "h" and self.split:
            return self.pS, f"sl + {self.spec.slot['h']} + hw"
        key = {"h": "Yh", "c": "Yc"}[which]
        if key in self.role:
            return self.role[key], "st"
        return self.pS, f"sl + {self.spec.slot[which]}"

    def scratch(self, slot):
        return f"sl + {self.spec.slot[slot]}" if self.spec.slot[slot] else "sl"

    def clip(self, var):
        if self.spec.clip is None:
            return
        c = self.spec.lit(float(self.spec.clip))
        self.src.line(f"{var} = min(max({var}, -{c}), {c})")

    def length(self, b):
        if "seq" in self.role:
            return f"min(max(np.int64({self.role['seq']}[{b}]), 0), {self.spec.T})"
        return str(self.spec.T)

    def for_rows(self, active=True):
        """Open the loop over the block's batch rows with their offsets; with `active` (and
        sequence lengths) only rows whose sequence is still running at step s."""
        spec, src = self.spec, self.src
        src.line("for bb in range(nb):").indent()
        src.line("b = b0 + bb")
        src.line(f"st = {spec.state_row(self.d, 'b')}")
        src.line(f"sl = {spec.proj} + ({self.d * spec.B} + b)*{spec.S}")
        opened = 1
        if active:
            src.line(f"L = {self.length('b')}")
            if "seq" in self.role:
                src.line("if s < L:").indent()
                opened += 1
            src.line("t = L - 1 - s" if self.reverse else "t = s")
            src.line(f"xo = ({self.d * spec.T} + t)*{spec.B * spec.GH} + b*{spec.GH}")
        return opened

    def close(self, opened):
        for _ in range(opened):
            self.src.dedent()

    def dots(self, accs, vectors):
        """acc += vector . R[gate row j] for (acc, gate) in accs, vector (pointer, base) per acc."""
        spec = self.spec
        H, rd = spec.H, self.d * spec.GH * spec.H
        self.src.line(f"for k in range({H}):").indent()
        loaded = {}
        for (acc, gate), (p, base) in zip(accs, vectors):
            if (p, base) not in loaded:
                loaded[(p, base)] = f"v{len(loaded)}"
                self.src.line(f"{loaded[(p, base)]} = {p}[{base} + k]")
            self.src.line(f"{acc} += {loaded[(p, base)]} * {self.role['R']}[{rd + gate * H * H} + j*{H} + k]")
        self.src.dedent()


def _recurrence_call(spec, node, d) -> KernelCall:
    """One direction: items are blocks of up to _BATCH_BLOCK batch rows, each running its rows'
    sequences through every step; in a step, hidden unit j is computed for every row of the
    block while R's rows for j are in cache."""
    args = _Args()
    dt = spec.dtype
    if spec.uk_recurrence:
        R = np.asarray(spec.R.data, np.float32)[d]
        packed, offsets = [], {}
        # Panels of gate rows [lo, hi): by product group, or (split) by unit half and gate.
        groups = _uk_groups(spec) if not spec.split else \
            [((half, g), g * spec.H + u0, g * spec.H + u1) for half, (u0, u1) in enumerate(_halves(spec))
             for g in range(spec.G)]
        for group in groups:
            key, lo, hi = (group[0], group[0], group[1]) if not spec.split else group
            offsets[key] = sum(p.size for p in packed)
            packed.append(rnn_uk.lowp_panels(R[lo:hi], spec.lowp[0]) if spec.lowp else rnn_uk.panels(R[lo:hi]))
        args.bind("R", np.concatenate(packed), np.uint16 if spec.lowp else dt)
    else:
        args.bind("R", spec.R.name, dt)
    if spec.lbr and spec.Bv is not None:
        args.bind("B", spec.bias_packed if spec.bias_packed is not None else spec.Bv.name, dt)
    if spec.seq is not None:
        args.bind("seq", spec.seq.name, np.int32)
    for key, value in (("h0", spec.h0), ("c0", spec.c0), ("P", spec.P)):
        if value is not None:
            args.bind(key, value.name, dt)
    n_inputs = len(args.values)
    for key, name in (("Y", spec.Y), ("Yh", spec.Yh), ("Yc", spec.Yc)):
        if name:
            args.bind(key, name, dt)
    args.bind("S", spec.scratch, dt)
    if spec.lowp:
        args.bind("h16", spec.h16, np.uint16)
    src = Source().indent()
    step = _Step(spec, d, args, src)
    if spec.uk_recurrence:
        step.uk, step.panel_offsets = rnn_uk.MicroKernels(prefetch_b=False, lowp=spec.lowp), offsets
    role, H, T, B = args.role, spec.H, spec.T, spec.B
    if spec.split:
        _split_steps(step)
        head = step.uk.header()
        if spec.lowp:
            from .lowp import CvtSpec
            for line in CvtSpec("f32", spec.lowp[0]).declaration("cvt_h").splitlines():
                head.line(line)
        for op in ("claim", "adopt", "add", "wait") if spec.threaded else ():
            for line in SyncSpec(op).declaration(f"sync_{op}").splitlines():
                head.line(line)
        head.line(kernel_header(len(args.values)))
        kernel = Kernel(spec.cell, head.text() + src.text(), tuple(args.types))
        return KernelCall(kernel, list(args.values), 2 if spec.threaded else 1, node.name,
                          n_outputs=len(args.values) - n_inputs, precision=lowp_label(spec.lowp))
    src.line("for blk in range(begin, end):").indent()
    src.line(f"b0 = blk*{spec.block}").line(f"nb = min({spec.block}, {B} - b0)")
    # Initial states.
    opened = step.for_rows(active=False)
    for which, init in [("h", "h0")] + ([("c", "c0")] if spec.cell == "LSTM" else []):
        p, base = step.state(which)
        src.line(f"for j in range({H}):").indent()
        src.line(f"{p}[{base} + j] = {role[init] + '[st + j]' if init in role else spec.lit(0)}")
        src.dedent()
    step.close(opened)
    if spec.seq is not None:
        src.line("steps = 0")
        src.line("for bb in range(nb):").indent()
        src.line(f"steps = max(steps, {step.length('b0 + bb')})").dedent()
    else:
        src.line(f"steps = {T}")
    src.line("for s in range(steps):").indent()
    {"LSTM": _lstm_step, "GRU": _gru_step, "RNN": _rnn_step}[spec.cell](step)
    src.dedent()  # time loop
    if "Y" in role and "seq" in role:
        opened = step.for_rows(active=False)
        src.line(f"for t in range({step.length('b')}, {T}):").indent()
        src.line(f"yo = {spec.y_row(d, 't', 'b')}")
        src.line(f"for j in range({H}):").indent().line(f"{role['Y']}[yo + j] = {spec.lit(0)}").dedent()
        src.dedent()
        step.close(opened)
    head = step.uk.header() if spec.uk_recurrence else Source()
    head.line(kernel_header(len(args.values)))
    kernel = Kernel(spec.cell, head.text() + src.text(), tuple(args.types))
    work = -(-B // spec.block)
    return KernelCall(kernel, list(args.values), work, node.name, n_outputs=len(args.values) - n_inputs)


def _halves(spec):
    """The units of the two halves of a split step."""
    return [(0, spec.split), (spec.split, spec.H)]


def _split_steps(step):
    """A split recurrence (see _unit_split). Threaded: work items 0 and 1; item i claims half i, and
    if the other half is still unclaimed a few microseconds later (its item has not started),
    claims it too and runs the whole recurrence alone; the late item then finds its half taken and
    returns. Otherwise each thread runs its half: a step sums h's units of its own half, waits
    until the other's progress counter (initial states written, then steps done) reaches s + 1,
    sums the other half's units, updates its units and counts the step. Step s reads h from slot
    (s+1) % 2 and writes slot s % 2: a half may finish step s while the other still reads h of
    step s - 1, never sooner. Single-threaded: one item runs both halves, no counters."""
    spec, src, role, pS = step.spec, step.src, step.role, step.pS
    H, us = spec.H, spec.split
    F = spec.sync + step.d * _SYNC_WORDS
    progress = lambda half: f"{F + _SYNC_PROGRESS} + {_SYNC_LINE}*{half}"
    src.line("for item in range(begin, end):").indent()
    if spec.threaded:
        src.line("me = item").line("other = 1 - item")
        src.line(f"if sync_claim({pS}, {F + _SYNC_OWNER} + me, 0) == 0:").indent().line("continue").dedent()
        src.line(f"both = sync_adopt({pS}, {F + _SYNC_OWNER} + other, {_ADOPT_TICKS})")
    else:
        src.line("me = 0").line("both = 1")
    src.line("b0 = 0").line(f"nb = {spec.B}")
    # Initial states of the units of the halves this thread runs; h of step -1 in the odd slot.
    src.line(f"hw = {H}")
    src.line("for half in range(2):").indent()
    src.line("if both != 0 or half == me:").indent()
    opened = step.for_rows(active=False)
    for which, init in (("h", "h0"), ("c", "c0")):
        p, base = step.state(which)
        src.line(f"for j in range(half*{us}, {us} + half*{H - us}):").indent()
        src.line(f"{p}[{base} + j] = {role[init] + '[st + j]' if init in role else spec.lit(0)}").dedent()
    step.close(opened)
    _store_h16(step, f"half*{us}", f"{us} + half*{H - us}")
    src.dedent().dedent()
    if spec.threaded:
        src.line("if both == 0:").indent().line(f"sync_add({pS}, {progress('me')}, 1)").dedent()
    src.line(f"for s in range({spec.T}):").indent()
    src.line(f"hw = (s % 2)*{H}").line(f"hr = {H} - hw")
    src.line("for half in range(2):").indent()
    src.line("if both != 0 or half == me:").indent()
    halves = _halves(spec)
    for half, units in enumerate(halves):
        src.line("if half == 0:" if half == 0 else "else:").indent()
        if half == 0 and not spec.threaded:
            _split_product(step, half, units, (0, H))   # the same sums as the two parts below
        else:
            _split_product(step, half, units, units)
            if spec.threaded:
                src.line("if both == 0:").indent().line(f"sync_wait({pS}, {progress('other')}, s + 1)").dedent()
            _split_product(step, half, units, halves[1 - half])
        _lstm_update(step, _lstm_rows(spec), *units)
        _store_h16(step, *units)
        src.dedent()
    src.dedent().dedent()
    if spec.threaded:
        src.line("if both == 0:").indent().line(f"sync_add({pS}, {progress('me')}, 1)").dedent()
    src.dedent().dedent()


def _store_h16(step, lo, hi):
    """A reduced-precision recurrence: h16[d, b, hw + j] = h[j] in 16 bits for units lo <= j < hi
    of every batch row (the A operand of the next step's product; `hw`: the slot written)."""
    spec, src = step.spec, step.src
    if not spec.lowp:
        return
    hp, hb = step.state("h")
    opened = step.for_rows(active=False)
    src.line(f"cvt_h({hp}, {hb} + {lo}, {step.role['h16']}, ({step.d * spec.B} + b)*{2 * spec.H} + hw + {lo}, "
             f"({hi}) - ({lo}))")
    step.close(opened)


def _split_product(step, half, units, ks):
    """pre[gate rows of `units`] += h[ks] . R[gate rows, ks]^T for every row of the batch (one
    block); `units` and `ks` are (first, end) ranges of the hidden units."""
    spec, src, pS = step.spec, step.src, step.pS
    H, NR = spec.H, rnn_uk.NR
    (u0, u1), (k0, k1) = units, ks
    src.line("b = b0")
    src.line(f"sl = {spec.proj} + {step.d * spec.B}*{spec.S}")
    src.line(f"t = {spec.T - 1} - s" if step.reverse else "t = s")
    src.line(f"xo = ({step.d * spec.T} + t)*{spec.B * spec.GH}")
    # A: h of the last step, float32 in its scratch slot or (reduced precision) its 16-bit copy.
    a, aoff, lda = (step.role["h16"], f"{step.d * spec.B * 2 * H + k0} + hr", 2 * H) if spec.lowp else \
        (pS, f"sl + {spec.slot['h'] + k0} + hr", spec.S)
    for g in range(spec.G):
        base = step.panel_offsets[(half, g)]
        for p in range(rnn_uk.n_panels(u1 - u0)):
            n0 = p * NR
            step.uk.tiles(src, "nb", a, aoff, lda, step.role["R"],
                          base + p * H * NR + k0 * NR, pS, f"xo + {g * H + u0 + n0}", spec.GH, k1 - k0,
                          min(NR, u1 - u0 - n0), 1, [spec.B])


def _store_h(step, value):
    """h[j] = value, and the step's Y row (and Y_h, when h lives in scratch slots)."""
    hp, hb = step.state("h")
    step.src.line(f"{hp}[{hb} + j] = {value}")
    if step.split and "Yh" in step.role:
        step.src.line(f"{step.role['Yh']}[st + j] = {value}")
    if "Y" in step.role:
        step.src.line(f"{step.role['Y']}[yo + j] = {value}")


def _rows_for_update(step, lo=0, hi=None):
    """Open the loop over active rows for an elementwise update of units lo <= j < hi (all by
    default; it vectorises)."""
    opened = step.for_rows()
    if "Y" in step.role:
        step.src.line(f"yo = {step.spec.y_row(step.d, 't', 'b')}")
    step.src.line(f"for j in range({lo}, {step.spec.H if hi is None else hi}):").indent()
    return opened + 1


def _accumulate(step, gates, vectors):
    """Phase 1 of a step: pre-activation of gate rows `gates` [(acc, gate)] += vector . R[gate
    row j], for every unit j and active row, stored back over the projections."""
    src, pS, H = step.src, step.pS, step.spec.H
    src.line(f"for j in range({H}):").indent()
    opened = step.for_rows()
    for acc, gate in gates:
        src.line(f"{acc} = {pS}[xo + {gate * H} + j]")
    step.dots(gates, vectors)
    for acc, gate in gates:
        src.line(f"{pS}[xo + {gate * H} + j] = {acc}")
    step.close(opened)
    src.dedent()


def _uk_groups(spec):
    """The recurrent products of a step on the micro-kernels: (first gate row, end, vector,
    destination), vector "h" (the state) or "q" (GRU's r*h), destination "xo" (the step's
    pre-activations, in place) or "q" (GRU's h.Rh with linear_before_reset, kept apart: r scales it)."""
    H, GH = spec.H, spec.GH
    if spec.cell != "GRU":
        return [(0, GH, "h", "xo")]
    return [(0, 2 * H, "h", "xo"), (2 * H, GH, "h" if spec.lbr else "q", "q" if spec.lbr else "xo")]


def _uk_product(step, lo, hi, vector, dest):
    """pre[gate rows lo:hi] (+)= vector . R[lo:hi]^T for the block's active rows: one micro-kernel
    call per panel of 64 gate rows; without sequence lengths all the block's rows share a call."""
    spec, src, pS = step.spec, step.src, step.pS
    H, GH = spec.H, spec.GH
    hp, hb = step.state("h")
    h_stride = spec.S if hp == pS else (H if spec.layout == 0 else spec.D * H)
    a, aoff, lda = (hp, hb, h_stride) if vector == "h" else (pS, step.scratch("q"), spec.S)
    if dest == "xo":
        c, coff, ldc, loadc = pS, f"xo + {lo}", GH, 1
    else:
        c, coff, ldc, loadc = pS, step.scratch("q"), spec.S, 0
    base = step.panel_offsets[lo]
    if "seq" in step.role or spec.B == 1:
        opened = step.for_rows()
        counts = [1]
    else:
        # Every row of the block is active: the block's first row and the row strides.
        src.line("b = b0")
        src.line(f"st = {spec.state_row(step.d, 'b')}")
        src.line(f"sl = {spec.proj} + ({step.d * spec.B} + b)*{spec.S}")
        src.line(f"t = {spec.T - 1} - s" if step.reverse else "t = s")
        src.line(f"xo = ({step.d * spec.T} + t)*{spec.B * GH} + b*{GH}")
        opened = 0
        counts = [min(spec.block, spec.B)] + ([spec.B % spec.block] if spec.B % spec.block else [])
    rows = hi - lo
    for p in range(rnn_uk.n_panels(rows)):
        n0 = p * rnn_uk.NR
        step.uk.tiles(src, "nb", a, aoff, lda, step.role["R"], base + p * H * rnn_uk.NR,
                      c, f"{coff} + {n0}", ldc, H, min(rnn_uk.NR, rows - n0), loadc, counts)
    step.close(opened)


def _lstm_rows(spec):
    """The gate rows an LSTM step reads, (pre-activation variable, gate) in ONNX order i, o, f, c."""
    rows = [("ai", 0), ("ao", 1), ("af", 2), ("ac", 3)]
    return [r for r in rows if r[0] != "af"] if spec.input_forget else rows


def _lstm_step(step):
    spec = step.spec
    rows = _lstm_rows(spec)
    if spec.uk_recurrence:
        _uk_product(step, *_uk_groups(spec)[0])
    else:
        _accumulate(step, rows, [step.state("h")] * len(rows))
    _lstm_update(step, rows)


def _lstm_update(step, rows, lo=0, hi=None):
    """c and h of units lo <= j < hi from the step's pre-activations (gate rows `rows`)."""
    spec, src, pS, role = step.spec, step.src, step.pS, step.role
    H = spec.H
    cp, cb = step.state("c")
    opened = _rows_for_update(step, lo, hi)
    for acc, gate in rows:
        src.line(f"{acc} = {pS}[xo + {gate * H} + j]")
    src.line(f"cv = {cp}[{cb} + j]")
    if "P" in role:
        p, base = role["P"], step.d * 3 * H
        src.line(f"ai += {p}[{base} + j] * cv")
        if not spec.input_forget:
            src.line(f"af += {p}[{base + 2 * H} + j] * cv")
    step.clip("ai")
    step.activate(0, "ai", "ig")
    if spec.input_forget:
        src.line(f"fg = {spec.lit(1)} - ig")
    else:
        step.clip("af")
        step.activate(0, "af", "fg")
    step.clip("ac")
    step.activate(1, "ac", "cg")
    src.line("cn = fg * cv + ig * cg")
    src.line(f"{cp}[{cb} + j] = cn")
    if "P" in role:
        src.line(f"ao += {role['P']}[{step.d * 3 * H + H} + j] * cn")
    step.clip("ao")
    step.activate(0, "ao", "og")
    step.activate(2, "cn", "hc")
    src.line("hv = og * hc")
    _store_h(step, "hv")
    step.close(opened)


def _store_reset_gate(step, q, value):
    """GRU: r = f(pre-activation) of every unit, then scratch[q + j] = value (of rg, the gate)."""
    src, pS, H = step.src, step.pS, step.spec.H
    opened = step.for_rows()
    src.line(f"for j in range({H}):").indent()
    src.line(f"ar = {pS}[xo + {H} + j]")
    step.clip("ar")
    step.activate(0, "ar", "rg")
    src.line(f"{pS}[{q} + j] = {value}")
    src.dedent()
    step.close(opened)


def _rbh(step) -> str | None:
    """GRU with linear_before_reset: the expression of Rbh[j] (None without biases)."""
    spec = step.spec
    if "B" not in step.role:
        return None
    width = spec.bias_packed.shape[1] if spec.bias_packed is not None else 2 * spec.GH
    offset = step.d * width + spec.GH + (0 if spec.bias_packed is not None else 2 * spec.H)
    return f"{step.role['B']}[{offset} + j]"


def _gru_update(step, hp, hb):
    """h' = (1 - z)*n + z*h from the pre-activations az and ah of unit j."""
    step.clip("az")
    step.clip("ah")
    step.activate(0, "az", "zg")
    step.activate(1, "ah", "ng")
    step.src.line(f"hv = ({step.spec.lit(1)} - zg) * ng + zg * {hp}[{hb} + j]")
    _store_h(step, "hv")


def _gru_step(step):
    if step.spec.uk_recurrence:
        _gru_step_uk(step)
        return
    spec, src, pS = step.spec, step.src, step.pS
    H = spec.H
    hp, hb = h = step.state("h")
    q = (pS, step.scratch("q"))
    # r first: the candidate needs r*h (or r) of every unit.
    _accumulate(step, [("ar", 1)], [h])
    _store_reset_gate(step, q[1], "rg" if spec.lbr else f"rg * {hp}[{hb} + j]")
    src.line(f"for j in range({H}):").indent()
    opened = step.for_rows()
    src.line(f"az = {pS}[xo + j]").line(f"ah = {pS}[xo + {2 * H} + j]")
    if spec.lbr:
        src.line(f"ahr = {_rbh(step) or spec.lit(0)}")
        step.dots([("az", 0), ("ahr", 2)], [h, h])
        src.line(f"ah += {pS}[{q[1]} + j] * ahr")
    else:
        step.dots([("az", 0), ("ah", 2)], [h, q])
    src.line(f"{pS}[xo + j] = az").line(f"{pS}[xo + {2 * H} + j] = ah")
    step.close(opened)
    src.dedent()
    opened = _rows_for_update(step)
    src.line(f"az = {pS}[xo + j]").line(f"ah = {pS}[xo + {2 * H} + j]")
    _gru_update(step, hp, hb)
    step.close(opened)


def _gru_step_uk(step):
    """GRU on the micro-kernels: z and r rows first; then (linear_before_reset=0) q = r*h and
    q . Rh^T into the candidate's pre-activation, or (=1) h . Rh^T into q, scaled by r in the update."""
    spec, src, pS = step.spec, step.src, step.pS
    H = spec.H
    hp, hb = step.state("h")
    q = step.scratch("q")
    first, second = _uk_groups(spec)
    _uk_product(step, *first)
    if not spec.lbr:
        _store_reset_gate(step, q, f"rg * {hp}[{hb} + j]")
    _uk_product(step, *second)
    opened = _rows_for_update(step)
    src.line(f"az = {pS}[xo + j]").line(f"ah = {pS}[xo + {2 * H} + j]")
    if spec.lbr:
        src.line(f"ar = {pS}[xo + {H} + j]")
        step.clip("ar")
        step.activate(0, "ar", "rg")
        rbh = _rbh(step)
        src.line(f"ah += rg * {f'({pS}[{q} + j] + {rbh})' if rbh else f'{pS}[{q} + j]'}")
    _gru_update(step, hp, hb)
    step.close(opened)


def _rnn_step(step):
    src, pS = step.src, step.pS
    if step.spec.uk_recurrence:
        _uk_product(step, *_uk_groups(step.spec)[0])
    else:
        _accumulate(step, [("ai", 0)], [step.state("h")])
    opened = _rows_for_update(step)
    src.line(f"ai = {pS}[xo + j]")
    step.clip("ai")
    step.activate(0, "ai", "hv")
    _store_h(step, "hv")
    step.close(opened)
