"""The input copy of a PrologueConv (domain "cuvil", passes/fuse_conv_prologue.py, lowered by
prologueconv.py): Conv(f(x)) for an elementwise program f of one input (a FusedElementwise:
wav2vec2's and Whisper's Gelu between two convs).

    y = Conv(f(x); W, b)   with  f(x)[i] = program(x[i])

A float32 conv on convgemm.py's implicit GEMM (or convsmall.py's) first copies its input into
phase images (the ConvPad step: every input value once, with the padding's zeros). Here that copy
applies f to each value it copies, so f(x) is never written to memory and read back: one pass over
the activation and one step fewer than FusedElementwise then ConvPad. The padding stays zero (it
pads f(x)). f is the same float32 expression as FusedElementwise's kernel, vectorised over a
channel's row here and over blocks of the flat tensor there (a value a loop's scalar remainder
computes can differ by an ulp of erf's polynomial). Another conv path (no phase images: a 1x1
conv, the direct kernel, Winograd...) runs the FusedElementwise kernel into a scratch tensor
first: the unfused schedule.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import numpy as np

from . import fused


@dataclass(frozen=True)
class Norm:
    """An InstanceNormalization before the program (its scale and bias value names, epsilon)."""
    scale: str
    bias: str
    epsilon: float


@dataclass(frozen=True)
class Prologue:
    lines: list          # computing `v` from `a_in` (program_expression)
    norm: Norm | None    # applied first, per (image, channel) plane


# (input name of the synthetic conv, Prologue, [used]) while PrologueConv lowers its conv
_ACTIVE = contextvars.ContextVar("cuvil_conv_prologue", default=None)


def program_expression(node, program, dtype, var: str) -> list[str]:
    """Lines computing the single-input program on variable `var` into `v` (FusedElementwise's
    expressions: fused.py), for a copy loop's body."""
    lines = [f"x0 = {var}"] + fused.program_lines(node, program, dtype)
    lines.append(f"v = np.{np.dtype(dtype).name}(t{len(program) - 1})")
    return lines


def take(x_name: str, whole_planes: bool = False) -> Prologue | None:
    """The Prologue a ConvPad copying `x_name` applies (noting that it did), or None. A prologue
    with an InstanceNormalization needs work items of whole (image, channel) planes."""
    active = _ACTIVE.get()
    if active is None or active[0] != x_name or (active[1].norm is not None and not whole_planes):
        return None
    active[2].append(True)
    return active[1]


@contextlib.contextmanager
def applying(x_name: str, prologue: Prologue):
    token = _ACTIVE.set((x_name, prologue, []))
    try:
        yield _ACTIVE.get()[2]
    finally:
        _ACTIVE.reset(token)
