"""Ops without a kernel whose ONNX schema defines a function body compile from
that body (cuvil/frontends/expand.py); ops with a kernel keep their kernel."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import cuvil
from cuvil.pipeline import has_kernel
from cuvil.errors import UnsupportedOpError
from cuvil.frontends import expand
from cuvil.frontends.expand import expand_functions

from .helpers import assert_matches_ort, make_model, rand


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _matches_ort_or_reference(model, feeds, tol=1e-4):
    """onnxruntime is the oracle; where it lacks the op, ONNX's reference evaluator is."""
    try:
        import onnxruntime as ort
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:
        from onnx.reference import ReferenceEvaluator
        want = ReferenceEvaluator(model).run(None, feeds)
        got = cuvil.compile(model).run(feeds)
        for out, ref in zip(got.values(), want):
            np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
        return
    assert_matches_ort(model, feeds, tol=tol)


# -- expansion itself -----------------------------------------------------------------------------

def test_rms_normalization_is_replaced_by_its_body():
    model = make_model([helper.make_node("RMSNormalization", ["x", "s"], ["y"], axis=-1)],
                       [("x", np.float32, [2, 3, 8]), ("s", np.float32, [8])], [("y", np.float32, [2, 3, 8])], opset=23)
    expanded = expand_functions(model, has_kernel)
    assert "RMSNormalization" not in _ops(expanded)
    assert {"ReduceMean", "Sqrt", "Div"} <= set(_ops(expanded))
    assert _ops(model) == ["RMSNormalization"]  # the input model is not changed


def test_ops_with_a_kernel_are_not_expanded():
    nodes = [helper.make_node("LayerNormalization", ["x", "s"], ["n"], axis=-1),
             helper.make_node("Gelu", ["n"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [2, 8]), ("s", np.float32, [8])], [("y", np.float32, [2, 8])], opset=20)
    assert expand_functions(model, has_kernel) is model
    # the same model with no kernels at all is expanded (the check is has_kernel's, not the op's)
    assert "LayerNormalization" not in _ops(expand_functions(model, lambda domain, op: False))


def test_default_attributes_of_the_schema_reach_the_body():
    # HannWindow's body reads `periodic` and `output_datatype`, which the node leaves at their defaults.
    model = make_model([helper.make_node("HannWindow", ["n"], ["y"])], [("n", np.int64, [])],
                       [("y", np.float32, None)], opset=17)
    expanded = expand_functions(model, has_kernel)
    from onnx.reference import ReferenceEvaluator
    n = np.array(10, np.int64)
    np.testing.assert_allclose(ReferenceEvaluator(expanded).run(None, {"n": n})[0],
                               ReferenceEvaluator(model).run(None, {"n": n})[0], atol=1e-6)


def test_a_failing_inliner_leaves_the_op_to_the_importer(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("inliner failed")
    monkeypatch.setattr(expand.onnx.inliner, "inline_local_functions", broken)
    model = make_model([helper.make_node("RMSNormalization", ["x", "s"], ["y"], axis=-1)],
                       [("x", np.float32, [2, 8]), ("s", np.float32, [8])], [("y", np.float32, [2, 8])], opset=23)
    assert _ops(expand_functions(model, has_kernel)) == ["RMSNormalization"]
    with pytest.raises(UnsupportedOpError, match="RMSNormalization"):
        cuvil.compile(model)


# -- numbers --------------------------------------------------------------------------------------

def test_rms_normalization_compiles():
    model = make_model([helper.make_node("RMSNormalization", ["x", "s"], ["y"], axis=-1, epsilon=1e-5)],
                       [("x", np.float32, [2, 3, 8]), ("s", np.float32, [8])], [("y", np.float32, [2, 3, 8])], opset=23)
    _matches_ort_or_reference(model, {"x": rand(2, 3, 8), "s": rand(8, seed=1)})


def test_group_normalization_compiles():
    model = make_model([helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2, epsilon=1e-5)],
                       [("x", np.float32, [2, 4, 3, 3]), ("s", np.float32, [4]), ("b", np.float32, [4])],
                       [("y", np.float32, [2, 4, 3, 3])], opset=21)
    _matches_ort_or_reference(model, {"x": rand(2, 4, 3, 3), "s": rand(4, seed=1), "b": rand(4, seed=2)})


@pytest.mark.parametrize("mask", [False, True])
def test_attention_compiles(mask):
    b, heads, q_len, kv_len, size = 2, 3, 4, 5, 8
    inputs = [("q", np.float32, [b, heads, q_len, size]), ("k", np.float32, [b, heads, kv_len, size]),
              ("v", np.float32, [b, heads, kv_len, size])]
    feeds = {"q": rand(b, heads, q_len, size), "k": rand(b, heads, kv_len, size, seed=1),
             "v": rand(b, heads, kv_len, size, seed=2)}
    if mask:
        inputs.append(("m", np.float32, [q_len, kv_len]))
        feeds["m"] = rand(q_len, kv_len, seed=3)
    node = helper.make_node("Attention", [name for name, _, _ in inputs], ["y"])
    model = make_model([node], inputs, [("y", np.float32, [b, heads, q_len, size])], opset=23)
    _matches_ort_or_reference(model, feeds)


def test_rotary_embedding_compiles():
    b, heads, seq, size, positions = 2, 2, 3, 8, 6
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"])
    model = make_model([node], [("x", np.float32, [b, heads, seq, size]), ("cos", np.float32, [positions, size // 2]),
                                ("sin", np.float32, [positions, size // 2]), ("pos", np.int64, [b, seq])],
                       [("y", np.float32, [b, heads, seq, size])], opset=23)
    angles = rand(positions, size // 2, seed=1)
    feeds = {"x": rand(b, heads, seq, size), "cos": np.cos(angles), "sin": np.sin(angles),
             "pos": np.array([[0, 1, 2], [3, 4, 5]], np.int64)}
    _matches_ort_or_reference(model, feeds)


def test_explain_sees_the_expanded_body():
    """`cuvil explain` / `cuvil check` import like the build does: an expandable op is no error there."""
    from cuvil.explain import explain_model, render
    model = make_model([helper.make_node("RMSNormalization", ["x", "s"], ["y"], axis=-1)],
                       [("x", np.float32, [2, 8]), ("s", np.float32, [8])], [("y", np.float32, [2, 8])], opset=23)
    text = render(explain_model(model))
    # The expanded body (8 nodes) reaches the passes; fuse_patterns makes its RMSNorm one kernel again.
    assert "RMSNormalization" not in text and "fold_qdq                  8 -> 8" in text
    assert "1 SimplifiedLayerNormalization from 5 nodes" in text
