"""Reductions, ArgMax/ArgMin, CumSum, TopK, LogSoftmax, Hardmax and the two
losses against onnxruntime (backends/numba_cpu/reduce.py)."""
import numpy as np
import pytest
from onnx import helper

from tests.helpers import assert_matches_ort, make_model, rand

F32 = np.float32


def one_node(op, inputs, attrs=None, opset=18, initializers=None, outputs=("y",), out_dtypes=None):
    """A model of one node reading `inputs` [(name, dtype, shape)] then the initializers."""
    node = helper.make_node(op, [n for n, _, _ in inputs] + list(initializers or {}), list(outputs), **(attrs or {}))
    out_dtypes = out_dtypes or [inputs[0][1]] * len(outputs)
    return make_model([node], inputs, [(o, t, None) for o, t in zip(outputs, out_dtypes)],
                      initializers=initializers, opset=opset)


# Reductions -----------------------------------------------------------------------------------

REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_ops_over_middle_axes(op):
    x = rand(2, 3, 4, 5, seed=1)
    if op in ("ReduceLogSum",):
        x = np.abs(x) + 0.1
    if op == "ReduceProd":
        x = 0.5 + np.abs(x) * 0.5
    model = one_node(op, [("x", F32, [2, 3, 4, 5])], {"keepdims": 1},
                     initializers={"axes": np.array([1, 2], np.int64)})
    assert_matches_ort(model, {"x": x}, tol=1e-5)


@pytest.mark.parametrize("axes,keepdims", [([-1], 0), ([0], 1), ([0, 3], 0), ([], 1), ([1, 2, 3], 0)])
def test_reduce_mean_axes_and_keepdims(axes, keepdims):
    inits = {"axes": np.array(axes, np.int64)} if axes else None
    model = one_node("ReduceMean", [("x", F32, [3, 4, 5, 6])], {"keepdims": keepdims}, initializers=inits)
    assert_matches_ort(model, {"x": rand(3, 4, 5, 6, seed=2)}, tol=1e-5)


def test_reduce_axes_attribute_before_opset_18():
    model = one_node("ReduceMax", [("x", F32, [3, 4, 5])], {"axes": [0, 2], "keepdims": 0}, opset=13)
    assert_matches_ort(model, {"x": rand(3, 4, 5, seed=3)})


def test_reduce_noop_with_empty_axes_copies():
    model = one_node("ReduceSum", [("x", F32, [3, 4])], {"noop_with_empty_axes": 1})
    assert_matches_ort(model, {"x": rand(3, 4, seed=4)})


@pytest.mark.parametrize("op,dtype", [("ReduceSum", np.int32), ("ReduceMax", np.int64), ("ReduceMin", np.int32),
                                      ("ReduceMean", np.float64), ("ReduceProd", np.int64)])
def test_reduce_dtypes(op, dtype):
    x = np.random.default_rng(5).integers(-9, 9, (4, 6)).astype(dtype)
    model = one_node(op, [("x", dtype, [4, 6])], {"keepdims": 0}, initializers={"axes": np.array([1], np.int64)})
    assert_matches_ort(model, {"x": x})


# ArgMax / ArgMin -----------------------------------------------------------------------------

@pytest.mark.parametrize("op,axis,keepdims,last", [("ArgMax", 1, 1, 0), ("ArgMax", -1, 0, 1), ("ArgMin", 0, 1, 0),
                                                  ("ArgMin", 2, 0, 1)])
def test_arg_extremes(op, axis, keepdims, last):
    # few distinct values, so ties (and select_last_index) matter
    x = np.random.default_rng(6).integers(0, 4, (3, 4, 5)).astype(F32)
    model = one_node(op, [("x", F32, [3, 4, 5])], {"axis": axis, "keepdims": keepdims, "select_last_index": last},
                     out_dtypes=[np.int64])
    assert_matches_ort(model, {"x": x})


