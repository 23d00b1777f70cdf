"""RoiAlign (opsets 10-22): each region of interest pooled to output_height x output_width bins.

Per roi (x1, y1, x2, y2) times spatial_scale, minus 0.5 with coordinate_transformation_mode
half_pixel (opset 16's default; output_half_pixel: no shift, and the roi at least 1 x 1), each bin
is sampled on a grid of sampling_ratio (or ceil(roi size / bins)) points per axis at the grid
cells' centres. A sample is bilinear in the four neighbours (clamped to the map; a point more than
one pixel outside the map is 0), as onnxruntime and onnx's reference compute it. mode avg: the mean
of the samples; max: the maximum over samples of the largest of the four weighted neighbours
(onnxruntime's definition). Computed in float64; one work item per (roi, channel)."""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header


def _text(value, default):
    value = default if value is None else value
    return value.decode() if isinstance(value, bytes) else str(value)


def lower_roi_align(node, graph) -> Lowered:
    x, rois, index, y = (graph.values[n] for n in (*node.inputs[:3], node.outputs[0]))
    t = np.dtype(x.dtype).name
    if len(x.shape) != 4 or t not in ("float32", "float64"):
        raise UnsupportedOpError(f"node '{node.name}' (RoiAlign): the input must be a float NCHW tensor")
    mode = _text(node.attr("mode"), "avg")
    # opset 16 made half_pixel the default; opset 10 had no attribute and no shift
    default = "half_pixel" if graph.opset >= 16 else "output_half_pixel"
    half_pixel = _text(node.attr("coordinate_transformation_mode"), default) == "half_pixel"
    if mode not in ("avg", "max"):
        raise UnsupportedOpError(f"node '{node.name}' (RoiAlign): mode {mode!r} is not avg or max")
    channels, height, width = (int(d) for d in x.shape[1:])
    out_h, out_w = int(node.attr("output_height", 1)), int(node.attr("output_width", 1))
    ratio, scale = int(node.attr("sampling_ratio", 0)), float(node.attr("spatial_scale", 1.0))
    offset = 0.5 if half_pixel else 0.0
    src = Source().line(kernel_header(4)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"r = item // {channels}").line(f"c = item % {channels}")
    src.line(f"xb = (np.int64(p2[r]) * {channels} + c) * {height * width}")
    src.line(f"yb = item * {out_h * out_w}")
    for i, name in enumerate(("sw", "sh", "ew", "eh")):
        src.line(f"{name} = np.float64(p1[r * 4 + {i}]) * {scale!r} - {offset!r}")
    src.line("rw = ew - sw").line("rh = eh - sh")
    if not half_pixel:
        src.line("rw = max(rw, 1.0)").line("rh = max(rh, 1.0)")
    src.line(f"bh = rh / {out_h}").line(f"bw = rw / {out_w}")
    src.line(f"gh = {ratio}" if ratio > 0 else f"gh = np.int64(math.ceil(rh / {out_h}))")
    src.line(f"gw = {ratio}" if ratio > 0 else f"gw = np.int64(math.ceil(rw / {out_w}))")
    src.line("count = max(gh * gw, 1)")
    src.line(f"for ph in range({out_h}):").indent()
    src.line(f"for pw in range({out_w}):").indent()
    src.line("acc = 0.0").line("first = True")
    src.line("for iy in range(gh):").indent()
    src.line("yy = sh + ph * bh + (iy + 0.5) * bh / gh")
    src.line("for ix in range(gw):").indent()
    src.line("xx = sw + pw * bw + (ix + 0.5) * bw / gw")
    src.line(f"if yy < -1.0 or yy > {height} or xx < -1.0 or xx > {width}:").indent()
    src.line("v1 = v2 = v3 = v4 = 0.0").dedent()
    src.line("else:").indent()
    src.line("yc = max(yy, 0.0)").line("xc = max(xx, 0.0)")
    src.line("y0 = np.int64(yc)").line("x0 = np.int64(xc)")
    src.line(f"if y0 >= {height - 1}:").indent().line(f"y0 = {height - 1}").line("y1 = y0").line("yc = np.float64(y0)")
    src.dedent().line("else:").indent().line("y1 = y0 + 1").dedent()
    src.line(f"if x0 >= {width - 1}:").indent().line(f"x0 = {width - 1}").line("x1 = x0").line("xc = np.float64(x0)")
    src.dedent().line("else:").indent().line("x1 = x0 + 1").dedent()
    src.line("ly = yc - y0").line("lx = xc - x0").line("hy = 1.0 - ly").line("hx = 1.0 - lx")
    src.line(f"v1 = hy * hx * p0[xb + y0 * {width} + x0]")
    src.line(f"v2 = hy * lx * p0[xb + y0 * {width} + x1]")
    src.line(f"v3 = ly * hx * p0[xb + y1 * {width} + x0]")
    src.line(f"v4 = ly * lx * p0[xb + y1 * {width} + x1]").dedent()
    if mode == "avg":
        src.line("acc += v1 + v2 + v3 + v4")
    else:
        src.line("v = max(max(v1, v2), max(v3, v4))")
        src.line("acc = v if first else max(acc, v)").line("first = False")
    src.dedent().dedent()
    src.line(f"p3[yb + ph * {out_w} + pw] = np.{t}(acc / count)" if mode == "avg" else
             f"p3[yb + ph * {out_w} + pw] = np.{t}(acc)")
    kernel = Kernel("RoiAlign", src.text(), (t, np.dtype(rois.dtype).name, np.dtype(index.dtype).name, t))
    return Lowered([KernelCall(kernel, [x.name, rois.name, index.name, y.name], int(rois.shape[0]) * channels,
                               node.name)])
