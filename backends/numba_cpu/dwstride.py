"""Depthwise 2-D convolutions with stride 2: one micro-kernel call per output row.

The direct kernel's stride-2 loads do not vectorise, and the phase images the
implicit GEMM reads cost a copy of the input (most of the time of such a conv in
MobileNetV2). Here each output row of a channel is one call of a DwRowSpec
micro-kernel (backends/native/ukernel.py), which reads the input rows in
place: wide loads, the taps' lanes picked by shuffles, bias and Relu/Clip in
registers. Work items are (image, channel) planes.
"""
from __future__ import annotations

import numpy as np

from backends.native.ukernel import EPILOGUE_ACTIVATIONS, DwRowSpec

from .epilogue import Epilogue, register_activation
from .kernel import Kernel, KernelCall, Source, kernel_header

MAX_OUT_WIDTH = 128   # outputs per row (the row is unrolled in groups of vector lanes)
MAX_TAPS_PER_AXIS = 7


def eligible(dtype, X, W, B, group, kernel, strides, dilations, Y, epilogue: Epilogue) -> bool:
    C = X.shape[1]
    return (np.dtype(dtype) == np.float32 and len(X.shape) == 4 and W.is_const and group == C
            and (B is None or B.is_const)
            and W.shape[0] == C and W.shape[1] == 1 and list(strides) == [2, 2] and list(dilations) == [1, 1]
            and max(kernel) <= MAX_TAPS_PER_AXIS and 1 <= Y.shape[3] <= MAX_OUT_WIDTH
            and epilogue.residual is None and epilogue.activation in EPILOGUE_ACTIVATIONS)


def lower_dw_stride2(node, X, W, B, Y, kernel, pads, epilogue: Epilogue) -> KernelCall:
    N, C, H, Wd = (int(v) for v in X.shape)
    OH, OW = (int(v) for v in Y.shape[2:])
    KH, KW = kernel
    p_t, p_l = pads[:2]
    spec = DwRowSpec(H=H, W=Wd, OW=OW, KH=KH, KW=KW, p_l=p_l, **register_activation(epilogue))
    taps = KH * KW
    # Weights and bias per channel: [C][taps + 1].
    packed = np.zeros((C, taps + 1), dtype=np.float32)
    packed[:, :taps] = np.asarray(W.data, dtype=np.float32).reshape(C, taps)
    if B is not None:
        packed[:, taps] = np.asarray(B.data, dtype=np.float32).reshape(C)
    src = Source()
    for line in spec.declaration("row").splitlines():
        src.line(line)
    src.line(kernel_header(3)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"c = item % {C}")
    src.line(f"xo = item * {H * Wd}").line(f"yo = item * {OH * OW}").line(f"wo = c * {taps + 1}")
    src.line(f"for oh in range({OH}):").indent()
    src.line(f"row(p0, xo, oh * 2 - {p_t}, p1, wo, p2, yo + oh * {OW})")
    kernel_obj = Kernel("Conv", src.text(), ("float32", "float32", "float32"))
    return KernelCall(kernel_obj, [X.name, packed, Y.name], N * C, node.name)
