"""merge_matmuls: sibling MatMul/Gemm on one input with constant weights -> one product + Split."""
import numpy as np
import pytest

from cuvil.explain import explain_model
from cuvil.frontends.onnx import import_onnx
from passes import OPT_LEVELS, run_passes
from passes.merge_matmuls import merge_matmuls
from tests.helpers import assert_matches_ort, rand
from tests.test_passes.common import model_from_text, run_pass, show

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _with_merge():
    """The opt-2 list with merge_matmuls where it belongs: after the fusions and eliminate_common."""
    names = [p for p in OPT_LEVELS[2] if p != "merge_matmuls"]
    names.insert(names.index("eliminate_common") + 1, "merge_matmuls")
    return names


def test_three_sibling_matmuls_become_one_and_a_split():
    # q, k, v of one input (N of 4, 4 and 6); m reads another input and stays as it is.
    model = model_from_text(HEAD + """
        g (float[1, 5, 8] x, float[1, 5, 8] u) => (float[1, 5, 4] q, float[1, 5, 4] k, float[1, 5, 6] v,
                                                  float[1, 5, 4] m) {
            q = MatMul(x, wq)
            k = MatMul(x, wk)
            m = MatMul(u, wq)
            v = MatMul(x, wv)
        }""", wq=rand(8, 4, seed=1), wk=rand(8, 4, seed=2), wv=rand(8, 6, seed=3))
    before, after = run_pass(merge_matmuls, model, {"x": rand(1, 5, 8), "u": rand(1, 5, 8, seed=4)})
    assert show(after) == ["MatMul(x, wq_merged) -> q_merged",
                           "Split(q_merged, MatMul_0_split_sizes) -> q, k, v {axis=-1}",
                           "MatMul(u, wq) -> m"]
    w = np.concatenate([before.values[n].data for n in ("wq", "wk", "wv")], axis=1)
    np.testing.assert_array_equal(after.values["wq_merged"].data, w)
    assert list(after.values["MatMul_0_split_sizes"].data) == [4, 4, 6]
    assert after.values["q_merged"].shape == (1, 5, 14)


def test_gemms_merge_weights_and_biases_and_fold_trans_b():
    model = model_from_text(HEAD + """
        g (float[3, 8] x) => (float[3, 4] a, float[3, 5] b) {
            a = Gemm <transB = 1> (x, w1, c1)
            b = Gemm(x, w2, c2)
        }""", w1=rand(4, 8, seed=1), c1=rand(4, seed=2), w2=rand(8, 5, seed=3), c2=rand(1, 5, seed=4))
    before, after = run_pass(merge_matmuls, model, {"x": rand(3, 8)})
    assert show(after) == ["Gemm(x, w1_merged, c1_merged) -> a_merged",
                           "Split(a_merged, Gemm_0_split_sizes) -> a, b {axis=-1}"]
    np.testing.assert_array_equal(after.values["w1_merged"].data,
                                  np.concatenate([before.values["w1"].data.T, before.values["w2"].data], axis=1))
    np.testing.assert_array_equal(after.values["c1_merged"].data,
                                  np.concatenate([before.values["c1"].data, before.values["c2"].data[0]])[None])


def test_must_not_fire_on_runtime_weights():
    model = model_from_text(HEAD + """
        g (float[2, 8] x, float[8, 4] w1, float[8, 4] w2) => (float[2, 4] a, float[2, 4] b) {
            a = MatMul(x, w1)
            b = MatMul(x, w2)
        }""")
    before, after = run_pass(merge_matmuls, model, {"x": rand(2, 8), "w1": rand(8, 4, seed=1),
                                                    "w2": rand(8, 4, seed=2)})
    assert after is before


def test_must_not_fire_when_k_differs():
    # One input, read as (3, 8) @ (8, 4) and as (8, 3) @ (3, 4): K is 8 in one and 3 in the other.
    model = model_from_text(HEAD + """
        g (float[3, 8] x) => (float[3, 4] a, float[8, 4] b) {
            a = Gemm(x, w1)
            b = Gemm <transA = 1> (x, w2)
        }""", w1=rand(8, 4, seed=1), w2=rand(3, 4, seed=2))
    before, after = run_pass(merge_matmuls, model, {"x": rand(3, 8)})
    assert after is before


def test_must_not_fire_on_different_attributes_or_mixed_biases():
    model = model_from_text(HEAD + """
        g (float[2, 8] x) => (float[2, 4] a, float[2, 4] b, float[2, 4] c) {
            a = Gemm <alpha = 0.5> (x, w1, c1)
            b = Gemm(x, w2, c1)
            c = Gemm(x, w2)
        }""", w1=rand(8, 4, seed=1), w2=rand(8, 4, seed=2), c1=rand(4, seed=3))
    before, after = run_pass(merge_matmuls, model, {"x": rand(2, 8)})
    assert after is before


