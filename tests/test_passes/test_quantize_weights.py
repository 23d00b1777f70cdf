"""quantize_weights (precision int4): constant MatMul/Gemm weights -> MatMulNBits (com.microsoft).

Numeric checks: the quantised weight is within half a scale of the float weight (round to nearest
inside the group's range); onnxruntime runs the rewritten graph (it has MatMulNBits), and so does the
library built with precision int4, equal within the bound derived in tests/test_nbits.py.
"""
import numpy as np
import onnx
import pytest

import cuvil
from cuvil import nbits
from cuvil.frontends.onnx import import_onnx
from cuvil.ir import to_onnx, verify
from passes.quantize_weights import Options, quantize_weights
from tests.helpers import rand, run_ort
from tests.test_nbits import error_bound
from tests.test_passes.common import model_from_text, show

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _run(model, options=None):
    before, _ = import_onnx(model)
    verify(before)
    after = quantize_weights(before, options or Options())
    verify(after)
    return before, after


def _onnx(graph) -> onnx.ModelProto:
    model = to_onnx(graph)
    model.opset_import.append(onnx.helper.make_opsetid(nbits.DOMAIN, 1))
    return model


def _check_weight(w, weight, symmetric):
    """|w - (q - zp) scale| <= scale / 2 for every weight inside its group's range (all of them:
    the range is the group's own min/max, widened to 0 for the asymmetric form)."""
    blocks = np.arange(weight.K) // weight.block_size
    scale = np.abs(weight.scales.astype(np.float64))[:, blocks].T
    err = np.abs(weight.dequantize() - w)
    # the symmetric form's largest code is 2^(bits-1) - 1: a value of the other sign of the same
    # magnitude as the group's extreme is clamped, by up to one more scale
    slack = 1.0 if symmetric else 0.5
    assert np.all(err <= scale * slack * (1 + 1e-6) + 1e-12)


def test_matmul_and_bias_become_one_matmul_nbits():
    model = model_from_text(HEAD + """
        g (float[1, 3, 64] x) => (float[1, 3, 48] y) {
            m = MatMul(x, w)
            y = Add(m, b)
        }""", w=rand(64, 48, seed=1), b=rand(48, seed=2))
    before, after = _run(model)
    assert show(after) == ["com.microsoft.MatMulNBits(x, MatMul_0_B_q4, MatMul_0_scales_q4, , , MatMul_0_bias) -> y "
                           "{K=64, N=48, bits=4, block_size=32}"]
    assert "w" not in after.values and "b" not in after.values     # the float weights are gone
    weight = nbits.decode(after.nodes[0], after.values)
    _check_weight(rand(64, 48, seed=1).astype(np.float64), weight, symmetric=True)
    assert weight.scales.dtype == np.float32 and np.array_equal(weight.scales.astype(np.float16).astype(np.float32),
                                                                weight.scales)   # float16 values
    x = rand(1, 3, 64, seed=3)
    got = run_ort(_onnx(after), {"x": x})["y"]
    exact = x.reshape(3, 64).astype(np.float64) @ weight.dequantize() + weight.bias
    assert np.all(np.abs(got.reshape(3, 48) - exact) <= error_bound(x, weight).reshape(3, 48))


def test_gemm_with_transposed_weight_alpha_and_beta():
    model = model_from_text(HEAD + """
        g (float[2, 32] x) => (float[2, 16] y) {
            y = Gemm <transB = 1, alpha = 0.5, beta = 2.0> (x, w, c)
        }""", w=rand(16, 32, seed=1), c=rand(16, seed=2))
    before, after = _run(model, Options(group_size=16, symmetric=False))
    assert [n.op for n in after.nodes] == ["MatMulNBits"]
    weight = nbits.decode(after.nodes[0], after.values)
    assert weight.zero_points is not None and weight.block_size == 16
    _check_weight(rand(16, 32, seed=1).T.astype(np.float64) * 0.5, weight, symmetric=False)
    np.testing.assert_array_equal(weight.bias, rand(16, seed=2) * np.float32(2.0))


def test_must_not_fire_on_a_weight_computed_at_run_time():
    model = model_from_text(HEAD + """
        g (float[2, 32] x, float[32, 8] w) => (float[2, 8] y) {
            y = MatMul(x, w)
        }""")
    before, after = _run(model)
    assert after is before


