"""Concat: one kernel copies every input into its slice of the output.

Viewed as outer x (n_i * inner), input i is one contiguous run of
len_i = n_i * inner elements per outer row, landing at column offset off_i
of the output row (length = sum of len_i). A work item is one outer row, or
one block of a row when rows are long and few (Concat on axis 0), so the
work splits across threads either way. The kernel only moves bytes, so its
pointers are unsigned integers of the element size.

When outer == 1 (a channel Concat at batch 1, or any axis with only 1s before
it) every input is one contiguous run of the output, so the call also lists
its inputs as ConcatParts, each with a call that copies that input alone: the
memory planner (backends/native/memory.py) lets an input's producer write
straight into its run of the output, drops the Concat when every input is
placed, and keeps the one-input copies of the others.
"""
from __future__ import annotations

import numpy as np

from .kernel import ConcatPart, Kernel, KernelCall, Lowered, Source, kernel_header
from .transpose import copy_type

# A row is split in blocks of this many elements when there are few rows.
_BLOCK = 4096
_FEW_ROWS = 64


def lower_concat(node, graph) -> Lowered:
    y = graph.values[node.outputs[0]]
    rank = len(y.shape)
    axis = int(node.attr("axis"))
    if axis < 0:
        axis += rank
    outer = int(np.prod(y.shape[:axis], dtype=np.int64))
    inner = int(np.prod(y.shape[axis + 1:], dtype=np.int64))
    ctype = copy_type(node, y.dtype)
    # Inputs with no elements add nothing (and may have no storage).
    parts, offset = [], 0
    for name in node.inputs:
        if not name:
            continue
        length = int(graph.values[name].shape[axis]) * inner
        if length:
            parts.append((name, offset, length))
        offset += length
    row = offset

    blocks = -(-row // _BLOCK) if outer < _FEW_ROWS and row > _BLOCK else 1
    src = Source().line(kernel_header(len(parts) + 1)).indent()
    out = f"p{len(parts)}"
    if blocks == 1:
        src.line("for r in range(begin, end):").indent()
        for k, (_, off, length) in enumerate(parts):
            src.line(f"for j in range({length}):").indent()
            src.line(f"{out}[r * {row} + {f'{off} + ' if off else ''}j] = p{k}[r * {length} + j]").dedent()
        work = outer
    else:
        # Work item w: row w // blocks, columns [lo, hi) of it; each input copies its overlap.
        src.line("for w in range(begin, end):").indent()
        src.line(f"r = w // {blocks}")
        src.line(f"lo = (w % {blocks}) * {_BLOCK}")
        src.line(f"hi = min(lo + {_BLOCK}, {row})")
        for k, (_, off, length) in enumerate(parts):
            src.line(f"for j in range(max(lo, {off}), min(hi, {off + length})):").indent()
            src.line(f"{out}[r * {row} + j] = p{k}[r * {length} + j - {off}]").dedent()
        work = outer * blocks
    if y.size == 0:
        work = 0
    kernel = Kernel("Concat", src.text(), (ctype,) * (len(parts) + 1))
    call = KernelCall(kernel, [name for name, _, _ in parts] + [y.name], work, node.name)
    if outer == 1 and y.size and y.shape_from is None:
        itemsize = np.dtype(y.dtype).itemsize
        call.parts = [ConcatPart(name, off * itemsize, _copy_run(name, y.name, off, length, ctype, node.name))
                      for name, off, length in parts]
    return Lowered([call])


def _copy_run(src: str, dst: str, offset: int, length: int, ctype: str, node: str) -> KernelCall:
    """The call copying `src` (length elements) to elements [offset, offset + length) of `dst`,
    in blocks of _BLOCK elements (the work items)."""
    blocks = -(-length // _BLOCK)
    src_text = Source().line(kernel_header(2)).indent()
    src_text.line("for w in range(begin, end):").indent()
    src_text.line(f"lo = w * {_BLOCK}")
    src_text.line(f"for j in range(lo, min(lo + {_BLOCK}, {length})):").indent()
    src_text.line(f"p1[{f'{offset} + ' if offset else ''}j] = p0[j]")
    return KernelCall(Kernel("ConcatCopy", src_text.text(), (ctype, ctype)), [src, dst], blocks, node)
