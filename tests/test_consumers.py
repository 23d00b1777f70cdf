"""C and C++ programs that use a built library through pkg-config, CMake or the static archive.

The example project is built with `link: both` (and once with `link: static`);
its output folder is then moved elsewhere, so the .pc and CMake files must find
the library relative to themselves. examples/cpp is built by CMake
(`find_package(tiny_cnn CONFIG REQUIRED)`) and by its Makefile (`pkg-config
--cflags --libs tiny_cnn`), and linked by plain g++ against the archive; each
program runs the model on zeros and must print what onnxruntime computes.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cuvil
from cuvil.build import VariantSpec, plan_variant, tool_versions
from cuvil.cache import Cache
from cuvil.cli import main
from cuvil.config import load_config
from cuvil.dag import StepGraph
from cuvil.errors import CuvilError
from cuvil.project import build_project

from tests.test_c_abi import ABI_FUNCTIONS, SECOND_MODEL
from tests.test_cli import EXAMPLE_MODEL, TEST_CACHE, run_ort, write_example_project

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CPP = ROOT / "examples" / "cpp"
CONSUMER_FILES = ("tiny_cnn.h", "tiny_cnn.pc", "tiny_cnnConfig.cmake", "tiny_cnnConfigVersion.cmake")

pytestmark = pytest.mark.skipif(not all(shutil.which(t) for t in ("g++", "cmake", "pkg-config", "make")),
                                reason="needs g++, cmake, pkg-config and make")


def build_example(folder: Path, link: str, extra_models: str = "") -> dict:
    """The example project built in `folder` with `link:` set in its defaults; {model name: Artifacts}."""
    config = write_example_project(folder, extra_models=extra_models)
    text = config.read_text()
    assert "\n  link: shared\n" in text, "cuvil.yaml.example no longer sets defaults.link: update this test"
    config.write_text(text.replace("\n  link: shared\n", f"\n  link: {link}\n"))
    return {a.info["name"]: a for a in build_project(load_config(config), progress=None).artifacts}


def moved(artifacts, destination: Path) -> Path:
    """Move a variant's output folder to `destination`, away from where it was built."""
    shutil.move(artifacts.library.parent, destination)
    return destination


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The example project with a second model (the same network, prefix other_) linked shared and
    static; returns {model name: the folder its files were moved to}."""
    folder = tmp_path_factory.mktemp("consumers")
    built = build_example(folder, "both", SECOND_MODEL)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    return {name: moved(a, elsewhere / name) for name, a in built.items()}


@pytest.fixture(scope="module")
def static_only(tmp_path_factory):
    folder = tmp_path_factory.mktemp("static")
    built = build_example(folder, "static")
    return moved(built["tiny_cnn"], tmp_path_factory.mktemp("static-elsewhere") / "tiny_cnn")


@pytest.fixture(scope="module")
def expected():
    """onnxruntime's output of the example model on zeros."""
    return run_ort(EXAMPLE_MODEL, {"input": np.zeros((1, 3, 32, 32), np.float32)})["probs"].ravel()


