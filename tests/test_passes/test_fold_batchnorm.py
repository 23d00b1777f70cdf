"""fold_batchnorm: BatchNormalization after Conv, ConvTranspose, Gemm or MatMul folded into its weights,
and a per-channel Mul/Add after InstanceNormalization folded into its scale and bias."""
import numpy as np
import pytest
from onnx import helper

from passes.fold_batchnorm import fold_batchnorm
from tests.helpers import assert_matches_ort, make_model, rand
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


# -- a per-channel affine after InstanceNormalization (torch's GroupNorm with one group per channel)

U = 2.0 ** -24


def norm_tol(plane: int) -> float:
    """InstanceNormalization sums `plane` elements for the mean and the variance, in another order
    than onnxruntime: their relative error is at most about plane * u, and the output (x - mean) /
    sqrt(var) carries it on (the variance's error halved by the square root); the fold itself
    rounds s * g and b * g + h once each (2 u). 4 * plane * u covers both, never below 1e-5."""
    return max(4 * plane * U, 1e-5)


def _instance_norm_affine(C, L, g_shape, h_shape=None, mul_first=True, batch=1, extra_reader=False):
    inits = {"s": rand(C, seed=1), "b": rand(C, seed=2)}
    nodes = [helper.make_node("InstanceNormalization", ["x", "s", "b"], ["n"], epsilon=1e-5)]
    last = "n"
    steps = [("Mul", "g", g_shape), ("Add", "h", h_shape)] if mul_first else [("Add", "h", h_shape), ("Mul", "g", g_shape)]
    for k, (op, name, shape) in enumerate(steps):
        if shape is None:
            continue
        inits[name] = rand(*shape, seed=3 + k) if shape else np.array(1.7, np.float32)
        nodes.append(helper.make_node(op, [last, name], [f"{name}_out"]))
        last = f"{name}_out"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    outputs = [("y", np.float32, None)]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["n"], ["z"]))
        outputs.append(("z", np.float32, None))
    model = make_model(nodes, [("x", np.float32, (batch, C, L))], outputs, inits)
    return model, {"x": rand(batch, C, L, seed=9) * np.float32(2) + np.float32(0.5)}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("C,L,g_shape,h_shape,batch", [
    (256, 1599, (256, 1), (256, 1), 1),    # wav2vec2's feature encoder, first layer
    (37, 101, (37, 1), (37, 1), 3),        # odd sizes, batch 3
    (19, 55, (1, 19, 1), None, 2),         # Mul only, a rank-3 constant
    (23, 64, None, (23, 1), 1),            # Add only
    (16, 33, (), (16, 1), 1),              # a scalar gamma
])
def test_instance_norm_affine_folds(C, L, g_shape, h_shape, batch, threads):
    model, feeds = _instance_norm_affine(C, L, g_shape, h_shape, batch=batch)
    before, after = run_pass(fold_batchnorm, model, feeds, tol=norm_tol(L))
    assert "InstanceNormalization" in ops(after) and "Mul" not in ops(after) and "Add" not in ops(after)
    assert_matches_ort(model, feeds, tol=norm_tol(L), threads=threads)


def test_instance_norm_add_then_mul_folds_the_add_only():
    # (IN + h) * g: the Add folds (it comes first), the Mul then reads the folded node's output;
    # folding continues only in the order Mul, Add.
    model, feeds = _instance_norm_affine(12, 40, (12, 1), (12, 1), mul_first=False)
    _, after = run_pass(fold_batchnorm, model, feeds, tol=norm_tol(40))
    assert ops(after) == ["InstanceNormalization", "Mul", "Identity"]


@pytest.mark.parametrize("g_shape", [(1, 1, 40), (12, 40), (2, 12, 1)])
def test_instance_norm_affine_must_not_fold_other_broadcasts(g_shape):
    # a per-position or per-sample factor is not a per-channel affine
    model, feeds = _instance_norm_affine(12, 40, g_shape, None, batch=2 if g_shape[0] == 2 else 1)
    before, after = run_pass(fold_batchnorm, model, feeds)
    assert ops(after) == ops(before)


def test_instance_norm_affine_must_not_fold_when_the_norm_has_another_reader():
    model, feeds = _instance_norm_affine(12, 40, (12, 1), (12, 1), extra_reader=True)
    before, after = run_pass(fold_batchnorm, model, feeds)
    assert ops(after) == ops(before)
