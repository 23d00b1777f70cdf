"""MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool over N x C x D1 x ... x Dk.

The work range runs over the N*C planes. Within a plane the output is built
in place: for every kernel tap, the taps of a whole output row are combined
in one loop over the output's last dim (unit stride in the output, stride
`strides[-1]` in the input), with that loop's bounds cut to the taps that
fall inside the input, so no padding test runs in the inner loop. A 2-D
MaxPool first takes the outputs whose whole window lies inside the input in
one loop over all k x k taps (one store per output, not a read-modify-write
per tap: ResNet's 3x3 stride-2 pool over 64 x 112 x 112 went from 0.247 to
0.135 ms); the per-tap loops then do only the border. An 8-bit 2-D MaxPool
(quantised models) runs separably instead: maxpool8.py.

Window of output position o along one axis: input positions
o*stride - pad_begin + j*dilation for j in [0, kernel), those in [0, size).
MaxPool ignores padding (like onnxruntime it starts from the dtype's lowest
value); AveragePool divides by the count of taps inside the input, or with
count_include_pad by the count inside the padded input: a per-output divisor
packed at build time as its reciprocal.
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from . import maxpool8
from .elementwise import check_dtypes, pointer_type
from .narrow import compute_type, load, store, store_exact, with_helpers
from .kernel import Kernel, KernelCall, Lowered, Source, dims_strides, kernel_header, literal


def _affine(terms, const=0) -> str:
    """Source of `a*s + b*t + c` with unit factors and zero terms simplified."""
    text = ""
    for var, factor in [*[(v, f) for v, f in terms if f != 0], *([("", const)] if const or not terms else [])]:
        magnitude = abs(factor)
        term = (str(magnitude) if not var else var if magnitude == 1 else f"{var} * {magnitude}")
        if not text:
            text = term if factor >= 0 else f"-{term}"
        else:
            text += f" + {term}" if factor >= 0 else f" - {term}"
    return text or "0"


def pool_geometry(node, in_spatial, out_spatial):
    """kernel, strides, dilations, pads at the begin and at the end of every spatial axis.

    The output shape comes from the graph (ONNX shape inference applied
    ceil_mode already); with auto_pad SAME_* the pads are derived from it as
    the ONNX spec does: total = (out-1)*stride + (kernel-1)*dilation + 1 - in."""
    rank = len(in_spatial)
    kernel = [int(k) for k in node.attr("kernel_shape")]
    strides = [int(s) for s in (node.attr("strides") or [1] * rank)]
    dilations = [int(d) for d in (node.attr("dilations") or [1] * rank)]
    pads = [int(p) for p in (node.attr("pads") or [0] * (2 * rank))]
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    begin, end = pads[:rank], pads[rank:]
    if auto_pad == "VALID":
        begin, end = [0] * rank, [0] * rank
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, out, k, s, d in zip(in_spatial, out_spatial, kernel, strides, dilations):
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            head = total // 2 if auto_pad == "SAME_UPPER" else (total + 1) // 2
            begin.append(head)
            end.append(total - head)
    elif auto_pad != "NOTSET":
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): unknown auto_pad '{auto_pad}'")
    return kernel, strides, dilations, begin, end


def _taps(out, size, k, s, d, pad_begin, pad_end, include_pad):
    """How many taps of output position `out`'s window count for its average."""
    lo, hi = (-pad_begin, size + pad_end) if include_pad else (0, size)
    return sum(1 for j in range(k) if lo <= out * s - pad_begin + j * d < hi)


