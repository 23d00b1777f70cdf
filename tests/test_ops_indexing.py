"""Cast, data movement and indexing ops against onnxruntime
(backends/numba_cpu/indexing.py, resize.py) and the narrow-type conversions
of backends/numba_cpu/narrow.py against numpy / ml_dtypes."""
import math

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil
from backends.numba_cpu.narrow import BIT_HELPERS
from tests.helpers import assert_matches_ort, make_model, rand

F32 = np.float32
I64 = np.int64


def one_node(op, inputs, attrs=None, opset=18, initializers=None, outputs=("y",), out_dtypes=None):
    node = helper.make_node(op, [n for n, _, _ in inputs] + list(initializers or {}), list(outputs), **(attrs or {}))
    out_dtypes = out_dtypes or [inputs[0][1]] * len(outputs)
    return make_model([node], inputs, [(o, t, None) for o, t in zip(outputs, out_dtypes)],
                      initializers=initializers, opset=opset)


# Small floats: exact against numpy / ml_dtypes ------------------------------------------------

@pytest.fixture(scope="module")
def helpers():
    namespace = {"math": math, "np": np}
    exec(BIT_HELPERS, namespace)
    return namespace


def _probe_floats():
    rng = np.random.default_rng(0)
    scales = (1e-7, 1e-5, 1e-3, 1.0, 1e2, 1e4, 6e4, 1e6)
    xs = [rng.standard_normal(3000).astype(F32) * s for s in scales]
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 57344, 61440, 2 ** -24,
                      2 ** -25, 3 * 2 ** -26, 2 ** -17, 1e-45], F32)
    return np.concatenate(xs + [edges])


@pytest.mark.parametrize("fmt,to_f32,from_f32", [("float16", "f16_to_f32", "f32_to_f16"),
                                                 ("bfloat16", "bf16_to_f32", "f32_to_bf16")])
def test_16_bit_floats_round_trip_exactly(helpers, fmt, to_f32, from_f32):
    dtype = np.float16 if fmt == "float16" else ml_dtypes.bfloat16
    bits = np.arange(65536, dtype=np.uint16)
    got = np.array([helpers[to_f32](b) for b in bits], F32)
    want = bits.view(dtype).astype(F32)
    assert np.array_equal(got, want, equal_nan=True)
    xs = _probe_floats()
    got = np.array([helpers[from_f32](x) for x in xs], np.uint16)
    with np.errstate(over="ignore"):
        want = xs.astype(dtype).view(np.uint16)
    nan = np.isnan(xs)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(got[nan].view(dtype).astype(F32)))


EIGHT_BIT = [("float8_e5m2", 57344), ("float8_e4m3fn", 448), ("float8_e4m3fnuz", 240), ("float8_e5m2fnuz", 57344),
             ("float4_e2m1fn", 6)]


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("fmt,largest", EIGHT_BIT, ids=[f for f, _ in EIGHT_BIT])
def test_float8_and_float4_match_ml_dtypes(helpers, fmt, largest, saturate):
    """Decode every code; encode as ONNX's Cast does (saturate: clip, then round)."""
    from backends.numba_cpu.narrow import SMALL_FLOATS
    _, decode, encode = SMALL_FLOATS[fmt]
    dtype = getattr(ml_dtypes, fmt)
    codes = np.arange(16 if fmt == "float4_e2m1fn" else 256, dtype=np.uint8)
    got = np.array([helpers[decode](c) for c in codes], F32)
    assert np.array_equal(got, codes.view(dtype).astype(F32), equal_nan=True)
    xs = _probe_floats()
    got = np.array([helpers[encode](x, saturate) for x in xs], np.uint8)
    with np.errstate(all="ignore"):
        want = (np.clip(xs, -largest, largest) if saturate else xs).astype(dtype).view(np.uint8)
    same = (got == want) | (np.isnan(got.view(dtype).astype(F32)) & np.isnan(want.view(dtype).astype(F32)))
    assert same.all(), xs[~same][:5]


