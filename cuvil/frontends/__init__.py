"""Frontends turn a model file into CIR. ONNX is the native format; TorchScript
and PyTorch modules are exported to ONNX first."""
