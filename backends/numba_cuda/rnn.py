"""LSTM, GRU and RNN on the GPU (ONNX semantics, as backends/numba_cpu/rnn.py: forward, reverse,
bidirectional, initial states, sequence lengths, peepholes, clip, activations, input_forget,
linear_before_reset, layout 0/1, any subset of Y / Y_h / Y_c).

Two kernel calls per node, as cuDNN and onnxruntime split the work:

1. `<cell>Projection`: x.W^T + b of every step of every direction at once, a GEMM of
   [T*B, I] x [I, G*H] into scratch [D, T, B, G*H]: 256 threads per block, a shared-memory tile
   of 16R x 16R outputs (R = 4, 2 or 1: the largest that still gives ~128 blocks), K in chunks
   of 16, R x R accumulators per thread in registers, each thread's rows and columns 16 apart
   (conflict-free shared reads, coalesced stores). W^T is packed at build time so that a
   tile's loads are coalesced.
2. `<cell>`: the recurrence, one persistent block per (direction, batch row), all of them in
   one launch. A thread owns hidden units (tid, tid + NT, ...) and keeps their c and h in
   registers; h of the step is shared through shared memory (two buffers, one
   syncthreads() per step; GRU's r*h takes a second). A step adds h.R^T to the step's
   projections: each thread reads its units' gate rows of R, packed at build time so that the
   block's loads are coalesced ([k][unit slot][gate][thread]); the first k's of the thread's
   rows are loaded into registers once (up to _RESIDENT_FLOATS), the rest stream from L1/L2
   every step; the step's projections were loaded a step earlier. Then the cell's update runs
   in registers. Sums run over k in order: the same bits on every run.

Blocks cannot wait for each other, so a direction's recurrence is one block: the hidden size
is limited by shared memory (three H-vectors), not the block size (a thread takes several units).
"""
from __future__ import annotations

import numpy as np

from backends.numba_cpu import rnn as cpu_rnn
from backends.numba_cpu.kernel import Source, literal
from backends.numba_cpu.scratch import scratch_value

from .kernel import KernelCall, Lowered, gpu_kernel

# Projection GEMM: threads per block and the K chunk staged in shared memory.
_GEMM_THREADS, _KC = 256, 16
# Blocks that fill an A100 / H200 (108 / 132 SMs): the tile shrinks until the grid has as many.
_FILL_BLOCKS = 128
# Recurrence: most threads per block (so that ptxas may give every thread 255 registers), and
# the floats of R a thread keeps in registers for the whole sequence.
_MAX_THREADS, _RESIDENT_FLOATS = 256, 128
# Static shared memory a block may use (bytes).
_SHARED_BYTES = 48 * 1024

F0, F1 = "float32(0)", "float32(1)"


def lower_lstm(node, graph) -> Lowered:
    return _lower(node, graph, "LSTM")


def lower_gru(node, graph) -> Lowered:
    return _lower(node, graph, "GRU")


def lower_rnn(node, graph) -> Lowered:
    return _lower(node, graph, "RNN")


