"""DeformConv (opset 19, 2-D): a convolution whose taps are moved by learned offsets.

    y[n, o, i, j] = B[o] + sum over c in o's group, taps (a, b) of
                    W[o, c, a, b] * mask[n, g, a, b, i, j] * X[n, c](h, w),
    h = i stride_h - pad_top + a dilation_h + offset[n, g, a, b, 0, i, j]
    w = j stride_w - pad_left + b dilation_w + offset[n, g, a, b, 1, i, j]

with g = c's offset group (offset and mask channels in the order (g, a, b[, h|w])) and X(h, w)
bilinear in its four neighbours, each outside the map counting 0 (onnx's reference samples with
GridSample, align_corners, zero padding; onnxruntime the same). Computed in float64; one work
item per (n, o, output row)."""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header


def lower_deform_conv(node, graph) -> Lowered:
    names = list(node.inputs) + [""] * (5 - len(node.inputs))
    x, w, off, y = (graph.values[n] for n in (names[0], names[1], names[2], node.outputs[0]))
    bias = graph.values[names[3]] if names[3] else None
    mask = graph.values[names[4]] if names[4] else None
    t = np.dtype(x.dtype).name
    if len(x.shape) != 4 or t not in ("float32", "float64"):
        raise UnsupportedOpError(f"node '{node.name}' (DeformConv): only 2-D float convolutions are compiled",
                                 hint="the input must be a float32/float64 NCHW tensor")
    n, channels, height, width = (int(d) for d in x.shape)
    out_c, per_group, kh, kw = (int(d) for d in w.shape)
    out_h, out_w = (int(d) for d in y.shape[2:])
    group, offset_group = int(node.attr("group", 1)), int(node.attr("offset_group", 1))
    sh, sw = (int(v) for v in (node.attr("strides") or [1, 1]))
    dh, dw = (int(v) for v in (node.attr("dilations") or [1, 1]))
    pt, pl = (int(v) for v in (node.attr("pads") or [0, 0, 0, 0])[:2])
    if channels != per_group * group or out_c % group or channels % offset_group:
        raise UnsupportedOpError(f"node '{node.name}' (DeformConv): {channels} input channels, weights "
                                 f"{list(w.shape)}, group {group}, offset_group {offset_group} do not agree")
    taps, plane = kh * kw, out_h * out_w
    per_offset_group, out_per_group = channels // offset_group, out_c // group
    args, types = [x.name, w.name, off.name], [t, np.dtype(w.dtype).name, np.dtype(off.dtype).name]
    for extra in (bias, mask):
        if extra is not None:
            args.append(extra.name)
            types.append(np.dtype(extra.dtype).name)
    pb = f"p{args.index(bias.name)}" if bias is not None else None
    pm = f"p{args.index(mask.name)}" if mask is not None else None
    py = f"p{len(args)}"
    src = Source().line(kernel_header(len(args) + 1)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"i = item % {out_h}").line(f"o = (item // {out_h}) % {out_c}").line(f"b = item // {out_h * out_c}")
    src.line(f"g = o // {out_per_group}")
    src.line(f"for j in range({out_w}):").indent()
    src.line(f"acc = np.float64({pb}[o])" if pb else "acc = 0.0")
    src.line(f"for cl in range({per_group}):").indent()
    src.line(f"c = g * {per_group} + cl").line(f"og = c // {per_offset_group}")
    src.line(f"xb = (b * {channels} + c) * {height * width}")
    src.line(f"for a in range({kh}):").indent()
    src.line(f"for e in range({kw}):").indent()
    src.line(f"k = og * {taps} + a * {kw} + e")
    src.line(f"at = i * {out_w} + j")
    src.line(f"h = np.float64(i * {sh} - {pt} + a * {dh}) + np.float64(p2[(b * {2 * offset_group * taps} + 2 * k) * {plane} + at])")
    src.line(f"w = np.float64(j * {sw} - {pl} + e * {dw}) + np.float64(p2[(b * {2 * offset_group * taps} + 2 * k + 1) * {plane} + at])")
    src.line("h0 = np.int64(math.floor(h))").line("w0 = np.int64(math.floor(w))")
    src.line("lh = h - h0").line("lw = w - w0")
    src.line("v = 0.0")
    for dy, dx, weight in ((0, 0, "(1.0 - lh) * (1.0 - lw)"), (0, 1, "(1.0 - lh) * lw"),
                           (1, 0, "lh * (1.0 - lw)"), (1, 1, "lh * lw")):
        src.line(f"if 0 <= h0 + {dy} < {height} and 0 <= w0 + {dx} < {width}:").indent()
        src.line(f"v += {weight} * p0[xb + (h0 + {dy}) * {width} + w0 + {dx}]").dedent()
    if pm:
        src.line(f"v *= np.float64({pm}[(b * {offset_group * taps} + k) * {plane} + at])")
    src.line(f"acc += np.float64(p1[((o * {per_group} + cl) * {kh} + a) * {kw} + e]) * v")
    src.dedent().dedent().dedent()
    src.line(f"{py}[((b * {out_c} + o) * {out_h} + i) * {out_w} + j] = np.{t}(acc)")
    kernel = Kernel("DeformConv", src.text(), (*types, t))
    return Lowered([KernelCall(kernel, [*args, y.name], n * out_c * out_h, node.name)])

