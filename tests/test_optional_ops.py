"""OptionalHasElement / OptionalGetElement on tensors (cuvil/frontends/onnx.py): every value cuvil
compiles is a tensor, so HasElement is a constant (its input given or omitted) and GetElement is the
tensor itself. Compared with onnxruntime (exact: bools and copied floats)."""
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import cuvil


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "optional", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def test_has_element_and_get_element_of_a_tensor():
    model = _model([helper.make_node("OptionalHasElement", ["x"], ["has"]),
                    helper.make_node("OptionalGetElement", ["x"], ["got"]),
                    helper.make_node("Neg", ["got"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("has", TensorProto.BOOL, []),
                    helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = cuvil.compile(model).run({"x": x})
    np.testing.assert_array_equal(got["has"], want[0])
    np.testing.assert_array_equal(got["y"], want[1])


def test_has_element_of_an_omitted_input_is_false():
    model = _model([helper.make_node("OptionalHasElement", [], ["has"]),
                    helper.make_node("Cast", ["has"], ["f"], to=TensorProto.FLOAT),
                    helper.make_node("Add", ["x", "f"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    x = np.ones(3, np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(cuvil.compile(model).run({"x": x})["y"], want[0])
