"""The build graph: step keys, caching, incremental rebuilds, reports, cycles."""
import os
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from cuvil.build import VariantSpec, build_variants
from cuvil.cache import Cache
from cuvil.dag import Step, StepGraph
from cuvil.errors import CuvilError
from tests.helpers import make_model


def _model(path: Path, scale=2.0):
    nodes = [helper.make_node("Mul", ["x", "s"], ["t"]), helper.make_node("Relu", ["t"], ["r"]),
             helper.make_node("Identity", ["r"], ["y"])]
    model = make_model(nodes, [("x", np.float32, [4, 8])], [("y", np.float32, None)],
                       {"s": np.full((8,), scale, np.float32)})
    path.write_bytes(model.SerializeToString())
    return path


def _build(tmp_path, variants, cache_dir="cache"):
    cache = Cache(tmp_path / cache_dir)
    arts, dag = build_variants([(v, tmp_path / "out" / v.name) for v in variants], cache)
    return arts, {s["name"]: s["status"] for s in dag.report()["steps"]}, dag


def _ran(statuses):
    return sorted(n for n, s in statuses.items() if s == "ran")


def test_second_build_runs_nothing_and_touch_changes_nothing(tmp_path):
    a = _model(tmp_path / "a.onnx")
    spec = VariantSpec("a", a)
    arts, first, _ = _build(tmp_path, [spec])
    assert "a/native/import" in first and all(s == "ran" for s in first.values())
    assert any(n.startswith("kernel:") for n in first)
    mtime = arts[0].library.stat().st_mtime_ns
    start = time.perf_counter()
    arts, second, _ = _build(tmp_path, [spec])
    assert _ran(second) == [] and not arts[0].changed
    assert time.perf_counter() - start < 1.0
    os.utime(a)  # same bytes, new mtime
    arts, third, _ = _build(tmp_path, [spec])
    assert _ran(third) == [] and arts[0].library.stat().st_mtime_ns == mtime


def test_changing_one_model_rebuilds_only_that_model(tmp_path):
    a, b = _model(tmp_path / "a.onnx"), _model(tmp_path / "b.onnx")
    _build(tmp_path, [VariantSpec("a", a), VariantSpec("b", b)])
    _model(b, scale=3.0)
    _, statuses, _ = _build(tmp_path, [VariantSpec("a", a), VariantSpec("b", b)])
    ran = _ran(statuses)
    assert ran and all(n.startswith("b/") for n in ran), ran


def test_changing_the_pass_list_keeps_the_import(tmp_path):
    a = _model(tmp_path / "a.onnx")
    _build(tmp_path, [VariantSpec("a", a)])
    _, statuses, _ = _build(tmp_path, [VariantSpec("a", a, disable_passes=["eliminate_common"])])
    ran = _ran(statuses)
    assert "a/native/import" not in ran and "a/native/pass:fold_constants" not in ran
    assert "a/native/pass:eliminate_dead" in ran and "a/native/link" in ran
    # The kernels are the same code: they come from the cache.
    assert not any(n.startswith("kernel:") for n in ran)


def test_identical_kernels_are_one_step_across_models(tmp_path):
    a, b = _model(tmp_path / "a.onnx"), _model(tmp_path / "b.onnx", scale=5.0)
    _, statuses, dag = _build(tmp_path, [VariantSpec("a", a), VariantSpec("b", b)])
    kernels = [n for n in statuses if n.startswith("kernel:")]
    # Mul and Relu: the scale is a weight, not part of the kernel, so both models share both kernels.
    assert len(kernels) == 2
    for k in kernels:
        assert set(dag.g.successors(k)) == {"a/native/link", "b/native/link"}


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
    a = _model(tmp_path / "a.onnx")
    arts, _, dag = _build(tmp_path, [VariantSpec("a", a)])
    link_key = dag.key("a/native/link")
    entry = tmp_path / "cache" / link_key[:2] / link_key
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0xFF
    entry.write_bytes(bytes(data))
    good = arts[0].library.read_bytes()
    arts, statuses, _ = _build(tmp_path, [VariantSpec("a", a)])
    assert statuses["a/native/link"] == "ran"
    assert arts[0].library.read_bytes() == good


def test_cycle_is_an_error_naming_the_steps(tmp_path):
    dag = StepGraph(Cache(tmp_path / "c"), {})
    noop = lambda *a: b""
    dag.add(Step("one", "x", {}, ["two"], noop, bytes, bytes))
    dag.add(Step("two", "x", {}, ["one"], noop, bytes, bytes))
    with pytest.raises(CuvilError, match="cycle: .*one.*two"):
        dag.check()


def test_graph_renders(tmp_path):
    a = _model(tmp_path / "a.onnx")
    _, _, dag = _build(tmp_path, [VariantSpec("a", a)])
    assert "a/native/import" in dag.render("text")
    assert dag.render("dot").startswith("digraph")
    assert dag.render("mermaid").startswith("graph LR")
    assert '"kind": "link"' in dag.render("json")


def _two_layer(path: Path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("Tanh", ["s"], ["y"])]
    rng = np.random.default_rng(0)
    model = make_model(nodes, [("x", np.float32, [4, 16])], [("y", np.float32, None)],
                       {"w": rng.standard_normal((16, 8)).astype(np.float32),
                        "b": rng.standard_normal(8).astype(np.float32)})
    path.write_bytes(model.SerializeToString())
    return path


def test_parallel_jobs_give_the_same_bytes(tmp_path):
    a = _two_layer(tmp_path / "a.onnx")
    outs = []
    for jobs in (1, 2):
        # opt_level 1: no fusion, so the four ops stay several kernels to compile in parallel.
        arts, dag = build_variants([(VariantSpec("a", a, opt_level=1), tmp_path / f"out{jobs}")],
                                   Cache(tmp_path / f"cache{jobs}"), jobs=jobs)
        assert sum(1 for s in dag.report()["steps"] if s["kind"] == "kernel") >= 3
        outs.append([f.read_bytes() for f in (arts[0].library, arts[0].header, arts[0].manifest)])
    assert outs[0] == outs[1]


def test_two_concurrent_builds_share_one_cache(tmp_path):
    import subprocess
    import sys
    a = _two_layer(tmp_path / "a.onnx")
    root = Path(__file__).resolve().parents[1]
    script = ("import sys\nfrom pathlib import Path\nfrom cuvil.build import VariantSpec, build_variant\n"
              "from cuvil.cache import Cache\n"
              f"build_variant(VariantSpec('a', {str(a)!r}, threads=2), Path(sys.argv[1]), Cache({str(tmp_path / 'shared')!r}))\n")
    env = dict(os.environ, PYTHONPATH=str(root))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"out{i}")], env=env,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert (tmp_path / "out0" / "liba.so").read_bytes() == (tmp_path / "out1" / "liba.so").read_bytes()
