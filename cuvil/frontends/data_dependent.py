"""Ops whose output shapes depend on the input *data*: static upper bounds.

NonZero, Unique, NonMaxSuppression and Compress (with a condition known only at
run time), StringNormalizer with stopwords and StringSplit (docs/strings.md) return
as many elements as the data selects. Cuvil gives each such
output a static upper-bound shape (the bytes its buffer holds) and an int64
"dims" value, one more output of the node, into which the kernel writes the
actual shape; the tensor is the C-contiguous prefix of the buffer
(docs/dynamic_shapes.md). `bounds` returns, per ONNX output, the bound, the
dtype and whether the shape is data-dependent (a Compress whose condition is a
constant, or Unique's inverse_indices, have exact static shapes).
"""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedOpError

OPS = ("NonZero", "Unique", "NonMaxSuppression", "Compress", "StringNormalizer", "StringSplit")

# StringSplit without maxsplit: at most this many substrings per string (the buffer's last dim); a
# run that finds more fails with an error naming the node (docs/strings.md).
STRING_SPLIT_PIECES = 64


def _axis(attrs, rank, name, op):
    axis = attrs.get("axis")
    if axis is None:
        return None
    axis = int(axis)
    if not -rank <= axis < rank:
        raise UnsupportedOpError(f"node '{name}' ({op}): axis {axis} is out of range for rank {rank}")
    return axis % rank


def bounds(op: str, name: str, attrs: dict, inputs: list) -> list[tuple[tuple[int, ...], np.dtype, bool]]:
    """inputs: the node's input Values (None where omitted)."""
    x = inputs[0]
    shape = tuple(int(d) for d in x.shape)
    n = int(np.prod(shape, dtype=np.int64))
    if op == "NonZero":
        if not shape:
            raise UnsupportedOpError(f"node '{name}' (NonZero): a scalar input is not supported",
                                     hint="give NonZero a tensor of rank 1 or more")
        return [((len(shape), n), np.dtype(np.int64), True)]
    if op == "Unique":
        axis = _axis(attrs, len(shape), name, op)
        m = n if axis is None else shape[axis]
        y = (m,) if axis is None else shape
        return [(y, np.dtype(x.dtype), True), ((m,), np.dtype(np.int64), True),
                ((m,), np.dtype(np.int64), False), ((m,), np.dtype(np.int64), True)]
    if op == "NonMaxSuppression":
        b, c = int(x.shape[0]), int(inputs[1].shape[1])
        boxes = int(x.shape[1])
        per_class = boxes
        limit = inputs[2] if len(inputs) > 2 else None
        if limit is None:
            per_class = 0  # max_output_boxes_per_class defaults to 0: nothing is selected
        elif limit.is_const:
            per_class = max(0, min(boxes, int(np.asarray(limit.data).reshape(-1)[0])))
        return [((b * c * per_class, 3), np.dtype(np.int64), True)]
    if op == "Compress":
        cond = inputs[1]
        axis = _axis(attrs, len(shape), name, op)
        length = n if axis is None else shape[axis]
        if cond.is_const:
            selected = int(np.count_nonzero(np.asarray(cond.data).reshape(-1)[:length]))
            dynamic = False
        else:
            selected, dynamic = min(length, cond.size), True
        out = (selected,) if axis is None else shape[:axis] + (selected,) + shape[axis + 1:]
        return [(out, np.dtype(x.dtype), dynamic)]
    if op == "StringNormalizer":
        # stopwords drop elements: at most the input's count, and onnxruntime returns one empty
        # string ([1] or [1, 1]) when every element is dropped
        stopwords = [w for w in attrs.get("stopwords", []) or []]
        if len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] != 1):
            raise UnsupportedOpError(f"node '{name}' (StringNormalizer): the input's shape is {list(shape)}; "
                                     "the op takes [C] or [1, C]")
        count = max(shape[-1], 1)
        return [(shape[:-1] + (count,), np.dtype(object), bool(stopwords))]
    if op == "StringSplit":
        maxsplit = attrs.get("maxsplit")
        pieces = int(maxsplit) + 1 if maxsplit is not None and int(maxsplit) >= 0 else STRING_SPLIT_PIECES
        return [(shape + (pieces,), np.dtype(object), True), (shape, np.dtype(np.int64), False)]
    raise AssertionError(op)
