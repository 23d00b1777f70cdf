"""ai.onnx.ml ops (backends/numba_cpu/ml.py) against onnxruntime, and the ai.onnx.preview.training
optimiser steps (training.py) against onnx's reference evaluator (onnxruntime's inference build
does not implement them: "ai.onnx.preview.training:Adagrad(-1) is not a registered function/op").
The models import only their own domain (no default ONNX domain), which the importer accepts."""
import numpy as np
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import cuvil
from tests.helpers import run_ort

ML, TRAINING = "ai.onnx.ml", "ai.onnx.preview.training"


def _model(node, inputs, outputs, domain, version):
    vi = lambda name, dtype, shape: helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)
    graph = helper.make_graph([node], "g", [vi(*i) for i in inputs], [vi(*o) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, version)])
    model.ir_version = 10
    return model


def test_binarizer_vs_onnxruntime():
    x = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    model = _model(helper.make_node("Binarizer", ["x"], ["y"], domain=ML, threshold=0.25),
                   [("x", np.float32, [4, 50])], [("y", np.float32, [4, 50])], ML, 1)
    np.testing.assert_array_equal(cuvil.compile(model).run({"x": x})["y"], run_ort(model, {"x": x})["y"])


@pytest.mark.parametrize("shape", [[3, 7], [2, 3, 5], [6]])
def test_array_feature_extractor_vs_onnxruntime(shape):
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    idx = np.array([shape[-1] - 1, 0, 2], np.int64)
    out_shape = [1, 3] if len(shape) == 1 else shape[:-1] + [3]
    model = _model(helper.make_node("ArrayFeatureExtractor", ["x", "i"], ["y"], domain=ML),
                   [("x", np.float32, shape), ("i", np.int64, [3])], [("y", np.float32, out_shape)], ML, 1)
    got = cuvil.compile(model).run({"x": x, "i": idx})["y"]
    np.testing.assert_array_equal(got, run_ort(model, {"x": x, "i": idx})["y"])


def _random_forest(rng, n_trees, depth, n_features, n_targets, modes):
    """Full binary trees of the given depth, nodes numbered per ensemble; leaves numbered apart."""
    attrs = {k: [] for k in ("nodes_featureids", "nodes_modes", "nodes_splits", "nodes_truenodeids",
                             "nodes_trueleafs", "nodes_falsenodeids", "nodes_falseleafs",
                             "nodes_missing_value_tracks_true", "leaf_targetids", "leaf_weights", "tree_roots")}
    members = []
    for _ in range(n_trees):
        base = len(attrs["nodes_modes"])
        attrs["tree_roots"].append(base)
        inner = 2 ** depth - 1
        for i in range(inner):
            mode = int(rng.choice(modes))
            attrs["nodes_featureids"].append(int(rng.integers(n_features)))
            attrs["nodes_modes"].append(mode)
            attrs["nodes_splits"].append(float(rng.integers(-2, 3)))
            attrs["nodes_missing_value_tracks_true"].append(int(rng.integers(2)))
            if mode == 6:
                # onnxruntime takes integer members only, and drops negative ones (a bit set)
                members += [float(v) for v in rng.choice(np.arange(0, 4), 3, replace=False)] + [np.nan]
            for side, child in (("true", 2 * i + 1), ("false", 2 * i + 2)):
                if child < inner:
                    attrs[f"nodes_{side}nodeids"].append(base + child)
                    attrs[f"nodes_{side}leafs"].append(0)
                else:
                    attrs[f"nodes_{side}nodeids"].append(len(attrs["leaf_weights"]))
                    attrs[f"nodes_{side}leafs"].append(1)
                    attrs["leaf_targetids"].append(int(rng.integers(n_targets)))
                    attrs["leaf_weights"].append(float(rng.normal()))
    return attrs, members


