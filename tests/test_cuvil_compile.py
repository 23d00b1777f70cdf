"""`cuvil-compile`: the one-shot command line for one model (cuvil/cli.py, compile_main).

It must make a one-model config of its flags and go through `cuvil build`'s cached
build graph: every file it writes has the bytes `cuvil build` writes for a cuvil.yaml
of the same settings, the library under --output's name too, and what it builds agrees
with onnxruntime. Each mistake on the command line is a usage error: exit code 2, one
message, no traceback.
"""
from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path

import numpy as np
import onnx
import pytest

import cuvil
from cuvil.cli import _compile_parser, compile_config, compile_main, main
from tests.helpers import make_model, run_ort

ROOT = Path(__file__).resolve().parents[1]
TEST_CACHE = Path(os.environ["CUVIL_CACHE_DIR"])  # set by conftest: kernels shared by every test


def _mlp(path: Path) -> Path:
    """x[batch, 16] -> MatMul(16x24) -> Add -> Relu -> MatMul(24x8): a batch dim left open for --input-shape."""
    rng = np.random.default_rng(21)
    weights = {"w1": rng.standard_normal((16, 24)).astype(np.float32) * 0.3,
               "b1": rng.standard_normal(24).astype(np.float32) * 0.1,
               "w2": rng.standard_normal((24, 8)).astype(np.float32) * 0.3}
    nodes = [onnx.helper.make_node("MatMul", ["x", "w1"], ["h"]), onnx.helper.make_node("Add", ["h", "b1"], ["a"]),
             onnx.helper.make_node("Relu", ["a"], ["r"]), onnx.helper.make_node("MatMul", ["r", "w2"], ["y"])]
    model = make_model(nodes, [("x", np.float32, ["batch", 16])], [("y", np.float32, ["batch", 8])], weights)
    onnx.save(model, path)
    return path


def _config(folder: Path, model: Path, **settings) -> Path:
    lines = [f"    {key}: {value}" for key, value in settings.items()]
    config = folder / "cuvil.yaml"
    config.write_text("version: 1\noutput_dir: build\n"
                      f"cache:\n  dir: {TEST_CACHE}\n"
                      f"models:\n  - name: mlp\n    source: {model}\n" + "\n".join(lines) + "\n")
    return config


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_same_bytes_as_cuvil_build_and_agrees_with_onnxruntime(tmp_path, capsys, monkeypatch):
    model = _mlp(tmp_path / "mlp.onnx")
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, model, targets="[native]", opt_level=3, threads=2, inputs="{x: [4, 16]}")
    assert main(["build", "-f", str(config)]) == 0
    built = capsys.readouterr().out
    assert compile_main(["--model", str(model), "--target", "native", "--opt-level", "3", "--threads", "2",
                         "--output", "out/mlp.so", "--input-shape", "x=4,16", "--cache-dir", str(TEST_CACHE)]) == 0
    compiled = capsys.readouterr().out

    by_build = _files(tmp_path / "build" / "mlp" / "native")
    by_compile = _files(tmp_path / "out")
    assert {"libmlp.so", "mlp.h", "mlp.pc", "manifest.json"} <= set(by_build)
    # the folder holds what `cuvil build` writes, byte for byte, and the library under --output's name
    assert by_compile.pop("mlp.so") == by_build["libmlp.so"]
    assert by_compile == by_build
    # the same report: the variant line, its figures, the step summary
    assert "mlp/native: out/mlp.so" in compiled and "1 variant:" in compiled
    figures = [line.rsplit(", ", 1)[0] for line in built.splitlines() if "kernels, arena" in line]
    assert len(figures) == 1 and figures[0] in compiled   # "N kernels, arena ..., weights ..." (not the seconds)

    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    got = cuvil.load(tmp_path / "out" / "mlp.so").run({"x": x})["y"]
    want = run_ort(onnx.load(model), {"x": x})["y"]
    # float32 sums of 16 and 24 products of O(1) values, in another order (fused, threaded): a few ulps
    # of the largest partial sum; 1e-5 relative + 1e-5 absolute is ~100 ulps of it.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_rebuild_changes_nothing_and_a_lib_name_is_kept(tmp_path, capsys):
    model = _mlp(tmp_path / "mlp.onnx")
    args = ["--model", str(model), "--output", str(tmp_path / "libmlp.so"), "--input-shape", "x=2,16",
            "--cache-dir", str(TEST_CACHE), "--opt-level", "0"]
    assert compile_main(args) == 0
    first = _files(tmp_path)
    assert compile_main(args) == 0
    out = capsys.readouterr().out
    assert "(unchanged)" in out and "ran 0" in out
    assert _files(tmp_path) == first
    assert "libmlp.so" in first and "mlp.so" not in first   # lib<name>.so is the name asked for: one file
    # --opt-level 0: no passes at all (cuvil.yaml's opt_level 0)
    info = cuvil.load(tmp_path / "libmlp.so").info
    assert info["passes"] == [] and info["name"] == "mlp"