class _Spec:
    """The node's shapes, attributes and values, checked."""

    def __init__(self, node, graph, cell):
        inp = lambda k: cpu_rnn._input(node, graph, k)
        self.node, self.cell = node, cell
        self.X, self.W, self.R, self.Bv = inp(0), inp(1), inp(2), inp(3)
        self.seq, self.h0 = inp(4), inp(5)
        self.c0 = inp(6) if cell == "LSTM" else None
        self.P = inp(7) if cell == "LSTM" else None
        if np.dtype(self.X.dtype) != np.float32:
            raise cpu_rnn._unsupported(node, f"dtype {np.dtype(self.X.dtype).name} is not supported on the GPU "
                                             "(float32)")
        self.layout = int(node.attr("layout", 0))
        self.direction = node.attr("direction", "forward")
        if self.direction not in ("forward", "reverse", "bidirectional"):
            raise cpu_rnn._unsupported(node, f"direction {self.direction!r} is not supported")
        self.D = 2 if self.direction == "bidirectional" else 1
        if self.layout == 0:
            self.T, self.B, self.I = (int(v) for v in self.X.shape)
        else:
            self.B, self.T, self.I = (int(v) for v in self.X.shape)
        self.G = len(cpu_rnn._GATES[cell])
        self.H = H = int(node.attr("hidden_size", self.R.shape[-1]))
        self.GH = self.G * H
        if tuple(self.W.shape) != (self.D, self.GH, self.I) or tuple(self.R.shape) != (self.D, self.GH, H):
            raise cpu_rnn._unsupported(node, f"W {self.W.shape} / R {self.R.shape} do not match {self.D} "
                                             f"direction(s), {self.G} gates, hidden {H}, input {self.I}")
        self.clip = node.attr("clip")
        self.lbr = int(node.attr("linear_before_reset", 0)) if cell == "GRU" else 0
        self.input_forget = int(node.attr("input_forget", 0)) if cell == "LSTM" else 0
        self.acts = cpu_rnn._activations(node, cell, self.D, np.float32)
        if self.seq is not None and self.seq.is_const and np.all(np.asarray(self.seq.data) == self.T):
            self.seq = None
        self.Y, self.Yh = cpu_rnn._output(node, 0), cpu_rnn._output(node, 1)
        self.Yc = cpu_rnn._output(node, 2) if cell == "LSTM" else None
        # Recurrence geometry: NT threads, each owning UPT units.
        self.UPT = -(-H // _MAX_THREADS)
        self.NT = -(-(-(-H // self.UPT)) // 32) * 32
        vectors = 3 if cell == "GRU" and not self.lbr else 2
        if vectors * H * 4 > _SHARED_BYTES:
            raise cpu_rnn._unsupported(node, f"hidden size {H} is too large for one GPU block's shared memory",
                                       hint=f"the GPU recurrence supports hidden sizes up to "
                                            f"{_SHARED_BYTES // (4 * vectors)}")
        self.S = self.UPT * self.G                           # gate rows per thread
        self.KR = min(H, _RESIDENT_FLOATS // self.S)         # k's of R held in registers

    def x_row(self, r):  # X offset of projection row r = t*B + b
        if self.layout == 0 or self.B == 1:
            return f"({r})*{self.I}"
        return f"(({r}) % {self.B})*{self.T * self.I} + (({r}) // {self.B})*{self.I}"

    def y_row(self, t):  # Y[t, d, b, :] or Y[b, t, d, :] (d, b: the kernel's variables)
        D, B, H, T = self.D, self.B, self.H, self.T
        if self.layout == 0:
            return f"({t})*{D * B * H} + d*{B * H} + b*{H}"
        return f"b*{T * D * H} + ({t})*{D * H} + d*{H}"

    def state_row(self):  # Y_h, Y_c, initial_h, initial_c: [d, b, :] or [b, d, :]
        if self.layout == 0:
            return f"d*{self.B * self.H} + b*{self.H}"
        return f"b*{self.D * self.H} + d*{self.H}"


def _lower(node, graph, cell) -> Lowered:
    spec = _Spec(node, graph, cell)
    if not (spec.Y or spec.Yh or spec.Yc):
        return Lowered([])
    scratch = scratch_value(graph, node, (spec.D * spec.T * spec.B * spec.GH,), np.float32)
    return Lowered([_projection_call(spec, scratch), _recurrence_call(spec, scratch)])


class _Args:
    """Kernel arguments in order: `bind` returns the pointer's name in the source."""

    def __init__(self):
        self.values, self.types = [], []

    def bind(self, value, dtype=np.float32):
        self.values.append(value)
        self.types.append(np.dtype(dtype).name)
        return f"p{len(self.values) - 1}"


# ---------------------------------------------------------------- input projection

def _tile_scale(spec) -> int:
    """R: the projection's tile is 16R x 16R; the largest R whose grid fills the GPU, else 1."""
    M, N = spec.T * spec.B, spec.GH
    for r in (4, 2):
        if spec.D * -(-M // (16 * r)) * -(-N // (16 * r)) >= _FILL_BLOCKS:
            return r
    return 1


def _projection_call(spec, scratch) -> KernelCall:
    """scratch[d, r, g] = X[r] . W[d, g] + Wb[d, g] + Rb[d, g] (no Rb for GRU's candidate with
    linear_before_reset: the recurrence scales it by r), r = t*B + b."""
    D, M, N, K, H = spec.D, spec.T * spec.B, spec.GH, spec.I, spec.H
    R = _tile_scale(spec)
    TM = TN = 16 * R
    tiles_m, tiles_n = -(-M // TM), -(-N // TN)
    args = _Args()
    pX = args.bind(spec.X.name)
    if spec.W.is_const:   # W^T per direction, [D, I, G*H]: a tile's rows of W^T are contiguous
        pW = args.bind(np.ascontiguousarray(np.asarray(spec.W.data, np.float32).transpose(0, 2, 1)))
        w_at = lambda k, g: f"{pW}[(d*{K} + {k})*{N} + {g}]"
    else:
        pW = args.bind(spec.W.name)
        w_at = lambda k, g: f"{pW}[(d*{N} + {g})*{K} + {k}]"
    pB = args.bind(spec.Bv.name) if spec.Bv is not None else None
    pS = args.bind(scratch)
    src = Source().line(f"def kernel({', '.join(f'p{i}' for i in range(len(args.values)))}, n):").indent()
    src.line(f"As = cuda.shared.array(({_KC}, {TM + 1}), float32)")   # +1: conflict-free stores
    src.line(f"Bs = cuda.shared.array(({_KC}, {TN}), float32)")
    src.line("tid = cuda.threadIdx.x").line("tx = tid % 16").line("ty = tid // 16")
    src.line("blk = cuda.blockIdx.x")
    src.line(f"d = blk // {tiles_m * tiles_n}").line(f"rest = blk % {tiles_m * tiles_n}")
    src.line(f"m0 = (rest // {tiles_n})*{TM}").line(f"n0 = (rest % {tiles_n})*{TN}")
    for i in range(R):
        for j in range(R):
            src.line(f"acc{i}_{j} = {F0}")
    src.line(f"for k0 in range(0, {K}, {_KC}):").indent()
    # Each thread stages R elements of each tile; X's along k (16 floats of a row), W^T's along g.
    for q in range(R):
        e = f"tid + {_GEMM_THREADS * q}"
        src.line(f"kk = ({e}) % {_KC}").line(f"m = ({e}) // {_KC}")
        src.line("r = m0 + m").line("k = k0 + kk")
        src.line(f"v = {F0}")
        src.line(f"if r < {M} and k < {K}:").indent().line(f"v = {pX}[{spec.x_row('r')} + k]").dedent()
        src.line("As[kk, m] = v")
        src.line(f"nn = ({e}) % {TN}").line(f"kk = ({e}) // {TN}")
        src.line("g = n0 + nn").line("k = k0 + kk")
        src.line(f"v = {F0}")
        src.line(f"if g < {N} and k < {K}:").indent().line(f"v = {w_at('k', 'g')}").dedent()
        src.line("Bs[kk, nn] = v")
    src.line("cuda.syncthreads()")
    src.line(f"for kk in range({_KC}):").indent()
    for i in range(R):
        src.line(f"a{i} = As[kk, ty + {16 * i}]")
    for j in range(R):
        src.line(f"b{j} = Bs[kk, tx + {16 * j}]")
    for i in range(R):
        for j in range(R):
            src.line(f"acc{i}_{j} += a{i} * b{j}")
    src.dedent()
    src.line("cuda.syncthreads()")
    src.dedent()
    for j in range(R):
        src.line(f"g = n0 + tx + {16 * j}")
        src.line(f"if g < {N}:").indent()
        if pB is None:
            src.line(f"bias = {F0}")
        else:
            src.line(f"bias = {pB}[d*{2 * N} + g]")
            rb = f"{pB}[d*{2 * N} + {N} + g]"
            if spec.lbr:
                src.line(f"if g < {2 * H}:").indent().line(f"bias += {rb}").dedent()
            else:
                src.line(f"bias += {rb}")
        for i in range(R):
            src.line(f"r = m0 + ty + {16 * i}")
            src.line(f"if r < {M}:").indent().line(f"{pS}[(d*{M} + r)*{N} + g] = acc{i}_{j} + bias").dedent()
        src.dedent()
    kernel = gpu_kernel(f"{spec.cell}Projection", src.text(), args.types, _GEMM_THREADS)
    blocks = D * tiles_m * tiles_n
    return KernelCall(kernel, args.values, blocks * _GEMM_THREADS, spec.node.name, n_outputs=1)


# ---------------------------------------------------------------- recurrence

def _pack_r(spec) -> np.ndarray:
    """R per direction as [k][unit slot][gate][thread]: thread tid's row of gate g for its unit
    tid + NT*slot at k is at ((k*UPT + slot)*G + g)*NT + tid, so a block's loads of one (k, slot,
    gate) are one contiguous run; units past H are zero rows."""
    D, G, H, NT, UPT = spec.D, spec.G, spec.H, spec.NT, spec.UPT
    R = np.asarray(spec.R.data, np.float32).reshape(D, G, H, H)           # [d, gate, unit, k]
    padded = np.zeros((D, G, UPT * NT, H), np.float32)
    padded[:, :, :H] = R
    units = padded.reshape(D, G, UPT, NT, H)                               # [d, gate, slot, tid, k]
    return np.ascontiguousarray(units.transpose(0, 4, 2, 1, 3))            # [d, k, slot, gate, tid]


class _Recurrence:
    """Source writer of one node's recurrence kernel."""

    def __init__(self, spec, scratch):
        self.spec = spec
        s = spec
        args = self.args = _Args()
        self.pP = args.bind(scratch)
        if s.R.is_const:
            self.pR = args.bind(_pack_r(s))
        else:
            self.pR = args.bind(s.R.name)
        self.pB = args.bind(s.Bv.name) if s.lbr and s.Bv is not None else None
        self.pseq = args.bind(s.seq.name, np.int32) if s.seq is not None else None
        self.ph0 = args.bind(s.h0.name) if s.h0 is not None else None
        self.pc0 = args.bind(s.c0.name) if s.c0 is not None else None
        self.ppeep = args.bind(s.P.name) if s.P is not None else None
        self.n_inputs = len(args.values)
        self.pY = args.bind(s.Y) if s.Y else None
        self.pYh = args.bind(s.Yh) if s.Yh else None
        self.pYc = args.bind(s.Yc) if s.Yc else None
        self.src = Source()

    def r_at(self, k, slot, g, resident):
        """R's row of gate g for the thread's unit in `slot`, at k (an expression); `resident`:
        the register that holds it."""
        s = self.spec
        if resident:
            return f"r{k}_{slot}_{g}"
        if s.R.is_const:
            return f"{self.pR}[rb + (({k})*{s.S} + {slot * s.G + g})*{s.NT} + tid]"
        return f"{self.pR}[(d*{s.GH} + {g * s.H} + ur{slot})*{s.H} + {k}]"

    def clip(self, var):
        if self.spec.clip is not None:
            c = literal(float(self.spec.clip), np.float32)
            self.src.line(f"{var} = min(max({var}, -{c}), {c})")

    def activate(self, k, x, out):
        """out = the direction's activation k of x (a branch on d where the directions differ)."""
        acts = self.spec.acts
        if all(a[k] == acts[0][k] for a in acts):
            self.src.line(f"{out} = {acts[0][k].replace('{x}', x)}")
            return
        self.src.line("if d == 0:").indent().line(f"{out} = {acts[0][k].replace('{x}', x)}").dedent()
        self.src.line("else:").indent().line(f"{out} = {acts[1][k].replace('{x}', x)}").dedent()

    def product(self, gates, vector, acc):
        """acc(slot, g) += vector[k] * R[g*H + unit, k] over k in order, for the given gates of
        every unit slot; vector: a shared array expression taking k."""
        s, src = self.spec, self.src
        for k in range(s.KR):
            src.line(f"v = {vector.format(k=k)}")
            for slot in range(s.UPT):
                for g in gates:
                    src.line(f"{acc(slot, g)} += v * {self.r_at(k, slot, g, True)}")
        if s.KR < s.H:
            src.line(f"for k in range({s.KR}, {s.H}):").indent()
            src.line(f"v = {vector.format(k='k')}")
            for slot in range(s.UPT):
                for g in gates:
                    src.line(f"{acc(slot, g)} += v * {self.r_at('k', slot, g, False)}")
            src.dedent()

    def text(self) -> str:
        s, src = self.spec, self.src
        H, NT, UPT = s.H, s.NT, s.UPT
        src.line(f"def kernel({', '.join(f'p{i}' for i in range(len(self.args.values)))}, n):").indent()
        src.line(f"hs = cuda.shared.array((2, {H}), float32)")
        if s.cell == "GRU" and not s.lbr:
            src.line(f"qs = cuda.shared.array(({H},), float32)")
        src.line("tid = cuda.threadIdx.x")
        src.line(f"d = cuda.blockIdx.x // {s.B}").line(f"b = cuda.blockIdx.x % {s.B}")
        src.line(f"st = {s.state_row()}")
        if s.R.is_const:
            src.line(f"rb = d*{H * s.S * NT}")
        for slot in range(UPT):
            src.line(f"u{slot} = tid + {slot * NT}").line(f"ur{slot} = min(u{slot}, {H - 1})")
        for k in range(s.KR):
            for slot in range(UPT):
                for g in range(s.G):
                    src.line(f"r{k}_{slot}_{g} = {self.r_at(k, slot, g, False)}")
        for slot in range(UPT):
            src.line(f"h{slot} = {self.ph0}[st + ur{slot}]" if self.ph0 else f"h{slot} = {F0}")
            if s.cell == "LSTM":
                src.line(f"c{slot} = {self.pc0}[st + ur{slot}]" if self.pc0 else f"c{slot} = {F0}")
            src.line(f"if u{slot} < {H}:").indent().line(f"hs[0, u{slot}] = h{slot}").dedent()
        if self.pseq:
            src.line(f"L = min(max(np.int64({self.pseq}[b]), 0), {s.T})")
        else:
            src.line(f"L = {s.T}")
        src.line("cuda.syncthreads()")
        self.prefetch("0")
        src.line("for s in range(L):").indent()
        src.line(f"t = {self.time_of('s')}")
        src.line("hb = s % 2")
        if self.pY:
            src.line(f"yo = {s.y_row('t')}")
        for slot in range(UPT):
            for g in self.gates():
                src.line(f"a{slot}_{g} = x{slot}_{g}")
        self.prefetch("s + 1")
        {"LSTM": self.lstm_step, "GRU": self.gru_step, "RNN": self.rnn_step}[s.cell]()
        src.line("cuda.syncthreads()")
        src.dedent()
        for slot in range(UPT if self.pYh or self.pYc else 0):
            src.line(f"if u{slot} < {H}:").indent()
            if self.pYh:
                src.line(f"{self.pYh}[st + u{slot}] = h{slot}")
            if self.pYc:
                src.line(f"{self.pYc}[st + u{slot}] = c{slot}")
            src.dedent()
        if self.pY and self.pseq:   # steps past a row's length are zeros
            src.line(f"for t in range(L, {s.T}):").indent()
            src.line(f"for j in range(tid, {H}, {NT}):").indent()
            src.line(f"{self.pY}[{s.y_row('t')} + j] = {F0}").dedent().dedent()
        return src.text()

    def time_of(self, step):
        """The time index of a step (reverse: from the row's last step back)."""
        direction = self.spec.direction
        if direction == "forward":
            return f"({step})"
        if direction == "reverse":
            return f"(L - 1 - ({step}))"
        return f"(({step}) if d == 0 else L - 1 - ({step}))"

    def gates(self):
        """The gate rows whose projections a step reads (an LSTM with input_forget has no f)."""
        s = self.spec
        return [0, 1, 3] if s.input_forget else list(range(s.G))

    def prefetch(self, step):
        """x{slot}_{g} = the projections of `step` (when it runs): loaded a whole step before
        they are used, so that no step waits on L2 for them."""
        s, src = self.spec, self.src
        for slot in range(s.UPT if step == "0" else 0):   # defined when L is 0
            for g in self.gates():
                src.line(f"x{slot}_{g} = {F0}")
        src.line(f"if {step} < L:").indent()
        src.line(f"xo = ((d*{s.T} + {self.time_of(step)})*{s.B} + b)*{s.GH}")
        for slot in range(s.UPT):
            for g in self.gates():
                src.line(f"x{slot}_{g} = {self.pP}[xo + {g * s.H} + ur{slot}]")
        src.dedent()

    def store_h(self, slot, value):
        """The unit's new h: in its register, in the next step's buffer, in Y."""
        src = self.src
        src.line(f"h{slot} = {value}")
        src.line(f"if u{slot} < {self.spec.H}:").indent()
        src.line(f"hs[1 - hb, u{slot}] = h{slot}")
        if self.pY:
            src.line(f"{self.pY}[yo + u{slot}] = h{slot}")
        src.dedent()

    def lstm_step(self):
        """ONNX gate rows i, o, f, c."""
        s, src = self.spec, self.src
        gates = self.gates()
        self.product(gates, "hs[hb, {k}]", lambda slot, g: f"a{slot}_{g}")
        H = s.H
        for slot in range(s.UPT):
            ai, ao, af, ac = (f"a{slot}_{g}" for g in range(4))
            if self.ppeep:
                src.line(f"{ai} += {self.ppeep}[d*{3 * H} + ur{slot}] * c{slot}")
                if not s.input_forget:
                    src.line(f"{af} += {self.ppeep}[d*{3 * H} + {2 * H} + ur{slot}] * c{slot}")
            self.clip(ai)
            self.activate(0, ai, "ig")
            if s.input_forget:
                src.line(f"fg = {F1} - ig")
            else:
                self.clip(af)
                self.activate(0, af, "fg")
            self.clip(ac)
            self.activate(1, ac, "cg")
            src.line(f"c{slot} = fg * c{slot} + ig * cg")
            if self.ppeep:
                src.line(f"{ao} += {self.ppeep}[d*{3 * H} + {H} + ur{slot}] * c{slot}")
            self.clip(ao)
            self.activate(0, ao, "og")
            self.activate(2, f"c{slot}", "hc")
            self.store_h(slot, "og * hc")

    def gru_step(self):
        """ONNX gate rows z, r, h. linear_before_reset=0: r*h goes through shared memory (a
        second syncthreads) before the candidate's product; =1: h.Rh (+ Rbh) is scaled by r."""
        s, src, H = self.spec, self.src, self.spec.H
        if s.lbr:
            for slot in range(s.UPT):
                src.line(f"q{slot} = {self.pB}[d*{2 * s.GH} + {s.GH + 2 * H} + ur{slot}]" if self.pB
                         else f"q{slot} = {F0}")
            self.product([0, 1, 2], "hs[hb, {k}]", lambda slot, g: f"a{slot}_{g}" if g < 2 else f"q{slot}")
        else:
            self.product([0, 1], "hs[hb, {k}]", lambda slot, g: f"a{slot}_{g}")
        for slot in range(s.UPT):
            self.clip(f"a{slot}_1")
            self.activate(0, f"a{slot}_1", f"rg{slot}")
            if s.lbr:
                src.line(f"a{slot}_2 += rg{slot} * q{slot}")
            else:
                src.line(f"if u{slot} < {H}:").indent().line(f"qs[u{slot}] = rg{slot} * h{slot}").dedent()
        if not s.lbr:
            src.line("cuda.syncthreads()")
            self.product([2], "qs[{k}]", lambda slot, g: f"a{slot}_{g}")
        for slot in range(s.UPT):
            self.clip(f"a{slot}_0")
            self.clip(f"a{slot}_2")
            self.activate(0, f"a{slot}_0", "zg")
            self.activate(1, f"a{slot}_2", "ng")
            self.store_h(slot, f"({F1} - zg) * ng + zg * h{slot}")

    def rnn_step(self):
        s = self.spec
        self.product([0], "hs[hb, {k}]", lambda slot, g: f"a{slot}_{g}")
        for slot in range(s.UPT):
            self.clip(f"a{slot}_0")
            self.activate(0, f"a{slot}_0", "hn")
            self.store_h(slot, "hn")


def _recurrence_call(spec, scratch) -> KernelCall:
    rec = _Recurrence(spec, scratch)
    kernel = gpu_kernel(spec.cell, rec.text(), rec.args.types, spec.NT)
    blocks = spec.D * spec.B
    return KernelCall(kernel, rec.args.values, blocks * spec.NT, spec.node.name,
                      n_outputs=len(rec.args.values) - rec.n_inputs)


GENERATORS = {"LSTM": lower_lstm, "GRU": lower_gru, "RNN": lower_rnn}