# CumSum ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis,exclusive,reverse", [(0, 0, 0), (1, 1, 0), (-1, 0, 1), (1, 1, 1)])
def test_cumsum(axis, exclusive, reverse):
    model = one_node("CumSum", [("x", F32, [3, 4, 5])], {"exclusive": exclusive, "reverse": reverse},
                     initializers={"axis": np.array(axis, np.int64)}, opset=14)
    assert_matches_ort(model, {"x": rand(3, 4, 5, seed=7)})


def test_cumsum_int32():
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    model = one_node("CumSum", [("x", np.int32, [3, 4])], initializers={"axis": np.array(1, np.int32)}, opset=14)
    assert_matches_ort(model, {"x": x})


# TopK -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis,k,largest", [(-1, 3, 1), (1, 2, 0), (0, 1, 1)])
def test_topk(axis, k, largest):
    x = np.random.default_rng(8).integers(0, 6, (4, 5, 6)).astype(F32)  # ties: lower index first
    model = one_node("TopK", [("x", F32, [4, 5, 6])], {"axis": axis, "largest": largest},
                     initializers={"k": np.array([k], np.int64)}, outputs=("values", "indices"),
                     out_dtypes=[F32, np.int64], opset=11)
    assert_matches_ort(model, {"x": x})


# LogSoftmax, Hardmax -----------------------------------------------------------------------------

@pytest.mark.parametrize("op,axis,opset", [("LogSoftmax", -1, 13), ("LogSoftmax", 1, 13), ("LogSoftmax", 1, 11),
                                           ("Hardmax", -1, 13), ("Hardmax", 0, 13)])
def test_log_softmax_and_hardmax(op, axis, opset):
    model = one_node(op, [("x", F32, [3, 4, 5])], {"axis": axis}, opset=opset)
    assert_matches_ort(model, {"x": rand(3, 4, 5, seed=9) * 5})


# Losses ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("reduction,weighted,ignore", [("mean", False, None), ("sum", True, None),
                                                       ("none", False, 1), ("mean", True, 2)])
def test_losses(op, reduction, weighted, ignore):
    x = rand(3, 5, 2, seed=10)
    target = np.random.default_rng(11).integers(0, 5, (3, 2)).astype(np.int64)
    attrs = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
        target[0, 0] = ignore
    inputs = [("x", F32, [3, 5, 2]), ("t", np.int64, [3, 2])]
    inits = {"w": rand(5, seed=12) ** 2} if weighted else None
    model = one_node(op, inputs, attrs, opset=13, initializers=inits, out_dtypes=[F32])
    assert_matches_ort(model, {"x": x, "t": target}, tol=1e-5)


# LRN ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [3, 5])  # onnxruntime takes odd sizes only
def test_lrn(size):
    model = one_node("LRN", [("x", F32, [2, 6, 3, 4])], {"size": size, "alpha": 2e-3, "beta": 0.6, "bias": 1.5},
                     opset=13)
    assert_matches_ort(model, {"x": rand(2, 6, 3, 4, seed=13)}, tol=1e-5)


# DFT ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("channels,inverse,onesided", [(2, 0, 0), (1, 0, 1), (2, 1, 0)])
def test_dft(channels, inverse, onesided):
    model = one_node("DFT", [("x", F32, [2, 8, 3, channels])], {"axis": 1, "inverse": inverse, "onesided": onesided},
                     opset=17)
    assert_matches_ort(model, {"x": rand(2, 8, 3, channels, seed=14)}, tol=1e-5)


# LpPool (pool.py) -------------------------------------------------------------------------------

@pytest.mark.parametrize("p,attrs", [(2, {}), (3, {"strides": [2, 1], "pads": [1, 0, 1, 1]})])
def test_lp_pool(p, attrs):
    model = one_node("LpPool", [("x", F32, [1, 2, 5, 6])], {"kernel_shape": [2, 3], "p": p, **attrs}, opset=18)
    assert_matches_ort(model, {"x": rand(1, 2, 5, 6, seed=15)}, tol=1e-5)
