"""float16 through the float32 kernels (backends/numba_cpu/widen.py): MatMul, Gemm, Conv and Softmax
on float16 tensors against onnxruntime.

Tolerance: cuvil computes in float32 and rounds each output once to float16 (relative error at most
2^-11); onnxruntime's CPU kernels do the same or accumulate in float16 pieces, so the two results
differ by at most about one float16 ulp (2^-10 ~ 9.8e-4 relative) plus float32 summation-order
noise (~1e-6): rtol 2e-3 is two ulps; atol 2e-3 covers results near zero, whose ulp is absolute."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import cuvil

H = TensorProto.FLOAT16


def _model(node, inputs, output, inits=()):
    graph = helper.make_graph([node], "f16", [helper.make_tensor_value_info(n, H, s) for n, s in inputs],
                              [helper.make_tensor_value_info(output, H, None)], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _check(model, feeds):
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = next(iter(cuvil.compile(model).run(feeds).values()))
    assert got.dtype == np.float16 and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


def _rand(*shape, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 0.5).astype(np.float16)


def test_matmul_float16():
    _check(_model(helper.make_node("MatMul", ["a", "b"], ["y"]), [("a", [2, 8, 16]), ("b", [16, 12])], "y"),
           {"a": _rand(2, 8, 16), "b": _rand(16, 12, seed=1)})


def test_gemm_float16_with_constant_weights():
    w = helper.make_tensor("w", H, [12, 16], _rand(12, 16, seed=2).tobytes(), raw=True)
    _check(_model(helper.make_node("Gemm", ["a", "w"], ["y"], transB=1), [("a", [5, 16])], "y", [w]),
           {"a": _rand(5, 16)})


def test_conv_float16():
    _check(_model(helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
                  [("x", [1, 3, 8, 8]), ("w", [4, 3, 3, 3])], "y"),
           {"x": _rand(1, 3, 8, 8), "w": _rand(4, 3, 3, 3, seed=3)})


@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_float16(axis):
    _check(_model(helper.make_node("Softmax", ["x"], ["y"], axis=axis), [("x", [3, 5, 7])], "y"),
           {"x": _rand(3, 5, 7) * 4})
