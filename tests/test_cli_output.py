"""What the CLI prints for people and for programs: the progress display, `--json` reports, pictures.

The pictures (`cuvil graph --format html|svg`, `cuvil build --timeline`) are
opened in headless Chromium (Debian's `chromium`), which must run their script
to the end (`data-rendered="ok"`) without a JavaScript error in its console.
"""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cuvil.cli import main
from cuvil.progress import BuildDisplay, live_terminal

from tests.test_cli import write_example_project

LIBRARY = Path("build/cuvil/tiny_cnn/native/libtiny_cnn.so")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The example project built once with --json and --timeline; returns (folder, report, stderr)."""
    folder = tmp_path_factory.mktemp("output")
    config = write_example_project(folder)
    # a cache of its own: the steps really run, so the timeline has bars
    config.write_text(config.read_text().replace("  dir: ", f"  dir: {folder / 'cache'}  # ", 1))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        out, err = io.StringIO(), io.StringIO()
        mp.setattr("sys.stdout", out)
        mp.setattr("sys.stderr", err)
        assert main(["build", "-f", str(config), "--json", "--timeline", "timeline.html"]) == 0
    return folder, json.loads(out.getvalue()), err.getvalue()


def test_build_json_report(project):
    folder, report, _ = project
    assert set(report) == {"config", "cache", "scheduler", "seconds", "summary", "variants", "steps"}
    assert report["scheduler"] is None and report["summary"]["ran"] + report["summary"]["cached"] == len(report["steps"])
    (variant,) = report["variants"]
    assert variant["name"] == "tiny_cnn" and variant["target"] == "native" and variant["precision"] == "fp32"
    assert Path(variant["library"]) == folder / LIBRARY and Path(variant["library"]).is_file()
    assert variant["files"][-1].endswith("manifest.json") and variant["kernels"] > 0
    assert {"arena_bytes", "weights_bytes"} <= set(variant["memory"]) and isinstance(variant["changed"], bool)
    step = report["steps"][0]
    assert set(step) == {"name", "kind", "key", "status", "seconds", "started", "worker"}


def test_json_keeps_stdout_for_the_report_and_errors_are_json_too(tmp_path, capsys):
    config = write_example_project(tmp_path)
    config.write_text(config.read_text().replace("opt_level: 2", "opt_level: 9"))
    assert main(["build", "-f", str(config), "--json"]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]
    assert "opt_level" in error["message"] and "cuvil.yaml:" in error["message"]
    assert "cuvil: error:" in captured.err and "Traceback" not in captured.err


def test_plain_progress_when_not_a_terminal(tmp_path, capsys, monkeypatch):
    """capsys is not a TTY: every step that ran is one plain line, no escape codes."""
    config = write_example_project(tmp_path)
    config.write_text(config.read_text().replace("  dir: ", f"  dir: {tmp_path / 'own-cache'}  # ", 1))
    monkeypatch.delenv("CI", raising=False)
    assert main(["build", "-f", str(config)]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    lines = out.splitlines()
    assert lines[0].startswith("[1 ran, 1/") and "tiny_cnn/native/import" in lines[0]
    assert any(line.startswith("[tiny_cnn/native] built: ") for line in lines)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_live_display_is_for_terminals_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert live_terminal(_Terminal()) and not live_terminal(io.StringIO())
    monkeypatch.setenv("CI", "true")
    assert not live_terminal(_Terminal())

    from cuvil.dag import StepRecord
    monkeypatch.delenv("CI")
    screen = _Terminal()
    with BuildDisplay(screen) as display:
        assert display.live
        display.step(StepRecord("m/native/import", "import", "0" * 64, "ran", 0.5), 1, 1, 3)
        display.say("[m/native] built: out")
    assert "[m/native] built: out" in screen.getvalue() and "\x1b[" in screen.getvalue()

    plain = io.StringIO()
    with BuildDisplay(plain) as display:
        display.step(StepRecord("m/native/import", "import", "0" * 64, "ran", 0.5), 1, 1, 3)
    assert plain.getvalue() == "[1 ran, 1/3 done] m/native/import (0.50 s)\n"


def test_check_json(project, tmp_path, capsys):
    folder, _, _ = project
    assert main(["check", "-f", str(folder / "cuvil.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and report["supported"]
    (model,) = report["models"]
    assert model["name"] == "tiny_cnn" and model["unsupported"] == [] and model["ops"]["Conv"] == 2
    assert model["inputs"] == [{"name": "input", "dtype": "float32", "shape": [1, 3, 32, 32]}]
    assert set(model["variants"]["native"]) == {"kernels", "steps", "memory"}


def test_check_json_lists_what_cannot_be_compiled(tmp_path, capsys):
    import numpy as np
    from onnx import helper

    from tests.helpers import make_model
    from tests.test_cli import _unsupported_op
    op = _unsupported_op()
    model = make_model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                        helper.make_node(op, ["r"], ["y"], name="odd")],
                       [("x", np.float32, [2, 4, 4])], [("y", np.float32, [2, 4, 4])])
    (tmp_path / "odd.onnx").write_bytes(model.SerializeToString())
    (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels:\n  - name: odd\n    source: odd.onnx\n")
    assert main(["check", "-f", str(tmp_path / "cuvil.yaml"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and not report["supported"]
    (model,) = report["models"]
    assert model["ops"] == {op: 1, "Relu": 1} and len(model["unsupported"]) == 1 and "'odd'" in model["unsupported"][0]


def test_inspect_json(project, capsys):
    folder, _, _ = project
    assert main(["inspect", str(folder / LIBRARY), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "tiny_cnn" and info["inputs"][0]["shape"] == [1, 3, 32, 32]
    assert {"target", "precision", "memory", "spec_hash", "graph_sha256"} <= set(info)


def test_bench_json_and_plot(project, tmp_path, capsys):
    folder, _, _ = project
    plot = tmp_path / "bench.png"
    assert main(["bench", str(folder / LIBRARY), "--runs", "5", "--json", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert set(report) == {"library", "model", "threads", "precision", "results"}
    assert all({"median_ms", "min_ms", "p90_ms"} <= set(r) for r in report["results"].values())
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "plot: " in captured.err


# -- pictures in a browser -----------------------------------------------------------------------

def _chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return exe


def render(page: Path) -> str:
    """The page's DOM after its scripts ran in headless Chromium; fails on any JavaScript error."""
    done = subprocess.run([_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--user-data-dir=" + str(page.parent / ".chromium"), "--dump-dom",
                           page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]
    assert errors == [], errors
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_render_catches_a_script_error(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>notDefined();</script></body></html>")
    with pytest.raises(AssertionError, match="notDefined"):
        render(page)


def test_graph_html_renders(project, tmp_path, capsys):
    folder, _, _ = project
    page = tmp_path / "tiny_cnn.html"
    assert main(["graph", "-f", str(folder / "cuvil.yaml"), "tiny_cnn", "--format", "html", "-o", str(page)]) == 0
    dom = render(page)
    assert 'data-rendered="ok"' in dom
    assert dom.count('class="kernel"') == 6 and dom.count('class="buffer"') >= 5   # conv, pool, conv, gap, fc, softmax
    assert "Conv" in dom and "Relu" in dom and "out:probs" in dom


def test_graph_svg_draws_the_graph_and_the_lifetimes(project, tmp_path, capsys):
    if shutil.which("dot") is None:
        pytest.skip("Graphviz is not installed (apt-get install graphviz)")
    folder, _, _ = project
    out = tmp_path / "tiny_cnn.svg"
    assert main(["graph", "-f", str(folder / "cuvil.yaml"), "tiny_cnn", "--format", "svg", "-o", str(out)]) == 0
    root = ET.fromstring(out.read_bytes())
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    text = out.read_text()
    assert text.count('class="buffer"') >= 5 and "GlobalAveragePool" in text and "memory plan" in text


def test_graph_picture_needs_one_model(project, capsys):
    folder, _, _ = project
    assert main(["graph", "-f", str(folder / "cuvil.yaml"), "--format", "html"]) == 2
    assert "name one model" in capsys.readouterr().err


def test_timeline_renders(project):
    folder, report, _ = project
    dom = render(folder / "timeline.html")
    assert 'data-rendered="ok"' in dom
    ran = [s for s in report["steps"] if s["status"] == "ran"]
    assert dom.count('class="step"') == len(ran)
