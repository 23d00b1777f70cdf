"""simplify_shapes: chains of Reshape/Flatten/Squeeze/Unsqueeze collapse to one Reshape."""
import numpy as np

from passes.simplify_shapes import simplify_shapes
from tests.helpers import rand
from tests.test_passes.common import model_from_text, run_pass, show

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def test_chain_collapses_to_one_reshape():
    model = model_from_text(HEAD + """
        g (float[2, 3, 4] x) => (float[1, 6, 4] y) {
            a = Reshape(x, s)
            b = Flatten <axis = 1> (a)
            c = Unsqueeze(b, zero)
            r = Relu(c)
            y = Reshape(r, t)
        }""", s=np.array([6, 4], np.int64), zero=np.array([0], np.int64), t=np.array([1, 6, 4], np.int64))
    before, after = run_pass(simplify_shapes, model, {"x": rand(2, 3, 4)})
    assert show(before)[:3] == ["Reshape(x, s) -> a", "Flatten(a) -> b {axis=1}", "Unsqueeze(b, zero) -> c"]
    # Unsqueeze(Flatten(Reshape(x))) is Reshape(x) to (1, 6, 4); the last Reshape keeps r's shape
    # but writes a graph output, so it stays.
    assert show(after) == ["Reshape(x, Unsqueeze_2_shape) -> c", "Relu(c) -> r", "Reshape(r, t) -> y"]
    assert list(after.values["Unsqueeze_2_shape"].data) == [1, 6, 4]


def test_a_transpose_of_unit_dims_is_a_reshape():
    model = model_from_text(HEAD + """
        g (float[1, 5, 1, 3] x) => (float[5, 1, 3, 1] y) {
            y = Transpose <perm = [1, 0, 3, 2]> (x)
        }""")
    before, after = run_pass(simplify_shapes, model, {"x": rand(1, 5, 1, 3)})
    assert show(after) == ["Reshape(x, Transpose_0_shape) -> y"]


def test_a_view_read_elsewhere_stays():
    model = model_from_text(HEAD + """
        g (float[2, 3, 4] x) => (float[24] y, float[6, 4] a) {
            a = Reshape(x, s)
            y = Flatten <axis = 0> (a)
        }""", s=np.array([6, 4], np.int64))
    before, after = run_pass(simplify_shapes, model, {"x": rand(2, 3, 4)})
    assert show(after)[0] == "Reshape(x, s) -> a" and after.nodes[1].inputs[0] == "x"


def test_must_not_fire_on_single_views_or_real_transposes():
    model = model_from_text(HEAD + """
        g (float[2, 3, 4] x) => (float[4, 6] y, float[2, 12] z) {
            t = Transpose <perm = [2, 0, 1]> (x)
            y = Reshape(t, s)
            z = Flatten(x)
        }""", s=np.array([4, 6], np.int64))
    before, after = run_pass(simplify_shapes, model, {"x": rand(2, 3, 4)})
    assert after is before
