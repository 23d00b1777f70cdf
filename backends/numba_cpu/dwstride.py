"""Depthwise 2-D convolutions with stride 1 or 2: one micro-kernel call per output row (stride 2)
or pair of rows (stride 1).

The direct kernel's stride-2 loads do not vectorise, and the phase images the
implicit GEMM reads cost a copy of the input (most of the time of such a conv in
MobileNetV2). Here each output row of a channel is one call of a DwRowSpec
micro-kernel (backends/native/ukernel.py), which reads the input rows in
place: wide loads, the taps' lanes picked by shuffles, bias and Relu/Clip in
registers. With stride 1 a call computes two output rows, and each input row
it loads feeds both (MobileNetV2's 3x3 depthwise convs at 112x112 to 14x14:
0.141 / 0.058 / 0.039 / 0.058 ms with the direct kernel's flat loop, 0.070 /
0.036 / 0.021 / 0.030 ms this way, `benchmarks/convs.py`, AMD Zen 4); rows
narrower than MIN_OUT_WIDTH_S1 keep the direct kernel, whose flat loop runs
over whole planes. Work items are (image, channel) planes.
"""
from __future__ import annotations

import numpy as np

from backends.native.ukernel import EPILOGUE_ACTIVATIONS, DwRowSpec

from .epilogue import Epilogue, register_activation
from .kernel import Kernel, KernelCall, Source, kernel_header

MAX_OUT_WIDTH = 128   # outputs per row (the row is unrolled in groups of vector lanes)
MAX_TAPS_PER_AXIS = 7
MIN_OUT_WIDTH_S1 = 9   # stride 1: narrower rows leave most lanes idle (the direct kernel's flat loop does not)


def eligible(dtype, X, W, B, group, kernel, strides, dilations, Y, epilogue: Epilogue) -> bool:
    C = X.shape[1]
    return (np.dtype(dtype) == np.float32 and len(X.shape) == 4 and W.is_const and group == C
            and (B is None or B.is_const)
            and W.shape[0] == C and W.shape[1] == 1 and list(strides) in ([2, 2], [1, 1]) and list(dilations) == [1, 1]
            and max(kernel) <= MAX_TAPS_PER_AXIS and 1 <= Y.shape[3] <= MAX_OUT_WIDTH
            and (strides[0] == 2 or Y.shape[3] >= MIN_OUT_WIDTH_S1)
            and epilogue.residual is None and epilogue.activation in EPILOGUE_ACTIVATIONS)


def lower_dw_rows(node, X, W, B, Y, kernel, strides, pads, epilogue: Epilogue) -> KernelCall:
    N, C, H, Wd = (int(v) for v in X.shape)
    OH, OW = (int(v) for v in Y.shape[2:])
    KH, KW = kernel
    p_t, p_l = pads[:2]
    s = int(strides[0])
    spec = DwRowSpec(H=H, W=Wd, OW=OW, KH=KH, KW=KW, p_l=p_l, stride=s, **register_activation(epilogue))
    pair = DwRowSpec(H=H, W=Wd, OW=OW, KH=KH, KW=KW, p_l=p_l, stride=s, rows=2, **register_activation(epilogue))
    taps = KH * KW
    # Weights and bias per channel: [C][taps + 1].
    packed = np.zeros((C, taps + 1), dtype=np.float32)
    packed[:, :taps] = np.asarray(W.data, dtype=np.float32).reshape(C, taps)
    if B is not None:
        packed[:, taps] = np.asarray(B.data, dtype=np.float32).reshape(C)
    src = Source()
    for line in spec.declaration("row").splitlines() + (pair.declaration("rows2").splitlines() if s == 1 else []):
        src.line(line)
    src.line(kernel_header(3)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"c = item % {C}")
    src.line(f"xo = item * {H * Wd}").line(f"yo = item * {OH * OW}").line(f"wo = c * {taps + 1}")
    if s == 1:   # pairs of rows, then the last one
        src.line(f"for oh in range(0, {OH - OH % 2}, 2):").indent()
        src.line(f"rows2(p0, xo, oh - {p_t}, p1, wo, p2, yo + oh * {OW})").dedent()
        if OH % 2:
            src.line(f"row(p0, xo, {OH - 1 - p_t}, p1, wo, p2, yo + {(OH - 1) * OW})")
    else:
        src.line(f"for oh in range({OH}):").indent()
        src.line(f"row(p0, xo, oh * {s} - {p_t}, p1, wo, p2, yo + oh * {OW})")
    kernel_obj = Kernel("Conv", src.text(), ("float32", "float32", "float32"))
    return KernelCall(kernel_obj, [X.name, packed, Y.name], N * C, node.name)