def _window_kernel(op, x, y, geometry) -> Kernel:
    kernel, strides, dilations, pad_begin, _ = geometry
    in_spatial, out_spatial = list(x.shape[2:]), list(y.shape[2:])
    rank = len(in_spatial)
    in_plane, out_plane = int(np.prod(in_spatial)), int(np.prod(out_spatial))
    x_strides, y_strides = dims_strides(in_spatial), dims_strides(out_spatial)
    is_max = op == "MaxPool"
    dtype = compute_type(y.dtype)   # a 16-bit MaxPool (bf16 / fp16 activations) compares in float32
    y_ptr = "p1" if is_max else "p2"
    X = lambda index: load("p0", index, x.dtype)
    Y = lambda index: load(y_ptr, index, y.dtype)
    # the maximum of 16-bit inputs is one of them: stored without rounding
    put = lambda index, value: (store_exact if is_max and x.dtype == y.dtype else store)(y_ptr, index, value, y.dtype)
    if is_max:
        lowest = np.finfo(dtype).min if dtype.kind == "f" else np.iinfo(dtype).min
        init = literal(lowest, dtype)
    else:
        init = literal(0, dtype)

    src = Source().line(kernel_header(2 if is_max else 3)).indent()
    src.line("for c in range(begin, end):").indent()
    plane_depth = src.depth
    src.line(f"xb = c * {in_plane}")
    src.line(f"yb = c * {out_plane}")
    src.line(f"for i in range({out_plane}):").indent().line(put("yb + i", init)).dedent()
    x_terms, y_terms = [("xb", 1)], [("yb", 1)]
    fused = None
    for axis in range(rank - 1):
        o, t, h = f"o{axis}", f"k{axis}", f"h{axis}"
        src.line(f"for {o} in range({out_spatial[axis]}):").indent()
        if axis == 0:
            fused = _fused_max_rows(src, x, y, geometry, init, X, put) if is_max and rank == 2 and min(dilations) == 1 else None
        src.line(f"for {t} in range({kernel[axis]}):").indent()
        src.line(f"{h} = {_affine([(o, strides[axis]), (t, dilations[axis])], -pad_begin[axis])}")
        last_tap = (out_spatial[axis] - 1) * strides[axis] + (kernel[axis] - 1) * dilations[axis] - pad_begin[axis]
        if pad_begin[axis] > 0 or last_tap >= in_spatial[axis]:  # some tap may fall outside the input
            src.line(f"if {h} >= 0 and {h} < {in_spatial[axis]}:").indent()
        x_terms.append((h, x_strides[axis]))
        y_terms.append((o, y_strides[axis]))
    # The last axis: for each tap, the output positions whose tap is inside the input.
    size, n_out = in_spatial[-1], out_spatial[-1]
    k, s, d, p = kernel[-1], strides[-1], dilations[-1], pad_begin[-1]
    src.line(f"xr = {_affine(x_terms)}")
    src.line(f"yr = {_affine(y_terms)}")
    src.line(f"for t in range({k}):").indent()
    # first o with o*s + t*d - p >= 0, and one past the last with it < size
    if s == 1:
        src.line(f"lo = max(0, {_affine([('t', -d)], p)})")
    else:
        src.line(f"lo = max(0, -(({_affine([('t', d)], -p)}) // {s}))")
    if s == 1:
        src.line(f"hi = min({n_out}, {_affine([('t', -d)], size + p)})")
    else:
        src.line(f"hi = min({n_out}, ({_affine([('t', -d)], size - 1 + p)}) // {s} + 1)")
    src.line(f"xt = xr + {_affine([('t', d)], -p)}")
    if fused is not None:
        # Rows whose window is inside the input were done by the fused loop, but for the edge columns.
        (r_lo, r_hi), (c_lo, c_hi) = fused
        src.line(f"if o0 >= {r_lo} and o0 < {r_hi}:").indent()
        for edge in (f"lo, min(hi, {c_lo})", f"max(lo, {c_hi}), hi"):
            src.line(f"for o in range({edge}):").indent()
            src.line("v = " + X("xt + " + _affine([("o", s)]))).line(f"w = {Y('yr + o')}")
            src.line(put("yr + o", "v if v > w else w")).dedent()
        src.line("continue").dedent()
    src.line("for o in range(lo, hi):").indent()
    src.line("v = " + X("xt + " + _affine([("o", s)])))
    if is_max:
        src.line(f"w = {Y('yr + o')}")
        src.line(put("yr + o", "v if v > w else w"))
    else:
        src.line(f"{y_ptr}[yr + o] += v")
    src.depth = plane_depth
    if not is_max:
        src.line(f"for i in range({out_plane}):").indent()
        src.line(f"{y_ptr}[yb + i] = {y_ptr}[yb + i] * p1[i]").dedent()
    arg_types = (pointer_type(x.dtype), pointer_type(y.dtype)) if is_max else (pointer_type(x.dtype),) * 3
    return Kernel(op, with_helpers(src.text()), arg_types)


def _inside(k, s, d, p, size, n_out) -> tuple[int, int]:
    """Output positions [lo, hi) along one axis whose whole kernel window lies inside the input."""
    inside = [o for o in range(n_out) if o * s - p >= 0 and o * s - p + (k - 1) * d < size]
    return (inside[0], inside[-1] + 1) if inside else (0, 0)


