"""Conv (NCHW, 1-D/2-D/3-D, groups, strides, pads, dilations, auto_pad, optional bias).

    Y[n, oc, o] = B[oc] + sum_{ic in group(oc), k} W[oc, ic, k] * X[n, ic, o*s - p + k*d]

A 1x1 stride-1 unpadded conv is a GEMM per (image, group): Y[n, g] = W[g] @ X[n, g]
(M = output channels, N = pixels, K = input channels), handed to gemm.py.

Otherwise the conv is direct. One work item computes output rows of OCB
output-channel planes of one image (OCB = 2 when the group allows: each input
load then feeds two FMAs). The planes are initialised with the bias, then
accumulated block by block, where a block is a few taps (ICB whole input
channels when the kernel is small, or a few kernel rows of one channel when it
is large) fused in one expression per output channel:

    x0 = x[xb + ow*s + c0]; x1 = x[xb + ow*s + c1]; ...
    out_j[row, ow] += wj_0 * x0 + wj_1 * x1 + ...

the c_t being compile-time offsets. The inner loop runs over the columns
where every tap is inside the input, so it has no branches and LLVM
vectorises it; border columns get one statement each with only their valid
taps. In 2-D, the few rows whose kernel window leaves the input (top/bottom
padding) get fused code of their own with only their valid kernel rows; other
such rows (3-D, large kernels, large pads) take a per-tap path with the valid
kernel range computed at run time.

With stride 1 and as many output as input columns (every "same" conv), the
input offset is affine in the flat output index oh*OW + ow, so the inner loop
runs over all interior rows at once: long trip counts vectorise with little
scalar tail. The border columns it crosses read neighbouring input rows (in
the same plane); there the sum of a kernel column that crosses the row edge is
multiplied by a 0/1 column mask packed at build time (kernels are compiled
with fastmath, so no inf/NaN semantics are lost that were not already).

Weights are read in their ONNX layout [OC, IC/group, *kernel], which is the
order the blocks read them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .ukernel import specs_in
from cuvil.errors import UnsupportedOpError
from cuvil.ir import Value

from . import conv1d, convgemm, convim2col, convsmall, dwlanes, dwstride, winograd, winograd_bf16
from .elementwise import elementwise_kernel
from .epilogue import Epilogue, epilogue_of
from .gemm import Operand, choose_tile, gemm_kernel, pack_a_panels, uk_eligible, uk_gemm_kernel
from .kernel import (InPlace, Kernel, KernelCall, Lowered, Source, broadcast_strides, dims_strides, kernel_header,
                     literal, with_strided_form)

WEIGHT_REGS = 18  # weights live in one pass (OCB x taps): they stay in vector registers
OC_BLOCK = 2      # output channels per work item (when the group size allows)
FUSED_EDGE_ROWS = 4  # at most this many top/bottom padding rows get their own fused code (2-D)
MIN_ITEMS = 16    # when the (image, channel block) items are fewer, rows are split too


def ceil_div(a, b):
    return -(-a // b)


def _unsupported(node, why):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}")


def conv_geometry(node, x_spatial, w_spatial):
    """Kernel shape, strides, dilations and begin pads of a Conv node (auto_pad resolved)."""
    s = len(x_spatial)
    kernel = [int(k) for k in (node.attr("kernel_shape") or w_spatial)]
    strides = [int(v) for v in (node.attr("strides") or [1] * s)]
    dilations = [int(v) for v in (node.attr("dilations") or [1] * s)]
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for i, k, st, d in zip(x_spatial, kernel, strides, dilations):
            out = ceil_div(i, st)
            total = max(0, (out - 1) * st + (k - 1) * d + 1 - i)
            pads.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
    elif auto_pad == "VALID":
        pads = [0] * s
    elif auto_pad in ("NOTSET", ""):
        pads = [int(v) for v in (node.attr("pads") or [0] * (2 * s))][:s]
    else:
        raise _unsupported(node, f"auto_pad '{auto_pad}' is not a valid value")
    return kernel, strides, dilations, pads


def lower_conv(node, graph) -> Lowered:
    """Conv, and FusedConv (domain "cuvil"): y = act(conv(x) + bias + residual), see epilogue.py."""
    epilogue, inputs = epilogue_of(node)
    X = graph.values[inputs[0]]
    W = graph.values[inputs[1]]
    B = graph.values[inputs[2]] if len(inputs) > 2 and inputs[2] else None
    Y = graph.values[node.outputs[0]]
    depthwise16 = _depthwise16(node, graph)
    if depthwise16 is not None:
        return Lowered([dwstride.lower_dw_rows(node, *depthwise16)])
    stored16 = _stored16(node, graph)
    if stored16:
        return _lower_stored16(node, graph, stored16, epilogue, X, W, B, Y)
    dtype = np.dtype(Y.dtype)
    if dtype.kind != "f":
        raise _unsupported(node, f"{dtype.name} inputs are not supported (float only)")
    if len(X.shape) < 3:
        raise _unsupported(node, f"input rank {len(X.shape)} is not supported (N, C and at least one spatial dim)")
    group = int(node.attr("group", 1))
    N, C = X.shape[:2]
    OC = W.shape[0]
    if C % group or OC % group or W.shape[1] != C // group:
        raise _unsupported(node, f"W shape {W.shape} does not match {C} input channels in {group} groups")
    kernel, strides, dilations, pads = conv_geometry(node, X.shape[2:], W.shape[2:])
    if list(kernel) != list(W.shape[2:]):
        raise _unsupported(node, f"kernel_shape {kernel} does not match W shape {W.shape}")
    res_arg, res_strides = None, None
    if epilogue.residual is not None:
        R = graph.values[epilogue.residual]
        res_arg = np.ascontiguousarray(np.asarray(R.data).astype(dtype)) if R.is_const else R.name
        res_strides = tuple(broadcast_strides(R.shape, Y.shape))
    args = [X.name, W.name] + ([B.name] if B is not None else [])
    # A weight computed at run time cannot be packed at build time: the direct kernel reads W as it is.
    pointwise = W.is_const and (all(k == 1 for k in kernel) and all(s == 1 for s in strides) and not any(pads)
                 and tuple(X.shape[2:]) == tuple(Y.shape[2:])
                 and (res_strides is None or _flat_spatial(res_strides[2:], Y.shape[2:]) is not None))
    # A residual laid out like the output, with no reader after this conv, may become the output's
    # buffer: the conv then accumulates onto it (one pass over it instead of a read and a write).
    in_place_residual = isinstance(res_arg, str) and res_strides == tuple(dims_strides(Y.shape))
    lowered = _gemm_paths(node, graph, dtype, X, W, B, Y, group, kernel, strides, dilations, pads, res_arg,
                          res_strides, epilogue, pointwise, in_place_residual)
    if lowered is None and len(X.shape) == 3 and W.is_const and not pointwise:
        # A 1-D conv is a 2-D conv with one row (conv1d.py): the 2-D GEMM kernels may take it.
        X2, W2, Y2, kernel2, strides2, dilations2, pads2, res2 = conv1d.as_2d(X, W, Y, kernel, strides, dilations,
                                                                              pads, res_strides)
        lowered = _gemm_paths(node, graph, dtype, X2, W2, B, Y2, group, kernel2, strides2, dilations2, pads2, res_arg,
                              res2, epilogue, False, in_place_residual)
    if lowered is not None:
        return lowered
    if pointwise:
        pixels = int(np.prod(X.shape[2:]))
        kernel_obj, work, packed = pointwise_kernel(dtype, N, C, OC, group, pixels, B is not None,
                                                     res_strides, Y.shape[2:], epilogue, W.data)
        args[0], args[1] = (W.name if packed is None else packed), X.name  # the GEMM reads A = W, B = X
        if in_place_residual and specs_in(kernel_obj.source):
            # The same GEMM, accumulating onto its output: it reads the weights packed above.
            form, form_work, _ = pointwise_kernel(dtype, N, C, OC, group, pixels, B is not None, None,
                                                   Y.shape[2:], epilogue, W.data, accumulate=True, packed=packed)
            form_args = args + [Y.name]
            call = KernelCall(kernel_obj, args + [res_arg, Y.name], work, node.name,
                              in_place=InPlace(res_arg, form, form_args, form_work))
            return Lowered([call])
    else:
        kernel_obj, work, mask = direct_conv_kernel(dtype, N, C, OC, group, X.shape[2:], Y.shape[2:], kernel,
                                                    strides, dilations, pads, B is not None, res_strides, epilogue)
        if mask is not None:
            args.append(mask)
    if res_arg is not None:
        args.append(res_arg)
    args.append(Y.name)
    call = KernelCall(kernel_obj, args, work, node.name)
    if pointwise:
        # before a Concat at batch > 1: the same GEMM writing its images a Concat row apart (concat.py)
        with_strided_form(call, Y, lambda row: pointwise_kernel(
            dtype, N, C, OC, group, pixels, B is not None, res_strides, Y.shape[2:], epilogue, W.data, packed=packed,
            out_batch_stride=row)[:2])
    return Lowered([call])


def _depthwise16(node, graph):
    """(X, W, B, Y, kernel, strides, pads, epilogue) of a depthwise conv whose input and/or output is
    stored in 16 bits (passes/assign_precision.py narrows the tensors around depthwise convs) when
    dwstride.py's rows take it, else None."""
    epilogue, inputs = epilogue_of(node)
    X, W, Y = graph.values[inputs[0]], graph.values[inputs[1]], graph.values[node.outputs[0]]
    B = graph.values[inputs[2]] if len(inputs) > 2 and inputs[2] else None
    if {dwstride.fmt(X), dwstride.fmt(Y)} <= {"f32", ""} or len(X.shape) != 4 or len(W.shape) != 4:
        return None
    kernel, strides, dilations, pads = conv_geometry(node, X.shape[2:], W.shape[2:])
    if list(kernel) != list(W.shape[2:]) or not dwstride.eligible(np.float32, X, W, B, int(node.attr("group", 1)),
                                                                 kernel, strides, dilations, Y, epilogue):
        return None
    return X, W, B, Y, kernel, strides, pads, epilogue


