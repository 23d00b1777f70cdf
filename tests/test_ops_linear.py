"""Gemm, MatMul, Conv and BatchNormalization kernels (backends/numba_cpu/gemm.py,
conv.py, batchnorm.py) against onnxruntime, relative tolerance 1e-4.

Shapes are small but chosen to reach every code path: row blocks with a partial
last block, k blocks with a remainder, GEMV column blocks, the dot form
(B stored transposed), 1x1 convs as GEMMs, the flat "same"-conv loop with its
column masks and edge rows, the row-by-row and per-tap paths, and row splits
when there are few output channels. A few cases run with threads=2 so the work
ranges are split for real."""
import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from cuvil.errors import UnsupportedOpError

from tests.helpers import assert_matches_ort, make_model, rand

import cuvil

F32, F64 = np.float32, np.float64


# ---------------------------------------------------------------- Gemm

def gemm_model(M, N, K, trans_a=0, trans_b=0, alpha=1.0, beta=1.0, c_shape=None, const_b=True, const_c=True,
               dtype=F32):
    a = rand(*((K, M) if trans_a else (M, K)), seed=1, dtype=dtype)
    b = rand(*((N, K) if trans_b else (K, N)), seed=2, dtype=dtype)
    inputs, feeds, inits = [("a", dtype, list(a.shape))], {"a": a}, {}

    def operand(name, value, const):
        if const:
            inits[name] = value
        else:
            inputs.append((name, dtype, list(value.shape)))
            feeds[name] = value

    operand("b", b, const_b)
    names = ["a", "b"]
    if c_shape is not None:
        operand("c", rand(*c_shape, seed=3, dtype=dtype), const_c)
        names.append("c")
    node = helper.make_node("Gemm", names, ["y"], transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    return make_model([node], inputs, [("y", dtype, [M, N])], inits), feeds


GEMM_CASES = {
    # name: (M, N, K, kwargs)
    "plain": (6, 9, 11, {"c_shape": (9,)}),
    "transA": (7, 10, 9, {"trans_a": 1, "c_shape": (7, 10), "alpha": 0.5}),
    "transB": (9, 20, 13, {"trans_b": 1, "c_shape": (1, 20), "beta": 2.0}),
    "transA_transB": (5, 8, 6, {"trans_a": 1, "trans_b": 1, "c_shape": (), "alpha": -1.5, "beta": 0.25}),
    "c_column": (8, 5, 4, {"c_shape": (8, 1), "beta": 3.0}),
    "no_c": (4, 33, 17, {}),
    "beta_zero": (4, 6, 5, {"c_shape": (4, 6), "beta": 0.0}),
    "gemv": (1, 300, 40, {"trans_b": 1, "c_shape": (300,)}),
    "b_runtime": (7, 12, 9, {"const_b": False, "c_shape": (12,), "alpha": 2.0}),
    "b_runtime_transB": (5, 11, 21, {"const_b": False, "trans_b": 1, "c_shape": (5, 11), "alpha": 0.5, "beta": 1.5}),
    "b_runtime_both_trans": (6, 7, 8, {"const_b": False, "trans_a": 1, "trans_b": 1}),
    "c_runtime": (6, 9, 4, {"const_c": False, "c_shape": (6, 9), "beta": -2.0}),
    "gemv_b_runtime_transB": (1, 70, 33, {"const_b": False, "trans_b": 1, "c_shape": (1, 70)}),
}


@pytest.mark.parametrize("case", sorted(GEMM_CASES))
def test_gemm(case):
    M, N, K, kwargs = GEMM_CASES[case]
    model, feeds = gemm_model(M, N, K, **kwargs)
    assert_matches_ort(model, feeds)


def test_gemm_float64():
    model, feeds = gemm_model(5, 7, 6, trans_b=1, alpha=0.5, c_shape=(7,), dtype=F64)
    assert_matches_ort(model, feeds, tol=1e-12)


def test_gemm_threads():
    """GEMV column blocks and row blocks split over two threads."""
    for M, N, K in [(1, 600, 20), (10, 24, 8)]:
        model, feeds = gemm_model(M, N, K, c_shape=(N,))
        assert_matches_ort(model, feeds, threads=2)


def test_gemv_large_weights_threads_identical():
    """A GEMV with 576 KB of constant weights splits its columns over two threads (few FLOPs, but
    bound by B's bytes), and its micro-kernel reads B from L2 without prefetches (the model's
    constants fit in L2): the same bits on one thread and on two, both against onnxruntime."""
    model, feeds = gemm_model(1, 576, 256, trans_b=1, c_shape=(576,))
    _, one = assert_matches_ort(model, feeds, threads=1)
    _, two = assert_matches_ort(model, feeds, threads=2)
    assert np.array_equal(one["y"], two["y"])


def _uk_prefetch_distances(model, threads=1):
    """The prefetch_b of every micro-kernel spec the lowered model's kernels declare."""
    import json
    import re
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    from passes import resolve_passes, run_passes
    graph, _ = import_onnx(model)
    graph = run_passes(graph, [p for p in resolve_passes(2) if p != "plan_memory"])
    return {json.loads(m)["prefetch_b"] for c in lower(graph, threads) if hasattr(c, "kernel")
            for m in re.findall(r"# cuvil-ukernel cuvil_uk_\S+ (\{.*\})", c.kernel.source)}


@pytest.mark.parametrize("threads, target", [(1, "native"), (2, "native"), (1, "x86_64-avx2")])
def test_streamed_weights_prefetch_far_ahead(threads, target):
    """Packed weights over L2 (here 600 x 520 floats, 1.25 MB) are prefetched STREAM_PREFETCH_B_ROWS
    k rows ahead by every row tile (37 rows: partial tiles; N 520: a partial column panel); a GEMV
    of the same weights does not, nor do weights that fit L2. A prefetch changes no
    arithmetic: the tolerance is the default 1e-4 of max |ref|, over the ~K u = 600 x 6e-8 = 3.6e-5
    a float32 sum of 600 products may differ by from onnxruntime's (another summation order)."""
    from backends.numba_cpu.gemm import STREAM_PREFETCH_B_ROWS
    from backends.numba_cpu.ukernel import PREFETCH_B_ROWS
    assert STREAM_PREFETCH_B_ROWS > PREFETCH_B_ROWS
    for M, K, N, far in [(37, 600, 520, True), (1, 600, 520, False), (37, 300, 200, False)]:
        a, b = rand(1, M, K, seed=1), (rand(K, N, seed=2) / np.sqrt(K)).astype(F32)
        model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", F32, [1, M, K])],
                           [("y", F32, [1, M, N])], {"b": b})
        if threads == 1 and target == "native":
            distances = _uk_prefetch_distances(model)   # (a GEMV whose model fits L2 reads B with none: 0)
            assert distances == {STREAM_PREFETCH_B_ROWS} if far else STREAM_PREFETCH_B_ROWS not in distances, (M, K, N)
        if far or threads == 1:
            assert_matches_ort(model, {"a": a}, threads=threads, target=target)


