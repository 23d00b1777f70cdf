"""Cuvil: compile ONNX and TorchScript models ahead of time into standalone
shared libraries with a plain C ABI. This package owns the front and the top:
config, CIR and the op vocabulary, frontends, the pipeline and its cached build
steps, the runtime loader, the API and the CLI (passes/ and backends/ do the rest).

`cuvil.load` needs only numpy and ctypes; `cuvil.compile` imports the
compiler (onnx, numba, llvmlite) when first called.
"""
from .errors import CuvilError

__version__ = "0.1.0"


def compile(model, *, input_shapes=None, target="native", precision="fp32", threads=None, enable_fp16=False,
            **options):
    """Compile a model (path, onnx.ModelProto, or torch module) into a loaded CompiledModel.
    `precision`: "fp32", "bf16" or "fp16" (the weight products compute in it, with float32 sums;
    inputs and outputs stay float32); `enable_fp16=True` is precision="fp16"."""
    from .api import compile as _compile
    return _compile(model, input_shapes=input_shapes, target=target, precision=precision, threads=threads,
                    enable_fp16=enable_fp16, **options)


def load(path, prefix=None):
    """Open a library built by cuvil (needs neither numba nor onnx)."""
    from .runtime import load as _load
    return _load(path, prefix=prefix)


def scons_toolpath() -> str:
    """The folder to put in an SCons Environment's toolpath for `tools=["default", "cuvil"]`."""
    from pathlib import Path
    return str(Path(__file__).resolve().parents[1] / "site_scons" / "site_tools")


__all__ = ["CuvilError", "compile", "load", "scons_toolpath", "__version__"]
