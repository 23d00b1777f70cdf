"""fold_constants: nodes whose inputs are all constants become constants."""
import numpy as np
from onnx import helper

from cuvil.ir import Graph, Node, Value
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
