"""2-D MaxPool on 8-bit integers (the uint8/int8 activations of quantised models), separably.

    y[c, o, q] = max_{i, j} x[c, o*sh - ph + i, q*sw - pw + j]     (taps inside the input only)
               = max_j v[c, q*sw - pw + j],   v[c, w] = max_i x[c, o*sh - ph + i, w]

The maximum of integers is exact and order-free, so the window's maximum may be taken as the
maximum over its columns of each column's maximum over its rows. Per output row, the first pass
takes the kh input rows' element-wise maximum into a row `v` of W bytes (unit stride: 64 bytes a
vector), the second the kw taps of `v` per output (stride sw). A k x k window then costs k + k loads
an output instead of k * k (ResNet's 3x3 stride-2 pool over 64 x 112 x 112 in ResNet-18's
profile: 0.041-0.053 -> 0.035 ms; docs/performance.md). `v` is one row a plane in a scratch
value, so planes split over threads as before. Float inputs keep pool.py's per-tap form: which of two equal zeros (or a NaN) is kept depends
on the order of the taps there.
"""
from __future__ import annotations

import numpy as np

from .emit import NOALIAS_MARK
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, literal
from .scratch import scratch_value

DTYPES = ("uint8", "int8")


def applies(x, y, geometry) -> bool:
    """An 8-bit 2-D MaxPool without dilation (and without the Indices output: the caller's test)."""
    _, _, dilations, _, _ = geometry
    return (len(x.shape) == 4 and np.dtype(x.dtype).name in DTYPES and np.dtype(x.dtype) == np.dtype(y.dtype)
            and all(int(d) == 1 for d in dilations))


def _inside(k, s, p, size, n_out) -> tuple[int, int]:
    """Output positions [lo, hi) whose whole window lies inside the input along one axis."""
    inside = [o for o in range(n_out) if o * s - p >= 0 and o * s - p + k - 1 < size]
    return (inside[0], inside[-1] + 1) if inside else (0, 0)


def lower(node, graph, x, y, geometry) -> Lowered:
    (kh, kw), (sh, sw), _, (ph, pw), _ = geometry
    H, W = (int(d) for d in x.shape[2:])
    OH, OW = (int(d) for d in y.shape[2:])
    planes = int(x.shape[0] * x.shape[1])
    dtype = np.dtype(x.dtype)
    lowest = literal(np.iinfo(dtype).min, dtype)
    rows = scratch_value(graph, node, (planes * W,), dtype, tag="maxpool_rows")
    c_lo, c_hi = _inside(kw, sw, pw, W, OW)
    # p0 x, p1 the row maxima, p2 y: three arena buffers (no in-place form), so no overlap checks
    src = Source().line(NOALIAS_MARK).line(kernel_header(3)).indent()
    src.line("for c in range(begin, end):").indent()
    src.line(f"xb = c * {H * W}").line(f"vb = c * {W}").line(f"yb = c * {OH * OW}")
    src.line(f"for o in range({OH}):").indent()
    src.line(f"r0 = max(o * {sh} - {ph}, 0)").line(f"r1 = min(o * {sh} - {ph} + {kh}, {H})")
    src.line(f"yr = yb + o * {OW}")
    src.line("if r1 <= r0:").indent()          # a window of padding rows alone (pads >= kernel)
    src.line(f"for q in range({OW}):").indent().line(f"p2[yr + q] = {lowest}").dedent()
    src.line("continue").dedent()
    # pass 1: the rows' element-wise maximum (all kh rows unrolled where the window is inside)
    src.line(f"xr = xb + r0 * {W}")
    src.line(f"if r1 - r0 == {kh}:").indent()
    src.line(f"for w in range({W}):").indent()
    src.line("m = p0[xr + w]")
    for i in range(1, kh):
        src.line(f"v = p0[xr + {i * W} + w]").line("m = v if v > m else m")
    src.line("p1[vb + w] = m").dedent().dedent()
    src.line("else:").indent()
    src.line(f"for w in range({W}):").indent().line("p1[vb + w] = p0[xr + w]").dedent()
    src.line("for r in range(r0 + 1, r1):").indent()
    src.line(f"xr = xb + r * {W}")
    src.line(f"for w in range({W}):").indent()
    src.line("v = p0[xr + w]").line("m = p1[vb + w]").line("p1[vb + w] = v if v > m else m")
    src.dedent().dedent().dedent()
    # pass 2: the columns' maximum, kw taps unrolled where the window is inside
    if c_hi > c_lo:
        src.line(f"for q in range({c_lo}, {c_hi}):").indent()
        src.line(f"t = vb + q * {sw} - {pw}")
        src.line("m = p1[t]")
        for j in range(1, kw):
            src.line(f"v = p1[t + {j}]").line("m = v if v > m else m")
        src.line("p2[yr + q] = m").dedent()
    edges = [(0, c_lo), (c_hi, OW)] if c_hi > c_lo else [(0, OW)]
    for lo, hi in edges:
        if hi <= lo:
            continue
        src.line(f"for q in range({lo}, {hi}):").indent()
        src.line(f"t0 = max(q * {sw} - {pw}, 0)").line(f"t1 = min(q * {sw} - {pw} + {kw}, {W})")
        src.line(f"m = {lowest}")
        src.line("for t in range(t0, t1):").indent()
        src.line("v = p1[vb + t]").line("m = v if v > m else m").dedent()
        src.line("p2[yr + q] = m").dedent()
    kernel = Kernel("MaxPool", src.text(), (dtype.name, dtype.name, dtype.name))
    return Lowered([KernelCall(kernel, [x.name, rows, y.name], planes, node.name, n_outputs=2)])
