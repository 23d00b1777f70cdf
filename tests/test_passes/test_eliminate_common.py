"""eliminate_common: identical nodes on identical inputs computed once."""
import numpy as np
from onnx import helper

from passes.eliminate_common import eliminate_common
from tests.helpers import make_model, rand
from tests.test_passes.common import ops, run_pass

F = np.float32


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
