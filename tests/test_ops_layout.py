"""Pooling, Softmax, Transpose and Concat kernels against onnxruntime
(backends/numba_cpu/pool.py, softmax.py, transpose.py, concat.py)."""
import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil.errors import UnsupportedOpError
from tests.helpers import assert_matches_ort, make_model, rand

F32 = np.float32


def one_node(op, inputs, attrs=None, opset=17, out_dtype=None, initializers=None, outputs=("y",)):
    """A model of one node reading `inputs` [(name, dtype, shape)]; output shapes are inferred."""
    node = helper.make_node(op, [name for name, _, _ in inputs] + list(initializers or {}), list(outputs), **(attrs or {}))
    dtype = out_dtype or inputs[0][1]
    return make_model([node], inputs, [(o, dtype, None) for o in outputs if o], initializers=initializers, opset=opset)


# Pooling ------------------------------------------------------------------------

# (attributes, input shape, opset). Output shapes come from ONNX shape inference;
# ceil_mode cases are chosen where it agrees with onnxruntime (see the report on
# windows that would start in the end padding).
MAXPOOL = [
    ({"kernel_shape": [3, 3]}, (2, 3, 7, 8), 12),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (2, 3, 7, 8), 12),
    ({"kernel_shape": [2, 3], "strides": [2, 1], "pads": [0, 1, 1, 0]}, (1, 2, 6, 7), 12),
    ({"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1}, (1, 2, 7, 8), 12),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 7, 8), 12),
    ({"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"}, (1, 2, 5, 6), 12),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "VALID"}, (1, 2, 7, 8), 12),
    ({"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]}, (1, 2, 7, 8), 12),
    ({"kernel_shape": [2, 2], "dilations": [2, 1], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}, (1, 2, 7, 8), 12),
    ({"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, (2, 3, 9), 12),
    ({"kernel_shape": [2, 3, 2], "strides": [2, 1, 2], "pads": [1, 0, 1, 0, 1, 1]}, (1, 2, 5, 6, 5), 12),
    ({"kernel_shape": [2, 2], "storage_order": 1}, (1, 1, 4, 4), 8),
    # ResNet's stem pool: interior rows and columns take the fused k x k loop, edges the per-tap loops
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (1, 4, 32, 30), 12),
    ({"kernel_shape": [3, 2], "strides": [1, 2], "pads": [0, 1, 2, 0], "ceil_mode": 1}, (1, 2, 9, 11), 12),
]


@pytest.mark.parametrize("attrs,shape,opset", MAXPOOL, ids=[f"case{i}" for i in range(len(MAXPOOL))])
def test_maxpool(attrs, shape, opset):
    assert_matches_ort(one_node("MaxPool", [("x", F32, list(shape))], attrs, opset), {"x": rand(*shape)})


@pytest.mark.parametrize("dtype", [np.float64, np.int8, np.uint8])
def test_maxpool_dtypes(dtype):
    x = (rand(1, 2, 6, 6) * 40).astype(dtype) if dtype != np.uint8 else np.random.default_rng(0).integers(0, 255, (1, 2, 6, 6)).astype(dtype)
    model = one_node("MaxPool", [("x", dtype, [1, 2, 6, 6])], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})
    assert_matches_ort(model, {"x": x})


# 8-bit MaxPool is opset 12's
MAXPOOL_8BIT = [case for case in MAXPOOL if len(case[1]) == 4 and case[2] >= 12] + [
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (1, 3, 113, 111), 12),   # odd sizes
    ({"kernel_shape": [5, 4], "strides": [3, 3], "pads": [4, 3, 4, 3]}, (1, 2, 10, 9), 12),       # pads wider than the stride
]


