"""CUDA targets without a GPU: what CI can check of a library built for a GPU.

A CUDA library's kernels are fatbins (sm machine code + PTX) embedded in an x86-64 shared library
whose driver loads libcuda.so.1 at session_create. Here: the targets resolve; two clean builds
give the same bytes and the architectures differ; the driver compiles with -Wall -Werror; the
library exports the CPU ABI plus session_run_device, needs no CUDA library to load, and without
the NVIDIA driver session_create fails with a message (never a crash); `cuvil check` plans GPU
targets. The kernels' numerics run in the CUDA simulator (tests/test_cuda_*.py) and on a real GPU
in benchmarks/gpu_check.sh.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil
from backends.targets import CUDA_ALIASES, CUDA_TARGETS, CudaTarget, known_targets, resolve_target
from cuvil import pipeline
from cuvil.config import TARGETS as CONFIG_TARGETS
from cuvil.errors import CuvilError

from tests.helpers import make_model

ABI_FUNCTIONS = ("abi_version", "model_info", "session_create", "session_run", "session_error", "session_destroy",
                 "session_output_shape", "session_run_device")


def small_model():
    """Elementwise, pooling and softmax: kernels every GPU path has (no product needed)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "x"], ["a"]),
             helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Softmax", ["p"], ["y"], axis=-1)]
    return make_model(nodes, [("x", TensorProto.FLOAT, [2, 3, 8, 8])], [("y", TensorProto.FLOAT, [2, 3, 4, 4])])


def test_targets_resolve_and_the_config_knows_them():
    assert resolve_target("cuda-a10") == CUDA_TARGETS["cuda-sm86"]
    assert resolve_target("cuda-sm90").arch == "sm_90" and resolve_target("cuda-sm80").cc == (8, 0)
    assert set(CONFIG_TARGETS) == set(known_targets())
    for alias, name in CUDA_ALIASES.items():
        assert isinstance(resolve_target(alias), CudaTarget) and name in CUDA_TARGETS
    with pytest.raises(CuvilError, match="unknown target 'cuda-sm70'"):
        resolve_target("cuda-sm70")


