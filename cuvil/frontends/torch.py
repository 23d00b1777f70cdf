"""PyTorch / TorchScript -> ONNX, so the ONNX frontend takes it from there.

The export runs torch's TorchScript-based ONNX exporter with the static input
shapes of the variant. Loading a TorchScript file runs code from it: only
compile TorchScript files you trust. Torch is an optional dependency
(`pip install cuvil[torch]`).
"""
from __future__ import annotations

import io
import warnings

from ..errors import CuvilError, ModelError

OPSET = 17


def _torch():
    try:
        import torch
    except ImportError:
        raise CuvilError("compiling a PyTorch model needs torch", hint="pip install 'cuvil[torch]' (torch==2.13.0)") from None
    return torch


def load_torchscript(path):
    torch = _torch()
    try:
        return torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:
        raise ModelError(f"{path}: cannot be loaded as TorchScript ({type(exc).__name__}: {exc})") from None


def to_onnx_proto(model, input_shapes: dict | None):
    """Export an nn.Module or ScriptModule (or a TorchScript file path) to an onnx.ModelProto."""
    import onnx
    torch = _torch()
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        model = load_torchscript(model)
    if not isinstance(model, torch.nn.Module):
        raise CuvilError(f"cannot compile an object of type {type(model).__name__}",
                         hint="pass an ONNX path or ModelProto, a TorchScript file, or a torch.nn.Module")
    if not input_shapes:
        raise CuvilError("a PyTorch model needs input_shapes={name: shape, ...} (in the order forward() takes them)")
    names = list(input_shapes)
    args = tuple(torch.zeros(tuple(shape), dtype=torch.float32) for shape in input_shapes.values())
    model = model.eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.no_grad():
                torch.onnx.export(model, args, buffer, dynamo=False, opset_version=OPSET, input_names=names,
                                  do_constant_folding=True)
        except Exception as exc:
            raise ModelError(f"exporting the PyTorch model to ONNX failed: {type(exc).__name__}: {exc}") from None
    return onnx.load_model_from_string(buffer.getvalue())
