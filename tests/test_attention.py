"""Attention: MatMul -> scale -> Softmax -> MatMul (and the head Transposes around it), fused by the
pass fuse_attention and computed a block of query rows at a time (backends/numba_cpu/attention.py),
against onnxruntime (relative tolerance 1e-5); and where the pass must not fire."""
import numpy as np
import pytest
from onnx import helper

import cuvil
from backends.numba_cpu.registry import lower
from cuvil.frontends.onnx import import_onnx
from passes import resolve_passes, run_passes

from tests.helpers import assert_matches_ort, make_model, rand

F32 = np.float32


def heads(B=1, T=16, S=None, H=4, D=64, Dv=None, scale="Mul", k_layout="bshd", out_transpose=True,
          q_transpose=True, v_transpose=True, between=None, also_output=None, axis=-1, mask=None, mask_input=False):
    """Multi-head attention as torch exports it: q [B, T, H, D], k and v [B, S, H, D(v)] -> Transposes to
    [B, H, ., .] -> MatMul(q, k^T) -> Mul/Div by a scalar -> Softmax -> MatMul(., v) -> Transpose back.
    k_layout "bhds": k is given as [B, H, D, S] already (no Transpose); `mask`: the shape of an additive
    mask (a constant, or with mask_input an input of the graph) added after the scale; `between`: an op
    put between the scale and the Softmax ("Where": a mask as GPT-2 exports it; "Add2": two masks);
    `also_output`: a tensor that is a graph output too."""
    S = S or T
    Dv = Dv or D
    feeds = {"q": rand(B, T, H, D, seed=1), "v": rand(B, S, H, Dv, seed=3)}
    feeds["k"] = rand(B, H, D, S, seed=2) if k_layout == "bhds" else rand(B, S, H, D, seed=2)
    inits = {"c": np.float32(D ** -0.5 if scale == "Mul" else D ** 0.5)}
    nodes, read = [], {}
    for name, transpose in (("q", q_transpose), ("v", v_transpose)):   # [B, H, ., .] from [B, ., H, .]
        read[name] = name + "t" if transpose else name
        if transpose:
            nodes.append(helper.make_node("Transpose", [name], [read[name]], perm=[0, 2, 1, 3]))
        else:
            feeds[name] = feeds[name].transpose(0, 2, 1, 3).copy()
    q, v, k = read["q"], read["v"], "k"
    if k_layout == "bshd":
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1]))
        k = "kt"
    nodes.append(helper.make_node("MatMul", [q, k], ["s"]))
    scores = "s"
    if scale:
        nodes.append(helper.make_node(scale, ["s", "c"], ["ss"]))
        scores = "ss"
    if mask is not None:
        m = np.where(rand(*mask, seed=9) > 0.5, -1e4, 0).astype(F32) + rand(*mask, seed=10)
        if mask_input:
            feeds["mask"] = m
        else:
            inits["mask"] = m
        nodes.append(helper.make_node("Add", ["mask", scores], ["sm"]))   # the mask first, as some exporters do
        scores = "sm"
    if between == "Where":
        inits["keep"] = np.tril(np.ones((T, S), bool))
        inits["minus"] = np.float32(-1e9)
        nodes.append(helper.make_node("Where", ["keep", scores, "minus"], ["sw"]))
        scores = "sw"
    if between == "Add2":
        inits["m1"], inits["m2"] = rand(T, S, seed=11), rand(1, S, seed=12)
        nodes.append(helper.make_node("Add", [scores, "m1"], ["sa"]))
        nodes.append(helper.make_node("Add", ["sa", "m2"], ["sb"]))
        scores = "sb"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=axis))
    nodes.append(helper.make_node("MatMul", ["p", v], ["o"]))
    out = "o"
    if out_transpose:
        nodes.append(helper.make_node("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3]))
        out = "y"
    inputs = [(name, F32, list(feeds[name].shape)) for name in ("q", "k", "v", "mask") if name in feeds]
    outputs = [(out, F32, None)] + ([(also_output, F32, None)] if also_output else [])
    return make_model(nodes, inputs, outputs, inits), feeds


def lowered(model, threads=1):
    graph, _ = import_onnx(model, {})
    graph = run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"])
    return graph, [c for c in lower(graph, threads) if hasattr(c, "kernel")]


def ops(graph):
    return [n.op for n in graph.nodes if n.op != "Identity"]


CASES = {
    "encoder_heads": {},
    "div_scale": {"scale": "Div"},
    "no_scale": {"scale": None},
    "cross_attention_S_ne_T": {"T": 5, "S": 33},
    "head_dims_not_a_vector_multiple": {"D": 20, "Dv": 12, "H": 3},
    "batch_2_row_blocks": {"B": 2, "T": 200, "S": 150, "H": 2, "D": 32},
    "vit_197_tokens": {"T": 197, "H": 3, "D": 64},     # Kt packed by 16 x 16 blocks, 5 keys past the last
    "k_block_edges": {"T": 8, "S": 37, "H": 2, "D": 40},   # ... and a partial block along D too
    "k_given_transposed": {"k_layout": "bhds", "T": 24},
    "no_transposes": {"q_transpose": False, "v_transpose": False, "out_transpose": False, "T": 7, "S": 40},
    "one_query_row": {"T": 1, "S": 64},
    "padding_mask_input": {"B": 2, "T": 11, "S": 11, "H": 3, "D": 16, "mask": (2, 1, 1, 11), "mask_input": True},
    "causal_mask_constant": {"T": 20, "mask": (20, 20)},
    "full_mask_per_head": {"T": 9, "S": 17, "H": 2, "D": 8, "mask": (1, 2, 9, 17), "scale": "Div"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_attention_matches_ort(case):
    model, feeds = heads(**CASES[case])
    graph, calls = lowered(model)
    # The Transposes became strides (with T = 1 the one of q is a Reshape, a view, before the pass)
    assert [op for op in ops(graph) if op != "Reshape"] == ["FusedAttention"], ops(graph)
    assert_matches_ort(model, feeds, tol=1e-5)


def test_rank_3_attention():
    """[N, T, D] operands, no heads axis: a plain batched attention."""
    feeds = {"q": rand(3, 9, 16, seed=1), "k": rand(3, 16, 21, seed=2), "v": rand(3, 21, 8, seed=3)}
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=2),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    model = make_model(nodes, [(n, F32, list(feeds[n].shape)) for n in ("q", "k", "v")], [("y", F32, None)])
    assert ops(lowered(model)[0]) == ["FusedAttention"]
    assert_matches_ort(model, feeds, tol=1e-5)


@pytest.mark.parametrize("threads, shape", [(2, {}), (3, {}), (2, {"T": 198, "H": 3, "D": 64})])
def test_results_identical_for_any_thread_count(threads, shape):
    """Row blocks split over the threads, each with scratch of its own: the same bits as one thread
    (DeiT's 3 heads x 198 rows at 2 threads: 2 runs of blocks of 48 rows a head, 72 on one thread)."""
    model, feeds = heads(**({"B": 1, "T": 96, "S": 80, "H": 2, "D": 32} | shape))
    one = cuvil.compile(model, threads=1).run(feeds)
    many = cuvil.compile(model, threads=threads).run(feeds)
    np.testing.assert_array_equal(one["y"], many["y"])


@pytest.mark.parametrize("T, H, threads, items, even", [
    (198, 3, 2, 6, True), (197, 3, 2, 6, True),   # DeiT / ViT: were 9 (72, 72, 54 rows a head: 9 % over)
    (250, 6, 2, 6, True),                         # Whisper: were 12, each packing its head's Kt
    (197, 3, 4, 12, True),                        # were 18 (36 x 5 + 17 rows a head: 9 % over)
    (50, 1, 2, 5, False),   # no split of 4 tiles of 12 rows and 2 is even: as many as the threads want
])
def test_threads_finish_together_on_the_fewest_items(T, H, threads, items, even):
    """The fewest work items (each packs its head's Kt) whose threads finish within IMBALANCE_OK of
    an even share as the pool hands them out; where none does, as many as the threads want."""
    from backends.numba_cpu.attention import Geometry, run_rows
    from backends.numba_cpu.gemm import IMBALANCE_OK, slowest_share
    from backends.numba_cpu.kernel import lowering_for
    model, _ = heads(T=T, H=H, D=64)
    graph, _ = lowered(model, threads)
    node = next(n for n in graph.nodes if n.op == "FusedAttention")
    with lowering_for(threads):
        g = Geometry(node, graph)
    rows = run_rows(T, g.RB, g.runs)
    assert sum(rows) == T and min(rows) > 0 and g.RB % g.s_tile[0] == 0 and g.RB % g.o_tile[0] == 0
    assert g.work == items and (slowest_share(rows * H, threads) <= IMBALANCE_OK) == even


@pytest.mark.parametrize("target", ["x86_64-avx2", "generic"])
def test_narrower_targets_compute_the_same(target):
    model, feeds = heads(T=19, S=23, H=2, D=20)
    assert_matches_ort(model, feeds, tol=1e-5, target=target)


@pytest.mark.parametrize("kwargs, left", [
    ({"between": "Where"}, {"Where", "Softmax", "MatMul"}),             # GPT-2's masking: not this pattern
    ({"between": "Add2"}, {"Add", "Softmax", "MatMul"}),                # two masks
    ({"also_output": "p"}, {"Softmax", "MatMul"}),                     # the probabilities are read elsewhere
    ({"also_output": "s"}, {"Softmax", "MatMul"}),                     # so are the scores
    ({"axis": 2}, {"Softmax", "MatMul"}),                              # softmax over the queries
])
def test_pass_leaves_other_chains_alone(kwargs, left):
    model, feeds = heads(T=12, **kwargs)
    graph, _ = lowered(model)
    assert "FusedAttention" not in ops(graph) and left <= set(ops(graph)), ops(graph)
    assert_matches_ort(model, feeds, tol=1e-5)


def test_transpose_read_elsewhere_stays():
    """A head Transpose that something else reads too runs as before; the attention reads its output."""
    model, feeds = heads(T=10, also_output="qt")
    graph, _ = lowered(model)
    assert ops(graph).count("Transpose") == 1 and "FusedAttention" in ops(graph)
    assert_matches_ort(model, feeds, tol=1e-5)


def test_explain_and_describe():
    from cuvil.explain import computes
    from passes import describe
    model, _ = heads(T=8)
    graph, _ = lowered(model)
    assert computes(graph.nodes[-1]) == "FusedAttention[MatMul -> Mul -> Softmax -> MatMul]"
    masked, _ = heads(T=8, scale="Div", mask=(8, 8))
    assert computes(lowered(masked)[0].nodes[-1]) == "FusedAttention[MatMul -> Div -> Add(mask) -> Softmax -> MatMul]"
    before, _ = import_onnx(model, {})
    assert describe("fuse_attention", before, graph) == (
        "1 MatMul -> Softmax -> MatMul chain into FusedAttention (4 Transposes absorbed as strides)")
