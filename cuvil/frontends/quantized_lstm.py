"""onnxruntime's DynamicQuantizeLSTM (com.microsoft) as an LSTM with its weights dequantised.

`onnxruntime.quantization.quantize_dynamic` replaces every LSTM whose W and R are constants by
DynamicQuantizeLSTM: the ONNX LSTM's inputs and attributes, with W and R stored as int8 codes,
transposed (W: [directions, input_size, 4 * hidden], R: [directions, hidden, 4 * hidden]; the ONNX
LSTM's are [directions, 4 * hidden, input_size] and [directions, 4 * hidden, hidden]), and their
scales and zero points as four more inputs (8: W_scale, 9: W_zero_point, 10: R_scale,
11: R_zero_point), per direction ([directions]) or per gate row ([directions, 4 * hidden]):

    W[d, g, i] = (W_code[d, i, g] - W_zero_point[d(, g)]) * W_scale[d(, g)]       (likewise R)

Here the node becomes that ONNX LSTM, with W and R dequantised once at import (the codes are exact
in float32 and each product with the scale is one float32 rounding, u = 2^-24), computed by the
LSTM kernels. onnxruntime computes the same weights, but quantises its activations too: at each
product it rounds X (and each step's h) to uint8 with a scale of (max - min) / 255 over the whole
matrix, so it differs from the float LSTM by up to half a step per activation.

The file asks for 8-bit activations in the recurrence, so the LSTM is marked for the 16-bit
recurrence of `precision: bf16` (RECURRENCE_PRECISION; backends/numba_cpu/rnn.py, where its steps
split in unit halves; otherwise float32, and `cuvil explain` says which): h and R are rounded to
bfloat16 for the product h . R^T (relative error <= u = 2^-8 each, float32 sums), which halves the
bytes of R that bound a step. Per element of h that is of the order of uint8's error: uint8 rounds
with an absolute error up to (max(h) - min(h)) / 510, at least |h| / 510 since the range holds 0,
so about half of bf16's bound for the largest element of h and far more than it for the small
ones. The input projection and the cell's update stay float32. tests/test_quantized_lstm.py derives the bound
against onnxruntime on the same file from both engines' roundings.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..errors import UnsupportedOpError

OP = "DynamicQuantizeLSTM"
DOMAIN = "com.microsoft"
# The LSTM's own inputs (X, W, R, B, sequence_lens, initial_h, initial_c, P), then the quantisation's.
LSTM_INPUTS = 8
W_SCALE, W_ZERO, R_SCALE, R_ZERO = 8, 9, 10, 11
# The precision the LSTM's recurrence is marked with (passes/assign_precision.py's attribute).
RECURRENCE_PRECISION = "bf16"


def _dequantised(name: str, what: str, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """The float32 ONNX-layout weight [directions, 4 * hidden, columns] of codes [directions,
    columns, 4 * hidden] and their per-direction or per-row scale and zero point."""
    directions, _, rows = codes.shape
    if codes.dtype not in (np.int8, np.uint8):
        raise UnsupportedOpError(f"node '{name}' ({OP}): {what} holds {codes.dtype} codes; onnxruntime defines "
                                 "int8 and uint8")
    per = lambda a: np.asarray(a).reshape(directions, -1)[:, None, :]   # [directions, 1, 1 or 4 * hidden]
    scale, zero = per(scale).astype(np.float32), per(zero).astype(np.int32)
    if scale.shape[2] not in (1, rows) or zero.shape[2] not in (1, rows):
        raise UnsupportedOpError(f"node '{name}' ({OP}): {what}'s scale and zero point must have one value per "
                                 f"direction or per gate row ({rows}), not {scale.shape[2]} / {zero.shape[2]}")
    weights = (codes.astype(np.int32) - zero).astype(np.float32) * scale
    return np.ascontiguousarray(weights.transpose(0, 2, 1))


def lstm_node(proto: onnx.NodeProto, name: str, values, fresh, add_constant) -> onnx.NodeProto:
    """The ONNX LSTM that computes `proto` (a DynamicQuantizeLSTM), its dequantised W and R added as
    constants by `add_constant(fresh(tag), array)`."""
    inputs = list(proto.input) + [""] * (R_ZERO + 1 - len(proto.input))
    needed = {1: "W", 2: "R", W_SCALE: "W_scale", W_ZERO: "W_zero_point", R_SCALE: "R_scale", R_ZERO: "R_zero_point"}
    for pos, what in needed.items():
        if not inputs[pos] or not values[inputs[pos]].is_const:
            raise UnsupportedOpError(f"node '{name}' ({OP}): {what} must be a constant (an initializer)",
                                     hint="quantize_dynamic writes it as one; re-quantise the float model")
    data = lambda pos: np.asarray(values[inputs[pos]].data)
    weights = {}
    for pos, scale, zero, what in ((1, W_SCALE, W_ZERO, "W"), (2, R_SCALE, R_ZERO, "R")):
        if data(pos).ndim != 3:
            raise UnsupportedOpError(f"node '{name}' ({OP}): {what} must be 3-D, not {data(pos).shape}")
        weights[what] = fresh(f"{name}/{what}")
        add_constant(weights[what], _dequantised(name, what, data(pos), data(scale), data(zero)))
    lstm_inputs = [inputs[0], weights["W"], weights["R"], *inputs[3:LSTM_INPUTS]]
    while lstm_inputs and not lstm_inputs[-1]:
        lstm_inputs.pop()
    node = helper.make_node("LSTM", lstm_inputs, list(proto.output), name=name)
    node.attribute.extend(proto.attribute)
    return node
