"""Cross targets (issue 28): libraries for aarch64 Linux and 64-bit Windows built on this x86-64
Linux machine with the Debian cross gcc / MinGW-w64, run under qemu-aarch64 or Wine through
cuvil/cross.py's C program and compared with onnxruntime here.

Tolerance: max |cuvil - onnxruntime| / max |onnxruntime| <= TOL, the float32 bound of the other
fp32 model tests. The aarch64 kernels are the same vector IR as the x86 ones, lowered to NEON
(4 floats a vector, fused multiply-add), so their sums are ordered as in the x86 `generic`
target's; the DLL has the `generic` target's code.

The tools come from `.ci/run` (apt-get install gcc-aarch64-linux-gnu qemu-user gcc-mingw-w64-x86-64
wine64); without them the tests that build or run such code skip, saying which package is missing.
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

from backends.targets import TARGETS, c_compiler, cc_variable
from cuvil.build import VariantSpec, build_variant
from cuvil.cache import Cache
from cuvil.cross import describe, elf_arch, emulator_problem, library_platform, run_emulated
from cuvil.errors import CuvilError, RuntimeFailure
from tests.helpers import run_ort

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "models" / "tiny_cnn.onnx"
TOL = 1e-5

PROBLEM = emulator_problem("aarch64-linux")
needs_cross = pytest.mark.skipif(PROBLEM is not None, reason=f"cannot build and run aarch64 here: {PROBLEM}")
MINGW = "x86_64-w64-mingw32-gcc"
needs_mingw = pytest.mark.skipif(shutil.which(MINGW) is None,
                                 reason=f"{MINGW} is not installed (apt-get install gcc-mingw-w64-x86-64)")
WINE_PROBLEM = emulator_problem("x86_64-windows")
needs_wine = pytest.mark.skipif(WINE_PROBLEM is not None, reason=f"cannot run a Windows DLL here: {WINE_PROBLEM}")


def _cache() -> Cache:
    return Cache(Path(os.environ["CUVIL_CACHE_DIR"]))


def build(model, shapes: dict, out: Path, target="aarch64-linux", cache=None, **options):
    """Build `model` for `target` into `out`: its Artifacts."""
    source = model if isinstance(model, (str, Path)) else model.SerializeToString()
    spec = VariantSpec(name=options.pop("name", "m"), source=source, input_shapes=shapes, target=target, **options)
    return build_variant(spec, out, cache or _cache())


def assert_close(got: dict, want: dict, tol: float = TOL):
    assert list(got) == list(want), f"output names differ: {list(got)} vs {list(want)}"
    for name, ref in want.items():
        out = got[name]
        assert out.shape == ref.shape and out.dtype == ref.dtype, f"{name}: {out.shape} {out.dtype} vs {ref.shape} {ref.dtype}"
        scale = max(float(np.max(np.abs(ref))), 1e-6)
        err = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64))))
        assert err / scale <= tol, f"{name}: max abs error {err:.3g} / max |ref| {scale:.3g} > {tol}"


def check_against_ort(model: onnx.ModelProto, feeds: dict, out: Path, target="aarch64-linux", timeout=120,
                      platform="aarch64-linux", **options):
    artifacts = build(model, {k: list(v.shape) for k, v in feeds.items()}, out, target=target, **options)
    assert library_platform(artifacts.library) == platform
    got = run_emulated(artifacts.library, feeds, timeout=timeout)
    assert_close(got, run_ort(model, feeds))
    return artifacts


def _zoo():
    pytest.importorskip("torch")
    from tests import zoo
    return zoo


# -- targets, errors (no cross tools needed) ------------------------------------------------

def test_aarch64_targets_are_named_for_llvm_and_gcc():
    base, variant = TARGETS["aarch64-linux"], TARGETS["aarch64-neon-fp16-dotprod"]
    for target in (base, variant):
        assert target.triple == "aarch64-unknown-linux-gnu" and target.arch == "aarch64" and target.is_cross
        assert target.vector_bits == 128 and "+neon" in target.features.split(",")
        assert target.as_key()["triple"] == "aarch64-unknown-linux-gnu"   # in every kernel and link step key
    assert {"+fullfp16", "+dotprod"} <= set(variant.features.split(","))
    assert "+fullfp16" not in base.features
    from backends.targets import required_features
    assert required_features(base) == ["neon"]
    assert required_features(variant) == ["neon", "fullfp16", "dotprod"]
    assert not TARGETS["generic"].is_cross


def test_aarch64_kernels_carry_no_x86_intrinsics():
    """The only ISA-specific micro-kernels (the LSTM's thread synchronisation) get AArch64's spin
    hint and counter; LLVM's AArch64 backend compiles each of them."""
    import llvmlite.binding as llvm

    from backends.numba_cpu.ukernel import SyncSpec, ukernel_ir
    from backends.targets import init_llvm
    init_llvm()
    machine = llvm.Target.from_triple("aarch64-unknown-linux-gnu").create_target_machine(
        cpu="generic", features="+neon", opt=2, reloc="pic")
    for op in ("claim", "adopt", "add", "wait"):
        text = ukernel_ir(SyncSpec(op), 128, "aarch64")
        assert "llvm.x86" not in text and "readcyclecounter" not in text
        module = llvm.parse_assembly(text)
        module.triple = "aarch64-unknown-linux-gnu"
        assert machine.emit_object(module)[:4] == b"\x7fELF"
        if op == "adopt":   # its timeout reads the virtual counter (LLVM's readsteadycounter folded to 0: a hang)
            assembly = machine.emit_assembly(module)
            assert "CNTVCT_EL0" in assembly and "CNTFRQ_EL0" in assembly
        assert ukernel_ir(SyncSpec(op), 512) == ukernel_ir(SyncSpec(op), 512, "x86_64")
    # and a kernel that did carry one is refused by name (LLVM would abort the compile worker)
    from backends.numba_cpu.emit import emit_object
    x86_only = ('define void @"cfunc.k"() {\n  call void @llvm.x86.sse2.pause()\n  ret void\n}\n'
                "declare void @llvm.x86.sse2.pause()\n")
    with pytest.raises(ValueError, match="kernel k1: x86 intrinsics in code for the aarch64 target aarch64-linux"):
        emit_object(x86_only, "k1", TARGETS["aarch64-linux"])
    assert emit_object(x86_only, "k1", TARGETS["generic"])[:4] == b"\x7fELF"


def test_missing_cross_compiler_names_the_debian_package(monkeypatch):
    monkeypatch.setenv(cc_variable("aarch64-unknown-linux-gnu"), "no-such-aarch64-gcc")
    with pytest.raises(CuvilError) as error:
        c_compiler(TARGETS["aarch64-linux"])
    assert "no-such-aarch64-gcc" in error.value.message
    assert "apt-get install gcc-aarch64-linux-gnu" in error.value.hint
    with pytest.raises(CuvilError) as error:   # a build stops there, before compiling anything
        build(EXAMPLE, {"input": [1, 3, 32, 32]}, Path("unused"))
    assert "gcc-aarch64-linux-gnu" in error.value.hint


def test_cross_targets_refuse_what_would_run_here():
    import cuvil
    with pytest.raises(CuvilError) as error:
        cuvil.compile(str(EXAMPLE), input_shapes={"input": [1, 3, 32, 32]}, target="aarch64-linux")
    assert "cannot be loaded on this machine" in error.value.message and "cuvil build" in error.value.hint


def test_config_accepts_the_cross_targets(tmp_path):
    from cuvil.config import load_config
    (tmp_path / "cuvil.yaml").write_text(
        "version: 1\nmodels:\n  - name: tiny_cnn\n    source: %s\n    inputs: {input: [1, 3, 32, 32]}\n"
        "    targets: [native, aarch64-linux, aarch64-neon-fp16-dotprod]\n" % EXAMPLE)
    assert load_config(tmp_path / "cuvil.yaml").models[0].targets == ["native", "aarch64-linux",
                                                                      "aarch64-neon-fp16-dotprod"]


# -- built and run under qemu-aarch64 ---------------------------------------------------------

@needs_cross
def test_example_runs_on_aarch64(tmp_path):
    model = onnx.load(EXAMPLE)
    feeds = {"input": np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    artifacts = check_against_ort(model, feeds, tmp_path, name="tiny_cnn")
    library = artifacts.library
    # only libc (and libm for the kernels' calls): nothing from the build machine
    dynamic = subprocess.run(["aarch64-linux-gnu-readelf", "-d", str(library)], capture_output=True, text=True,
                             check=True).stdout
    needed = sorted(line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line)
    assert set(needed) <= {"libc.so.6", "libm.so.6"}, needed
    # the description: in the manifest and in the library, read without loading it
    manifest = json.loads(artifacts.manifest.read_text())
    assert manifest["target"] == "aarch64-linux" and manifest["triple"] == "aarch64-unknown-linux-gnu"
    assert describe(library).info["triple"] == "aarch64-unknown-linux-gnu"
    with pytest.raises(CuvilError, match="a library for aarch64"):
        __import__("cuvil").load(library)
    inspect = subprocess.run([os.sys.executable, "-m", "cuvil", "inspect", str(library)], capture_output=True,
                             text=True, cwd=ROOT)
    assert inspect.returncode == 0, inspect.stderr
    assert "target     aarch64-linux (cpu generic +neon,+fp-armv8), aarch64-unknown-linux-gnu" in inspect.stdout


@needs_cross
def test_feature_variant_checks_hwcap(tmp_path):
    """The fp16 + dot-product variant runs on a CPU that has both (qemu's default, "max") and
    refuses, naming the feature, to make a session on a Cortex-A53 (ARMv8.0: neither)."""
    model = onnx.load(EXAMPLE)
    feeds = {"input": np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    artifacts = check_against_ort(model, feeds, tmp_path / "variant", target="aarch64-neon-fp16-dotprod")
    assert artifacts.info["features"] == TARGETS["aarch64-neon-fp16-dotprod"].features
    with pytest.raises(RuntimeFailure) as error:
        run_emulated(artifacts.library, feeds, cpu="cortex-a53")
    assert "session_create failed" in str(error.value) and "uses fullfp16" in str(error.value)
    # the base target runs on the A53
    base = build(EXAMPLE, {"input": [1, 3, 32, 32]}, tmp_path / "base")
    assert_close(run_emulated(base.library, feeds, cpu="cortex-a53"), run_ort(model, feeds))


@needs_cross
@pytest.mark.slow   # CI budget: MobileNetV2, the encoder and the example cover this target by default
def test_small_resnet_on_aarch64(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.resnet((1, 1, 1, 1), width=8, num_classes=10), {"input": (1, 3, 32, 32)})
    check_against_ort(model, {"input": zoo.sample_input((1, 3, 32, 32))}, tmp_path)


@needs_cross
def test_small_mobilenet_v2_on_aarch64_two_threads(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.mobilenet_v2(width_mult=0.25, num_classes=10), {"input": (1, 3, 32, 32)})
    check_against_ort(model, {"input": zoo.sample_input((1, 3, 32, 32))}, tmp_path, threads=2)


@needs_cross
def test_small_encoder_on_aarch64(tmp_path):
    zoo = _zoo()
    seq = 8
    model = zoo.export(zoo.bert_encoder(layers=1, d=32, heads=2, ff=64, seq=seq), {"ids": (1, seq), "mask": (1, seq)},
                       int_inputs=("ids",))
    mask = np.ones((1, seq), np.float32)
    mask[0, 6:] = 0
    ids = np.random.default_rng(2).integers(0, 100, (1, seq)).astype(np.int64)
    check_against_ort(model, {"ids": ids, "mask": mask}, tmp_path)


@needs_cross
def test_lstm_on_aarch64_split_over_two_threads(tmp_path):
    """Two threads: the recurrence runs as two halves synchronised by the sync micro-kernels
    (rnn.py _unit_split), which are the AArch64 ones here."""
    zoo = _zoo()
    model = zoo.export(zoo.lstm_model(inp=8, hidden=96, layers=1), {"x": (1, 6, 8)})   # H=96: two panels of R
    from backends.numba_cpu.registry import lower
    from cuvil.pipeline import import_model
    schedule = lower(import_model(model.SerializeToString(), {"x": [1, 6, 8]}), 2, target=TARGETS["aarch64-linux"])
    assert any("sync_wait" in call.kernel.source for call in schedule if hasattr(call, "kernel"))
    check_against_ort(model, {"x": zoo.sample_input((1, 6, 8))}, tmp_path, threads=2)


@needs_cross
@pytest.mark.slow
def test_resnet18_on_aarch64(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.resnet((2, 2, 2, 2)), {"input": (1, 3, 224, 224)})
    check_against_ort(model, {"input": zoo.sample_input((1, 3, 224, 224))}, tmp_path, timeout=900)


@needs_cross
@pytest.mark.slow
def test_mobilenet_v2_at_224_on_aarch64(tmp_path):
    zoo = _zoo()
    model = zoo.export(zoo.mobilenet_v2(), {"input": (1, 3, 224, 224)})
    check_against_ort(model, {"input": zoo.sample_input((1, 3, 224, 224))}, tmp_path, timeout=900)


# -- reproducible, and built beside the native library ----------------------------------------

@needs_cross
def test_aarch64_library_is_byte_identical_from_two_build_folders(tmp_path):
    """Two builds with separate caches (every kernel compiled again, in other processes) and
    output folders give the same bytes, the static archive's too."""
    builds = [build(EXAMPLE, {"input": [1, 3, 32, 32]}, tmp_path / f"out{i}", cache=Cache(tmp_path / f"cache{i}"),
                    name="tiny_cnn", link="both") for i in (1, 2)]
    for name in ("libtiny_cnn.so", "libtiny_cnn.a", "manifest.json"):
        first, second = (b.library.parent / name for b in builds)
        assert first.read_bytes() == second.read_bytes(), name
    archive = builds[0].library.parent / "libtiny_cnn.a"
    members = subprocess.run(["aarch64-linux-gnu-objdump", "-f", str(archive)], capture_output=True, text=True,
                             check=True).stdout
    assert "elf64-littleaarch64" in members


@needs_cross
def test_one_build_makes_native_and_aarch64_libraries(tmp_path):
    """...and the Windows DLL where MinGW-w64 is installed."""
    windows = shutil.which(MINGW) is not None
    (tmp_path / "cuvil.yaml").write_text(
        "version: 1\noutput_dir: out\ncache: {dir: %s}\nmodels:\n  - name: tiny_cnn\n    source: %s\n"
        "    inputs: {input: [1, 3, 32, 32]}\n    targets: [native, aarch64-linux%s]\n"
        % (os.environ["CUVIL_CACHE_DIR"], EXAMPLE, ", x86_64-windows" if windows else ""))
    result = subprocess.run([os.sys.executable, "-m", "cuvil", "build", "-f", str(tmp_path / "cuvil.yaml")],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    native, cross = tmp_path / "out/tiny_cnn/native/libtiny_cnn.so", tmp_path / "out/tiny_cnn/aarch64-linux/libtiny_cnn.so"
    assert elf_arch(native) == "x86_64" and elf_arch(cross) == "aarch64"
    feeds = {"input": np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    import cuvil
    want = run_ort(onnx.load(EXAMPLE), feeds)
    assert_close(cuvil.load(native).run(feeds), want)
    assert_close(run_emulated(cross, feeds), want)
    if windows:
        assert library_platform(tmp_path / "out/tiny_cnn/x86_64-windows/tiny_cnn.dll") == "x86_64-windows"


# -- x86_64-windows: a DLL built with MinGW-w64, checked with objdump -p, run under Wine ----------

C_ABI = ("abi_version", "model_info", "session_create", "session_run", "session_error", "session_output_shape",
         "session_destroy")


def _pe_tables(dll: Path) -> tuple[set, set]:
    """(exported names, imported DLLs) of a DLL, from `objdump -p`."""
    text = subprocess.run(["x86_64-w64-mingw32-objdump", "-p", str(dll)], capture_output=True, text=True,
                          check=True).stdout
    names = text.split("[Ordinal/Name Pointer] Table", 1)[1].split("\n\n", 1)[0]
    exports = {line.split("]", 1)[1].strip() for line in names.splitlines() if "]" in line}
    imports = {line.split("DLL Name:", 1)[1].strip() for line in text.splitlines() if "DLL Name:" in line}
    return exports, imports


@needs_mingw
def test_windows_dll_exports_exactly_the_c_abi(tmp_path):
    builds = [build(EXAMPLE, {"input": [1, 3, 32, 32]}, tmp_path / f"out{i}", target="x86_64-windows",
                    cache=Cache(tmp_path / f"cache{i}"), name="tiny_cnn", symbol_prefix="tc_") for i in (1, 2)]
    dll = builds[0].library
    assert dll.name == "tiny_cnn.dll" and dll.read_bytes()[:2] == b"MZ"
    exports, imports = _pe_tables(dll)
    assert exports == {f"tc_{name}" for name in C_ABI}
    assert imports <= {"KERNEL32.dll", "msvcrt.dll"}, imports   # libgcc and winpthreads are linked in
    for name in ("tiny_cnn.dll", "libtiny_cnn.dll.a", "manifest.json"):   # reproducible, the import library too
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes(), name
    assert describe(dll).info["target"] == "x86_64-windows" and describe(dll).platform == "x86_64-windows"
    # a C program links against the import library with the generated header
    (tmp_path / "app.c").write_text('#include "tiny_cnn.h"\nint main(void) { tc_session* s = tc_session_create();\n'
                                    '    tc_session_destroy(s); return tc_abi_version() == TC_ABI_VERSION ? 0 : 1; }\n')
    subprocess.run([MINGW, "-std=c11", "-Wall", "-Werror", "-o", str(tmp_path / "app.exe"), str(tmp_path / "app.c"),
                    f"-I{dll.parent}", f"-L{dll.parent}", "-ltiny_cnn"], check=True)
    with pytest.raises(CuvilError, match="x86_64-windows"):
        __import__("cuvil").load(dll)
    with pytest.raises(CuvilError, match="not supported for the Windows target"):
        build(EXAMPLE, {"input": [1, 3, 32, 32]}, tmp_path / "static", target="x86_64-windows", link="static")


@needs_mingw
@needs_wine
def test_windows_dll_runs_under_wine(tmp_path):
    model = onnx.load(EXAMPLE)
    feeds = {"input": np.random.default_rng(4).standard_normal((1, 3, 32, 32)).astype(np.float32)}
    check_against_ort(model, feeds, tmp_path / "example", target="x86_64-windows", platform="x86_64-windows")
    zoo = _zoo()
    lstm = zoo.export(zoo.lstm_model(inp=8, hidden=96, layers=1), {"x": (1, 6, 8)})   # threads and sync kernels
    check_against_ort(lstm, {"x": zoo.sample_input((1, 6, 8))}, tmp_path / "lstm", target="x86_64-windows",
                      platform="x86_64-windows", threads=2)


@needs_cross
def test_scons_tool_builds_the_cross_targets_of_a_cuvil_yaml(tmp_path):
    """env.Cuvil("cuvil.yaml") in a monorepo's SConstruct: a node per model x target, the DLL
    named as Windows names it (where MinGW-w64 is installed); a second run has nothing to do."""
    windows = shutil.which(MINGW) is not None
    (tmp_path / "cuvil.yaml").write_text(
        "version: 1\noutput_dir: out\ncache: {dir: %s}\nmodels:\n  - name: tiny_cnn\n    source: %s\n"
        "    inputs: {input: [1, 3, 32, 32]}\n    targets: [aarch64-linux%s]\n"
        % (os.environ["CUVIL_CACHE_DIR"], EXAMPLE, ", x86_64-windows" if windows else ""))
    (tmp_path / "SConstruct").write_text(
        f'env = Environment(tools=["default", "cuvil"], toolpath=[{str(ROOT / "site_scons" / "site_tools")!r}])\n'
        'env.Cuvil("cuvil.yaml")\n')
    scons = [os.sys.executable, "-c", "import SCons.Script; SCons.Script.main()", "-Q"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    first = subprocess.run(scons, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert library_platform(tmp_path / "out/tiny_cnn/aarch64-linux/libtiny_cnn.so") == "aarch64-linux"
    if windows:
        assert library_platform(tmp_path / "out/tiny_cnn/x86_64-windows/tiny_cnn.dll") == "x86_64-windows"
        assert (tmp_path / "out/tiny_cnn/x86_64-windows/libtiny_cnn.dll.a").is_file()
    second = subprocess.run(scons, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert second.returncode == 0 and "is up to date" in second.stdout, second.stdout + second.stderr