@pytest.mark.parametrize("mode", ["up", "down", "nearest"])
def test_float8_e8m0_matches_onnx(helpers, mode):
    from onnx.numpy_helper import to_float8e8m0
    codes = np.arange(256, dtype=np.uint8)
    got = np.array([helpers["e8m0_to_f32"](c) for c in codes], F32)
    assert np.array_equal(got, codes.view(ml_dtypes.float8_e8m0fnu).astype(F32), equal_nan=True)
    xs = np.concatenate([_probe_floats(), np.array([3e38, 2.0 ** 127, 1e-40, -2.0], F32)])
    for saturate in (True, False):
        got = np.array([helpers["f32_to_e8m0"](x, saturate, {"up": 0, "down": 1, "nearest": 2}[mode]) for x in xs])
        np.testing.assert_array_equal(got.astype(np.uint8), to_float8e8m0(xs, saturate, mode).view(np.uint8))


@pytest.mark.parametrize("fmt,bits,signed", [("int4", 4, True), ("uint4", 4, False), ("int2", 2, True),
                                             ("uint2", 2, False)])
def test_sub_byte_integers_match_ml_dtypes(helpers, fmt, bits, signed):
    dtype = getattr(ml_dtypes, fmt)
    codes = np.arange(1 << bits, dtype=np.uint8)
    got = np.array([helpers["intn_load"](c, bits, signed) for c in codes])
    np.testing.assert_array_equal(got, codes.view(dtype).astype(np.int64))
    floats = np.concatenate([np.arange(-20, 20), [np.nan, np.inf, -np.inf, 7.9, -8.9, 2.5]]).astype(F32)
    with np.errstate(all="ignore"):
        want = floats.astype(dtype).view(np.uint8)
    np.testing.assert_array_equal([helpers["intn_from_float"](x, bits, signed) for x in floats], want)
    ints = np.arange(-300, 300)
    np.testing.assert_array_equal([helpers["intn_from_int"](v, bits, signed) for v in ints],
                                  ints.astype(dtype).view(np.uint8))


def test_float16_cast_keeps_nan_and_inf_under_fastmath():
    x = np.array([np.nan, np.inf, -np.inf, 1.0, -0.0, 65519, 7e4, 1e-7], F32)
    for src, dst in ((F32, np.float16), (np.float16, F32)):
        to = helper.np_dtype_to_tensor_dtype(np.dtype(dst))
        model = one_node("Cast", [("x", src, [8])], {"to": to}, out_dtypes=[dst])
        with np.errstate(over="ignore"):
            feed = x.astype(src)
        got = cuvil.compile(model).run({"x": feed})["y"]
        with np.errstate(over="ignore"):
            want = feed.astype(dst)
        np.testing.assert_array_equal(got, want)


# Cast -----------------------------------------------------------------------------------------

CASTS = [(F32, np.float64), (np.float64, F32), (F32, np.int32), (np.int64, F32), (np.int32, np.int8),
         (np.uint8, np.int64), (F32, np.bool_), (np.bool_, F32), (np.int64, np.bool_), (F32, np.float16),
         (np.float16, np.float64)]


@pytest.mark.parametrize("src,dst", CASTS, ids=[f"{np.dtype(a).name}-{np.dtype(b).name}" for a, b in CASTS])
def test_cast(src, dst):
    x = rand(3, 7, seed=1) * 20
    if np.dtype(src).kind in "iub":
        x = np.round(np.abs(x) if np.dtype(src).kind == "u" else x)
    x[0, :3] = 0
    model = one_node("Cast", [("x", src, [3, 7])], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(dst))},
                     out_dtypes=[dst], opset=13)
    assert_matches_ort(model, {"x": x.astype(src)})


def test_cast_like():
    model = one_node("CastLike", [("x", F32, [4, 5]), ("t", np.float64, [1])], out_dtypes=[np.float64], opset=15)
    assert_matches_ort(model, {"x": rand(4, 5), "t": np.zeros(1)})


# Expand, Tile, Slice ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape,target", [((3, 1), (2, 3, 4)), ((1,), (5,)), ((2, 1, 3), (2, 4, 3)), ((4,), (1, 1))])
def test_expand(shape, target):
    model = one_node("Expand", [("x", F32, list(shape))], initializers={"shape": np.array(target, I64)}, opset=13)
    assert_matches_ort(model, {"x": rand(*shape, seed=2)})


