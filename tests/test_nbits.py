"""MatMulNBits (com.microsoft, cuvil/nbits.py; kernel backends/numba_cpu/nbits.py) against onnxruntime's
own MatMulNBits kernel on the same file.

Tolerance, derived: onnxruntime's CPU kernel with accuracy_level unset (0) dequantises each weight
to float32, w = fl((q - zp) * scale), and accumulates the K products with FMAs: its result is within
gamma(K + 1) * sum_k |a_k| |W_k| of the exact sum (W the exactly dequantised weight, gamma(n) =
n u / (1 - n u), u = 2^-24). Cuvil computes (q - zp) exactly (in integers; a float zero point costs
one rounding), sums each block's products (one rounding per term), scales the block sum (one) and
adds it to the column's sum (one per block), then adds the bias (one): within gamma(K + K/block + 4)
* (sum_k |a_k| |W_k| + |bias|). The two differ by at most the sum of the bounds, which the tests
assert element by element (every product is exact in float64, so the float64 reference bound is
itself exact up to 2^-53 terms, far below u).

4-bit codes with zero points of their own, on AVX-512 targets: the kernel reads q - 8 from a table
and corrects each block's sum by (zp - 8) * sum_k a_k (backends/numba_cpu/nbits.py), so its terms
are bounded by |a_k| (|q_k - 8| + |zp - 8|) scale instead of |a_k| |W_k|: the bound uses that larger
magnitude for those weights (at most 16 scale |a_k| a term, against |q - zp| scale <= 15 scale).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from backends.targets import has_feature, resolve_target
from cuvil import nbits
from cuvil.explain import explain_model
from cuvil.errors import CuvilError, UnsupportedOpError
from tests.helpers import run_ort

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def nbits_model(K, N, a_shape, bits=4, block=32, zp=None, bias=False, seed=0, f16_scales=False,
                g_idx=None, a_dtype=TensorProto.FLOAT):
    """A one-node MatMulNBits model and its weight (quantised from seeded random floats); zp: None
    (the default zero point), "u8" (packed codes) or "f32" (float zero points)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((K, N)).astype(np.float32)
    weight = nbits.quantize(w, bits, block, symmetric=zp is None, scale_dtype=np.float16 if f16_scales else np.float32)
    if zp == "f32":
        weight.zero_points = (rng.random((N, weight.k_blocks)) * (1 << bits)).astype(np.float32)
    arrays = nbits.encode(weight)
    if zp == "f32":
        arrays["zero_points"] = weight.zero_points
    inits = {"B": arrays["B"], "scales": arrays["scales"]}
    inputs = ["A", "B", "scales", "zp" if zp else "", "g_idx" if g_idx is not None else ""]
    if zp:
        inits["zp"] = arrays["zero_points"]
    if g_idx is not None:
        inits["g_idx"] = np.asarray(g_idx, np.int32)
    if bias:
        weight.bias = rng.standard_normal(N).astype(np.float32)
        inits["bias"] = weight.bias
        inputs.append("bias")
    while inputs[-1] == "":
        inputs.pop()
    node = helper.make_node("MatMulNBits", inputs, ["Y"], name="q_proj", domain="com.microsoft",
                            K=K, N=N, bits=bits, block_size=block)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", a_dtype, list(a_shape))],
                              [helper.make_tensor_value_info("Y", a_dtype, list(a_shape[:-1]) + [N])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model, weight


def error_bound(x, weight) -> np.ndarray:
    """The derived bound on |cuvil - onnxruntime| per output element (module docstring)."""
    K = weight.K
    ours, theirs = gamma(K + K // weight.block_size + 4), gamma(K + 1)
    return (ours + theirs) * magnitude(x, weight)


def magnitude(x, weight) -> np.ndarray:
    """sum_k |a_k| |term_k| (+ |bias|) per output element: the terms the rounding errors scale with."""
    K = weight.K
    terms = np.abs(weight.dequantize())
    if weight.bits == 4 and weight.zero_points is not None and weight.zero_points.dtype == np.uint8:
        blocks = weight.groups()
        centre = nbits.default_zero_point(4)
        terms = ((np.abs(weight.q.astype(np.float64) - centre)
                  + np.abs(weight.zero_points.astype(np.float64) - centre)[:, blocks])
                 * np.abs(weight.scales.astype(np.float64))[:, blocks]).T
    total = np.abs(x.reshape(-1, K).astype(np.float64)) @ terms
    if weight.bias is not None:
        total = total + np.abs(weight.bias.astype(np.float64))
    return total.reshape(x.shape[:-1] + (weight.N,))


def check_against_ort(model, weight, a_shape, seed=1, **compile_options):
    x = np.random.default_rng(seed).standard_normal(a_shape).astype(np.float32)
    got = cuvil.compile(model, **compile_options).run({"A": x})["Y"]
    want = run_ort(model, {"A": x})["Y"]
    assert got.shape == want.shape and got.dtype == np.float32
    diff = np.abs(got.astype(np.float64) - want)
    bound = error_bound(x, weight)
    assert np.all(diff <= bound), f"max diff {diff.max():.3g}, at most {(diff / bound).max():.2f} x the bound"
    # and both near the float64 value of the same quantised weight
    exact = x.reshape(-1, weight.K).astype(np.float64) @ weight.dequantize()
    if weight.bias is not None:
        exact = exact + weight.bias
    assert np.all(np.abs(got.reshape(exact.shape) - exact) <= bound.reshape(exact.shape))
    return got


CASES = [
    # K, N, A shape, bits, block, zero points, bias
    (256, 64, (1, 256), 4, 32, None, False),        # a GEMV, symmetric
    (256, 100, (3, 256), 4, 32, "u8", True),        # rows below the tile, N not a multiple of 16
    (200, 40, (5, 200), 8, 64, "u8", False),        # 8 bits, a partial last block
    (96, 48, (1, 96), 4, 64, None, True),           # a partial last block in a GEMV, bias
    (128, 80, (2, 128), 4, 16, "f32", False),       # float zero points, the smallest block
    (512, 72, (1, 512), 4, 256, "u8", False),       # the largest block
    (128, 32, (6, 128), 8, 128, None, True),        # 8 bits symmetric, a full tile and a tail tile
    (64, 130, (2, 3, 64), 4, 32, "u8", True),       # batch dims on A, a 3-column last group
    (96, 150, (1, 96), 4, 32, "u8", False),         # an odd number of blocks: nibble zero points, 3 groups
    # 16 rows or more (a prefill): dequantised panels and the float32 micro-kernel (nbits_gemm.py)
    (256, 100, (20, 256), 4, 32, "u8", False),      # nibble zero points, a partial last group, a tail tile
    (200, 40, (17, 200), 8, 64, "u8", False),       # 8 bits, a partial last block
    (128, 80, (16, 128), 4, 16, "f32", False),      # float zero points
    (640, 130, (2, 12, 640), 4, 32, None, False),   # symmetric, batch dims, three passes over k, 3 groups
]


@pytest.mark.parametrize("K,N,a_shape,bits,block,zp,bias", CASES)
def test_matmul_nbits_matches_onnxruntime(K, N, a_shape, bits, block, zp, bias):
    model, weight = nbits_model(K, N, a_shape, bits, block, zp, bias)
    check_against_ort(model, weight, a_shape)


def test_float16_scales_are_kept_in_two_bytes():
    # scales that are float16 values: the library stores 2 bytes each (nbits.py's f16 path)
    K, N = 256, 64
    model, weight = nbits_model(K, N, (1, K), f16_scales=True)
    f32_model, _ = nbits_model(K, N, (1, K), f16_scales=False)
    compiled = cuvil.compile(model)
    check_against_ort(model, weight, (1, K))
    assert compiled.info["memory"]["weights_bytes"] < cuvil.compile(f32_model).info["memory"]["weights_bytes"]
    assert compiled.info["memory"]["weights_bytes"] <= K * N * (0.5 + 2 / 32) + 64 * 4


def test_weights_stay_packed_in_the_library():
    # 4 bits per weight and a float32 scale per 32: 0.625 bytes per weight (64-byte alignment aside)
    K, N = 512, 256
    model, _ = nbits_model(K, N, (1, K))
    weights = cuvil.compile(model).info["memory"]["weights_bytes"]
    assert weights <= K * N * (0.5 + 4 / 32) + 3 * 64


def test_trivial_g_idx_is_accepted():
    K, block = 128, 32
    model, weight = nbits_model(K, 48, (1, K), block=block, g_idx=np.arange(K) // block)
    check_against_ort(model, weight, (1, K))


@pytest.mark.parametrize("symmetric,bits,block", [(True, 4, 32), (False, 4, 32), (False, 4, 128), (True, 8, 64)])
def test_files_of_onnxruntimes_quantizer(symmetric, bits, block):
    """A MatMul model quantised by onnxruntime's own MatMulNBitsQuantizer."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    K, N = 256, 96
    rng = np.random.default_rng(3)
    w = rng.standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"], name="proj")], "mm",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, N])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    quant = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=symmetric)
    quant.process()
    qmodel = quant.model.model
    assert [n.op_type for n in qmodel.graph.node] == ["MatMulNBits"]
    from cuvil.frontends.onnx import import_onnx
    graph_ir, _ = import_onnx(qmodel)
    weight = nbits.decode(graph_ir.nodes[0], graph_ir.values)
    check_against_ort(qmodel, weight, (2, K))


def _error(model, match):
    with pytest.raises(CuvilError, match=match) as info:
        cuvil.compile(model)
    assert "q_proj" in str(info.value) and "MatMulNBits" in str(info.value)
    return info.value


def test_two_bits_is_refused_with_the_node_named():
    model, _ = nbits_model(64, 16, (1, 64))
    model.graph.node[0].attribute[2].i = 2          # bits (B's size no longer matches either)
    assert model.graph.node[0].attribute[2].name == "bits"
    error = _error(model, "bits=2 is not supported")
    assert isinstance(error, UnsupportedOpError)


def _act_order(K, block, seed=0):
    return np.random.default_rng(seed).permutation(np.arange(K) // block)


def check_against_spec(model, weight, a_shape, seed=1):
    """Cuvil against the spec's formula in float64 (where onnxruntime has no kernel to compare with),
    within Cuvil's own bound gamma(K + K/block + 4) * magnitude."""
    x = np.random.default_rng(seed).standard_normal(a_shape).astype(np.float32)
    got = cuvil.compile(model).run({"A": x})["Y"]
    exact = x.reshape(-1, weight.K).astype(np.float64) @ weight.dequantize()
    if weight.bias is not None:
        exact = exact + weight.bias
    bound = gamma(weight.K + weight.K // weight.block_size + 4) * magnitude(x, weight)
    assert np.all(np.abs(got - exact.reshape(got.shape)) <= bound)


def test_act_order_g_idx_matches_onnxruntime():
    # GPTQ's act-order: k permuted at build time so groups are blocks, A's columns at run time
    K, N, block = 256, 48, 32
    g = _act_order(K, block)
    model, weight = nbits_model(K, N, (3, K), block=block, g_idx=g, bias=True)
    weight.g_idx = g.astype(np.int64)
    check_against_ort(model, weight, (3, K))


@pytest.mark.parametrize("bits,zp", [(4, "u8"), (8, None)])
def test_act_order_g_idx_follows_the_spec(bits, zp):
    """onnxruntime 1.32's CPU kernel has no 8-bit path with g_idx, and with zero points it does not
    compute the spec's (q - zp[g_idx[k]]) * scale[g_idx[k]] on a reordering g_idx (measured: 87% of
    max |y| apart on a random one), so the oracle here is the spec's formula in float64."""
    K, N, block = 128, 40, 32
    g = _act_order(K, block, seed=2)
    model, weight = nbits_model(K, N, (2, K), bits=bits, block=block, zp=zp, g_idx=g)
    weight.g_idx = g.astype(np.int64)
    check_against_spec(model, weight, (2, K))


def test_uneven_g_idx_is_refused():
    K, block = 64, 32
    g = np.zeros(K, np.int32)
    g[-8:] = 1                                  # 56 k in group 0, 8 in group 1
    model, _ = nbits_model(K, 16, (1, K), block=block, g_idx=g)
    _error(model, "g_idx does not give every group block_size members")


def test_float16_activations_are_refused():
    model, _ = nbits_model(64, 16, (1, 64), a_dtype=TensorProto.FLOAT16)
    for init in model.graph.initializer:
        if init.name == "scales":
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), "scales"))
    _error(model, "float32 activations")


def test_misshapen_weight_is_refused():
    model, _ = nbits_model(64, 16, (1, 64))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((16, 3), np.uint8), "B"))
    _error(model, "expected uint8")


