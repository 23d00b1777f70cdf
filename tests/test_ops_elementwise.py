"""Elementwise kernels (backends/numba_cpu/elementwise.py) against onnxruntime:
every unary and binary op, broadcasting, integer and bool dtypes, Clip at both
opset forms, LeakyRelu, HardSigmoid, HardSwish and Where.

Several ops share one model where they share inputs, to keep builds few."""
import numpy as np
import pytest
from onnx import helper

import cuvil

from tests.helpers import assert_matches_ort, make_model, rand

F32, F64, I32, I64, B = np.float32, np.float64, np.int32, np.int64, np.bool_


def ints(*shape, seed=0, dtype=I32, low=-9, high=10):
    return np.random.default_rng(seed).integers(low, high, shape).astype(dtype)


def bools(*shape, seed=0):
    return np.random.default_rng(seed).random(shape) < 0.5


def ops_model(ops, inputs, out_dtype, out_shape=None, opset=17):
    """One node per op, all reading `inputs`; output i is op i's result."""
    names = [name for name, _, _ in inputs]
    nodes = [helper.make_node(op, names, [f"y_{op}"]) for op in ops]
    return make_model(nodes, inputs, [(f"y_{op}", out_dtype, out_shape) for op in ops], opset=opset)


# Inputs chosen inside each op's domain; 3x scale so Sigmoid/Tanh/Softplus see their tails.
UNARY_FLOAT = {
    "Relu": lambda x: x, "Neg": lambda x: x, "Abs": lambda x: x,
    "Sqrt": np.abs, "Exp": lambda x: x, "Log": lambda x: np.abs(x) + 0.1,
    "Tanh": lambda x: x, "Erf": lambda x: x, "Sigmoid": lambda x: x * 40,
    "Reciprocal": lambda x: np.where(np.abs(x) < 0.1, 0.5, x), "Floor": lambda x: x, "Ceil": lambda x: x,
    "Sin": lambda x: x, "Cos": lambda x: x, "Softplus": lambda x: x * 50, "Softsign": lambda x: x,
}


@pytest.mark.parametrize("op", sorted(UNARY_FLOAT))
def test_unary_float32(op):
    x = (UNARY_FLOAT[op](rand(2, 3, 5, seed=1) * 3)).astype(F32)
    model = ops_model([op], [("x", F32, [2, 3, 5])], F32)
    assert_matches_ort(model, {"x": x})


def test_unary_float64():
    x = rand(4, 7, seed=2, dtype=F64) * 3
    model = ops_model(["Exp", "Sigmoid", "Tanh", "Floor", "Neg"], [("x", F64, [4, 7])], F64)
    assert_matches_ort(model, {"x": x}, tol=1e-10)


@pytest.mark.parametrize("dtype", [I32, I64])
def test_unary_int(dtype):
    ops = ["Abs", "Neg", "Relu"] if dtype == I32 else ["Abs", "Neg"]  # onnxruntime has no int64 Relu
    model = ops_model(ops, [("x", dtype, [3, 4])], dtype)
    assert_matches_ort(model, {"x": ints(3, 4, dtype=dtype)})


def test_not():
    model = ops_model(["Not"], [("x", B, [2, 5])], B)
    assert_matches_ort(model, {"x": bools(2, 5)})


# (shape of a, shape of b, shape of the output): same shape, scalar, row,
# column, both sides broadcast, rank mismatch, a scalar on the left.
BROADCAST = [
    ((3, 4), (3, 4), (3, 4)),
    ((3, 4), (), (3, 4)),
    ((3, 4), (4,), (3, 4)),
    ((3, 4), (3, 1), (3, 4)),
    ((3, 1), (1, 4), (3, 4)),
    ((2, 3, 4), (3, 1), (2, 3, 4)),
    ((1,), (2, 1, 5), (2, 1, 5)),
]
ARITH = ["Add", "Sub", "Mul", "Div", "Max", "Min"]


@pytest.mark.parametrize("a_shape,b_shape,out_shape", BROADCAST, ids=[f"{a}x{b}" for a, b, _ in BROADCAST])
def test_binary_float_broadcast(a_shape, b_shape, out_shape):
    model = ops_model(ARITH, [("a", F32, list(a_shape)), ("b", F32, list(b_shape))], F32)
    b = rand(*b_shape, seed=4)
    b = np.where(np.abs(b) < 0.1, np.float32(0.5), b).astype(F32)  # keep Div well conditioned
    assert_matches_ort(model, {"a": rand(*a_shape, seed=3), "b": b})


