"""Reduced precision on the cross targets (issue 28): bf16, fp16, int8 and int4 libraries built for
aarch64 Linux, wasm32 and 64-bit Windows, run under qemu-aarch64, wasmtime or Wine (cuvil/cross.py)
and compared with onnxruntime on this machine; and the int8 `sdot` micro-kernel of
`aarch64-neon-fp16-dotprod`.

What each target computes (`cuvil explain` says it per kernel):
- bf16: the "widen" products on every target (portable vector IR: bf16 -> float32 is a shift);
- fp16: AArch64 widens float16 with NEON (FCVTL, F16C's equivalent); wasm32 (SIMD128) and the
  DLL's baseline x86-64 have no half conversion, so the products compute in float32 and explain
  names that reason;
- int8 (`precision: int8`, calibrated QDQ): the exact integer kernels (quant.py's scalar loops; on
  the dot-product variant the GEMMs take the sdot micro-kernel);
- int4: MatMulNBits (packed 4-bit weights) without the AVX-512 lookup table.

Tolerances, each the one its host test derives:
- bf16 / fp16: tests/test_precision.py's bound on |Y - Y_ort| for a linear layer (the operands
  rounded once to 16 bits, float32 sums in both engines). Without FMA (wasm32, the DLL) a float32
  product rounds once more, u |a b| <= 2^-24 |a b| a term: inside the bound's 2u (2^-7 or 2^-10).
- int8: bit-exact where onnxruntime's integer ops are exact (MatMulInteger, QLinearMatMul:
  tests/test_int8_gemm.py); a calibrated model within one output quantisation step of onnxruntime
  running the same QDQ file (tests/test_calibrate.py's bound: both quantise the output, and float32
  rounding near a .5 boundary may pick the neighbouring step).
- int4: tests/test_nbits.py's per-element bound, gamma(K + K/block + 4) + gamma(K + 1) times
  sum_k |a_k| |w_k|; without FMA each of cuvil's K products rounds once more: gamma(2K + K/block + 4).

The tools come from `.ci/run`; a test skips naming the package when one is missing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cuvil.build import VariantSpec, build_variant
from cuvil.cache import Cache
from cuvil.cross import emulator_problem, run_emulated
from cuvil.explain import explain_model
from tests.helpers import run_ort
from tests.test_precision import _bound, _linear_model

PROBLEMS = {platform: emulator_problem(platform) for platform in ("aarch64-linux", "wasm32", "x86_64-windows")}
PLATFORM = {"aarch64-linux": "aarch64-linux", "aarch64-neon-fp16-dotprod": "aarch64-linux", "wasm32": "wasm32",
            "x86_64-windows": "x86_64-windows"}
NO_FMA = ("wasm32", "x86_64-windows")   # backends/numba_cpu/emit.py lacks_fma


def _skip_without_tools(target):
    problem = PROBLEMS[PLATFORM[target]]
    if problem:
        pytest.skip(f"cannot build and run {target} here: {problem}")


def _build(model, shapes, out: Path, target: str, **options):
    spec = VariantSpec(name="m", source=model.SerializeToString(), input_shapes=shapes, target=target, **options)
    return build_variant(spec, out, Cache(Path(os.environ["CUVIL_CACHE_DIR"])))


def _labels(model, target, **options):
    return [k.precision for k in explain_model(model, target=target, **options).kernels]


# -- bf16 / fp16 --------------------------------------------------------------------------------

# (target, precision): what explain reports for the product
LOWP_CASES = {
    ("aarch64-linux", "fp16"): "fp16 (f16c)",
    ("aarch64-linux", "bf16"): "bf16 (widen)",
    ("aarch64-neon-fp16-dotprod", "fp16"): "fp16 (f16c)",
    ("wasm32", "bf16"): "bf16 (widen)",
    ("wasm32", "fp16"): "float32 (marked fp16: the target wasm32 has no half-precision conversion",
    ("x86_64-windows", "bf16"): "bf16 (widen)",
    ("x86_64-windows", "fp16"): "float32 (marked fp16: the target x86_64-windows (cpu x86-64) has no F16C",
}
FAST_LOWP = {("aarch64-linux", "fp16"), ("wasm32", "bf16")}


@pytest.mark.parametrize("target, precision", [
    pytest.param(*case, marks=() if case in FAST_LOWP else pytest.mark.slow) for case in LOWP_CASES])
def test_a_linear_layer_in_16_bits_is_within_the_derived_bound(target, precision, tmp_path):
    _skip_without_tools(target)
    M, K, N = 5, 257, 80     # K odd (bf16 pads a pair), N = 80: a full and a partial column panel
    model, w, b = _linear_model((M, K), K, N)
    expected = LOWP_CASES[target, precision]
    assert any(label.startswith(expected) for label in _labels(model, target, precision=precision))
    artifacts = _build(model, {"x": [M, K]}, tmp_path, target, precision=precision)
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    got, want = run_emulated(artifacts.library, {"x": x})["y"], run_ort(model, {"x": x})["y"]
    bound = _bound(x, w, b, precision)
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound), float(np.max(np.abs(got - want) - bound))
    if not expected.startswith("float32"):   # the operands really were rounded to 16 bits
        assert np.max(np.abs(got - want)) > 1e-3 * np.max(bound)
    manifest = json.loads(artifacts.manifest.read_text())
    assert manifest["precision"] == precision and manifest["target"] == target
    # the accuracy report ran both libraries under the emulator
    assert manifest["accuracy"]["reference"] == "fp32" and manifest["accuracy"]["outputs"]["y"]["cosine"] > 0.999


# -- int8 -----------------------------------------------------------------------------------------

def _int8_cases():
    from tests.test_int8_gemm import F32, I8, MATMUL_INTEGER, U8, _one_node, ints
    cases = {}
    for case in ("u8_runtime_zero", "s8_const_zero_batched", "u8_weights_zero_128", "s8_no_zero_per_column_b_zero"):
        a, b, za, za_const, zb = MATMUL_INTEGER[case]
        inputs = [("a", a, False), ("b", b, True), ("za", za, za_const) if za is not None else ("", None, True)]
        if zb is not None:
            inputs.append(("zb", zb, True))
        cases[f"MatMulInteger_{case}"] = (_one_node("MatMulInteger", inputs, np.int32), "i32")
    for dtype, M, K, N, per_column, name in ((U8, 10, 64, 96, False, "u8"), (I8, 17, 128, 40, True, "s8")):
        rng = np.random.default_rng(11)
        sb = rng.uniform(0.002, 0.01, N).astype(F32) if per_column else np.array(0.004, F32)
        zero = (lambda v, dtype=dtype: np.array(v, dtype))
        inputs = [("a", ints((M, K), dtype, 12), False), ("sa", np.array(0.05, F32), True), ("za", zero(3), True),
                  ("b", ints((K, N), I8, 13), True), ("sb", sb, True), ("zb", np.array(0, I8), True),
                  ("sy", np.array(0.9, F32), True), ("zy", zero(120 if dtype == U8 else -4), True)]
        cases[f"QLinearMatMul_{name}"] = (_one_node("QLinearMatMul", inputs, dtype), name)
    return cases


SDOT_FAST = ("MatMulInteger_u8_runtime_zero", "QLinearMatMul_s8")
SDOT_CASES = ["MatMulInteger_u8_runtime_zero", "MatMulInteger_s8_const_zero_batched",
              "MatMulInteger_u8_weights_zero_128", "MatMulInteger_s8_no_zero_per_column_b_zero",
              "QLinearMatMul_u8", "QLinearMatMul_s8"]


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in SDOT_FAST else pytest.mark.slow)
                                  for c in SDOT_CASES])
def test_sdot_integer_products_are_onnxruntimes_bit_for_bit(case, tmp_path):
    """uint8 and int8 activations (the -128 shift of uint8 and its compensation), constant, run-time
    and absent zero points, per-column weight zero points and scales, M and N off the tile."""
    _skip_without_tools("aarch64-neon-fp16-dotprod")
    (model, feeds), out = _int8_cases()[case]
    target = "aarch64-neon-fp16-dotprod"
    assert f"int8 (sdot, {out} out)" in _labels(model, target)
    assert not any("sdot" in label for label in _labels(model, "aarch64-linux"))   # no dot product: scalar loops
    artifacts = _build(model, {k: list(v.shape) for k, v in feeds.items()}, tmp_path, target)
    got = run_emulated(artifacts.library, feeds)["y"]
    np.testing.assert_array_equal(got, run_ort(model, feeds)["y"])


def test_sdot_micro_kernel_keeps_its_accumulators_in_registers():
    """The 6x64 sdot kernel's K loop: 24 SDOTs a k quad on 24 accumulators, no spill (stack access)."""
    import re

    import llvmlite.binding as llvm

    from backends.numba_cpu.ukernel_int8 import Int8UKSpec, int8_ukernel_ir
    from backends.targets import TARGETS, init_llvm
    init_llvm()
    target = TARGETS["aarch64-neon-fp16-dotprod"]
    text = int8_ukernel_ir(Int8UKSpec(mr=6, nr=64, out="u8", dot="sdot"))
    assert "llvm.x86" not in text
    loop = _hot_loop(text, target, "sdot")
    assert len(re.findall(r"\bsdot\b", loop)) == 24 and "[sp" not in loop


