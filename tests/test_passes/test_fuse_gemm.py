"""fuse_gemm: MatMul + bias Add -> Gemm."""
import numpy as np

from passes.fuse_gemm import fuse_gemm
from tests.helpers import rand
from tests.test_passes.common import model_from_text, run_pass, show

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def test_matmul_bias_becomes_gemm():
    model = model_from_text(HEAD + """
        g (float[2, 4] x) => (float[2, 3] y) {
            m = MatMul(x, w)
            y = Add(b, m)
        }""", w=rand(4, 3, seed=1), b=rand(3, seed=2))
    before, after = run_pass(fuse_gemm, model, {"x": rand(2, 4)})
    assert show(before) == ["MatMul(x, w) -> m", "Add(b, m) -> y"]
    assert show(after) == ["Gemm(x, w, b) -> y"]


def test_batched_input_is_viewed_as_a_matrix_around_the_gemm():
    # A linear layer on a sequence: (1, 5, 4) @ (4, 3) + b.
    model = model_from_text(HEAD + """
        g (float[1, 5, 4] x) => (float[1, 5, 3] y) {
            m = MatMul(x, w)
            y = Add(m, b)
        }""", w=rand(4, 3, seed=1), b=rand(1, 1, 3, seed=2))
    before, after = run_pass(fuse_gemm, model, {"x": rand(1, 5, 4)})
    assert show(after) == ["Reshape(x, MatMul_0_a_shape) -> x_2d", "Gemm(x_2d, w, b_row) -> y_2d",
                           "Reshape(y_2d, MatMul_0_y_shape) -> y"]
    assert after.values["b_row"].shape == (3,) and list(after.values["MatMul_0_a_shape"].data) == [5, 4]


def test_must_not_fire_when_the_product_has_another_reader():
    model = model_from_text(HEAD + """
        g (float[2, 4] x) => (float[2, 3] y, float[2, 3] m) {
            m = MatMul(x, w)
            y = Add(m, b)
        }""", w=rand(4, 3, seed=1), b=rand(3, seed=2))
    before, after = run_pass(fuse_gemm, model, {"x": rand(2, 4)})
    assert after is before


def test_must_not_fire_when_the_add_broadcasts_the_product():
    # (2, 3) + (4, 2, 3) is larger than the product: not a bias.
    model = model_from_text(HEAD + """
        g (float[2, 4] x) => (float[4, 2, 3] y) {
            m = MatMul(x, w)
            y = Add(m, b)
        }""", w=rand(4, 3, seed=1), b=rand(4, 2, 3, seed=2))
    before, after = run_pass(fuse_gemm, model, {"x": rand(2, 4)})
    assert after is before


def test_must_not_fire_on_a_batched_weight():
    model = model_from_text(HEAD + """
        g (float[2, 2, 4] x) => (float[2, 2, 3] y) {
            m = MatMul(x, w)
            y = Add(m, b)
        }""", w=rand(2, 4, 3, seed=1), b=rand(3, seed=2).astype(np.float32))
    before, after = run_pass(fuse_gemm, model, {"x": rand(2, 2, 4)})
    assert after is before
