"""Bad models give a clear CuvilError naming what is wrong; odd names still build."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from tests.helpers import assert_matches_ort, make_model, rand

F = np.float32


def _relu(shape=("N", 4)):
    return make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, list(shape))], [("y", F, None)])


CASES = {
    "truncated": lambda tmp: (tmp / "m.onnx", _relu().SerializeToString()[:-9], "not a valid ONNX|empty"),
    "garbage": lambda tmp: (tmp / "m.onnx", b"\xff\x00garbage" * 10, "not a valid ONNX|empty"),
    "empty file": lambda tmp: (tmp / "m.onnx", b"", "empty"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unreadable_files(tmp_path, case):
    path, data, pattern = CASES[case](tmp_path)
    path.write_bytes(data)
    with pytest.raises(cuvil.CuvilError, match=pattern) as err:
        cuvil.compile(path, input_shapes={"x": [2, 4]})
    assert "m.onnx" in str(err.value) or "empty" in str(err.value)


def _graph(nodes, inputs=(("x", F, [2, 4]),), outputs=(("y", F, None),), inits=None):
    model = make_model(nodes, list(inputs), list(outputs), inits)
    return model


def test_cycle():
    model = _graph([helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
                    helper.make_node("Relu", ["a"], ["b"], name="n2"),
                    helper.make_node("Relu", ["a"], ["y"], name="n3")])
    with pytest.raises(cuvil.CuvilError, match="cycle.*n[12].*n[12]"):
        cuvil.compile(model)


def test_undefined_input():
    with pytest.raises(cuvil.CuvilError, match="'ghost'.*no node, input or initializer"):
        cuvil.compile(_graph([helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")]))


def test_duplicate_output_name():
    with pytest.raises(cuvil.CuvilError, match="produced twice"):
        cuvil.compile(_graph([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["y"])]))


def test_unknown_op_in_unknown_domain():
    model = _graph([helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example", name="f1")])
    with pytest.raises(cuvil.CuvilError, match="f1.*com.example"):
        cuvil.compile(model)


def test_unsupported_dtype():
    # (string tensors are supported since issue 24: tests/test_strings.py; complex ones are not)
    model = _graph([helper.make_node("Identity", ["x"], ["y"])], inputs=[("x", TensorProto.COMPLEX64, [2])],
                   outputs=[("y", TensorProto.COMPLEX64, None)])
    with pytest.raises(cuvil.CuvilError, match="COMPLEX64 are not supported"):
        cuvil.compile(model)


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    model = _graph([helper.make_node("Add", ["x", "w"], ["y"])], inits={"w": np.ones((2, 4), F)})
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "32")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    (tmp_path / "secret.bin").write_bytes(b"\0" * 32)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(cuvil.CuvilError, match="outside the model's folder"):
        cuvil.compile(folder / "m.onnx")


@pytest.mark.parametrize("shape, pattern", [
    ([2, 4, 4], "rank"), ([0, 4], "positive"), ([-1, 4], "positive"), (["a", 4], "integers"),
    ([1 << 40, 4], "bytes"),
])
def test_bad_shapes(shape, pattern):
    with pytest.raises(cuvil.CuvilError, match=pattern):
        cuvil.compile(_relu(), input_shapes={"x": shape})


def test_unknown_input_name_and_missing_symbolic_dim():
    with pytest.raises(cuvil.CuvilError, match="not inputs of the model"):
        cuvil.compile(_relu(), input_shapes={"x": [2, 4], "z": [1]})
    with pytest.raises(cuvil.CuvilError, match="symbolic dims"):
        cuvil.compile(_relu())


def test_arena_over_the_limit_is_refused_with_sizes():
    model = make_model([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Sigmoid", ["a"], ["y"])],
                       [("x", F, [1024, 1024])], [("y", F, None)])
    with pytest.raises(cuvil.CuvilError, match=r"4\.0 MiB of working memory, over the limit of 1 MiB"):
        cuvil.compile(model, max_arena_mb=1)


def test_names_with_quotes_newlines_and_c_keywords_still_build():
    odd = ['in"put\n', "int", "y */ #include", "while"]
    nodes = [helper.make_node("Relu", [odd[0]], [odd[1]], name='node "one"\n*/'),
             helper.make_node("Sigmoid", [odd[1]], [odd[2]], name="return"),
             helper.make_node("Neg", [odd[1]], [odd[3]], name="x\\y")]
    model = make_model(nodes, [(odd[0], F, [2, 3])], [(odd[2], F, None), (odd[3], F, None)])
    compiled, _ = assert_matches_ort(model, {odd[0]: rand(2, 3)})
    assert compiled.output_names == [odd[2], odd[3]]


def test_no_model_string_reaches_generated_kernel_source():
    """Kernel source is exec'd by Numba: nothing the model names may appear in it."""
    from backends.numba_cpu.kernel import KernelCall
    from backends.numba_cpu.registry import lower
    from cuvil.frontends.onnx import import_onnx
    payload = "__import__('os').system('echo pwned')"
    nodes = [helper.make_node("LeakyRelu", [payload], ["h" + payload], name=payload, alpha=0.5),
             helper.make_node("Concat", ["h" + payload, payload], ["y"], axis=1, name="c" + payload)]
    model = make_model(nodes, [(payload, F, [2, 3])], [("y", F, None)])
    graph, _ = import_onnx(model)
    sources = [c.kernel.source for c in lower(graph) if isinstance(c, KernelCall)]
    assert sources and not any("import" in s or "system" in s or "pwned" in s for s in sources)
