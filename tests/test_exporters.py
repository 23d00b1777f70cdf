"""Models as exporters write them: torch's dynamo-based exporter (opset 18+, its own
decompositions), the TorchScript-based exporter with modules as ONNX local functions,
an nn.MultiheadAttention / scaled_dot_product_attention model, and weights in
external data files. Every one is compared with onnxruntime (max abs error / max |ref|)."""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

from tests import zoo
from tests.helpers import assert_matches_ort

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")  # the dynamo exporter's ONNX builder (cuvil[torch] installs it)


def dynamo_export(module, *args) -> onnx.ModelProto:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module.eval(), args, dynamo=True, verbose=False)
    return program.model_proto


def feeds_for(model: onnx.ModelProto, *arrays) -> dict:
    return {vi.name: a for vi, a in zip(model.graph.input, arrays)}


def test_dynamo_exported_resnet_and_mobilenet():
    for module, shape in [(zoo.resnet((1, 1), width=8, num_classes=5), (1, 3, 32, 32)),
                          (zoo.mobilenet_v2(width_mult=0.25, num_classes=7), (1, 3, 32, 32))]:
        x = zoo.sample_input(shape)
        model = dynamo_export(module, torch.from_numpy(x))
        assert model.opset_import[0].version >= 18
        assert_matches_ort(model, feeds_for(model, x), tol=1e-3)


def test_dynamo_exported_gpt2_block_with_causal_mask():
    x = zoo.sample_input((1, 16, 64))
    model = dynamo_export(zoo.gpt2_block(), torch.from_numpy(x))
    assert_matches_ort(model, feeds_for(model, x), tol=1e-3)


class _SdpaBlock(torch.nn.Module):
    """nn.MultiheadAttention with a key padding mask, then scaled_dot_product_attention (causal)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        torch.manual_seed(3)
        self.mha = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.heads = heads

    def forward(self, x, pad):
        y, _ = self.mha(x, x, x, key_padding_mask=pad, need_weights=False)
        b, t, d = y.shape
        q = y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        z = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return z.transpose(1, 2).reshape(b, t, d)


def test_dynamo_exported_attention_with_masks():
    """(The TorchScript-based exporter cannot export nn.MultiheadAttention's inference fast path;
    tests/test_zoo.py covers its output for attention written with plain ops.)"""
    x = zoo.sample_input((1, 12, 32))
    pad = np.zeros((1, 12), dtype=bool)
    pad[0, 9:] = True
    model = dynamo_export(_SdpaBlock(), torch.from_numpy(x), torch.from_numpy(pad))
    assert_matches_ort(model, feeds_for(model, x, pad), tol=1e-3)


def test_torchscript_exporter_with_modules_as_local_functions():
    module = zoo.resnet((1, 1), width=8, num_classes=5).eval()
    x = zoo.sample_input((1, 3, 32, 32))
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(x),), buf, dynamo=False, opset_version=17, input_names=["x"],
                          export_modules_as_functions={torch.nn.BatchNorm2d, torch.nn.ReLU, torch.nn.Linear})
    model = onnx.load_model_from_string(buf.getvalue())
    assert len(model.functions) >= 2 and any(n.domain not in ("", "ai.onnx") for n in model.graph.node)
    assert_matches_ort(model, {"x": x}, tol=1e-3)


def test_large_weights_in_external_data(tmp_path):
    """A 16 MB weight saved beside the model (onnx's external data), loaded from the model's folder."""
    from onnx import helper, numpy_helper
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1024, 4096)).astype(np.float32) * np.float32(0.02)
    b = rng.standard_normal(4096).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 1024])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4096])],
                              initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = tmp_path / "big.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="big.weights", size_threshold=1024)
    assert path.stat().st_size < 10_000 and (tmp_path / "big.weights").stat().st_size >= w.nbytes
    import cuvil
    x = rng.standard_normal((2, 1024)).astype(np.float32)
    got = cuvil.compile(str(path)).run({"x": x})["y"]
    want = x.astype(np.float64) @ w.astype(np.float64) + b
    assert float(np.max(np.abs(got - want))) / float(np.max(np.abs(want))) <= 1e-4
    from tests.helpers import run_ort
    np.testing.assert_allclose(got, run_ort(onnx.load(str(path)), {"x": x})["y"], rtol=1e-4, atol=1e-4)
