"""The SCons tool end to end: a temporary SConstruct builds models with `env.CuvilModel` and
`env.Cuvil`, links a C program against them, and rebuilds only what a changed setting touches."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import cuvil
from tests.helpers import make_model, run_ort

# What `cuvil.scons_toolpath()` returns: the site_tools folder beside the installed package.
TOOLPATH = Path(cuvil.__file__).resolve().parents[1] / "site_scons" / "site_tools"

MLP_INPUT = ((np.arange(8, dtype=np.float32) - 3.5) * 0.25).reshape(2, 4)
SIG_INPUT = ((np.arange(15, dtype=np.float32) - 7) * 0.5).reshape(3, 5)

MAIN_C = r"""
#include <stdio.h>
#include "mlp.h"
#include "sig.h"

static int check(int status, const char* message) {
    if (status != 0) fprintf(stderr, "error: %s\n", message);
    return status;
}

int main(void) {
    float x[2 * 4], y[2 * 3], s[3 * 5], t[3 * 5];
    for (int i = 0; i < 2 * 4; i++) x[i] = (i - 3.5f) * 0.25f;
    for (int i = 0; i < 3 * 5; i++) s[i] = (i - 7) * 0.5f;
    const void* mlp_in[] = {x};
    void* mlp_out[] = {y};
    const void* sig_in[] = {s};
    void* sig_out[] = {t};
    mlp_session* m = mlp_session_create();
    sig_session* g = sig_session_create();
    if (!m || !g) return 1;
    if (check(mlp_session_run(m, mlp_in, mlp_out), mlp_session_error(m))) return 1;
    if (check(sig_session_run(g, sig_in, sig_out), sig_session_error(g))) return 1;
    for (int i = 0; i < 2 * 3; i++) printf("mlp %.9g\n", y[i]);
    for (int i = 0; i < 3 * 5; i++) printf("sig %.9g\n", t[i]);
    mlp_session_destroy(m);
    sig_session_destroy(g);
    return 0;
}
"""

SCONSTRUCT = """\
import cuvil
env = Environment(tools=["default", "cuvil"], toolpath=[{toolpath!r}], CUVIL_CACHE_DIR={cache!r})
env.CuvilModel("build/mlp/libmlp.so", "mlp.onnx", CUVIL_INPUTS={{"x": [2, 4]}}, CUVIL_PREFIX="mlp_",
               CUVIL_THREADS={threads})
env.CuvilModel("build/sig/libsig.so", "sig.onnx", CUVIL_PREFIX="sig_")
folders = ["build/mlp", "build/sig"]
env.Program("main", "main.c", CPPPATH=folders, LIBS=["mlp", "sig"], LIBPATH=folders,
            RPATH=[Dir(f).abspath for f in folders])
"""


def mlp_model() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    # The batch dimension is symbolic: CUVIL_INPUTS fixes it.
    return make_model(nodes, [("x", np.float32, ["N", 4])], [("y", np.float32, ["N", 3])],
                      {"W": rng.standard_normal((4, 3)).astype(np.float32),
                       "b": rng.standard_normal(3).astype(np.float32)})


def sig_model() -> onnx.ModelProto:
    return make_model([helper.make_node("Sigmoid", ["x"], ["y"])], [("x", np.float32, [3, 5])],
                      [("y", np.float32, [3, 5])])


def scons(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import SCons.Script; SCons.Script.main()", "-Q", *args],
                          cwd=cwd, capture_output=True, text=True)


def built(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One step cache for the module: kernels compiled by one test are reused by the next."""
    return tmp_path_factory.mktemp("cuvil-cache")


@pytest.fixture
def project(tmp_path, cache_dir) -> Path:
    onnx.save(mlp_model(), tmp_path / "mlp.onnx")
    onnx.save(sig_model(), tmp_path / "sig.onnx")
    (tmp_path / "main.c").write_text(MAIN_C)
    write_sconstruct(tmp_path, cache_dir, threads=1)
    return tmp_path


def write_sconstruct(folder: Path, cache_dir: Path, threads: int) -> None:
    (folder / "SConstruct").write_text(SCONSTRUCT.format(toolpath=str(TOOLPATH), cache=str(cache_dir),
                                                         threads=threads))


def check_program(folder: Path) -> None:
    result = subprocess.run([str(folder / "main")], capture_output=True, text=True, check=True)
    printed = {"mlp": [], "sig": []}
    for line in result.stdout.splitlines():
        which, value = line.split()
        printed[which].append(float(value))
    want_mlp = run_ort(mlp_model(), {"x": MLP_INPUT})["y"]
    want_sig = run_ort(sig_model(), {"x": SIG_INPUT})["y"]
    assert np.abs(want_mlp).max() > 0  # the Relu leaves something to compare
    np.testing.assert_allclose(np.reshape(printed["mlp"], want_mlp.shape), want_mlp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.reshape(printed["sig"], want_sig.shape), want_sig, rtol=1e-5, atol=1e-5)


def mtimes(folder: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in sorted((folder / "build").rglob("*")) + [folder / "main"]
            if p.is_file()}


def test_toolpath_is_the_packages_site_tools():
    assert (TOOLPATH / "cuvil.py").is_file()
    if hasattr(cuvil, "scons_toolpath"):
        assert Path(cuvil.scons_toolpath()) == TOOLPATH


