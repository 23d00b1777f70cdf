"""Bounded fuzzing: mutated models and configs either build or raise CuvilError -
never another exception, a crash or a hang.

Longer runs: `CUVIL_FUZZ_EXAMPLES=2000 python -m pytest tests/hardening/test_fuzz.py -m ''`
(hypothesis keeps failing examples in .hypothesis/ and replays them first).
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from onnx import helper

import cuvil
from cuvil.config import parse_config
from tests.helpers import make_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("CUVIL_FUZZ_EXAMPLES", "12"))  # per model test (each is a child process)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FUZZ_CONFIG = settings(FUZZ, max_examples=EXAMPLES * 10)  # in-process: cheap

SEED_MODEL = make_model(
    [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
     helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Reshape", ["r", "s"], ["y"])],
    [("x", np.float32, ["N", 6])], [("y", np.float32, None)],
    {"w": np.arange(24, dtype=np.float32).reshape(6, 4) / 10, "b": np.ones(4, np.float32),
     "s": np.array([-1], np.int64)}).SerializeToString()


def _compile_in_child(data: bytes, tmp_path: Path) -> subprocess.CompletedProcess:
    """Build in a child process, so a crash is seen as a crash instead of killing the test run."""
    path = tmp_path / "fuzz.onnx"
    path.write_bytes(data)
    script = (
        "import sys, cuvil, numpy as np\n"
        "try:\n"
        f"    m = cuvil.compile({str(path)!r}, input_shapes={{'x': [2, 6]}})\n"
        "    feeds = {i['name']: np.zeros(i['shape'], i['dtype']) for i in m.info['inputs']}\n"
        "    m.run(feeds)\n"
        "    print('BUILT')\n"
        "except cuvil.CuvilError as e:\n"
        "    print('CUVILERROR', str(e).splitlines()[0][:200])\n"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _check(result):
    assert result.returncode == 0, f"crash or unexpected exception:\n{result.stderr[-3000:]}"
    assert result.stdout.startswith(("BUILT", "CUVILERROR")), result.stdout + result.stderr[-2000:]


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(SEED_MODEL) - 1), st.integers(0, 255)), min_size=1, max_size=6))
def test_byte_mutated_models(tmp_path_factory, flips):
    data = bytearray(SEED_MODEL)
    for position, value in flips:
        data[position] = value
    _check(_compile_in_child(bytes(data), tmp_path_factory.mktemp("fuzz")))


@FUZZ
@given(st.integers(0, len(SEED_MODEL)))
def test_truncated_models(tmp_path_factory, length):
    _check(_compile_in_child(SEED_MODEL[:length], tmp_path_factory.mktemp("fuzz")))


CONFIG = """version: 1
output_dir: out
defaults:
  threads: 1
models:
  - name: m
    source: m.onnx
    inputs: {x: [2, 6]}
    targets: [native]
watch: {paths: [], debounce_ms: 100}
"""


@FUZZ_CONFIG
@given(st.lists(st.tuples(st.integers(0, len(CONFIG) - 1),
                          st.sampled_from(list(":-[]{}\n #'\"!&*0123456789abcxyz\t") + ["", "  ", "null"])),
                min_size=1, max_size=5))
def test_mutated_configs(tmp_path_factory, edits):
    folder = tmp_path_factory.mktemp("cfg")
    (folder / "m.onnx").write_bytes(SEED_MODEL)
    text = CONFIG
    for position, replacement in edits:
        position = min(position, len(text))
        text = text[:position] + replacement + text[position + 1:]
    try:
        parse_config(text, folder / "cuvil.yaml")
    except cuvil.CuvilError:
        pass
