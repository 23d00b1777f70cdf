"""Batch buckets: one library, one compiled entry per batch size, one weights blob.

A model built with `batch: [1, 8, 32]` (or `inputs: {x: [[1, 3, 224, 224], [8, 3, 224, 224],
[32, 3, 224, 224]]}`, the same thing written per input) is imported, rewritten and lowered once per
bucket with every input's dim 0 set to the bucket's batch, and the entries go into one driver
(backends/native/batching.py) whose weights are packed once: each kernel's packed layout is the
one every row count reads (kernel.sharing_weights) and identical arrays are stored once
(weights.Blob).

At run time `session_run_batch(s, n, inputs, outputs)` takes n rows (1 <= n <= the largest
bucket) of every input and writes n rows of every output: the smallest bucket b >= n runs, on the
caller's tensors when n == b, else on session buffers with rows n..b-1 of the inputs zero and the
outputs' first n rows copied out. `session_run` runs the largest bucket (the tensors the library's
description lists). The batch axis is dim 0 of every input and every output, and rows must not
depend on each other (BatchNormalization in inference, convolutions, matrix products: yes; a
reduction over dim 0: no) -- the build checks the shapes, not the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import CuvilError


@dataclass(frozen=True)
class Buckets:
    """The batch sizes with a compiled entry, ascending, and the input shapes of the largest."""
    batches: tuple[int, ...]
    shapes: dict                      # name -> shape of the largest bucket

    @property
    def largest(self) -> int:
        return self.batches[-1]

    def input_shapes(self, batch: int) -> dict[str, list[int]]:
        """The static input shapes of the entry for `batch` rows."""
        return {name: [batch, *shape[1:]] for name, shape in sorted(self.shapes.items())}

    def as_key(self) -> dict:
        return {"batches": list(self.batches), "shapes": {k: list(v) for k, v in sorted(self.shapes.items())}}


def _is_shape_list(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, (list, tuple)) for v in value)


def split_input_shapes(input_shapes: dict, batch, where: str) -> tuple[dict, list[int] | None]:
    """`inputs` written per bucket ({x: [[1, ...], [8, ...]]}) or with `batch` ([1, 8]) as one
    shape per input and the sorted batch sizes (None: no buckets). Each bucket's shapes may differ
    in dim 0 only, every input's dim 0 is the bucket's batch; a mistake is a CuvilError naming it."""
    input_shapes = dict(input_shapes or {})
    listed = {name: v for name, v in input_shapes.items() if _is_shape_list(v)}
    if batch is not None:
        if listed:
            raise CuvilError(f"{where}: give the buckets once: `batch:` or a list of shapes per input, not both "
                             f"(inputs {sorted(listed)} list several shapes)")
        if not isinstance(batch, (list, tuple)) or not batch or \
                any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch):
            raise CuvilError(f"{where}: batch: expected a list of positive integers, got {batch!r}")
        if len(set(batch)) != len(batch):
            raise CuvilError(f"{where}: batch: {list(batch)} names a batch size twice")
        if not input_shapes:
            raise CuvilError(f"{where}: batch: {list(batch)} needs the input shapes (inputs:) whose dim 0 it sets",
                             hint="give every input's shape; its dim 0 is replaced by each batch size")
        for name, shape in input_shapes.items():
            if not isinstance(shape, (list, tuple)) or not shape:
                raise CuvilError(f"{where}: input '{name}': batch buckets need a shape with a batch dim (dim 0), "
                                 f"got {shape!r}")
        largest = max(batch)
        return {name: [largest, *list(shape)[1:]] for name, shape in input_shapes.items()}, sorted(batch)
    if not listed:
        return input_shapes, None
    single = sorted(set(input_shapes) - set(listed))
    if single:
        raise CuvilError(f"{where}: inputs {sorted(listed)} list one shape per batch bucket but {single} one shape",
                         hint="every input takes the batch in dim 0: list a shape per bucket for each input, or "
                              "give one shape each and `batch: [..]`")
    counts = {len(v) for v in listed.values()}
    if len(counts) != 1:
        raise CuvilError(f"{where}: the inputs list different numbers of bucket shapes "
                         f"({ {k: len(v) for k, v in sorted(listed.items())} })")
    batches = None
    for name, shapes in sorted(listed.items()):
        firsts = [list(s)[0] if s else None for s in shapes]
        rest = {tuple(list(s)[1:]) for s in shapes}
        if any(not s for s in shapes) or len(rest) != 1:
            raise CuvilError(f"{where}: input '{name}': the bucket shapes {[list(s) for s in shapes]} may differ in "
                             f"dim 0 (the batch) only")
        if batches is None:
            batches = firsts
        elif firsts != batches:
            raise CuvilError(f"{where}: input '{name}': the bucket shapes' batches {firsts} differ from the other "
                             f"inputs' {batches}", hint="bucket k's shapes must agree in dim 0 for every input")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise CuvilError(f"{where}: the bucket batches {batches} must be positive integers")
    if len(set(batches)) != len(batches):
        raise CuvilError(f"{where}: the bucket shapes name the batch size {sorted(batches)} twice")
    largest = batches.index(max(batches))
    return {name: list(shapes[largest]) for name, shapes in listed.items()}, sorted(batches)


def check_entries(graphs: list, batches, name: str) -> None:
    """Every entry's inputs and outputs carry the batch in dim 0 and agree on the other dims: a
    CuvilError naming the tensor that does not (the padding and slicing read dim 0 as the batch)."""
    first = graphs[0]
    for graph, batch in zip(graphs, batches):
        for kind, names in (("input", graph.inputs), ("output", graph.outputs)):
            for tensor in names:
                shape = tuple(graph.values[tensor].shape)
                like = tuple(first.values[tensor].shape) if tensor in first.values else None
                if not shape or shape[0] != batch or like is None or shape[1:] != like[1:]:
                    raise CuvilError(f"model '{name}': {kind} '{tensor}' has shape {list(shape)} in the entry for "
                                     f"batch {batch}: batch buckets need every input and output to have the batch "
                                     f"in dim 0 and the same other dims in every bucket",
                                     hint="build this model without batch buckets, or export it with the batch as "
                                          "the first dim of every input and output")
