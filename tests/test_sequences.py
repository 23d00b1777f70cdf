"""Sequence- and optional-typed values (cuvil/frontends/sequences.py, docs/sequences.md): each op
against onnxruntime on models made here, the C ABI / runtime form of sequence inputs and outputs,
the refusals of what is data-dependent, and ONNX's node tests of these ops through the backend.

Tolerances: every lowering here is data movement (Identity, Slice, Gather, Concat) around float32
elementwise ops that both engines compute in float32 with one rounding, so outputs agree to float32
rounding: rtol 1e-6 (a few ulp), atol 1e-7.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil.backend import run_node_test
from cuvil.errors import CuvilError, ShapeError, UnsupportedOpError
from tests.helpers import run_ort

RTOL, ATOL = 1e-6, 1e-7
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=18):
    graph = helper.make_graph(nodes, "seq", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def _const(name, value):
    return onnx.numpy_helper.from_array(np.asarray(value), name)


def _seq(name, elem=F, shape=None):
    return helper.make_tensor_sequence_value_info(name, elem, shape)


def _close(got, want):
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            _close(g, w)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def _check(model, feeds, input_shapes=None):
    lib = cuvil.compile(model, input_shapes=input_shapes)
    got, want = lib.run(feeds), run_ort(model, feeds)
    assert list(got) == list(want)
    for name in want:
        _close(got[name], want[name])
    return lib


def test_split_map_concat_matches_onnxruntime():
    body = helper.make_graph([helper.make_node("Relu", ["e"], ["r"]), helper.make_node("Mul", ["r", "e"], ["o"])],
                             "body", [helper.make_tensor_value_info("e", F, None)],
                             [helper.make_tensor_value_info("o", F, None)])
    model = _model([helper.make_node("SplitToSequence", ["x", "split"], ["s"], axis=0),
                    helper.make_node("SequenceMap", ["s"], ["m"], body=body),
                    helper.make_node("SequenceLength", ["m"], ["n"]),
                    helper.make_node("ConcatFromSequence", ["m"], ["y"], axis=0),
                    helper.make_node("SplitToSequence", ["x"], ["rows"], axis=1, keepdims=0),
                    helper.make_node("ConcatFromSequence", ["rows"], ["t"], axis=0, new_axis=1)],
                   [helper.make_tensor_value_info("x", F, [6, 4])],
                   [helper.make_tensor_value_info("y", F, [6, 4]), helper.make_tensor_value_info("n", TensorProto.INT64, []),
                    helper.make_tensor_value_info("t", F, [4, 6])],
                   [_const("split", np.array([1, 2, 3], np.int64))])
    _check(model, {"x": np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)})


def test_construct_insert_erase_at_match_onnxruntime():
    model = _model([helper.make_node("SequenceConstruct", ["a", "b"], ["s"]),
                    helper.make_node("SequenceInsert", ["s", "c", "zero"], ["s2"]),
                    helper.make_node("SequenceErase", ["s2", "last"], ["s3"]),
                    helper.make_node("SequenceAt", ["s3", "one"], ["at"]),
                    helper.make_node("SequenceLength", ["s3"], ["n"]),
                    helper.make_node("ConcatFromSequence", ["s3"], ["cat"], axis=-1, new_axis=1),
                    helper.make_node("SequenceEmpty", [], ["e"]),
                    helper.make_node("SequenceInsert", ["e", "a"], ["e1"]),
                    helper.make_node("SequenceAt", ["e1", "last"], ["first"])],
                   [helper.make_tensor_value_info(n, F, [2, 3]) for n in "abc"],
                   [helper.make_tensor_value_info("at", F, [2, 3]), helper.make_tensor_value_info("n", TensorProto.INT64, []),
                    helper.make_tensor_value_info("cat", F, [2, 3, 2]), helper.make_tensor_value_info("first", F, [2, 3])],
                   [_const("zero", np.array(0, np.int64)), _const("one", np.array(1, np.int64)),
                    _const("last", np.array(-1, np.int64))])
    rng = np.random.default_rng(1)
    _check(model, {n: rng.standard_normal((2, 3)).astype(np.float32) for n in "abc"})


def _sigmoid_map_model():
    body = helper.make_graph([helper.make_node("Sigmoid", ["e"], ["o"])], "body",
                             [helper.make_tensor_value_info("e", F, None)], [helper.make_tensor_value_info("o", F, None)])
    return _model([helper.make_node("SequenceMap", ["x"], ["y"], body=body),
                   helper.make_node("ConcatFromSequence", ["y"], ["total"], axis=0)],
                  [_seq("x", F, ["n", 3])], [_seq("y", F, None), helper.make_tensor_value_info("total", F, None)])


def test_sequence_input_and_output_cross_the_abi_as_tensors():
    model = _sigmoid_map_model()
    rng = np.random.default_rng(2)
    feeds = {"x": [rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)]}
    lib = _check(model, feeds, input_shapes={"x[0]": [2, 3], "x[1]": [4, 3]})
    assert lib.input_names == ["x[0]", "x[1]"]
    assert [o["name"] for o in lib.info["outputs"]] == ["y[0]", "y[1]", "total"]
    assert lib.info["structure"] == {
        "inputs": [{"name": "x", "kind": "sequence", "dtype": "float32", "tensors": ["x[0]", "x[1]"]}],
        "outputs": [{"name": "y", "kind": "sequence", "dtype": "float32", "tensors": ["y[0]", "y[1]"]}]}
    header = next(f for f in lib.artifacts.files if f.suffix == ".h").read_text()
    assert "input 'x' is a sequence of 2 float32 tensor(s): inputs ['x[0]', 'x[1]']" in header
    # the tensors may also be given one by one, under their ABI names
    flat = lib.run({"x[0]": feeds["x"][0], "x[1]": feeds["x"][1]})
    _close(flat["y"], lib.run(feeds)["y"])
    tensors = lib.run_tensors({"x[0]": feeds["x"][0], "x[1]": feeds["x"][1]})  # what `cuvil run` writes
    assert list(tensors) == ["y[0]", "y[1]", "total"]
    _close([tensors["y[0]"], tensors["y[1]"]], flat["y"])
    with pytest.raises(CuvilError, match="a sequence of 2 tensors, got 3"):
        lib.run({"x": feeds["x"] + feeds["x"][:1]})


def test_untyped_sequence_output_is_returned_as_a_list():
    model = _model([helper.make_node("SplitToSequence", ["x"], ["s"], axis=1, keepdims=1)],
                   [helper.make_tensor_value_info("x", F, [2, 3])], [helper.make_empty_tensor_value_info("s")])
    lib = _check(model, {"x": np.random.default_rng(7).standard_normal((2, 3)).astype(np.float32)})
    assert lib.info["structure"]["outputs"] == [{"name": "s", "kind": "sequence", "dtype": "float32",
                                                 "tensors": ["s[0]", "s[1]", "s[2]"]}]


def test_sequence_input_needs_its_element_shapes():
    with pytest.raises(ShapeError, match=r"input 'x' is a sequence") as info:
        cuvil.compile(_sigmoid_map_model())
    assert "x[0]" in str(info.value)


def test_loop_carrying_a_sequence_is_unrolled_and_matches_onnxruntime():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Cast", ["i"], ["fi"], to=F),
         helper.make_node("Mul", ["x", "fi"], ["scaled"]),
         helper.make_node("SequenceInsert", ["seq_in", "scaled"], ["seq_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []), _seq("seq_in", F, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _seq("seq_out", F, None)])
    model = _model([helper.make_node("SequenceEmpty", [], ["empty"], dtype=F),
                    helper.make_node("Loop", ["trips", "yes", "empty"], ["built"], body=body),
                    helper.make_node("ConcatFromSequence", ["built"], ["y"], axis=0, new_axis=1)],
                   [helper.make_tensor_value_info("x", F, [5])], [helper.make_tensor_value_info("y", F, [3, 5])],
                   [_const("trips", np.array(3, np.int64)), _const("yes", np.array(True))])
    _check(model, {"x": np.random.default_rng(3).standard_normal(5).astype(np.float32)})


def test_run_time_if_selects_sequences_element_by_element():
    def branch(tag, ops):
        nodes = [helper.make_node(op, ["x"], [f"{tag}{k}"]) for k, op in enumerate(ops)]
        nodes.append(helper.make_node("SequenceConstruct", [f"{tag}{k}" for k in range(len(ops))], [f"{tag}_seq"]))
        return helper.make_graph(nodes, tag, [], [_seq(f"{tag}_seq", F, [2, 3])])
    model = _model([helper.make_node("If", ["c"], ["s"], then_branch=branch("t", ["Relu", "Neg"]),
                                     else_branch=branch("e", ["Sigmoid", "Abs"])),
                    helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0)],
                   [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("x", F, [2, 3])],
                   [_seq("s", F, [2, 3]), helper.make_tensor_value_info("y", F, [4, 3])])
    x = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
    lib = cuvil.compile(model)
    for c in (True, False):
        feeds = {"c": np.array(c), "x": x}
        got, want = lib.run(feeds), run_ort(model, feeds)
        _close(got["s"], want["s"])
        _close(got["y"], want["y"])


def test_optionals_match_onnxruntime():
    model = _model([helper.make_node("Optional", ["x"], ["o"]),
                    helper.make_node("OptionalHasElement", ["o"], ["has"]),
                    helper.make_node("OptionalGetElement", ["o"], ["got"]),
                    helper.make_node("Add", ["got", "got"], ["y"])],
                   [helper.make_tensor_value_info("x", F, [3, 2])],
                   [helper.make_tensor_value_info("y", F, [3, 2]), helper.make_tensor_value_info("has", TensorProto.BOOL, [])])
    _check(model, {"x": np.random.default_rng(4).standard_normal((3, 2)).astype(np.float32)})


def test_optional_input_present_or_empty_matches_onnxruntime():
    then = helper.make_graph([helper.make_node("OptionalGetElement", ["o"], ["g"]), helper.make_node("Relu", ["g"], ["t"])],
                             "then", [], [helper.make_tensor_value_info("t", F, [3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", F, [3])])
    optional = helper.make_value_info("o", helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [3])))
    model = _model([helper.make_node("OptionalHasElement", ["o"], ["has"]),
                    helper.make_node("If", ["has"], ["y"], then_branch=then, else_branch=other)],
                   [optional, helper.make_tensor_value_info("x", F, [3])],
                   [helper.make_tensor_value_info("y", F, [3]), helper.make_tensor_value_info("has", TensorProto.BOOL, [])])
    rng = np.random.default_rng(6)
    x, o = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    present = _check(model, {"o": o, "x": x})
    assert present.input_names == ["o", "x"]
    assert present.info["structure"]["inputs"][0] == {"name": "o", "kind": "optional", "dtype": "float32",
                                                      "tensors": ["o"], "present": True}
    empty = _check(model, {"o": None, "x": x}, input_shapes={"o": None})
    assert empty.input_names == ["x"]
    with pytest.raises(CuvilError, match="an optional built empty"):
        empty.run({"o": o, "x": x})


def test_tensor_only_library_has_no_structure():
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", F, [2])],
                   [helper.make_tensor_value_info("y", F, [2])])
    lib = cuvil.compile(model)
    assert "structure" not in lib.info
    assert " is a sequence" not in next(f for f in lib.artifacts.files if f.suffix == ".h").read_text()


@pytest.mark.parametrize("case", ["position", "loop", "tensor_op", "if"])
def test_data_dependent_structure_is_refused_naming_the_node(case):
    s = [helper.make_node("SequenceConstruct", ["x", "x"], ["s"], name="make")]
    inputs = [helper.make_tensor_value_info("x", F, [2])]
    if case == "position":
        nodes = s + [helper.make_node("SequenceAt", ["s", "pos"], ["y"], name="pick")]
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, []))
        match = r"node 'pick' \(SequenceAt\): its position 'pos' is known only at run time"
    elif case == "loop":
        body = helper.make_graph(
            [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("SequenceInsert", ["q", "x"], ["q2"]),
             helper.make_node("Identity", ["t"], ["t2"])],
            "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                     helper.make_tensor_value_info("c", TensorProto.BOOL, []), _seq("q", F, None),
                     helper.make_tensor_value_info("t", F, [2])],
            [helper.make_tensor_value_info("c2", TensorProto.BOOL, []), _seq("q2", F, None),
             helper.make_tensor_value_info("t2", F, [2])])
        nodes = s + [helper.make_node("Loop", ["n", "", "s", "x"], ["out", "y"], body=body, name="grow")]
        inputs.append(helper.make_tensor_value_info("n", TensorProto.INT64, []))
        match = r"node 'grow' \(Loop\): its trip count or condition is known only at run time"
    elif case == "if":
        one = helper.make_graph([helper.make_node("SequenceConstruct", ["x"], ["o1"])], "one", [], [_seq("o1", F, [2])])
        two = helper.make_graph([helper.make_node("SequenceConstruct", ["x", "x"], ["o2"])], "two", [],
                                [_seq("o2", F, [2])])
        nodes = [helper.make_node("If", ["c"], ["q"], then_branch=one, else_branch=two, name="choose"),
                 helper.make_node("ConcatFromSequence", ["q"], ["y"], axis=0)]
        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
        match = r"node 'choose' \(If\): its condition is only known at run time and output 'q' has another length"
    else:
        nodes = s + [helper.make_node("Relu", ["s"], ["y"], name="bad")]
        match = r"node 'bad' \(Relu\) reads 's', a sequence"
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", F, None)]),
                              opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(UnsupportedOpError, match=match):
        cuvil.compile(model)


# ONNX's node tests of these ops through cuvil.backend (all of them run in test_conformance's slow suite);
# three in the default suite.
NODE_TESTS = ["test_sequence_map_add_1_sequence_1_tensor_expanded", "test_loop16_seq_none",
              "test_optional_has_element_empty_optional_input",
              *[pytest.param(name, marks=pytest.mark.slow) for name in (
                  "test_if_opt", "test_split_to_sequence_2", "test_identity_opt", "test_sequence_insert_at_front",
                  "test_scan_sum")]]


@pytest.mark.parametrize("name", NODE_TESTS)
def test_node_tests_through_the_backend(name):
    from tests.test_conformance import CASES
    run_node_test(CASES[name][0])