def run(*args, cwd, env=None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300,
                            env=None if env is None else {**os.environ, **env})
    assert result.returncode == 0, f"{' '.join(map(str, args))}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def printed(stdout: str) -> np.ndarray:
    """The values main.cpp prints: `probs: v0 v1 ...`."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("probs:")]
    return np.array(line.split()[1:], np.float64)


def cmake_app(package: Path, work: Path) -> Path:
    """examples/cpp configured and built by CMake against the package in `package`."""
    build = work / "cmake-build"
    run("cmake", "-S", EXAMPLE_CPP, "-B", build, f"-DCMAKE_PREFIX_PATH={package}", cwd=work)
    run("cmake", "--build", build, cwd=work)
    return build / "app"


def make_app(package: Path, work: Path) -> Path:
    """examples/cpp built by its Makefile with pkg-config finding `package`."""
    source = work / "cpp"
    shutil.copytree(EXAMPLE_CPP, source)
    run("make", "-C", source, cwd=work, env={"PKG_CONFIG_PATH": str(package)})
    return source / "app"


def test_files_are_listed_in_the_manifest_and_hold_no_build_path(both):
    folder = both["tiny_cnn"]
    manifest = json.loads((folder / "manifest.json").read_text())
    names = {"libtiny_cnn.so", "libtiny_cnn.a", *CONSUMER_FILES}
    assert set(manifest["files"]) == names
    assert sorted(p.name for p in folder.iterdir()) == sorted(names | {"manifest.json"})
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    for name in CONSUMER_FILES[1:]:
        text = (folder / name).read_text()
        assert not re.search(r"(^|[\s\"=])/(tmp|work|home|root)\b", text, re.M), (name, text)
    assert "prefix=${pcfiledir}\n" in (folder / "tiny_cnn.pc").read_text()
    assert "${CMAKE_CURRENT_LIST_DIR}" in (folder / "tiny_cnnConfig.cmake").read_text()


def test_two_links_give_the_same_bytes(both):
    """The link step run twice (in two temporary folders): the same archive, library and files."""
    dag = StepGraph(Cache(TEST_CACHE), tool_versions())
    last = plan_variant(dag, VariantSpec("tiny_cnn", str(EXAMPLE_MODEL), {"input": [1, 3, 32, 32]},
                                         symbol_prefix="tiny_cnn_", link="both"))
    link = dag.step(last)
    bundle = dag.get(link.deps[0])
    first, second = link.run(dag, bundle), link.run(dag, bundle)
    assert sorted(first) == sorted(["libtiny_cnn.so", "libtiny_cnn.a", *CONSUMER_FILES, "manifest.json"])
    assert first == second
    assert first["libtiny_cnn.a"] == (both["tiny_cnn"] / "libtiny_cnn.a").read_bytes()
    other = (both["tiny_cnn_b"] / "tiny_cnn_b.pc").read_text()
    assert "Name: tiny_cnn_b\n" in other and "-ltiny_cnn_b\n" in other


def test_inspect_still_reads_the_shared_library(both, capsys):
    assert main(["inspect", str(both["tiny_cnn"] / "libtiny_cnn.so")]) == 0
    assert "tiny_cnn (ABI 1, symbol prefix tiny_cnn_)" in capsys.readouterr().out
    with pytest.raises(CuvilError, match="static archive cannot be loaded"):
        cuvil.load(both["tiny_cnn"] / "libtiny_cnn.a")


def test_cmake_find_package_builds_and_runs_the_moved_library(both, expected, tmp_path):
    app = cmake_app(both["tiny_cnn"], tmp_path)
    np.testing.assert_allclose(printed(run(app, cwd=tmp_path)), expected, rtol=1e-4, atol=1e-4)
    needed = run("readelf", "-d", app, cwd=tmp_path)
    assert "[libtiny_cnn.so]" in needed   # not the path it was found at


def test_makefile_with_pkg_config_builds_and_runs_the_moved_library(both, expected, tmp_path):
    app = make_app(both["tiny_cnn"], tmp_path)
    np.testing.assert_allclose(printed(run(app, cwd=tmp_path)), expected, rtol=1e-4, atol=1e-4)


def test_static_archive_exports_the_abi_and_links_with_plain_gpp(both, expected, tmp_path):
    folder = both["tiny_cnn"]
    defined = run("nm", "-g", "--defined-only", folder / "libtiny_cnn.a", cwd=tmp_path)
    exported = sorted(line.split()[-1] for line in defined.splitlines() if re.match(r"[0-9a-f]+ ", line))
    assert exported == sorted(f"tiny_cnn_{f}" for f in ABI_FUNCTIONS)
    run("g++", "-O2", "-I", folder, EXAMPLE_CPP / "main.cpp", folder / "libtiny_cnn.a", "-lm", "-lpthread",
        "-o", "app", cwd=tmp_path)
    assert "libtiny_cnn" not in run("readelf", "-d", tmp_path / "app", cwd=tmp_path)
    np.testing.assert_allclose(printed(run(tmp_path / "app", cwd=tmp_path)), expected, rtol=1e-4, atol=1e-4)


def test_two_static_archives_with_the_same_kernels_link_into_one_program(both, tmp_path):
    a, b = both["tiny_cnn"], both["tiny_cnn_b"]
    (tmp_path / "two.c").write_text(textwrap.dedent("""\
        #include <stdio.h>
        #include <string.h>
        #include "tiny_cnn.h"
        #include "tiny_cnn_b.h"

        static float input[1 * 3 * 32 * 32], out_a[10], out_b[10];

        int main(void) {
            const void* inputs[] = {input};
            void* outputs_a[] = {out_a};
            void* outputs_b[] = {out_b};
            tiny_cnn_session* s = tiny_cnn_session_create();
            other_session* t = other_session_create();
            if (!s || !t || tiny_cnn_session_run(s, inputs, outputs_a) || other_session_run(t, inputs, outputs_b)) return 1;
            tiny_cnn_session_destroy(s);
            other_session_destroy(t);
            puts(memcmp(out_a, out_b, sizeof out_a) == 0 ? "ok" : "different");
            return 0;
        }
        """))
    run("gcc", "-O2", "-Wall", "-I", a, "-I", b, "two.c", a / "libtiny_cnn.a", b / "libtiny_cnn_b.a", "-lm",
        "-lpthread", "-o", "two", cwd=tmp_path)
    assert run(tmp_path / "two", cwd=tmp_path).strip() == "ok"


def test_static_only_build_through_cmake_and_pkg_config(static_only, expected, tmp_path):
    assert sorted(p.name for p in static_only.iterdir()) == sorted(
        {"libtiny_cnn.a", *CONSUMER_FILES, "manifest.json"})
    assert "STATIC IMPORTED" in (static_only / "tiny_cnnConfig.cmake").read_text()
    assert "Libs: -L${libdir} -ltiny_cnn -lm -lpthread\n" in (static_only / "tiny_cnn.pc").read_text()
    for app in (cmake_app(static_only, tmp_path), make_app(static_only, tmp_path)):
        assert "libtiny_cnn" not in run("readelf", "-d", app, cwd=tmp_path)
        np.testing.assert_allclose(printed(run(app, cwd=tmp_path)), expected, rtol=1e-4, atol=1e-4)


def test_switching_to_static_removes_the_shared_library(tmp_path):
    out = build_example(tmp_path, "shared")["tiny_cnn"].library.parent
    (out / "notes.txt").write_text("a file cuvil did not write stays")
    assert (out / "libtiny_cnn.so").is_file() and not (out / "libtiny_cnn.a").exists()
    build_example(tmp_path, "static")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        {"libtiny_cnn.a", *CONSUMER_FILES, "manifest.json", "notes.txt"})


def test_link_mode_is_in_the_link_step_key(tmp_path):
    keys = {}
    for link in ("shared", "static", "both"):
        dag = StepGraph(Cache(tmp_path / "cache"), tool_versions())
        last = plan_variant(dag, VariantSpec("tiny_cnn", str(EXAMPLE_MODEL), {"input": [1, 3, 32, 32]}, link=link))
        assert dag.step(last).params["link"] == link
        keys[link] = dag.key(last)
    assert len(set(keys.values())) == 3
    with pytest.raises(CuvilError, match="unknown link 'dynamic'"):
        plan_variant(dag, VariantSpec("tiny_cnn", str(EXAMPLE_MODEL), link="dynamic"))


def test_static_bf16_build_measures_its_accuracy_on_a_shared_link(tmp_path):
    config = write_example_project(tmp_path)
    text = config.read_text().replace("\n  link: shared\n", "\n  link: static\n")
    config.write_text(text.replace("    precision: fp32\n", "    precision: bf16\n"))
    (built,) = build_project(load_config(config), progress=None).artifacts
    assert built.library.name == "libtiny_cnn.a" and not (built.library.parent / "libtiny_cnn.so").exists()
    assert built.info["accuracy"]["outputs"]["probs"]["cosine"] > 0.99
