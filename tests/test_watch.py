"""`cuvil watch` rebuilds after an edit, survives a broken save, and rebuilds after the fix."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from onnx import helper

from tests.helpers import make_model

ROOT = Path(__file__).resolve().parents[1]


def _model(path, scale):
    model = make_model([helper.make_node("Mul", ["x", "s"], ["y"])], [("x", np.float32, [2, 4])],
                       [("y", np.float32, None)], {"s": np.full((4,), scale, np.float32)})
    tmp = path.with_suffix(".partial")
    tmp.write_bytes(model.SerializeToString())
    tmp.replace(path)


CONFIG = """version: 1
output_dir: out
cache: {{dir: {cache}}}
models:
  - name: scale
    source: models/scale.onnx
    inputs: {{x: [2, 4]}}
watch: {{paths: [models], debounce_ms: 100}}
"""


def _wait_for(predicate, proc, lines, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError("timed out; watch printed:\n" + "".join(lines))


def test_watch_rebuilds_and_survives_broken_saves(tmp_path):
    (tmp_path / "models").mkdir()
    _model(tmp_path / "models" / "scale.onnx", 2.0)
    (tmp_path / "cuvil.yaml").write_text(CONFIG.format(cache=os.environ["CUVIL_CACHE_DIR"]))
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "cuvil", "watch", "--max-builds", "4"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    import threading
    reader = threading.Thread(target=lambda: [lines.append(l) for l in proc.stdout], daemon=True)
    reader.start()
    manifest = tmp_path / "out" / "scale" / "native" / "manifest.json"
    try:
        _wait_for(lambda: sum("watching " in l for l in lines) >= 1, proc, lines)
        assert manifest.exists()
        first = manifest.read_bytes()
        # An edit of the model: rebuilt.
        _model(tmp_path / "models" / "scale.onnx", 3.0)
        _wait_for(lambda: manifest.read_bytes() != first, proc, lines)
        _wait_for(lambda: sum("watching " in l for l in lines) >= 2, proc, lines)
        assert any("rebuilt scale/native" in l for l in lines)
        # A broken save of the config: an error, and the watcher goes on.
        (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels: [\n")
        _wait_for(lambda: any("cuvil: error:" in l for l in lines), proc, lines)
        _wait_for(lambda: sum("watching " in l for l in lines) >= 3, proc, lines)
        second = manifest.read_bytes()
        (tmp_path / "cuvil.yaml").write_text(CONFIG.format(cache=os.environ["CUVIL_CACHE_DIR"]).replace(
            "[2, 4]}", "[2, 4]}\n    threads: 2"))
        _wait_for(lambda: manifest.read_bytes() != second, proc, lines)
        proc.wait(timeout=60)
        assert proc.returncode == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
