"""Reduced precision end to end: `precision: bf16 | fp16` (and `enable_fp16=True`) marks the weight
products (passes/assign_precision.py), which compute on 16-bit operands with float32 sums
(backends/numba_cpu/gemm.py over ukernel_lowp.py). Compared with onnxruntime in float32.

The bound, derived from the formats (round to nearest even, unit roundoff u = 2^-8 for bf16,
2^-11 for fp16): each operand is rounded once, so a product is off by at most (2u + u^2)|a b|;
an fp16 operand in the subnormal range (|x| < 2^-14) is off by at most 2^-25 absolutely, which
adds 2^-25 (1 + u)(|a| + |b|) to a product. Both engines sum K products and a bias in float32,
each within gamma(K + 2) = (K + 2) 2^-24 / (1 - (K + 2) 2^-24) of the sum of magnitudes. So for
Y = act(X W + b) with a 1-Lipschitz act (Relu):

    |Y - Y_ort| <= (2u + u^2 + 2 gamma(K + 2)) (|X| |W| + |b|)  [+ 2^-25 (1 + u)(rowsum|X| + colsum|W|) for fp16]

Whole models are held to the accuracy the issue asks of a reduced-precision build: cosine
similarity >= 0.999 to float32 on every output.
"""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil.errors import CuvilError
from cuvil.explain import explain_model
from tests.helpers import cosine

U = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def _gamma(n):
    return n * 2.0 ** -24 / (1 - n * 2.0 ** -24)


def _bound(x2d, w, b, precision):
    u = U[precision]
    K = w.shape[0]
    magnitude = np.abs(x2d).astype(np.float64) @ np.abs(w).astype(np.float64) + np.abs(b)
    bound = (2 * u + u * u + 2 * _gamma(K + 2)) * magnitude
    if precision == "fp16":
        rows = np.abs(x2d).sum(axis=1, keepdims=True)
        cols = np.abs(w).sum(axis=0, keepdims=True)
        bound += 2.0 ** -25 * (1 + u) * (rows + cols)
    return bound


