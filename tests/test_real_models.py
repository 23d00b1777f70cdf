"""Regression tests for failures met with real exported models (issue 24), each rebuilt here
from the pattern that failed, then compared with onnxruntime:

- Paddle2ONNX writes a dynamic dim as `dim_value: -1`; a static shape given for it was rejected.
- transformers' BertModel gathers its `token_type_ids` buffer with GatherElements over an Expand
  whose shape comes from the `Where(Equal(shape, -1), ones, shape)` idiom; folding it at build
  time failed in onnx's reference GatherElements for axes of 64 elements or more.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil.errors import ShapeError
from cuvil.frontends.onnx import import_onnx
from tests.helpers import assert_matches_ort, rand

# fp32 outputs of a few ops: onnxruntime and cuvil round the same sums in another order.
TOL = 1e-5


def _paddle_style_model() -> onnx.ModelProto:
    """x: [-1, 3, -1, -1] (Paddle2ONNX's dynamic dims) -> Conv -> Relu -> Reshape(batch, -1)."""
    w = rand(4, 3, 3, 3, seed=1)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axis0"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["r", "target"], ["y"]),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    graph = helper.make_graph(nodes, "paddle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1, -1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, -1])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def test_paddle_style_minus_one_dims_are_dynamic():
    model = _paddle_style_model()
    for shape in ([1, 3, 8, 8], [2, 3, 5, 7]):
        x = rand(*shape, seed=2)
        _, got = assert_matches_ort(model, {"x": x}, tol=TOL, input_shapes={"x": shape})
        assert got["y"].shape == (shape[0], 4 * shape[2] * shape[3])


def test_paddle_style_minus_one_dims_need_a_shape():
    with pytest.raises(ShapeError, match=r"input 'x' has symbolic dims \['-1', '-1', '-1'\]"):
        cuvil.compile(_paddle_style_model())
    # a fixed dim of the model still has to match
    with pytest.raises(ShapeError, match="dim 1 is 3 in the model but 4 was given"):
        cuvil.compile(_paddle_style_model(), input_shapes={"x": [1, 4, 8, 8]})


def _bert_token_type_model(buffer_len: int, seq: int, runtime_indices: bool) -> onnx.ModelProto:
    """BertEmbeddings' token_type_ids as torch.onnx writes it: a [1, buffer_len] buffer expanded
    to a shape that Where(Equal(shape, -1), ones, shape) computes, gathered at positions
    0..seq-1 (GatherElements, axis 1), then embedded and added to the input.

    With `runtime_indices`, the positions are a model input, so GatherElements runs as a kernel
    instead of being folded at build time."""
    rng = np.random.default_rng(3)
    buffer = rng.integers(0, 2, (1, buffer_len)).astype(np.int64)
    table = rng.standard_normal((2, 8)).astype(np.float32)
    nodes = [
        # target = [batch, -1], written as the exporter writes a broadcast shape
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Slice", ["x_shape", "zero1", "one1"], ["batch"]),
        helper.make_node("Concat", ["batch", "minus_one"], ["target"], axis=0),
        helper.make_node("Shape", ["target"], ["target_rank"]),
        helper.make_node("ConstantOfShape", ["target_rank"], ["ones"],
                         value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("Mul", ["ones", "minus_one_scalar"], ["minus_ones"]),
        helper.make_node("Equal", ["target", "minus_ones"], ["is_minus_one"]),
        helper.make_node("Where", ["is_minus_one", "ones", "target"], ["expand_shape"]),
        helper.make_node("Expand", ["buffer", "expand_shape"], ["expanded"]),
        helper.make_node("GatherElements", ["expanded", "positions"], ["token_type_ids"], axis=1),
        helper.make_node("Gather", ["table", "token_type_ids"], ["embedded"], axis=0),
        helper.make_node("Add", ["x", "embedded"], ["y"]),
    ]
    inits = {"zero1": np.array([0], np.int64), "one1": np.array([1], np.int64),
             "minus_one": np.array([-1], np.int64), "minus_one_scalar": np.array(-1, np.int64),
             "buffer": buffer, "table": table}
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])]
    if runtime_indices:
        inputs.append(helper.make_tensor_value_info("positions", TensorProto.INT64, ["batch", "seq"]))
    else:
        # the exporter's constant: positions 0..seq-1 of the buffer
        inits["positions"] = np.arange(seq, dtype=np.int64)[None]
    graph = helper.make_graph(nodes, "bert_token_type", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("buffer_len, seq", [(64, 64), (512, 80)])
def test_bert_token_type_idiom_folds(buffer_len, seq):
    """All of it depends only on shapes, so it is folded at import; it failed for buffers of 64+."""
    model = _bert_token_type_model(buffer_len, seq, runtime_indices=False)
    x = rand(1, seq, 8, seed=4)
    assert_matches_ort(model, {"x": x}, tol=TOL, input_shapes={"x": [1, seq, 8]})
    graph, _ = import_onnx(model, {"x": [1, seq, 8]})
    assert [n.op for n in graph.nodes] == ["Add"]  # the embedding lookup is folded too


def test_bert_token_type_idiom_with_runtime_positions():
    """The same gather run by the GatherElements kernel, negative positions included."""
    model = _bert_token_type_model(512, 80, runtime_indices=True)
    x = rand(2, 80, 8, seed=5)
    positions = np.random.default_rng(6).integers(-512, 512, (2, 80)).astype(np.int64)
    assert_matches_ort(model, {"x": x, "positions": positions}, tol=TOL,
                       input_shapes={"x": [2, 80, 8], "positions": [2, 80]})


def test_gather_elements_out_of_range_at_build_time_names_the_node():
    model = _bert_token_type_model(64, 80, runtime_indices=False)  # positions go to 79 > 63
    with pytest.raises(cuvil.CuvilError, match=r"GatherElements.*index 64 is outside \[-64, 64\)"):
        cuvil.compile(model, input_shapes={"x": [1, 80, 8]})


def _tiny_bert():
    """transformers' BertModel from a small config with seeded random weights (nothing downloaded),
    wrapped so both exporters see (input_ids, attention_mask) -> (last hidden state, pooled)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=128)
    bert = transformers.BertModel(config).eval()

    class Bert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state, out.pooler_output

    return torch, Bert().eval()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_transformers_bert_builds_and_matches(dynamo):
    torch, module = _tiny_bert()
    if dynamo:
        pytest.importorskip("onnxscript")
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 100, (1, 16)).astype(np.int64)
    mask = np.ones((1, 16), np.int64)
    mask[0, 12:] = 0  # padding, so the attention mask matters
    args = (torch.from_numpy(ids), torch.from_numpy(mask))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            model = torch.onnx.export(module, args, dynamo=True, verbose=False,
                                      input_names=["input_ids", "attention_mask"]).model_proto
        else:
            buffer = io.BytesIO()
            torch.onnx.export(module, args, buffer, dynamo=False, opset_version=17,
                              input_names=["input_ids", "attention_mask"], output_names=["hidden", "pooled"])
            model = onnx.load_from_string(buffer.getvalue())
    names = [vi.name for vi in model.graph.input]
    feeds = {name: value for name, value in zip(["input_ids", "attention_mask"], [ids, mask]) if name in names}
    assert_matches_ort(model, feeds, tol=TOL)