def test_must_not_fire_on_an_odd_k_a_batched_weight_or_a_kept_node():
    odd = model_from_text(HEAD + """
        g (float[2, 33] x) => (float[2, 8] y) { y = MatMul(x, w) }""", w=rand(33, 8))
    assert [n.op for n in _run(odd)[1].nodes] == ["MatMul"]
    batched = model_from_text(HEAD + """
        g (float[2, 4, 32] x) => (float[2, 4, 8] y) { y = MatMul(x, w) }""", w=rand(2, 32, 8))
    assert [n.op for n in _run(batched)[1].nodes] == ["MatMul"]
    kept = model_from_text(HEAD + """
        g (float[2, 32] x) => (float[2, 8] y) { y = MatMul(x, w) }""", w=rand(32, 8))
    assert [n.op for n in _run(kept, Options(keep_fp32=["MatMul"]))[1].nodes] == ["MatMul"]


@pytest.mark.parametrize("symmetric,group_size", [(True, 32), (False, 64)])
def test_precision_int4_builds_and_matches_onnxruntime_on_the_rewritten_graph(symmetric, group_size):
    model = model_from_text(HEAD + """
        g (float[1, 128] x) => (float[1, 24] y) {
            h = MatMul(x, w1)
            r = Relu(h)
            y = MatMul(r, w2)
        }""", w1=rand(128, 64, seed=1), w2=rand(64, 24, seed=2))
    options = {"group_size": group_size, "symmetric": symmetric}
    compiled = cuvil.compile(model, precision="int4", pass_options={"quantize_weights": options})
    assert compiled.info["precision"] == "int4" and compiled.info["passes"][0] == "quantize_weights"
    _, after = _run(model, Options(**options))
    x = rand(1, 128, seed=3)
    got, want = compiled.run({"x": x})["y"], run_ort(_onnx(after), {"x": x})["y"]
    # the second product's input differs by the first's rounding: bound both layers
    w1 = nbits.decode(after.nodes[0], after.values)
    w2 = nbits.decode(after.nodes[2], after.values)
    h = np.maximum(x.astype(np.float64) @ w1.dequantize(), 0)
    first = error_bound(x, w1)
    bound = error_bound(h, w2) + first @ np.abs(w2.dequantize()) * (1 + 1e-6)
    assert np.all(np.abs(got - want) <= bound)
    # weights: 4 bits each plus a float16 scale (and a 4-bit zero point) per group
    params = 128 * 64 + 64 * 24
    per_group = 2 + (0 if symmetric else 0.5)
    assert compiled.info["memory"]["weights_bytes"] <= params * (0.5 + per_group / group_size) + 6 * 64


def test_imported_scales_rounded_to_float16_on_request():
    """An imported MatMulNBits file with float32 scales: `imported_scales: fp16` stores them in 2
    bytes; each weight moves by at most 2^-11 of itself (float16's unit roundoff), so the outputs
    stay within the kernel bound plus 2^-11 sum |a||w| of onnxruntime on the file."""
    from tests.test_nbits import nbits_model
    K, N = 256, 96
    model, weight = nbits_model(K, N, (1, K), zp="u8")
    options = {"imported_scales": "fp16"}
    graph, _ = import_onnx(model)
    after = quantize_weights(graph, Options(**options))
    rounded = nbits.decode(after.nodes[0], after.values).scales
    assert not np.array_equal(rounded, weight.scales)
    np.testing.assert_array_equal(rounded, weight.scales.astype(np.float16).astype(np.float32))
    compiled = cuvil.compile(model, precision="int4", pass_options={"quantize_weights": options})
    kept = cuvil.compile(model)
    assert compiled.info["memory"]["weights_bytes"] <= K * N * (0.5 + 2.5 / 32) + 4 * 64
    assert kept.info["memory"]["weights_bytes"] > K * N * (0.5 + 4 / 32)
    x = rand(1, K, seed=5)
    got, want = compiled.run({"A": x})["Y"], run_ort(model, {"A": x})["Y"]
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(weight.dequantize())
    bound = error_bound(x, weight) * (1 + 2.0 ** -10) + 2.0 ** -11 * (1 + 2.0 ** -10) * magnitude
    assert np.all(np.abs(got - want) <= bound)
