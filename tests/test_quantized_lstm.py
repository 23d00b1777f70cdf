"""onnxruntime's DynamicQuantizeLSTM (what `quantize_dynamic` writes for an LSTM) builds and runs
(cuvil/frontends/quantized_lstm.py): an ONNX LSTM with the file's weights dequantised, its
recurrence marked bf16.

Oracle: onnxruntime on the same quantised file. The engines compute the same weights; onnxruntime
rounds x and each step's h to uint8 (up to half a quantisation step each), cuvil rounds h and R to
bfloat16 for h . R^T (the bf16 recurrence of tests/test_precision_lstm.py). The bound propagates
both along the sequence (tests/test_precision_lstm.py's `_bounds` with `quantised_activations`).
A second check pins the weights: against onnxruntime's float LSTM with the weights dequantised here
by the formula of the op's definition, cuvil is within the bf16 recurrence's own bound.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil.errors import UnsupportedOpError
from cuvil.explain import explain_model
from tests.test_precision_lstm import _bounds, _lstm_model

quantization = pytest.importorskip("onnxruntime.quantization")


def _quantised(model, tmp_path, per_channel):
    onnx.save(model, tmp_path / "float.onnx")
    quantization.quantize_dynamic(str(tmp_path / "float.onnx"), str(tmp_path / "q.onnx"), per_channel=per_channel,
                                  weight_type=quantization.QuantType.QInt8)
    q = onnx.load(tmp_path / "q.onnx")
    assert [n.op_type for n in q.graph.node] == ["DynamicQuantizeLSTM"]
    return q


def _dequantised_weights(q):
    """W and R in the ONNX LSTM's layout, by the op's definition: (code - zero) * scale, transposed."""
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    node = q.graph.node[0]
    out = []
    for codes, scale, zero in ((1, 8, 9), (2, 10, 11)):
        c = inits[node.input[codes]].astype(np.float64)
        s = inits[node.input[scale]].reshape(c.shape[0], 1, -1)
        z = inits[node.input[zero]].reshape(c.shape[0], 1, -1)
        out.append(((c - z) * s).transpose(0, 2, 1).astype(np.float32))
    return out


def _run_ort(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(("y", "y_h", "y_c"), session.run(None, {"x": x})))


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("threads, target", [(1, "native"), (2, "native"), (1, "x86_64-avx2")])
def test_a_dynamically_quantised_lstm_matches_onnxruntime_within_the_derived_bound(tmp_path, per_channel, threads,
                                                                                   target):
    T, B, I, H = 12, 2, 24, 128
    model, _, _, b = _lstm_model(T, B, I, H)
    q = _quantised(model, tmp_path, per_channel)
    x = np.random.default_rng(1).standard_normal((T, B, I)).astype(np.float32)
    got = cuvil.compile(q, threads=threads, target=target).run({"x": x})
    w, r = (a[0] for a in _dequantised_weights(q))

    want = _run_ort(q, x)
    e_h, e_c = _bounds(x, w, r, b, "bf16", quantised_activations=True)
    for name, bound in (("y", e_h), ("y_h", e_h[-1]), ("y_c", e_c)):
        error = np.abs(got[name].astype(np.float64) - want[name])
        assert np.all(error <= bound), (name, float(np.max(error - bound)))

    # the weights: onnxruntime's float LSTM on the weights dequantised by the definition
    dequantised = onnx.ModelProto()
    dequantised.CopyFrom(model)
    for init in dequantised.graph.initializer:
        if init.name in ("w", "r"):
            init.CopyFrom(numpy_helper.from_array(w[None] if init.name == "w" else r[None], init.name))
    want = _run_ort(dequantised, x)
    e_h, e_c = _bounds(x, w, r, b, "bf16")
    for name, bound in (("y", e_h), ("y_h", e_h[-1]), ("y_c", e_c)):
        error = np.abs(got[name].astype(np.float64) - want[name])
        assert np.all(error <= bound), (name, float(np.max(error - bound)))

    labels = [k.precision for k in explain_model(q, threads=threads, target=target).kernels]
    assert any(label.startswith("bf16 (") for label in labels), labels


def _dq_lstm(w_const=True):
    H, I = 8, 4
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-127, 128, (1, H, 4 * H)).astype(np.int8), "r"),
             numpy_helper.from_array(np.array([0.01], np.float32), "ws"),
             numpy_helper.from_array(np.array([0], np.int8), "wz"),
             numpy_helper.from_array(np.array([0.01], np.float32), "rs"),
             numpy_helper.from_array(np.array([0], np.int8), "rz")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 1, I])]
    if w_const:
        inits.append(numpy_helper.from_array(rng.integers(-127, 128, (1, I, 4 * H)).astype(np.int8), "w"))
    else:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.INT8, [1, I, 4 * H]))
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "w", "r", "", "", "", "", "", "ws", "wz", "rs", "rz"],
                            ["y"], name="lstm_quant", domain="com.microsoft", hidden_size=H)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_a_dynamically_quantised_lstm_with_run_time_weights_is_refused_naming_the_node():
    with pytest.raises(UnsupportedOpError, match=r"lstm_quant.*DynamicQuantizeLSTM.*W must be a constant"):
        cuvil.compile(_dq_lstm(w_const=False))


def test_a_contrib_op_cuvil_does_not_know_is_named_with_its_domain():
    node = helper.make_node("FancyGelu", ["x"], ["y"], name="gelu0", domain="com.microsoft")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(UnsupportedOpError, match=r"gelu0.*FancyGelu of domain 'com.microsoft' is not supported"):
        cuvil.compile(model)
