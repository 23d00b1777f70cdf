"""The random ops: RandomUniform(Like), RandomNormal(Like), Bernoulli, Multinomial and training
Dropout, on a counter-based generator (Philox4x32-10, Salmon et al. 2011, as cuRAND, JAX and
PyTorch use it).

Philox maps (counter, key) to four 32-bit words with ten rounds of

    (c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))
    (k0, k1)         -> (k0 + W0, k1 + W1)                       (all mod 2^32)

Element i of a node's output uses counter (lo(i), hi(i), lo(stream), hi(stream)): its value
depends on nothing but (key, stream, i), so the same bits come out for any split of the work
over threads. The key and stream come from an argument of two uint64 words (key, stream):

- with the op's `seed`: a constant (the float64 bits of the seed, stream 0). Every run then
  gives the same values (the op is a function of its seed).
- without a seed: the session's state (RNG_STATE: the driver's `s->rng`, the seed CUVIL_SEED
  names when the session is created, else 0, and the number of runs so far as the stream), with
  a salt from the node's name in the key, so each run and each node draws new numbers. Such a
  call reads the session, so it runs on the calling thread.

From the words: a float32 uniform on [0, 1) is w0 >> 8 times 2^-24; a float64 one is 53 bits
of (w0, w1); a normal is Box-Muller on two float64 uniforms, sqrt(-2 ln(1 - u)) cos(2 pi v)."""
from __future__ import annotations

import hashlib
import struct

import numpy as np

from cuvil.errors import UnsupportedOpError
from cuvil.ir import Value
from cuvil.ops import RNG_STATE  # the driver binds it to the session's state (native/driver.py)

from .kernel import Kernel, KernelCall, Lowered, Source, const_input, kernel_header


PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox4x32(counter, key, rounds=10) -> tuple[int, int, int, int]:
    """The reference in Python integers (tests check the kernels' bits against it)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = PHILOX_M0 * c0, PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


# Kernel source: the generator as an inlined function over uint64 holding 32-bit words (every
# literal a np.uint64: mixing with int64 would give float64 in Numba).
_PHILOX_SOURCE = f'''
@_numba_njit(inline='always')
def _philox(i, state, salt):
    mask = np.uint64({MASK32})
    n = np.uint64(i)
    c0 = n & mask
    c1 = n >> np.uint64(32)
    c2 = state[1] & mask
    c3 = state[1] >> np.uint64(32)
    k0 = (state[0] & mask) ^ np.uint64(salt)
    k1 = state[0] >> np.uint64(32)
    for _ in range(10):
        p0 = np.uint64({PHILOX_M0}) * c0
        p1 = np.uint64({PHILOX_M1}) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
        k0 = (k0 + np.uint64({PHILOX_W0})) & mask
        k1 = (k1 + np.uint64({PHILOX_W1})) & mask
    return c0, c1, c2, c3


@_numba_njit(inline='always')
def _uniform32(w0):
    return np.float32(np.float64(w0 >> np.uint64(8)) * 5.9604644775390625e-08)


@_numba_njit(inline='always')
def _uniform64(w0, w1):
    return (np.float64(w0 >> np.uint64(5)) * 67108864.0 + np.float64(w1 >> np.uint64(6))) * 1.1102230246251565e-16


@_numba_njit(inline='always')
def _normal(w0, w1, w2, w3):
    u = _uniform64(w0, w1)
    v = _uniform64(w2, w3)
    return math.sqrt(-2.0 * math.log(1.0 - u)) * math.cos(6.283185307179586 * v)

'''


def _state_arg(node, graph):
    """(the state argument: a constant or RNG_STATE, the key salt) for a node's `seed`."""
    seed = node.attr("seed")
    if seed is not None:
        bits = struct.unpack("<Q", struct.pack("<d", float(seed)))[0]
        return np.array([bits, 0], np.uint64), 0
    if RNG_STATE not in graph.values:
        graph.values[RNG_STATE] = Value(RNG_STATE, np.dtype(np.uint64), (2,))
    salt = int.from_bytes(hashlib.sha256(node.name.encode()).digest()[:4], "little")
    return RNG_STATE, salt


def _float_type(node, value) -> str:
    dtype = np.dtype(value.dtype)
    if dtype not in (np.float32, np.float64):
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): {dtype} random values are not supported",
                                 hint="use float32 or float64 (cast the result)")
    return dtype.name


def _sample(dtype: str, kind: str) -> str:
    """The expression of one sample of element i (words w0..w3)."""
    if kind == "normal":
        return "_normal(w0, w1, w2, w3)"
    return "_uniform32(w0)" if dtype == "float32" else "_uniform64(w0, w1)"


def _elementwise(family, node, y, state, salt, body: str, reads: list, read_types: tuple) -> Lowered:
    """A kernel over y's elements: words w0..w3 of element i, then `body` (writes the output p<last>)."""
    out = f"p{len(reads) + 1}"
    src = Source()
    src.line(_PHILOX_SOURCE)
    src.line(kernel_header(len(reads) + 2)).indent()
    src.line("for i in range(begin, end):").indent()
    src.line(f"w0, w1, w2, w3 = _philox(i, p{len(reads)}, {salt})")
    src.line(body.replace("OUT", out))
    kernel = Kernel(family, src.text(), (*read_types, "uint64", _dtype_name(y.dtype)))
    return Lowered([KernelCall(kernel, [*reads, state, y.name], int(y.size), node.name)])


