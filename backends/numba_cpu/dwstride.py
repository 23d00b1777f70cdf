"""Depthwise 2-D convolutions with stride 1 or 2: one micro-kernel call per output row (stride 2)
or pair of rows (stride 1).

The direct kernel's stride-2 loads do not vectorise, and the phase images the
implicit GEMM reads cost a copy of the input (most of the time of such a conv in
MobileNetV2). Here each output row of a channel is one call of a DwRowSpec
micro-kernel (backends/numba_cpu/ukernel.py), which reads the input rows in
place: wide loads, the taps' lanes picked by shuffles, bias and Relu/Clip in
registers. With stride 1 a call computes two output rows, and each input row
it loads feeds both (MobileNetV2's 3x3 depthwise convs at 112x112 to 14x14:
0.141 / 0.058 / 0.039 / 0.058 ms with the direct kernel's flat loop, 0.070 /
0.036 / 0.021 / 0.030 ms this way, `benchmarks/convs.py`, AMD Zen 4); rows
narrower than MIN_OUT_WIDTH_S1 keep the direct kernel, whose flat loop runs
over whole planes. Work items are (image, channel) planes.

Activations stored in 16 bits (bf16 / fp16, passes/assign_precision.py `narrow_activations`):
the rows are DwRow16Spec micro-kernels (ukernel_lowp.py), which widen x on load and round y
once on the store; the sums are float32 as above. Such a conv takes this kernel at every row
width (narrow stride-1 rows too): the alternative, float32 copies of x and y around the direct
kernel, costs more than the idle lanes.
"""
from __future__ import annotations

import numpy as np

from .ukernel import EPILOGUE_ACTIVATIONS, DwRowSpec
from .ukernel_lowp import DwRow16Spec, DwRowPairSpec, store_rounding

from .epilogue import Epilogue, register_activation
from .kernel import Kernel, KernelCall, Source, kernel_header, lowering_target
from .lowp import best_method
from .narrow import pointer_type

MAX_OUT_WIDTH = 128   # outputs per row (the row is unrolled in groups of vector lanes)
MAX_TAPS_PER_AXIS = 7
MIN_OUT_WIDTH_S1 = 9   # stride 1: narrower rows leave most lanes idle (the direct kernel's flat loop does not)


FORMATS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}   # a stored activation's format


def fmt(value) -> str:
    """The format ("f32", "bf16", "f16") a depthwise row reads or writes the tensor `value` in."""
    return FORMATS.get(np.dtype(value.dtype).name, "")


def eligible(dtype, X, W, B, group, kernel, strides, dilations, Y, epilogue: Epilogue) -> bool:
    C = X.shape[1]
    formats = (fmt(X), fmt(Y))
    sixteen = formats != ("f32", "f32")   # x and/or y stored in 16 bits
    return ("" not in formats and (sixteen or np.dtype(dtype) == np.float32)
            and len(X.shape) == 4 and W.is_const and group == C
            and (B is None or B.is_const)
            and W.shape[0] == C and W.shape[1] == 1 and list(strides) in ([2, 2], [1, 1]) and list(dilations) == [1, 1]
            and max(kernel) <= MAX_TAPS_PER_AXIS and 1 <= Y.shape[3] <= MAX_OUT_WIDTH
            and (strides[0] == 2 or Y.shape[3] >= MIN_OUT_WIDTH_S1 or sixteen)
            and epilogue.residual is None and epilogue.activation in EPILOGUE_ACTIVATIONS)


def packed_weights(W, B, C: int) -> np.ndarray:
    """Depthwise weights (C, 1, KH, KW) and bias (C or None) as DwRowSpec reads them: [C][taps, bias]."""
    w = np.asarray(W, dtype=np.float32).reshape(C, -1)
    packed = np.zeros((C, w.shape[1] + 1), dtype=np.float32)
    packed[:, :-1] = w
    if B is not None:
        packed[:, -1] = np.asarray(B, dtype=np.float32).reshape(C)
    return packed