@pytest.mark.parametrize("dtype", [I32, I64])
def test_binary_int(dtype):
    # Div truncates toward zero (-7 / 2 == -3); Pow on integers.
    model = ops_model(ARITH, [("a", dtype, [3, 4]), ("b", dtype, [4])], dtype)
    b = ints(4, seed=6, dtype=dtype)
    b[b == 0] = 3
    assert_matches_ort(model, {"a": ints(3, 4, seed=5, dtype=dtype), "b": b})
    pow_model = ops_model(["Pow"], [("a", dtype, [3, 4]), ("b", dtype, [4])], dtype)
    assert_matches_ort(pow_model, {"a": ints(3, 4, seed=5, dtype=dtype), "b": np.array([0, 1, 2, 3], dtype)})


def test_pow_float():
    model = ops_model(["Pow"], [("a", F32, [3, 4]), ("b", F32, [3, 1])], F32)
    assert_matches_ort(model, {"a": np.abs(rand(3, 4, seed=7)) + 0.1, "b": rand(3, 1, seed=8)})
    # A float base with an integer exponent (Pow-12+ allows mixed types): negative bases work.
    model = ops_model(["Pow"], [("a", F32, [3, 4]), ("b", I64, [4])], F32)
    assert_matches_ort(model, {"a": rand(3, 4, seed=7), "b": np.array([0, 1, 2, 3], I64)})


@pytest.mark.parametrize("exponent", [2.0, 3.0])
def test_pow_by_a_small_constant_is_a_product(exponent):
    # x ** 2 is exact either way (one rounding of x*x); x ** 3 as x*x*x rounds twice where powf
    # rounds once: 2 u = 1.2e-7 relative at most, so tol 1e-6.
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    model = make_model([helper.make_node("Pow", ["a", "e"], ["y"])], [("a", F32, [3, 40])], [("y", F32, None)],
                       {"e": np.array([exponent], F32)})
    graph, _ = import_onnx(model)
    assert "**" not in lower(graph)[0].kernel.source
    assert_matches_ort(model, {"a": rand(3, 40, seed=7) * 3}, tol=1e-6)


COMPARE = ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]


@pytest.mark.parametrize("dtype", [F32, I64])
def test_compare_outputs_bool(dtype):
    a = ints(3, 4, seed=9, low=-2, high=3).astype(dtype)  # small ints so Equal is often true
    b = ints(3, 1, seed=10, low=-2, high=3).astype(dtype)
    model = ops_model(COMPARE, [("a", dtype, [3, 4]), ("b", dtype, [3, 1])], B)
    assert_matches_ort(model, {"a": a, "b": b})


def test_logical_bool_broadcast():
    model = ops_model(["And", "Or", "Xor", "Equal"], [("a", B, [2, 3, 4]), ("b", B, [4])], B)
    assert_matches_ort(model, {"a": bools(2, 3, 4, seed=1), "b": bools(4, seed=2)})


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_variadic(op):
    shapes = [(2, 3, 4), (4,), (3, 1)]
    nodes = [helper.make_node(op, ["a", "b", "c"], ["y3"]), helper.make_node(op, ["a"], ["y1"])]
    model = make_model(nodes, [(n, F32, list(s)) for n, s in zip("abc", shapes)],
                       [("y3", F32, None), ("y1", F32, None)])
    assert_matches_ort(model, {n: rand(*s, seed=i) for i, (n, s) in enumerate(zip("abc", shapes))})


def test_prelu_slope_per_channel():
    model = ops_model(["PRelu"], [("x", F32, [2, 3, 4, 4]), ("slope", F32, [3, 1, 1])], F32)
    assert_matches_ort(model, {"x": rand(2, 3, 4, 4), "slope": rand(3, 1, 1, seed=1)})


def test_scalar_and_long_vector():
    # Rank 0 (one element) and a 1-D tensor longer than one work block.
    model = ops_model(["Add"], [("a", F32, []), ("b", F32, [])], F32)
    assert_matches_ort(model, {"a": np.array(1.5, F32), "b": np.array(-0.25, F32)})
    model = ops_model(["Mul"], [("a", F32, [5000]), ("b", F32, [5000])], F32)
    assert_matches_ort(model, {"a": rand(5000, seed=1), "b": rand(5000, seed=2)})


