"""Batch buckets (cuvil/batching.py, backends/native/batching.py): one library with an entry per
batch size sharing one weights blob answers every batch from 1 to the largest bucket as
onnxruntime does, through the Python runtime and the C ABI (session_run_batch).

Tolerance: every output is compared with onnxruntime's on the same batch, max |diff| / max |ref|
<= 1e-5. The models are fp32 products of at most 288 terms (3x3 convs over 32 channels, a 64-wide
matrix product) of values O(1): summation-order differences between the two engines' kernels stay
near sqrt(288) * 2^-24 * max|ref| ~ 1e-6 relative, with one decade of margin.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import textwrap

import numpy as np
import pytest
from onnx import helper

import cuvil
from cuvil.errors import CuvilError
from tests.helpers import make_model, rand, run_ort

TOL = 1e-5


def assert_close(got: dict, want: dict):
    assert list(got) == list(want)
    for name, ref in want.items():
        out = got[name]
        assert out.shape == ref.shape and out.dtype == ref.dtype, (name, out.shape, ref.shape)
        scale = max(float(np.max(np.abs(ref))), 1e-6)
        err = float(np.max(np.abs(out.astype(np.float64) - ref)))
        assert err / scale <= TOL, f"{name}: max abs error {err:.3g} / max |ref| {scale:.3g} > {TOL}"


def small_cnn(fc_out: int = 10, fc_hidden: int = 0):
    """conv 3->16, relu, conv 16->32 stride 2, relu, global average pool, [matmul 32->fc_hidden,
    relu,] matmul -> fc_out; the batch dim N left open."""
    rng = np.random.default_rng(0)
    init = {"w1": rng.standard_normal((16, 3, 3, 3)) * 0.2, "b1": rng.standard_normal(16) * 0.1,
            "w2": rng.standard_normal((32, 16, 3, 3)) * 0.1, "b2": rng.standard_normal(32) * 0.1}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"])]
    last, width = "f", 32
    if fc_hidden:
        init["fh"] = rng.standard_normal((32, fc_hidden)) * 0.2
        nodes += [helper.make_node("MatMul", ["f", "fh"], ["h"]), helper.make_node("Relu", ["h"], ["hr"])]
        last, width = "hr", fc_hidden
    init["fw"] = rng.standard_normal((width, fc_out)) * (1 / np.sqrt(width))
    nodes.append(helper.make_node("MatMul", [last, "fw"], ["y"]))
    init = {k: v.astype(np.float32) for k, v in init.items()}
    return make_model(nodes, [("x", np.float32, ["N", 3, 16, 16])], [("y", np.float32, ["N", fc_out])], init)


def two_inputs():
    """z = relu(a @ W + b) and s = sum(b * b, axis 1): two inputs, two outputs, batch N."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, 16)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["aw"]), helper.make_node("Add", ["aw", "b"], ["ab"]),
             helper.make_node("Relu", ["ab"], ["z"]), helper.make_node("Mul", ["b", "b"], ["bb"]),
             helper.make_node("ReduceSum", ["bb", "axes"], ["s"], keepdims=1)]
    return make_model(nodes, [("a", np.float32, ["N", 8]), ("b", np.float32, ["N", 16])],
                      [("z", np.float32, ["N", 16]), ("s", np.float32, ["N", 1])],
                      {"w": w, "axes": np.array([1], np.int64)})


@pytest.fixture(scope="module")
def cnn_library(tmp_path_factory):
    model = small_cnn()
    return model, cuvil.compile(model, input_shapes={"x": [1, 3, 16, 16]}, batch=[1, 8, 32], name="cnn")


def test_every_batch_from_1_to_32_matches_onnxruntime(cnn_library):
    model, lib = cnn_library
    assert lib.info["batch"]["buckets"] == [1, 8, 32]
    assert lib.info["inputs"][0]["shape"] == [32, 3, 16, 16]     # session_run: the largest bucket
    for n in range(1, 33):
        x = rand(n, 3, 16, 16, seed=n)
        assert_close(lib.run({"x": x}), run_ort(model, {"x": x}))


def test_two_inputs_every_batch_matches_onnxruntime():
    model = two_inputs()
    # the buckets written as one shape per bucket for each input
    lib = cuvil.compile(model, input_shapes={"a": [[1, 8], [8, 8], [32, 8]], "b": [[1, 16], [8, 16], [32, 16]]})
    assert lib.info["batch"]["buckets"] == [1, 8, 32]
    for n in range(1, 33):
        feeds = {"a": rand(n, 8, seed=n), "b": rand(n, 16, seed=100 + n)}
        assert_close(lib.run(feeds), run_ort(model, feeds))
    # the same library as batch=[...]
    same = cuvil.compile(model, input_shapes={"a": [4, 8], "b": [4, 16]}, batch=[32, 1, 8])
    assert same.artifacts.library.read_bytes() == lib.artifacts.library.read_bytes()