class RowCalls:
    """The DwRowSpec micro-kernels of one depthwise conv and the calls computing its output rows
    [lo, hi) of one channel: row by row (stride 2), or in pairs and then the last one (stride 1).
    y_fmt "bf16pairs": y is one half of rows of bf16 channel pairs (DwRowPairSpec: output ow at
    16-bit element 2 ow of the row, rows 2 OW elements apart)."""

    def __init__(self, H, W, OW, KH, KW, p_t, p_l, stride, epilogue: Epilogue, x_fmt="f32", y_fmt="f32"):
        fields = dict(H=H, W=W, OW=OW, KH=KH, KW=KW, p_l=p_l, stride=stride, **register_activation(epilogue))
        spec = DwRowSpec
        self.y_step = 1   # y elements per output
        if y_fmt == "bf16pairs":
            fields.update(x_fmt=x_fmt, y_fmt="bf16", method=store_rounding("bf16", lowering_target()))
            spec, self.y_step = DwRowPairSpec, 2
        elif (x_fmt, y_fmt) != ("f32", "f32"):   # x and/or y stored in 16 bits (DwRow16Spec)
            sixteen = y_fmt if y_fmt != "f32" else x_fmt
            fields.update(x_fmt=x_fmt, y_fmt=y_fmt, method=best_method("f32", sixteen, lowering_target()))
            spec = DwRow16Spec
        self.row, self.pair = spec(**fields), spec(rows=2, **fields)
        self.p_t, self.s, self.OW = p_t, stride, OW

    def declare(self, src: Source) -> None:
        lines = self.row.declaration("dwrow").splitlines()
        if self.s == 1:
            lines += self.pair.declaration("dwrows2").splitlines()
        for line in lines:
            src.line(line)

    def emit(self, src: Source, x, xo, w, wo, y, yo, lo, hi) -> None:
        """Rows lo..hi (expressions) of the channel whose input plane starts at x[xo] (its row r at
        xo + r*W), weights at w[wo], output plane at y[yo]."""
        p_t, OW = self.p_t, self.OW * self.y_step
        if self.s == 1:   # pairs of rows (the input rows loaded feed both), then the last one
            src.line(f"for oh in range({lo}, {hi} - 1, 2):").indent()
            src.line(f"dwrows2({x}, {xo}, oh - {p_t}, {w}, {wo}, {y}, {yo} + oh * {OW})").dedent()
            src.line(f"if ({hi} - {lo}) % 2:").indent()
            src.line(f"dwrow({x}, {xo}, {hi} - 1 - {p_t}, {w}, {wo}, {y}, {yo} + ({hi} - 1) * {OW})").dedent()
        else:
            src.line(f"for oh in range({lo}, {hi}):").indent()
            src.line(f"dwrow({x}, {xo}, oh * {self.s} - {p_t}, {w}, {wo}, {y}, {yo} + oh * {OW})").dedent()


def lower_dw_rows(node, X, W, B, Y, kernel, strides, pads, epilogue: Epilogue) -> KernelCall:
    N, C, H, Wd = (int(v) for v in X.shape)
    OH, OW = (int(v) for v in Y.shape[2:])
    KH, KW = kernel
    p_t, p_l = pads[:2]
    rows = RowCalls(H, Wd, OW, KH, KW, p_t, p_l, int(strides[0]), epilogue, fmt(X), fmt(Y))
    packed = packed_weights(W.data, None if B is None else B.data, C)
    src = Source()
    rows.declare(src)
    src.line(kernel_header(3)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"c = item % {C}")
    src.line(f"xo = item * {H * Wd}").line(f"yo = item * {OH * OW}").line(f"wo = c * {KH * KW + 1}")
    rows.emit(src, "p0", "xo", "p1", "wo", "p2", "yo", 0, OH)
    kernel_obj = Kernel("Conv", src.text(), (pointer_type(X.dtype), "float32", pointer_type(Y.dtype)), self_sized=True)
    return KernelCall(kernel_obj, [X.name, packed, Y.name], N * C, node.name)
