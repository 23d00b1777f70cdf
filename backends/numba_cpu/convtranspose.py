"""ConvTranspose (ONNX opsets 1-22), any number of spatial dims: groups,
strides, pads, dilations, output_padding, output_shape and auto_pad.

    Y[n, oc, o] = B[oc] + sum_{ic in oc's group, k} X[n, ic, i] * W[ic, oc % (M/group), k]
    where o = i*stride - pad_begin + k*dilation (per spatial dim)

As onnxruntime does it, in two kernel calls:

1. GEMM: col[n, g, m, i] = sum_c W[g*C/group + c, m] * X[n, g*C/group + c, i] with
   m = (output channel in group, tap) and i an input position, into scratch.
   A work item is a block of rows m; its inner loop runs over i, unit-stride,
   with a block of rows x a block of channels of W in registers.
2. col2im: each (image, output channel) plane is set to the bias, then every
   tap adds its column rows. For a tap k the input positions whose output lands
   inside the plane form one range per dim, [ceil((p - k*d)/s),
   floor((O - 1 + p - k*d)/s)], so that loop has no tests.

Pads come from `pads`, or, with `output_shape` or SAME auto_pad, from the
total padding s*(I-1) + output_padding + (K-1)*d + 1 - O split as ONNX says
(SAME_UPPER puts the odd one at the end, otherwise at the beginning).
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, dims_strides, kernel_header, literal, with_strided_form
from .scratch import scratch_value

# GEMM register block: rows of W^T x input channels.
_ROWS = 4
_CHANNELS = 4


def _unsupported(node, why):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}")


def pads_begin(node, in_spatial, kernel, strides, dilations, out_spatial) -> list[int]:
    n = len(in_spatial)
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad == "VALID":
        return [0] * n
    if node.attr("output_shape") is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        output_padding = list(node.attr("output_padding", [0] * n))
        heads = []
        for i in range(n):
            total = strides[i] * (in_spatial[i] - 1) + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1 - out_spatial[i]
            heads.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
        return heads
    return list(node.attr("pads", [0] * 2 * n))[:n]


def lower_convtranspose(node, graph) -> Lowered:
    X, W = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    Bv = graph.values[node.inputs[2]] if len(node.inputs) > 2 and node.inputs[2] else None
    Y = graph.values[node.outputs[0]]
    dtype = np.dtype(Y.dtype)
    if dtype.name not in ("float32", "float64"):
        raise _unsupported(node, f"dtype {dtype.name} is not supported (float32, float64)")
    if len(X.shape) < 3:
        raise _unsupported(node, f"input rank {len(X.shape)} is not supported (N, C, spatial...)")
    N, C = X.shape[:2]
    M = Y.shape[1]
    group = int(node.attr("group", 1))
    in_spatial, out_spatial, kernel = list(X.shape[2:]), list(Y.shape[2:]), list(W.shape[2:])
    n = len(in_spatial)
    strides = list(node.attr("strides", [1] * n))
    dilations = list(node.attr("dilations", [1] * n))
    pads = pads_begin(node, in_spatial, kernel, strides, dilations, out_spatial)
    Cg, Mg = C // group, M // group
    if W.shape[0] != C or W.shape[1] != Mg:
        raise _unsupported(node, f"weight shape {W.shape} does not match {C} input channels, {M} outputs, group {group}")
    geometry = _Geometry(N, C, M, group, in_spatial, out_spatial, kernel, strides, dilations, pads, dtype)
    col = scratch_value(graph, node, (N * group * geometry.MK * geometry.HW,), dtype, tag="col")
    if _patches(geometry, W, Bv):
        return _patch_calls(geometry, node, X, W, Bv, Y, col)
    return Lowered([_gemm_call(geometry, X.name, W.name, col, node.name),
                    _col2im_call(geometry, col, Bv.name if Bv is not None else None, Y.name, node.name)])


def _patches(g, W, Bv) -> bool:
    """Whether every input position's outputs are a patch of their own: 2-D, strides equal to the
    kernel, no dilation, padding or output padding (the 2x "deconvolution" upsampling of U-Nets
    and segmentation heads), group 1, float32, constant weights and bias."""
    return (len(g.kernel) == 2 and g.group == 1 and g.dtype == np.float32 and W.is_const
            and (Bv is None or Bv.is_const) and list(g.strides) == list(g.kernel)
            and all(d == 1 for d in g.dilations) and not any(g.pads)
            and [i * s for i, s in zip(g.in_spatial, g.strides)] == list(g.out_spatial))


def _patch_calls(g, node, X, W, Bv, Y, col) -> Lowered:
    """The non-overlapping case in two calls, neither of which reads what it writes twice:

    1. col[n, (oc, kh, kw), i] = B[oc] + sum_c W[c, oc, kh, kw] * X[n, c, i]: a 1x1 convolution of
       M*KH*KW output "channels" (conv.py's pointwise GEMM on the micro-kernel, W^T packed in
       panels at build time, the bias added in its epilogue);
    2. Y[n, oc, h*KH + kh, w*KW + kw] = col[n, (oc, kh, kw), h*W + w]: a permutation, every output
       written once (the general col2im sets each plane to the bias, then adds every tap).
    """
    from .conv import pointwise_kernel
    rows = g.M * g.K
    weights = np.asarray(W.data, dtype=np.float32).reshape(g.C, rows).T
    gemm, work, packed = pointwise_kernel(g.dtype, g.N, g.C, rows, 1, g.HW, Bv is not None, weights=weights)
    args = [packed if packed is not None else np.ascontiguousarray(weights), X.name]
    if Bv is not None:
        args.append(np.repeat(np.asarray(Bv.data, dtype=np.float32).reshape(g.M), g.K))
    shuffle = KernelCall(_shuffle_kernel(g), [col, Y.name], g.N * g.M * g.in_spatial[0], node.name)
    # before a Concat at batch > 1: the images a Concat row apart (concat.py)
    with_strided_form(shuffle, Y, lambda row: (_shuffle_kernel(g, row), shuffle.work))
    return Lowered([KernelCall(gemm, args + [col], work, node.name), shuffle])


def _shuffle_kernel(g, batch_stride=None) -> Kernel:
    """Step 2 of _patch_calls; with `batch_stride` the output's images lie that many elements
    apart (else g.M * g.OUT)."""
    KH, KW = g.kernel
    H, Wd = g.in_spatial
    OW = g.out_spatial[1]
    src = Source().line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()   # (image, output channel, input row)
    src.line(f"plane = item // {H}").line(f"h = item % {H}")
    if batch_stride is None:
        src.line(f"ob = plane*{g.OUT}")
    else:
        src.line(f"ob = (plane // {g.M})*{batch_stride} + (plane % {g.M})*{g.OUT}")
    src.line(f"cb = plane*{g.K * g.HW}")
    for kh in range(KH):
        src.line(f"yo = ob + (h*{KH} + {kh})*{OW}")
        src.line(f"co = cb + {kh * KW * g.HW} + h*{Wd}")
        src.line(f"for w in range({Wd}):").indent()
        for kw in range(KW):
            src.line(f"p1[yo + w*{KW} + {kw}] = p0[co + {kw * g.HW} + w]")
        src.dedent()
    return Kernel("ConvTransposePatches", src.text(), (g.dtype.name,) * 2)


class _Geometry:
    def __init__(self, N, C, M, group, in_spatial, out_spatial, kernel, strides, dilations, pads, dtype):
        self.N, self.C, self.M, self.group = N, C, M, group
        self.Cg, self.Mg = C // group, M // group
        self.in_spatial, self.out_spatial, self.kernel = in_spatial, out_spatial, kernel
        self.strides, self.dilations, self.pads, self.dtype = strides, dilations, pads, dtype
        self.K = int(np.prod(kernel))
        self.HW = int(np.prod(in_spatial))
        self.OUT = int(np.prod(out_spatial))
        self.MK = self.Mg * self.K


def _gemm_call(g, x, w, col, name) -> KernelCall:
    """col[n, grp, m, :] = sum_c W[grp*Cg + c, m] * X[n, grp*Cg + c, :] (W is [C, Mg*K] flat)."""
    blocks = -(-g.MK // _ROWS)
    src = Source().line(kernel_header(3)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"mb = item % {blocks}").line(f"rest = item // {blocks}")
    src.line(f"grp = rest % {g.group}").line(f"n = rest // {g.group}")
    src.line(f"m0 = mb*{_ROWS}")
    src.line(f"xb = (n*{g.C} + grp*{g.Cg})*{g.HW}")
    src.line(f"wb = grp*{g.Cg * g.MK} + m0")
    src.line(f"cb = ((n*{g.group} + grp)*{g.MK} + m0)*{g.HW}")
    tail = g.MK % _ROWS
    if tail:
        src.line(f"if m0 + {_ROWS} <= {g.MK}:").indent()
        _gemm_rows(src, g, _ROWS)
        src.dedent().line("else:").indent()
        _gemm_rows(src, g, tail)
        src.dedent()
    else:
        _gemm_rows(src, g, _ROWS)
    kernel = Kernel("ConvTransposeGemm", src.text(), (g.dtype.name,) * 3)
    return KernelCall(kernel, [x, w, col], g.N * g.group * blocks, name)


def _gemm_rows(src, g, rows):
    """Rows m0..m0+rows-1 of the column buffer: one pass over the input positions per block of
    channels, the first one storing, the others accumulating."""
    HW, MK = g.HW, g.MK

    def block(c0, channels, first):
        for r in range(rows):
            for t in range(channels):
                src.line(f"w{r}_{t} = p1[wb + ({c0} + {t})*{MK} + {r}]")
        src.line(f"for j in range({HW}):").indent()
        for t in range(channels):
            src.line(f"x{t} = p0[xb + ({c0} + {t})*{HW} + j]")
        for r in range(rows):
            terms = " + ".join(f"w{r}_{t} * x{t}" for t in range(channels))
            src.line(f"p2[cb + {r * HW} + j] {'=' if first else '+='} {terms}")
        src.dedent()
    first = min(_CHANNELS, g.Cg)
    block(0, first, True)
    full, rest = divmod(g.Cg - first, _CHANNELS)
    if full:
        src.line(f"for cblk in range({full}):").indent()
        src.line(f"c0 = {first} + cblk*{_CHANNELS}")
        block("c0", _CHANNELS, False)
        src.dedent()
    if rest:
        block(first + full * _CHANNELS, rest, False)


def _col2im_call(g, col, bias, y, name) -> KernelCall:
    n = len(g.in_spatial)
    args = [col] + ([bias] if bias else []) + [y]
    pY = f"p{len(args) - 1}"
    in_strides, out_strides, k_strides = dims_strides(g.in_spatial), dims_strides(g.out_spatial), dims_strides(g.kernel)
    src = Source().line(kernel_header(len(args))).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {g.M}").line(f"oc = item % {g.M}")
    src.line(f"ob = item*{g.OUT}")
    src.line(f"bv = {'p1[oc]' if bias else literal(0, g.dtype)}")
    src.line(f"for o in range({g.OUT}):").indent().line(f"{pY}[ob + o] = bv").dedent()
    src.line(f"grp = oc // {g.Mg}").line(f"ocl = oc % {g.Mg}")
    src.line(f"cb = ((n*{g.group} + grp)*{g.MK} + ocl*{g.K})*{g.HW}")
    for d in range(n):
        s, p, dil, I, O = g.strides[d], g.pads[d], g.dilations[d], g.in_spatial[d], g.out_spatial[d]
        src.line(f"for k{d} in range({g.kernel[d]}):").indent()
        # Input positions i with 0 <= i*s - p + k*dil < O.
        src.line(f"lo{d} = max(0, -((k{d}*{dil} - {p}) // {s}))")
        src.line(f"hi{d} = min({I}, ({O - 1 + p} - k{d}*{dil}) // {s} + 1)")
    src.line(f"ck = cb + ({' + '.join(f'k{d}*{k_strides[d]}' for d in range(n))})*{g.HW}")
    for d in range(n):
        src.line(f"for i{d} in range(lo{d}, hi{d}):").indent()
    c_index = " + ".join(["ck"] + [f"i{d}*{in_strides[d]}" if in_strides[d] != 1 else f"i{d}" for d in range(n)])
    y_terms = []
    for d in range(n):
        o = f"(i{d}*{g.strides[d]} - {g.pads[d]} + k{d}*{g.dilations[d]})"
        y_terms.append(f"{o}*{out_strides[d]}" if out_strides[d] != 1 else o)
    src.line(f"{pY}[ob + {' + '.join(y_terms)}] += p0[{c_index}]")
    kernel = Kernel("ConvTranspose", src.text(), (g.dtype.name,) * len(args))
    return KernelCall(kernel, args, g.N * g.M, name)
