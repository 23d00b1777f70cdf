"""PyTorch and TorchScript sources: nn.Module, ScriptModule, a .pt file (API and cuvil.yaml);
the ONNX export runs as a cached build step."""
import numpy as np
import pytest

import cuvil
from cuvil.build import VariantSpec, build_variants
from cuvil.cache import Cache
from tests import zoo

torch = pytest.importorskip("torch")


def _reference(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def _close(got, want, tol=1e-4):
    assert float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-6) <= tol


def test_nn_module_and_script_module():
    module = zoo.mlp((32, 64, 8)).eval()
    x = zoo.sample_input((2, 32))
    want = _reference(module, x)
    for source in (module, torch.jit.script(module), torch.jit.trace(module, torch.from_numpy(x))):
        compiled = cuvil.compile(source, input_shapes={"x": [2, 32]})
        assert compiled.input_names == ["x"]
        _close(compiled.run({"x": x})[compiled.output_names[0]], want)


def test_torchscript_file_through_the_api_and_the_build_graph(tmp_path):
    module = zoo.resnet((1, 1), width=8, num_classes=5).eval()
    x = zoo.sample_input((1, 3, 32, 32))
    path = tmp_path / "small_resnet.pt"
    torch.jit.trace(module, torch.from_numpy(x)).save(str(path))
    want = _reference(module, x)
    compiled = cuvil.compile(torch.jit.load(str(path)), input_shapes={"input": [1, 3, 32, 32]})
    _close(compiled.run({"input": x})[compiled.output_names[0]], want)

    spec = VariantSpec("small_resnet", str(path), {"input": [1, 3, 32, 32]})
    arts, dag = build_variants([(spec, tmp_path / "out")], Cache(tmp_path / "cache"))
    steps = {s["name"]: s["status"] for s in dag.report()["steps"]}
    assert steps["small_resnet/native/export"] == "ran"
    lib = cuvil.load(arts[0].library)
    _close(lib.run({"input": x})[lib.output_names[0]], want)
    _, dag = build_variants([(spec, tmp_path / "out")], Cache(tmp_path / "cache"))
    assert all(s["status"] == "cached" for s in dag.report()["steps"])


def test_torchscript_source_in_cuvil_yaml(tmp_path):
    from cuvil.config import load_config
    from cuvil.project import build_project
    module = zoo.mlp((16, 8)).eval()
    torch.jit.script(module).save(str(tmp_path / "tiny.pt"))
    (tmp_path / "cuvil.yaml").write_text("version: 1\nmodels:\n  - name: tiny\n    source: tiny.pt\n"
                                         "    inputs: {x: [3, 16]}\n")
    result = build_project(load_config(tmp_path / "cuvil.yaml"), progress=None)
    x = zoo.sample_input((3, 16))
    lib = cuvil.load(result.artifacts[0].library)
    _close(lib.run({"x": x})[lib.output_names[0]], _reference(module, x))