@pytest.mark.parametrize("dtype", [F32, np.int64, np.bool_])
def test_tile(dtype):
    x = (rand(2, 3, seed=3) > 0) if dtype == np.bool_ else (rand(2, 3, seed=3) * 5).astype(dtype)
    model = one_node("Tile", [("x", dtype, [2, 3])], initializers={"repeats": np.array([3, 2], I64)}, opset=13)
    assert_matches_ort(model, {"x": x})


SLICES = [([1, 0], [3, 5], [0, 1], [1, 2]), ([-1], [-100], [1], [-1]), ([0, 10], [2, -10], [0, 2], [1, -3]),
          ([2], [100], [-1], [1]), ([5], [1], [0], [-2])]


@pytest.mark.parametrize("starts,ends,axes,steps", SLICES, ids=[f"case{i}" for i in range(len(SLICES))])
def test_slice(starts, ends, axes, steps):
    inits = {"starts": np.array(starts, I64), "ends": np.array(ends, I64), "axes": np.array(axes, I64),
             "steps": np.array(steps, I64)}
    model = one_node("Slice", [("x", F32, [6, 7, 8])], initializers=inits, opset=13)
    assert_matches_ort(model, {"x": rand(6, 7, 8, seed=4)})


def test_slice_attributes_opset_9():
    model = one_node("Slice", [("x", F32, [4, 5])], {"starts": [1, 0], "ends": [3, -1], "axes": [0, 1]}, opset=9)
    assert_matches_ort(model, {"x": rand(4, 5, seed=5)})


# Pad, Split -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_modes(mode):
    inits = {"pads": np.array([0, 2, 1, 0, 1, 2], I64), "value": np.array(1.5, F32)}
    model = one_node("Pad", [("x", F32, [2, 3, 4])], {"mode": mode}, initializers=inits, opset=19)
    assert_matches_ort(model, {"x": rand(2, 3, 4, seed=6)})


def test_pad_negative_pads_and_axes():
    inits = {"pads": np.array([1, -1, 2, 1], I64), "value": np.array(0, np.int32), "axes": np.array([-1, 0], I64)}
    model = one_node("Pad", [("x", np.int32, [3, 5])], initializers=inits, opset=18)
    assert_matches_ort(model, {"x": np.arange(15, dtype=np.int32).reshape(3, 5)})


def test_pad_runtime_constant_value():
    model = one_node("Pad", [("x", F32, [2, 3]), ("v", F32, [])], initializers={"pads": np.array([1, 1, 1, 1], I64)},
                     opset=13)
    # Pad's inputs are (data, pads, value): reorder the node's inputs
    model.graph.node[0].input[:] = ["x", "pads", "v"]
    assert_matches_ort(model, {"x": rand(2, 3, seed=7), "v": np.array(-3.0, F32)})


@pytest.mark.parametrize("axis,split,n", [(1, [2, 3, 1], 3), (0, None, 2), (-1, [4, 0, 2], 3)])
def test_split(axis, split, n):
    shape = [4, 6, 6]
    inits = {"split": np.array(split, I64)} if split else None
    model = one_node("Split", [("x", F32, shape)], {"axis": axis}, initializers=inits, opset=13,
                     outputs=tuple(f"y{i}" for i in range(n)))
    assert_matches_ort(model, {"x": rand(*shape, seed=8)})


def test_split_num_outputs_uneven():
    model = one_node("Split", [("x", F32, [7, 2])], {"num_outputs": 3}, outputs=("a", "b", "c"), opset=18)
    assert_matches_ort(model, {"x": rand(7, 2, seed=9)})


# Gather family, scatter family ------------------------------------------------------------------

@pytest.mark.parametrize("axis,indices", [(0, [[0, 2], [-1, 1]]), (1, [3, 0, 3]), (-1, 2)])
def test_gather(axis, indices):
    idx = np.array(indices, I64)
    model = one_node("Gather", [("x", F32, [3, 4, 5]), ("i", I64, list(idx.shape))], {"axis": axis}, opset=13)
    assert_matches_ort(model, {"x": rand(3, 4, 5, seed=10), "i": idx})


