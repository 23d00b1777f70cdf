"""Pass tests: import a small ONNX model to CIR, run one pass, check the graph
it gives (Before / Expected) and that the outputs stay the same.

`run_pass` compares onnxruntime before and after the pass (for passes whose
result onnxruntime can run); `run_pass_compiled` compiles the model with that
one pass and compares the library with onnxruntime on the model before the
pass (for passes that make ops of the "cuvil" domain, which onnxruntime
cannot run).
The verifier runs on every graph.
"""
import io
import warnings

import numpy as np
import onnx

import cuvil
from cuvil.frontends.onnx import import_onnx
from cuvil.ir import to_onnx, verify
from passes import run_pass as run_pass_by_name
from tests.helpers import run_ort


def _close(got: dict, want: dict, tol):
    for name in want:
        scale = max(float(np.max(np.abs(want[name]))), 1e-6)
        err = float(np.max(np.abs(got[name].astype(np.float64) - want[name])))
        assert err / scale <= tol, f"{name}: max abs error {err:.3g} / max |ref| {scale:.3g} > {tol}"


def run_pass(pass_fn, model, feeds, tol=1e-5):
    before, _ = import_onnx(model)
    verify(before)
    after = pass_fn(before)
    verify(after)
    _close(run_ort(to_onnx(after), feeds), run_ort(to_onnx(before), feeds), tol)
    return before, after


def run_pass_compiled(name, model, feeds, tol=1e-5, **options):
    """Run pass `name` (with `options`), then compile the model with that pass alone and compare
    the library with onnxruntime on the model before the pass. Returns (before, after) graphs."""
    before, _ = import_onnx(model)
    verify(before)
    after = run_pass_by_name(name, before, options)
    verify(after)
    compiled = cuvil.compile(model, passes=[name], pass_options={name: options} if options else None)
    assert compiled.info["passes"] == [name]
    _close(compiled.run(feeds), run_ort(model, feeds), tol)
    return before, after


def ops(graph):
    return [n.op for n in graph.nodes]


def export_keeping_batchnorm(module, shapes: dict, opset: int = 17) -> onnx.ModelProto:
    """Export a torch module with its BatchNormalization nodes (torch's eval export folds them
    into Conv): export in training mode, then make each BatchNormalization an inference one."""
    import torch
    args = tuple(torch.zeros(s) for s in shapes.values())
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.train(), args, buf, dynamo=False, opset_version=opset, input_names=list(shapes),
                          output_names=["output"], training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    module.eval()
    model = onnx.load_model_from_string(buf.getvalue())
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            del node.output[1:]
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = 0
    return model


def model_from_text(text: str, **initializers) -> onnx.ModelProto:
    """A model in ONNX text syntax; `initializers` (numpy arrays) are added as constants."""
    from onnx import numpy_helper, parser
    model = parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items())
    model.ir_version = min(model.ir_version, 10)
    return model


def _fmt(value):
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def show(graph) -> list[str]:
    """Each node as `op(inputs) -> outputs {attrs}`: what Before / Expected tests compare."""
    lines = []
    for n in graph.nodes:
        op = f"{n.domain}.{n.op}" if n.domain else n.op
        attrs = ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(n.attrs.items()))
        lines.append(f"{op}({', '.join(n.inputs)}) -> {', '.join(n.outputs)}" + (f" {{{attrs}}}" if attrs else ""))
    return lines
