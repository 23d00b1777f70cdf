"""Concat: one kernel copies every input into its slice of the output.

Viewed as outer x (n_i * inner), input i is one contiguous run of
len_i = n_i * inner elements per outer row, landing at column offset off_i
of the output row (length = sum of len_i). A work item is one outer row, or
one block of a row when rows are long and few (Concat on axis 0), so the
work splits across threads either way. The kernel only moves bytes, so its
pointers are unsigned integers of the element size.

The call also lists its inputs as ConcatParts, each with a call that copies
that input alone into its `outer` runs: the memory planner
(backends/native/memory.py) lets an input's producer write straight into its
runs of the output, drops the Concat when every input is placed, and keeps the
one-input copies of the others. When outer == 1 (a channel Concat at batch 1,
or any axis with only 1s before it) an input is one contiguous run, which any
producer can write. When outer > 1 it is `outer` runs one output row apart, so
only a producer that can write its output with that stride between blocks can
be placed: `strided_inputs` names the inputs of a Concat along an axis after
the batch (outer == batch) whose one reader it is, and the generators that can
write their output's batch blocks a row apart (nearest and general Resize,
ConvTranspose's patch shuffle, elementwise ops) give their call that form
(kernel.with_strided_form).
"""
from __future__ import annotations

from collections import Counter

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
    if y.size and y.shape_from is None:
        itemsize = np.dtype(y.dtype).itemsize
        call.parts = [ConcatPart(name, off * itemsize, _copy_runs(name, y.name, off, length, outer, row, ctype,
                                                                  node.name), outer)
                      for name, off, length in parts]
    return Lowered([call])


def strided_inputs(graph) -> dict[str, int]:
    """value -> row (elements between batch blocks of the Concat output) for each input of a
    Concat at batch > 1 along an axis after the batch with only 1s between (its outer extent is
    the batch) whose only reader is that Concat, once: a producer that writes the input's batch
    blocks a row apart writes it in place (kernel.with_strided_form)."""
    reads = Counter(name for node in graph.nodes for name in node.inputs if name)
    rows = {}
    for node in graph.nodes:
        if node.op != "Concat" or node.domain:
            continue
        y = graph.values[node.outputs[0]]
        axis = int(node.attr("axis"))
        axis += len(y.shape) if axis < 0 else 0
        if axis < 1 or y.shape_from is not None or not y.size or int(y.shape[0]) < 2 \
                or int(np.prod(y.shape[1:axis], dtype=np.int64)) != 1:
            continue
        for name in node.inputs:
            if name and reads[name] == 1 and name not in graph.outputs and graph.values[name].size:
                rows[name] = y.size // int(y.shape[0])
    return rows


def _copy_runs(src: str, dst: str, offset: int, length: int, rows: int, row: int, ctype: str,
               node: str) -> KernelCall:
    """The call copying `src` (rows x length elements) to elements [offset, offset + length) of
    each of the first `rows` rows of `dst` (row elements long), in blocks of _BLOCK elements of
    a row (the work items)."""
    blocks = -(-length // _BLOCK)
    src_text = Source().line(kernel_header(2)).indent()
    src_text.line("for w in range(begin, end):").indent()
    if rows == 1:
        src_text.line(f"lo = w * {_BLOCK}")
        src_text.line(f"for j in range(lo, min(lo + {_BLOCK}, {length})):").indent()
        src_text.line(f"p1[{f'{offset} + ' if offset else ''}j] = p0[j]")
    else:
        src_text.line(f"r = w // {blocks}").line(f"lo = (w % {blocks}) * {_BLOCK}")
        src_text.line(f"for j in range(lo, min(lo + {_BLOCK}, {length})):").indent()
        src_text.line(f"p1[r * {row} + {f'{offset} + ' if offset else ''}j] = p0[r * {length} + j]")
    return KernelCall(Kernel("ConcatCopy", src_text.text(), (ctype, ctype)), [src, dst], rows * blocks, node)
