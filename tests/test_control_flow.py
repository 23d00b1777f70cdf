"""If with a constant condition, Loop with a static trip count (or a condition that folds
every iteration) and Scan are compiled by inlining / unrolling at import; an If decided at
run time computes both branches and selects; results match onnxruntime."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil
from tests.helpers import assert_matches_ort, make_model, rand

F = np.float32


def _branch(op, name):
    return helper.make_graph([helper.make_node(op, ["x"], [f"{name}_out"])], name, [],
                             [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2, 3])])


def _if_model(cond_source):
    nodes = cond_source + [helper.make_node("If", ["c"], ["y"], then_branch=_branch("Relu", "then"),
                                            else_branch=_branch("Neg", "else"))]
    return nodes


@pytest.mark.parametrize("value", [True, False])
def test_if_with_constant_condition(value):
    nodes = _if_model([helper.make_node("Constant", [], ["c"], value=helper.make_tensor("v", TensorProto.BOOL, [], [value]))])
    model = make_model(nodes, [("x", F, [2, 3])], [("y", F, None)])
    assert_matches_ort(model, {"x": rand(2, 3)})


def test_if_on_a_shape_comparison_folds():
    # cond = (Shape(x)[0] == 2): known once the input shape is static.
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Equal", ["n", "two"], ["c"])]
    model = make_model(_if_model(nodes), [("x", F, [2, 3])], [("y", F, None)],
                       {"zero": np.array(0, np.int64), "two": np.array(2, np.int64)})
    assert_matches_ort(model, {"x": rand(2, 3)})


def _runtime_if_model(else_branch):
    nodes = [helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0), helper.make_node("Greater", ["t", "z"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=_branch("Relu", "then"), else_branch=else_branch)]
    return make_model(nodes, [("x", F, [2, 3])], [("y", F, None)], {"z": np.array(0, F)})


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_on_runtime_data_computes_both_branches_and_selects(sign):
    # sign picks the branch at run time: sum(x) > 0 takes Relu, else Neg (same shape: Where selects).
    feeds = {"x": (np.abs(rand(2, 3)) * sign).astype(F)}
    assert_matches_ort(_runtime_if_model(_branch("Neg", "else")), feeds)


def test_if_on_runtime_data_with_differing_shapes_is_refused():
    other = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["else_out"], keepdims=0)], "else", [],
                              [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, [])])
    with pytest.raises(cuvil.CuvilError, match="If.*run time.*in one branch.*in the other"):
        cuvil.compile(_runtime_if_model(other))


def _while_body(limit_source):
    # acc = acc * 0.5 + x while i + 1 < limit: the loop has no trip count, only a condition
    # (the form converters give tf.while_loop); the condition folds when limit is a constant.
    return helper.make_graph(
        [helper.make_node("Add", ["i", "one"], ["next"]), helper.make_node("Less", ["next", limit_source], ["cond_out"]),
         helper.make_node("Mul", ["acc_in", "half"], ["h"]), helper.make_node("Add", ["h", "x"], ["acc_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2, 3])],
        initializer=[helper.make_tensor("half", TensorProto.FLOAT, [], [0.5]),
                     helper.make_tensor("one", TensorProto.INT64, [], [1])])


def test_loop_without_trip_count_runs_while_its_condition_folds_true():
    nodes = [helper.make_node("Loop", ["", "cond", "acc0"], ["acc"], body=_while_body("limit"))]
    model = make_model(nodes, [("x", F, [2, 3]), ("acc0", F, [2, 3])], [("acc", F, None)],
                       {"cond": np.array(True), "limit": np.array(6, np.int64)})
    assert_matches_ort(model, {"x": rand(2, 3), "acc0": rand(2, 3, seed=1)})


def test_loop_whose_condition_never_folds_false_is_refused():
    nodes = [helper.make_node("Loop", ["", "cond", "acc0"], ["acc"], body=_while_body("limit"))]
    model = make_model(nodes, [("x", F, [2, 3]), ("acc0", F, [2, 3])], [("acc", F, None)],
                       {"cond": np.array(True), "limit": np.array(1 << 40, np.int64)})
    with pytest.raises(cuvil.CuvilError, match="Loop.*still holds after 4096"):
        cuvil.compile(model)


def test_loop_with_static_trip_count_and_scan_output():
    # acc = acc * 0.5 + x each iteration; scan output collects acc; iteration count 4.
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Mul", ["acc_in", "half"], ["h"]), helper.make_node("Add", ["h", "x"], ["acc_out"]),
         helper.make_node("Identity", ["acc_out"], ["scan_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("scan_out", TensorProto.FLOAT, [2, 3])],
        initializer=[helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])])
    nodes = [helper.make_node("Loop", ["trip", "cond", "acc0"], ["acc", "history"], body=body)]
    model = make_model(nodes, [("x", F, [2, 3]), ("acc0", F, [2, 3])], [("acc", F, None), ("history", F, None)],
                       {"trip": np.array(4, np.int64), "cond": np.array(True)})
    assert_matches_ort(model, {"x": rand(2, 3), "acc0": rand(2, 3, seed=1)})


@pytest.mark.parametrize("direction", [0, 1])
def test_scan_cumulative_sum(direction):
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["y_t"])],
        "body",
        [helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("y_t", TensorProto.FLOAT, [3])])
    nodes = [helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1,
                              scan_input_directions=[direction])]
    model = make_model(nodes, [("s0", F, [3]), ("xs", F, [5, 3])], [("s", F, None), ("ys", F, None)])
    assert_matches_ort(model, {"s0": rand(3), "xs": rand(5, 3, seed=4)})


@pytest.mark.parametrize("direction", [0, 1])
def test_scan8_batched_cumulative_sum(direction):
    """Scan-8: a batch axis 0 on states and scan inputs (the scan axis is 1), no sequence_lens."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]), helper.make_node("Mul", ["s_out", "x_t"], ["y_t"])],
        "body",
        [helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("y_t", TensorProto.FLOAT, [3])])
    nodes = [helper.make_node("Scan", ["", "s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1,
                              directions=[direction])]
    model = make_model(nodes, [("s0", F, [2, 3]), ("xs", F, [2, 4, 3])], [("s", F, [2, 3]), ("ys", F, [2, 4, 3])],
                       opset=8)
    assert_matches_ort(model, {"s0": rand(2, 3), "xs": rand(2, 4, 3, seed=5)})


# -- Loops decided at run time: compiled as a C loop (LoopBegin / LoopEnd) ------------------------

def _runtime_loop_body():
    """(i, cond, y) -> (sum(y') < limit, y') with y' = y * 1.5 + i: the condition depends on the data."""
    return helper.make_graph(
        [helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["y", "k"], ["y2"]),
         helper.make_node("Add", ["y2", "fi"], ["y_out"]),
         helper.make_node("ReduceSum", ["y_out"], ["s"], keepdims=0),
         helper.make_node("Less", ["s", "limit"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 64])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("y_out", TensorProto.FLOAT, [16, 64])],
        [helper.make_tensor("k", TensorProto.FLOAT, [], [1.5])])


