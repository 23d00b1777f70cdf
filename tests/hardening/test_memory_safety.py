"""Generated code under AddressSanitizer + UBSan, and under valgrind memcheck; concurrent sessions."""
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import cuvil
from cuvil.build import VariantSpec, build_variant
from cuvil.cache import Cache, default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "models" / "tiny_cnn.onnx"
SHAPES = {"input": [1, 3, 32, 32]}


def _run_model_binary(tmp_path, *flags):
    exe = tmp_path / ("run_model" + ("_asan" if flags else ""))
    subprocess.run(["gcc", "-O1", "-g", *flags, "-o", str(exe), str(ROOT / "examples" / "run_model.c"), "-ldl"],
                   check=True)
    return exe


def _input(tmp_path):
    x = np.random.default_rng(7).standard_normal(SHAPES["input"]).astype(np.float32)
    path = tmp_path / "input.bin"
    x.tofile(path)
    return x, path


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_sanitized_build_runs_clean(tmp_path):
    art = build_variant(VariantSpec("tiny", str(MODEL), SHAPES, sanitize=True), tmp_path / "asan",
                        Cache(default_cache_dir()))
    assert art.info.get("sanitize") == ["address", "undefined"]
    exe = _run_model_binary(tmp_path, "-fsanitize=address,undefined", "-fno-omit-frame-pointer")
    x, path = _input(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    result = subprocess.run([str(exe), "-o", str(out), str(art.library), "cuvil_", str(path)],
                            capture_output=True, text=True, env={"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
                                                                 "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "AddressSanitizer" not in result.stderr and "runtime error" not in result.stderr
    got = np.fromfile(out / "out0.bin", np.float32)
    want = cuvil.compile(str(MODEL), input_shapes=SHAPES).run({"input": x})["probs"].ravel()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_valgrind_memcheck_reports_no_errors_and_no_leaks(tmp_path):
    # AVX2 code: valgrind does not decode AVX-512 instructions.
    art = build_variant(VariantSpec("tiny", str(MODEL), SHAPES, target="x86_64-avx2"), tmp_path / "vg",
                        Cache(default_cache_dir()))
    exe = _run_model_binary(tmp_path)
    _, path = _input(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    result = subprocess.run(["valgrind", "--error-exitcode=99", "--leak-check=full",
                             "--errors-for-leak-kinds=definite,indirect,possible", "--show-leak-kinds=definite",
                             str(exe), "-o", str(out), str(art.library), "cuvil_", str(path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in result.stderr


def test_concurrent_sessions_from_threads_match_serial():
    compiled = cuvil.compile(str(MODEL), input_shapes=SHAPES, threads=2)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(SHAPES["input"]).astype(np.float32) for _ in range(12)]
    serial = [compiled.run({"input": x})["probs"] for x in inputs]
    results = {}

    def worker(index):
        session = compiled.session()
        for round_ in range(5):
            for i, x in enumerate(inputs):
                if (i + index + round_) % 3 == 0:
                    results[(index, round_, i)] = session.run({"input": x})["probs"]
        session.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) >= 60
    for (_, _, i), got in results.items():
        np.testing.assert_array_equal(got, serial[i])