@pytest.mark.parametrize("dtype,threads", [(np.uint8, 1), (np.int8, 2)], ids=["uint8-1thread", "int8-2threads"])
@pytest.mark.parametrize("attrs,shape,opset", MAXPOOL_8BIT, ids=[f"case{i}" for i in range(len(MAXPOOL_8BIT))])
def test_maxpool_8bit(attrs, shape, opset, dtype, threads):
    """backends/numba_cpu/maxpool8.py (rows, then columns) equals onnxruntime exactly, the dtype's
    extremes included (a window of the lowest value alone, and windows in the padding)."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(threads)
    x = rng.integers(int(info.min), int(info.max) + 1, shape).astype(dtype)
    x.reshape(-1)[rng.integers(0, x.size, x.size // 4)] = info.min
    x.reshape(-1)[rng.integers(0, x.size, x.size // 8)] = info.max
    x[..., : shape[-2] // 3, :] = info.min
    model = one_node("MaxPool", [("x", dtype, list(shape))], attrs, opset)
    assert_matches_ort(model, {"x": x}, threads=threads)


def test_maxpool_indices_output():
    model = one_node("MaxPool", [("x", F32, [1, 2, 5, 5])], {"kernel_shape": [2, 2], "strides": [2, 2]},
                     outputs=("y", "idx"))
    model.graph.output[1].type.tensor_type.elem_type = 7  # int64
    assert_matches_ort(model, {"x": rand(1, 2, 5, 5)})


def test_maxpool_unused_indices_slot():
    model = one_node("MaxPool", [("x", F32, [1, 1, 4, 4])], {"kernel_shape": [2, 2]}, outputs=("y", ""))
    assert_matches_ort(model, {"x": rand(1, 1, 4, 4)})


AVERAGEPOOL = [
    ({"kernel_shape": [3, 3]}, (2, 3, 7, 8), 11),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (2, 3, 7, 8), 11),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}, (2, 3, 7, 8), 11),
    ({"kernel_shape": [3, 2], "strides": [1, 2], "pads": [2, 0, 1, 1], "count_include_pad": 1}, (1, 2, 6, 7), 11),
    ({"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1}, (1, 2, 7, 8), 11),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 7, 8), 11),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER", "count_include_pad": 1}, (1, 2, 7, 8), 11),
    ({"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER", "count_include_pad": 1}, (1, 2, 5, 6), 11),
    ({"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}, (1, 2, 7, 8), 19),
    ({"kernel_shape": [3], "strides": [2], "pads": [1, 1], "count_include_pad": 1}, (2, 3, 9), 11),
    ({"kernel_shape": [2, 3, 2], "strides": [2, 1, 2], "pads": [1, 0, 1, 0, 1, 1]}, (1, 2, 5, 6, 5), 11),
    ({"kernel_shape": [2, 2], "strides": [2, 2]}, (1, 2, 6, 6), 7),
]


@pytest.mark.parametrize("attrs,shape,opset", AVERAGEPOOL, ids=[f"case{i}" for i in range(len(AVERAGEPOOL))])
def test_averagepool(attrs, shape, opset):
    assert_matches_ort(one_node("AveragePool", [("x", F32, list(shape))], attrs, opset), {"x": rand(*shape)})


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 4, 9), (1, 2, 3, 4, 5)])
def test_global_pool(op, shape):
    assert_matches_ort(one_node(op, [("x", F32, list(shape))]), {"x": rand(*shape)})


def test_global_pool_float64():
    # onnxruntime has no float64 global pools: numpy is the reference.
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["avg"]), helper.make_node("GlobalMaxPool", ["x"], ["max"])]
    model = make_model(nodes, [("x", np.float64, [2, 3, 4, 5])], [("avg", np.float64, None), ("max", np.float64, None)])
    x = rand(2, 3, 4, 5, dtype=np.float64)
    got = cuvil.compile(model).run({"x": x})
    np.testing.assert_allclose(got["avg"], x.mean(axis=(2, 3), keepdims=True), rtol=1e-12)
    np.testing.assert_array_equal(got["max"], x.max(axis=(2, 3), keepdims=True))


# Softmax ------------------------------------------------------------------------

SOFTMAX = [
    ({}, (3, 10), 13),                    # default axis -1
    ({"axis": 1}, (2, 3, 4, 5), 13),      # over channels: the column kernel
    ({"axis": 1}, (2, 5, 15, 20), 13),    # inner 300: two column blocks
    ({"axis": 0}, (4, 6), 13),
    ({"axis": -2}, (2, 7, 3), 13),
    ({}, (2, 3, 4), 11),                  # opset < 13: coerced to 2-D at axis 1
    ({"axis": -1}, (2, 3, 4), 11),
    ({"axis": 0}, (2, 3, 4), 11),         # the whole tensor is one row
    ({"axis": 2}, (2, 3, 1, 4), 12),
    ({}, (4, 1), 13),                     # a single element per row
]


@pytest.mark.parametrize("attrs,shape,opset", SOFTMAX, ids=[f"case{i}" for i in range(len(SOFTMAX))])
def test_softmax(attrs, shape, opset):
    # Large values: only a max-subtracting softmax stays finite.
    x = rand(*shape) * 60
    assert_matches_ort(one_node("Softmax", [("x", F32, list(shape))], attrs, opset), {"x": x})


def test_softmax_float64():
    model = one_node("Softmax", [("x", np.float64, [3, 4, 5])], {"axis": 1})
    assert_matches_ort(model, {"x": rand(3, 4, 5, dtype=np.float64)}, tol=1e-10)


# Transpose ----------------------------------------------------------------------

TRANSPOSE = [
    (None, (2, 3, 4)),                  # default: dims reversed
    ([0, 2, 3, 1], (2, 3, 4, 5)),       # NCHW -> NHWC
    ([0, 3, 1, 2], (2, 4, 5, 3)),       # NHWC -> NCHW
    ([1, 0], (70, 3)),
    ([2, 0, 1, 3], (3, 1, 4, 2)),       # a size-1 dim, the last dim kept in place
    ([3, 1, 4, 0, 2], (2, 3, 2, 4, 3)),
    ([0, 1, 2], (2, 3, 4)),             # identity: a copy
    ([1, 0, 2], (80, 3, 2)),            # large outer dim: work over dim 0 only
]


@pytest.mark.parametrize("perm,shape", TRANSPOSE, ids=[f"case{i}" for i in range(len(TRANSPOSE))])
def test_transpose(perm, shape):
    attrs = {} if perm is None else {"perm": perm}
    assert_matches_ort(one_node("Transpose", [("x", F32, list(shape))], attrs), {"x": rand(*shape)})


# Planes of float32 whose last two dims swap (NCHW <-> NHWC, a matrix): 16 x 16 blocks by the
# shuffle micro-kernel (TBlockSpec) and the rows / columns past the last whole block by a scalar
# loop. Data movement: the result is exact (tolerance 0), on every target's vector width.
PLANE_TRANSPOSE = [
    ([0, 2, 3, 1], (1, 48, 56, 56)),    # ConvNeXt's NCHW -> NHWC: whole blocks of channels, 3136 % 16 = 0
    ([0, 3, 1, 2], (2, 7, 7, 384)),     # NHWC -> NCHW, 49 positions: a partial block of rows
    ([1, 0], (37, 45)),                 # both dims end in a partial block
    ([0, 2, 1], (3, 16, 16)),           # exactly one block per matrix
    ([0, 2, 1], (1, 250, 384)),         # Whisper's conv output (C, T) -> (T, C)
]


@pytest.mark.parametrize("target", ["x86_64-avx512", "x86_64-avx2", "generic"])
@pytest.mark.parametrize("perm,shape", PLANE_TRANSPOSE, ids=[f"plane{i}" for i in range(len(PLANE_TRANSPOSE))])
def test_plane_transpose_blocks(perm, shape, target):
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    model = one_node("Transpose", [("x", F32, list(shape))], {"perm": perm})
    graph, _ = import_onnx(model, {})
    assert any("tblock" in call.kernel.source for call in lower(graph, 1) if hasattr(call, "kernel"))
    assert_matches_ort(model, {"x": rand(*shape)}, tol=0.0, target=target)


@pytest.mark.parametrize("threads", [2, 3])
def test_plane_transpose_any_thread_count(threads):
    model = one_node("Transpose", [("x", F32, [2, 40, 33])], {"perm": [0, 2, 1]})
    assert_matches_ort(model, {"x": rand(2, 40, 33)}, tol=0.0, threads=threads)


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.uint8])
def test_transpose_dtypes(dtype):
    x = np.random.default_rng(0).integers(0, 2 if dtype == np.bool_ else 100, (2, 3, 4)).astype(dtype)
    assert_matches_ort(one_node("Transpose", [("x", dtype, [2, 3, 4])], {"perm": [1, 2, 0]}), {"x": x})


# Concat -------------------------------------------------------------------------

CONCAT = [
    (0, [(2, 3), (4, 3)]),
    (1, [(2, 3, 4), (2, 1, 4), (2, 5, 4)]),
    (-1, [(2, 3, 4), (2, 3, 2)]),
    (-2, [(2, 3, 4), (2, 2, 4)]),
    (0, [(3, 4)]),                        # one input: a copy
    (1, [(1, 5000), (1, 3000)]),          # few long rows: split in blocks
    (0, [(2, 3), (0, 3), (1, 3)]),        # an empty input
]


@pytest.mark.parametrize("axis,shapes", CONCAT, ids=[f"case{i}" for i in range(len(CONCAT))])
def test_concat(axis, shapes):
    inputs = [(f"x{i}", F32, list(s)) for i, s in enumerate(shapes)]
    feeds = {f"x{i}": rand(*s, seed=i) for i, s in enumerate(shapes)}
    assert_matches_ort(one_node("Concat", inputs, {"axis": axis}), feeds)


def test_concat_constants_and_repeats():
    # A constant among the inputs, and one input used twice.
    node = helper.make_node("Concat", ["x", "w", "x"], ["y"], axis=1)
    model = make_model([node], [("x", F32, [2, 3])], [("y", F32, [2, 8])],
                       initializers={"w": rand(2, 2, seed=9)})
    assert_matches_ort(model, {"x": rand(2, 3)})


@pytest.mark.parametrize("dtype", [np.int64, np.bool_])
def test_concat_dtypes(dtype):
    rng = np.random.default_rng(0)
    inputs = [("a", dtype, [2, 3]), ("b", dtype, [2, 2])]
    feeds = {n: rng.integers(0, 2, s).astype(dtype) for n, _, s in inputs}
    assert_matches_ort(one_node("Concat", inputs, {"axis": 1}), feeds)


def test_layout_ops_with_threads():
    # Every generator's work range split over threads gives the same result.
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("AveragePool", ["x"], ["a"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Softmax", ["x"], ["s"], axis=1),
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("Concat", ["x", "x"], ["c"], axis=0),
        helper.make_node("GlobalAveragePool", ["x"], ["g"]),
    ]
    model = make_model(nodes, [("x", F32, [2, 5, 8, 8])], [(n, F32, None) for n in "pastcg"])
    assert_matches_ort(model, {"x": rand(2, 5, 8, 8)}, threads=3)