def _hot_loop(text: str, target, instruction: str) -> str:
    """The first loop (label to its backward branch) of the function's AArch64 assembly that has `instruction`."""
    import re

    import llvmlite.binding as llvm
    attrs = f'attributes #0 = {{ nounwind "target-cpu"="{target.cpu}" "target-features"="{target.features}" }}'
    module = llvm.parse_assembly(text.replace("attributes #0 = { nounwind }", attrs))
    module.triple = target.triple
    machine = llvm.Target.from_triple(target.triple).create_target_machine(cpu=target.cpu, features=target.features,
                                                                           opt=3, reloc="pic")
    module.data_layout = str(machine.target_data)
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    builder.getModulePassManager().run(module, builder)
    asm = machine.emit_assembly(module)
    for match in re.finditer(r"^(\.LBB\d+_\d+):\n(.*?)^\s+b\.ne\s+\1$", asm, flags=re.M | re.S):
        if re.search(rf"\b{instruction}\b", match.group(2)):
            return match.group(2)
    raise AssertionError(f"no loop with {instruction}")


def test_neon_float_tile_fills_the_32_registers():
    """The float32 6x64 micro-kernel on AArch64: column chunks of 6x16 (24 accumulators of AArch64's
    32 vector registers, not the 12 of x86's 16), the K loop 24 `fmla` (by element), no spill."""
    import re

    from backends.numba_cpu.ukernel import UKSpec, ukernel_ir
    from backends.targets import TARGETS, init_llvm
    init_llvm()
    target = TARGETS["aarch64-linux"]
    text = ukernel_ir(UKSpec(mr=6, nr=64, a_packed=1, a_panel=6, prefetch_b=0), target.vector_bits, target.arch)
    loop = _hot_loop(text, target, "fmla")
    # each A value is loaded as a scalar and used by lane (LLVM loads the first row's with ld1r: a full vector)
    assert len(re.findall(r"\bfmla\b", loop)) == 24 and "[sp" not in loop
    assert len(re.findall(r"fmla\s+v\d+\.4s, v\d+\.4s, v\d+\.s\[\d\]", loop)) >= 20