def _fused_max_rows(src, x, y, geometry, init, X, put):
    """2-D MaxPool, before the per-tap loops of output row o0: if the row's window lies inside the
    input rows, one loop over the columns whose window is inside too takes the max of all k*k taps
    (one store per output instead of a read-modify-write per tap). Returns those rows and columns,
    ([lo, hi), [lo, hi)), or None when no row or column is inside."""
    kernel, strides, dilations, pad_begin, _ = geometry
    H, W = (int(v) for v in x.shape[2:])
    OH, OW = (int(v) for v in y.shape[2:])
    r_lo, r_hi = _inside(kernel[0], strides[0], dilations[0], pad_begin[0], H, OH)
    cols = _inside(kernel[1], strides[1], dilations[1], pad_begin[1], W, OW)
    if r_hi <= r_lo or cols[1] <= cols[0]:
        return None
    kh, kw = kernel
    sh, sw = strides
    dh, dw = dilations
    src.line(f"if o0 >= {r_lo} and o0 < {r_hi}:").indent()
    src.line(f"xf = xb + (o0 * {sh} - {pad_begin[0]}) * {W} - {pad_begin[1]}")
    src.line(f"yf = yb + o0 * {OW}")
    src.line(f"for o in range({cols[0]}, {cols[1]}):").indent()
    src.line(f"xo = xf + o * {sw}" if sw != 1 else "xo = xf + o")
    # From the lowest value, like the per-tap loops (a NaN input is skipped the same way).
    src.line(f"m = {init}")
    for t in (i * dh * W + j * dw for i in range(kh) for j in range(kw)):
        src.line("v = " + X(f"xo + {t}")).line("m = v if v > m else m")
    src.line(put("yf + o", "m"))
    src.dedent().dedent()
    return (r_lo, r_hi), cols


def _check(node, graph, dtypes):
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y], float16="bfloat16" in dtypes)
    if np.dtype(x.dtype).name not in dtypes:
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): dtype {np.dtype(x.dtype).name} is not supported",
                                 hint=f"supported: {', '.join(dtypes)}")
    if len(x.shape) < 3:
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): input rank {len(x.shape)}, expected N x C x spatial dims")
    return x, y


def _maxpool_indices_kernel(x, y, geometry, storage_order) -> Kernel:
    """MaxPool with its Indices output: a window walk per output element (the
    first maximum wins); an index is the flat position in the whole input,
    row-major, or with storage_order=1 column-major within a plane."""
    kernel, strides, dilations, pad_begin, _ = geometry
    in_spatial, out_spatial = [int(d) for d in x.shape[2:]], [int(d) for d in y.shape[2:]]
    rank = len(in_spatial)
    in_plane, out_plane = int(np.prod(in_spatial)), int(np.prod(out_spatial))
    x_strides, y_strides = dims_strides(in_spatial), dims_strides(out_spatial)
    index_strides = x_strides if not storage_order else dims_strides(in_spatial[::-1])[::-1]
    src = Source().line(kernel_header(3)).indent()
    src.line("for c in range(begin, end):").indent()
    for a in range(rank):
        src.line(f"for o{a} in range({out_spatial[a]}):").indent()
    src.line("found = False").line(f"best = p0[c * {in_plane}]").line("arg = 0")
    for a in range(rank):
        src.line(f"for k{a} in range({kernel[a]}):").indent()
        src.line(f"h{a} = {_affine([(f'o{a}', strides[a]), (f'k{a}', dilations[a])], -pad_begin[a])}")
        src.line(f"if h{a} < 0 or h{a} >= {in_spatial[a]}:").indent().line("continue").dedent()
    src.line(f"v = p0[{_affine([('c', in_plane)] + [(f'h{a}', x_strides[a]) for a in range(rank)])}]")
    src.line("if not found or v > best:").indent().line("found = True").line("best = v")
    src.line(f"arg = {_affine([('c', in_plane)] + [(f'h{a}', index_strides[a]) for a in range(rank)])}").dedent()
    src.depth = 2 + rank
    out = _affine([("c", out_plane)] + [(f"o{a}", y_strides[a]) for a in range(rank)])
    src.line(f"p1[{out}] = best").line(f"p2[{out}] = np.int64(arg)")
    return Kernel("MaxPoolIndices", src.text(), (pointer_type(x.dtype), pointer_type(y.dtype), "int64"))


