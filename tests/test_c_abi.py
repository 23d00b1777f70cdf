"""The C ABI as a C program sees it.

A library built from cuvil.yaml.example is driven by examples/run_model.c and
must give the bytes the Python runtime gets; it must need nothing beyond libc,
libm and the loader, export exactly the six `<prefix>` ABI functions, let two
models live in one process when their prefixes differ, and answer NULL
arguments with an error code rather than a crash.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cuvil
from cuvil.config import load_config
from cuvil.project import build_project

from tests.test_cli import EXAMPLE_MODEL, OUT_SHAPE, run_ort, write_example_project

ROOT = Path(__file__).resolve().parents[1]
ABI_FUNCTIONS = ("abi_version", "model_info", "session_create", "session_run", "session_error", "session_output_shape",
                 "session_destroy")
ALLOWED_NEEDED = re.compile(r"(linux-vdso\.so\.\d+|libc\.so\.6|libm\.so\.6|(/\S+/)?ld-linux[-\w.]*\.so\.\d+)")

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# A second model entry: the same network under another name and symbol prefix,
# so both libraries hold kernels with the same (hidden) symbol names.
SECOND_MODEL = """
  - name: tiny_cnn_b
    source: examples/models/tiny_cnn.onnx
    inputs:
      input: [1, 3, 32, 32]
    symbol_prefix: other_