def reads_stored16(node, graph) -> bool:
    """Whether lower_conv reads and writes the node's 16-bit activations itself (a marked conv, or a
    depthwise conv dwstride.py's rows take); else widen.in_float32 gives it float32 copies."""
    return node.attr("precision") in ("bf16", "fp16") or _depthwise16(node, graph) is not None


def _stored16(node, graph) -> list[str]:
    """The inputs and outputs of a marked conv that are activations stored in 16 bits
    (passes/assign_precision.py, `narrow_activations`)."""
    precision = node.attr("precision")
    if precision not in ("bf16", "fp16"):
        return []
    stored = "bfloat16" if precision == "bf16" else "float16"
    return [name for name in list(node.inputs) + list(node.outputs)
            if name and not graph.values[name].is_const and np.dtype(graph.values[name].dtype).name == stored]


def _lower_stored16(node, graph, stored16, epilogue, X, W, B, Y) -> Lowered:
    """A marked conv with 16-bit activations: the implicit GEMM reads and writes them where it takes
    the conv (convgemm.py: phase images copied from X, tiles rounded once into Y, a residual widened
    on load). Elsewhere (a conv the backend gives to a float32 kernel) the 16-bit tensors are widened
    into float32 copies before the conv and its output narrowed after it: correct, only slower."""
    group = int(node.attr("group", 1))
    lowp = convgemm.lowp_conv(node, group, int(X.shape[1]) // group) if len(X.shape) == 4 else None
    bf16_winograd = _bf16_winograd(node, graph, lowp, X, W, B, Y, group, epilogue)
    if bf16_winograd is not None:
        return bf16_winograd
    if lowp is not None and W.is_const and not _float32_winograd(node, lowp) \
            and len(W.shape) == 4 and X.shape[1] % group == 0 and W.shape[1] == X.shape[1] // group:
        kernel, strides, dilations, pads = conv_geometry(node, X.shape[2:], W.shape[2:])
        res_arg = res_strides = None
        if epilogue.residual is not None:
            R = graph.values[epilogue.residual]
            res_arg = np.ascontiguousarray(np.asarray(R.data, dtype=np.float32)) if R.is_const else R.name
            res_strides = tuple(broadcast_strides(R.shape, Y.shape))
        if list(kernel) == list(W.shape[2:]) \
                and convgemm.eligible(np.float32, X, W, group, kernel, strides, dilations, Y) \
                and (res_strides is None or convgemm.flat_residual(res_strides, Y.shape[2:])):
            calls = convgemm.lower_conv_gemm(node, graph, X, W, B, Y, group, kernel, strides, dilations, pads,
                                             res_arg, res_strides, epilogue, lowp=lowp)
            if isinstance(res_arg, str) and res_strides == tuple(dims_strides(Y.shape)) \
                    and graph.values[res_arg].dtype == Y.dtype:
                # Y may take over the residual's buffer (the memory plan decides): the same kernel then
                # reads each residual value from Y just before it writes that element.
                conv_call = calls[-1]
                args = list(conv_call.args)
                at = max(k for k, a in enumerate(args) if isinstance(a, str) and a == res_arg)
                args[at] = Y.name
                conv_call.in_place = InPlace(res_arg, conv_call.kernel, args, conv_call.work)
            return Lowered(calls)
    wide = dataclasses.replace(node, inputs=list(node.inputs), outputs=list(node.outputs), attrs=dict(node.attrs))
    before, after = [], []
    for names, is_input in ((wide.inputs, True), (wide.outputs, False)):
        for k, name in enumerate(names):
            if name not in stored16:
                continue
            v = graph.values[name]
            copy = graph.unique_name(f"{name}__f32")
            graph.values[copy] = Value(copy, np.dtype(np.float32), tuple(v.shape))
            src, dst = (v, graph.values[copy]) if is_input else (graph.values[copy], v)
            cvt, work = elementwise_kernel("Cvt16", "a", [src.shape], [src.dtype], dst.shape, dst.dtype)
            (before if is_input else after).append(KernelCall(cvt, [src.name, dst.name], work, node.name))
            names[k] = copy
    return Lowered(before + lower_conv(wide, graph).calls + after)


def _float32_winograd(node, lowp) -> bool:
    """Whether a conv marked for Winograd may take the float32 transforms: not when it is marked bf16
    (one winograd_bf16.py declines, an odd channel count say, runs as the direct bf16 conv; the
    float32 transforms would hold 16/9-4x its weights in float32). fp16 keeps them (as before)."""
    return bool(node.attr("winograd", 0)) and not (lowp and lowp[0] == "bf16")


def kernel_candidates(node, graph) -> tuple[list[str], str | None]:
    """The kernels measured selection (cuvil/select.py) chooses among for this node, by the names of
    winograd.KERNELS, and the one the shape rules take; ([], None) where the rules leave nothing to
    choose: a float32 Conv / FusedConv with constant weights that the winograd pass marked, and at
    least one transform fits it."""
    if node.op not in ("Conv", "FusedConv") or not node.attr("winograd", 0) or node.attr("precision"):
        return [], None
    _, inputs = epilogue_of(node)
    X, W, Y = graph.values[inputs[0]], graph.values[inputs[1]], graph.values[node.outputs[0]]
    if not W.is_const or len(X.shape) != 4 or len(W.shape) != 4:
        return [], None
    kernel, strides, dilations, _ = conv_geometry(node, X.shape[2:], W.shape[2:])
    shape = (X, W, int(node.attr("group", 1)), kernel, strides, dilations, Y)
    names = winograd.candidates(Y.dtype, *shape)
    return names, (winograd.kernel_name(winograd.choose(Y.dtype, *shape)) if names else None)


def _bf16_winograd(node, graph, lowp, X, W, B, Y, group, epilogue) -> Lowered | None:
    """A conv marked both bf16 and for Winograd, on winograd_bf16.py's kernels when they take it
    (float32 or bf16 activations), else None."""
    if lowp is None or not node.attr("winograd", 0) or not W.is_const or len(X.shape) != 4 or len(W.shape) != 4:
        return None
    kernel, strides, dilations, pads = conv_geometry(node, X.shape[2:], W.shape[2:])
    transform = winograd_bf16.choose(lowp, X, W, group, kernel, strides, dilations, Y)
    if transform is None:
        return None
    res_arg = res_strides = None
    if epilogue.residual is not None:
        R = graph.values[epilogue.residual]
        res_arg = np.ascontiguousarray(np.asarray(R.data, dtype=np.float32)) if R.is_const else R.name
        res_strides = tuple(broadcast_strides(R.shape, Y.shape))
    return Lowered(winograd_bf16.lower_winograd_bf16(node, graph, transform, lowp, X, W, B, Y, pads, res_arg,
                                                     res_strides, epilogue))


def _gemm_paths(node, graph, dtype, X, W, B, Y, group, kernel, strides, dilations, pads, res_arg, res_strides,
                epilogue, pointwise, in_place_residual) -> Lowered | None:
    """The conv on one of the GEMM-shaped kernels (Winograd, convsmall.py, dwstride.py,
    convgemm.py) when one takes it, else None (the pointwise GEMM or the direct kernel)."""
    lowp = convgemm.lowp_conv(node, group, int(X.shape[1]) // group) if len(X.shape) == 4 else None
    bf16_winograd = _bf16_winograd(node, graph, lowp, X, W, B, Y, group, epilogue)
    if bf16_winograd is not None:
        return bf16_winograd
    transform = winograd.choose(dtype, X, W, group, kernel, strides, dilations, Y, node.attr("select")) \
        if W.is_const and _float32_winograd(node, lowp) else None
    if transform is not None:
        return Lowered(winograd.lower_winograd(node, graph, transform, X, W, B, Y, pads, res_arg, res_strides,
                                               epilogue))
    # A conv marked bf16/fp16 (passes/assign_precision.py) takes the implicit GEMM where it can, 1x1
    # convs included (one tap): its micro-kernels are the reduced-precision ones.
    lowp = convgemm.lowp_conv(node, group, int(X.shape[1]) // group)
    gemm_ok = W.is_const and len(X.shape) == 4 and convgemm.eligible(dtype, X, W, group, kernel, strides, dilations, Y) \
        and (res_strides is None or convgemm.flat_residual(res_strides, Y.shape[2:]))
    lowp = lowp if gemm_ok else None
    if not lowp and convim2col.prefer(X, W, B, Y, group, kernel, strides, dilations, res_strides is not None):
        return Lowered(convim2col.lower_im2col(node, graph, X, W, B, Y, kernel, strides, dilations, pads, lower_conv))
    if not lowp and convsmall.eligible(X, W, B, group, kernel, strides, dilations, pads, Y, res_strides, pointwise):
        return Lowered(convsmall.lower_conv_small(node, graph, X, W, B, Y, group, kernel, strides, dilations, pads,
                                                  res_arg, res_strides, epilogue, pointwise))
    if dwlanes.prefer(dtype, X, W, B, group, kernel, strides, dilations, Y, epilogue):
        return Lowered([dwlanes.lower_dw_lanes(node, graph, X, W, B, Y, kernel, pads)])
    if dwstride.eligible(dtype, X, W, B, group, kernel, strides, dilations, Y, epilogue):
        return Lowered([dwstride.lower_dw_rows(node, X, W, B, Y, kernel, strides, pads, epilogue)])
    if gemm_ok and (lowp or not pointwise):
        calls = convgemm.lower_conv_gemm(node, graph, X, W, B, Y, group, kernel, strides, dilations, pads,
                                         res_arg, res_strides, epilogue, lowp=lowp)
        if in_place_residual:
            # The scratch the conv reads is already in the graph: only the conv call has another form.
            form = convgemm.lower_conv_gemm(node, graph, X, W, B, Y, group, kernel, strides, dilations, pads,
                                            None, None, epilogue, accumulate=True, scratch=calls[-1].args[0],
                                            lowp=lowp)[-1]
            calls[-1].in_place = InPlace(res_arg, form.kernel, form.args, form.work)
        return Lowered(calls)
    return None


def _flat_spatial(strides, dims):
    """The stride of a flat index over the spatial dims (0 or the last dim's stride) when the
    spatial dims read linearly (or not at all); None otherwise."""
    strides, dims = list(strides), list(dims)
    if all(v == 0 for v in strides):
        return 0
    if all(strides[i] == strides[i + 1] * dims[i + 1] for i in range(len(dims) - 1)):
        return strides[-1]
    return None


def pointwise_kernel(dtype, N, C, OC, group, pixels, has_bias, res_strides=None, out_spatial=(), epilogue=None,
                      weights=None, accumulate=False, packed=None, out_batch_stride=None):
    """1x1 conv as a GEMM batched over (image, group): A = W[g] (OCg x ICg), B = X[n, g] (ICg x pixels).
    Returns the kernel, its work size and the weights packed into micro-kernel panels (or None: W as is);
    `packed`: those panels from an earlier call for the same weights (not packed again);
    `out_batch_stride`: elements between the output's images (default OC x pixels: contiguous)."""
    icg, ocg = C // group, OC // group
    a = Operand((0, ocg * icg), icg, 1)
    b = Operand((C * pixels, icg * pixels), pixels, 1)
    c = Operand((0, ocg), 1, 0) if has_bias else None
    out = Operand((OC * pixels if out_batch_stride is None else out_batch_stride, ocg * pixels), pixels, 1)
    r = None
    if res_strides is not None:
        sn, sc = res_strides[:2]
        r = Operand((sn, ocg * sc), sc, _flat_spatial(res_strides[2:], out_spatial))
    if uk_eligible(dtype, ocg, pixels, icg, a, b):
        if weights is not None:
            if packed is None:
                packed = pack_a_panels(np.asarray(weights, dtype=np.float32).reshape(group, ocg, icg),
                                       choose_tile(ocg, pixels)[0])
            a = Operand((0, packed[0].size), icg, 1)
            return (*uk_gemm_kernel("Conv", ocg, pixels, icg, (N, group), a, b, c, out, residual=r,
                                    epilogue=epilogue, a_panels=True, accumulate=accumulate), packed)
        return (*uk_gemm_kernel("Conv", ocg, pixels, icg, (N, group), a, b, c, out, residual=r, epilogue=epilogue,
                                accumulate=accumulate), None)
    return (*gemm_kernel("Conv", dtype, ocg, pixels, icg, (N, group), a, b, c, out, residual=r, epilogue=epilogue),
            None)


@dataclass
class _Geometry:
    """Everything a direct-conv kernel is specialised to (spatial lists are per spatial dim)."""
    dtype: np.dtype
    C: int
    OC: int
    icg: int
    ocg: int
    ocb: int             # output channels per work item
    in_spatial: list
    out_spatial: list
    kernel: list
    strides: list
    dilations: list
    pads: list           # begin pads
    has_bias: bool
    res_strides: tuple | None = None   # residual's element strides over (N, OC, *out_spatial), or None
    epilogue: Epilogue | None = None

    def __post_init__(self):
        self.lead = list(range(len(self.in_spatial) - 1))  # spatial dims above the column dim
        self.in_strides = dims_strides(self.in_spatial)
        self.in_plane = int(np.prod(self.in_spatial))
        self.out_plane = int(np.prod(self.out_spatial))
        self.ksize = int(np.prod(self.kernel))
        self.IW, self.OW = self.in_spatial[-1], self.out_spatial[-1]
        self.KW, self.SW, self.DW, self.PW = self.kernel[-1], self.strides[-1], self.dilations[-1], self.pads[-1]
        # Columns where tap kw reads inside the input: ow in [col_lo[kw], col_hi[kw]).
        self.col_lo = [max(0, ceil_div(self.PW - kw * self.DW, self.SW)) for kw in range(self.KW)]
        self.col_hi = [min(self.OW, (self.IW - 1 + self.PW - kw * self.DW) // self.SW + 1) for kw in range(self.KW)]
        self.inner_lo, self.inner_hi = max(self.col_lo), min(self.col_hi)
        if self.inner_lo >= self.inner_hi:
            self.inner_lo = self.inner_hi = 0
            self.border = list(range(self.OW))
        else:
            self.border = list(range(self.inner_lo)) + list(range(self.inner_hi, self.OW))
        # Leading output indices whose whole kernel window is inside the input: [lo, hi) per dim.
        self.interior = []
        for d in self.lead:
            lo = ceil_div(self.pads[d], self.strides[d])
            hi = min(self.out_spatial[d],
                     (self.in_spatial[d] - 1 + self.pads[d] - (self.kernel[d] - 1) * self.dilations[d]) // self.strides[d] + 1)
            self.interior.append((lo, max(lo, hi)))
        self.all_interior = all(lo == 0 and hi == self.out_spatial[d] for d, (lo, hi) in zip(self.lead, self.interior))
        self.none_interior = any(lo >= hi for lo, hi in self.interior)
        self.flat = (len(self.lead) == 1 and self.SW == 1 and self.strides[0] == 1 and self.IW == self.OW
                     and self.inner_hi > self.inner_lo and not self.none_interior)

    def edge_rows(self) -> dict[int, tuple]:
        """2-D: output rows whose kernel window leaves the input -> their valid kernel rows, when few
        enough (and the kernel small enough) to give each fused code of its own; else {}."""
        if len(self.lead) != 1 or self.none_interior or self.ksize > max(1, WEIGHT_REGS // self.ocb):
            return {}
        lo, hi = self.interior[0]
        rows = list(range(lo)) + list(range(hi, self.out_spatial[0]))
        if len(rows) > FUSED_EDGE_ROWS:
            return {}
        S, P, D, I = self.strides[0], self.pads[0], self.dilations[0], self.in_spatial[0]
        return {r: tuple(k for k in range(self.kernel[0]) if 0 <= r * S - P + k * D < I) for r in rows}

    @property
    def masked_kw(self) -> list[int]:
        """Kernel columns that are invalid somewhere in a row: the flat loop masks their sums."""
        return [kw for kw in range(self.KW) if self.col_lo[kw] > 0 or self.col_hi[kw] < self.OW] if self.flat else []

    def column_masks(self) -> np.ndarray:
        """mask[i, oh*OW + ow] = 1 where masked kernel column i reads inside the input, else 0."""
        cols = np.arange(self.out_plane) % self.OW
        return np.stack([((cols >= self.col_lo[kw]) & (cols < self.col_hi[kw])) for kw in self.masked_kw]).astype(self.dtype)

    def tap_offsets(self, ks):
        """Input offset of kernel index ks relative to kernel index 0."""
        return sum(k * d * st for k, d, st in zip(ks, self.dilations, self.in_strides))


def direct_conv_kernel(dtype, N, C, OC, group, in_spatial, out_spatial, kernel, strides, dilations, pads,
                       has_bias, res_strides=None, epilogue=None) -> tuple[Kernel, int, np.ndarray | None]:
    """The direct conv kernel, its work size, and the column masks it reads (None if it reads none).
    Pointers: X, W, [bias], [masks], [residual], Y."""
    icg, ocg = C // group, OC // group
    g = _Geometry(np.dtype(dtype), C, OC, icg, ocg, OC_BLOCK if ocg % OC_BLOCK == 0 else 1, [int(v) for v in in_spatial],
                  [int(v) for v in out_spatial], list(kernel), list(strides), list(dilations), list(pads), has_bias,
                  tuple(res_strides) if res_strides is not None else None, epilogue)
    rows_total = int(np.prod(g.out_spatial[:-1])) if g.lead else 1
    items = N * OC // g.ocb
    splits = min(rows_total, ceil_div(MIN_ITEMS, items)) if items < MIN_ITEMS else 1
    rows_per_split = ceil_div(rows_total, splits)
    splits = ceil_div(rows_total, rows_per_split)

    n_ptrs = 3 + has_bias + bool(g.masked_kw) + (g.res_strides is not None)
    src = Source().line(kernel_header(n_ptrs)).indent()
    src.line("for item in range(begin, end):").indent()
    if splits > 1:
        src.line(f"split = item % {splits}").line(f"blk = item // {splits}")
        src.line(f"r_lo = split * {rows_per_split}").line(f"r_hi = min(r_lo + {rows_per_split}, {rows_total})")
    else:
        src.line("blk = item").line("r_lo = 0").line(f"r_hi = {rows_total}")
    blocks_per_image = OC // g.ocb
    src.line(f"oc0 = (blk % {blocks_per_image})*{g.ocb}").line(f"n = blk // {blocks_per_image}")
    g_term = f" + (oc0 // {ocg})*{icg}" if group > 1 else ""
    src.line(f"x_base = (n*{C}{g_term})*{g.in_plane}")
    src.line(f"w_base0 = oc0*{icg * g.ksize}")
    src.line(f"o_base0 = (n*{OC} + oc0)*{g.out_plane}")
    # Output ranges [lo, hi) set to the bias before the taps add up and given the epilogue after:
    # all of them, or, when the flat loop sums every tap at once, only what it does not write
    # itself (one pass over the rest of the output instead of three).
    ranges = [(f"r_lo*{g.OW}", f"r_hi*{g.OW}")]
    single = _single_pass(g)
    if single:
        lo, hi = g.interior[0]
        src.line(f"fl_lo = max(r_lo, {lo})*{g.OW} + {g.inner_lo}").line(f"fl_hi = (min(r_hi, {hi}) - 1)*{g.OW} + {g.inner_hi}")
        src.line("if fl_hi <= fl_lo:").indent().line(f"fl_lo = r_hi*{g.OW}").line("fl_hi = fl_lo").dedent()
        ranges = [(f"r_lo*{g.OW}", "fl_lo"), ("fl_hi", f"r_hi*{g.OW}")]
    with _per_channel(src, g):
        for lo, hi in ranges:
            src.line(f"for f in range({lo}, {hi}):").indent()
            src.line(f"{_py(g)}[o_base + f] = bias{_residual_term(src, g)}").dedent()
    if g.flat:
        _flat_rows(src, g, assign=single)
    else:
        _row_by_row(src, g)
    if g.epilogue is not None and g.epilogue.active:
        with _per_channel(src, g, bias=False):
            for lo, hi in ranges:
                src.line(f"for f in range({lo}, {hi}):").indent()
                src.line(f"v = {_py(g)}[o_base + f]")
                src.line(f"{_py(g)}[o_base + f] = {g.epilogue.expr('v', g.dtype)}").dedent()
    mask = g.column_masks() if g.masked_kw else None
    return Kernel("Conv", src.text(), tuple([g.dtype.name] * n_ptrs), self_sized=True), items * splits, mask


_PX, _PW, _PB = "p0", "p1", "p2"


def _pm(g):
    return "p3" if g.has_bias else "p2"


def _py(g):
    return f"p{2 + g.has_bias + bool(g.masked_kw) + (g.res_strides is not None)}"


def _pr(g):
    return f"p{2 + g.has_bias + bool(g.masked_kw)}"


def _residual_term(src, g) -> str:
    """` + R[...]` for output element (n, oc, flat index f), emitting index lines into src if needed."""
    if g.res_strides is None:
        return ""
    sn, sc = g.res_strides[:2]
    base = " + ".join(t for t in (f"n*{sn}" if sn else "", f"oc*{sc}" if sc else "") if t) or "0"
    flat = _flat_spatial(g.res_strides[2:], g.out_spatial)
    if flat is not None:
        return f" + {_pr(g)}[{base}{'' if flat == 0 else (' + f' if flat == 1 else f' + f*{flat}')}]"
    terms, rest = [], "f"
    for d in range(len(g.out_spatial) - 1, -1, -1):
        stride = g.res_strides[2 + d]
        if d == 0:
            src.line(f"rc{d} = {rest}")
        else:
            src.line(f"rc{d} = {rest} % {g.out_spatial[d]}").line(f"rq{d} = {rest} // {g.out_spatial[d]}")
            rest = f"rq{d}"
        if stride:
            terms.append(f"rc{d}*{stride}")
    return f" + {_pr(g)}[{' + '.join([base] + terms)}]"


class _per_channel:
    """`with _per_channel(src, g):` emits a loop over the item's output channels that sets
    `oc`, `o_base`, `w_base` and `bias` for the body."""

    def __init__(self, src, g, bias=True):
        self.src, self.g, self.bias = src, g, bias

    def __enter__(self):
        src, g = self.src, self.g
        if g.ocb > 1:
            src.line(f"for jo in range({g.ocb}):").indent()
            src.line("oc = oc0 + jo").line(f"o_base = o_base0 + jo*{g.out_plane}")
            src.line(f"w_base = w_base0 + jo*{g.icg * g.ksize}")
        else:
            src.line("oc = oc0").line("o_base = o_base0").line("w_base = w_base0")
        if self.bias:
            src.line(f"bias = {_PB}[oc]" if g.has_bias else f"bias = {literal(0, g.dtype)}")

    def __exit__(self, *exc):
        if self.g.ocb > 1:
            self.src.dedent()


def _row_start(src, g, o_base):
    """Decode the leading output indices of flat row `r`; set `orow` (output row offset from `o_base`)
    and `xrow` (input offset of kernel index 0 at output column 0)."""
    rest = "r"
    for d in reversed(g.lead):
        size = g.out_spatial[d]
        if d == g.lead[0]:
            src.line(f"o{d} = {rest}")
        else:
            src.line(f"o{d} = {rest} % {size}").line(f"oq{d} = {rest} // {size}")
            rest = f"oq{d}"
    src.line(f"orow = {o_base} + r*{g.OW}")
    terms = ["x_base"] + [f"(o{d}*{g.strides[d]} - {g.pads[d]})*{g.in_strides[d]}" for d in g.lead]
    src.line(f"xrow = {' + '.join(terms)}" + (f" - {g.PW}" if g.PW else ""))


def _row_by_row(src, g):
    """Each row: fused blocks (rows whose kernel window is inside) or per-tap loops."""
    src.line("for r in range(r_lo, r_hi):").indent()
    _row_start(src, g, "o_base0")
    row_border = [(ow, None) for ow in g.border]
    if not g.lead or g.all_interior:
        _fused_blocks(src, g, g.inner_lo, g.inner_hi, row_border)
    elif g.none_interior:
        _per_tap_all(src, g)
    else:
        cond = " and ".join(f"o{d} >= {lo} and o{d} < {hi}" for d, (lo, hi) in zip(g.lead, g.interior))
        src.line(f"if {cond}:").indent()
        _fused_blocks(src, g, g.inner_lo, g.inner_hi, row_border)
        src.dedent()
        _edge_rows(src, g, "elif")
    src.dedent()


def _edge_rows(src, g, keyword):
    """The rest of an if-chain over a row that is not interior, `keyword` being "if" (a new chain)
    or "elif" (continuing one): fused code per edge row (the last one takes the `else`), or
    per-tap loops when there are no edge rows with code of their own."""
    edges = list(g.edge_rows().items())
    bodies = [(f"r == {r}", lambda kh=kh: _edge_row(src, g, kh)) for r, kh in edges] or [(None, lambda: _per_tap_all(src, g))]
    for i, (cond, body) in enumerate(bodies):
        last = i == len(bodies) - 1
        if last and keyword == "if" and i == 0:
            body()  # the only case of a new chain: no test needed
            return
        src.line("else:" if last else f"{keyword} {cond}:").indent()
        body()
        src.dedent()
        keyword = "elif"


def _edge_row(src, g, kh_valid):
    if kh_valid:
        _fused_blocks(src, g, g.inner_lo, g.inner_hi, [(ow, None) for ow in g.border], kh_valid=kh_valid)
    else:
        src.line("pass")  # the kernel window is all padding: the row is the bias


def _single_pass(g) -> bool:
    """Whether the flat loop sums all of an output's taps in one pass (one block of taps: a
    depthwise conv), so it can store bias + sum, with the epilogue, instead of adding to it."""
    if not g.flat or g.res_strides is not None:
        return False
    per_oc = max(1, WEIGHT_REGS // g.ocb)
    return g.icg == 1 and g.ksize <= per_oc


def _flat_rows(src, g, assign=False):
    """2-D, stride 1, OW == IW: one inner loop from the first inner column of the first interior row
    to the last inner column of the last one. Its reads stay inside the plane (both ends do); at the
    border columns it crosses, a kernel column reading across the row edge has its sum multiplied
    by a 0/1 column mask. The partial first and last rows' border columns are single statements."""
    lo, hi = g.interior[0]
    OW = g.OW
    src.line(f"ra = max(r_lo, {lo})").line(f"rb = min(r_hi, {hi})")
    src.line("if ra < rb:").indent()
    src.line("orow = o_base0").line(f"xrow = x_base - {g.pads[0] * g.IW + g.PW}")
    src.line(f"fa = ra*{OW}").line(f"fb = (rb - 1)*{OW}")
    border = [(ow, "fa") for ow in range(g.inner_lo)] + [(ow, "fb") for ow in range(g.inner_hi, OW)]
    _fused_blocks(src, g, f"fa + {g.inner_lo}", f"fb + {g.inner_hi}", border, masks=True, assign=assign)
    src.dedent()
    if lo > 0 or hi < g.out_spatial[0]:
        src.line("for r in range(r_lo, r_hi):").indent()
        src.line("if r < ra or r >= rb:").indent()
        _row_start(src, g, "o_base0")
        _edge_rows(src, g, "if")
        src.dedent().dedent()


def _blocks(g, kh_valid=None):
    """How taps are grouped in passes over an output row.

    Returns (header, taps, remainder): `header(src)` emits the block loop (returns whether it
    opened one) and the runtime bases `xb` (input offset, relative to the row) and `wb`
    (weight offset of the block's first output channel); `taps` are (x offset, weight offset, kw)
    with compile-time offsets; `remainder` is None or (xb expr, wb expr, taps) for a last partial
    block of channels."""
    per_oc = max(1, WEIGHT_REGS // g.ocb)
    lead = g.lead

    def channel_taps(n_channels):
        return [(i * g.in_plane + g.tap_offsets(ks), i * g.ksize + t, ks[-1])
                for i in range(n_channels) for t, ks in enumerate(np.ndindex(*g.kernel))
                if kh_valid is None or ks[0] in kh_valid]

    if g.ksize <= per_oc or not lead:
        taps_per_channel = g.ksize if kh_valid is None else len(kh_valid) * (g.ksize // g.kernel[0])
        icb = max(1, min(g.icg, per_oc // taps_per_channel))
        n_full, rem = divmod(g.icg, icb)

        def header(src):
            if n_full == 1:
                src.line("xb = xrow").line("wb = w_base0")
                return False
            src.line(f"for icb in range({n_full}):").indent()
            src.line(f"xb = xrow + icb*{icb * g.in_plane}").line(f"wb = w_base0 + icb*{icb * g.ksize}")
            return True
        remainder = None
        if rem:
            remainder = (f"xrow + {n_full * icb * g.in_plane}", f"w_base0 + {n_full * icb * g.ksize}", channel_taps(rem))
        return header, channel_taps(icb), remainder
    # Large kernels: a block is `rows` consecutive rows of the last leading kernel dim, in one channel.
    kh = g.kernel[-2]
    rows = max(r for r in range(1, kh + 1) if kh % r == 0 and (r * g.KW <= per_oc or r == 1))
    groups_per_channel = (g.ksize // g.KW) // rows
    taps = [(j * g.dilations[-2] * g.in_strides[-2] + kw * g.DW, j * g.KW + kw, kw)
            for j in range(rows) for kw in range(g.KW)]

    def header(src):
        src.line(f"for blk in range({g.icg * groups_per_channel}):").indent()
        src.line(f"ic = blk // {groups_per_channel}")
        src.line(f"kr0 = (blk % {groups_per_channel}) * {rows}")  # first kernel row (flat over leading dims)
        terms, rest = [], "kr0"
        for d in reversed(lead):
            if d == lead[0]:
                src.line(f"kl{d} = {rest}")
            else:
                src.line(f"kl{d} = {rest} % {g.kernel[d]}").line(f"kq{d} = {rest} // {g.kernel[d]}")
                rest = f"kq{d}"
            terms.append(f"kl{d}*{g.dilations[d] * g.in_strides[d]}")
        src.line(f"xb = xrow + ic*{g.in_plane} + {' + '.join(terms)}")
        src.line(f"wb = w_base0 + ic*{g.ksize} + kr0*{g.KW}")
        return True
    return header, taps, None


def _fused_blocks(src, g, loop_lo, loop_hi, border, kh_valid=None, masks=False, assign=False):
    """Every block of taps over columns [loop_lo, loop_hi) of the row at `orow`, then the `border`
    columns; only kernel rows `kh_valid` (2-D) when given; column masks in the flat loop; with
    `assign` (one block: see _single_pass) the loop stores act(bias + sum)."""
    header, taps, remainder = _blocks(g, kh_valid)
    opened = header(src)
    assert not assign or (not opened and remainder is None)
    _fused_taps(src, g, taps, loop_lo, loop_hi, border, masks, assign)
    if opened:
        src.dedent()
    if remainder is not None:
        xb, wb, rem_taps = remainder
        src.line(f"xb = {xb}").line(f"wb = {wb}")
        _fused_taps(src, g, rem_taps, loop_lo, loop_hi, border, masks)


def _fused_taps(src, g, taps, loop_lo, loop_hi, border, masks, assign=False):
    """One pass: weights to scalars, the branch-free inner loop (inputs loaded once for all output
    channels, before any store), then the `border` columns (ow, extra row offset or None) with
    their valid taps."""
    per_oc = g.icg * g.ksize
    for j in range(g.ocb):
        for t, (_, w_off, _) in enumerate(taps):
            src.line(f"w{j}_{t} = {_PW}[{_add('wb', j * per_oc + w_off)}]")
        if assign:
            src.line(f"b{j} = " + (f"{_PB}[oc0 + {j}]" if g.has_bias else literal(0, g.dtype)))
    col = "ow" if g.SW == 1 else f"ow*{g.SW}"
    py = _py(g)
    masked = {kw: i for i, kw in enumerate(g.masked_kw)} if masks else {}
    if isinstance(loop_lo, str) or loop_hi > loop_lo:
        src.line(f"for ow in range({loop_lo}, {loop_hi}):").indent()
        for t, (x_off, _, _) in enumerate(taps):
            src.line(f"x{t} = {_PX}[{_add(f'xb + {col}', x_off)}]")
        used = sorted({kw for _, _, kw in taps} & set(masked))
        for kw in used:
            src.line(f"m{kw} = {_pm(g)}[{_add('ow', masked[kw] * g.out_plane)}]")
        for j in range(g.ocb):
            sums = []
            for kw in sorted({kw for _, _, kw in taps}):
                products = " + ".join(f"w{j}_{t} * x{t}" for t, (_, _, k) in enumerate(taps) if k == kw)
                sums.append(f"({products}) * m{kw}" if kw in masked else products)
            if assign:
                src.line(f"v = b{j} + {' + '.join(sums)}")
                epi = g.epilogue.expr("v", g.dtype) if g.epilogue is not None and g.epilogue.active else "v"
                src.line(f"{py}[{_add('orow + ow', j * g.out_plane)}] = {epi}")
            else:
                src.line(f"{py}[{_add('orow + ow', j * g.out_plane)}] += {' + '.join(sums)}")
        src.dedent()
    for ow, row in border:
        valid = [(t, x_off) for t, (x_off, _, kw) in enumerate(taps) if 0 <= ow * g.SW - g.PW + kw * g.DW < g.IW]
        base = f" + {row}" if row else ""
        for j in range(g.ocb if valid else 0):
            terms = " + ".join(f"w{j}_{t} * {_PX}[{_add('xb' + base, x_off + ow * g.SW)}]" for t, x_off in valid)
            src.line(f"{py}[{_add('orow' + base, ow + j * g.out_plane)}] += {terms}")


def _add(expr, offset):
    return f"{expr} + {offset}" if offset else expr


def _per_tap_all(src, g):
    """Rows whose kernel window leaves the input, for every output channel of the item:
    valid kernel ranges at run time, one loop per tap."""
    py = _py(g)
    for d in g.lead:
        # i = o*s - p + k*d must lie in [0, I): k in [ceil(-base/d), floor((I-1-base)/d)].
        dil = g.dilations[d]
        src.line(f"base{d} = o{d}*{g.strides[d]} - {g.pads[d]}")
        src.line(f"k{d}_lo = max(0, (-base{d} + {dil - 1}) // {dil})" if dil > 1 else f"k{d}_lo = max(0, -base{d})")
        src.line(f"k{d}_hi = min({g.kernel[d]}, ({g.in_spatial[d] - 1} - base{d}) // {dil} + 1)" if dil > 1
                 else f"k{d}_hi = min({g.kernel[d]}, {g.in_spatial[d]} - base{d})")
    with _per_channel(src, g):
        src.line(f"orow_c = orow + {'jo' if g.ocb > 1 else '0'}*{g.out_plane}")
        src.line(f"for ic in range({g.icg}):").indent()
        src.line(f"xk = xrow + ic*{g.in_plane}").line(f"wk = w_base + ic*{g.ksize}")
        k_strides = dims_strides(g.kernel)
        for d in g.lead:
            src.line(f"for k{d} in range(k{d}_lo, k{d}_hi):").indent()
        src.line(f"xt = {' + '.join(['xk'] + [f'k{d}*{g.dilations[d] * g.in_strides[d]}' for d in g.lead])}")
        src.line(f"wt = {' + '.join(['wk'] + [f'k{d}*{k_strides[d]}' for d in g.lead])}")
        col = "ow" if g.SW == 1 else f"ow*{g.SW}"
        for kw in range(g.KW):
            if g.col_hi[kw] <= g.col_lo[kw]:
                continue
            src.line(f"wv = {_PW}[{_add('wt', kw)}]")
            src.line(f"for ow in range({g.col_lo[kw]}, {g.col_hi[kw]}):").indent()
            src.line(f"{py}[orow_c + ow] += wv * {_PX}[{_add(f'xt + {col}', kw * g.DW)}]")
            src.dedent()
        for _ in g.lead:
            src.dedent()
        src.dedent()
