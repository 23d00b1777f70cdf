"""What a kernel generator returns, and small helpers for writing kernel source.

A Kernel is Python source specialised to static shapes that defines
`kernel(p0, p1, ..., begin, end)`: raw pointers (inputs first, then outputs)
and the work range `[begin, end)` of its outer loop, so the driver can split
it across threads. Its identity is its source and pointer types: two nodes
with the same op, shapes and attributes produce the same Kernel and share one
compiled object.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from backends.native.targets import DEFAULT_L1D_WAYS
from cuvil.errors import UnsupportedOpError


_THREADS = contextvars.ContextVar("cuvil_session_threads", default=1)


def session_threads() -> int:
    """The thread count of the library being lowered (the build's `threads`): generators size
    their work items for it."""
    return _THREADS.get()


_L1D_WAYS = contextvars.ContextVar("cuvil_l1d_ways", default=DEFAULT_L1D_WAYS)


def l1d_ways() -> int:
    """The L1 data cache associativity of the target being lowered for (CpuTarget.l1d_ways)."""
    return _L1D_WAYS.get()


@contextlib.contextmanager
def lowering_for(threads: int, l1d_ways: int = DEFAULT_L1D_WAYS):
    token = _THREADS.set(max(1, int(threads)))
    ways = _L1D_WAYS.set(max(1, int(l1d_ways)))
    try:
        yield
    finally:
        _L1D_WAYS.reset(ways)
        _THREADS.reset(token)


def work_items() -> int:
    """Work items a large GEMM or convolution aims for: at least 8 (measured: 1, 2, 4 or 8 items
    run a ResNet-18 equally fast on one thread), and four per thread beyond two threads."""
    return max(8, 4 * session_threads())


@dataclass(frozen=True)
class Kernel:
    family: str                # short op-family name, used in the symbol
    source: str                # defines `def kernel(p0, ..., begin, end):`
    arg_types: tuple[str, ...]  # numpy dtype name of each pointer argument

    @cached_property
    def key(self) -> str:
        blob = json.dumps([self.family, self.source, list(self.arg_types)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def symbol(self) -> str:
        family = re.sub(r"[^A-Za-z0-9]", "_", self.family).lower()
        return f"cuvilk_{family}_{self.key[:16]}"


@dataclass
class InPlace:
    """The form a call takes when its output takes over the buffer of input `value` (the memory
    planner decides, when `value` has no later reader): `kernel` then finds that input's values
    in its output (a GEMM or conv accumulates onto its residual instead of reading it apart)."""
    value: str
    kernel: Kernel
    args: list
    work: int


@dataclass
class KernelCall:
    """One call of a kernel in the schedule: which values (or build-time packed
    constants) its pointers bind to, and the size of its work range."""
    kernel: Kernel
    args: list  # value names (str) or np.ndarray constants packed at build time
    work: int
    node: str = ""  # the CIR node(s) it implements, for messages and `explain`
    n_outputs: int = 1  # the trailing n_outputs args are written, the rest only read
    in_place: InPlace | None = None  # see InPlace
    # Runs once, when the first session of the loaded library is created, not on every run: its
    # inputs are constants and its outputs persist, shared by every session, for the other calls
    # to read (weights transformed for a kernel, which the library then need not store
    # transformed: see winograd.py).
    once: bool = False


@dataclass
class View:
    """The output is the input's bytes under another shape (Reshape, Flatten...)."""
    src: str
    dst: str
    node: str = ""


@dataclass
class Lowered:
    """What a generator returns for one node."""
    calls: list = field(default_factory=list)  # KernelCall | View


def const_input(node, graph, pos, what, default=None):
    """The data of a node's constant input at `pos` (`default` when omitted); an
    UnsupportedOpError naming the node when the input is computed at run time."""
    if len(node.inputs) <= pos or not node.inputs[pos]:
        return default
    v = graph.values[node.inputs[pos]]
    if not v.is_const:
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): {what} ('{v.name}') must be a constant",
                                 hint="cuvil specialises kernels to constant shapes, axes, starts, pads and counts")
    return np.asarray(v.data)


def dims_strides(shape) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return list(reversed(strides))


def broadcast_strides(in_shape, out_shape) -> list[int]:
    """Element strides of an input broadcast (numpy rules) to out_shape; 0 on broadcast dims."""
    in_shape = [1] * (len(out_shape) - len(in_shape)) + list(in_shape)
    strides = dims_strides(in_shape)
    return [0 if d == 1 and o != 1 else s for d, s, o in zip(in_shape, strides, out_shape)]


def index_expr(loop_vars, strides, base="") -> str:
    """Flat index `i0*s0 + i1*s1 ...` with zero strides dropped and unit strides simplified."""
    terms = [base] if base else []
    for var, stride in zip(loop_vars, strides):
        if stride == 0:
            continue
        terms.append(var if stride == 1 else f"{var}*{stride}")
    return " + ".join(terms) if terms else "0"


def literal(value, dtype) -> str:
    """A typed literal for generated source (float32 kernels must not widen to float64)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        v = float(value)
        if v != v:
            text = "np.nan"
        elif v == float("inf"):
            text = "np.inf"
        elif v == float("-inf"):
            text = "-np.inf"
        else:
            text = repr(v)
        return f"np.{dtype.name}({text})"
    if dtype.kind == "b":
        return "True" if value else "False"
    return f"np.{dtype.name}({int(value)})"


class Source:
    """A tiny indented-source writer."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def line(self, text=""):
        self.lines.append("    " * self.depth + text if text else "")
        return self

    def indent(self):
        self.depth += 1
        return self

    def dedent(self):
        self.depth -= 1
        return self

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def kernel_header(n_args: int) -> str:
    params = ", ".join([f"p{i}" for i in range(n_args)] + ["begin", "end"])
    return f"def kernel({params}):"
