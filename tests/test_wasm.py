"""The wasm32 target (issue 28): WebAssembly modules with SIMD128 built on this machine with
llvmlite (the kernels), clang and wasm-ld (the driver, the link, wasi-libc linked in), run in
this process through wasmtime's Python API (cuvil/cross.py run_wasm) and compared with
onnxruntime here.

Tolerance: max |cuvil - onnxruntime| / max |onnxruntime| <= TOL, the float32 bound of the other
fp32 model tests (tests/test_cross.py). The wasm kernels are the same portable vector IR as the
x86 `generic` target's, lowered to 4-float SIMD128 vectors, with the sums in the same order.
WebAssembly has no fused multiply-add: each product is rounded before it is added (one more float32
rounding, 2^-24 relative, per term; emit.py WASM_INTRINSICS), an error of the order of the
summation's own, which the bound already covers for the other targets (onnxruntime's MLAS
kernels fuse or not by CPU).

The tools come from `.ci/run` (apt-get install clang lld wasi-libc libclang-rt-14-dev-wasm32; pip
install wasmtime, the test extra); without them the tests that build or run a module skip, saying
which package is missing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from backends.targets import TARGETS, WASM_TRIPLE, c_compiler, cc_variable
from cuvil.build import VariantSpec, build_variant
from cuvil.cache import Cache
from cuvil.cross import (describe, emulator_problem, library_platform, run_emulated, wasm_exports,
                         wasm_function_names)
from cuvil.errors import CuvilError
from tests.helpers import run_ort

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "models" / "tiny_cnn.onnx"
TOL = 1e-5
C_ABI = ("abi_version", "model_info", "session_create", "session_run", "session_error", "session_output_shape",
         "session_destroy")

PROBLEM = emulator_problem("wasm32")
needs_wasm = pytest.mark.skipif(PROBLEM is not None, reason=f"cannot build and run wasm32 here: {PROBLEM}")


def build(model, shapes: dict, out: Path, cache=None, **options):
    """Build `model` for wasm32 into `out`: its Artifacts."""
    source = model if isinstance(model, (str, Path)) else model.SerializeToString()
    spec = VariantSpec(name=options.pop("name", "m"), source=source, input_shapes=shapes, target="wasm32", **options)
    return build_variant(spec, out, cache or Cache(Path(os.environ["CUVIL_CACHE_DIR"])))


def assert_close(got: dict, want: dict, tol: float = TOL):
    assert list(got) == list(want), f"output names differ: {list(got)} vs {list(want)}"
    for name, ref in want.items():
        out = got[name]
        assert out.shape == ref.shape and out.dtype == ref.dtype, f"{name}: {out.shape} {out.dtype} vs {ref.shape} {ref.dtype}"
        scale = max(float(np.max(np.abs(ref))), 1e-6)
        err = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64))))
        assert err / scale <= tol, f"{name}: max abs error {err:.3g} / max |ref| {scale:.3g} > {tol}"


# libm's float functions LLVM would call, lane by lane, for an intrinsic WebAssembly has no
# instruction for (emit.py WASM_INTRINSICS): none may be linked into a module.
SOFTWARE_FLOAT = {"fmaf", "fmaxf", "fminf", "fma", "fmax", "fmin"}


def check_against_ort(model: onnx.ModelProto, feeds: dict, out: Path, **options):
    artifacts = build(model, {k: list(v.shape) for k, v in feeds.items()}, out, **options)
    assert artifacts.library.suffix == ".wasm" and library_platform(artifacts.library) == "wasm32"
    assert not SOFTWARE_FLOAT & set(wasm_function_names(artifacts.library.read_bytes()))
    assert_close(run_emulated(artifacts.library, feeds), run_ort(model, feeds))
    return artifacts


def _zoo():
    pytest.importorskip("torch")
    from tests import zoo
    return zoo


# -- the target, its errors (no tools needed) -----------------------------------------------------

def test_wasm32_target_is_named_for_llvm_and_clang():
    target = TARGETS["wasm32"]
    assert target.triple == WASM_TRIPLE == "wasm32-unknown-wasi" and target.arch == "wasm32" and target.is_cross
    assert target.features == "+simd128" and target.vector_bits == 128 and target.system == "wasm"
    assert target.library_file("tiny_cnn") == "tiny_cnn.wasm"
    assert target.as_key()["triple"] == WASM_TRIPLE   # in every kernel and link step key
    from backends.targets import required_features
    assert required_features(target) == []   # the engine validates SIMD128 when it compiles the module


def test_wasm32_kernel_is_32_bit_and_returns_nothing():
    """A kernel's object for wasm32: a WebAssembly object whose function takes 32-bit pointers and
    the 64-bit work range, and returns nothing, as the driver declares it (a wasm call must match
    its callee's type exactly)."""
    from backends.numba_cpu.emit import emit_object, kernel_ir
    source = ("def kernel(p0, p1, begin, end):\n"
              "    for i in range(begin, end):\n"
              "        p1[i] = p0[i] * 2.0 + 1.0\n")
    ir = kernel_ir(source, ("float32", "float32"))
    assert "ret ptr" in ir   # Numba's wrapper returns a null pointer
    obj = emit_object(ir, "k_double", TARGETS["wasm32"], source)
    assert obj[:8] == b"\0asm\x01\0\0\0"
    # the type section's only function type: (i32, i32, i64, i64) -> () (0x7f: i32, 0x7e: i64)
    assert b"\x60\x04\x7f\x7f\x7e\x7e\x00" in obj


def test_wasm32_kernels_get_no_x86_intrinsics_and_no_software_float():
    """A kernel carrying an x86 intrinsic is refused by name (LLVM would abort the compile worker);
    llvm.fma and llvm.maxnum, which WebAssembly has no instruction for, become fmuladd and maximum."""
    from backends.numba_cpu.emit import emit_object, wasm_intrinsics
    x86_only = ('define void @"cfunc.k"() {\n  call void @llvm.x86.sse2.pause()\n  ret void\n}\n'
                "declare void @llvm.x86.sse2.pause()\n")
    with pytest.raises(ValueError, match="kernel k1: x86 intrinsics in code for the wasm32 target wasm32"):
        emit_object(x86_only, "k1", TARGETS["wasm32"])
    ir = "call <4 x float> @llvm.fma.v4f32(...)\ncall float @llvm.maxnum.f32(...)\ncall float @llvm.minnum.f32(...)"
    assert wasm_intrinsics(ir) == ("call <4 x float> @llvm.fmuladd.v4f32(...)\ncall float @llvm.maximum.f32(...)\n"
                                   "call float @llvm.minimum.f32(...)")


def test_wasm32_refuses_threads_and_other_link_modes():
    with pytest.raises(CuvilError) as error:
        build(EXAMPLE, {"input": [1, 3, 32, 32]}, Path("unused"), threads=4)
    assert "threads: 4 for target 'wasm32'" in error.value.message and "threads: 1" in error.value.hint
    import cuvil
    with pytest.raises(CuvilError) as error:
        cuvil.compile(str(EXAMPLE), input_shapes={"input": [1, 3, 32, 32]}, target="wasm32")
    assert "cannot be loaded on this machine" in error.value.message
    for options, refused in (({"link": "static"}, "link: static"), ({"sanitize": True}, "sanitize: true")):
        with pytest.raises(CuvilError) as error:   # before anything is compiled
            build(EXAMPLE, {"input": [1, 3, 32, 32]}, Path("unused"), **options)
        assert f"{refused} is not supported for the wasm32 target" in error.value.message


def test_missing_wasm_compiler_names_the_debian_packages(monkeypatch):
    monkeypatch.setenv(cc_variable(WASM_TRIPLE), "no-such-clang")
    with pytest.raises(CuvilError) as error:
        c_compiler(TARGETS["wasm32"])
    assert "no-such-clang" in error.value.message and "apt-get install clang lld wasi-libc" in error.value.hint
    assert "no-such-clang" in emulator_problem("wasm32")


def test_config_accepts_wasm32(tmp_path):
    from cuvil.config import load_config
    (tmp_path / "cuvil.yaml").write_text(
        "version: 1\nmodels:\n  - name: tiny_cnn\n    source: %s\n    inputs: {input: [1, 3, 32, 32]}\n"
        "    targets: [native, wasm32]\n" % EXAMPLE)
    assert load_config(tmp_path / "cuvil.yaml").models[0].targets == ["native", "wasm32"]


# -- built and run in wasmtime ----------------------------------------------------------------

@needs_wasm
def test_example_runs_in_wasmtime_and_is_reproducible(tmp_path):
    """The example matches onnxruntime; the module imports nothing and exports the C ABI, its
    memory and the allocator; two builds with separate caches and folders give the same bytes."""
    model = onnx.load(EXAMPLE)
    feeds = {"input": np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    # the tests' shared cache, then a new one (every kernel compiled again, in other processes)
    builds = [build(EXAMPLE, {"input": [1, 3, 32, 32]}, tmp_path / f"out{i}", cache=cache, name="tiny_cnn",
                    symbol_prefix="tc_") for i, cache in ((1, None), (2, Cache(tmp_path / "cache2")))]
    module = builds[0].library
    assert module.name == "tiny_cnn.wasm"
    assert sorted(p.name for p in module.parent.iterdir()) == ["manifest.json", "tiny_cnn.h", "tiny_cnn.wasm"]
    for name in ("tiny_cnn.wasm", "tiny_cnn.h", "manifest.json"):
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes(), name
    assert_close(run_emulated(module, feeds), run_ort(model, feeds))
    names = set(wasm_function_names(module.read_bytes()))
    assert "tc_session_run" in names and not SOFTWARE_FLOAT & names

    import wasmtime
    compiled = wasmtime.Module.from_file(wasmtime.Engine(), str(module))
    assert list(compiled.imports) == []   # no WASI: any engine, a browser too, instantiates it as it is
    assert sorted(e.name for e in compiled.exports) == sorted(["memory", "_initialize", "malloc", "free",
                                                               *(f"tc_{f}" for f in C_ABI)])
    assert sorted(wasm_exports(module.read_bytes())) == sorted(e.name for e in compiled.exports)
    # the description: in the manifest and in the module, read without running it
    manifest = json.loads(builds[0].manifest.read_text())
    assert manifest["target"] == "wasm32" and manifest["triple"] == WASM_TRIPLE and manifest["threads"] == 1
    assert "-p:32:32" in manifest["data_layout"] and manifest["vector_bits"] == 128   # 32-bit pointers, SIMD128
    described = describe(module)
    assert described.platform == "wasm32" and described.prefix == "tc_" and described.info["triple"] == WASM_TRIPLE
    with pytest.raises(CuvilError, match="a library for wasm32") as error:
        __import__("cuvil").load(module)
    assert "wasmtime" in error.value.hint
    inspect = subprocess.run([os.sys.executable, "-m", "cuvil", "inspect", str(module)], capture_output=True,
                             text=True, cwd=ROOT)
    assert inspect.returncode == 0, inspect.stderr
    assert f"target     wasm32 (cpu generic +simd128), {WASM_TRIPLE}" in inspect.stdout
    # the header is valid C for the target's compiler (a host written in C and compiled to wasm32)
    (tmp_path / "app.c").write_text('#include "tiny_cnn.h"\nint ok(void) { return tc_abi_version() == TC_ABI_VERSION; }\n')
    subprocess.run([c_compiler(TARGETS["wasm32"]), "--target=wasm32-wasi", "-std=c11", "-Wall", "-Werror",
                    "-fsyntax-only", f"-I{module.parent}", str(tmp_path / "app.c")], check=True)


@needs_wasm
def test_session_errors_come_back_through_the_abi(tmp_path):
    """A NULL input is refused with the driver's message (formatted without wasi-libc's stdio)."""
    artifacts = build(EXAMPLE, {"input": [1, 3, 32, 32]}, tmp_path, name="tiny_cnn")
    from cuvil.cross import WasmModule
    module = WasmModule(artifacts.library)
    session = module.call("session_create")
    table = module.malloc(8)
    module.memory.write(module.store, bytes(8), table)   # inputs[0] = outputs[0] = NULL
    assert module.call("session_run", session, table, table + 4) == 2   # ERR_NULL_ARGUMENT
    assert module.string(module.call("session_error", session)) == 'input 0 ("input") is NULL'
    module.call("session_destroy", session)


@needs_wasm
@pytest.mark.slow   # CI budget: MobileNetV2, the encoder and the example cover this target by default
def test_small_resnet_in_wasmtime(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.resnet((1, 1, 1, 1), width=8, num_classes=10), {"input": (1, 3, 32, 32)})
    check_against_ort(model, {"input": zoo.sample_input((1, 3, 32, 32))}, tmp_path)


@needs_wasm
def test_small_mobilenet_v2_in_wasmtime(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.mobilenet_v2(width_mult=0.25, num_classes=10), {"input": (1, 3, 32, 32)})
    check_against_ort(model, {"input": zoo.sample_input((1, 3, 32, 32))}, tmp_path)


@needs_wasm
def test_small_encoder_in_wasmtime(tmp_path):
    zoo = _zoo()
    seq = 8
    model = zoo.export(zoo.bert_encoder(layers=1, d=32, heads=2, ff=64, seq=seq), {"ids": (1, seq), "mask": (1, seq)},
                       int_inputs=("ids",))
    mask = np.ones((1, seq), np.float32)
    mask[0, 6:] = 0
    ids = np.random.default_rng(2).integers(0, 100, (1, seq)).astype(np.int64)
    check_against_ort(model, {"ids": ids, "mask": mask}, tmp_path)


@needs_wasm
def test_lstm_in_wasmtime(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.lstm_model(inp=8, hidden=96, layers=1), {"x": (1, 6, 8)})
    check_against_ort(model, {"x": zoo.sample_input((1, 6, 8))}, tmp_path)


@needs_wasm
@pytest.mark.slow
def test_resnet18_in_wasmtime(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.resnet((2, 2, 2, 2)), {"input": (1, 3, 224, 224)})
    check_against_ort(model, {"input": zoo.sample_input((1, 3, 224, 224))}, tmp_path)


@needs_wasm
@pytest.mark.slow
def test_mobilenet_v2_at_224_in_wasmtime(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.mobilenet_v2(), {"input": (1, 3, 224, 224)})
    check_against_ort(model, {"input": zoo.sample_input((1, 3, 224, 224))}, tmp_path)


NODE_PROGRAM = """import { readFileSync } from "node:fs";
const { instance } = await WebAssembly.instantiate(readFileSync(process.argv[2]));
const m = instance.exports, input = new Float32Array(readFileSync(process.argv[3]).buffer);
m._initialize();
const x = m.malloc(input.byteLength), out = m.malloc(10 * 4), table = m.malloc(8);
new Float32Array(m.memory.buffer, x, input.length).set(input);
new Uint32Array(m.memory.buffer, table, 2).set([x, out]);   // const void* inputs[1], void* outputs[1]
const s = m.cuvil_session_create();
if (m.cuvil_session_run(s, table, table + 4) !== 0) throw new Error("cuvil: run failed");
process.stdout.write(Buffer.from(new Float32Array(m.memory.buffer, out, 10).slice().buffer));
"""


@needs_wasm
@pytest.mark.skipif(shutil.which("node") is None, reason="node (Node.js) is not installed")
def test_example_runs_in_node(tmp_path):
    """Another engine (V8, as in Chrome) runs the same module with no import object: the README's
    JavaScript, reading a raw input file and writing the output's bytes."""
    artifacts = build(EXAMPLE, {"input": [1, 3, 32, 32]}, tmp_path / "out", name="tiny_cnn")
    feeds = {"input": np.random.default_rng(5).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    (tmp_path / "in.bin").write_bytes(feeds["input"].tobytes())
    (tmp_path / "run.mjs").write_text(NODE_PROGRAM)
    result = subprocess.run(["node", str(tmp_path / "run.mjs"), str(artifacts.library), str(tmp_path / "in.bin")],
                            capture_output=True, check=True)
    got = np.frombuffer(result.stdout, np.float32).reshape(1, 10)
    assert_close({"probs": got}, run_ort(onnx.load(EXAMPLE), feeds))


@needs_wasm
def test_one_build_and_the_scons_tool_make_the_wasm_module_beside_the_native_library(tmp_path):
    """`targets: [native, aarch64-linux, wasm32, x86_64-windows]` (the README's) in one `cuvil build`,
    the aarch64 and Windows ones where their cross compilers are installed; then the SCons tool's
    env.Cuvil builds the same cuvil.yaml: the same bytes for all four, the module as <name>.wasm with
    its header and manifest (no pkg-config or CMake files), and a second scons run has nothing to do."""
    cache = os.environ["CUVIL_CACHE_DIR"]
    cross = {}   # target: (library, platform), where its cross compiler is installed (only built, not run)
    if shutil.which("aarch64-linux-gnu-gcc") and Path("/usr/aarch64-linux-gnu").is_dir():
        cross["aarch64-linux"] = ("libtiny_cnn.so", "aarch64-linux")
    if shutil.which("x86_64-w64-mingw32-gcc"):
        cross["x86_64-windows"] = ("tiny_cnn.dll", "x86_64-windows")
    targets = ["native", *(t for t in cross if t == "aarch64-linux"), "wasm32", *(t for t in cross if t != "aarch64-linux")]
    (tmp_path / "cuvil.yaml").write_text(
        "version: 1\noutput_dir: out\ncache: {dir: %s}\nmodels:\n  - name: tiny_cnn\n    source: %s\n"
        "    inputs: {input: [1, 3, 32, 32]}\n    targets: [%s]\n" % (cache, EXAMPLE, ", ".join(targets)))
    result = subprocess.run([os.sys.executable, "-m", "cuvil", "build", "-f", str(tmp_path / "cuvil.yaml")],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    module = tmp_path / "out/tiny_cnn/wasm32/tiny_cnn.wasm"
    assert library_platform(tmp_path / "out/tiny_cnn/native/libtiny_cnn.so") == "x86_64-linux"
    assert library_platform(module) == "wasm32"
    for target, (library, platform) in cross.items():
        assert library_platform(tmp_path / "out/tiny_cnn" / target / library) == platform
    feeds = {"input": np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    assert_close(run_emulated(module, feeds), run_ort(onnx.load(EXAMPLE), feeds))

    (tmp_path / "scons").mkdir()   # the same cuvil.yaml, every target through the SCons tool
    (tmp_path / "scons/cuvil.yaml").write_text((tmp_path / "cuvil.yaml").read_text())
    (tmp_path / "scons/SConstruct").write_text(
        f'env = Environment(tools=["default", "cuvil"], toolpath=[{str(ROOT / "site_scons" / "site_tools")!r}])\n'
        'env.Cuvil("cuvil.yaml")\n')
    scons = [os.sys.executable, "-c", "import SCons.Script; SCons.Script.main()", "-Q"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    first = subprocess.run(scons, cwd=tmp_path / "scons", capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    built = tmp_path / "scons/out/tiny_cnn/wasm32"
    assert sorted(p.name for p in built.iterdir()) == ["manifest.json", "tiny_cnn.h", "tiny_cnn.wasm"]
    assert (built / "tiny_cnn.wasm").read_bytes() == module.read_bytes()
    libraries = {"native": "libtiny_cnn.so", **{target: library for target, (library, _) in cross.items()}}
    for target, library in libraries.items():   # the same bytes as `cuvil build` made
        assert (tmp_path / "scons/out/tiny_cnn" / target / library).read_bytes() == \
            (tmp_path / "out/tiny_cnn" / target / library).read_bytes(), target
    second = subprocess.run(scons, cwd=tmp_path / "scons", capture_output=True, text=True, env=env)
    assert second.returncode == 0 and "is up to date" in second.stdout, second.stdout + second.stderr


def test_wasm32_refuses_a_model_over_its_4_gib_memory():
    """Weights and a session's working memory share the module's 32-bit memory."""
    from backends.targets import check_memory
    check_memory(TARGETS["wasm32"], 3 << 30, 512 << 20)   # fits
    check_memory(TARGETS["aarch64-linux"], 6 << 30, 1 << 30)   # a 64-bit target: no such limit
    with pytest.raises(CuvilError) as error:
        check_memory(TARGETS["wasm32"], 3 << 30, 1 << 30)
    assert "3072 MiB of weights and 1024 MiB of working memory" in error.value.message
    assert "4 GiB memory of a wasm32 module" in error.value.message
