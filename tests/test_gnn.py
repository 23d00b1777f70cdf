"""Graph neural network workloads: the gather / scatter ops message passing exports to, and
GraphSAGE and GAT from tests/zoo.py, each against onnxruntime.

Every scatter case has duplicate destinations (several updates of one element, applied in
index order), and the larger ones are built for 1 and 2 threads: the scatter kernels split
their work by destination rows (backends/numba_cpu/indexing.py), which must not change a bit.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper

import cuvil
from passes.simplify_scatter import simplify_scatter
from tests import zoo
from tests.helpers import assert_matches_ort, make_model, rand
from tests.test_passes.common import ops, run_pass

F32, I64 = np.float32, np.int64
# fp32 sums of a few terms in the same order as onnxruntime's: the same rounding, up to the
# last bit of a fused multiply-add in the layers around them.
TOL = 1e-5


def _scatter_model(op, data_shape, index_shape, update_shape, opset, **attrs):
    node = helper.make_node(op, ["x", "i", "u"], ["y"], **attrs)
    return make_model([node], [("x", F32, list(data_shape)), ("i", I64, list(index_shape)),
                               ("u", F32, list(update_shape))], [("y", F32, None)], opset=opset)


def _exact(model, feeds, **options):
    """A scatter moves or combines values in index order: cuvil's result is onnxruntime's, bit for bit."""
    compiled, got = assert_matches_ort(model, feeds, tol=0.0, **options)
    return got


# (reduction, opset): add and mul came in opset 16, max and min in 18.
REDUCTIONS = [("none", 16), ("add", 16), ("mul", 16), ("add", 18), ("max", 18), ("min", 18)]


def _distinct_along(rng, axis, count, size, other):
    """Indices with no repeat along `axis` (reduction "none": a repeat's result is undefined)."""
    picks = np.stack([rng.permutation(size)[:count] for _ in range(other)])   # [other, count]
    return picks.T if axis == 0 else picks


@pytest.mark.parametrize("reduction,opset", REDUCTIONS)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_elements_reductions_with_duplicates(reduction, opset, axis):
    rng = np.random.default_rng(1)
    shape = (6, 5)
    along = axis % 2
    if reduction == "none":
        idx = _distinct_along(rng, along, 4, shape[along], shape[1 - along]).astype(I64)
    else:
        idx = rng.integers(-shape[along], shape[along], (9, 5) if along == 0 else (6, 8)).astype(I64)
    model = _scatter_model("ScatterElements", shape, idx.shape, idx.shape, opset, axis=axis, reduction=reduction)
    _exact(model, {"x": rand(*shape, seed=2), "i": idx, "u": rand(*idx.shape, seed=3)})


@pytest.mark.parametrize("reduction,opset", REDUCTIONS)
def test_scatter_nd_reductions_with_duplicates(reduction, opset):
    rng = np.random.default_rng(4)
    if reduction == "none":  # distinct (row, column) pairs
        flat = rng.permutation(6 * 4)[:7]
        idx = np.stack([flat // 4, flat % 4], axis=1).astype(I64)
    else:  # 2-tuples into [6, 4, 3], repeats included, negative ones too
        idx = np.stack([rng.integers(-6, 6, 11), rng.integers(-4, 4, 11)], axis=1).astype(I64)
        idx[5] = idx[2]
    model = _scatter_model("ScatterND", (6, 4, 3), idx.shape, (idx.shape[0], 3), opset, reduction=reduction)
    _exact(model, {"x": rand(6, 4, 3, seed=5), "i": idx, "u": rand(idx.shape[0], 3, seed=6)})


@pytest.mark.parametrize("threads", [1, 2])
def test_scatters_split_by_destination(threads):
    """Big enough to be split into one part per thread: every kind of scatter in one model."""
    rng = np.random.default_rng(7)
    nodes_, edges, features = 300, 2000, 16
    dst = rng.integers(0, nodes_, edges).astype(I64)
    rows = dst[:, None]
    expanded = np.repeat(rows, features, axis=1)
    cols = rng.integers(0, features, (nodes_, 60)).astype(I64)  # 72 kB of updates: split too
    graph_nodes = [
        helper.make_node("ScatterND", ["x", "rows", "msg"], ["sum"], reduction="add"),
        helper.make_node("ScatterElements", ["x", "expanded", "msg"], ["max"], axis=0, reduction="max"),
        helper.make_node("ScatterElements", ["x", "cols", "per_row"], ["min"], axis=1, reduction="min"),
        helper.make_node("ScatterND", ["x", "rows", "msg"], ["prod"], reduction="mul"),
    ]
    model = make_model(graph_nodes, [("x", F32, [nodes_, features]), ("rows", I64, [edges, 1]),
                                     ("expanded", I64, [edges, features]), ("cols", I64, [nodes_, 60]),
                                     ("msg", F32, [edges, features]), ("per_row", F32, [nodes_, 60])],
                       [(n, F32, None) for n in ("sum", "max", "min", "prod")], opset=18)
    feeds = {"x": rand(nodes_, features, seed=8), "rows": rows, "expanded": expanded, "cols": cols,
             "msg": (1 + 0.01 * rand(edges, features, seed=9)), "per_row": rand(nodes_, 60, seed=10)}
    _exact(model, feeds, threads=threads)


def test_scatter_of_one_constant_value_reads_no_tensor():
    """torch's scatter_reduce(include_self=False) marks the touched elements by scattering a
    ConstantOfShape of the lowest float with `min`: the kernel takes the value as a literal and
    the library holds no [edges, features] tensor of it."""
    rng = np.random.default_rng(11)
    idx = rng.integers(0, 50, (3000, 1)).astype(I64)
    lowest = np.full((3000, 8), np.finfo(F32).min, F32)
    node = helper.make_node("ScatterND", ["x", "i", "lowest"], ["y"], reduction="min")
    model = make_model([node], [("x", F32, [50, 8]), ("i", I64, [3000, 1])], [("y", F32, None)],
                       initializers={"lowest": lowest}, opset=18)
    compiled, _ = assert_matches_ort(model, {"x": rand(50, 8, seed=12), "i": idx}, tol=0.0)
    assert compiled.info["memory"]["weights_bytes"] < lowest.nbytes // 10


@pytest.mark.parametrize("batch_dims,ishape", [(0, (500, 1)), (0, (300, 2)), (1, (4, 60, 1))])
def test_gather_nd_rows(batch_dims, ishape):
    rng = np.random.default_rng(13)
    shape = (4, 40, 16) if batch_dims else (40, 30, 16)
    idx = np.stack([rng.integers(-shape[batch_dims + k], shape[batch_dims + k], ishape[:-1])
                    for k in range(ishape[-1])], axis=-1).astype(I64)
    node = helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=batch_dims)
    model = make_model([node], [("x", F32, list(shape)), ("i", I64, list(ishape))], [("y", F32, None)], opset=13)
    _exact(model, {"x": rand(*shape, seed=14), "i": idx})


# simplify_scatter --------------------------------------------------------------------------------

def _expanded_scatter_model(reduction="max", axis=0, expand_from=(40, 1), dtype=I64):
    nodes = [helper.make_node("Expand", ["dst", "shape"], ["index"]),
             helper.make_node("ScatterElements", ["x", "index", "msg"], ["y"], axis=axis, reduction=reduction)]
    return make_model(nodes, [("x", F32, [10, 6]), ("dst", dtype, list(expand_from)), ("msg", F32, [40, 6])],
                      [("y", F32, None)], initializers={"shape": np.array([40, 6], I64)}, opset=18)


def _dst(shape=(40, 1), dtype=I64):
    return np.random.default_rng(15).integers(0, 10, shape).astype(dtype)


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_simplify_scatter(reduction):
    dst = np.random.default_rng(15).permutation(10)[:6].reshape(6, 1) if reduction == "none" else _dst()
    model = _expanded_scatter_model(reduction, expand_from=dst.shape)
    if reduction == "none":
        model = make_model([helper.make_node("Expand", ["dst", "shape"], ["index"]),
                            helper.make_node("ScatterElements", ["x", "index", "msg"], ["y"], axis=0)],
                           [("x", F32, [10, 6]), ("dst", I64, [6, 1]), ("msg", F32, [6, 6])], [("y", F32, None)],
                           initializers={"shape": np.array([6, 6], I64)}, opset=18)
    feeds = {"x": rand(10, 6, seed=16), "dst": dst, "msg": rand(dst.shape[0], 6, seed=17)}
    before, after = run_pass(simplify_scatter, model, feeds, tol=0.0)
    assert ops(before) == ["Expand", "ScatterElements"]
    assert ops(after) == ["Expand", "ScatterND"]  # the Expand is eliminate_dead's
    assert after.nodes[1].inputs[1] == "dst" and after.nodes[1].attrs.get("reduction", "none") == reduction
    assert_matches_ort(model, feeds, tol=0.0)  # the whole pipeline: the Expand is gone


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
    else:  # the index varies along the row: [40, 6] expanded from [1, 6]... here from [40, 6] itself
        model = _expanded_scatter_model(expand_from=(40, 6))
        feeds = {"x": rand(10, 6, seed=20), "dst": _dst((40, 6)), "msg": rand(40, 6, seed=21)}
    before, after = run_pass(simplify_scatter, model, feeds, tol=0.0)
    assert after is before


# GraphSAGE and GAT -------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _dynamo_export(module, x, edge_index):
    pytest.importorskip("onnxscript")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.onnx.export(module.eval(), (torch.from_numpy(x), torch.from_numpy(edge_index)), dynamo=True,
                                 verbose=False, input_names=["x", "edge_index"]).model_proto


GNN_NODES, GNN_EDGES = 60, 500


@pytest.mark.parametrize("name,threads", [("graphsage", 1), ("graphsage", 2), ("gat", 1), ("gat", 2)])
def test_gnn_zoo_dynamo_export(name, threads):
    """index_add_ (ScatterND add) and scatter_reduce(amax, include_self=False) (ScatterElements
    min then max) as torch.onnx.export(dynamo=True) writes them."""
    module = getattr(zoo, name)(GNN_NODES)
    x, edge_index = zoo.sample_input((GNN_NODES, 32)), zoo.random_edges(GNN_NODES, GNN_EDGES)
    model = _dynamo_export(module, x, edge_index)
    assert {"ScatterND", "ScatterElements", "GatherND"} <= {n.op_type for n in model.graph.node}
    compiled, got = assert_matches_ort(model, {"x": x, "edge_index": edge_index}, tol=TOL, threads=threads)
    want = module(torch.from_numpy(x), torch.from_numpy(edge_index)).detach().numpy()
    assert np.abs(list(got.values())[0] - want).max() <= TOL * np.abs(want).max()



def _torchscript_export(module, x, edge_index):
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.from_numpy(x), torch.from_numpy(edge_index)), buffer, dynamo=False,
                          opset_version=18, input_names=["x", "edge_index"], output_names=["output"])
    return onnx.load_model_from_string(buffer.getvalue())


