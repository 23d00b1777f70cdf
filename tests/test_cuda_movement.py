"""Transpose / Slice / Split / Concat / Gather GPU kernels (backends/numba_cuda/movement.py) in the
CUDA simulator against onnxruntime, and through ptxas for sm_90 (tests/test_cuda_zoo.py builds sm_80 too)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.cuda_check import assert_gpu_matches_ort
from tests.helpers import make_model

F = TensorProto.FLOAT


def x_of(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape, perm", [((2, 3, 4), (2, 0, 1)), ((1, 4, 6, 5), (0, 2, 1, 3)), ((3, 5), (1, 0)),
                                         ((2, 3, 2, 4), (3, 2, 1, 0))])
def test_transpose(shape, perm):
    out = [shape[p] for p in perm]
    model = make_model([helper.make_node("Transpose", ["x"], ["y"], perm=list(perm))], [("x", F, list(shape))],
                       [("y", F, out)])
    assert_gpu_matches_ort(model, {"x": x_of(shape)}, families=["Transpose"])


@pytest.mark.parametrize("starts, ends, axes, steps, out", [
    ([1, 0], [3, 5], [0, 2], [1, 2], [2, 4, 3]),
    ([-1], [-100], [1], [-1], [3, 4, 5]),
    ([0, 1, 1], [3, 4, 4], [0, 1, 2], [2, 2, 1], [2, 2, 3]),
])
def test_slice(starts, ends, axes, steps, out):
    inits = {n: np.array(v, np.int64) for v, n in ((starts, "s"), (ends, "e"), (axes, "a"), (steps, "t"))}
    model = make_model([helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"])], [("x", F, [3, 4, 5])],
                       [("y", F, out)], initializers=inits)
    assert_gpu_matches_ort(model, {"x": x_of((3, 4, 5))}, families=["Slice"])


def test_split_three_ways_on_the_middle_axis():
    split = {"split": np.array([1, 3, 2], np.int64)}
    model = make_model([helper.make_node("Split", ["x", "split"], ["a", "b", "c"], axis=1)], [("x", F, [2, 6, 5])],
                       [("a", F, [2, 1, 5]), ("b", F, [2, 3, 5]), ("c", F, [2, 2, 5])], initializers=split)
    assert_gpu_matches_ort(model, {"x": x_of((2, 6, 5))}, families=["Split"])


def test_concat_of_three_on_the_last_axis_and_on_the_first():
    nodes = [helper.make_node("Concat", ["x", "y", "z"], ["c"], axis=-1),
             helper.make_node("Concat", ["c", "c"], ["out"], axis=0)]
    model = make_model(nodes, [("x", F, [2, 3, 2]), ("y", F, [2, 3, 4]), ("z", F, [2, 3, 1])], [("out", F, [4, 3, 7])])
    feeds = {"x": x_of((2, 3, 2), 1), "y": x_of((2, 3, 4), 2), "z": x_of((2, 3, 1), 3)}
    assert_gpu_matches_ort(model, feeds, families=["Concat"])


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_with_negative_indices(axis):
    data = x_of((5, 4, 3))
    idx = np.array([[0, -1], [2, 3]], np.int64)
    out = [2, 2, 4, 3] if axis == 0 else [5, 2, 2, 3]
    model = make_model([helper.make_node("Gather", ["d", "i"], ["y"], axis=axis)],
                       [("d", F, [5, 4, 3]), ("i", TensorProto.INT64, [2, 2])], [("y", F, out)])
    assert_gpu_matches_ort(model, {"d": data, "i": idx}, families=["Gather"])


def test_gather_of_an_embedding_table_with_int64_rows():
    table = {"t": np.arange(40, dtype=np.int64).reshape(10, 4)}
    model = make_model([helper.make_node("Gather", ["t", "i"], ["y"], axis=0)], [("i", TensorProto.INT64, [1, 3])],
                       [("y", TensorProto.INT64, [1, 3, 4])], initializers=table)
    assert_gpu_matches_ort(model, {"i": np.array([[9, 0, 4]], np.int64)}, families=["Gather"], opt_level=0)


@pytest.mark.parametrize("op", ["Floor", "Ceil", "Round"])
def test_portable_rounding_of_doubles(op):
    """A float64 elementwise op stays on the portable path; numpy's rounding becomes libdevice's."""
    x = np.array([[-2.5, -1.5, -0.4, 0.5, 1.5, 2.5, 1e300, -3.7]], np.float64)
    model = make_model([helper.make_node(op, ["x"], ["y"])], [("x", TensorProto.DOUBLE, [1, 8])],
                       [("y", TensorProto.DOUBLE, [1, 8])])
    assert_gpu_matches_ort(model, {"x": x}, families=[op], opt_level=0)
