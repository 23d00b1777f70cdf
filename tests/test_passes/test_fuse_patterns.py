"""fuse_patterns: LayerNorm, Softmax, GELU, SiLU, HardSwish as exporters decompose them -> one op."""
import numpy as np
import pytest

from passes.fuse_patterns import Options, fuse_patterns
from tests.helpers import rand
from tests.test_passes.common import model_from_text, run_pass, run_pass_compiled, show

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'
X = {"x": rand(2, 5, 8) * 2}


def _layernorm(opset=17, square="Pow(d, two)"):
    axes = "<axes = [-1]>" if opset < 18 else ""
    ax = "" if opset < 18 else ", ax"
    return model_from_text(f'<ir_version: 8, opset_import: ["" : {opset}]>' + f"""
        g (float[2, 5, 8] x) => (float[2, 5, 8] y) {{
            m = ReduceMean {axes} (x{ax})
            d = Sub(x, m)
            q = {square}
            v = ReduceMean {axes} (q{ax})
            e = Add(v, eps)
            s = Sqrt(e)
            n = Div(d, s)
            k = Mul(n, gamma)
            y = Add(k, beta)
        }}""", two=np.float32(2), eps=np.float32(1e-5), gamma=rand(8, seed=1), beta=rand(8, seed=2),
        ax=np.array([-1], np.int64))


@pytest.mark.parametrize("opset, square", [(17, "Pow(d, two)"), (18, "Mul(d, d)")])
def test_layernorm(opset, square):
    before, after = run_pass(fuse_patterns, _layernorm(opset, square), X, tol=1e-5)
    assert len(before.nodes) == 9
    assert show(after) == ["LayerNormalization(x, Add_8_scale, Add_8_bias) -> y {axis=2, epsilon=1e-05}"]


def test_softmax():
    model = model_from_text(HEAD + """
        g (float[2, 5, 8] x) => (float[2, 5, 8] y) {
            m = ReduceMax <axes = [1]> (x)
            d = Sub(x, m)
            e = Exp(d)
            s = ReduceSum(e, one)
            y = Div(e, s)
        }""", one=np.array([1], np.int64))
    before, after = run_pass(fuse_patterns, model, X, tol=1e-5)
    assert show(after) == ["Softmax(x) -> y {axis=1}"]


def test_hardswish_and_hardsigmoid():
    model = model_from_text(HEAD + """
        g (float[2, 5, 8] x) => (float[2, 5, 8] y, float[2, 5, 8] z) {
            a = Add(x, three)
            c = Clip(a, zero, six)
            p = Mul(x, c)
            y = Div(p, six)
            b = Add(three, x)
            r = Relu(b)
            l = Min(r, six)
            z = Mul(l, sixth)
        }""", three=np.float32(3), zero=np.float32(0), six=np.float32(6), sixth=np.float32(1 / 6))
    before, after = run_pass(fuse_patterns, model, X, tol=1e-5)
    assert show(after) == ["HardSwish(x) -> y", "HardSigmoid(x) -> z {alpha=0.166667, beta=0.5}"]


def test_gelu_both_forms_and_silu_become_one_step_loops():
    # As torch writes GELU (erf) and a tanh GELU with its terms in another order; SiLU.
    model = model_from_text(HEAD + """
        g (float[2, 5, 8] x) => (float[2, 5, 8] y, float[2, 5, 8] t, float[2, 5, 8] s) {
            a = Div(x, sqrt2)
            b = Erf(a)
            c = Add(b, one)
            d = Mul(x, c)
            y = Mul(d, half)
            x3 = Pow(x, three)
            k = Mul(coef, x3)
            i = Add(x, k)
            j = Mul(i, c2pi)
            h = Tanh(j)
            o = Add(one, h)
            w = Mul(half, x)
            t = Mul(o, w)
            g = Sigmoid(x)
            s = Mul(g, x)
        }""", sqrt2=np.float32(2 ** 0.5), one=np.float32(1), half=np.float32(0.5), three=np.float32(3),
        coef=np.float32(0.044715), c2pi=np.float32((2 / np.pi) ** 0.5))
    before, after = run_pass_compiled("fuse_patterns", model, X, tol=1e-5)
    assert len(before.nodes) == 15
    assert show(after) == ["cuvil.FusedElementwise(x) -> y {program=[Gelu x0 approximate=none]}",
                           "cuvil.FusedElementwise(x) -> t {program=[Gelu x0 approximate=tanh]}",
                           "cuvil.FusedElementwise(x) -> s {program=[Silu x0]}"]


def test_gelu_is_the_onnx_op_from_opset_20():
    model = model_from_text('<ir_version: 9, opset_import: ["" : 20]>' + """
        g (float[4] x) => (float[4] y) {
            a = Div(x, sqrt2)
            b = Erf(a)
            c = Add(b, one)
            d = Mul(x, c)
            y = Mul(d, half)
        }""", sqrt2=np.float32(2 ** 0.5), one=np.float32(1), half=np.float32(0.5))
    before, after = run_pass(fuse_patterns, model, {"x": rand(4)}, tol=1e-5)
    assert show(after) == ["Gelu(x) -> y {approximate=none}"]