"""


def gcc(*args, cwd):
    result = subprocess.run(["gcc", *map(str, args)], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    return result


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """Both models of the example project built; returns (folder, {name: Artifacts})."""
    folder = tmp_path_factory.mktemp("c_abi")
    config = write_example_project(folder, extra_models=SECOND_MODEL)
    artifacts = build_project(load_config(config), progress=None).artifacts
    return folder, {a.info["name"]: a for a in artifacts}


@pytest.fixture(scope="module")
def run_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run_model")
    gcc("-O2", "-Wall", "-Wextra", "-o", folder / "run_model", ROOT / "examples" / "run_model.c", "-ldl", cwd=folder)
    return folder / "run_model"


def test_run_model_c_gives_the_python_runtimes_bytes(project, run_model, tmp_path):
    folder, built = project
    library = built["tiny_cnn"].library
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)
    x.tofile(tmp_path / "input.bin")
    (tmp_path / "out").mkdir()
    result = subprocess.run([run_model, "-o", tmp_path / "out", library, "tiny_cnn_", tmp_path / "input.bin"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    info = json.loads(result.stdout.splitlines()[0])
    assert info["name"] == "tiny_cnn" and info["symbol_prefix"] == "tiny_cnn_"
    assert "input 0: input float32 [1, 3, 32, 32] (12288 bytes)" in result.stdout

    from_c = np.fromfile(tmp_path / "out" / "out0.bin", np.float32).reshape(OUT_SHAPE)
    from_python = cuvil.load(library).run({"input": x})["probs"]
    np.testing.assert_array_equal(from_c, from_python)
    want = run_ort(folder / "examples" / "models" / EXAMPLE_MODEL.name, {"input": x})["probs"]
    np.testing.assert_allclose(from_c, want, rtol=1e-4, atol=1e-4)


def test_run_model_c_reports_bad_arguments(project, run_model, tmp_path):
    library = project[1]["tiny_cnn"].library
    (tmp_path / "short.bin").write_bytes(b"\0" * 100)
    cases = {
        "wrong prefix": ([library, "nope_", tmp_path / "short.bin"], "symbol nope_abi_version not found"),
        "short input": ([library, "tiny_cnn_", tmp_path / "short.bin"], "expected exactly 12288 bytes"),
        "no input": ([library, "tiny_cnn_"], "takes 1 input(s), 0 file(s) given"),
        "no library": ([tmp_path / "missing.so"], "cannot load"),
    }
    for case, (args, message) in cases.items():
        result = subprocess.run([run_model, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and message in result.stderr, f"{case}: {result.stderr}"


def test_library_needs_only_libc_libm_and_the_loader(project):
    for artifacts in project[1].values():
        result = subprocess.run(["ldd", artifacts.library], capture_output=True, text=True, check=True)
        needed = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
        assert needed and all(ALLOWED_NEEDED.fullmatch(n) for n in needed), result.stdout


def test_library_exports_only_the_abi(project):
    for artifacts in project[1].values():
        prefix = artifacts.info["symbol_prefix"]
        result = subprocess.run(["nm", "-D", "--defined-only", artifacts.library],
                                capture_output=True, text=True, check=True)
        exported = sorted(line.split()[-1] for line in result.stdout.splitlines() if line.strip())
        assert exported == sorted(prefix + f for f in ABI_FUNCTIONS)
        undefined = subprocess.run(["nm", "-D", "--undefined-only", artifacts.library],
                                   capture_output=True, text=True, check=True).stdout
        assert not re.search(r"\bPy|numba|NRT_", undefined), undefined


def test_two_models_with_different_prefixes_in_one_process(project, tmp_path):
    _, built = project
    first, second = built["tiny_cnn"], built["tiny_cnn_b"]
    source = textwrap.dedent("""\
        #include <stdio.h>
        #include <string.h>
        #include "tiny_cnn.h"
        #include "tiny_cnn_b.h"

        static float input[1 * 3 * 32 * 32];
        static float out_a[OUT_SIZE], out_b[OUT_SIZE];

        int main(void) {
            for (int i = 0; i < (int)(sizeof input / sizeof input[0]); i++) input[i] = (float)((i % 17) - 8) / 8.0f;
            if (tiny_cnn_abi_version() != TINY_CNN_ABI_VERSION || other_abi_version() != OTHER_ABI_VERSION) return 10;
            if (strstr(tiny_cnn_model_info(), "\\"tiny_cnn\\"") == NULL) return 11;
            if (strstr(other_model_info(), "\\"tiny_cnn_b\\"") == NULL) return 12;
            tiny_cnn_session* a = tiny_cnn_session_create();
            other_session* b = other_session_create();
            if (!a || !b) return 13;
            const void* inputs[] = {input};
            void* outputs_a[] = {out_a};
            void* outputs_b[] = {out_b};
            if (tiny_cnn_session_run(a, inputs, outputs_a) != 0) { puts(tiny_cnn_session_error(a)); return 14; }
            if (other_session_run(b, inputs, outputs_b) != 0) { puts(other_session_error(b)); return 15; }
            tiny_cnn_session_destroy(a);
            other_session_destroy(b);
            /* The same network in both: the same bytes out. */
            if (memcmp(out_a, out_b, sizeof out_a) != 0) return 16;
            puts("ok");
            return 0;
        }
        """)
    (tmp_path / "both.c").write_text(source)
    out_size = int(np.prod(OUT_SHAPE))
    gcc("-O2", "-Wall", "-Wextra", f"-DOUT_SIZE={out_size}", "-I", first.library.parent, "-I", second.library.parent,
        "-o", "both", "both.c", first.library, second.library,
        f"-Wl,-rpath,{first.library.parent}:{second.library.parent}", cwd=tmp_path)
    result = subprocess.run([tmp_path / "both"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stdout)


def test_null_arguments_return_an_error_code(project, tmp_path):
    artifacts = project[1]["tiny_cnn"]
    source = textwrap.dedent("""\
        #include <stdio.h>
        #include <string.h>
        #include "tiny_cnn.h"

        static float input[1 * 3 * 32 * 32], output[OUT_SIZE];

        #define EXPECT(cond) do { if (!(cond)) { printf("failed: %s (line %d)\\n", #cond, __LINE__); return 1; } } while (0)

        int main(void) {
            const void* inputs[] = {input};
            const void* null_inputs[] = {NULL};
            void* outputs[] = {output};
            void* null_outputs[] = {NULL};
            tiny_cnn_session* s = tiny_cnn_session_create();
            EXPECT(s != NULL);
            EXPECT(tiny_cnn_session_run(NULL, inputs, outputs) == TINY_CNN_ERR_NULL_SESSION);
            EXPECT(tiny_cnn_session_error(NULL) != NULL && strlen(tiny_cnn_session_error(NULL)) > 0);
            EXPECT(tiny_cnn_session_run(s, NULL, outputs) == TINY_CNN_ERR_NULL_ARGUMENT);
            EXPECT(strlen(tiny_cnn_session_error(s)) > 0);
            EXPECT(tiny_cnn_session_run(s, inputs, NULL) == TINY_CNN_ERR_NULL_ARGUMENT);
            EXPECT(tiny_cnn_session_run(s, null_inputs, outputs) == TINY_CNN_ERR_NULL_ARGUMENT);
            EXPECT(strstr(tiny_cnn_session_error(s), "input 0") != NULL);
            EXPECT(tiny_cnn_session_run(s, inputs, null_outputs) == TINY_CNN_ERR_NULL_ARGUMENT);
            EXPECT(strstr(tiny_cnn_session_error(s), "output 0") != NULL);
            /* The session still works after failed calls, and a success clears the message. */
            EXPECT(tiny_cnn_session_run(s, inputs, outputs) == TINY_CNN_OK);
            EXPECT(strcmp(tiny_cnn_session_error(s), "") == 0);
            tiny_cnn_session_destroy(s);
            tiny_cnn_session_destroy(NULL);
            puts("ok");
            return 0;
        }
        """)
    (tmp_path / "nulls.c").write_text(source)
    gcc("-O2", "-Wall", "-Wextra", f"-DOUT_SIZE={int(np.prod(OUT_SHAPE))}", "-I", artifacts.library.parent,
        "-o", "nulls", "nulls.c", artifacts.library, f"-Wl,-rpath,{artifacts.library.parent}", cwd=tmp_path)
    result = subprocess.run([tmp_path / "nulls"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stdout)
