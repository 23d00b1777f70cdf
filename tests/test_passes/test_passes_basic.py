"""fold_constants, eliminate_identity, eliminate_common, eliminate_dead, fold_batchnorm."""
import numpy as np
from onnx import helper

from cuvil.ir import Graph, Node, Value
from passes.eliminate_common import eliminate_common
from passes.eliminate_dead import eliminate_dead
from passes.eliminate_identity import eliminate_identity
from passes.fold_batchnorm import fold_batchnorm
from passes.fold_constants import fold_constants
from tests.helpers import make_model, rand
from tests.test_passes.common import ops, run_pass

F = np.float32


def test_fold_constants_folds_what_passes_expose():
    # A CIR graph where a Transpose reads a constant (as after another pass).
    w = rand(3, 4)
    g = Graph("g", {"x": Value("x", np.dtype(F), (2, 4)), "w": Value("w", np.dtype(F), (3, 4), w),
                    "wt": Value("wt", np.dtype(F), (4, 3)), "y": Value("y", np.dtype(F), (2, 3))},
              [Node("Transpose", "t", ["w"], ["wt"], {"perm": [1, 0]}), Node("MatMul", "mm", ["x", "wt"], ["y"])],
              ["x"], ["y"])
    after = fold_constants(g)
    assert ops(after) == ["MatMul"]
    np.testing.assert_array_equal(after.values["wt"].data, w.T)


def test_fold_constants_must_not_fire_on_runtime_inputs():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [2, 3])], [("y", F, None)])
    before, after = run_pass(fold_constants, model, {"x": rand(2, 3)})
    assert after is before


def test_eliminate_identity():
    model = make_model([helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
                        helper.make_node("Relu", ["b"], ["c"]), helper.make_node("Transpose", ["c"], ["d"], perm=[0, 1]),
                        helper.make_node("Dropout", ["d"], ["e"]), helper.make_node("Sigmoid", ["e"], ["y"])],
                       [("x", F, [2, 3])], [("y", F, None)])
    before, after = run_pass(eliminate_identity, model, {"x": rand(2, 3)})
    assert ops(before) == ["Identity", "Relu", "Relu", "Transpose", "Dropout", "Sigmoid"]
    assert ops(after) == ["Relu", "Sigmoid"]


def test_eliminate_identity_must_not_fire():
    # A real transpose, a real reshape, and an Identity that writes a graph output all stay.
    model = make_model([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
                        helper.make_node("Reshape", ["t", "s"], ["r"]), helper.make_node("Identity", ["r"], ["y"])],
                       [("x", F, [2, 3])], [("y", F, None)], {"s": np.array([6], np.int64)})
    before, after = run_pass(eliminate_identity, model, {"x": rand(2, 3)})
    assert after is before


def test_eliminate_common():
    model = make_model([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["x"], ["b"]),
                        helper.make_node("Add", ["a", "b"], ["y"])], [("x", F, [2, 3])], [("y", F, None)])
    before, after = run_pass(eliminate_common, model, {"x": rand(2, 3)})
    assert ops(before) == ["Relu", "Relu", "Add"]
    assert ops(after) == ["Relu", "Add"]
    assert after.nodes[1].inputs == ["a", "a"]


def test_eliminate_common_must_not_fire_on_different_attributes():
    model = make_model([helper.make_node("LeakyRelu", ["x"], ["a"], alpha=0.1),
                        helper.make_node("LeakyRelu", ["x"], ["b"], alpha=0.2),
                        helper.make_node("Add", ["a", "b"], ["y"])], [("x", F, [2, 3])], [("y", F, None)])
    before, after = run_pass(eliminate_common, model, {"x": rand(2, 3)})
    assert after is before


def test_eliminate_dead():
    model = make_model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["unused"])],
                       [("x", F, [2, 3])], [("y", F, None)])
    before, after = run_pass(eliminate_dead, model, {"x": rand(2, 3)})
    assert ops(after) == ["Relu"] and "unused" not in after.values


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