# (target): fast in the default run
INT8_TARGETS = {"wasm32": True, "aarch64-neon-fp16-dotprod": False, "aarch64-linux": False, "x86_64-windows": False}


@pytest.mark.parametrize("target", [pytest.param(t, marks=() if fast else pytest.mark.slow)
                                    for t, fast in INT8_TARGETS.items()])
def test_calibrated_int8_is_within_one_step_of_onnxruntime(target, tmp_path):
    import onnx

    from cuvil import calibrate
    _skip_without_tools(target)
    M, K, N = 6, 64, 80
    model, _, _ = _linear_model((M, K), K, N)
    artifacts = _build(model, {"x": [M, K]}, tmp_path, target, precision="int8")
    qdq = calibrate.quantize_model(model.SerializeToString(), {"x": [M, K]}, {**calibrate.DEFAULTS})
    quantised = onnx.load_model_from_string(qdq)
    out_dq = next(n for n in quantised.graph.node if n.output[0] == "y")
    scale = next(t for t in quantised.graph.initializer if t.name == out_dq.input[1])
    step = float(onnx.numpy_helper.to_array(scale))
    x = np.random.default_rng(7).standard_normal((M, K)).astype(np.float32)
    got = run_emulated(artifacts.library, {"x": x})["y"]
    want = run_ort(quantised, {"x": x})["y"]
    assert np.max(np.abs(got - want)) <= step * 1.001
    assert np.mean(np.abs(got - want) < step / 2) >= 0.5
    assert json.loads(artifacts.manifest.read_text())["accuracy"]["outputs"]["y"]["cosine"] > 0.99