def test_must_not_fire_on_lookalikes():
    # 0.5 * x * (1 + erf(x / 1.5)) is not GELU; a LayerNorm over a non-trailing axis is not
    # LayerNormalization; a softmax whose exponentials are also an output keeps them.
    model = model_from_text(HEAD + """
        g (float[2, 5, 8] x) => (float[2, 5, 8] y, float[2, 5, 8] n, float[2, 5, 8] z, float[2, 5, 8] e) {
            a = Div(x, wrong)
            b = Erf(a)
            c = Add(b, one)
            d = Mul(x, c)
            y = Mul(d, half)
            m = ReduceMean <axes = [1]> (x)
            dd = Sub(x, m)
            q = Mul(dd, dd)
            v = ReduceMean <axes = [1]> (q)
            ee = Add(v, eps)
            s = Sqrt(ee)
            n = Div(dd, s)
            e = Exp(x)
            t = ReduceSum(e, last)
            z = Div(e, t)
        }""", wrong=np.float32(1.5), one=np.float32(1), half=np.float32(0.5), eps=np.float32(1e-5),
        last=np.array([-1], np.int64))
    before, after = run_pass(fuse_patterns, model, X)
    assert after is before


def test_options_choose_patterns():
    model = _layernorm()
    from cuvil.frontends.onnx import import_onnx
    graph, _ = import_onnx(model)
    assert fuse_patterns(graph, Options(patterns=["softmax", "gelu"])) is graph
    with pytest.raises(Exception, match="unknown pattern"):
        Options(patterns=["layer_norm"])


def _rmsnorm(inverse: str, square: str = "Pow(x, two)", gamma: str = "y = Mul(gamma, n)"):
    return model_from_text(HEAD + f"""
        g (float[2, 5, 8] x) => (float[2, 5, 8] y) {{
            q = {square}
            v = ReduceMean <axes = [-1]> (q)
            e = Add(v, eps)
            s = Sqrt(e)
            {inverse}
            {gamma}
        }}""", two=np.float32(2), one=np.float32(1), eps=np.float32(1e-6), gamma=rand(8, seed=1))


@pytest.mark.parametrize("inverse, square", [
    ("r = Div(one, s)\n n = Mul(x, r)", "Pow(x, two)"),           # T5 as torch exports it
    ("r = Reciprocal(s)\n n = Mul(r, x)", "Mul(x, x)"),           # x * torch.rsqrt(.) (LLaMA)
    ("n = Div(x, s)", "Pow(x, two)"),
])
def test_rmsnorm(inverse, square):
    # Compiled (the SimplifiedLayerNormalization kernel) against onnxruntime on the model before the
    # pass: one row of 8 is a sum of 8 squares and one sqrt, float32 rounding ~1e-7 relative.
    before, after = run_pass_compiled("fuse_patterns", _rmsnorm(inverse, square), X, tol=1e-5)
    assert len(before.nodes) == len(inverse.split("\n")) + 5
    _assert_one_rmsnorm(after)


def _assert_one_rmsnorm(after):
    (node,) = after.nodes
    assert (node.op, node.inputs[0], node.outputs, node.attrs) == (
        "SimplifiedLayerNormalization", "x", ["y"], {"axis": 2, "epsilon": pytest.approx(1e-6)})


def test_rmsnorm_without_gamma_and_must_not_fire():
    # No gamma: a scale of ones. Must not fire: the mean over a non-trailing axis, or the
    # squared tensor also a graph output.
    plain = _rmsnorm("r = Div(one, s)\n y = Mul(x, r)", gamma="")
    before, after = run_pass(fuse_patterns, plain, X, tol=1e-5)
    _assert_one_rmsnorm(after)
    np.testing.assert_array_equal(after.values[after.nodes[0].inputs[1]].data, np.ones(8, np.float32))
    model = model_from_text(HEAD + """
        g (float[2, 5, 8] x) => (float[2, 5, 8] y, float[2, 5, 8] z, float[2, 5, 8] q2) {
            q = Pow(x, two)
            v = ReduceMean <axes = [1]> (q)
            e = Add(v, eps)
            s = Sqrt(e)
            y = Div(x, s)
            q2 = Mul(x, x)
            v2 = ReduceMean <axes = [-1]> (q2)
            e2 = Add(v2, eps)
            s2 = Sqrt(e2)
            z = Div(x, s2)
        }""", two=np.float32(2), eps=np.float32(1e-6))
    before, after = run_pass(fuse_patterns, model, X, tol=1e-5)
    assert [n.op for n in after.nodes] == [n.op for n in before.nodes]
