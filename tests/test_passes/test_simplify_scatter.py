"""simplify_scatter: ScatterElements over Expand-ed row indices -> ScatterND (Before / Expected,
must-not-fire cases, onnxruntime before and after the pass, bit for bit: a scatter only moves
or combines values, in the same order)."""
import numpy as np
import pytest
from onnx import helper

from passes import describe
from passes.simplify_scatter import simplify_scatter
from tests.helpers import assert_matches_ort, make_model, rand
from tests.test_passes.common import ops, run_pass

F32, I64 = np.float32, np.int64


def _expanded_scatter_model(reduction="max", axis=0, edges=40, expand_from=None, dtype=I64):
    nodes = [helper.make_node("Expand", ["dst", "shape"], ["index"]),
             helper.make_node("ScatterElements", ["x", "index", "msg"], ["y"], axis=axis, reduction=reduction)]
    return make_model(nodes, [("x", F32, [10, 6]), ("dst", dtype, list(expand_from or (edges, 1))),
                              ("msg", F32, [edges, 6])],
                      [("y", F32, None)], initializers={"shape": np.array([edges, 6], I64)}, opset=18)


def _dst(shape=(40, 1), dtype=I64):
    return np.random.default_rng(15).integers(0, 10, shape).astype(dtype)


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_simplify_scatter(reduction):
    # reduction "none": distinct rows (a repeated one's result is undefined)
    dst = np.random.default_rng(15).permutation(10)[:6].reshape(6, 1) if reduction == "none" else _dst()
    model = _expanded_scatter_model(reduction, edges=dst.shape[0])
    feeds = {"x": rand(10, 6, seed=16), "dst": dst, "msg": rand(dst.shape[0], 6, seed=17)}
    before, after = run_pass(simplify_scatter, model, feeds, tol=0.0)
    assert ops(before) == ["Expand", "ScatterElements"]
    assert ops(after) == ["Expand", "ScatterND"]  # the Expand is eliminate_dead's
    assert after.nodes[1].inputs[1] == "dst" and after.nodes[1].attrs.get("reduction", "none") == reduction
    assert describe("simplify_scatter", before, after) == "1 ScatterElements over expanded row indices -> ScatterND"
    compiled, _ = assert_matches_ort(model, feeds, tol=0.0)  # the whole pipeline
    assert compiled.info["steps"] == 1  # the ScatterND alone: the Expand is gone


def test_simplify_scatter_reshapes_rank_3_rows():
    nodes = [helper.make_node("Expand", ["dst", "shape"], ["index"]),
             helper.make_node("ScatterElements", ["x", "index", "msg"], ["y"], axis=0, reduction="add")]
    model = make_model(nodes, [("x", F32, [10, 3, 2]), ("dst", I64, [40, 1, 1]), ("msg", F32, [40, 3, 2])],
                       [("y", F32, None)], initializers={"shape": np.array([40, 3, 2], I64)}, opset=18)
    feeds = {"x": rand(10, 3, 2, seed=18), "dst": _dst((40, 1, 1)), "msg": rand(40, 3, 2, seed=19)}
    _, after = run_pass(simplify_scatter, model, feeds, tol=0.0)
    assert ops(after) == ["Expand", "Reshape", "ScatterND"]


@pytest.mark.parametrize("case", ["axis1", "int32", "partial_expand"])
def test_simplify_scatter_must_not_fire(case):
    if case == "axis1":  # indices along axis 1: not a row scatter
        nodes = [helper.make_node("Expand", ["dst", "shape"], ["index"]),
                 helper.make_node("ScatterElements", ["x", "index", "msg"], ["y"], axis=1, reduction="add")]
        model = make_model(nodes, [("x", F32, [10, 6]), ("dst", I64, [10, 1]), ("msg", F32, [10, 6])],
                           [("y", F32, None)], initializers={"shape": np.array([10, 6], I64)}, opset=18)
        feeds = {"x": rand(10, 6, seed=20), "dst": _dst((10, 1)) % 6, "msg": rand(10, 6, seed=21)}
    elif case == "int32":  # ScatterND takes int64 indices only
        model = _expanded_scatter_model(dtype=np.int32)
        feeds = {"x": rand(10, 6, seed=20), "dst": _dst(dtype=np.int32), "msg": rand(40, 6, seed=21)}
    else:  # the index varies along the row
        model = _expanded_scatter_model(expand_from=(40, 6))  # an Expand that expands nothing
        feeds = {"x": rand(10, 6, seed=20), "dst": _dst((40, 6)), "msg": rand(40, 6, seed=21)}
    before, after = run_pass(simplify_scatter, model, feeds, tol=0.0)
    assert after is before
