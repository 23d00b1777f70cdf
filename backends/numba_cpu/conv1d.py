"""1-D convolutions seen as 2-D ones with one row, so the 2-D GEMM kernels take them.

    Y[n, oc, o] = sum_{c, k} W[oc, c, k] * X[n, c, o*s - p + k*d]

is the 2-D conv of X as [N, C, 1, L] with W as [OC, C/g, 1, K], strides (1, s), dilations
(1, d), pads (0, p): the bytes are the same (NCHW with H = 1), so only the shapes the kernel
generators read change, never a buffer. A long kernel with a large stride (an STFT written as a
Conv1d: 1 input channel, kernel 256, stride 128) then runs on the phase images of convgemm.py
(phase j of the input is X[j], X[j + s], ...: the frames' columns, a strided gather of the
input) and the channels-in-lanes micro-kernel of convsmall.py, a GEMM over K = channels x taps
with no im2col buffer; a 1-D conv the direct kernel vectorises well stays 1-D (conv.py decides).
At batch 1 on several threads, a 1-D conv's few column tiles split unevenly: each thread then
takes its own rows of all of them (thread_split).
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Value

from .gemm import IMBALANCE_OK, slowest_share


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


# Column blocks per thread of a row-block split (see thread_split): enough for a thread done early
# to take some of another's work, few enough that each block's weights are read a few times only.
BLOCKS_PER_THREAD = 3


def thread_split(threads: int, images: int, widths: list[int], n_panels: int,
                 split: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """Work items (column blocks, tiles per block, row blocks, panels per block) of a conv GEMM
    on one output row (a 1-D conv as convgemm.py computes it) that `threads` threads finish
    together, or None to keep `split` (gemm.split_work's, items numbered row block first).
    `widths`: each column tile's computed width (the last one's micro-kernel is narrower).

    A 1-D conv's output row is a few column tiles (wav2vec2's 799 outputs: 16 tiles of 48 and
    one of 32; 399: 8 and one of 16) and its channels many row panels (256 = 32 panels of 8).
    gemm.split_work cuts the columns first: 17 tiles in 6 blocks of 3 tiles (the last 2, one of
    them 2/3 wide) x 2 row blocks, 12 items; the first thread's 6 items are 9 tiles, the
    other's 7.7, and the second thread waits ~8 % of the step. Here each thread takes its own
    rows instead (n_panels / threads panels: equal work, every tile of the row), cut in
    BLOCKS_PER_THREAD column blocks; the items are numbered column block first (convgemm's
    `rows_outer` decode), so the pool's contiguous share of a thread is one row block. Each
    thread reads all of B (the phase images) once and only its rows of the weights, against
    every column block's read of half the weights before.

    Only for one image and group (several images give each thread whole images), panels that
    split evenly, and where `split` leaves a thread waiting (IMBALANCE_OK: Whisper's 500 and 250
    outputs on 12 x 32 tiles split evenly and keep theirs). Results do not depend on the split
    (blocks group whole tiles)."""
    n_tiles = len(widths)
    if threads < 2 or images != 1 or n_panels % threads or n_tiles < 2:
        return None
    n_blocks, tpb, m_blocks, mpb = split
    sizes = [sum(widths[nb * tpb:(nb + 1) * tpb]) * min(mpb, n_panels - mb * mpb)
             for nb in range(n_blocks) for mb in range(m_blocks)]
    if slowest_share(sizes, threads) <= IMBALANCE_OK:
        return None
    n_blocks = min(n_tiles, BLOCKS_PER_THREAD)
    tpb = -(-n_tiles // n_blocks)
    return -(-n_tiles // tpb), tpb, threads, n_panels // threads
