"""eliminate_dead: nodes and values nothing reads removed."""
import numpy as np
from onnx import helper

from passes.eliminate_dead import eliminate_dead
from tests.helpers import make_model, rand
from tests.test_passes.common import ops, run_pass

F = np.float32


def test_eliminate_dead():
    model = make_model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["unused"])],
                       [("x", F, [2, 3])], [("y", F, None)])
    before, after = run_pass(eliminate_dead, model, {"x": rand(2, 3)})
    assert ops(after) == ["Relu"] and "unused" not in after.values