def test_gnn_zoo_torchscript_export_mean():
    """scatter_add (ScatterElements add over an Expand-ed index, which simplify_scatter makes a
    ScatterND) as the TorchScript exporter writes it."""
    module = zoo.graphsage(GNN_NODES, aggr=("mean", "mean"), style="scatter")
    x, edge_index = zoo.sample_input((GNN_NODES, 32)), zoo.random_edges(GNN_NODES, GNN_EDGES)
    model = _torchscript_export(module, x, edge_index)
    assert "ScatterElements" in {n.op_type for n in model.graph.node}
    assert_matches_ort(model, {"x": x, "edge_index": edge_index}, tol=TOL)


@pytest.mark.parametrize("name", ["graphsage", "gat"])
def test_gnn_zoo_torchscript_export_max(name):
    """scatter_reduce("amax", include_self=True) through the TorchScript exporter, which wraps each
    ScatterElements in an If (on a constant: cuvil inlines it). onnxruntime 1.32 refuses these
    models at load ("[ShapeInferenceError] Incompatible dimensions": it cannot join the If's
    branch shapes), so torch itself is the oracle here."""
    module = getattr(zoo, name)(GNN_NODES, style="scatter")
    x, edge_index = zoo.sample_input((GNN_NODES, 32)), zoo.random_edges(GNN_NODES, GNN_EDGES)
    model = _torchscript_export(module, x, edge_index)
    assert {"If", "ScatterElements"} <= {n.op_type for n in model.graph.node}
    got = cuvil.compile(model).run({"x": x, "edge_index": edge_index})["output"]
    want = module(torch.from_numpy(x), torch.from_numpy(edge_index)).detach().numpy()
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()