def _linear_model(x_shape, K, N, seed=0, relu=True):
    """MatMul + bias Add (+ Relu): fuse_gemm and fuse_activation make it one FusedGemm."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * 0.2).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="linear"), helper.make_node("Add", ["h", "b"], ["z"])]
    nodes.append(helper.make_node("Relu", ["z"], ["y"]) if relu else helper.make_node("Identity", ["z"], ["y"]))
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w, b


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("target, method", [("native", None), ("x86_64-avx2", {"bf16": "widen", "fp16": "f16c"})])
def test_a_linear_layer_is_within_the_derived_bound(precision, target, method):
    # K odd: bf16 pads A and B with a zero pair element; N = 80: a full and a partial panel of columns
    M, K, N = 5, 257, 80
    model, w, b = _linear_model((M, K), K, N)
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    lib = cuvil.compile(model, precision=precision, target=target)
    got, want = lib.run({"x": x})["y"], _ort(model, {"x": x})
    bound = _bound(x, w, b, precision)
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    assert lib.info["precision"] == precision
    # the operands really were rounded: float32 would be ~100x closer than bf16 / fp16's bound
    assert np.max(np.abs(got - want)) > 1e-3 * np.max(bound)
    labels = [k.precision for k in explain_model(model, precision=precision, target=target).kernels]
    expected = method[precision] if method else ("dpbf16" if precision == "bf16" else "f16c")
    assert f"{precision} ({expected})" in labels and f"{precision} (A converted)" in labels


def test_a_batched_matmul_folds_into_one_reduced_precision_product():
    B, T, K, N = 2, 3, 96, 64
    model, w, b = _linear_model((B, T, K), K, N, relu=False)
    x = np.random.default_rng(2).standard_normal((B, T, K)).astype(np.float32)
    got = cuvil.compile(model, precision="bf16").run({"x": x})["y"]
    want = _ort(model, {"x": x})
    bound = _bound(x.reshape(B * T, K), w, b, "bf16").reshape(B, T, N)
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound)


@pytest.mark.parametrize("target", ["native", "x86_64-avx2"])
def test_streamed_bf16_weights_are_prefetched_far_ahead(target):
    """bf16 weights too large for L2 (600 x 520, 1.25 MB in float32) stream from the L3 or memory:
    the product's micro-kernels prefetch B STREAM_PREFETCH_B_ROWS pair rows ahead (LowpStreamedSpec;
    "dpbf16" here, "widen" on x86_64-avx2), within the derived bound (a prefetch changes no bits)."""
    import json
    import re
    from backends.numba_cpu.gemm import STREAM_PREFETCH_B_ROWS
    from backends.numba_cpu.registry import lower
    from cuvil import pipeline
    from cuvil.frontends.onnx import import_onnx
    M, K, N = 37, 600, 520
    model, w, b = _linear_model((M, K), K, N)
    names, options = pipeline.pass_list(2, precision="bf16")
    graph = pipeline.run_passes(import_onnx(model)[0], [n for n in names if n != "plan_memory"], options)
    specs = [json.loads(m) for c in lower(graph, 1) if hasattr(c, "kernel")
             for m in re.findall(r"# cuvil-ukernel cuvil_ukbf16_\S+ (\{.*\})", c.kernel.source)]
    assert specs and all(s["kind"] == "lowpstream" and s["prefetch_b"] == STREAM_PREFETCH_B_ROWS for s in specs)
    x = np.random.default_rng(3).standard_normal((M, K)).astype(np.float32)
    got = cuvil.compile(model, precision="bf16", target=target).run({"x": x})["y"]
    assert np.all(np.abs(got.astype(np.float64) - _ort(model, {"x": x})) <= _bound(x, w, b, "bf16"))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_an_mlp_keeps_its_outputs_and_halves_its_weights(precision):
    torch = pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.mlp(sizes=(256, 512, 256, 64, 16)), {"x": (4, 256)})
    x = zoo.sample_input((4, 256))
    want = _ort(model, {"x": x})
    fp32 = cuvil.compile(model)
    reduced = cuvil.compile(model, precision=precision)
    assert cosine(reduced.run({"x": x})[fp32.output_names[0]], want) >= 0.999
    assert reduced.info["memory"]["weights_bytes"] <= 0.55 * fp32.info["memory"]["weights_bytes"]
    assert torch is not None


def test_enable_fp16_is_precision_fp16_for_onnx_and_torch_models(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32)).eval()
    x = torch.randn(3, 64)
    want = module(x).detach().numpy()
    lib = cuvil.compile(module, input_shapes={"x": [3, 64]}, enable_fp16=True)
    assert lib.info["precision"] == "fp16"
    assert cosine(lib.run({lib.input_names[0]: x.numpy()})[lib.output_names[0]], want) >= 0.999

    model, _, _ = _linear_model((4, 64), 64, 32)
    a = cuvil.compile(model, enable_fp16=True).save(tmp_path / "a")
    b = cuvil.compile(model, precision="fp16").save(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    with pytest.raises(CuvilError, match="enable_fp16=True asks for fp16"):
        cuvil.compile(model, enable_fp16=True, precision="bf16")


def test_keep_fp32_and_a_target_without_the_instructions_are_explained():
    model, w, b = _linear_model((4, 64), 64, 32)
    kept = explain_model(model, precision="bf16", pass_options={"assign_precision": {"keep_fp32": ["linear"]}})
    assert all(not k.precision for k in kept.kernels)
    assert [p.summary for p in kept.passes if p.name == "assign_precision"] == ["no change"]
    # generic x86-64 has no F16C: fp16 products compute in float32, and explain says so
    generic = explain_model(model, precision="fp16", target="generic")
    assert any(k.precision.startswith("float32 (marked fp16") for k in generic.kernels)
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    got = cuvil.compile(model, precision="fp16", target="generic").run({"x": x})["y"]
    np.testing.assert_allclose(got, _ort(model, {"x": x}), rtol=1e-5, atol=1e-5)


def test_precision_is_in_the_step_keys_and_the_manifest(tmp_path):
    model, _, _ = _linear_model((4, 64), 64, 32)
    infos = {p: cuvil.compile(model, precision=p).info for p in ("fp32", "bf16", "fp16")}
    assert len({info["spec_hash"] for info in infos.values()}) == 3
    assert [info["precision"] for info in infos.values()] == ["fp32", "bf16", "fp16"]
    assert "assign_precision" in infos["bf16"]["passes"] and "assign_precision" not in infos["fp32"]["passes"]


def test_fp16_leaves_winograd_out_unless_the_pass_list_names_it_and_bf16_keeps_it():
    """An fp16 build runs its 3x3 convs as 16-bit implicit GEMMs instead of float32 Winograd, whose
    load-time transformed weights (16/9-4x the float32 weights) held ResNet-50 fp16 at 167 MB
    resident instead of 61 MB (benchmarks/resident.py); an explicit `passes:` list keeps it. A bf16
    build keeps the pass: its Winograd is bf16 F(2x2, 3x3) with U packed at build time in place of
    W (backends/numba_cpu/winograd_bf16.py), nothing transformed at load."""
    from cuvil import pipeline
    from passes import resolve_passes
    assert "winograd" in pipeline.pass_list(2)[0]
    assert "winograd" in pipeline.pass_list(2, precision="bf16")[0]
    assert "winograd" not in pipeline.pass_list(2, precision="fp16")[0]
    assert "winograd" in pipeline.pass_list(2, resolve_passes(2, None, ()), precision="fp16")[0]
    pytest.importorskip("torch")
    from tests import zoo
    model = zoo.export(zoo.resnet((1, 1, 1, 1), width=16), {"x": (1, 3, 32, 32)})
    fp32, bf16 = (cuvil.compile(model, precision=p, accuracy={"samples": 1} if p != "fp32" else None).info
                  for p in ("fp32", "bf16"))
    assert "winograd" in fp32["passes"] and fp32["memory"]["shared_bytes"] > 0
    assert "winograd" in bf16["passes"] and bf16["memory"]["shared_bytes"] == 0   # U packed at build time
    # (this small model's last stages, 2x2 and 1x1 images, run on float32 direct kernels: its
    # weights do not halve; ResNet-50 at 224x224 goes from 103 to 52 MB, benchmarks/resident.py)
    held = lambda info: info["memory"]["weights_bytes"] + info["memory"]["shared_bytes"]
    assert held(bf16) < held(fp32)