@pytest.mark.parametrize("aggregate,post", [(1, 0), (0, 0), (0, 2), (1, 1), (3, 0), (2, 0), (1, 3)])
def test_tree_ensemble_vs_onnxruntime(aggregate, post):
    rng = np.random.default_rng(aggregate * 10 + post)
    n_features, n_targets = 5, 3
    attrs, members = _random_forest(rng, n_trees=8, depth=4, n_features=n_features, n_targets=n_targets,
                                    modes=[0, 1, 2, 3, 4, 5, 6])
    # integers (the splits' and members' grid, so EQ / NEQ / MEMBER nodes go both ways), halves
    # between them, and a few NaNs (missing values)
    x = (rng.integers(-6, 7, size=(64, n_features)) / 2).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = np.nan
    node = helper.make_node(
        "TreeEnsemble", ["x"], ["y"], domain=ML, n_targets=n_targets, aggregate_function=aggregate,
        post_transform=post, tree_roots=attrs["tree_roots"], nodes_featureids=attrs["nodes_featureids"],
        nodes_modes=numpy_helper.from_array(np.array(attrs["nodes_modes"], np.uint8), "nodes_modes"),
        nodes_splits=numpy_helper.from_array(np.array(attrs["nodes_splits"], np.float32), "nodes_splits"),
        nodes_truenodeids=attrs["nodes_truenodeids"], nodes_trueleafs=attrs["nodes_trueleafs"],
        nodes_falsenodeids=attrs["nodes_falsenodeids"], nodes_falseleafs=attrs["nodes_falseleafs"],
        nodes_missing_value_tracks_true=attrs["nodes_missing_value_tracks_true"],
        membership_values=numpy_helper.from_array(np.array(members, np.float32), "membership_values"),
        leaf_targetids=attrs["leaf_targetids"],
        leaf_weights=numpy_helper.from_array(np.array(attrs["leaf_weights"], np.float32), "leaf_weights"))
    model = _model(node, [("x", np.float32, [64, n_features])], [("y", np.float32, [64, n_targets])], ML, 5)
    got = cuvil.compile(model).run({"x": x})["y"]
    # onnxruntime 1.32 reads post_transform 1 as LOGISTIC and 2 as SOFTMAX (its own enum's order);
    # the operator's definition, which cuvil follows, says 1 SOFTMAX, 2 LOGISTIC: the oracle runs
    # with the two swapped
    for attr in model.graph.node[0].attribute:
        if attr.name == "post_transform":
            attr.i = {1: 2, 2: 1}.get(attr.i, attr.i)
    want = run_ort(model, {"x": x})["y"]
    # float32 sums of 8 leaf weights in another order: a few float32 ulps
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _training_case(op, attrs, n_tensors, states, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [[3, 4], [5]][:n_tensors]
    names = ["X", "G"] + (["V", "H"] if states == 2 else ["S"])
    ins = ["R", "T"] + [f"{k}{i}" for k in names for i in range(n_tensors)]
    outs = [f"{k}{i}_new" for k in ["X"] + names[2:] for i in range(n_tensors)]
    shape_of = lambda name: shapes[int(name.rstrip("_new")[-1])]
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(3, np.int64)}
    for name in ins[2:]:
        data = rng.normal(size=shape_of(name)).astype(np.float32)
        feeds[name] = np.abs(data) if name[0] in "HS" and op != "Momentum" else data
    inputs = [("R", np.float32, []), ("T", np.int64, [])] + [(n, np.float32, shape_of(n)) for n in ins[2:]]
    model = _model(helper.make_node(op, ins, outs, domain=TRAINING, **attrs), inputs,
                   [(n, np.float32, shape_of(n)) for n in outs], TRAINING, 1)
    return model, feeds


@pytest.mark.parametrize("op,attrs,states", [
    ("Adagrad", dict(decay_factor=0.1, epsilon=1e-5, norm_coefficient=0.001), 1),
    ("Momentum", dict(alpha=0.95, beta=0.1, mode="standard", norm_coefficient=0.001), 1),
    ("Momentum", dict(alpha=0.95, beta=1.0, mode="nesterov", norm_coefficient=0.01), 1),
    ("Adam", dict(alpha=0.95, beta=0.85, epsilon=1e-2, norm_coefficient=0.001, norm_coefficient_post=0.01), 2),
])
@pytest.mark.parametrize("n_tensors", [1, 2])
def test_optimiser_steps_vs_reference(op, attrs, states, n_tensors):
    model, feeds = _training_case(op, attrs, n_tensors, states)
    got = cuvil.compile(model).run(feeds)
    want = dict(zip([o.name for o in model.graph.output], ReferenceEvaluator(model).run(None, feeds)))
    for name, value in want.items():
        # the reference mixes float32 arrays and float64 scalars; cuvil computes in float64 and
        # rounds once: a few float32 ulps apart
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