def test_gather_constant_int32_indices():
    model = one_node("Gather", [("x", np.int64, [5, 2])], {"axis": 0},
                     initializers={"i": np.array([4, 0, 4], np.int32)}, opset=13)
    assert_matches_ort(model, {"x": np.arange(10, dtype=np.int64).reshape(5, 2)})


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(axis):
    rng = np.random.default_rng(11)
    idx = rng.integers(-3, 3, (2, 3, 2)).astype(I64)
    model = one_node("GatherElements", [("x", F32, [3, 3, 3]), ("i", I64, [2, 3, 2])], {"axis": axis}, opset=13)
    assert_matches_ort(model, {"x": rand(3, 3, 3, seed=12), "i": idx})


@pytest.mark.parametrize("batch_dims,ishape", [(0, (2, 2)), (0, (3, 1)), (1, (2, 1))])
def test_gather_nd(batch_dims, ishape):
    rng = np.random.default_rng(13)
    idx = rng.integers(0, 2, ishape).astype(I64)
    model = one_node("GatherND", [("x", F32, [2, 2, 3]), ("i", I64, list(ishape))], {"batch_dims": batch_dims}, opset=13)
    assert_matches_ort(model, {"x": rand(2, 2, 3, seed=14), "i": idx})


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
def test_scatter_elements(reduction):
    idx = np.array([[1, 0, 2], [0, 2, 1]], I64)
    model = one_node("ScatterElements", [("x", F32, [3, 3]), ("i", I64, [2, 3]), ("u", F32, [2, 3])],
                     {"axis": 0, "reduction": reduction}, opset=18)
    assert_matches_ort(model, {"x": rand(3, 3, seed=15), "i": idx, "u": rand(2, 3, seed=16)})


def test_scatter_nd():
    idx = np.array([[0], [2]], I64)
    model = one_node("ScatterND", [("x", F32, [4, 3]), ("i", I64, [2, 1]), ("u", F32, [2, 3])], opset=13)
    assert_matches_ort(model, {"x": rand(4, 3, seed=17), "i": idx, "u": rand(2, 3, seed=18)})


# Trilu, OneHot, EyeLike, DepthToSpace, SpaceToDepth ----------------------------------------------

@pytest.mark.parametrize("upper,k", [(1, 0), (0, -1), (1, 2)])
def test_trilu(upper, k):
    model = one_node("Trilu", [("x", F32, [2, 4, 5])], {"upper": upper}, initializers={"k": np.array(k, I64)},
                     opset=14)
    assert_matches_ort(model, {"x": rand(2, 4, 5, seed=19)})


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot(axis):
    idx = np.array([[0, 3, -1], [2, 1, 0]], I64)
    inits = {"depth": np.array(4, I64), "values": np.array([0.5, 2.0], F32)}
    model = one_node("OneHot", [("i", I64, [2, 3])], {"axis": axis}, initializers=inits, out_dtypes=[F32], opset=11)
    assert_matches_ort(model, {"i": idx})


def test_eye_like():
    model = one_node("EyeLike", [("x", F32, [3, 5])], {"k": 1, "dtype": TensorProto.INT32}, out_dtypes=[np.int32],
                     opset=9)
    assert_matches_ort(model, {"x": rand(3, 5)})


@pytest.mark.parametrize("op,mode", [("DepthToSpace", "DCR"), ("DepthToSpace", "CRD"), ("SpaceToDepth", None)])
def test_depth_space(op, mode):
    shape = [1, 8, 2, 3] if op == "DepthToSpace" else [1, 2, 4, 6]
    attrs = {"blocksize": 2, **({"mode": mode} if mode else {})}
    model = one_node(op, [("x", F32, shape)], attrs, opset=13)
    assert_matches_ort(model, {"x": rand(*shape, seed=20)})


# Einsum -----------------------------------------------------------------------------------------

EINSUMS = [("ij,jk->ik", [(3, 4), (4, 5)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]), ("ij->ji", [(3, 4)]),
           ("ii->i", [(4, 4)]), ("i,i", [(5,), (5,)]), ("...ij,...jk", [(2, 3, 4), (2, 4, 2)]),
           ("ij->", [(3, 4)])]


@pytest.mark.parametrize("equation,shapes", EINSUMS, ids=[e for e, _ in EINSUMS])
def test_einsum(equation, shapes):
    inputs = [(f"x{i}", F32, list(s)) for i, s in enumerate(shapes)]
    model = one_node("Einsum", inputs, {"equation": equation}, opset=12)
    assert_matches_ort(model, {f"x{i}": rand(*s, seed=21 + i) for i, s in enumerate(shapes)})


