"""The Python API: compile, run, info, save/load, errors, reproducibility."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil
from tests.helpers import assert_matches_ort, make_model, rand, run_ort

ROOT = Path(__file__).resolve().parents[1]


def small_model(batch="N"):
    nodes = [helper.make_node("Add", ["x", "b"], ["t"]), helper.make_node("Relu", ["t"], ["y"]),
             helper.make_node("Sigmoid", ["t"], ["z"])]
    return make_model(nodes, [("x", np.float32, [batch, 3, 4])],
                      [("y", np.float32, None), ("z", np.float32, None)], {"b": np.arange(4, dtype=np.float32)})


def test_compile_run_and_describe():
    compiled, got = assert_matches_ort(small_model(), {"x": rand(2, 3, 4)}, input_shapes={"x": [2, 3, 4]})
    assert compiled.input_names == ["x"]
    assert compiled.output_names == ["y", "z"]
    assert list(got) == ["y", "z"]
    info = compiled.info
    assert info["inputs"] == [{"name": "x", "dtype": "float32", "shape": [2, 3, 4]}]
    assert [o["name"] for o in info["outputs"]] == ["y", "z"]
    assert info["precision"] == "fp32" and info["target"] == "native"
    assert info["cuvil_version"] == cuvil.__version__
    # the library names its imported graph's semantic hash, the manifest the source's sha256
    assert len(info["graph_sha256"]) == 64 and "source_sha256" not in info
    assert len(compiled.artifacts.info["source_sha256"]) == 64


def test_save_and_load_without_compiler(tmp_path):
    compiled = cuvil.compile(small_model(), input_shapes={"x": [2, 3, 4]}, symbol_prefix="small_")
    lib_path = compiled.save(tmp_path / "out")
    assert (tmp_path / "out" / "model.h").exists() and (tmp_path / "out" / "manifest.json").exists()
    x = rand(2, 3, 4)
    np.save(tmp_path / "x.npy", x)
    # A fresh interpreter that loads the library must import neither numba nor onnx.
    script = (
        "import sys, numpy as np, cuvil\n"
        f"lib = cuvil.load({str(lib_path)!r})\n"
        f"out = lib.run({{'x': np.load({str(tmp_path / 'x.npy')!r})}})\n"
        "assert 'numba' not in sys.modules and 'onnx' not in sys.modules and 'llvmlite' not in sys.modules\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, out['y'])\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    want = run_ort(small_model(2), {"x": x})["y"]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-6, atol=1e-6)


def test_feed_errors_name_the_problem():
    compiled = cuvil.compile(small_model(), input_shapes={"x": [2, 3, 4]})
    with pytest.raises(cuvil.CuvilError, match="missing input"):
        compiled.run({})
    with pytest.raises(cuvil.CuvilError, match="unknown input"):
        compiled.run({"x": rand(2, 3, 4), "w": rand(1)})
    with pytest.raises(cuvil.CuvilError, match=r"shape \[3, 3, 4\]"):
        compiled.run({"x": rand(3, 3, 4)})
    with pytest.raises(cuvil.CuvilError, match="dtype int32"):
        compiled.run({"x": np.zeros((2, 3, 4), np.int32)})
    # Non-contiguous input is accepted (copied), and the session still works after errors.
    x = np.asfortranarray(rand(2, 3, 4))
    np.testing.assert_allclose(compiled.run({"x": x})["y"], np.maximum(x + np.arange(4), 0), rtol=1e-6)


def test_symbolic_dim_without_shape_is_a_clear_error():
    with pytest.raises(cuvil.CuvilError, match=r"input 'x' has symbolic dims \['N'\]"):
        cuvil.compile(small_model())


def test_unsupported_op_names_node_and_op():
    # GlobalLpPool: no kernel and no function body (Bernoulli, the op here before, now compiles)
    model = make_model([helper.make_node("GlobalLpPool", ["x"], ["y"], name="pool1")],
                       [("x", np.float32, [2, 4, 4])], [("y", TensorProto.FLOAT, None)])
    with pytest.raises(cuvil.CuvilError) as err:
        cuvil.compile(model)
    assert "pool1" in str(err.value) and "GlobalLpPool" in str(err.value) and "supported ops" in str(err.value)


def test_bad_protobuf_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(small_model().SerializeToString()[:37])
    with pytest.raises(cuvil.CuvilError, match="broken.onnx"):
        cuvil.compile(path, input_shapes={"x": [2, 3, 4]})


def test_threads_give_identical_results():
    model = small_model()
    x = rand(64, 3, 4)
    one = cuvil.compile(model, input_shapes={"x": [64, 3, 4]}, threads=1).run({"x": x})
    two = cuvil.compile(model, input_shapes={"x": [64, 3, 4]}, threads=2).run({"x": x})
    for name in one:
        np.testing.assert_array_equal(one[name], two[name])


def test_two_builds_in_two_folders_are_byte_identical(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(small_model().SerializeToString())
    script = (
        "import sys, hashlib, json\n"
        "from pathlib import Path\n"
        "from cuvil.build import VariantSpec, build_variant\n"
        "from cuvil.cache import Cache\n"
        "out = Path(sys.argv[1])\n"
        f"a = build_variant(VariantSpec('m', {str(path)!r}, {{'x': [2, 3, 4]}}, target='x86_64-avx2'), out / 'lib', Cache(out / 'cache'))\n"
        "print(json.dumps({f.name: __import__('hashlib').sha256(f.read_bytes()).hexdigest() for f in (a.library, a.header, a.manifest)}))\n"
    )
    digests = []
    for i, seed in enumerate(("1", "2")):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / f"build{i}")], check=True, env=env,
                             capture_output=True, text=True, cwd=tmp_path).stdout
        digests.append(json.loads(out.strip().splitlines()[-1]))
    assert digests[0] == digests[1]