def _args(*extra) -> argparse.Namespace:
    return _compile_parser().parse_args(["--model", "m.onnx", "--output", "out/m.so", *extra])


def test_flags_become_a_one_model_config(tmp_path):
    model = _mlp(tmp_path / "m.onnx")
    args = _args("--target", "cuda-a10", "--precision", "int4", "--opt-level", "1", "--threads", "3",
                 "--input-shape", "x=1,16", "--prefix", "m_")
    args.model, args.output, args.name, args.cache_dir = model, tmp_path / "out" / "llama3-8b-a10.so", None, None
    _compile_parser().get_default("validate")(_compile_parser(), args)
    assert args.name == "llama3_8b_a10"     # a file name that is no identifier gives the model name
    spec = compile_config(args)
    (m,) = spec.models
    assert m.targets == ["cuda-sm86"]       # the A10's compute capability 8.6
    assert (m.precision, m.opt_level, m.threads, m.symbol_prefix) == ("int4", 1, 3, "m_")
    assert m.inputs == {"x": (1, 16)} and spec.output_dir == tmp_path / "out"


@pytest.mark.parametrize("extra, message", [
    (["--target", "x86_64-avx9"], "argument --target: invalid choice: 'x86_64-avx9'"),
    (["--precision", "int3"], "argument --precision: invalid choice: 'int3'"),
    (["--opt-level", "4"], "argument --opt-level: invalid choice: 4"),
    (["--threads", "0"], "argument --threads: expected a positive integer, got 0"),
    (["--input-shape", "x=4,a"], "argument --input-shape: expected NAME=D1,D2,..."),
    (["--input-shape", "x=4,0"], "argument --input-shape: expected NAME=D1,D2,..."),
    (["--input-shape", "x=1,16", "--input-shape", "x=2,16"], "an input is given twice"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--output", "m.dylib"], "must end in .so"),
    (["--output", "m.dll"], "a .dll is built for --target x86_64-windows only"),
    (["--output", "9.so"], "no model name can be made from '9.so': give --name"),
    (["--name", "my-model"], "argument --name: 'my-model' is not an identifier"),
    (["--prefill-buckets", "16,0"], "argument --prefill-buckets: expected positive integers"),
    (["--prefill-buckets", "16"], "argument --prefill-buckets: needs --max-context"),
])
def test_mistakes_are_usage_errors(tmp_path, capsys, extra, message):
    model = _mlp(tmp_path / "m.onnx")
    code = compile_main(["--model", str(model), "--output", str(tmp_path / "m.so"), *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "usage: cuvil-compile" in err and "Traceback" not in err


def test_a_missing_model_and_a_model_cuvil_cannot_import(tmp_path, capsys):
    assert compile_main(["--model", str(tmp_path / "none.onnx"), "--output", str(tmp_path / "m.so")]) == 2
    assert "argument --model: file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert compile_main(["--model", str(bad), "--output", str(tmp_path / "m.so"),
                         "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cuvil-compile: error:") and "bad.onnx" in err and "Traceback" not in err


def test_the_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["cuvil-compile"] == "cuvil.cli:compile_main"
