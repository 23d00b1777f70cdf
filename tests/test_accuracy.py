"""The accuracy report of a reduced-precision build (cuvil/accuracy.py): the library against its
float32 build on the same inputs, in the manifest and `cuvil build`'s output, with min_cosine
failing the build. Its figures are checked against onnxruntime in float32 on the same inputs
(cuvil's float32 build matches onnxruntime to ~1e-6, tested elsewhere)."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cuvil.accuracy import sample_inputs
from cuvil.cli import main
from cuvil.runtime import load
from tests.test_cli import TEST_CACHE
from tests.helpers import cosine

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from tests import zoo
    folder = tmp_path_factory.mktemp("accuracy")
    onnx.save(zoo.export(zoo.mlp(sizes=(256, 512, 64, 16)), {"x": (4, 256)}), folder / "mlp.onnx")
    return folder


def _config(folder, accuracy="", precision="bf16"):
    (folder / "cuvil.yaml").write_text(f"""version: 1
output_dir: out
cache: {{dir: {TEST_CACHE}}}
models:
  - name: mlp
    source: mlp.onnx
    precision: {precision}
{accuracy}""")
    return str(folder / "cuvil.yaml")


def test_a_bf16_build_reports_its_accuracy(project, capsys):
    assert main(["build", "-f", _config(project)]) == 0
    out = capsys.readouterr().out
    assert "accuracy vs fp32 (8 random samples): cosine >= 0.99" in out and "top-1 agreement" in out
    folder = project / "out" / "mlp" / "native"
    report = json.loads((folder / "manifest.json").read_text())["accuracy"]
    (name, figures), = report["outputs"].items()
    assert report["samples"] == 8 and figures["cosine"] >= 0.999
    # the same figure against onnxruntime in float32
    lib = load(folder / "libmlp.so")
    feeds = sample_inputs(lib.info, 8)
    session = ort.InferenceSession(str(project / "mlp.onnx"), providers=["CPUExecutionProvider"])
    got = np.concatenate([lib.run(f)[name] for f in feeds])
    want = np.concatenate([session.run([name], f)[0] for f in feeds])
    assert abs(cosine(got, want) - figures["cosine"]) < 1e-6
    assert abs(float(np.max(np.abs(got - want))) - figures["max_abs_err"]) <= 1e-4 * float(np.max(np.abs(want)))
    assert main(["inspect", str(folder / "libmlp.so")]) == 0
    assert "accuracy vs fp32" in capsys.readouterr().out


def test_min_cosine_fails_the_build_and_installs_nothing(project, capsys):
    config = _config(project, "    accuracy: {min_cosine: 0.9999999999}", precision="fp16")
    assert main(["build", "-f", config]) == 2
    err = capsys.readouterr().err
    assert "cuvil.yaml:5: model 'mlp': output 'output' has a cosine similarity of" in err and "min_cosine" in err
    assert "Traceback" not in err
    assert not (project / "out" / "mlp" / "native" / "manifest.json").exists() or \
        json.loads((project / "out" / "mlp" / "native" / "manifest.json").read_text())["precision"] != "fp16"


def test_inputs_from_an_npz_file(project, capsys):
    x = np.random.default_rng(7).standard_normal((3, 4, 256)).astype(np.float32)
    np.savez(project / "samples.npz", x=x)
    assert main(["build", "-f", _config(project, "    accuracy: {samples: 5, inputs: samples.npz}")]) == 0
    assert "accuracy vs fp32 (3 samples.npz samples)" in capsys.readouterr().out


def test_a_float32_build_has_no_report(project, capsys):
    assert main(["build", "-f", _config(project, precision="fp32")]) == 0
    out = capsys.readouterr().out
    assert "accuracy vs" not in out and "fp32-reference" not in out
    assert "accuracy" not in json.loads((project / "out" / "mlp" / "native" / "manifest.json").read_text())


@pytest.mark.parametrize("accuracy, says", [({"samples": 0}, "samples: Input should be greater than or equal to 1"),
                                            ({"sample": 4}, "sample: Extra inputs are not permitted"),
                                            (3, "Input should be a valid dictionary")])
def test_compile_checks_accuracy_like_the_config(accuracy, says):
    """cuvil.compile(accuracy=...) takes what cuvil.yaml's accuracy: block takes; anything else is a
    CuvilError before building (samples=0 reached the report as an IndexError)."""
    import cuvil
    from cuvil.errors import CuvilError
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])]))
    with pytest.raises(CuvilError, match=says):
        cuvil.compile(model, precision="bf16", accuracy=accuracy)
