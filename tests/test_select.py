"""Measured kernel selection (`select: measure`, cuvil/select.py) against onnxruntime.

Whichever candidate the measurement takes, the outputs match onnxruntime within the conv tests'
relative 1e-4 (tests/test_winograd.py: F(4x4, 3x3) in float32 errs ~7e-6 of the largest output on a
256-channel conv; these have 16 channels). The models: two 16-channel 3x3 convs of one shape (which
measure once: the measurement is cached per node shape), after a 3-channel conv that no transform
fits (nothing to choose) in the 16x16 model.
"""
import numpy as np
import onnx
import pytest
from onnx import helper

import cuvil
from cuvil import select
from cuvil.build import VariantSpec, build_variants, compiled_kernels, plan_variant, tool_versions
from cuvil.cache import Cache, default_cache_dir
from cuvil.dag import StepGraph
from cuvil.errors import CuvilError
from tests.helpers import make_model, rand, run_ort

F32 = np.float32
TOL = 1e-4


def convs(size=8, first=True):
    """[a 3-channel conv no transform fits ->] two 16-channel 3x3 convs of one shape (+ Relu each)."""
    inits = {"w0": rand(16, 3, 3, 3, seed=1) * 0.3, "w1": rand(16, 16, 3, 3, seed=2) * 0.2,
             "w2": rand(16, 16, 3, 3, seed=3) * 0.2, "b": rand(16, seed=4)}
    nodes = [helper.make_node("Conv", ["x", "w0", "b"], ["c0"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"])] if first else []
    nodes += [helper.make_node("Conv", ["r0" if first else "x", "w1", "b"], ["c1"], pads=[1, 1, 1, 1]),
              helper.make_node("Relu", ["c1"], ["r1"]),
              helper.make_node("Conv", ["r1", "w2", "b"], ["c2"], pads=[1, 1, 1, 1]),
              helper.make_node("Relu", ["c2"], ["y"])]
    channels = 3 if first else 16
    model = make_model(nodes, [("x", F32, [1, channels, size, size])], [("y", F32, None)],
                       {k: v for k, v in inits.items() if first or k != "w0"})
    return onnx.shape_inference.infer_shapes(model), {"x": rand(1, channels, size, size, seed=5)}


def assert_close(got, want):
    scale = float(np.max(np.abs(want)))
    assert float(np.max(np.abs(got.astype(np.float64) - want))) / scale <= TOL


def measuring(lines) -> int:
    return sum("select: measuring" in line for line in lines)


def test_measured_selection_builds_matches_onnxruntime_caches_and_explains(tmp_path):
    """8x8 outputs: F(4x4) leaves 4 tiles, too few for its GEMMs, so the candidates are winograd_f2
    and direct (in the shared test cache: a rerun may find the measurement already there)."""
    from cuvil.explain import explain_variant, render
    model, feeds = convs(size=8, first=False)
    want = run_ort(model, feeds)["y"]
    lines = [[], []]
    builds = [cuvil.compile(model, select="measure", progress=said.append, name="convs") for said in lines]
    assert measuring(lines[1]) == 0          # the second build reads the cached step
    chosen = builds[0].info["select"]
    assert chosen["mode"] == "measure" and chosen == builds[1].info["select"]
    assert len(chosen["kernels"]) == 2 and set(chosen["kernels"].values()) <= {"winograd_f2", "direct"}
    for build in builds:
        assert_close(build.run(feeds)["y"], want)
    spec = VariantSpec(name="convs", source=model.SerializeToString(), select="measure")
    [_], dag = build_variants([(spec, tmp_path)], Cache(default_cache_dir()))
    report = explain_variant(dag, "convs/native/link", "convs")
    assert {node: r["kernel"] for node, r in report.selection["nodes"].items()} == chosen["kernels"]
    for result in report.selection["nodes"].values():
        assert set(result["times_ms"]) == {"winograd_f2", "direct"} and result["rules"] == "winograd_f2"
        assert result["times_ms"][result["kernel"]] == min(result["times_ms"].values()) > 0
    assert f"select  measured on {select.cpu_model()}: 2 nodes with a choice" in render(report)


@pytest.mark.slow  # a fresh cache: every kernel compiled (~20 s on 2 cores)
def test_forced_candidates_are_measured_once_per_node_shape(tmp_path):
    """16x16: all three kernels apply; the forced list times two. The two 16-channel convs have one
    shape (measured once); the 3-channel conv has no choice (F(4x4) and F(2x2) do not fit)."""
    model, feeds = convs(size=16)
    lines = []
    build = cuvil.compile(model, select="measure", select_candidates=["direct", "winograd_f2"], cache_dir=tmp_path,
                          progress=lines.append)
    assert measuring(lines) == 1
    assert set(build.info["select"]["kernels"].values()) <= {"winograd_f2", "direct"}
    assert len(build.info["select"]["kernels"]) == 2
    assert_close(build.run(feeds)["y"], run_ort(model, feeds)["y"])


# F(4x4)'s transform kernels take ~10 s to compile on 2 cores
@pytest.mark.parametrize("kernel", [pytest.param("winograd_f4", marks=pytest.mark.slow), "winograd_f2", "direct"])
def test_every_candidate_library_matches_onnxruntime(kernel, tmp_path):
    """The one-node library the measurement times, on each candidate: the second conv (+ Relu)."""
    from backends.targets import resolve_target
    from cuvil.frontends.onnx import import_onnx
    from cuvil.runtime import Library
    from passes import resolve_passes, run_passes
    model, _ = convs(size=16)
    graph = run_passes(import_onnx(model, {})[0], resolve_passes(2))
    choices = select.choices_to_measure(graph, None)
    assert [(names, rules) for _, names, rules in choices] == [(["winograd_f4", "winograd_f2", "direct"],
                                                                "winograd_f4")] * 2
    node = choices[0][0]
    single = select.one_node_graph(node, graph, kernel)
    library, _ = select.one_node_library(StepGraph(Cache(default_cache_dir()), tool_versions()), single,
                                         resolve_target("native"), 1, tmp_path / kernel, compiled_kernels)
    x = rand(1, 16, 16, 16, seed=6)
    got = Library(library).session().run({single.inputs[0]: x})[node.outputs[0]]
    conv = make_model([helper.make_node("Conv", ["x", "w1", "b"], ["c"], pads=[1, 1, 1, 1]),
                       helper.make_node("Relu", ["c"], ["y"])], [("x", F32, [1, 16, 16, 16])], [("y", F32, None)],
                      {"w1": rand(16, 16, 3, 3, seed=2) * 0.2, "b": rand(16, seed=4)})
    assert_close(got, run_ort(conv, {"x": x})["y"])


@pytest.mark.parametrize("options, message", [
    ({"select": "fastest"}, "unknown select 'fastest'"),
    ({"select": "measure", "select_candidates": ["winograd_f8", "direct"]}, "unknown kernel 'winograd_f8'"),
    ({"select": "measure", "select_candidates": ["direct"]}, "at least two kernels"),
    ({"select": "rules", "select_candidates": ["winograd_f2", "direct"]}, "select_candidates is given"),
    ({"select": "measure", "target": "aarch64-linux"}, "cannot run target 'aarch64-linux'"),
])
def test_bad_select_options_are_clear_errors(options, message):
    model, _ = convs()
    spec = VariantSpec(name="convs", source=model.SerializeToString(), **options)
    with pytest.raises(CuvilError, match=message):
        plan_variant(StepGraph(Cache(None), tool_versions()), spec)


def test_rules_builds_keep_their_keys():
    """The default (select: rules) adds nothing to the codegen step: its key, and the library, are
    what they were before measured selection existed."""
    model, _ = convs()
    dag = StepGraph(Cache(None), tool_versions())
    link = plan_variant(dag, VariantSpec(name="convs", source=model.SerializeToString()))
    codegen = dag.step(link).deps[0]
    assert "select" not in dag.step(codegen).params
    assert "convs/native/select" not in dag.g


def test_config_rejects_an_unknown_select(tmp_path):
    from cuvil.config import load_config
    from cuvil.errors import ConfigError
    path = tmp_path / "cuvil.yaml"
    path.write_text("version: 1\nmodels:\n  - name: m\n    source: m.onnx\n    select: fastest\n")
    (tmp_path / "m.onnx").write_bytes(convs()[0].SerializeToString())
    with pytest.raises(ConfigError, match="unknown select 'fastest'"):
        load_config(path)


def test_command_line_flags(tmp_path, capsys):
    """`cuvil-compile --select measure` is the config's `select: measure`; `cuvil build --select` takes
    rules or measure only (a usage error, exit 2)."""
    from cuvil.cli import _compile_parser, compile_config, main
    model = tmp_path / "m.onnx"
    model.write_bytes(convs()[0].SerializeToString())
    parser = _compile_parser()
    args = parser.parse_args(["--model", str(model), "--output", str(tmp_path / "libm.so"), "--select", "measure"])
    parser.get_default("validate")(parser, args)
    assert compile_config(args).models[0].select == "measure"
    assert main(["build", "--select", "fastest"]) == 2
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_the_rules_kernel_stays_within_the_margin():
    names = ["winograd_f4", "winograd_f2", "direct"]
    times = {"winograd_f4": 1.04, "winograd_f2": 1.0, "direct": 2.0}
    assert select.pick(names, times, "winograd_f4") == "winograd_f4"     # 4 % slower: noise
    assert select.pick(names, {**times, "winograd_f4": 1.06}, "winograd_f4") == "winograd_f2"
    assert select.pick(names, {**times, "winograd_f4": 2.0, "direct": 1.0}, None) == "winograd_f2"  # a tie: the first