def _dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    return "uint8" if dtype == np.bool_ else dtype.name


def lower_random(node, graph) -> Lowered:
    """RandomUniform(Like): low + (high - low) u; RandomNormal(Like): mean + scale z."""
    y = graph.values[node.outputs[0]]
    dtype = _float_type(node, y)
    state, salt = _state_arg(node, graph)
    normal = node.op.startswith("RandomNormal")
    if normal:
        a, b = float(node.attr("mean", 0.0)), float(node.attr("scale", 1.0))
    else:
        low, high = float(node.attr("low", 0.0)), float(node.attr("high", 1.0))
        a, b = low, high - low
    sample = _sample(dtype, "normal" if normal else "uniform")
    body = f"OUT[i] = np.{dtype}({a!r} + {b!r} * np.float64({sample}))"
    return _elementwise(node.op, node, y, state, salt, body, [], ())


def lower_bernoulli(node, graph) -> Lowered:
    """y = 1 where a uniform u < p (the input), else 0, in the output's dtype."""
    p, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    ptype = _float_type(node, p)
    state, salt = _state_arg(node, graph)
    one = "np.uint8(1)" if np.dtype(y.dtype) == np.bool_ else f"np.{_dtype_name(y.dtype)}(1)"
    zero = one.replace("(1)", "(0)")
    body = f"OUT[i] = {one} if {_sample(ptype, 'uniform')} < p0[i] else {zero}"
    return _elementwise("Bernoulli", node, y, state, salt, body, [p.name], (ptype,))


def lower_training_dropout(node, graph, ratio: float) -> Lowered:
    """Training Dropout: keep an element where a uniform u >= ratio, scaled by 1 / (1 - ratio);
    the mask (optional output) says which were kept."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    dtype = _float_type(node, x)
    state, salt = _state_arg(node, graph)
    scale = 1.0 / (1.0 - ratio) if ratio < 1.0 else 0.0
    keep = f"{_sample(dtype, 'uniform')} >= np.{dtype}({ratio!r})"
    mask = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1] else None
    src = Source().line(_PHILOX_SOURCE).line(kernel_header(4 if mask else 3)).indent()
    src.line("for i in range(begin, end):").indent()
    src.line(f"w0, w1, w2, w3 = _philox(i, p1, {salt})")
    src.line(f"keep = {keep}")
    src.line(f"p2[i] = p0[i] * np.{dtype}({scale!r}) if keep else np.{dtype}(0.0)")
    types = (dtype, "uint64", dtype)
    args = [x.name, state, y.name]
    if mask:
        src.line("p3[i] = np.uint8(1) if keep else np.uint8(0)")
        types += ("uint8",)
        args.append(mask)
    kernel = Kernel("TrainingDropout", src.text(), types)
    return Lowered([KernelCall(kernel, args, int(x.size), node.name, n_outputs=2 if mask else 1)])


def lower_multinomial(node, graph) -> Lowered:
    """Each row of the input holds unnormalised log-probabilities of the classes; each of
    `sample_size` samples is the first class whose cumulative exp(x - max) exceeds u times
    their sum (u uniform in float64). Work item: one sample of one row."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    xtype = _float_type(node, x)
    if len(x.shape) != 2:
        raise UnsupportedOpError(f"node '{node.name}' (Multinomial): the input must be [batch, classes]")
    classes, samples = int(x.shape[1]), int(node.attr("sample_size", 1))
    state, salt = _state_arg(node, graph)
    out = _dtype_name(y.dtype)
    src = Source().line(_PHILOX_SOURCE).line(kernel_header(3)).indent()
    src.line("for i in range(begin, end):").indent()
    src.line(f"row = (i // {samples}) * {classes}")
    src.line("w0, w1, w2, w3 = _philox(i, p1, %d)" % salt)
    src.line("top = np.float64(p0[row])")
    src.line(f"for c in range(1, {classes}):").indent().line("top = max(top, np.float64(p0[row + c]))").dedent()
    src.line("total = 0.0")
    src.line(f"for c in range({classes}):").indent().line("total += math.exp(np.float64(p0[row + c]) - top)").dedent()
    src.line("target = _uniform64(w0, w1) * total")
    src.line(f"pick = {classes - 1}")
    src.line("run = 0.0")
    src.line(f"for c in range({classes}):").indent()
    src.line("run += math.exp(np.float64(p0[row + c]) - top)")
    src.line("if target < run:").indent().line("pick = c").line("break").dedent().dedent()
    src.line(f"p2[i] = np.{out}(pick)")
    kernel = Kernel("Multinomial", src.text(), (xtype, "uint64", out))
    return Lowered([KernelCall(kernel, [x.name, state, y.name], int(y.size), node.name)])


def dropout_ratio(node, graph) -> float | None:
    """The ratio of a Dropout in training mode with a non-zero ratio (random), else None."""
    ratio = const_input(node, graph, 1, "ratio")
    training = const_input(node, graph, 2, "training_mode")
    if training is None or not bool(np.asarray(training).reshape(-1)[0]):
        return None
    value = 0.5 if ratio is None else float(np.asarray(ratio).reshape(-1)[0])
    return value if value != 0.0 else None