# Resize -----------------------------------------------------------------------------------------

RESIZES = [
    ({"mode": "nearest"}, [1, 1, 2, 2], None),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 1.7, 0.6], None),
    ({"mode": "linear"}, [1, 1, 0.6, 1.5], None),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, None, [1, 2, 7, 3]),
    ({"mode": "cubic"}, [1, 1, 2, 2], None),
    ({"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, [1, 1, 0.8, 0.8], None),
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, None, [1, 2, 3, 1]),
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.5, 0.6], None),
]


@pytest.mark.parametrize("attrs,scales,sizes", RESIZES, ids=[f"case{i}" for i in range(len(RESIZES))])
def test_resize(attrs, scales, sizes):
    inits = {"roi": np.array([], F32), "scales": np.array(scales if scales else [], F32)}
    if sizes:
        inits["sizes"] = np.array(sizes, I64)
    model = one_node("Resize", [("x", F32, [1, 2, 5, 4])], attrs, initializers=inits, opset=19)
    assert_matches_ort(model, {"x": rand(1, 2, 5, 4, seed=30)}, tol=1e-5)


# GridSample -------------------------------------------------------------------------------------

GRID_SAMPLES = [("bilinear", "zeros", 0), ("nearest", "border", 1), ("bicubic", "reflection", 0),
                ("bilinear", "reflection", 1)]


@pytest.mark.parametrize("mode,padding,align", GRID_SAMPLES, ids=[f"{m}-{p}-{a}" for m, p, a in GRID_SAMPLES])
def test_grid_sample(mode, padding, align):
    grid = np.random.default_rng(31).uniform(-1.3, 1.3, (2, 3, 4, 2)).astype(F32)
    model = one_node("GridSample", [("x", F32, [2, 3, 5, 6]), ("grid", F32, [2, 3, 4, 2])],
                     {"mode": mode, "padding_mode": padding, "align_corners": align}, opset=16)
    assert_matches_ort(model, {"x": rand(2, 3, 5, 6, seed=32), "grid": grid}, tol=1e-5)


# MaxUnpool, Col2Im (pool.py) ----------------------------------------------------------------------

def test_max_unpool_inverts_max_pool_indices():
    pool = helper.make_node("MaxPool", ["x"], ["v", "i"], kernel_shape=[2, 2], strides=[2, 2])
    unpool = helper.make_node("MaxUnpool", ["v", "i"], ["y"], kernel_shape=[2, 2], strides=[2, 2])
    model = make_model([pool, unpool], [("x", F32, [1, 2, 4, 6])], [("y", F32, None)], opset=11)
    assert_matches_ort(model, {"x": rand(1, 2, 4, 6, seed=33)})


@pytest.mark.parametrize("attrs", [{}, {"strides": [2, 1], "pads": [1, 0, 1, 0], "dilations": [1, 2]}])
def test_col2im(attrs):
    image, block = (5, 6), (2, 2)
    strides, pads, dilations = attrs.get("strides", [1, 1]), attrs.get("pads", [0] * 4), attrs.get("dilations", [1, 1])
    slides = [(image[a] + pads[a] + pads[2 + a] - (dilations[a] * (block[a] - 1) + 1)) // strides[a] + 1 for a in (0, 1)]
    shape = [2, 3 * 4, slides[0] * slides[1]]
    inits = {"image_shape": np.array(image, I64), "block_shape": np.array(block, I64)}
    model = one_node("Col2Im", [("x", F32, shape)], attrs, initializers=inits, opset=18)
    assert_matches_ort(model, {"x": rand(*shape, seed=34)})


# AffineGrid (resize.py) ----------------------------------------------------------------------------

@pytest.mark.parametrize("align", [0, 1])
def test_affine_grid(align):
    model = one_node("AffineGrid", [("theta", F32, [2, 2, 3])], {"align_corners": align},
                     initializers={"size": np.array([2, 3, 4, 5], I64)}, opset=20)
    assert_matches_ort(model, {"theta": rand(2, 2, 3, seed=35)}, tol=1e-5)