def test_check_reports_nothing_for_a_compilable_node():
    from cuvil import pipeline
    model, _ = nbits_model(64, 16, (1, 64))
    graph = pipeline.import_model(model, {})
    assert pipeline.lowering_problems(graph) == []


@pytest.mark.parametrize("target,zp", [("x86_64-avx2", None), ("x86_64-avx2", "u8"), ("generic", "f32")])
def test_targets_without_avx512_unpack_without_the_table(target, zp):
    # no vpermps over 16 floats: codes are masked, shifted, minus the zero point, converted (and
    # `generic` has no F16C: float16 scales are widened to float32 at build time)
    K, N = 192, 40
    model, weight = nbits_model(K, N, (1, K), zp=zp, bias=True, f16_scales=True)
    check_against_ort(model, weight, (1, K), target=target)


def int8_magnitude(x, weight) -> np.ndarray:
    """sum_k |a_k| max(q_k + zp_b, |q_k - 8| + |zp_b - 8|) scale_b (+ |bias|): bounds the terms of both
    sides' sums at accuracy_level 4 (onnxruntime's integer sums times scales split as qa q - qa zp;
    Cuvil's q - zp, or the table's q - 8 plus the correction zp - 8: each at most that)."""
    blocks = weight.groups()
    q, zp = weight.q.astype(np.float64), weight.zero_point_values()[:, blocks]
    terms = (np.maximum(q + zp, np.abs(q - 8) + np.abs(zp - 8))
             * np.abs(weight.scales.astype(np.float64))[:, blocks]).T
    total = np.abs(x.reshape(-1, weight.K).astype(np.float64)) @ terms
    if weight.bias is not None:
        total = total + np.abs(weight.bias.astype(np.float64))
    return total.reshape(x.shape[:-1] + (weight.N,))


