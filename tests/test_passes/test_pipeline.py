"""The pass pipeline: the registry and opt levels, pass options (validated, in the step key),
the verifier after every pass on whole models, and `explain`."""
import numpy as np
import pytest

import cuvil
from cuvil.build import VariantSpec, build_variants
from cuvil.cache import Cache
from cuvil.config import parse_config
from cuvil.errors import ConfigError
from cuvil.explain import explain_model, render
from cuvil.frontends.onnx import import_onnx
from cuvil.ir import verify
from passes import OPT_LEVELS, PASS_OPTIONS, PASSES, describe, resolve_pass_options, resolve_passes, run_passes
from tests import zoo
from tests.helpers import assert_matches_ort, make_model, rand
from tests.test_passes.common import export_keeping_batchnorm

torch = pytest.importorskip("torch")


def test_opt_levels_grow_and_name_registered_passes():
    assert OPT_LEVELS[0] == []
    for level in (1, 2, 3):
        assert set(OPT_LEVELS[level]) <= set(PASSES) and OPT_LEVELS[level][-1] == "plan_memory"
        assert set(OPT_LEVELS[level - 1]) <= set(OPT_LEVELS[level])
    assert "fuse_activation" in OPT_LEVELS[2] and "fuse_elementwise" in OPT_LEVELS[3]


def test_unknown_passes_and_options_are_errors_naming_what_exists():
    with pytest.raises(ConfigError, match="(?s)unknown pass 'fuse_everything'.*fuse_activation"):
        resolve_passes(2, disable=["fuse_everything"])
    with pytest.raises(ConfigError, match=r"fuse_elementwise: unknown option 'max_size' \(known: max_ops"):
        resolve_pass_options(["fuse_elementwise"], {"fuse_elementwise": {"max_size": 4}})
    with pytest.raises(ConfigError, match="fold_batchnorm' takes no options"):
        resolve_pass_options(["fold_batchnorm"], {"fold_batchnorm": {"x": 1}})
    assert resolve_pass_options(["eliminate_dead", "plan_memory"], {"plan_memory": {"strategy": "best_fit"}}) == {
        "eliminate_dead": {}, "plan_memory": {"strategy": "best_fit", "in_place": True, "reorder": True}}
    assert set(PASS_OPTIONS) == {"fuse_activation", "fuse_elementwise", "fuse_depthwise_block", "fuse_patterns",
                                 "plan_memory", "assign_precision", "quantize_weights"}


def test_pass_options_in_cuvil_yaml_merge_over_defaults_and_are_located(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"")
    text = ("version: 1\ndefaults:\n  pass_options:\n    fuse_elementwise: {max_ops: 4}\n"
            "models:\n  - name: m\n    source: m.onnx\n    pass_options:\n      fuse_elementwise: {max_inputs: 3}\n")
    spec = parse_config(text, tmp_path / "cuvil.yaml")
    assert spec.models[0].pass_options == {"fuse_elementwise": {"max_ops": 4, "max_inputs": 3}}
    with pytest.raises(ConfigError) as error:
        parse_config(text.replace("max_inputs: 3", "max_inputs: many"), tmp_path / "cuvil.yaml")
    assert error.value.line == 9 and "fuse_elementwise: max_inputs" in str(error.value)


def _dense_model():
    nodes = [helper_node("MatMul", ["x", "w"], ["m"]), helper_node("Add", ["m", "b"], ["a"]),
             helper_node("Relu", ["a"], ["r"]), helper_node("Exp", ["r"], ["e"]), helper_node("Neg", ["e"], ["y"])]
    return make_model(nodes, [("x", np.float32, [4, 8])], [("y", np.float32, None)],
                      {"w": rand(8, 6, seed=1), "b": rand(6, seed=2)})


def helper_node(op, inputs, outputs):
    from onnx import helper
    return helper.make_node(op, inputs, outputs, name=outputs[0])


def test_a_pass_option_reruns_that_pass_and_what_follows_only(tmp_path):
    (tmp_path / "d.onnx").write_bytes(_dense_model().SerializeToString())
    cache = Cache(tmp_path / "cache")

    def build(**options):
        spec = VariantSpec("d", tmp_path / "d.onnx", opt_level=3, pass_options=options)
        _, dag = build_variants([(spec, tmp_path / "out")], cache)
        return {s["name"]: s["status"] for s in dag.report()["steps"]}

    build()
    ran = sorted(n for n, s in build(fuse_elementwise={"max_ops": 2}).items() if s == "ran")
    assert "d/native/pass:fuse_elementwise" in ran and "d/native/pass:fuse_activation" not in ran
    assert "d/native/import" not in ran and "d/native/codegen" in ran


def _transformer_block():
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, d=32, heads=4):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.heads = heads

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(d, dim=-1))
            a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(nn.functional.silu(nn.functional.gelu(self.fc1(self.ln2(x)))))

    torch.manual_seed(0)
    # Opset 14: torch writes LayerNorm and GELU as their decompositions.
    return zoo.export(Block(), {"x": (1, 8, 32)}, opset=14), {"x": zoo.sample_input((1, 8, 32))}


MODELS = {
    "mobilenet_v2_with_bn": lambda: (export_keeping_batchnorm(zoo.mobilenet_v2(), {"input": (1, 3, 64, 64)}),
                                     {"input": zoo.sample_input((1, 3, 64, 64))}),
    "transformer_block": _transformer_block,
    "dense": lambda: (_dense_model(), {"x": rand(4, 8)}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_pass_keeps_the_graph_valid_and_the_outputs(name):
    model, feeds = MODELS[name]()
    graph, _ = import_onnx(model)
    verify(graph)
    seen = []
    run_passes(graph, resolve_passes(3), on_pass=lambda n, before, after: (verify(after), seen.append(n)))
    assert seen == resolve_passes(3)
    assert_matches_ort(model, feeds, tol=1e-4, opt_level=3, jobs=2)


def test_explain_says_what_each_pass_did():
    model, _ = MODELS["transformer_block"]()
    report = explain_model(model, opt_level=3)
    by_pass = {p.name: p.summary for p in report.passes}
    assert by_pass["fuse_gemm"] == "4 MatMul + bias Add fused into Gemm"
    assert by_pass["fuse_patterns"].startswith("2 LayerNormalization, 1 Gelu (FusedElementwise)")
    assert by_pass["fold_batchnorm"] == "no change"
    assert any(k.computes == "FusedElementwise[Gelu, Silu]" for k in report.kernels)
    assert len(report.kernels) < report.kernels_before
    text = render(report)
    assert "fuse_patterns" in text and "arena" in text and "in place" in text


def test_describe_falls_back_to_op_counts():
    model = make_model([helper_node("Identity", ["x"], ["a"]), helper_node("Relu", ["a"], ["y"])],
                       [("x", np.float32, [2])], [("y", np.float32, None)])
    graph, _ = import_onnx(model)
    after = PASSES["eliminate_identity"](graph)
    assert describe("eliminate_identity", graph, after) == "-1 Identity"
    assert describe("eliminate_dead", graph, graph) == "no change"


def test_compile_accepts_pass_options():
    compiled = cuvil.compile(_dense_model(), opt_level=3, pass_options={"fuse_elementwise": {"max_ops": 2}})
    assert compiled.info["pass_options"] == {"fuse_elementwise": {"max_ops": 2}}
    with pytest.raises(ConfigError):
        cuvil.compile(_dense_model(), pass_options={"fuse_elementwise": {"max_ops": "two"}})
