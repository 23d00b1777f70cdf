"""`cuvil build`, `inspect`, `explain` and `check` report the same kernels, arena and weights:
they read the objects of one pipeline (cuvil/pipeline.py) made with the same parameters.

Variants: the shipped example (its 3x3 convs go through Winograd, whose transformed weights
are the block the sessions share) and a ResNet-18 at 1 and 2 threads (2 threads lowers to
other work splits, so other kernels)."""
import os
import shutil
from pathlib import Path

import onnx
import pytest

from cuvil.cache import Cache
from cuvil.cli import main
from cuvil.config import load_config
from cuvil.explain import explain_variant
from cuvil.project import build_project, check_model
from cuvil.runtime import load
from tests import zoo

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("arena_bytes", "naive_bytes", "weights_bytes", "shared_bytes")

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agree")
    shutil.copy(ROOT / "examples" / "models" / "tiny_cnn.onnx", folder / "tiny_cnn.onnx")
    onnx.save(zoo.export(zoo.resnet((2, 2, 2, 2)), {"input": (1, 3, 64, 64)}), folder / "resnet18.onnx")
    (folder / "cuvil.yaml").write_text("""version: 1
output_dir: out
models:
  - name: tiny_cnn
    source: tiny_cnn.onnx
    inputs: {input: [1, 3, 32, 32]}
  - name: resnet18
    source: resnet18.onnx
    inputs: {input: [1, 3, 64, 64]}
  - name: resnet18_t2
    source: resnet18.onnx
    inputs: {input: [1, 3, 64, 64]}
    threads: 2
""")
    spec = load_config(folder / "cuvil.yaml")
    cache = Cache(Path(os.environ["CUVIL_CACHE_DIR"]))  # the suite's kernel cache
    result = build_project(spec, jobs=2, progress=None, cache=cache)
    return folder, spec, result


@pytest.mark.parametrize("name", ["tiny_cnn", "resnet18", "resnet18_t2"])
def test_build_inspect_explain_and_check_agree(project, name):
    _, spec, result = project
    (artifacts,) = [a for a in result.artifacts if a.info["name"] == name]
    built = artifacts.info
    inspected = load(artifacts.library).info
    explained = explain_variant(result.dag, f"{name}/native/link", name)
    checked = check_model(spec, spec.model(name))
    assert not checked.unsupported
    variant = checked.variants["native"]

    for figure in FIGURES:
        assert built["memory"][figure] == inspected["memory"][figure] == explained.memory[figure] \
            == variant["memory"][figure], figure
    assert built["kernels"] == inspected["kernels"] == explained.distinct_kernels == variant["kernels"]
    assert built["steps"] == inspected["steps"] == len(explained.kernels) == variant["steps"]
    if name == "tiny_cnn":
        assert built["memory"]["shared_bytes"] > 0  # a Winograd build: its transformed weights


def test_two_threads_lower_to_other_kernels(project):
    """The 2-thread variant is a different lowering, so agreeing on it checks that explain and
    check use the variant's threads (they used 1 thread whatever the build's)."""
    _, _, result = project
    info = {a.info["name"]: a.info for a in result.artifacts}
    symbols = {name: {k.symbol for k in explain_variant(result.dag, f"{name}/native/link", name).kernels}
               for name in ("resnet18", "resnet18_t2")}
    assert info["resnet18_t2"]["threads"] == 2 and symbols["resnet18"] != symbols["resnet18_t2"]


def test_the_commands_print_the_same_figures(project, capsys):
    folder, _, result = project
    (artifacts,) = [a for a in result.artifacts if a.info["name"] == "tiny_cnn"]
    config = str(folder / "cuvil.yaml")
    outputs = {}
    for command in (["inspect", str(artifacts.library)], ["explain", "-f", config, "tiny_cnn"],
                    ["check", "-f", config, "tiny_cnn"]):
        assert main(command) == 0
        outputs[command[0]] = capsys.readouterr().out
    arena = f"{artifacts.info['memory']['arena_bytes'] / 1024:.1f} KiB"
    weights = f"{artifacts.info['memory']['weights_bytes'] / 1024:.1f} KiB"
    for command, out in outputs.items():
        assert f"arena {arena}" in out.replace("arena  ", "arena "), command
        assert f"weights {weights}" in out, command