def test_above_the_largest_bucket_and_mismatched_batches_are_clear_errors(cnn_library):
    model, lib = cnn_library
    with pytest.raises(CuvilError, match=r"batch 33 is outside 1\.\.32 \(this library's batch buckets: \[1, 8, 32\]\)"):
        lib.run({"x": rand(33, 3, 16, 16)})
    with pytest.raises(CuvilError, match=r"takes \[n, 3, 16, 16\]"):
        lib.run({"x": rand(4, 3, 16, 17)})
    two = cuvil.compile(two_inputs(), input_shapes={"a": [1, 8], "b": [1, 16]}, batch=[1, 4])
    with pytest.raises(CuvilError, match="input 'b': batch 3, but input 'a' has batch 2"):
        two.run({"a": rand(2, 8), "b": rand(3, 16)})
    # the C ABI refuses a batch outside 1..32 with ERR_BAD_ARGUMENT and says why
    c = ctypes.CDLL(str(lib.artifacts.library))
    run_batch = c.cuvil_session_run_batch
    run_batch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    c.cuvil_session_create.restype = ctypes.c_void_p
    c.cuvil_session_error.restype, c.cuvil_session_error.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    c.cuvil_session_destroy.argtypes = [ctypes.c_void_p]
    session = c.cuvil_session_create()
    ptrs = (ctypes.c_void_p * 1)()
    for n in (0, 33):
        assert run_batch(session, n, ptrs, ptrs) == 6                      # ERR_BAD_ARGUMENT
        assert f"batch {n} is outside 1..32" in c.cuvil_session_error(session).decode()
    c.cuvil_session_destroy(session)


def test_an_output_without_the_batch_in_dim_0_is_refused():
    model = make_model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
                       [("x", np.float32, ["N", 4])], [("y", np.float32, [4])], {"axes": np.array([0], np.int64)})
    with pytest.raises(CuvilError, match=r"output 'y' has shape \[4\] in the entry for batch 1: batch buckets need every input and output"):
        cuvil.compile(model, input_shapes={"x": [1, 4]}, batch=[1, 2])
    with pytest.raises(CuvilError, match="not both"):
        cuvil.compile(model, input_shapes={"x": [[1, 4], [2, 4]]}, batch=[1, 2])


def test_weights_are_stored_once_and_the_size_is_within_1_1x_of_the_largest_bucket():
    # 32 -> 512 -> 1024 dense layers: 2.1 MB of weights, so the library is mostly weights, as a
    # real model's is (three buckets add two sets of kernels and driver code, a few KB each)
    model = small_cnn(fc_out=1024, fc_hidden=512)
    buckets = cuvil.compile(model, input_shapes={"x": [1, 3, 16, 16]}, batch=[1, 8, 32], name="sized")
    single = cuvil.compile(model, input_shapes={"x": [32, 3, 16, 16]}, name="sized")
    # one copy of each weight, in the layout every bucket reads (the single build may pick another tile)
    assert buckets.info["memory"]["weights_bytes"] <= single.info["memory"]["weights_bytes"]
    size, largest = (os.path.getsize(m.artifacts.library) for m in (buckets, single))
    assert size <= 1.1 * largest, (size, largest)
    x = rand(5, 3, 16, 16, seed=5)
    assert_close(buckets.run({"x": x}), run_ort(model, {"x": x}))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_c_program_runs_a_padded_batch_through_the_header(cnn_library, tmp_path):
    model, lib = cnn_library
    folder = lib.save(tmp_path / "lib")
    header = (folder.parent / "cnn.h").read_text()
    assert "int cuvil_session_run_batch(cuvil_session* session, int64_t n" in header
    assert "#define CUVIL_MAX_BATCH 32" in header and "#define CUVIL_BATCH_BUCKETS {1, 8, 32}" in header
    x = rand(5, 3, 16, 16, seed=7)
    x.tofile(tmp_path / "x.bin")
    (tmp_path / "main.c").write_text(textwrap.dedent("""\
        #include <stdio.h>
        #include "cnn.h"
        int main(void) {
            static float x[5 * 3 * 16 * 16], y[5 * 10];
            FILE* f = fopen("x.bin", "rb");
            if (!f || fread(x, sizeof x, 1, f) != 1) return 3;
            fclose(f);
            cuvil_session* s = cuvil_session_create();
            const void* in[CUVIL_NUM_INPUTS] = {x};
            void* out[CUVIL_NUM_OUTPUTS] = {y};
            int rc = cuvil_session_run_batch(s, 5, in, out);
            if (rc) { fprintf(stderr, "%s\\n", cuvil_session_error(s)); return rc; }
            cuvil_session_destroy(s);
            f = fopen("y.bin", "wb");
            fwrite(y, sizeof y, 1, f);
            fclose(f);
            return 0;
        }
        """))
    lib_dir = folder.parent
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(lib_dir), "-o", "main", "main.c",
                    str(folder), f"-Wl,-rpath,{lib_dir}"], cwd=tmp_path, check=True)
    subprocess.run([str(tmp_path / "main")], cwd=tmp_path, check=True, timeout=60)
    y = np.fromfile(tmp_path / "y.bin", np.float32).reshape(5, 10)
    assert_close({"y": y}, run_ort(model, {"x": x}))


def test_cuvil_compile_batch_flag_and_inspect_list_the_buckets(tmp_path, capsys):
    import onnx

    from cuvil.cli import compile_main, main
    path = tmp_path / "two.onnx"
    onnx.save(two_inputs(), path)
    out = tmp_path / "out" / "libtwo.so"
    assert compile_main(["--model", str(path), "--output", str(out), "--input-shape", "a=1,8",
                         "--input-shape", "b=1,16", "--batch", "4,1,2", "--cache-dir", str(tmp_path / "cache")]) == 0
    manifest = json.loads((out.parent / "manifest.json").read_text())
    assert manifest["batch"]["buckets"] == [1, 2, 4]
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "batch      buckets 1 (arena" in capsys.readouterr().out
    lib = cuvil.load(out)
    feeds = {"a": rand(3, 8, seed=3), "b": rand(3, 16, seed=4)}
    assert_close(lib.run(feeds), run_ort(two_inputs(), feeds))
