"""fuse_activation: Conv/Gemm/MatMul [+ residual Add] [+ activation] -> cuvil.Fused* epilogues.

onnxruntime cannot run the "cuvil" ops, so the numeric check compiles the model
with this pass alone and compares with onnxruntime on the model before it."""
import numpy as np
import pytest

from passes.fuse_activation import Options, fuse_activation
from tests.helpers import rand
from tests.test_passes.common import model_from_text, run_pass, run_pass_compiled, show

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _conv_block(tail: str, outputs="float[1, 4, 6, 6] y"):
    return model_from_text(HEAD + f"""
        g (float[1, 3, 6, 6] x, float[1, 4, 6, 6] r) => ({outputs}) {{
            c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
            {tail}
        }}""", w=rand(4, 3, 3, 3, seed=1) * 0.3, b=rand(4, seed=2), lo=np.float32(0.0), hi=np.float32(0.5))


FEEDS = {"x": rand(1, 3, 6, 6, seed=3), "r": rand(1, 4, 6, 6, seed=4)}


def test_conv_residual_relu():
    model = _conv_block("s = Add(r, c)\n y = Relu(s)")
    before, after = run_pass_compiled("fuse_activation", model, FEEDS, tol=1e-5)
    assert show(before) == ["Conv(x, w, b) -> c {pads=[1, 1, 1, 1]}", "Add(r, c) -> s", "Relu(s) -> y"]
    assert show(after) == ["cuvil.FusedConv(x, w, b, r) -> y {activation=Relu, activation_params=[], "
                           "has_residual=1, pads=[1, 1, 1, 1]}"]


@pytest.mark.parametrize("act, params", [("Clip(c, lo, hi)", [0.0, 0.5]), ("LeakyRelu <alpha = 0.2> (c)", [0.2]),
                                         ("HardSigmoid(c)", [0.2, 0.5]), ("Sigmoid(c)", [])])
def test_activation_parameters(act, params):
    model = _conv_block(f"y = {act}")
    _, after = run_pass_compiled("fuse_activation", model, FEEDS)
    (node,) = after.nodes
    assert node.op == "FusedConv" and node.attr("activation") == act.split("(")[0].split()[0]
    assert node.attr("activation_params") == pytest.approx(params) and node.attr("has_residual") == 0


def test_gemm_and_matmul():
    model = model_from_text(HEAD + """
        g (float[2, 8] x, float[2, 4] r) => (float[2, 4] y, float[2, 5] z) {
            a = Gemm <transB = 1> (x, w, b)
            s = Add(a, r)
            y = Tanh(s)
            m = MatMul(x, v)
            z = HardSwish(m)
        }""", w=rand(4, 8, seed=1), b=rand(4, seed=2), v=rand(8, 5, seed=3))
    _, after = run_pass_compiled("fuse_activation", model, {"x": rand(2, 8), "r": rand(2, 4, seed=5)})
    assert show(after) == [
        "cuvil.FusedGemm(x, w, b, r) -> y {activation=Tanh, activation_params=[], has_residual=1, transB=1}",
        "cuvil.FusedMatMul(x, v) -> z {activation=HardSwish, activation_params=[], has_residual=0}"]


def test_options_turn_off_residuals_and_activations():
    model = _conv_block("s = Add(r, c)\n y = Relu(s)")
    from cuvil.frontends.onnx import import_onnx
    graph, _ = import_onnx(model)
    assert fuse_activation(graph, Options(residual=False)) is graph  # the Add sits between Conv and Relu
    assert fuse_activation(graph, Options(activations=["Sigmoid"])).nodes[0].attr("activation") == ""


def test_must_not_fire_when_the_conv_output_has_two_readers():
    model = _conv_block("y = Relu(c)\n z = Sigmoid(c)", outputs="float[1, 4, 6, 6] y, float[1, 4, 6, 6] z")
    before, after = run_pass(fuse_activation, model, FEEDS)
    assert after is before


def test_must_not_fire_on_a_broadcast_residual_or_an_activation_before_the_add():
    model = model_from_text(HEAD + """
        g (float[1, 3, 6, 6] x, float[1, 4, 1, 1] r) => (float[1, 4, 6, 6] y, float[1, 4, 6, 6] z) {
            c = Conv <pads = [1, 1, 1, 1]> (x, w)
            y = Add(c, r)
            d = Conv <pads = [1, 1, 1, 1]> (x, w)
            e = Clip(d, lo, q)
            z = Add(e, y)
        }""", w=rand(4, 3, 3, 3, seed=1), lo=np.float32(0), q=np.float32(1))
    from cuvil.frontends.onnx import import_onnx
    graph, _ = import_onnx(model)
    # The Clip's bound q is a constant, so Conv d + Clip fuse; Conv c + broadcast Add must not.
    after = fuse_activation(graph)
    assert [n.op for n in after.nodes] == ["Conv", "Add", "FusedConv", "Add"]
    # With a runtime Clip bound nothing fuses at all.
    model = model_from_text(HEAD + """
        g (float[1, 3, 6, 6] x, float q) => (float[1, 4, 6, 6] z) {
            d = Conv <pads = [1, 1, 1, 1]> (x, w)
            z = Clip(d, lo, q)
        }""", w=rand(4, 3, 3, 3, seed=1), lo=np.float32(0))
    before, after = run_pass(fuse_activation, model, {"x": FEEDS["x"], "q": np.array(1, np.float32)})
    assert after is before


def test_a_view_between_the_gemm_and_the_residual_is_looked_through():
    # What fuse_gemm makes of a linear layer on a sequence, followed by the residual Add.
    model = model_from_text(HEAD + """
        g (float[1, 5, 8] x) => (float[1, 5, 8] y) {
            a = Reshape(x, s2)
            g = Gemm(a, w, b)
            h = Reshape(g, s3)
            y = Add(x, h)
        }""", w=rand(8, 8, seed=1), b=rand(8, seed=2), s2=np.array([5, 8], np.int64),
        s3=np.array([1, 5, 8], np.int64))
    _, after = run_pass_compiled("fuse_activation", model, {"x": rand(1, 5, 8)})
    assert show(after) == [
        "Reshape(x, s2) -> a",
        "Reshape(x, Gemm_1_shape) -> x_as_Gemm_1",
        "cuvil.FusedGemm(a, w, b, x_as_Gemm_1) -> y_Gemm_1 {activation=, activation_params=[], has_residual=1}",
        "Reshape(y_Gemm_1, y_shape) -> y"]