def test_integer_precision_on_a_gpu_target_is_refused_clearly():
    """bf16 / fp16 build for CUDA targets (tests/test_cuda_lowp.py); int8 / int4 do not yet."""
    with pytest.raises(CuvilError, match="not supported yet for CUDA targets"):
        pipeline.resolve_variant_target("cuda-sm90", "int8")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The small model for sm_80 and sm_90, each built twice from empty caches."""
    out = {}
    for arch in ("cuda-sm80", "cuda-sm90"):
        for attempt in (1, 2):
            cache = tmp_path_factory.mktemp(f"cache-{arch}-{attempt}")
            compiled = cuvil.compile(small_model(), input_shapes={"x": [2, 3, 8, 8]}, target=arch, cache_dir=cache,
                                     name="small")
            out[arch, attempt] = compiled.save(tmp_path_factory.mktemp(f"lib-{arch}-{attempt}"))
    return out


def test_two_clean_builds_are_byte_identical(built):
    for arch in ("cuda-sm80", "cuda-sm90"):
        assert built[arch, 1].read_bytes() == built[arch, 2].read_bytes(), arch
    assert built["cuda-sm80", 1].read_bytes() != built["cuda-sm90", 1].read_bytes()


def test_the_library_embeds_machine_code_and_ptx_for_its_architecture(built):
    """One fatbin per kernel in the library, each with sm_90 machine code and PTX for compute_90."""
    import struct

    from backends.numba_cuda.emit import FATBIN_MAGIC, fatbin_images
    lib = built["cuda-sm90", 1]
    blob = lib.read_bytes()
    magic = struct.pack("<I", FATBIN_MAGIC)
    found = [fatbin_images(blob, m.start()) for m in re.finditer(re.escape(magic), blob)]
    info = json.loads((lib.parent / "manifest.json").read_text())
    assert len(found) == info["kernels"] > 0
    assert all(sorted(images) == [("elf", 90), ("ptx", 90)] for images in found), found


def test_it_exports_the_abi_and_needs_no_cuda_library(built):
    lib = built["cuda-sm90", 1]
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    names = sorted(line.split()[-1] for line in exported.splitlines() if " T " in line)
    assert names == sorted(f"cuvil_{f}" for f in ABI_FUNCTIONS)
    needed = re.findall(r"NEEDED.*\[(.*)\]", subprocess.run(["readelf", "-d", str(lib)], capture_output=True,
                                                             text=True).stdout)
    assert not [n for n in needed if "cuda" in n or "nv" in n], needed
    header = (lib.parent / "small.h").read_text()
    assert "cuvil_session_run_device(" in header and "ERR_DEVICE" in header


def test_without_the_driver_session_create_fails_with_a_message(built):
    """In a fresh process (the driver is loaded once per process), with the driver library
    pointed at a missing file: model_info works, session_create returns NULL and says why."""
    lib = built["cuda-sm90", 1]
    code = (f"import ctypes, json\n"
            f"lib = ctypes.CDLL({str(lib)!r})\n"
            "lib.cuvil_model_info.restype = ctypes.c_char_p\n"
            "lib.cuvil_session_create.restype = ctypes.c_void_p\n"
            "lib.cuvil_session_error.restype = ctypes.c_char_p\n"
            "lib.cuvil_session_error.argtypes = [ctypes.c_void_p]\n"
            "info = json.loads(lib.cuvil_model_info())\n"
            "s = lib.cuvil_session_create()\n"
            "print(info['target'], s, lib.cuvil_session_error(None).decode())\n")
    env = dict(os.environ, CUVIL_CUDA_LIBRARY="libcuda-not-here.so.1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cuda-sm90 None the NVIDIA driver (libcuda-not-here.so.1) is not installed")
    # and through the Python runtime: a RuntimeFailure naming the library, no crash
    code = (f"import cuvil, numpy as np\nlib = cuvil.load({str(lib)!r})\n"
            "try:\n    lib.run({'x': np.zeros((2, 3, 8, 8), np.float32)})\n"
            "except cuvil.CuvilError as e:\n    print('error:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert "session_create failed: the NVIDIA driver" in result.stdout


def test_the_driver_compiles_with_all_warnings_as_errors(tmp_path):
    graph = pipeline.import_model(small_model(), {"x": [2, 3, 8, 8]})
    names, options = pipeline.pass_list(2, gpu=True)
    graph = pipeline.run_passes(graph, names, options)
    target = resolve_target("cuda-sm90")
    planned = pipeline.plan(graph, pipeline.VariantParams("small", target, 1, pipeline.memory_options(names, options)))
    info = pipeline.describe(planned, {"name": "small", "target": "cuda-sm90"})
    files = pipeline.generate(planned, info, "cuvil_", 1)
    (tmp_path / "driver.c").write_bytes(files["driver.c"])
    cc = os.environ.get("CC", "gcc")
    result = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-fPIC", "-c",
                             "driver.c", "-o", "driver.o"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # the header compiles in C++ too
    (tmp_path / "h.cpp").write_text('#include "small.h"\nint main() { return 0; }\n')
    (tmp_path / "small.h").write_bytes(files["header.h"])
    result = subprocess.run(["g++", "-Wall", "-Werror", "-c", "h.cpp", "-o", "h.o"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_kernel_steps_are_keyed_by_architecture_and_tools():
    from cuvil.build import kernel_step
    graph = pipeline.import_model(small_model(), {"x": [2, 3, 8, 8]})
    kernel = next(c.kernel for c in pipeline.lower(graph, resolve_target("cuda-sm90")) if hasattr(c, "kernel"))
    s80 = kernel_step(resolve_target("cuda-sm80"), kernel.as_spec())
    s90 = kernel_step(resolve_target("cuda-sm90"), kernel.as_spec())
    assert s80.params["target"]["cc"] == [8, 0] and s90.params["target"]["cc"] == [9, 0]
    assert s90.params["target"]["ptx_isa"] == "9.0" and s90.params["block"] == kernel.block
    tools = s90.params["cuda_tools"]
    assert tools["numba-cuda"] and tools["nvidia-nvvm"] and "cuda_13" in tools["ptxas"]


def test_check_plans_gpu_targets(tmp_path, capsys):
    from cuvil.cli import main
    import onnx
    onnx.save(small_model(), tmp_path / "small.onnx")
    (tmp_path / "cuvil.yaml").write_text(
        "version: 1\nmodels:\n  - name: small\n    source: small.onnx\n    inputs:\n      x: [2, 3, 8, 8]\n"
        "    targets: [native, cuda-sm90]\n")
    assert main(["check", "-f", str(tmp_path / "cuvil.yaml")]) == 0
    out = capsys.readouterr().out
    assert "cuda-sm90" in out and "native" in out
