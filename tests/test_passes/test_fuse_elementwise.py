"""fuse_elementwise: chains and trees of elementwise ops -> one cuvil.FusedElementwise loop."""
import numpy as np
import pytest

from backends.numba_cpu import fused
from passes.fuse_elementwise import BINARY, FUSIBLE, UNARY, Options, fuse_elementwise
from tests.helpers import rand
from tests.test_passes.common import model_from_text, run_pass, run_pass_compiled, show

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _tree():
    # Relu(x * s + y) / (1 + exp(-x)), s broadcast per channel, with one scalar constant.
    return model_from_text(HEAD + """
        g (float[2, 3, 4] x, float[2, 3, 4] y) => (float[2, 3, 4] z) {
            a = Mul(x, s)
            b = Add(a, y)
            c = Relu(b)
            n = Neg(x)
            e = Exp(n)
            d = Add(one, e)
            z = Div(c, d)
        }""", s=rand(3, 1, seed=2), one=np.float32(1.0))


FEEDS = {"x": rand(2, 3, 4), "y": rand(2, 3, 4, seed=1)}


def test_a_tree_becomes_one_loop():
    before, after = run_pass_compiled("fuse_elementwise", _tree(), FEEDS, tol=1e-5)
    assert len(before.nodes) == 7
    assert show(after) == ["cuvil.FusedElementwise(x, s, y) -> z {program=[Mul x0 x1, Add t0 x2, Relu t1, Neg x0, "
                           "Exp t3, Add 1.0 t4, Div t2 t5]}"]


def test_the_size_limit_splits_groups():
    _, after = run_pass_compiled("fuse_elementwise", _tree(), FEEDS, max_ops=3)
    assert all(len(n.attr("program")) <= 3 for n in after.nodes if n.op == "FusedElementwise")
    assert len(after.nodes) == 3


def test_attributes_and_clip_bounds_are_kept():
    model = model_from_text(HEAD + """
        g (float[4, 5] x) => (float[4, 5] y) {
            a = LeakyRelu <alpha = 0.3> (x)
            b = Clip(a, lo, hi)
            c = HardSigmoid <alpha = 0.25, beta = 0.4> (b)
            y = Pow(c, two)
        }""", lo=np.float32(-0.5), hi=np.float32(2.0), two=np.float32(2.0))
    _, after = run_pass_compiled("fuse_elementwise", model, {"x": rand(4, 5) * 3}, tol=1e-5)
    assert after.nodes[0].attr("program") == ["LeakyRelu x0 alpha=0.30000001192092896", "Clip t0 min=-0.5 max=2.0",
                                              "HardSigmoid t1 alpha=0.25 beta=0.4000000059604645", "Pow t2 2.0"]


def test_must_not_fire_across_a_shared_intermediate_or_a_broadcast():
    # b is read by two ops outside each other's chain (and is an output); v is a small
    # tensor broadcast into a large one (it would be recomputed for every element).
    model = model_from_text(HEAD + """
        g (float[2, 3] x, float[3] v) => (float[2, 3] b, float[2, 3] y) {
            b = Relu(x)
            e = Exp(v)
            y = Mul(b, e)
        }""")
    before, after = run_pass(fuse_elementwise, model, {"x": rand(2, 3), "v": rand(3)})
    assert after is before


def test_must_not_fire_on_integers_or_single_ops():
    model = model_from_text(HEAD + """
        g (int64[4] i, float[4] x) => (int64[4] j, float[4] y) {
            a = Add(i, i)
            j = Mul(a, i)
            y = Relu(x)
        }""")
    before, after = run_pass(fuse_elementwise, model, {"i": np.arange(4), "x": rand(4)})
    assert after is before


def test_the_kernel_generator_knows_every_fusible_op():
    """Each op the pass may put in a program has an expression in fused.py."""
    from cuvil.ir import Node
    node = Node("FusedElementwise", "n", [], ["y"])
    for op in sorted(FUSIBLE):
        operands = ["x0", "x1"] if op in BINARY else ["x0"]
        assert fused._expression(node, op, operands, {}), op
    assert UNARY.isdisjoint(BINARY)


@pytest.mark.parametrize("bad", [{"max_ops": 1}, {"max_inputs": 0}, {"size": 3}])
def test_options_are_checked(bad):
    with pytest.raises(Exception):
        Options.model_validate(bad)
