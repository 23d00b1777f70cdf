"""`cuvil explain MODEL` and `cuvil build --explain` on the example project."""
import json
import shutil
from pathlib import Path

from cuvil.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _project(tmp_path):
    shutil.copytree(ROOT / "examples" / "models", tmp_path / "examples" / "models")
    config = tmp_path / "cuvil.yaml"
    config.write_text((ROOT / "cuvil.yaml.example").read_text())
    return config


def test_explain_prints_passes_kernels_and_arena(tmp_path, capsys):
    config = _project(tmp_path)
    assert main(["explain", "-f", str(config), "tiny_cnn"]) == 0
    out = capsys.readouterr().out
    assert "fuse_activation" in out and "2 Relu fused into Conv epilogues" in out
    assert "Conv + Relu" in out and "arena" in out
    assert main(["explain", "-f", str(config), "tiny_cnn", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # The Relus run in the convs' epilogues: no kernel of their own (the count of kernels need
    # not fall: a conv taken by Winograd runs as four steps instead of two).
    assert report["kernels_before"] > 0 and not any(k["op"] == "Relu" for k in report["kernels"])
    assert report["memory"]["arena_bytes"] > 0


def test_explain_an_unknown_model_is_a_located_error(tmp_path, capsys):
    config = _project(tmp_path)
    assert main(["explain", "-f", str(config), "nope"]) == 2
    assert "no model named 'nope'" in capsys.readouterr().err


def test_build_explain(tmp_path, capsys):
    config = _project(tmp_path)
    assert main(["build", "-f", str(config), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "model tiny_cnn" in out and "kernels" in out and "fuse_activation" in out