LEVEL_4_CASES = [
    (256, 64, (1, 256), 4, 32, None, False),       # a GEMV, symmetric (the builder's int4 form)
    (256, 100, (3, 256), 4, 32, "u8", True),       # rows below the tile (a tail row), zero points, bias
    (200, 40, (5, 200), 8, 64, "u8", False),       # 8 bits (float32 kernels), a partial last block
    (512, 96, (20, 512), 4, 32, "u8", False),      # a prefill (dequantised panels without VNNI)
    (256, 64, (1, 256), 4, 128, None, False),      # a larger block
    (200, 136, (3, 200), 4, 16, "u8", True),       # the smallest block, a partial last one, N past 2 groups
]
HOST = resolve_target("native")


@pytest.mark.parametrize("target", ["native", "x86_64-avx512"])
@pytest.mark.parametrize("K,N,a_shape,bits,block,zp,bias", LEVEL_4_CASES)
def test_accuracy_level_4_quantises_a_as_onnxruntime(K, N, a_shape, bits, block, zp, bias, target):
    """accuracy_level 4: onnxruntime quantises A to int8 per block (cuvil/nbits.py). Both sides then
    compute with a' = qa * scale_a (the same int8 codes: nbits.quantize_activations is the reference),
    so they differ only by float32 rounding: Cuvil's float32 kernels on a' (x86_64-avx512 has no
    VNNI) or, 4 bits on a VNNI host, exact integer block sums (nbits_vnni.py). Tolerance, derived:
    Cuvil's float32 sums within gamma(K + K/block + 4) of the terms (as at level 0, with a' for a;
    the VNNI kernel's few roundings a block are within it), onnxruntime's per block (the integer sum
    exact, times scale_a * scale, the zero point's share apart: about 4 roundings of a block's terms)
    and over the blocks (2 k_blocks additions) within gamma(2 k_blocks + 4): the sum of the two times
    int8_magnitude. Without the int8 step the difference is 100 times larger or more."""
    model, weight = nbits_model(K, N, a_shape, bits=bits, block=block, zp=zp, bias=bias)
    model.graph.node[0].attribute.append(helper.make_attribute("accuracy_level", 4))
    x = np.random.default_rng(1).standard_normal(a_shape).astype(np.float32)
    if target == "native":   # the VNNI kernel exactly where it applies
        labels = [k.precision for k in explain_model(model).kernels]
        assert any("VNNI" in label for label in labels) == (bits == 4 and has_feature(HOST, "avx512vnni")), labels
    lib = cuvil.compile(model, target=target)
    got = lib.run({"A": x})["Y"].astype(np.float64)
    want = run_ort(model, {"A": x})["Y"]
    xq = nbits.quantize_activations(x, block)
    bound = (gamma(K + K // block + 4) + gamma(2 * weight.k_blocks + 4)) * int8_magnitude(xq, weight)
    diff = np.abs(got - want)
    assert np.all(diff <= bound), f"max diff {diff.max():.3g}, at most {(diff / bound).max():.2f} x the bound"
    # the float32 product of x itself is far off: the int8 step is what makes them agree
    float_product = x.reshape(-1, K).astype(np.float64) @ weight.dequantize()
    if weight.bias is not None:
        float_product = float_product + weight.bias
    assert np.abs(float_product.reshape(want.shape) - want).max() > 100 * diff.max()


def test_int8_activations_round_ties_to_even_and_zero_blocks():
    """The product of the kernel's a' is the product of nbits.quantize_activations' (a code off by one would
    move it by scale_a |W|, far past the bound): amax / 127, 127 / amax, round half
    to even (ties made on purpose), an all-zero block (scale 0)."""
    K, N, block = 128, 16, 32
    model, weight = nbits_model(K, N, (2, K), block=block)
    model.graph.node[0].attribute.append(helper.make_attribute("accuracy_level", 4))
    x = np.random.default_rng(3).standard_normal((2, K)).astype(np.float32)
    x[0, :block] = np.arange(block, dtype=np.float32) - 15.5     # amax 15.5: a * 127 / 15.5 lands on .5 steps
    x[1, block:2 * block] = 0
    lib = cuvil.compile(model)
    got = lib.run({"A": x})["Y"].astype(np.float64)
    xq = nbits.quantize_activations(x, block)
    assert np.array_equal(nbits.quantize_activations(xq, block), xq)       # idempotent: a' is on the int8 grid
    # with identity-like weights the output reads a' back: compare the product of a' exactly instead
    exact = xq.astype(np.float64) @ weight.dequantize()
    bound = gamma(K + K // block + 4) * int8_magnitude(xq, weight)
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.parametrize("a_shape", [(1, 256), (6, 256)])
def test_two_threads_share_the_column_groups_and_row_tiles(a_shape):
    model, weight = nbits_model(256, 200, a_shape, zp="u8", bias=True)
    check_against_ort(model, weight, a_shape, threads=2)