def test_small_weights_of_a_large_model_prefetch_far_ahead():
    """Weights that fit L2 by themselves (300 x 200 floats, 240 KB) are prefetched far ahead too when
    the model's constants do not fit it (here with a 200 x 2800 product, 2.2 MB: MODEL_L2_BYTES):
    between calls the other products' weights evict them (DistilBERT's 384 x 384 projections).
    Tolerance: the default 1e-4 of max |ref|, over the ~(300 + 200) u a float32 sum of each chain of
    products may differ by from onnxruntime's (another summation order); a prefetch changes no bits."""
    from backends.numba_cpu.gemm import MODEL_L2_BYTES, STREAM_PREFETCH_B_ROWS
    a = rand(1, 37, 300, seed=1)
    small, large = (rand(300, 200, seed=2) / np.sqrt(300)).astype(F32), (rand(200, 2800, seed=3) / np.sqrt(200)).astype(F32)
    assert small.nbytes + large.nbytes > MODEL_L2_BYTES
    model = make_model([helper.make_node("MatMul", ["a", "small"], ["h"]), helper.make_node("MatMul", ["h", "large"], ["y"])],
                       [("a", F32, [1, 37, 300])], [("y", F32, [1, 37, 2800])], {"small": small, "large": large})
    assert _uk_prefetch_distances(model) == {STREAM_PREFETCH_B_ROWS}
    assert_matches_ort(model, {"a": a})


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_aliasing_rows_of_a_packed_at_run_time(op, tmp_path, monkeypatch):
    """Rows of A 4 KB apart (K = 1024) alias in an 8-way L1: on such targets the GEMM packs A into
    panels first (an APack step), with the same bits as reading A in place, both against
    onnxruntime; a 12-way L1 (Sapphire Rapids) reads it in place."""
    from backends.numba_cpu import gemm
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx

    M, N, K = 29, 260, 1024   # 5 row panels, the last partial; 5 column panels
    if op == "Gemm":
        model, feeds = gemm_model(M, N, K, c_shape=(N,))
    else:
        a, b = rand(M, K, seed=1), rand(K, N, seed=2)
        model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", F32, [M, K])],
                           [("y", F32, [M, N])], {"b": b})
        feeds = {"a": a}
    graph, _ = import_onnx(model, {})
    assert [c.kernel.family for c in lower(graph, 1, l1d_ways=8)][0] == "APack"
    assert "APack" not in [c.kernel.family for c in lower(graph, 1, l1d_ways=12)]
    # x86_64-avx2 describes an 8-way L1 whatever this machine has.
    _, packed = assert_matches_ort(model, feeds, target="x86_64-avx2", threads=2)
    monkeypatch.setattr(gemm, "A_ALIAS_MAX_WAYS", 0)
    _, in_place = assert_matches_ort(model, feeds, target="x86_64-avx2", threads=2, cache_dir=tmp_path)
    assert np.array_equal(packed["y"], in_place["y"])