# -- int4 -----------------------------------------------------------------------------------------

INT4_TARGETS = {"aarch64-linux": True, "wasm32": False, "x86_64-windows": False}


@pytest.mark.parametrize("target", [pytest.param(t, marks=() if fast else pytest.mark.slow)
                                    for t, fast in INT4_TARGETS.items()])
def test_int4_products_are_within_the_derived_bound(target, tmp_path):
    """A MatMulNBits file (4-bit weights with zero points, a partial last group) and `precision: int4`
    of a float model, whose accuracy report the emulator's runs give."""
    from tests.test_nbits import gamma, magnitude, nbits_model
    _skip_without_tools(target)
    K, N, a_shape, block = 256, 100, (3, 256), 32
    model, weight = nbits_model(K, N, a_shape, 4, block, "u8", True)
    artifacts = _build(model, {"A": list(a_shape)}, tmp_path / "nbits", target)
    x = np.random.default_rng(1).standard_normal(a_shape).astype(np.float32)
    got, want = run_emulated(artifacts.library, {"A": x})["Y"], run_ort(model, {"A": x})["Y"]
    ours = gamma(K + K // block + 4 + (K if target in NO_FMA else 0))
    bound = (ours + gamma(K + 1)) * magnitude(x, weight)
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound)
    linear, _, _ = _linear_model((4, 128), 128, 64)
    own = _build(linear, {"x": [4, 128]}, tmp_path / "own", target, precision="int4")
    report = json.loads(own.manifest.read_text())["accuracy"]
    # 4-bit round-to-nearest of Gaussian weights (tests/test_int4_decoder.py: a broken quantisation is far below)
    assert report["outputs"]["y"]["cosine"] >= 0.98


def test_a_reduced_precision_cross_build_without_its_emulator_names_the_package(monkeypatch, tmp_path):
    """The accuracy report runs the library: without qemu-user it is a CuvilError naming the package."""
    import cuvil.cross
    import cuvil.runtime
    from cuvil import accuracy
    from cuvil.errors import CuvilError
    library = tmp_path / "libm.so"
    library.write_bytes(b"\0")
    monkeypatch.setattr(cuvil.cross, "is_foreign", lambda path: True)
    monkeypatch.setattr(cuvil.runtime, "library_platform", lambda path: "aarch64-linux")
    monkeypatch.setattr(cuvil.cross, "emulator_problem",
                        lambda platform: "qemu-aarch64 is not installed (apt-get install qemu-user)")
    with pytest.raises(CuvilError) as error:
        accuracy._runner(library)
    assert "apt-get install qemu-user" in error.value.message and "aarch64-linux" in error.value.message
    assert "fp32" in error.value.hint
