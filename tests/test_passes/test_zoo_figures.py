"""What the passes must achieve on whole networks at batch 1, 224 x 224 (issue 5's done-when):
no BatchNormalization and no standalone activation kernel left, and an arena at most a quarter
of the naive sum of intermediates. Measured on the planned graph and schedule; nothing is
compiled (test_models.py compiles these networks and compares them with onnxruntime).

torch's exporter already folds BatchNormalization into Conv, so each network is also exported
with its BatchNormalization nodes kept, which fold_batchnorm must then fold."""
import pytest

from cuvil.explain import explain_model
from cuvil.ops import EPILOGUE_ACTIVATIONS
from tests import zoo
from tests.test_passes.common import export_keeping_batchnorm

torch = pytest.importorskip("torch")

ACTIVATIONS = set(EPILOGUE_ACTIVATIONS)
NETWORKS = {"resnet50": lambda: zoo.resnet((3, 4, 6, 3), bottleneck=True), "mobilenet_v2": zoo.mobilenet_v2}
SHAPES = {"input": (1, 3, 224, 224)}


@pytest.mark.parametrize("keep_bn", [False, True], ids=["torch_export", "with_batchnorm"])
@pytest.mark.parametrize("network", sorted(NETWORKS))
def test_no_batchnorm_no_standalone_activation_and_a_small_arena(network, keep_bn):
    module = NETWORKS[network]()
    model = export_keeping_batchnorm(module, SHAPES) if keep_bn else zoo.export(module, SHAPES)
    report = explain_model(model, opt_level=2, name=network)
    assert ("BatchNormalization" in report.op_counts_before) == keep_bn
    assert "BatchNormalization" not in report.op_counts_after
    standalone = [k.node for k in report.kernels if k.op in ACTIVATIONS or k.op == "Add"]
    assert standalone == []
    memory = report.memory
    assert memory["arena_bytes"] / memory["naive_bytes"] <= 0.25, memory
    if keep_bn:
        folded = next(p.summary for p in report.passes if p.name == "fold_batchnorm")
        assert folded == f"{report.op_counts_before['BatchNormalization']} BatchNormalization folded into Conv"
