"""STFT (cuvil/frontends/onnx.py: frames by a constant Gather, the window, a DFT per frame) against
onnxruntime.

Tolerance: each bin is a sum of frame_length (16) products of samples (|x| <= 4 here) and twiddle
factors; float32 rounding of the sum and of the factors (~1e-7 each, cuvil's and onnxruntime's
factors may differ by an ulp) gives an absolute error of about 16 * 4 * 2e-7 ~ 1.3e-5: atol 1e-4
and rtol 1e-4 leave a wide margin."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import cuvil


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("onesided", [0, 1])
def test_stft(window, onesided):
    inputs = [helper.make_tensor_value_info("signal", TensorProto.FLOAT, [2, 64, 1])]
    inits = [helper.make_tensor("step", TensorProto.INT64, [], [6])]
    if window:
        inputs.append(helper.make_tensor_value_info("window", TensorProto.FLOAT, [16]))
        node = helper.make_node("STFT", ["signal", "step", "window"], ["y"], onesided=onesided)
    else:
        inits.append(helper.make_tensor("length", TensorProto.INT64, [], [16]))
        node = helper.make_node("STFT", ["signal", "step", "", "length"], ["y"], onesided=onesided)
    graph = helper.make_graph([node], "stft", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(5)
    feeds = {"signal": rng.uniform(-4, 4, (2, 64, 1)).astype(np.float32)}
    if window:
        feeds["window"] = np.hanning(16).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = cuvil.compile(model).run(feeds)["y"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
