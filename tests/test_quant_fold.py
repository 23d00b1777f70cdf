"""QuantizeLinear / DequantizeLinear on constants fold at build time to exactly onnxruntime's
values (cuvil/evaluate.py), at the opsets quantisation tools write (13, 17: onnx's reference
evaluator has no implementation below 19) and later ones, per tensor and per axis."""
import numpy as np
import pytest
from onnx import helper

from cuvil.evaluate import evaluate_exact
from cuvil.frontends.onnx import import_onnx
from tests.helpers import make_model, run_ort

import cuvil

F32 = np.float32


def _ints(shape, dtype, seed):
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def _params(per_axis: bool, dtype, n: int, seed: int):
    rng = np.random.default_rng(seed)
    size = n if per_axis else 1
    scale = (rng.uniform(0.001, 0.1, size)).astype(F32)
    zero = np.zeros(size, dtype) if dtype == np.int32 else _ints((size,), dtype, seed + 1)
    return (scale, zero) if per_axis else (scale.reshape(()), zero.reshape(()))


CASES = [(dtype, per_axis, opset) for dtype in (np.int8, np.uint8, np.int32) for per_axis in (False, True)
         for opset in (13, 17, 21)]


@pytest.mark.parametrize("dtype,per_axis,opset", CASES)
def test_dequantize_linear_of_a_constant_is_onnxruntimes(dtype, per_axis, opset):
    q = _ints((4, 5, 3), dtype, seed=1) if dtype != np.int32 else \
        np.random.default_rng(1).integers(-2**20, 2**20, (4, 5, 3)).astype(np.int32)
    scale, zero = _params(per_axis, dtype, 5, seed=2)
    attrs = {"axis": 1} if per_axis else {}
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs)
    model = make_model([node], [], [("y", F32, None)], initializers={"q": q, "s": scale, "z": zero}, opset=opset)
    want = run_ort(model, {})["y"]
    got = evaluate_exact("DequantizeLinear", "", [q, scale, zero], attrs)[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype,per_axis,opset", [c for c in CASES if c[0] != np.int32])
def test_quantize_linear_of_a_constant_is_onnxruntimes(dtype, per_axis, opset):
    scale, zero = _params(per_axis, dtype, 5, seed=3)
    # values on and next to the .5 boundaries (ties round to even) and beyond the range
    x = ((np.arange(60).reshape(4, 5, 3) - 30) * 0.5 + np.random.default_rng(4).integers(0, 2, (4, 5, 3)) * 1e-3)
    x = (x * scale.reshape(1, -1, 1) * 9 if per_axis else x * scale * 9).astype(F32)
    attrs = {"axis": 1} if per_axis else {}
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], **attrs)
    model = make_model([node], [], [("y", dtype, None)], initializers={"x": x, "s": scale, "z": zero}, opset=opset)
    want = run_ort(model, {})["y"]
    got = evaluate_exact("QuantizeLinear", "", [x, scale, zero], attrs)[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_blocked_and_float16_forms_are_left_to_the_reference_evaluator():
    q = _ints((4, 6), np.int8, seed=1)
    assert evaluate_exact("DequantizeLinear", "", [q, np.ones((4, 3), F32), None], {"axis": 1, "block_size": 2}) is None
    assert evaluate_exact("DequantizeLinear", "", [q, np.ones((), np.float16), None], {}) is None


def test_quantised_weights_stay_quantised_through_the_frontend_and_fold_later():
    """The frontend keeps DequantizeLinear of a constant as a node (so a pass can read the
    integer weight); fold_constants folds it, and the built model equals onnxruntime's exactly."""
    w = _ints((6, 5), np.int8, seed=5)
    scale, zero = _params(True, np.int8, 5, seed=6)
    bias = np.random.default_rng(7).integers(-1000, 1000, 5).astype(np.int32)
    nodes = [helper.make_node("DequantizeLinear", ["w", "ws"], ["wf"], axis=1),
             helper.make_node("DequantizeLinear", ["b", "bs"], ["bf"]),
             helper.make_node("MatMul", ["x", "wf"], ["xw"]),
             helper.make_node("Add", ["xw", "bf"], ["y"])]
    x = np.eye(3, 6, dtype=F32)   # rows of the weight, exactly
    model = make_model(nodes, [("x", F32, [3, 6])], [("y", F32, None)],
                       initializers={"w": w, "ws": scale, "b": bias, "bs": np.float32(0.01)}, opset=17)
    graph, _ = import_onnx(model)
    assert [n.op for n in graph.nodes].count("DequantizeLinear") == 2
    got = cuvil.compile(model, opt_level=1).run({"x": x})["y"]
    # node by node: with its optimisations onnxruntime moves this weight's scale past the product
    np.testing.assert_array_equal(got, run_ort(model, {"x": x}, optimize=False)["y"])
