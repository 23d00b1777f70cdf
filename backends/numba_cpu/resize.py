"""Resize (and Upsample): separable interpolation with build-time tables.

Interpolation is separable, so each resized axis gets two tables computed
here in float64 exactly as ONNX specifies (coordinate transformation, nearest
rounding, linear/cubic coefficients, antialias, exclude_outside, edge
clamping): for output position o, taps t < n, the input index idx[o, t] and
the weight w[o, t]. The kernel walks the output and sums, over the taps of
every resized axis, the product of their weights times the input element.
With tf_crop_and_resize, an output position whose source coordinate leaves
the input has idx[o, 0] = -1 and the output element is extrapolation_value.
Scales, sizes and roi must be constants (the tables depend on them).

GridSample (the sampling points come from a run-time grid, so its taps and
weights are computed in the kernel) and AffineGrid (the grid from a batch of
affine matrices) live here too.
"""
from __future__ import annotations

import math

import numpy as np

from cuvil.errors import UnsupportedOpError

from .elementwise import check_dtypes, compute_type, load, pointer_type, store, with_helpers
from .kernel import (Kernel, KernelCall, Lowered, Source, const_input, dims_strides, kernel_header, literal,
                     with_strided_form)
from .upsample import lower_nearest, nearest_factors


def _nearest(ratio, mode):
    if float(ratio).is_integer():
        return [0.0, 1.0]
    if mode == "round_prefer_floor":
        return [float(ratio <= 0.5), float(ratio > 0.5)]
    if mode == "round_prefer_ceil":
        return [float(ratio < 0.5), float(ratio >= 0.5)]
    if mode == "floor":
        return [1.0, 0.0]
    if mode == "ceil":
        return [0.0, 1.0]
    raise ValueError(mode)