# ---------------------------------------------------------------- MatMul

MATMUL_CASES = {
    # name: (A shape, B shape, B constant)
    "2d": ((5, 7), (7, 9), False),
    "2d_const_b": ((9, 16), (16, 20), True),
    "few_rows_short_passes": ((14, 200), (200, 70), True),   # 7 < M <= 16: passes of 64 k (64, 64, 64, 8)
    "1d_2d": ((7,), (7, 5), False),
    "2d_1d": ((6, 7), (7,), False),
    "1d_1d": ((8,), (8,), False),
    "3d": ((2, 5, 6), (2, 6, 4), False),
    "3d_2d": ((3, 5, 6), (6, 7), True),
    "2d_3d": ((5, 6), (3, 6, 7), False),
    "4d_broadcast": ((2, 1, 3, 4), (1, 3, 4, 5), False),
    "1d_3d": ((6,), (2, 6, 3), False),
    "batched_gemv": ((2, 3, 1, 8), (2, 3, 8, 10), False),
}


@pytest.mark.parametrize("case", sorted(MATMUL_CASES))
def test_matmul(case):
    a_shape, b_shape, const_b = MATMUL_CASES[case]
    a, b = rand(*a_shape, seed=1), rand(*b_shape, seed=2)
    out_shape = list(np.matmul(a, b).shape)
    inputs, feeds, inits = [("a", F32, list(a_shape))], {"a": a}, {}
    if const_b:
        inits["b"] = b
    else:
        inputs.append(("b", F32, list(b_shape)))
        feeds["b"] = b
    model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"])], inputs, [("y", F32, out_shape)], inits)
    assert_matches_ort(model, feeds)


