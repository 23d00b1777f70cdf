"""assign_precision: the weight products of a reduced-precision variant are marked; nothing else is.
(What a marked product computes is tested against onnxruntime in tests/test_precision.py.)"""
import numpy as np
from onnx import helper

from cuvil.frontends.onnx import import_onnx
from cuvil.ir import verify
from passes.assign_precision import Options, assign_precision, describe
from tests.helpers import make_model, rand

F = np.float32


def _model():
    """A Gemm with constant weights, a MatMul of two run-time inputs, a Softmax."""
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="dense"),
             helper.make_node("MatMul", ["h", "z"], ["s"], name="scores"),
             helper.make_node("Softmax", ["s"], ["y"], name="softmax")]
    return make_model(nodes, [("x", F, [2, 8]), ("z", F, [4, 3])], [("y", F, None)],
                      {"w": rand(8, 4, seed=1), "b": rand(4, seed=2)})


def _marks(graph):
    return {n.name: n.attr("precision") for n in graph.nodes}


def test_marks_the_products_with_constant_weights():
    before, _ = import_onnx(_model())
    after = assign_precision(before, Options(precision="bf16"))
    verify(after)
    assert _marks(after) == {"dense": "bf16", "scores": None, "softmax": None}
    assert _marks(before) == {"dense": None, "scores": None, "softmax": None}  # the pass is pure
    assert describe(before, after) == "1 weight products in bf16, 2 nodes in float32"


def test_must_not_fire_in_float32_or_on_what_is_kept():
    before, _ = import_onnx(_model())
    assert assign_precision(before, Options(precision="fp32")) is before
    assert assign_precision(before, Options(precision="fp16", keep_fp32=["dense"])) is before
    assert assign_precision(before, Options(precision="fp16", keep_fp32=["Gemm"])) is before


def _lstm(r_constant: bool):
    """An LSTM (hidden 4) whose R is a constant initializer or a run-time input."""
    H, I = 4, 3
    inits = {"w": rand(1, 4 * H, I, seed=3)}
    inputs = [("x", F, [2, 1, I])]
    if r_constant:
        inits["r"] = rand(1, 4 * H, H, seed=4)
    else:
        inputs.append(("r", F, [1, 4 * H, H]))
    nodes = [helper.make_node("LSTM", ["x", "w", "r"], ["y"], name="lstm", hidden_size=H)]
    return make_model(nodes, inputs, [("y", F, None)], inits)


def test_marks_an_lstm_with_a_constant_recurrence_and_not_one_without():
    before, _ = import_onnx(_lstm(True))
    after = assign_precision(before, Options(precision="bf16"))
    verify(after)
    assert _marks(after) == {"lstm": "bf16"}
    unmarked, _ = import_onnx(_lstm(False))
    assert assign_precision(unmarked, Options(precision="bf16")) is unmarked
    assert assign_precision(before, Options(precision="bf16", keep_fp32=["LSTM"])) is before
