"""The steps after the import are keyed by the imported graph's identity (cuvil/semantic.py): the
same model from two files -- renamed, reordered, re-documented, or the ONNX that tf2onnx makes of
a Keras model next to the Keras file itself -- builds byte-identical libraries, the second from the
first one's cache entries; a changed weight gives another library.

Numeric checks compare with onnxruntime (and TensorFlow for the Keras model): max |diff| / max|ref|
<= 1e-5, for fp32 products of at most 8 * 9 = 72 terms (sqrt(72) * 6e-8 ~ 5e-7, one decade of margin).
"""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import cuvil
from cuvil import ir_io, semantic
from cuvil.build import VariantSpec, build_variants
from cuvil.cache import Cache
from cuvil.pipeline import import_model
from tests.helpers import make_model, rand, run_ort

TOL = 1e-5
AFTER_IMPORT = ("graph", "pass", "codegen", "link", "kernel")


def two_branches(scale: float = 1.0):
    """y = relu(x @ w1) + sigmoid(x @ w2) @ w3: two branches, so the nodes have more than one order."""
    rng = np.random.default_rng(0)
    init = {"w1": rng.standard_normal((8, 16)), "w2": rng.standard_normal((8, 16)) * scale,
            "w3": rng.standard_normal((16, 16)) * 0.2}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"], name="left"),
             helper.make_node("Relu", ["a"], ["ra"], name="left_relu"),
             helper.make_node("MatMul", ["x", "w2"], ["b"], name="right"),
             helper.make_node("Sigmoid", ["b"], ["sb"], name="right_sigmoid"),
             helper.make_node("MatMul", ["sb", "w3"], ["c"], name="right_out"),
             helper.make_node("Add", ["ra", "c"], ["y"], name="sum")]
    return make_model(nodes, [("x", np.float32, [4, 8])], [("y", np.float32, [4, 16])],
                      {k: v.astype(np.float32) for k, v in init.items()})


def renamed(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph as another tool might write it: every internal value, initializer and node
    renamed, the nodes in another topological order (the last ready node first), initializers
    reversed, doc strings and producer changed."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    kept = {v.name for v in g.input} | {v.name for v in g.output}
    names = {}

    def new(name):
        if not name or name in kept:
            return name
        return names.setdefault(name, f"t{len(names)}_{name[::-1]}")
    remaining, order, defined = list(g.node), [], kept | {t.name for t in g.initializer}
    while remaining:   # Kahn's order, taking the last ready node each time
        ready = [n for n in remaining if all(not i or i in defined for i in n.input)]
        node = ready[-1]
        remaining.remove(node)
        order.append(node)
        defined |= set(node.output)
    nodes = []
    for k, node in enumerate(order):
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = f"node{k}"
        copy.doc_string = "written by hand"
        copy.input[:] = [new(i) for i in node.input]
        copy.output[:] = [new(o) for o in node.output]
        nodes.append(copy)
    inits = [numpy_helper.from_array(numpy_helper.to_array(t), new(t.name)) for t in reversed(g.initializer)]
    graph = helper.make_graph(nodes, "another_name", list(g.input), list(g.output), initializer=inits,
                              doc_string="another doc string")
    out = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="by-hand",
                            producer_version="9.9")
    out.ir_version = model.ir_version
    return out


def build(tmp_path, cache, source, folder, shapes, name="m"):
    spec = VariantSpec(name, source, shapes)
    (artifacts,), dag = build_variants([(spec, tmp_path / folder)], cache)
    statuses = {}
    for step in dag.report()["steps"]:
        statuses.setdefault(step["kind"], set()).add(step["status"])
    return artifacts, statuses


def test_canonical_graphs_of_a_renamed_reordered_model_are_equal():
    a = import_model(two_branches(), {})
    b = import_model(renamed(two_branches()), {})
    assert [n.name for n in a.nodes] != [n.name for n in b.nodes]
    assert semantic.identity(a) == semantic.identity(b)
    assert ir_io.dumps(semantic.canonical(a)) == ir_io.dumps(semantic.canonical(b))
    assert semantic.graph_hash(a) == semantic.graph_hash(b)     # the serve diff's hash: the same function
    changed = import_model(two_branches(scale=1.001), {})
    assert semantic.identity(changed) != semantic.identity(a)
    names = semantic.original_names(b)
    assert sorted(n for n in names.values() if n.startswith("node")) == [f"node{k}" for k in range(6)]


