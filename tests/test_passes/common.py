"""Pass tests: import a small ONNX model to CIR, run one pass, check the graph
it gives (Before / Expected) and that onnxruntime computes the same outputs
before and after."""
import numpy as np

from cuvil.frontends.onnx import import_onnx
from cuvil.ir import to_onnx, verify
from tests.helpers import run_ort


def run_pass(pass_fn, model, feeds, tol=1e-5):
    before, _ = import_onnx(model)
    verify(before)
    after = pass_fn(before)
    verify(after)
    want = run_ort(to_onnx(before), feeds)
    got = run_ort(to_onnx(after), feeds)
    for name in want:
        scale = max(float(np.max(np.abs(want[name]))), 1e-6)
        assert float(np.max(np.abs(got[name] - want[name]))) / scale <= tol, name
    return before, after


def ops(graph):
    return [n.op for n in graph.nodes]
