"""Nearest-neighbour upsampling by integer factors (Resize / Upsample), as a copy.

    Y[..., o_h, o_w] = X[..., o_h // s_h, o_w // s_w]

The general Resize kernel (resize.py) walks every output element through its build-time tables
and sums weighted taps in float64; a feature pyramid's x2 nearest upsample (YOLO necks, FPNs,
DBNet's x2..x8) only repeats each input element s_w times along the row and each input row
s_h times. `nearest_factors` recognises it from those same tables (every resized axis has one
tap of weight 1 at o // s, whatever coordinate transformation and rounding gave it), and
`lower_nearest` copies: a work item is one output row, which reads its input row once and
stores each element s_w times (a compile-time unrolled store per copy). Before a Concat at batch
> 1 it can write its batch blocks a Concat row apart (concat.py, kernel.with_strided_form).
"""
from __future__ import annotations

import numpy as np

from .elementwise import pointer_type
from .kernel import Kernel, KernelCall, Source, kernel_header, with_strided_form


def nearest_factors(in_shape, out_shape, resized, tables) -> list[int] | None:
    """The integer factor of every axis when the tables are those of a nearest upsample by
    integer factors (the one tap of weight 1 of output o, the others 0, reads o // s), else None."""
    factors = [1] * len(in_shape)
    for k, axis in enumerate(resized):
        n_in, n_out = in_shape[axis], out_shape[axis]
        if n_out % n_in or tables[2 * k].size % n_out:
            return None
        idx, weights = tables[2 * k].reshape(n_out, -1), tables[2 * k + 1].reshape(n_out, -1)
        ones = weights == 1.0
        if not (np.all(ones.sum(axis=1) == 1) and np.all(ones | (weights == 0.0))):
            return None
        s = n_out // n_in
        if not np.array_equal(idx[np.arange(n_out), ones.argmax(axis=1)], np.arange(n_out) // s):
            return None
        factors[axis] = s
    return factors


def lower_nearest(node, x, y, factors) -> KernelCall:
    call = KernelCall(*_nearest_kernel(node, x, y, factors), node.name)

    def strided(row):
        kernel, _, work = _nearest_kernel(node, x, y, factors, row)
        return kernel, work
    return with_strided_form(call, y, strided)


def _nearest_kernel(node, x, y, factors, batch_stride=None):
    """(kernel, args, work) of the upsample; with `batch_stride` it writes the output's batch
    blocks that many elements apart (in place into a Concat: concat.py)."""
    in_shape, out_shape = [int(d) for d in x.shape], [int(d) for d in y.shape]
    rank = len(in_shape)
    sw, IW, OW = factors[-1], in_shape[-1], out_shape[-1]
    rows = int(np.prod(out_shape[:-1], dtype=np.int64)) if rank > 1 else 1
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    # The input row of output row w: each leading output index divided by its factor.
    terms, below, in_stride = [], 1, IW
    for d in range(rank - 2, -1, -1):
        o = f"((w // {below}) % {out_shape[d]})" if below > 1 else f"(w % {out_shape[d]})"
        i = f"({o} // {factors[d]})" if factors[d] > 1 else o
        terms.append(f"{i} * {in_stride}")
        below *= out_shape[d]
        in_stride *= in_shape[d]
    src.line(f"xb = {' + '.join(terms) if terms else '0'}")
    if batch_stride is None:
        src.line(f"yb = w * {OW}")
    else:
        per_image = rows // out_shape[0]
        src.line(f"yb = (w // {per_image}) * {batch_stride} + (w % {per_image}) * {OW}")
    src.line(f"for i in range({IW}):").indent()
    src.line("v = p0[xb + i]")
    for r in range(sw):
        src.line(f"p1[yb + i * {sw} + {r}] = v")
    kernel = Kernel(node.op, src.text(), (pointer_type(x.dtype), pointer_type(y.dtype)))
    return kernel, [x.name, y.name], rows if y.size else 0
