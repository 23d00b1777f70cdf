"""Whole models against onnxruntime: an MLP, a ResNet-18 and a MobileNetV2,
torch modules with seeded random weights exported to ONNX."""
import pytest

from tests import zoo
from tests.helpers import assert_matches_ort

torch = pytest.importorskip("torch")

TOL = 1e-4


def test_mlp():
    model = zoo.export(zoo.mlp(), {"x": (1, 256)})
    assert_matches_ort(model, {"x": zoo.sample_input((1, 256))}, tol=TOL)


def test_mlp_batch_and_threads():
    model = zoo.export(zoo.mlp(), {"x": (8, 256)})
    assert_matches_ort(model, {"x": zoo.sample_input((8, 256))}, tol=TOL, threads=2)


def test_resnet18_style():
    model = zoo.export(zoo.resnet((2, 2, 2, 2)), {"input": (1, 3, 64, 64)})
    assert_matches_ort(model, {"input": zoo.sample_input((1, 3, 64, 64))}, tol=TOL, jobs=2)


def test_mobilenet_v2_style():
    model = zoo.export(zoo.mobilenet_v2(), {"input": (1, 3, 64, 64)})
    assert_matches_ort(model, {"input": zoo.sample_input((1, 3, 64, 64))}, tol=TOL, jobs=2)


@pytest.mark.slow
def test_resnet50_style():
    model = zoo.export(zoo.resnet((3, 4, 6, 3), bottleneck=True), {"input": (1, 3, 224, 224)})
    assert_matches_ort(model, {"input": zoo.sample_input((1, 3, 224, 224))}, tol=TOL, jobs=2)