def test_matmul_float64_threads():
    a, b = rand(2, 9, 6, seed=1, dtype=F64), rand(6, 5, seed=2, dtype=F64)
    model = make_model([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", F64, [2, 9, 6]), ("b", F64, [6, 5])],
                       [("y", F64, [2, 9, 5])])
    assert_matches_ort(model, {"a": a, "b": b}, tol=1e-12, threads=2)


# ---------------------------------------------------------------- Conv

def conv_model(x_shape, out_channels, kernel, group=1, bias=True, **attrs):
    w = rand(out_channels, x_shape[1] // group, *kernel, seed=1)
    inits, names = {"w": w}, ["x", "w"]
    if bias:
        inits["b"] = rand(out_channels, seed=2)
        names.append("b")
    node = helper.make_node("Conv", names, ["y"], group=group, **attrs)
    model = make_model([node], [("x", F32, list(x_shape))], [("y", F32, None)], inits)
    return onnx.shape_inference.infer_shapes(model), {"x": rand(*x_shape, seed=3)}


CONV_CASES = {
    # name: (x shape, out channels, kernel, kwargs)
    "3x3_pad1": ((1, 3, 9, 9), 4, (3, 3), {"pads": [1, 1, 1, 1]}),
    "3x3_pad1_batch2_odd_oc": ((2, 4, 7, 8), 5, (3, 3), {"pads": [1, 1, 1, 1]}),
    "3x3_stride2": ((2, 4, 9, 7), 6, (3, 3), {"strides": [2, 2]}),
    "3x3_stride2_pad1": ((1, 4, 10, 10), 4, (3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "3x3_dilation2": ((1, 4, 9, 9), 4, (3, 3), {"dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    "groups2": ((1, 4, 8, 8), 6, (3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    "depthwise": ((1, 6, 8, 8), 6, (3, 3), {"group": 6, "pads": [1, 1, 1, 1]}),
    "depthwise_stride2": ((1, 4, 9, 9), 4, (3, 3), {"group": 4, "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "1x1": ((1, 5, 6, 6), 7, (1, 1), {}),
    "1x1_groups_batch2": ((2, 4, 5, 5), 6, (1, 1), {"group": 2}),
    "1x1_stride2": ((2, 8, 9, 9), 6, (1, 1), {"strides": [2, 2]}),
    "7x7_stride2_pad3": ((1, 3, 20, 20), 4, (7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
    "5x5_same": ((1, 2, 12, 11), 4, (5, 5), {"pads": [2, 2, 2, 2]}),
    "same_upper": ((1, 3, 7, 8), 4, (4, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 1]}),
    "same_lower": ((1, 3, 7, 8), 4, (4, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 1]}),
    "same_lower_stride1": ((1, 2, 6, 7), 2, (2, 4), {"auto_pad": "SAME_LOWER"}),
    "valid_no_bias": ((1, 3, 7, 8), 4, (3, 3), {"auto_pad": "VALID", "bias": False}),
    "asymmetric_pads": ((1, 4, 8, 8), 4, (3, 3), {"group": 4, "pads": [1, 0, 2, 1]}),
    "pads_beyond_kernel": ((1, 1, 3, 3), 1, (3, 3), {"pads": [4, 4, 4, 4], "strides": [3, 1]}),
    "kernel_larger_than_input": ((1, 2, 3, 3), 3, (5, 5), {"pads": [2, 2, 2, 2]}),
    "conv1d": ((2, 3, 16), 4, (5,), {"pads": [2, 1]}),
    "conv1d_stride_dilation": ((1, 2, 20), 3, (3,), {"strides": [2], "dilations": [3]}),
    "conv3d": ((1, 2, 5, 6, 7), 3, (3, 2, 3), {"pads": [1, 0, 1, 1, 1, 0]}),
    "conv3d_large_kernel": ((1, 2, 6, 6, 6), 2, (3, 5, 5), {"pads": [1, 2, 2, 1, 2, 2], "strides": [1, 2, 1]}),
    "few_channels_row_split": ((1, 3, 40, 33), 1, (3, 3), {"pads": [1, 1, 1, 1]}),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv(case):
    x_shape, oc, kernel, kwargs = CONV_CASES[case]
    model, feeds = conv_model(x_shape, oc, kernel, **kwargs)
    assert_matches_ort(model, feeds)


def test_conv_threads():
    """Output-channel blocks and row splits over two threads."""
    for x_shape, oc in [((1, 4, 10, 10), 6), ((1, 2, 24, 20), 1)]:
        model, feeds = conv_model(x_shape, oc, (3, 3), pads=[1, 1, 1, 1])
        assert_matches_ort(model, feeds, threads=2)


@pytest.mark.parametrize("attrs", [{"pads": [1, 1, 1, 1]}, {"strides": [2, 2], "group": 2}, {}])
def test_conv_runtime_weight(attrs):
    """W as a graph input: not packed at build time, the direct kernel reads it as it is."""
    group = attrs.get("group", 1)
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv_rt", **attrs)
    model = make_model([node], [("x", F32, [1, 2, 5, 5]), ("w", F32, [4, 2 // group, 3, 3])], [("y", F32, None)])
    assert_matches_ort(model, {"x": rand(1, 2, 5, 5), "w": rand(4, 2 // group, 3, 3, seed=1)})
    pointwise = helper.make_node("Conv", ["x", "w"], ["y"], name="conv_rt_1x1")
    model = make_model([pointwise], [("x", F32, [1, 2, 5, 5]), ("w", F32, [3, 2, 1, 1])], [("y", F32, None)])
    assert_matches_ort(model, {"x": rand(1, 2, 5, 5), "w": rand(3, 2, 1, 1, seed=1)})


# ---------------------------------------------------------------- BatchNormalization

def bn_model(shape, const=True, opset=17, outputs=("y",), **attrs):
    C = shape[1]
    params = {"scale": rand(C, seed=1), "bias": rand(C, seed=2), "mean": rand(C, seed=3),
              "var": np.abs(rand(C, seed=4)) + 0.1}
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], list(outputs), name="bn", **attrs)
    inputs, feeds = [("x", F32, list(shape))], {"x": rand(*shape, seed=5)}
    if not const:
        inputs += [(k, F32, [C]) for k in params]
        feeds.update(params)
    return make_model([node], inputs, [("y", F32, list(shape))], params if const else {}, opset=opset), feeds


@pytest.mark.parametrize("shape, const, attrs", [
    ((3, 5), True, {}),
    ((2, 3, 4, 5), True, {}),
    ((1, 4, 2, 3, 2), True, {"epsilon": 1e-3}),
    ((4, 6), False, {}),
    ((2, 3, 7), False, {"epsilon": 0.5}),
])
def test_batchnorm(shape, const, attrs):
    model, feeds = bn_model(shape, const, **attrs)
    assert_matches_ort(model, feeds)


@pytest.mark.parametrize("shape, outputs", [((2, 3, 4, 4), ("y", "running_mean", "running_var")),
                                            ((5, 4), ("y", "running_mean", "")), ((1, 2, 6), ("y", "", "running_var"))])
def test_batchnorm_training_mode(shape, outputs):
    """Batch statistics normalise x; the running statistics are updated with momentum.
    onnxruntime's inference build has no training mode: ONNX's reference evaluator is the oracle."""
    C = shape[1]
    params = {"scale": rand(C, seed=1), "bias": rand(C, seed=2), "mean": rand(C, seed=3),
              "var": np.abs(rand(C, seed=4)) + 0.1}
    node = helper.make_node("BatchNormalization", ["x", *params], list(outputs), training_mode=1, momentum=0.8)
    model = make_model([node], [("x", F32, list(shape))] + [(k, F32, [C]) for k in params],
                       [(o, F32, None) for o in outputs if o], opset=15)
    feeds = {"x": rand(*shape, seed=5) * F32(3) + F32(1), **params}
    got = cuvil.compile(model).run(feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    assert list(got) == [o for o in outputs if o]
    for out, ref in zip(got.values(), want):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
