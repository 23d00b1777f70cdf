"""Write examples/models/tiny_cnn.onnx: the small CNN that cuvil.yaml.example builds.

    input [N,3,32,32] -> Conv 3x3 (8) + Relu -> MaxPool 2 -> Conv 3x3 (16) + Relu
          -> GlobalAveragePool -> Flatten -> Gemm (10) -> Softmax -> probs [N,10]

The batch dimension is symbolic ("N"), so a build must give the input's static
shape (`inputs:` in cuvil.yaml). Weights come from a seeded numpy generator and
the file is written with onnx.helper only, so running this script again gives
the same bytes.

    python examples/make_example_model.py [OUTPUT]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # readable by every onnxruntime from 1.10 on
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "models" / "tiny_cnn.onnx"


def _he_normal(rng, shape, fan_in):
    """He-initialised weights keep activations in a sensible range through the Relus."""
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


def make_tiny_cnn(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    weights = {
        "conv1.weight": _he_normal(rng, (8, 3, 3, 3), 3 * 9),
        "conv1.bias": (rng.standard_normal(8) * 0.1).astype(np.float32),
        "conv2.weight": _he_normal(rng, (16, 8, 3, 3), 8 * 9),
        "conv2.bias": (rng.standard_normal(16) * 0.1).astype(np.float32),
        "fc.weight": _he_normal(rng, (10, 16), 16),
        "fc.bias": (rng.standard_normal(10) * 0.1).astype(np.float32),
    }
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    nodes = [
        helper.make_node("Conv", ["input", "conv1.weight", "conv1.bias"], ["conv1"], name="conv1", **conv),
        helper.make_node("Relu", ["conv1"], ["relu1"], name="relu1"),
        helper.make_node("MaxPool", ["relu1"], ["pool1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["pool1", "conv2.weight", "conv2.bias"], ["conv2"], name="conv2", **conv),
        helper.make_node("Relu", ["conv2"], ["relu2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["relu2"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny_cnn",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 32])],
        outputs=[helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10])],
        initializer=[numpy_helper.from_array(array, name) for name, array in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="cuvil-examples", ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    output = Path(argv[0]) if argv else DEFAULT_OUTPUT
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(make_tiny_cnn().SerializeToString(deterministic=True))
    print(f"wrote {output} ({output.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
