"""Faults: a build killed at any moment loses nothing; unwritable outputs are clear errors."""
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil.build import VariantSpec, build_variant
from cuvil.cache import Cache
from tests.helpers import make_model

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from pathlib import Path
from cuvil.build import VariantSpec, build_variant
from cuvil.cache import Cache
build_variant(VariantSpec("m", sys.argv[1]), Path(sys.argv[2]), Cache(Path(sys.argv[3])), jobs=2)
"""


def _model(path: Path, seed: int):
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    model = make_model(nodes, [("x", np.float32, [3, 12])], [("y", np.float32, None)],
                       {"w": rng.standard_normal((12, 7 + seed)).astype(np.float32),
                        "b": rng.standard_normal(7 + seed).astype(np.float32)})
    path.write_bytes(model.SerializeToString())
    return path


def _complete_or_absent(out: Path):
    """Either nothing of the variant is there, or all of it, consistent with the manifest."""
    import hashlib
    import json
    names = sorted(p.name for p in out.iterdir()) if out.exists() else []
    visible = [n for n in names if not n.startswith(".cuvil-tmp-")]
    if "manifest.json" in visible:
        manifest = json.loads((out / "manifest.json").read_text())
        for name, digest in manifest["files"].items():
            assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    else:
        assert "libm.so" not in visible or "m.h" in visible


def test_builds_killed_at_random_moments_lose_nothing(tmp_path):
    """SIGKILL a build at random points; the next build must succeed, give the same bytes
    as an undisturbed build, and the output folder must never hold a half-written file."""
    rng = random.Random(1234)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    reference = tmp_path / "reference"
    kills = 0
    for seed in range(3):
        model = _model(tmp_path / f"m{seed}.onnx", seed)
        build_variant(VariantSpec("m", str(model)), reference / str(seed), Cache(tmp_path / "ref-cache"))
        out, cache = tmp_path / "out" / str(seed), tmp_path / "cache"
        for _ in range(4):
            proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(model), str(out), str(cache)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            time.sleep(rng.uniform(0.05, 2.5))
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                kills += 1
            proc.wait()
            _complete_or_absent(out)
        build_variant(VariantSpec("m", str(model)), out, Cache(cache))
        for name in ("libm.so", "m.h", "manifest.json"):
            assert (out / name).read_bytes() == (reference / str(seed) / name).read_bytes(), name
        assert not list(out.glob(".cuvil-tmp-*"))
    assert kills >= 3  # the test must really have interrupted builds


def test_output_folder_that_cannot_be_written_is_a_clear_error(tmp_path):
    model = _model(tmp_path / "m.onnx", 0)
    blocker = tmp_path / "out"
    blocker.write_text("a file where the output folder should be")
    with pytest.raises(cuvil.CuvilError, match="output folder"):
        build_variant(VariantSpec("m", str(model)), blocker / "m", Cache(tmp_path / "cache"))


def test_unwritable_cache_does_not_fail_the_build(tmp_path):
    model = _model(tmp_path / "m.onnx", 0)
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    art = build_variant(VariantSpec("m", str(model)), tmp_path / "out", Cache(blocker))
    assert art.library.exists()


def test_full_disk_while_installing_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    import cuvil.build as build_module
    model = _model(tmp_path / "m.onnx", 0)
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, fd, mode):
            self.f = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(build_module.os, "fdopen", FullDisk)
    out = tmp_path / "out"
    with pytest.raises(cuvil.CuvilError, match="No space left on device") as err:
        build_variant(VariantSpec("m", str(model)), out, Cache(tmp_path / "cache"))
    assert "disk is not full" in str(err.value)
    assert not [p for p in out.iterdir()] if out.exists() else True