def lower_maxpool(node, graph) -> Lowered:
    # bfloat16 / float16: activations stored in 16 bits (passes/assign_precision.py)
    x, y = _check(node, graph, ("float32", "float64", "int8", "uint8", "bfloat16", "float16"))
    geometry = pool_geometry(node, x.shape[2:], y.shape[2:])
    planes = int(x.shape[0] * x.shape[1])
    if len(node.outputs) > 1 and node.outputs[1]:
        kernel = _maxpool_indices_kernel(x, y, geometry, int(node.attr("storage_order", 0)))
        return Lowered([KernelCall(kernel, [x.name, y.name, node.outputs[1]], planes, node.name, n_outputs=2)])
    if maxpool8.applies(x, y, geometry):   # 8-bit: separably, rows then columns
        return maxpool8.lower(node, graph, x, y, geometry)
    kernel = _window_kernel("MaxPool", x, y, geometry)
    return Lowered([KernelCall(kernel, [x.name, y.name], planes, node.name)])


def lower_averagepool(node, graph) -> Lowered:
    x, y = _check(node, graph, ("float32", "float64"))
    geometry = pool_geometry(node, x.shape[2:], y.shape[2:])
    kernel_shape, strides, dilations, pad_begin, pad_end = geometry
    include_pad = bool(node.attr("count_include_pad", 0))
    # The divisor is a product over axes: the taps counted along each axis.
    per_axis = [np.array([_taps(o, size, k, s, d, pb, pe, include_pad) for o in range(n_out)], dtype=np.float64)
                for size, n_out, k, s, d, pb, pe
                in zip(x.shape[2:], y.shape[2:], kernel_shape, strides, dilations, pad_begin, pad_end)]
    count = per_axis[0]
    for axis_count in per_axis[1:]:
        count = np.multiply.outer(count, axis_count)
    with np.errstate(divide="ignore"):
        reciprocal = np.where(count > 0, 1.0 / np.maximum(count, 1), 0.0).astype(x.dtype).reshape(-1)
    kernel = _window_kernel("AveragePool", x, y, geometry)
    planes = int(x.shape[0] * x.shape[1])
    return Lowered([KernelCall(kernel, [x.name, reciprocal, y.name], planes, node.name)])


def _global_kernel(op, x, y) -> Kernel:
    """A 16-bit x or y (activations stored in bf16 / fp16) is widened on load, narrowed on store:
    the sums run in float32."""
    dtype = compute_type(x.dtype)
    X = lambda index: load("p0", index, x.dtype)
    plane = int(np.prod(x.shape[2:]))
    src = Source().line(kernel_header(2)).indent()
    src.line("for c in range(begin, end):").indent()
    src.line(f"xb = c * {plane}")
    if op == "GlobalMaxPool":
        src.line(f"acc = {X('xb')}")
        src.line(f"for i in range(1, {plane}):").indent()
        src.line(f"v = {X('xb + i')}")
        src.line("acc = v if v > acc else acc").dedent()
        src.line(store("p1", "c", "acc", y.dtype))
    else:
        src.line(f"acc = {literal(0, dtype)}")
        src.line(f"for i in range({plane}):").indent().line(f"acc += {X('xb + i')}").dedent()
        src.line(store("p1", "c", f"acc / {literal(plane, dtype)}", y.dtype))
    return Kernel(op, with_helpers(src.text()), (pointer_type(x.dtype), pointer_type(y.dtype)))


def _lower_global(node, graph) -> Lowered:
    x, y = _check(node, graph, ("float32", "float64", "bfloat16", "float16"))
    planes = int(x.shape[0] * x.shape[1])
    return Lowered([KernelCall(_global_kernel(node.op, x, y), [x.name, y.name], planes, node.name)])


def lower_global_averagepool(node, graph) -> Lowered:
    return _lower_global(node, graph)


def lower_global_maxpool(node, graph) -> Lowered:
    return _lower_global(node, graph)