def test_same_graph_from_two_files_is_one_library_from_one_cache(tmp_path):
    cache = Cache(tmp_path / "cache")
    onnx.save(two_branches(), tmp_path / "a.onnx")
    onnx.save(renamed(two_branches()), tmp_path / "b.onnx")
    first, ran = build(tmp_path, cache, str(tmp_path / "a.onnx"), "a", {})
    assert ran["codegen"] == {"ran"}
    second, statuses = build(tmp_path, cache, str(tmp_path / "b.onnx"), "b", {})
    assert statuses["import"] == {"ran"}          # another file: imported...
    for kind in AFTER_IMPORT:                      # ...and everything after it read from the cache
        assert statuses.get(kind, {"cached"}) == {"cached"}, (kind, statuses)
    assert first.library.read_bytes() == second.library.read_bytes()
    assert first.info["source_sha256"] != second.info["source_sha256"]     # the manifests name their files
    x = rand(4, 8, seed=1)
    want = run_ort(two_branches(), {"x": x})["y"]
    got = cuvil.load(second.library).run({"x": x})["y"]
    assert np.max(np.abs(got - want)) <= TOL * np.max(np.abs(want))
    # one weight changed: another graph, another library
    onnx.save(two_branches(scale=1.001), tmp_path / "c.onnx")
    third, statuses = build(tmp_path, cache, str(tmp_path / "c.onnx"), "c", {})
    assert statuses["graph"] == {"ran"} and statuses["codegen"] == {"ran"}
    assert third.library.read_bytes() != first.library.read_bytes()


def test_a_clean_build_of_the_renamed_file_gives_the_same_bytes(tmp_path):
    onnx.save(two_branches(), tmp_path / "a.onnx")
    onnx.save(renamed(two_branches()), tmp_path / "b.onnx")
    first, _ = build(tmp_path, Cache(tmp_path / "cache1"), str(tmp_path / "a.onnx"), "a", {})
    second, statuses = build(tmp_path, Cache(tmp_path / "cache2"), str(tmp_path / "b.onnx"), "b", {})
    assert statuses["codegen"] == {"ran"}
    assert first.library.read_bytes() == second.library.read_bytes()


def test_errors_after_the_import_name_the_files_nodes():
    model = make_model([helper.make_node("GlobalLpPool", ["x"], ["y"], name="my_pool")],
                       [("x", np.float32, [2, 4, 4])], [("y", np.float32, [2, 4, 1])])
    with pytest.raises(cuvil.CuvilError, match="node 'my_pool'"):
        cuvil.compile(model)


def test_keras_file_and_its_onnx_export_give_one_library(tmp_path):
    from cuvil.frontends.tensorflow import triton_first, to_onnx_proto
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    triton_first()
    pytest.importorskip("tensorflow")
    pytest.importorskip("tf2onnx")
    import keras
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8, 8, 3), name="image"),
                              keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    model.save(tmp_path / "cnn.keras")
    shapes = {"image": [2, 8, 8, 3]}
    exported = to_onnx_proto(str(tmp_path / "cnn.keras"), shapes)
    onnx.save(exported, tmp_path / "cnn.onnx")
    onnx.save(renamed(exported), tmp_path / "by_hand.onnx")
    cache = Cache(tmp_path / "cache")
    keras_lib, _ = build(tmp_path, cache, str(tmp_path / "cnn.keras"), "k", shapes, name="cnn")
    for source, folder in (("cnn.onnx", "o"), ("by_hand.onnx", "h")):
        lib, statuses = build(tmp_path, cache, str(tmp_path / source), folder, shapes, name="cnn")
        for kind in AFTER_IMPORT:
            assert statuses.get(kind, {"cached"}) == {"cached"}, (source, kind, statuses)
        assert lib.library.read_bytes() == keras_lib.library.read_bytes(), source
    x = rand(2, 8, 8, 3, seed=2)
    want = model(x).numpy()
    got = cuvil.load(keras_lib.library).run({"image": x})
    got = next(iter(got.values()))
    assert np.max(np.abs(got - want)) <= TOL * max(np.max(np.abs(want)), 1.0)
    # a changed weight in the Keras file: another library
    kernel = model.layers[0].kernel
    kernel.assign(kernel * 1.01)
    model.save(tmp_path / "cnn2.keras")
    changed, statuses = build(tmp_path, cache, str(tmp_path / "cnn2.keras"), "k2", shapes, name="cnn")
    assert statuses["graph"] == {"ran"}
    assert changed.library.read_bytes() != keras_lib.library.read_bytes()


def test_a_pass_option_naming_nodes_keeps_the_files_names():
    # keep_fp32 names nodes as the file does: such a variant is keyed by its file and its passes
    # read the imported names, so the option still finds node 'left'
    from cuvil.explain import explain_model
    options = {"assign_precision": {"keep_fp32": ["left", "right", "right_out"]}}
    lib = cuvil.compile(two_branches(), precision="bf16", pass_options=options)
    assert "source_sha256" in lib.info and "graph_sha256" not in lib.info
    explained = explain_model(two_branches(), precision="bf16", pass_options=options)
    assert [p.summary for p in explained.passes if p.name == "assign_precision"] == ["no change"]
    x = rand(4, 8, seed=3)
    want = run_ort(two_branches(), {"x": x})["y"]
    assert np.max(np.abs(lib.run({"x": x})["y"] - want)) <= TOL * np.max(np.abs(want))   # all float32


def test_narrow_dtypes_that_share_a_numpy_str_have_other_identities():
    # ml_dtypes' int4 and uint4 (and the float8 variants) share dtype.str '|V1': the identity
    # names the dtype, or the cache would hand a uint4 library to an int4 model
    from onnx import TensorProto
    graphs = [import_model(make_model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
                                      [("x", elem, [4])], [("y", np.float32, [4])], opset=21), {})
              for elem in (TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2FNUZ)]
    assert len({semantic.identity(g) for g in graphs}) == 4
