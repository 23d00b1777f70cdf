"""The diff hashes behind hot updates: semantic is blind to names and node order, not to weights or ops;
syntactic sees every byte. A model's key also follows its build settings, but not its `serve:` ones."""
import numpy as np
from onnx import helper

from cuvil.config import parse_config
from cuvil.frontends.onnx import import_onnx
from cuvil.serve.builder import graph_hash, model_key
from tests.helpers import make_model


def two_branches(weight=1.5, names=("r", "s", "w"), reverse=False, alpha=None):
    r, s, w = names
    nodes = [helper.make_node("Relu", ["x"], [r], name=f"node_{r}"),
             helper.make_node("Mul", ["x", w], [s], name=f"node_{s}"),
             helper.make_node("Add", [r, s], ["out"], name="sum")]
    if alpha is not None:
        nodes[0] = helper.make_node("LeakyRelu", ["x"], [r], alpha=alpha)
    if reverse:
        nodes[:2] = nodes[1::-1]
    return make_model(nodes, [("x", np.float32, [2, 3])], [("out", np.float32, [2, 3])],
                      {w: np.full((3,), weight, np.float32)})


def semantic(model):
    graph, _ = import_onnx(model)
    return graph_hash(graph)


def test_semantic_hash_ignores_internal_names_and_node_order():
    base = semantic(two_branches())
    assert semantic(two_branches(names=("a1", "b2", "weights"))) == base
    assert semantic(two_branches(reverse=True)) == base


def test_semantic_hash_sees_weights_ops_attributes_and_io_names():
    base = semantic(two_branches())
    assert semantic(two_branches(weight=1.25)) != base
    assert semantic(two_branches(alpha=0.1)) != semantic(two_branches(alpha=0.2))
    assert semantic(two_branches(alpha=0.1)) != base
    renamed_output = two_branches()
    renamed_output.graph.node[2].output[0] = "total"
    renamed_output.graph.output[0].name = "total"
    assert semantic(renamed_output) != base  # a client asks for outputs by name: that is part of the model


def _spec(tmp_path, model, extra=""):
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    text = f"version: 1\nmodels:\n  - name: m\n    source: m.onnx\n{extra}"
    return parse_config(text, tmp_path / "cuvil.yaml").models[0]


def test_model_keys_by_diff_mode_and_settings(tmp_path):
    config = _spec(tmp_path, two_branches())
    keys = {mode: model_key(config, mode) for mode in ("semantic", "syntactic")}
    _spec(tmp_path, two_branches(names=("a1", "b2", "weights"), reverse=True))  # a null edit
    assert model_key(config, "semantic") == keys["semantic"]
    assert model_key(config, "syntactic") != keys["syntactic"]
    _spec(tmp_path, two_branches())
    assert model_key(config, "syntactic") == keys["syntactic"]
    threads = _spec(tmp_path, two_branches(), "    threads: 2\n")
    assert model_key(threads, "semantic") != keys["semantic"]
    serve = _spec(tmp_path, two_branches(), "    serve: {priority: critical}\n")
    assert model_key(serve, "semantic") == keys["semantic"]