def _cubic(ratio, a):
    r = ratio
    return [((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
            ((a + 2) * r - (a + 3)) * r * r + 1,
            ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
            ((a * ((1 - r) + 1) - 5 * a) * ((1 - r) + 1) + 8 * a) * ((1 - r) + 1) - 4 * a]


def _cubic_antialias(ratio, scale, a):
    scale = min(scale, 1.0)

    def coeff(x):
        x = abs(x)
        if x <= 1:
            return (a + 2) * x ** 3 - (a + 3) * x * x + 1
        if x < 2:
            return a * x ** 3 - 5 * a * x * x + 8 * a * x - 4 * a
        return 0.0
    start = int(np.floor(-2 / scale) + 1)
    c = [coeff(scale * (i - ratio)) for i in range(start, 2 - start)]
    return [v / sum(c) for v in c]


def _linear_antialias(ratio, scale):
    scale = min(scale, 1.0)
    start = int(np.floor(-1 / scale) + 1)
    args = (np.arange(start, start + 2 - 2 * start) - ratio) * scale
    c = np.clip(1 - np.abs(args), 0, 1)
    return list(c / c.sum())


def axis_tables(in_len, out_len, scale, mode, attrs, roi=None):
    """(idx, weights) of shape (out_len, taps) for one axis; idx[o, 0] = -1 marks extrapolation."""
    transform = attrs["coordinate_transformation_mode"]
    out_width = scale * in_len
    y = np.arange(out_len, dtype=np.float64)
    extrapolated = np.zeros(out_len, dtype=bool)
    if transform == "align_corners":
        x = np.zeros(out_len) if out_width == 1 else y * (in_len - 1) / (out_width - 1)
    elif transform == "asymmetric":
        x = y / scale
    elif transform == "tf_crop_and_resize":
        start, end = roi
        x = np.full(out_len, (end - start) * (in_len - 1) / 2) if out_width == 1 else \
            y * (end - start) * (in_len - 1) / (out_width - 1)
        x = x + start * (in_len - 1)
        extrapolated = (x < 0) | (x > in_len - 1)
    elif transform == "pytorch_half_pixel":
        x = np.full(out_len, -0.5) if out_width == 1 else (y + 0.5) / scale - 0.5
    elif transform == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif transform == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_width)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise ValueError(transform)
    floor = np.floor(x).astype(np.int64)
    ratios = np.where(x == floor, 1.0, x - floor)
    a = attrs["cubic_coeff_a"]
    if mode == "nearest":
        coeffs = [_nearest(r, attrs["nearest_mode"]) for r in ratios]
    elif mode == "linear":
        coeffs = [_linear_antialias(r, scale) if attrs["antialias"] else [1 - r, r] for r in ratios]
    else:
        coeffs = [_cubic_antialias(r, scale, a) if attrs["antialias"] else _cubic(r, a) for r in ratios]
    coeffs = np.asarray(coeffs, dtype=np.float64).reshape(out_len, -1)
    n = coeffs.shape[1]
    # the n neighbours of x nearest in edge-padded coordinates, ties to the left
    pad = int(np.ceil(n / 2))
    xp = x + pad
    p = np.floor(xp).astype(np.int64)
    frac = xp - p
    if n % 2 == 0:
        offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        base = -((n - 1) // 2)
        offset = np.where(frac <= 0.5, base, base + 1)
    idx = (p + offset)[:, None] + np.arange(n)[None, :] - pad
    if attrs["exclude_outside"]:
        coeffs = np.where((idx < 0) | (idx >= in_len), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    idx = np.clip(idx, 0, in_len - 1)
    # taps with zero weight (nearest's other neighbour) are dropped when no row needs them
    used = np.any(coeffs != 0, axis=0)
    if mode == "nearest" and used.sum() < n:
        keep = np.argsort(-np.abs(coeffs), axis=1, kind="stable")[:, :1]
        idx = np.take_along_axis(idx, keep, axis=1)
        coeffs = np.take_along_axis(coeffs, keep, axis=1)
    idx = idx.astype(np.int64)
    idx[extrapolated, 0] = -1
    return idx, coeffs


def _resize_params(node, graph, shape):
    """(per-axis scale, output size, roi (start, end)) of a Resize or Upsample node."""
    rank = len(shape)
    out_shape = [int(d) for d in graph.values[node.outputs[0]].shape]

    def const(pos):  # the interpolation tables are built from constant scales/sizes/roi
        data = const_input(node, graph, pos, f"input {pos} (roi, scales or sizes)")
        data = None if data is None else np.asarray(data, dtype=np.float64).reshape(-1)
        return data if data is not None and data.size else None

    if node.op == "Upsample" or graph.opset < 11:
        scales = const(1) if node.attr("scales") is None else np.asarray(node.attr("scales"), dtype=np.float64)
        roi, sizes = None, None
    else:
        roi, scales, sizes = const(1), const(2), const(3)
    axes = node.attr("axes")
    axes = list(range(rank)) if axes is None else [int(a) + rank if int(a) < 0 else int(a) for a in axes]
    full_scales = [1.0] * rank
    full_roi = [(0.0, 1.0)] * rank
    if roi is not None:
        k = len(roi) // 2
        for i, a in enumerate(axes[:k]):
            full_roi[a] = (float(roi[i]), float(roi[k + i]))
    if scales is not None:
        for i, a in enumerate(axes):
            full_scales[a] = float(scales[i])
    else:
        given = [float(s) for s in sizes]
        ratios = {a: given[i] / shape[a] for i, a in enumerate(axes)}
        policy = str(node.attr("keep_aspect_ratio_policy", "stretch"))
        if policy == "not_larger":
            ratios = {a: min(ratios.values()) for a in axes}
        elif policy == "not_smaller":
            ratios = {a: max(ratios.values()) for a in axes}
        for a in axes:
            full_scales[a] = ratios[a]
    return full_scales, out_shape, full_roi


def lower_resize(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y], float16=True)
    if np.dtype(x.dtype).kind not in "fiu":
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): dtype {np.dtype(x.dtype).name} is not supported")
    in_shape = [int(d) for d in x.shape]
    scales, out_shape, roi = _resize_params(node, graph, in_shape)
    mode = str(node.attr("mode", "nearest"))
    legacy = node.op == "Upsample" or graph.opset < 11
    attrs = {
        "coordinate_transformation_mode": "asymmetric" if legacy else
        str(node.attr("coordinate_transformation_mode", "half_pixel")),
        "nearest_mode": "floor" if legacy else str(node.attr("nearest_mode", "round_prefer_floor")),
        "cubic_coeff_a": float(node.attr("cubic_coeff_a", -0.75)),
        "exclude_outside": bool(node.attr("exclude_outside", 0)),
        "antialias": bool(node.attr("antialias", 0)),
    }
    if mode not in ("nearest", "linear", "cubic"):
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): mode '{mode}' is not supported")
    if legacy and mode == "linear":
        attrs["coordinate_transformation_mode"] = "asymmetric"
    extrapolation = float(node.attr("extrapolation_value", 0.0))
    rank = len(in_shape)
    resized, tables = [], []
    for a in range(rank):
        if math.isclose(scales[a], 1.0) and out_shape[a] == in_shape[a] and \
                math.isclose(roi[a][0], 0.0) and math.isclose(roi[a][1], 1.0):
            continue  # identity along this axis (as ONNX's reference skips it)
        idx, w = axis_tables(in_shape[a], out_shape[a], scales[a], mode, attrs, roi[a])
        resized.append(a)
        tables += [idx.reshape(-1), w.reshape(-1)]
    factors = nearest_factors(in_shape, [int(d) for d in y.shape], resized, tables) if mode == "nearest" else None
    if factors is not None and resized:
        return Lowered([lower_nearest(node, x, y, factors)])   # an integer-factor upsample: a copy (upsample.py)

    def build(out_strides):
        """The kernel writing output element (o0, o1, ...) at sum(o_d * out_strides[d])."""
        in_strides = dims_strides(in_shape)
        ct = compute_type(y.dtype)
        acc_t = "float64"
        n_args = 2 + len(tables)
        out_p = f"p{n_args - 1}"
        src = Source().line(kernel_header(n_args)).indent()
        # work item: one output row (all dims but the last)
        rows = int(np.prod(out_shape[:-1], dtype=np.int64)) if rank > 1 else 1
        src.line("for w in range(begin, end):").indent()
        below = 1
        for d in range(rank - 2, -1, -1):
            src.line(f"o{d} = (w // {below}) % {out_shape[d]}" if below > 1 else f"o{d} = w % {out_shape[d]}")
            below *= out_shape[d]
        last = rank - 1
        src.line(f"for o{last} in range({out_shape[last]}):").indent()
        taps = {a: len(tables[2 * k]) // out_shape[a] for k, a in enumerate(resized)}
        # extrapolated positions (tf_crop_and_resize)
        checks = [f"p{1 + 2 * k}[o{a} * {taps[a]}] < 0" for k, a in enumerate(resized)]
        dst = " + ".join(f"o{d} * {s}" if s != 1 else f"o{d}" for d, s in enumerate(out_strides))
        if attrs["coordinate_transformation_mode"] == "tf_crop_and_resize" and checks:
            src.line(f"if {' or '.join(checks)}:").indent()
            src.line(store(out_p, dst, literal(extrapolation, ct), y.dtype)).line("continue").dedent()
        src.line(f"acc = {literal(0, acc_t)}")
        depth = src.depth
        weight = []
        for k, a in enumerate(resized):
            src.line(f"for t{a} in range({taps[a]}):").indent()
            src.line(f"j{a} = p{1 + 2 * k}[o{a} * {taps[a]} + t{a}]")
            src.line(f"c{a} = p{2 + 2 * k}[o{a} * {taps[a]} + t{a}]")
            weight.append(f"c{a}")
        offset = " + ".join((f"j{d}" if d in resized else f"o{d}") + (f" * {s}" if s != 1 else "")
                            for d, s in enumerate(in_strides))
        value = f"np.float64({load('p0', offset, x.dtype)})"
        src.line(f"acc += {' * '.join(weight + [value])}")
        src.depth = depth
        if np.dtype(y.dtype).kind in "iu":
            info = np.iinfo(y.dtype)
            src.line("acc = np.float64(np.rint(acc))")
            src.line(f"acc = {float(info.min)!r} if acc < {float(info.min)!r} else ({float(info.max)!r} if acc > {float(info.max)!r} else acc)")
        src.line(store(out_p, dst, "acc", y.dtype))
        arg_types = [pointer_type(x.dtype)] + ["int64", "float64"] * len(resized) + [pointer_type(y.dtype)]
        kernel = Kernel(node.op, with_helpers(src.text()), tuple(arg_types))
        return kernel, rows if y.size else 0

    kernel, work = build(dims_strides(out_shape))
    call = KernelCall(kernel, [x.name] + tables + [y.name], work, node.name)
    # before a Concat at batch > 1: the output's batch blocks a Concat row apart (concat.py)
    return Lowered([with_strided_form(call, y, lambda row: build([row] + dims_strides(out_shape)[1:]))])


# -- GridSample -----------------------------------------------------------------------------------

_GRID_HELPERS = '''from numba import njit


@njit(inline="always")
def gs_reflect(x, lo, hi):
    rng = hi - lo
    if x < lo:
        dx = lo - x
        n = np.int64(dx / rng)
        r = dx - n * rng
        return lo + r if n % 2 == 0 else hi - r
    if x > hi:
        dx = x - hi
        n = np.int64(dx / rng)
        r = dx - n * rng
        return hi - r if n % 2 == 0 else lo + r
    return x


@njit(inline="always")
def gs_cubic(t, k):
    a = -0.75
    if k == 0:
        return ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a
    if k == 1:
        return ((a + 2) * t - (a + 3)) * t * t + 1
    if k == 2:
        return ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1
    return ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a


'''


def lower_grid_sample(node, graph) -> Lowered:
    """GridSample as ONNX's reference computes it: per output point the grid gives
    normalised coordinates (last spatial axis first); nearest / linear / cubic taps
    per axis, out-of-range taps read as zeros, the clamped border or the reflection."""
    x, grid, y = graph.values[node.inputs[0]], graph.values[node.inputs[1]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, grid, y], float16=True)
    mode = str(node.attr("mode", "linear" if graph.opset >= 20 else "bilinear"))
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    padding = str(node.attr("padding_mode", "zeros"))
    align = bool(node.attr("align_corners", 0))
    if mode not in ("nearest", "linear", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise UnsupportedOpError(f"node '{node.name}' (GridSample): mode '{mode}' / padding_mode '{padding}' is not supported")
    dims = [int(d) for d in x.shape[2:]]
    r = len(dims)
    n_batch, channels = int(x.shape[0]), int(x.shape[1])
    out_points = int(np.prod([int(d) for d in y.shape[2:]], dtype=np.int64))
    in_plane = int(np.prod(dims, dtype=np.int64))
    strides = dims_strides(dims)
    taps, offset = {"nearest": (1, 0), "linear": (2, 0), "cubic": (4, 1)}[mode]
    src = Source()
    src.line(kernel_header(3)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"n = w // {out_points}").line(f"o = w % {out_points}")
    src.line(f"g = w * {r}")
    for a, d in enumerate(dims):
        lo, hi = (0.0, d - 1.0) if align else (-0.5, d - 0.5)
        src.line(f"v = np.float64({load('p1', f'g + {r - 1 - a}', grid.dtype)})")
        # the reference keeps denormalised coordinates in float32
        src.line(f"x{a} = np.float64(np.float32((v + 1.0) / 2.0 * {d - 1}.0))" if align else
                 f"x{a} = np.float64(np.float32(((v + 1.0) * {d}.0 - 1.0) / 2.0))")
        if mode == "nearest":
            src.line(f"x{a} = np.rint(x{a})")
        if padding == "border":
            src.line(f"if x{a} < {lo!r} or x{a} > {hi!r}:").indent()
            src.line(f"x{a} = 0.0 if x{a} < 0.0 else ({d - 1}.0 if x{a} > {d - 1}.0 else x{a})").dedent()
        elif padding == "reflection":
            src.line(f"x{a} = gs_reflect(x{a}, {lo!r}, {hi!r})")
        src.line(f"f{a} = np.int64(math.floor(x{a}))")
        src.line(f"t{a} = x{a} - np.float64(f{a})")
    src.line(f"for c in range({channels}):").indent()
    src.line(f"base = (n * {channels} + c) * {in_plane}")
    src.line("acc = 0.0")
    depth = src.depth
    weights = []
    for a, d in enumerate(dims):
        lo, hi = (0.0, d - 1.0) if align else (-0.5, d - 0.5)
        src.line(f"for k{a} in range({taps}):").indent()
        src.line(f"i{a} = f{a} + k{a} - {offset}" if taps > 1 else f"i{a} = f{a}")
        if mode == "linear":
            src.line(f"c{a} = (1.0 - t{a}) if k{a} == 0 else t{a}")
        elif mode == "cubic":
            src.line(f"c{a} = gs_cubic(t{a}, k{a})")
        else:
            src.line(f"c{a} = 1.0")
        weights.append(f"c{a}")
        if padding == "zeros":
            src.line(f"inside{a} = i{a} >= 0 and i{a} < {d}")
            src.line(f"i{a} = 0 if i{a} < 0 else ({d - 1} if i{a} > {d - 1} else i{a})")
        elif padding == "border":
            src.line(f"i{a} = 0 if i{a} < 0 else ({d - 1} if i{a} > {d - 1} else i{a})")
        else:
            src.line(f"i{a} = np.int64(gs_reflect(np.float64(i{a}), {lo!r}, {hi!r}))")
            src.line(f"i{a} = 0 if i{a} < 0 else ({d - 1} if i{a} > {d - 1} else i{a})")
    offset_expr = " + ".join(f"i{a} * {s}" if s != 1 else f"i{a}" for a, s in enumerate(strides))
    value = f"np.float64({load('p0', f'base + {offset_expr}', x.dtype)})"
    if padding == "zeros":
        inside = " and ".join(f"inside{a}" for a in range(r))
        src.line(f"if {inside}:").indent()
    src.line(f"acc += {' * '.join(weights)} * {value}")
    src.depth = depth
    src.line(store("p2", f"(n * {channels} + c) * {out_points} + o", "acc", y.dtype))
    source = _GRID_HELPERS + with_helpers(src.text())
    kernel = Kernel("GridSample", source, (pointer_type(x.dtype), pointer_type(grid.dtype), pointer_type(y.dtype)))
    return Lowered([KernelCall(kernel, [x.name, grid.name, y.name], n_batch * out_points if y.size else 0, node.name)])


# -- AffineGrid -----------------------------------------------------------------------------------

def lower_affine_grid(node, graph) -> Lowered:
    """grid[n, ..., k] = sum_j theta[n, k, j] * base_j with base = (x, y[, z], 1), the
    normalised pixel centres (or corners, align_corners) of the output size."""
    theta, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [theta, y], float16=True)
    align = bool(node.attr("align_corners", 0))
    spatial = [int(d) for d in y.shape[1:-1]]
    r = len(spatial)
    points = int(np.prod(spatial, dtype=np.int64))
    strides = dims_strides(spatial)
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"n = w // {points}").line(f"q = w % {points}")
    # base coordinate of spatial axis a (x is the last axis)
    for a, size in enumerate(spatial):
        idx = f"((q // {strides[a]}) % {size})" if strides[a] > 1 else f"(q % {size})"
        if align:
            src.line(f"c{a} = -1.0 + np.float64({idx}) * {2.0 / (size - 1) if size > 1 else 0.0!r}")
        else:
            src.line(f"c{a} = -1.0 + (2.0 * np.float64({idx}) + 1.0) / {float(size)!r}")
    base = [f"c{a}" for a in reversed(range(r))] + ["1.0"]
    for k in range(r):
        row = f"(n * {r} + {k}) * {r + 1}"
        terms = " + ".join(f"np.float64({load('p0', f'{row} + {j}', theta.dtype)}) * {b}" for j, b in enumerate(base))
        src.line(store("p1", f"w * {r} + {k}", terms, y.dtype))
    kernel = Kernel("AffineGrid", with_helpers(src.text()), (pointer_type(theta.dtype), pointer_type(y.dtype)))
    return Lowered([KernelCall(kernel, [theta.name, y.name], int(y.shape[0]) * points if y.size else 0, node.name)])