def test_models_link_into_a_c_program_and_rebuild_only_on_change(project, cache_dir):
    first = built(scons(project))
    assert "cuvil-compile mlp.onnx -o build/mlp" in first.stdout
    assert "cuvil-compile sig.onnx -o build/sig" in first.stdout
    for path in ["build/mlp/libmlp.so", "build/mlp/mlp.h", "build/mlp/manifest.json",
                 "build/sig/libsig.so", "build/sig/sig.h", "build/sig/manifest.json"]:
        assert (project / path).is_file(), path
    assert json.loads((project / "build/mlp/manifest.json").read_text())["symbol_prefix"] == "mlp_"
    check_program(project)

    # A second run has nothing to do.
    assert scons(project, "--question").returncode == 0
    before = mtimes(project)
    again = built(scons(project))
    assert "cuvil-compile" not in again.stdout
    assert mtimes(project) == before

    # CUVIL_THREADS is in the varlist: the mlp library is rebuilt, the sigmoid one is not.
    write_sconstruct(project, cache_dir, threads=2)
    assert scons(project, "--question").returncode != 0
    rebuilt = built(scons(project))
    assert "--threads 2" in rebuilt.stdout and "cuvil-compile mlp.onnx" in rebuilt.stdout
    assert "cuvil-compile sig.onnx" not in rebuilt.stdout
    assert json.loads((project / "build/mlp/manifest.json").read_text())["threads"] == 2
    check_program(project)
    assert scons(project, "--question").returncode == 0


def test_cuvilcomstr_sets_the_printed_line(project):
    sconstruct = project / "SConstruct"
    sconstruct.write_text(sconstruct.read_text().replace("Environment(", 'Environment(CUVILCOMSTR="model $TARGET", '))
    result = built(scons(project, "build/sig"))
    assert result.stdout.splitlines() == ["model build/sig/libsig.so"]


def write_config(folder: Path, cache_dir: Path, threads: int = 1, extra: str = "") -> None:
    (folder / "cuvil.yaml").write_text(textwrap.dedent(f"""\
        version: 1
        output_dir: out
        cache:
          dir: {cache_dir}
        models:
          - name: sig
            source: sig.onnx
            inputs: {{x: [3, 5]}}
            targets: [native]
            threads: {threads}
        {extra}"""))


def test_cuvil_yaml_declares_one_library_per_model_and_target(tmp_path, cache_dir):
    onnx.save(sig_model(), tmp_path / "sig.onnx")
    write_config(tmp_path, cache_dir)
    (tmp_path / "SConstruct").write_text(
        f'env = Environment(tools=["default", "cuvil"], toolpath=[{str(TOOLPATH)!r}])\n'
        'libraries = env.Cuvil("cuvil.yaml")\n'
        'print("libraries:", " ".join(str(n) for n in libraries))\n')
    first = built(scons(tmp_path))
    assert "libraries: out/sig/native/libsig.so" in first.stdout
    folder = tmp_path / "out/sig/native"
    assert sorted(p.name for p in folder.iterdir()) == ["libsig.so", "manifest.json", "sig.h", "sig.pc",
                                                        "sigConfig.cmake", "sigConfigVersion.cmake"]
    got = cuvil.load(folder / "libsig.so").run({"x": SIG_INPUT})["y"]
    np.testing.assert_allclose(got, run_ort(sig_model(), {"x": SIG_INPUT})["y"], rtol=1e-5, atol=1e-5)
    assert scons(tmp_path, "--question").returncode == 0

    write_config(tmp_path, cache_dir, threads=2)
    assert "cuvil-compile sig.onnx" in built(scons(tmp_path)).stdout
    assert json.loads((folder / "manifest.json").read_text())["threads"] == 2


def test_a_cuvil_error_fails_the_build_with_its_message(project):
    sconstruct = project / "SConstruct"
    # int8 builds on the CPU targets now; on a CUDA target it is still refused
    sconstruct.write_text(sconstruct.read_text().replace('CUVIL_PREFIX="sig_"', 'CUVIL_PREFIX="sig_", '
                                                                                  'CUVIL_PRECISION="int8", '
                                                                                  'CUVIL_TARGET="cuda-sm90"'))
    result = scons(project, "build/sig")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "precision 'int8' is not supported" in output and "hint:" in output
    assert "Traceback" not in output
    assert not (project / "build/sig/libsig.so").exists()


def test_a_bad_cuvil_yaml_stops_scons_with_file_and_line(tmp_path, cache_dir):
    onnx.save(sig_model(), tmp_path / "sig.onnx")
    write_config(tmp_path, cache_dir, extra="colour: blue\n")
    (tmp_path / "SConstruct").write_text(
        f'env = Environment(tools=["default", "cuvil"], toolpath=[{str(TOOLPATH)!r}])\n'
        'env.Cuvil("cuvil.yaml")\n')
    result = scons(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "cuvil.yaml:11:" in output and "unknown key 'colour'" in output
    assert "Traceback" not in output


def test_pass_options_and_arena_limit_reach_the_build(project):
    """CUVIL_PASS_OPTIONS is checked like cuvil.yaml's pass_options; CUVIL_MAX_ARENA_MB is in the varlist."""
    sconstruct = project / "SConstruct"
    original = sconstruct.read_text()
    sconstruct.write_text(original.replace('CUVIL_PREFIX="sig_"', 'CUVIL_PREFIX="sig_", CUVIL_PASS_OPTIONS={"nope": {}}'))
    result = scons(project, "build/sig")
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "unknown pass 'nope'" in output and "Traceback" not in output
    sconstruct.write_text(original)
    built(scons(project, "build/sig"))
    sconstruct.write_text(original.replace('CUVIL_PREFIX="sig_"', 'CUVIL_PREFIX="sig_", CUVIL_MAX_ARENA_MB=64'))
    assert "sig.onnx" in built(scons(project, "build/sig")).stdout
