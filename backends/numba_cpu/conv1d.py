"""1-D convolutions seen as 2-D ones with one row, so the 2-D GEMM kernels take them.

    Y[n, oc, o] = sum_{c, k} W[oc, c, k] * X[n, c, o*s - p + k*d]

is the 2-D conv of X as [N, C, 1, L] with W as [OC, C/g, 1, K], strides (1, s), dilations
(1, d), pads (0, p): the bytes are the same (NCHW with H = 1), so only the shapes the kernel
generators read change, never a buffer. A long kernel with a large stride (an STFT written as a
Conv1d: 1 input channel, kernel 256, stride 128) then runs on the phase images of convgemm.py
(phase j of the input is X[j], X[j + s], ...: the frames' columns, a strided gather of the
input) and the channels-in-lanes micro-kernel of convsmall.py, a GEMM over K = channels x taps
with no im2col buffer; a 1-D conv the direct kernel vectorises well stays 1-D (conv.py decides).
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Value


def as_2d(X, W, Y, kernel, strides, dilations, pads, res_strides):
    """The 2-D views (same names) of a 1-D conv's values and geometry: (X, W, Y, kernel, strides,
    dilations, pads, res_strides). W keeps its data, reshaped; the residual's row stride is that of
    a whole output row, so it reads as flat as it did."""
    def view(value, shape):
        data = None if value.data is None else np.asarray(value.data).reshape(shape)
        return Value(value.name, value.dtype, shape, data)
    N, C, L = X.shape
    OC, ICG, K = W.shape
    OL = Y.shape[2]
    if res_strides is not None:
        sn, sc, sl = res_strides
        res_strides = (sn, sc, sl * OL, sl)
    return (view(X, (N, C, 1, L)), view(W, (OC, ICG, 1, K)), view(Y, (Y.shape[0], OC, 1, OL)), [1] + list(kernel),
            [1] + list(strides), [1] + list(dilations), [0] + list(pads), res_strides)
