"""The generators' toolkit: the schedule types they return (backends/schedule.py),
the lowering context (session threads, the target's L1 ways) and small helpers
for writing kernel source.
"""
from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from backends.schedule import ConcatPart, InPlace, Kernel, KernelCall, Lowered, Strided, View  # noqa: F401  (the generators' types)
from backends.targets import DEFAULT_L1D_WAYS
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


_TARGET = contextvars.ContextVar("cuvil_lowering_target", default=None)


def lowering_target():
    """The CpuTarget being lowered for (None when a caller lowers without one): generators that
    choose instructions by the target's features (the reduced-precision products) read it."""
    return _TARGET.get()


@contextlib.contextmanager
def lowering_for(threads: int, l1d_ways: int = DEFAULT_L1D_WAYS, target=None):
    token = _THREADS.set(max(1, int(threads)))
    ways = _L1D_WAYS.set(max(1, int(l1d_ways)))
    cpu = _TARGET.set(target)
    try:
        yield
    finally:
        _TARGET.reset(cpu)
        _L1D_WAYS.reset(ways)
        _THREADS.reset(token)


_CONCAT_ROWS = contextvars.ContextVar("cuvil_concat_rows", default={})


@contextlib.contextmanager
def concat_rows(rows: dict[str, int]):
    """Lower with `rows` (value -> elements between the batch blocks of the Concat output it is
    the one reader of: numba_cpu/concat.py strided_inputs) for concat_row to read."""
    token = _CONCAT_ROWS.set(rows)
    try:
        yield
    finally:
        _CONCAT_ROWS.reset(token)


def with_strided_form(call: KernelCall, value, kernel_for) -> KernelCall:
    """`call`, which writes `value`, with the Strided form for the Concat `value` feeds (if it
    feeds one that can take it: concat_rows): `kernel_for(row)` returns the (kernel, work) that
    write the batch blocks of `value` `row` elements apart. A generator that can write its output
    so declares it by calling this."""
    row = _CONCAT_ROWS.get().get(value.name)
    if row is not None:
        kernel, work = kernel_for(row)
        call.strided = Strided(kernel, work, row * np.dtype(value.dtype).itemsize)
    return call


_ONE_WEIGHT_LAYOUT = contextvars.ContextVar("cuvil_one_weight_layout", default=False)


def one_weight_layout() -> bool:
    """Whether graphs of different row counts share the weights they read (a generation library's
    prefill and decode entries, cuvil/generation.py): constant matrices are then packed in the one
    layout every row count reads (gemm.choose_tile), so the library stores them once."""
    return _ONE_WEIGHT_LAYOUT.get()


@contextlib.contextmanager
def sharing_weights():
    token = _ONE_WEIGHT_LAYOUT.set(True)
    try:
        yield
    finally:
        _ONE_WEIGHT_LAYOUT.reset(token)


def work_items() -> int:
    """Work items a large GEMM or convolution aims for: at least 8 (measured: 1, 2, 4 or 8 items
    run a ResNet-18 equally fast on one thread), and four per thread beyond two threads."""
    return max(8, 4 * session_threads())


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
