"""Build-time evaluation of a node whose inputs are all constants, shared by the ONNX
frontend's folding and passes/fold_constants.py.

ONNX's reference evaluator computes most ops. QuantizeLinear and DequantizeLinear on
integer data are computed here instead, for two reasons: onnx's reference evaluator
implements them only from opset 19 (a model that onnxruntime's `quantize_static` writes at
opset 17 failed to build with "No implementation for operator 'DequantizeLinear' domain ''
and version 17"), and a folded weight must be the value onnxruntime computes at run time:

    DequantizeLinear  x = float32(q - zero_point) * scale           integer difference, one rounding
    QuantizeLinear    q = saturate(rint(x / scale) + zero_point)    x / scale in float32, ties to even

with the scale and zero point per tensor or per `axis` (1-D, along that axis). Other forms
(blocked scales, float8/int4 data, float16 scales) go to the reference evaluator.

GatherElements is computed here too: the reference evaluator's version (onnx 1.23) gathers
with `np.choose`, which takes at most 64 choices, and its fallback for longer axes reads one
element per row and then fails to reshape it ("cannot reshape array of size 1 into shape
(1,64)"). transformers' BertModel gathers its `token_type_ids` buffer (512 long) this way,
so a BERT export did not build. Here it is one fancy index:

    out[i_0, ..., i_r] = data[i_0, ..., indices[i_0, ..., i_r] (at axis), ..., i_r]
"""
from __future__ import annotations

import numpy as np

_QUANTISED = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535)}
_DEQUANTISABLE = set(_QUANTISED) | {"int32"}


def _along_axis(param: np.ndarray, rank: int, axis: int) -> np.ndarray | None:
    """A per-tensor or per-axis parameter shaped to broadcast against a rank-`rank` tensor; None
    for a shape this form does not cover (blocked)."""
    if param.size == 1 and param.ndim <= 1:
        return param.reshape(())
    if param.ndim != 1 or rank == 0:
        return None
    shape = [1] * rank
    shape[axis % rank] = param.size
    return param.reshape(shape)


def _params(inputs, attrs, rank):
    """(scale, zero point or None), each broadcastable to the data, or None when not covered here."""
    scale = np.asarray(inputs[1])
    zero = np.asarray(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else None
    if scale.dtype != np.float32 or attrs.get("block_size", 0):
        return None
    axis = int(attrs.get("axis", 1))
    s = _along_axis(scale, rank, axis)
    z = _along_axis(zero, rank, axis) if zero is not None else None
    if s is None or (zero is not None and (z is None or zero.size != scale.size)):
        return None
    return s, z


def dequantize_linear(inputs, attrs) -> np.ndarray | None:
    q = np.asarray(inputs[0])
    if q.dtype.name not in _DEQUANTISABLE:
        return None
    params = _params(inputs, attrs, q.ndim)
    if params is None:
        return None
    scale, zero = params
    diff = q.astype(np.int64) - (zero.astype(np.int64) if zero is not None else 0)
    return (diff.astype(np.float32) * scale).astype(np.float32)


def quantize_linear(inputs, attrs) -> np.ndarray | None:
    x = np.asarray(inputs[0])
    zero = np.asarray(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else np.zeros((), np.uint8)
    if zero.dtype.name not in _QUANTISED or x.dtype.name not in ("float32", "int32") or attrs.get("output_dtype"):
        return None
    params = _params(inputs, attrs, x.ndim)
    if params is None:
        return None
    scale, z = params
    lo, hi = _QUANTISED[zero.dtype.name]
    quotient = (x.astype(np.float32) / scale).astype(np.float32)
    q = np.rint(quotient).astype(np.float64) + (z.astype(np.float64) if z is not None else 0.0)
    return np.clip(q, lo, hi).astype(zero.dtype)


def gather_elements(inputs, attrs) -> np.ndarray | None:
    data, indices = np.asarray(inputs[0]), np.asarray(inputs[1])
    rank = data.ndim
    axis = int(attrs.get("axis", 0))
    if rank == 0 or indices.ndim != rank or not -rank <= axis < rank or indices.dtype.kind not in "iu":
        return None  # malformed: the reference evaluator reports it
    axis %= rank
    if any(i > d for k, (i, d) in enumerate(zip(indices.shape, data.shape)) if k != axis):
        return None
    size = data.shape[axis]
    indices = indices.astype(np.int64)
    if indices.size and (indices.min() < -size or indices.max() >= size):
        bad = int(indices[(indices < -size) | (indices >= size)].flat[0])
        raise IndexError(f"index {bad} is outside [-{size}, {size}), the size of axis {axis} of the data")
    grid = list(np.indices(indices.shape, sparse=True))
    grid[axis] = np.where(indices < 0, indices + size, indices)
    return data[tuple(grid)]


_EXACT = {"DequantizeLinear": dequantize_linear, "QuantizeLinear": quantize_linear,
          "GatherElements": gather_elements}


def evaluate_exact(op: str, domain: str, inputs: list, attrs: dict) -> list[np.ndarray] | None:
    """The outputs of a node computed here (see the module docstring), or None when the
    reference evaluator should compute it. `inputs` are arrays (None for an omitted input)."""
    generate = _EXACT.get(op) if domain in ("", "ai.onnx") else None
    if generate is None:
        return None
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = generate(inputs, attrs)
    return None if out is None else [out]