@pytest.mark.parametrize("threads", [1, 2])
def test_loop_with_run_time_trip_count_and_condition_is_compiled_as_a_loop(threads):
    from tests.helpers import run_ort
    nodes = [helper.make_node("Loop", ["M", "cond", "y0"], ["y"], body=_runtime_loop_body())]
    model = make_model(nodes, [("M", np.int64, []), ("cond", np.bool_, []), ("y0", F, [16, 64]), ("limit", F, [])],
                       [("y", F, [16, 64])])
    compiled = cuvil.compile(model, threads=threads)
    # the body's 5 nodes are in the library once (at most one kernel each), not once per iteration
    assert compiled.info["steps"] <= 5
    y0 = np.abs(rand(16, 64))
    for trip, cond, limit in ((10, True, 5e4), (3, True, 1e9), (0, True, 1.0), (50, False, 1.0), (200, True, 1e30)):
        feeds = {"M": np.array(trip, np.int64), "cond": np.array(cond), "y0": y0, "limit": np.array(limit, F)}
        want = run_ort(model, feeds)["y"]
        got = compiled.run(feeds)["y"]
        # the same float32 operations in the same order (elementwise; the sum only decides when to
        # stop, and it is far from the limits above): the results agree to float32 rounding
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_while_loop_without_trip_count_on_run_time_data():
    nodes = [helper.make_node("Loop", ["", "cond", "y0"], ["y"], body=_runtime_loop_body())]
    model = make_model(nodes, [("cond", np.bool_, []), ("y0", F, [16, 64]), ("limit", F, [])], [("y", F, [16, 64])])
    feeds = {"cond": np.array(True), "y0": np.abs(rand(16, 64, seed=3)), "limit": np.array(3e5, F)}
    assert_matches_ort(model, feeds, tol=1e-6)


def test_run_time_loop_with_a_scan_output_is_refused():
    body = _runtime_loop_body()
    body.output.append(helper.make_tensor_value_info("y_out", TensorProto.FLOAT, [16, 64]))
    nodes = [helper.make_node("Loop", ["M", "", "y0"], ["y", "ys"], body=body)]
    model = make_model(nodes, [("M", np.int64, []), ("y0", F, [16, 64]), ("limit", F, [])],
                       [("y", F, [16, 64]), ("ys", F, None)])
    from cuvil.errors import UnsupportedOpError
    with pytest.raises(UnsupportedOpError, match="scan output"):
        cuvil.compile(model)