def test_fused_epilogues_merge_when_alike_and_never_with_a_residual():
    # After fuse_activation: two FusedGemm with Relu merge; the one with a residual keeps its own.
    model = model_from_text(HEAD + """
        g (float[4, 16] x, float[4, 16] r) => (float[4, 16] a, float[4, 24] b, float[4, 16] c) {
            p = Gemm(x, w1, c1)
            a = Relu(p)
            s = Gemm(x, w2, c2)
            b = Relu(s)
            t = Gemm(x, w1, c2s)
            u = Add(t, r)
            c = Relu(u)
        }""", w1=rand(16, 16, seed=1), c1=rand(16, seed=2), w2=rand(16, 24, seed=3), c2=rand(24, seed=4),
        c2s=rand(16, seed=5))
    passes = ["fuse_activation", "merge_matmuls"]
    feeds = {"x": rand(4, 16), "r": rand(4, 16, seed=6)}
    compiled, _ = assert_matches_ort(model, feeds, tol=1e-5, passes=passes)
    assert compiled.info["passes"] == passes
    graph = run_passes(import_onnx(model)[0], passes)
    assert [n.op for n in graph.nodes] == ["FusedGemm", "Split", "FusedGemm"]
    assert graph.nodes[0].attr("activation") == "Relu" and graph.nodes[2].attr("has_residual") == 1


def _attention(t=8, d=64, heads=2):
    """One self-attention block as exporters write it: q, k, v projections (MatMul + bias Add) of x,
    heads split by Reshape + Transpose, softmax(q k^T / sqrt(dh)) v, output projection + residual."""
    dh = d // heads
    text = HEAD + f"""
        g (float[1, {t}, {d}] x) => (float[1, {t}, {d}] y) {{
            qm = MatMul(x, wq)
            q0 = Add(qm, bq)
            km = MatMul(x, wk)
            k0 = Add(km, bk)
            vm = MatMul(x, wv)
            v0 = Add(vm, bv)
            q1 = Reshape(q0, heads)
            k1 = Reshape(k0, heads)
            v1 = Reshape(v0, heads)
            q = Transpose <perm = [0, 2, 1, 3]> (q1)
            k = Transpose <perm = [0, 2, 3, 1]> (k1)
            v = Transpose <perm = [0, 2, 1, 3]> (v1)
            s = MatMul(q, k)
            z = Mul(s, scale)
            p = Softmax <axis = -1> (z)
            o = MatMul(p, v)
            o1 = Transpose <perm = [0, 2, 1, 3]> (o)
            o2 = Reshape(o1, back)
            om = MatMul(o2, wo)
            ob = Add(om, bo)
            y = Add(ob, x)
        }}"""
    w = {f"w{n}": rand(d, d, seed=i) * d ** -0.5 for i, n in enumerate("qkvo")}
    b = {f"b{n}": rand(d, seed=10 + i) for i, n in enumerate("qkvo")}
    return model_from_text(text, **w, **b, heads=np.array([1, t, heads, dh], np.int64),
                           back=np.array([1, t, d], np.int64), scale=np.float32(dh ** -0.5))


@pytest.mark.parametrize("t", [8, 40])
def test_attention_block_matches_onnxruntime_and_the_unmerged_build(t):
    model, feeds = _attention(t=t), {"x": rand(1, t, 64, seed=7)}
    merged = _with_merge()
    unmerged = [p for p in merged if p != "merge_matmuls"]
    _, got = assert_matches_ort(model, feeds, tol=1e-5, passes=merged)
    _, want = assert_matches_ort(model, feeds, tol=1e-5, passes=unmerged)
    # Same dot product per element, same kernel family (float32 micro-kernels at these sizes): same bits.
    np.testing.assert_array_equal(got["y"].view(np.uint32), want["y"].view(np.uint32))


def test_merges_in_the_attention_block_after_the_fusions():
    report = explain_model(_attention(), passes=_with_merge())
    # q, k and v: one Gemm and a Split; the output projection took the residual (FusedGemm); the
    # scores, softmax and weighted sum are one Attention (fuse_attention).
    after = report.op_counts_after
    assert (after["Gemm"], after["Split"], after["FusedGemm"], after["FusedAttention"]) == (1, 1, 1, 1)
    assert "MatMul" not in after