def lower_lppool(node, graph) -> Lowered:
    """LpPool: (sum over the window of |x|^p)^(1/p); padding contributes nothing.
    A window walk per output element."""
    x, y = _check(node, graph, ("float32", "float64"))
    kernel_shape, strides, dilations, pad_begin, _ = pool_geometry(node, x.shape[2:], y.shape[2:])
    p = float(node.attr("p", 2))
    in_spatial, out_spatial = [int(d) for d in x.shape[2:]], [int(d) for d in y.shape[2:]]
    rank = len(in_spatial)
    in_plane, out_plane = int(np.prod(in_spatial)), int(np.prod(out_spatial))
    x_strides, y_strides = dims_strides(in_spatial), dims_strides(out_spatial)
    dtype = np.dtype(x.dtype)
    src = Source().line(kernel_header(2)).indent()
    src.line("for c in range(begin, end):").indent()
    for a in range(rank):
        src.line(f"for o{a} in range({out_spatial[a]}):").indent()
    src.line(f"acc = {literal(0, dtype)}")
    for a in range(rank):
        src.line(f"for k{a} in range({kernel_shape[a]}):").indent()
        src.line(f"h{a} = {_affine([(f'o{a}', strides[a]), (f'k{a}', dilations[a])], -pad_begin[a])}")
        src.line(f"if h{a} < 0 or h{a} >= {in_spatial[a]}:").indent().line("continue").dedent()
    v = f"abs(p0[{_affine([('c', in_plane)] + [(f'h{a}', x_strides[a]) for a in range(rank)])}])"
    src.line(f"acc += {v} * {v}" if p == 2 else f"acc += {v} ** {literal(p, dtype)}")
    src.depth = 2 + rank
    out = _affine([("c", out_plane)] + [(f"o{a}", y_strides[a]) for a in range(rank)])
    src.line(f"p1[{out}] = math.sqrt(acc)" if p == 2 else f"p1[{out}] = acc ** {literal(1.0 / p, dtype)}")
    planes = int(x.shape[0] * x.shape[1])
    return Lowered([KernelCall(Kernel("LpPool", src.text(), (pointer_type(dtype),) * 2), [x.name, y.name], planes,
                               node.name)])


def lower_max_unpool(node, graph) -> Lowered:
    """MaxUnpool: a zero output, then every value written at its index (a flat
    position in the whole output, as MaxPool's Indices give it). One work item."""
    x, indices, y = graph.values[node.inputs[0]], graph.values[node.inputs[1]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y])
    dtype = np.dtype(y.dtype)
    src = Source().line(kernel_header(3)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"for i in range({y.size}):").indent().line(f"p2[i] = {literal(0, dtype)}").dedent()
    src.line(f"for i in range({x.size}):").indent()
    src.line("t = np.int64(p1[i])")
    src.line(f"if t >= 0 and t < {y.size}:").indent().line("p2[t] = p0[i]")
    kernel = Kernel("MaxUnpool", src.text(), (pointer_type(x.dtype), np.dtype(indices.dtype).name, pointer_type(dtype)))
    return Lowered([KernelCall(kernel, [x.name, indices.name, y.name], 1, node.name)])


def lower_col2im(node, graph) -> Lowered:
    """Col2Im: the sum of every block column back into its image position
    (N x C*prod(block) x L -> N x C x image); a work item is one (n, c) image."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y])
    image = [int(d) for d in y.shape[2:]]
    block = [int(b) for b in np.asarray(graph.values[node.inputs[2]].data).reshape(-1)]
    r = len(image)
    strides = [int(s) for s in (node.attr("strides") or [1] * r)]
    dilations = [int(d) for d in (node.attr("dilations") or [1] * r)]
    pads = [int(p) for p in (node.attr("pads") or [0] * 2 * r)]
    slides = [(image[a] + pads[a] + pads[r + a] - (dilations[a] * (block[a] - 1) + 1)) // strides[a] + 1
              for a in range(r)]
    n_block, n_slide, plane = int(np.prod(block)), int(np.prod(slides)), int(np.prod(image))
    channels = int(y.shape[1])
    block_strides, slide_strides, image_strides = dims_strides(block), dims_strides(slides), dims_strides(image)
    dtype = np.dtype(y.dtype)
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"n = w // {channels}").line(f"c = w % {channels}")
    src.line(f"for i in range({plane}):").indent().line(f"p1[w * {plane} + i] = {literal(0, dtype)}").dedent()
    for a in range(r):
        src.line(f"for b{a} in range({block[a]}):").indent()
    for a in range(r):
        src.line(f"for l{a} in range({slides[a]}):").indent()
        src.line(f"h{a} = {_affine([(f'l{a}', strides[a]), (f'b{a}', dilations[a])], -pads[a])}")
        src.line(f"if h{a} < 0 or h{a} >= {image[a]}:").indent().line("continue").dedent()
    row = _affine([("c", n_block)] + [(f"b{a}", block_strides[a]) for a in range(r)])
    col = _affine([(f"l{a}", slide_strides[a]) for a in range(r)])
    dst = _affine([(f"h{a}", image_strides[a]) for a in range(r)])
    src.line(f"p1[w * {plane} + {dst}] += p0[(n * {channels * n_block} + {row}) * {n_slide} + {col}]")
    kernel = Kernel("Col2Im", src.text(), (pointer_type(x.dtype), pointer_type(dtype)))
    return Lowered([KernelCall(kernel, [x.name, y.name], int(y.shape[0]) * channels if y.size else 0, node.name)])
