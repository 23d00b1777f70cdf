"""fold_qdq: quantised products into FusedMatMulInteger (Before / Expected op counts, must-not-fire
cases, numbers against onnxruntime on the same file).

Tolerances, derived:
- quantize_dynamic's form (float output): the fused kernel rounds as onnxruntime's unfused graph
  does (Cast, Mul of the scales, Mul, Add, each in float32, no fused multiply-add), so it equals
  onnxruntime with its graph optimisations off bit for bit.
- QDQ with a quantised output: both engines requantise the same int32 sums (bias included) with
  the float32 multiplier s_x s_w / s_y and round half to even (onnxruntime's QDQ transformer
  makes the same integer op), so the bytes are equal.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from cuvil.frontends.onnx import import_onnx
from passes.fold_qdq import fold_qdq
from tests.helpers import make_model, run_ort

import cuvil

F32, U8, I8 = np.float32, np.uint8, np.int8
M, K, N = 6, 32, 20


def _ints(shape, dtype, seed):
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def dynamic_model(bias=True, shared_product=False):
    """What quantize_dynamic writes for x @ W + b (W int8, per tensor)."""
    w_scale = np.array(0.0123, F32)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["scale"]),
             helper.make_node("Mul", ["accf", "scale"], ["prod"])]
    outputs = [("y", F32, None)]
    if bias:
        nodes.append(helper.make_node("Add", ["b", "prod"], ["y"]))
    else:
        nodes[-1].output[0] = "y"
    if shared_product:
        outputs.append(("acc", np.int32, None))
    inits = {"w": _ints((K, N), I8, 1), "wz": np.array(0, I8), "ws": w_scale,
             "b": np.random.default_rng(2).standard_normal(N).astype(F32)}
    model = make_model(nodes, [("x", F32, [M, K])], outputs, initializers=inits, opset=13)
    return model, {"x": np.random.default_rng(3).standard_normal((M, K)).astype(F32)}


def qdq_model(op="MatMul", activations=U8, bias_scale_matches=True, runtime_weight=False):
    """What quantize_static writes for a product: DQ(x), DQ(W) per channel, DQ(int32 bias), Q(y)."""
    rng = np.random.default_rng(4)
    sx, zx = np.array(0.02, F32), np.array(128 if activations == U8 else 3, activations)
    sw = rng.uniform(0.001, 0.01, N).astype(F32)
    w = _ints((N, K) if op == "Gemm" else (K, N), I8, 5)
    bias = rng.integers(-3000, 3000, N).astype(np.int32)
    bs = sx * sw if bias_scale_matches else sx * sw * F32(1.5)
    axis = 0 if op == "Gemm" else 1
    nodes = [helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xf"]),
             helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wf"], axis=axis),
             helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bf"], axis=0)]
    if op == "Gemm":
        nodes.append(helper.make_node("Gemm", ["xf", "wf", "bf"], ["mm"], transB=1))
    else:
        nodes += [helper.make_node("MatMul", ["xf", "wf"], ["mm0"]), helper.make_node("Add", ["mm0", "bf"], ["mm"])]
    nodes += [helper.make_node("QuantizeLinear", ["mm", "sy", "zy"], ["y"])]
    inits = {"sx": sx, "zx": zx, "sw": sw, "zw": np.zeros(N, I8), "b": bias, "bs": bs, "bz": np.zeros(N, np.int32),
             "sy": np.array(0.05, F32), "zy": np.array(100 if activations == U8 else -7, activations)}
    inputs = [("xq", activations, [M, K])]
    if runtime_weight:
        inputs.append(("w", I8, list(w.shape)))
    else:
        inits["w"] = w
    model = make_model(nodes, inputs, [("y", activations, None)], initializers=inits, opset=13)
    feeds = {"xq": _ints((M, K), activations, 6)}
    if runtime_weight:
        feeds["w"] = w
    return model, feeds


def _fused(model) -> int:
    graph, _ = import_onnx(model)
    after = fold_qdq(graph)
    return sum(1 for n in after.nodes if n.op == "FusedMatMulInteger"), graph, after


@pytest.mark.parametrize("bias", [True, False])
def test_dynamic_quantisation_folds_and_equals_onnxruntime_unfused(bias):
    model, feeds = dynamic_model(bias=bias)
    fused, before, after = _fused(model)
    assert fused == 1
    assert not {"MatMulInteger", "Cast"} & {n.op for n in after.nodes}
    assert "Add" not in {n.op for n in after.nodes}
    want = run_ort(model, feeds, optimize=False)["y"]
    np.testing.assert_array_equal(cuvil.compile(model).run(feeds)["y"], want)
    # the scalar loops (no VNNI) compile with fast-math: the product and the bias may fuse into one
    # multiply-add and the two scales may be applied one after the other, a rounding more or less
    # on each: |diff| <= 2 u (|float(acc) * scale| + |y|), u = 2^-24, the product being y - bias
    got = cuvil.compile(model, target="x86_64-avx512").run(feeds)["y"].astype(np.float64)
    product = want.astype(np.float64) - bias_of(model)
    bound = 2.0 ** -23 * (np.abs(product) + np.abs(want))
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) - bound))


def bias_of(model):
    from onnx import numpy_helper
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return inits["b"].astype(np.float64) if any(n.op_type == "Add" for n in model.graph.node) else 0.0


@pytest.mark.parametrize("op,activations", [("MatMul", U8), ("Gemm", U8), ("MatMul", I8)])
def test_qdq_product_folds_and_equals_onnxruntime(op, activations):
    model, feeds = qdq_model(op, activations)
    fused, _, after = _fused(model)
    assert fused == 1
    assert not {"MatMul", "Gemm", "QuantizeLinear", "Add"} & {n.op for n in after.nodes}
    for target in ("native", "x86_64-avx512"):
        got = cuvil.compile(model, target=target).run(feeds)["y"]
        np.testing.assert_array_equal(got, run_ort(model, feeds)["y"], err_msg=target)


def test_must_not_fire():
    # the int32 product is also a graph output: it cannot disappear into the fused node
    assert _fused(dynamic_model(shared_product=True)[0])[0] == 0
    # the bias is not in the products' scale: its int32 values cannot join the sums
    assert _fused(qdq_model(bias_scale_matches=False)[0])[0] == 0
    # the weight is computed at run time
    model, _ = qdq_model(runtime_weight=True)
    fused, before, after = _fused(model)
    assert fused == 0 and after is before


def test_what_does_not_fold_stays_correct():
    model, feeds = qdq_model(bias_scale_matches=False)
    got = cuvil.compile(model).run(feeds)["y"]
    want = run_ort(model, feeds, optimize=False)["y"]
    # float emulation both sides, differently ordered float32 sums: a value within rounding of a
    # .5 boundary of y / s_y may land on the neighbouring step, never further
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


def _dq(x, s, z):
    return helper.make_node("DequantizeLinear", [x, s, z], [x + "_f"])


def _q(x, s, z, y):
    return helper.make_node("QuantizeLinear", [x, s, z], [y])


def qdq_conv_model(activations=U8, bias=True, group=1):
    """quantize_static's Conv: DQ(x), DQ(W) per output channel, DQ(int32 bias), Q(y); then its
    MaxPool (Q with the input's own scale) and a residual Add of two quantised tensors."""
    rng = np.random.default_rng(7)
    C, OC = 8, 8
    sx, zx = np.array(0.03, F32), np.array(120 if activations == U8 else -2, activations)
    sw = rng.uniform(0.002, 0.02, OC).astype(F32)
    inits = {"sx": sx, "zx": zx, "w": _ints((OC, C // group, 3, 3), I8, 8), "sw": sw, "zw": np.zeros(OC, I8),
             "b": rng.integers(-500, 500, OC).astype(np.int32), "bs": sx * sw, "bz": np.zeros(OC, np.int32),
             "sy": np.array(0.08, F32), "zy": np.array(110 if activations == U8 else 3, activations)}
    nodes = [_dq("xq", "sx", "zx"), helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["w_f"], axis=0),
             helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["b_f"], axis=0),
             helper.make_node("Conv", ["xq_f", "w_f"] + (["b_f"] if bias else []), ["c"], pads=[1, 1, 1, 1], group=group),
             _q("c", "sy", "zy", "cq"), _dq("cq", "sy", "zy"),
             helper.make_node("MaxPool", ["cq_f"], ["p"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]),
             _q("p", "sy", "zy", "pq"), _dq("pq", "sy", "zy"),
             helper.make_node("Add", ["pq_f", "xq_f"], ["s"]), _q("s", "sy", "zy", "y")]
    model = make_model(nodes, [("xq", activations, [1, C, 9, 9])], [("y", activations, None)], initializers=inits,
                       opset=13)
    return model, {"xq": _ints((1, C, 9, 9), activations, 9)}


@pytest.mark.parametrize("activations", [U8, I8])
def test_qdq_conv_maxpool_add_fold_into_integer_ops(activations):
    """Each becomes an integer op and the chain matches onnxruntime's integer path: the conv's bytes
    exactly (same int32 sums, same float32 requantisation), the Add within one step of its output
    (the reciprocal multiply against onnxruntime's division, see quant.lower_qlinear_add)."""
    model, feeds = qdq_conv_model(activations)
    fused, before, after = _fused(model)
    ops = [n.op for n in after.nodes]
    assert ops.count("QLinearConv") == 1 and ops.count("QLinearAdd") == 1 and "Conv" not in ops
    assert not {"QuantizeLinear", "Add"} & set(ops) and ops.count("MaxPool") == 1
    maxpool = next(n for n in after.nodes if n.op == "MaxPool")
    assert np.dtype(after.values[maxpool.inputs[0]].dtype) == np.dtype(activations)
    got = cuvil.compile(model).run(feeds)["y"].astype(np.int32)
    want = run_ort(model, feeds)["y"].astype(np.int32)
    assert np.abs(got - want).max() <= 1
    assert np.mean(got == want) >= 0.95


def test_grouped_convs_stay_in_float():
    model, feeds = qdq_conv_model(group=2)
    fused, before, after = _fused(model)
    assert "QLinearConv" not in [n.op for n in after.nodes] and "Conv" in [n.op for n in after.nodes]
    got = cuvil.compile(model).run(feeds)["y"].astype(np.int32)
    assert np.abs(got - run_ort(model, feeds, optimize=False)["y"].astype(np.int32)).max() <= 1


@pytest.mark.parametrize("op", ["Relu", "Clip"])
def test_quantised_activation_becomes_a_table(op):
    """Q(Relu|Clip(DQ(x))) with other output parameters: 256 inputs, a build-time table of
    onnxruntime's own arithmetic (cuvil/evaluate.py), so the bytes equal its float path's."""
    inits = {"s": np.array(0.05, F32), "z": np.array(120, U8), "s2": np.array(0.03, F32), "z2": np.array(7, U8),
             "lo": np.array(-0.5, F32), "hi": np.array(2.0, F32)}
    act = helper.make_node("Clip", ["xq_f", "lo", "hi"], ["a"]) if op == "Clip" else helper.make_node("Relu", ["xq_f"], ["a"])
    nodes = [_dq("xq", "s", "z"), act, _q("a", "s2", "z2", "y")]
    model = make_model(nodes, [("xq", U8, [4, 64])], [("y", U8, None)], initializers=inits, opset=13)
    fused, before, after = _fused(model)
    ops = [n.op for n in after.nodes]   # the DequantizeLinear, now unread, is eliminate_dead's
    assert "QLookup" in ops and not {op, "QuantizeLinear"} & set(ops)
    feeds = {"xq": np.arange(256, dtype=U8).reshape(4, 64)}
    np.testing.assert_array_equal(cuvil.compile(model).run(feeds)["y"], run_ort(model, feeds, optimize=False)["y"])


def test_check_names_the_quantised_ops_that_stay_in_float(tmp_path, capsys):
    """`cuvil check` lists, per target, each quantised op not on an int8 kernel and what it runs as:
    a grouped (not depthwise) QDQ Conv stays float32 between its DequantizeLinear and
    QuantizeLinear; on a target without VNNI the integer products are exact scalar loops."""
    from cuvil.cli import main
    model, _ = qdq_conv_model(group=2)
    (tmp_path / "grouped.onnx").write_bytes(model.SerializeToString())
    dense, _ = qdq_model()
    (tmp_path / "dense.onnx").write_bytes(dense.SerializeToString())
    (tmp_path / "cuvil.yaml").write_text(
        "version: 1\nmodels:\n"
        "  - name: grouped\n    source: grouped.onnx\n    inputs: {xq: [1, 8, 9, 9]}\n"
        "  - name: dense\n    source: dense.onnx\n    inputs: {xq: [6, 32]}\n    targets: [native, x86_64-avx512]\n")
    assert main(["check", "-f", str(tmp_path / "cuvil.yaml")]) == 0
    out = capsys.readouterr().out
    grouped, dense_part = out.split("\ndense")
    assert "not int8: node" in grouped and "(DequantizeLinear): its readers (Conv) run in float32" in grouped
    native, generic = dense_part.split("x86_64-avx512:")
    assert "not int8" not in native
    assert "(FusedMatMulInteger): no int8 kernel for it on this target" in generic


def test_a_folded_conv_on_a_target_without_vnni_runs_its_qdq_form_in_float():
    """x86_64-avx512 (Skylake-X, no VNNI): the QLinearConv fold_qdq made computes as the QDQ graph
    did, on the float conv kernels, so it matches onnxruntime's float path (within a step: float32
    sums in another order) and is not the slow scalar integer loops."""
    from cuvil.explain import explain_model
    model, feeds = qdq_conv_model()
    labels = [k.precision for k in explain_model(model, target="x86_64-avx512").kernels]
    assert any(label.startswith("float32 (the QDQ form") for label in labels)
    got = cuvil.compile(model, target="x86_64-avx512").run(feeds)["y"].astype(np.int32)
    assert np.abs(got - run_ort(model, feeds, optimize=False)["y"].astype(np.int32)).max() <= 1


@pytest.mark.parametrize("op,attrs", [("Flatten", {}), ("Transpose", {"perm": [0, 2, 3, 1]})])
def test_requantising_a_moved_tensor_with_its_own_parameters_is_the_op_on_bytes(op, attrs):
    """Q(op(DQ(x))) with DQ's scale and zero point, op only moving elements: the op on the bytes,
    which are exactly onnxruntime's."""
    inits = {"s": np.array(0.05, F32), "z": np.array(120, U8)}
    nodes = [_dq("xq", "s", "z"), helper.make_node(op, ["xq_f"], ["m"], **attrs), _q("m", "s", "z", "y")]
    model = make_model(nodes, [("xq", U8, [1, 3, 4, 5])], [("y", U8, None)], initializers=inits, opset=13)
    fused, before, after = _fused(model)
    ops = [n.op for n in after.nodes]
    assert op in ops and "QuantizeLinear" not in ops
    moved = next(n for n in after.nodes if n.op == op)
    assert np.dtype(after.values[moved.inputs[0]].dtype) == np.uint8
    feeds = {"xq": _ints((1, 3, 4, 5), U8, 3)}
    np.testing.assert_array_equal(cuvil.compile(model).run(feeds)["y"], run_ort(model, feeds)["y"])