def test_threads_split_the_work():
    model = ops_model(["Sub"], [("a", F32, [5000]), ("b", F32, [])], F32)
    assert_matches_ort(model, {"a": rand(5000, seed=1), "b": np.array(0.5, F32)}, threads=3)
    model = ops_model(["Add"], [("a", F32, [9, 7, 5]), ("b", F32, [7, 1])], F32)
    assert_matches_ort(model, {"a": rand(9, 7, 5, seed=1), "b": rand(7, 1, seed=2)}, threads=4)


# Clip -----------------------------------------------------------------------

@pytest.mark.parametrize("attrs", [{}, {"min": -0.5}, {"max": 0.25}, {"min": -0.5, "max": 0.25}],
                         ids=["none", "min", "max", "both"])
def test_clip_opset6_attributes(attrs):
    node = helper.make_node("Clip", ["x"], ["y"], **attrs)
    model = make_model([node], [("x", F32, [3, 5])], [("y", F32, [3, 5])], opset=6)
    assert_matches_ort(model, {"x": rand(3, 5)})


@pytest.mark.parametrize("bounds", [("lo", ""), ("", "hi"), ("lo", "hi"), ("lo",)], ids=["min", "max", "both", "min-only-input"])
def test_clip_opset11_inputs(bounds):
    node = helper.make_node("Clip", ["x", *bounds], ["y"])
    inits = {"lo": np.array(-0.5, F32), "hi": np.array(0.25, F32)}
    model = make_model([node], [("x", F32, [3, 5])], [("y", F32, [3, 5])],
                       initializers={k: v for k, v in inits.items() if k in bounds}, opset=13)
    assert_matches_ort(model, {"x": rand(3, 5)})


def test_clip_bounds_computed_at_run_time():
    node = helper.make_node("Clip", ["x", "lo", "hi"], ["y"])
    model = make_model([node], [("x", F32, [3, 5]), ("lo", F32, []), ("hi", F32, [])], [("y", F32, [3, 5])], opset=13)
    assert_matches_ort(model, {"x": rand(3, 5), "lo": np.array(-0.3, F32), "hi": np.array(0.4, F32)})


@pytest.mark.parametrize("dtype", [I32, I64])
def test_clip_int(dtype):
    # int64 bounds at the type's limits must be exact (no float rounding).
    info = np.iinfo(dtype)
    node = helper.make_node("Clip", ["x", "lo", "hi"], ["y"])
    inits = {"lo": np.array(-3, dtype), "hi": np.array(info.max, dtype)}
    model = make_model([node], [("x", dtype, [3, 5])], [("y", dtype, [3, 5])], initializers=inits, opset=13)
    x = ints(3, 5, dtype=dtype)
    x[0, 0] = info.max
    assert_matches_ort(model, {"x": x})


# Activations with attributes, and Where ----------------------------------------

@pytest.mark.parametrize("op,attrs,opset", [
    ("LeakyRelu", {}, 17), ("LeakyRelu", {"alpha": 0.3}, 17),
    ("HardSigmoid", {}, 17), ("HardSigmoid", {"alpha": 0.1, "beta": 0.6}, 17),
    ("HardSwish", {}, 17),
], ids=["leaky-default", "leaky-0.3", "hardsigmoid-default", "hardsigmoid-attrs", "hardswish"])
def test_activation_attributes(op, attrs, opset):
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    model = make_model([node], [("x", F32, [2, 3, 7])], [("y", F32, [2, 3, 7])], opset=opset)
    assert_matches_ort(model, {"x": rand(2, 3, 7) * 5})


def where_model(dtype):
    node = helper.make_node("Where", ["c", "x", "y"], ["z"])
    return make_model([node], [("c", B, [3, 1]), ("x", dtype, [2, 3, 4]), ("y", dtype, [4])], [("z", dtype, [2, 3, 4])])


@pytest.mark.parametrize("dtype", [F32, I64])
def test_where_broadcast(dtype):
    make = {F32: lambda *s, seed: rand(*s, seed=seed), I64: lambda *s, seed: ints(*s, seed=seed, dtype=I64)}[dtype]
    assert_matches_ort(where_model(dtype), {"c": bools(3, 1, seed=3), "x": make(2, 3, 4, seed=4), "y": make(4, seed=5)})


def test_where_bool_values():
    # onnxruntime has no bool Where: numpy is the reference.
    feeds = {"c": bools(3, 1, seed=3), "x": bools(2, 3, 4, seed=4), "y": bools(4, seed=5)}
    got = cuvil.compile(where_model(B)).run(feeds)["z"]
    assert got.dtype == B
    np.testing.assert_array_equal(got, np.where(feeds["c"], feeds["x"], feeds["y"]))
