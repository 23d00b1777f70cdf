"""The `cuvil` command line, end to end on a temporary copy of the example project.

`build` compiles cuvil.yaml.example's model, `inspect` reads what was built,
`run` executes it on .npy inputs and must agree with onnxruntime, `check`
reports an op cuvil cannot compile, and a mistake in cuvil.yaml comes out as
one located message with exit code 2 and no traceback.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from cuvil import __version__
from cuvil.cli import main

from tests.helpers import make_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIG = ROOT / "cuvil.yaml.example"
EXAMPLE_MODEL = ROOT / "examples" / "models" / "tiny_cnn.onnx"
TEST_CACHE = Path(os.environ["CUVIL_CACHE_DIR"])  # set by conftest: kernels shared by every test


def write_example_project(folder: Path, extra_models: str = "") -> Path:
    """cuvil.yaml.example and its model copied into `folder`, with the shared test cache; returns the config."""
    (folder / "examples" / "models").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(EXAMPLE_MODEL, folder / "examples" / "models" / EXAMPLE_MODEL.name)
    text = EXAMPLE_CONFIG.read_text().replace("dir: .cuvil-cache", f"dir: {TEST_CACHE}")
    assert str(TEST_CACHE) in text, "cuvil.yaml.example no longer sets cache.dir: update this test"
    if extra_models:
        text = text.replace("\n# `cuvil watch`", extra_models + "\n# `cuvil watch`")
    config = folder / "cuvil.yaml"
    config.write_text(text)
    return config


OUT_SHAPE = [1, 10]  # probs


def cuvil_subprocess(*args, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "cuvil", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def run_ort(model_path: Path, feeds: dict) -> dict:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The example project, built once with `cuvil build`; returns (folder, library, build stdout)."""
    folder = tmp_path_factory.mktemp("project")
    config = write_example_project(folder)
    result = cuvil_subprocess("build", "-f", config, "-j", "2", cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    return folder, folder / "build" / "cuvil" / "tiny_cnn" / "native" / "libtiny_cnn.so", result.stdout


def test_build_writes_the_variant_and_a_summary(built):
    folder, library, stdout = built
    variant = library.parent
    assert sorted(p.name for p in variant.iterdir()) == ["libtiny_cnn.so", "manifest.json", "tiny_cnn.h",
                                                         "tiny_cnn.pc", "tiny_cnnConfig.cmake",
                                                         "tiny_cnnConfigVersion.cmake"]
    assert "[tiny_cnn/native] built: build/cuvil/tiny_cnn/native" in stdout
    assert "tiny_cnn/native: build/cuvil/tiny_cnn/native/libtiny_cnn.so" in stdout
    assert "kernels, arena" in stdout and "1 variant: ran " in stdout
    manifest = json.loads((variant / "manifest.json").read_text())
    assert manifest["symbol_prefix"] == "tiny_cnn_"
    assert manifest["inputs"] == [{"name": "input", "dtype": "float32", "shape": [1, 3, 32, 32]}]
    assert "tiny_cnn_session_run" in (variant / "tiny_cnn.h").read_text()


def test_build_again_hits_the_cache(built, capsys, monkeypatch):
    folder, library, _ = built
    monkeypatch.chdir(folder)
    assert main(["build"]) == 0  # -f defaults to ./cuvil.yaml
    out = capsys.readouterr().out
    assert "1 variant: ran 0, cached" in out and "up to date" in out, out


def test_inspect_prints_the_model_info(built, capsys):
    _, library, _ = built
    assert main(["inspect", str(library)]) == 0
    out = capsys.readouterr().out
    for words in ("tiny_cnn", "symbol prefix tiny_cnn_", "native", "fp32", "input", "float32 [1, 3, 32, 32]",
                  "probs", str(OUT_SHAPE), "arena", "sha256", "numba"):
        assert words in out, f"{words!r} missing from:\n{out}"

    assert main(["inspect", "--json", str(library)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["outputs"] == [{"name": "probs", "dtype": "float32", "shape": OUT_SHAPE}]
    assert info["precision"] == "fp32" and info["target"] == "native"
    assert set(info["memory"]) >= {"arena_bytes", "weights_bytes"}


def test_bench_times_every_engine_and_compares_with_onnxruntime(built, capsys):
    """`cuvil bench` on a library: each engine in its own processes; the ratio compares each
    engine's best process median (no figure is asserted: these machines are shared)."""
    folder, library, _ = built
    model = folder / "examples" / "models" / "tiny_cnn.onnx"
    assert main(["bench", str(library), "--vs", "onnxruntime", "--onnx", str(model), "--runs", "3", "--rounds", "2",
                 "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert set(results) == {"cuvil (C)", "cuvil (Python)", "onnxruntime"}
    for r in results.values():
        assert r["runs"] == 6
        assert 0 < r["min_ms"] <= r["process_median_ms"] <= r["p90_ms"] and r["min_ms"] <= r["median_ms"] <= r["p90_ms"]
    for key in ("cuvil (C)", "cuvil (Python)"):
        want = results[key]["process_median_ms"] / results["onnxruntime"]["process_median_ms"]
        assert results[key]["ratio"] == pytest.approx(want)

    assert main(["bench", str(library), "--vs", "onnxruntime"]) == 2
    assert "--onnx FILE.onnx" in capsys.readouterr().err
    assert main(["bench", str(model)]) == 2  # its batch dim is symbolic
    err = capsys.readouterr().err
    assert "symbolic dims" in err and "--shape input=D1,D2" in err


def test_bench_vs_openvino(built, capsys, monkeypatch):
    """`--vs openvino` times OpenVINO's CPU plugin as a third engine (the test extra installs it)
    and gives each cuvil figure its ratio against it; without OpenVINO the flag is a clear error."""
    folder, library, _ = built
    model = folder / "examples" / "models" / "tiny_cnn.onnx"
    assert main(["bench", str(library), "--vs", "onnxruntime", "--vs", "openvino", "--onnx", str(model),
                 "--runs", "3", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert set(results) == {"cuvil (C)", "cuvil (Python)", "onnxruntime", "openvino"}
    for key in ("cuvil (C)", "cuvil (Python)"):
        for engine, ratio in (("onnxruntime", "ratio"), ("openvino", "ratio_openvino")):
            want = results[key]["process_median_ms"] / results[engine]["process_median_ms"]
            assert results[key][ratio] == pytest.approx(want)

    assert main(["bench", str(library), "--vs", "openvino", "--onnx", str(model), "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "vs openvino" in out and "vs onnxruntime" not in out
    assert out.splitlines()[-1].split()[0] == "openvino"

    from cuvil import bench
    monkeypatch.setattr(bench, "openvino_version", lambda: None)
    assert main(["bench", str(library), "--vs", "openvino", "--onnx", str(model)]) == 2
    err = capsys.readouterr().err
    assert "OpenVINO is not installed" in err and "pip install openvino" in err


def test_openvino_worker_computes_in_float32(built, tmp_path):
    """OpenVINO's CPU plugin infers in bfloat16 by default on CPUs with AVX512_BF16 (this machine):
    the bench's worker asks for float32, so its output matches onnxruntime's on the same inputs
    to float32 rounding (bfloat16 would differ by ~1e-2)."""
    from cuvil import bench
    folder, _, _ = built
    model = folder / "examples" / "models" / "tiny_cnn.onnx"
    saved = tmp_path / "openvino.npy"
    times = bench.openvino_times(model, {"input": [1, 3, 32, 32]}, threads=1, runs=2, save_output=saved)
    assert len(times) == 2 and all(t > 0 for t in times)
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)  # the worker's inputs
    np.testing.assert_allclose(np.load(saved), run_ort(model, {"input": x})["probs"], rtol=1e-5, atol=1e-6)


def test_run_matches_onnxruntime(built, tmp_path, capsys):
    folder, library, _ = built
    x = np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out_dir = tmp_path / "out"
    assert main(["run", str(library), "--input", f"input={tmp_path / 'x.npy'}", "--output-dir", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert f"probs: shape {OUT_SHAPE} float32" in printed
    got = np.load(out_dir / "probs.npy")
    want = run_ort(folder / "examples" / "models" / "tiny_cnn.onnx", {"input": x})["probs"]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_run_names_a_missing_input_and_a_wrong_shape(built, tmp_path, capsys):
    _, library, _ = built
    assert main(["run", str(library)]) == 2
    assert "no file given for input(s) ['input']" in capsys.readouterr().err
    np.save(tmp_path / "small.npy", np.zeros((1, 3, 8, 8), np.float32))
    assert main(["run", str(library), "-i", str(tmp_path / "small.npy")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cuvil: error: input 'input': shape [1, 3, 8, 8]") and "Traceback" not in err


def test_run_output_file_names_are_sanitised():
    from cuvil.cli import _file_names
    assert _file_names(["probs", "a/b:c", "../x", "a_b_c", "a/b:c"]) == ["probs", "a_b_c", "_x", "a_b_c_2", "a_b_c_3"]


def test_check_lists_ops_and_passes_a_supported_model(built, capsys):
    folder, _, _ = built
    assert main(["check", "-f", str(folder / "cuvil.yaml")]) == 0
    out = capsys.readouterr().out
    assert "input   input: float32 [1, 3, 32, 32]" in out
    assert "all ops, targets and precisions supported" in out and "unsupported" not in out


def _unsupported_op() -> str:
    from backends.numba_cpu.registry import GENERATORS
    # GlobalLpPool has no kernel and no function body (Bernoulli, the op here before, now compiles);
    # if it ever lands, pick another (the models below pool their input: [N, 4, 4] -> [N, 4, 1]).
    assert "GlobalLpPool" not in GENERATORS
    return "GlobalLpPool"


def test_check_reports_an_unsupported_op(tmp_path, capsys):
    op = _unsupported_op()
    model = make_model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                        helper.make_node(op, ["r"], ["y"], name="odd")],
                       [("x", np.float32, ["N", 4, 4])], [("y", np.float32, ["N", 4, 1])])
    (tmp_path / "odd.onnx").write_bytes(model.SerializeToString())
    (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels:\n  - name: odd\n    source: odd.onnx\n"
                                         "    inputs: {x: [2, 4, 4]}\n")
    assert main(["check", "-f", str(tmp_path / "cuvil.yaml")]) == 1
    out = capsys.readouterr().out
    assert f"ops     2 nodes: {op} 1, Relu 1" in out
    assert f"unsupported: node 'odd' ({op}):" in out
    assert "node 'relu'" not in out

    from cuvil.config import load_config
    from cuvil.project import check_project
    problems = check_project(load_config(tmp_path / "cuvil.yaml"))
    assert len(problems) == 1 and problems[0].endswith(f"cuvil.yaml:3: model 'odd': node 'odd' ({op}): "
                                                       f"no kernel generator for op {op}")


@pytest.mark.parametrize("changes, refused", [
    ({"targets": "[native, cuda-sm90]", "precision": "int4"},
     "target 'cuda-sm90', precision 'int4': precision 'int4' is not supported yet for CUDA targets"),
    ({"targets": "[native, cuda-sm90]", "precision": "int8"},
     "target 'cuda-sm90', precision 'int8': precision 'int8' is not supported yet for CUDA targets"),
])
def test_check_refuses_what_build_refuses(tmp_path, capsys, changes, refused):
    """cuvil.yaml accepts every target and precision the project plans; what `cuvil build` cannot
    build yet, `cuvil check` reports (exit 1), with the build's own reason."""
    config = write_example_project(tmp_path)
    for key, value in changes.items():
        config.write_text(config.read_text().replace(f"    {key}: " + ("[native]" if key == "targets" else "fp32"),
                                                     f"    {key}: {value}", 1))
    assert main(["check", "-f", str(config)]) == 1
    out = capsys.readouterr().out
    assert f"unsupported: {refused}" in out
    assert main(["build", "-f", str(config)]) == 2
    err = capsys.readouterr().err
    assert refused.split(": ", 1)[1] in err and "Traceback" not in err


def test_a_config_error_is_located_and_has_no_traceback(tmp_path):
    config = write_example_project(tmp_path)
    config.write_text(config.read_text().replace("  opt_level: 2", "  opt_levle: 2"))
    result = cuvil_subprocess("build", "-f", "cuvil.yaml", cwd=tmp_path)
    assert result.returncode == 2
    line = next(i for i, text in enumerate(config.read_text().splitlines(), 1) if "opt_levle" in text)
    assert result.stderr.startswith(f"cuvil: error: cuvil.yaml:{line}:"), result.stderr
    assert "opt_levle" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "build").exists()

    debug = cuvil_subprocess("--debug", "check", "-f", "cuvil.yaml", cwd=tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_a_model_error_names_the_entry_in_the_config(tmp_path, capsys):
    config = write_example_project(tmp_path)
    config.write_text(config.read_text().replace("input: [1, 3, 32, 32]", "input: [1, 3, 32]"))
    assert main(["build", "-f", str(config)]) == 2
    err = capsys.readouterr().err
    line = next(i for i, text in enumerate(config.read_text().splitlines(), 1) if "name: tiny_cnn" in text)
    assert f"cuvil.yaml:{line}: model 'tiny_cnn': input 'input'" in err and "rank" in err


def test_unknown_model_is_named_with_the_known_ones(tmp_path, capsys):
    config = write_example_project(tmp_path)
    assert main(["build", "-f", str(config), "resnet"]) == 2
    assert "no model named 'resnet' (known: tiny_cnn)" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit is deprecated upstream, still supported
def test_check_exports_a_torchscript_source(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    torch.jit.trace(model, torch.zeros(2, 8)).save(str(tmp_path / "net.pt"))
    (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels:\n  - name: net\n    source: net.pt\n"
                                         "    inputs: {x: [2, 8]}\n")
    assert main(["check", "-f", str(tmp_path / "cuvil.yaml")]) == 0
    out = capsys.readouterr().out
    assert "input   x: float32 [2, 8]" in out and "Relu 1" in out and "all ops, targets and precisions supported" in out

    (tmp_path / "broken.pt").write_bytes(b"not a TorchScript archive")
    (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels:\n  - name: broken\n    source: broken.pt\n"
                                         "    inputs: {x: [2, 8]}\n")
    assert main(["check", "-f", str(tmp_path / "cuvil.yaml")]) == 2
    err = capsys.readouterr().err
    assert "cuvil.yaml:3: model 'broken': " in err and "cannot be loaded as TorchScript" in err


def test_version_and_usage(tmp_path):
    result = cuvil_subprocess("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"cuvil {__version__}"
    result = cuvil_subprocess("frobnicate", cwd=tmp_path)
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = cuvil_subprocess("inspect", tmp_path / "nothing.so", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("cuvil: error: library not found")
