"""Det (backends/numba_cpu/linalg.py) against onnxruntime.

Tolerance: Gaussian elimination with partial pivoting is backward stable; for these well-scaled
random matrices (n <= 6, entries ~N(0,1)) the relative error of the product of pivots is a few
n * u (u = 6e-8 in float32), and onnxruntime (Eigen's partial-pivot LU) rounds differently only in
the order of its updates: rtol 1e-4 leaves a wide margin over ~1e-6; atol 1e-5 for determinants near
zero (the singular case is exact: 0)."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import cuvil


@pytest.mark.parametrize("shape", [[3, 3], [2, 4, 4], [2, 3, 6, 6], [1, 1]])
def test_det(shape):
    elem = TensorProto.FLOAT  # onnxruntime's CPU provider has Det for float32 only
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"])], "det",
                              [helper.make_tensor_value_info("x", elem, shape)],
                              [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(dtype)
    if shape[-1] > 1:
        x.reshape(-1, shape[-1], shape[-1])[0, 1] = x.reshape(-1, shape[-1], shape[-1])[0, 0]  # one singular matrix
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = cuvil.compile(model).run({"x": x})["y"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
