"""eliminate_identity: Identity, Dropout (inference) and no-op reshapes, transposes and repeated Relus removed."""
import numpy as np
from onnx import helper

from passes.eliminate_identity import eliminate_identity
from tests.helpers import make_model, rand
from tests.test_passes.common import ops, run_pass

F = np.float32


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
