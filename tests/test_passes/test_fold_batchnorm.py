"""fold_batchnorm: BatchNormalization after Conv, ConvTranspose, Gemm or MatMul folded into its weights."""
import numpy as np
from onnx import helper

from passes.fold_batchnorm import fold_batchnorm
from tests.helpers import make_model, rand
from tests.test_passes.common import ops, run_pass

F = np.float32


def _conv_bn(bn_params_const=True):
    c = 4
    inits = {"w": rand(c, 3, 3, 3, seed=1) * 0.3, "b": rand(c, seed=2), "gamma": 1 + 0.1 * rand(c, seed=3),
             "beta": rand(c, seed=4), "mean": rand(c, seed=5) * 0.1, "var": 1 + np.abs(rand(c, seed=6))}
    inputs = [("x", F, [1, 3, 8, 8])]
    if not bn_params_const:
        inputs.append(("gamma", F, [c]))
        inits.pop("gamma")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], epsilon=1e-3)]
    return make_model(nodes, inputs, [("y", F, None)], inits)


def test_fold_batchnorm():
    before, after = run_pass(fold_batchnorm, _conv_bn(), {"x": rand(1, 3, 8, 8)})
    assert ops(before) == ["Conv", "BatchNormalization"]
    assert ops(after) == ["Conv"] and after.nodes[0].outputs == ["y"]

def test_fold_batchnorm_must_not_fire_on_runtime_parameters():
    feeds = {"x": rand(1, 3, 8, 8), "gamma": 1 + rand(4, seed=9) * 0.1}
    before, after = run_pass(fold_batchnorm, _conv_bn(bn_params_const=False), feeds)
    assert after is before

def _conv_transpose_bn(group, bias):
    c_in, per_group = 6, 2
    c = group * per_group
    inits = {"w": rand(c_in, per_group, 2, 3, seed=1) * 0.3, "b": rand(c, seed=2), "gamma": 1 + 0.1 * rand(c, seed=3),
             "beta": rand(c, seed=4), "mean": rand(c, seed=5) * 0.1, "var": 1 + np.abs(rand(c, seed=6))}
    if not bias:
        inits.pop("b")
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"] if bias else ["x", "w"], ["c"], strides=[2, 3],
                              group=group),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], epsilon=1e-3)]
    return make_model(nodes, [("x", F, [2, c_in, 5, 4])], [("y", F, None)], inits)

def test_fold_batchnorm_into_conv_transpose():
    """W is [C_in, C_out/group, k...]: each output channel's scale lands on its column of its group's
    rows; onnxruntime runs the graph before and after (run_pass)."""
    for group, bias in ((1, True), (3, False)):
        before, after = run_pass(fold_batchnorm, _conv_transpose_bn(group, bias), {"x": rand(2, 6, 5, 4)})
        assert ops(before) == ["ConvTranspose", "BatchNormalization"]
        assert ops(after) == ["ConvTranspose"] and after.nodes[0].outputs == ["y"]

def _linear_bn(op):
    c = 5
    inits = {"w": rand(c, 6, seed=1) if op == "Gemm" else rand(6, c, seed=1), "b": rand(c, seed=2),
             "gamma": 1 + 0.1 * rand(c, seed=3), "beta": rand(c, seed=4), "mean": rand(c, seed=5) * 0.1,
             "var": 1 + np.abs(rand(c, seed=6))}
    first = helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1, beta=0.5) if op == "Gemm" \
        else helper.make_node("MatMul", ["x", "w"], ["h"])
    if op != "Gemm":
        inits.pop("b")
    nodes = [first, helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["y"])]
    return make_model(nodes, [("x", F, [3, 6])], [("y", F, None)], inits)

def test_fold_batchnorm_into_gemm_and_matmul():
    for op in ("Gemm", "MatMul"):
        before, after = run_pass(fold_batchnorm, _linear_bn(op), {"x": rand(3, 6)})
        assert ops(before) == [op, "BatchNormalization"]
        assert ops(after) == ["Gemm"] and after.nodes[0].outputs == ["y"] and after.nodes[0].attr("beta") == 1.0

def test_fold_batchnorm_must_not_fire_on_a_batched_matmul():
    c = 4
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["y"])]
    inits = {"w": rand(6, 6, seed=1), "gamma": np.ones(c, F), "beta": np.zeros(c, F), "mean": np.zeros(c, F),
             "var": np.ones(c, F)}
    model = make_model(nodes, [("x", F, [2, c, 6])], [("y", F, None)], inits)
    before, after = run_pass(fold_batchnorm, model, {"x": rand(2, c, 6)})
    assert after is before
