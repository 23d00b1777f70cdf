"""Reductions over axes and along one axis.

- ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare: the input's
  dims are classed kept or reduced, adjacent dims of one class merged. A work
  item is one output element; it walks the reduced dims (innermost last, so a
  reduction over trailing dims is unit-stride) from the op's identity, so an
  empty reduction gives the identity (0, 1, -inf, inf) as numpy does.
  Floats accumulate in their own type (as onnxruntime does); integers in
  int64/uint64 and are converted once, at the end.
- ArgMax/ArgMin: the first (or last, `select_last_index`) extreme index.
- CumSum, CumProd: running sums / products along one axis (`exclusive`,
  `reverse`); a work item is one outer index, the inner dims innermost so the
  update is unit-stride.
- TopK: k selection passes over each slice, each taking the best element
  ordered after the previous pick (value, then lower index first); O(k * n)
  but needs no scratch memory.
- LogSoftmax and Hardmax: along one axis, with the opset < 13 flattening.
- NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss: one work item, with
  ONNX's reference semantics for weights, ignore_index and the reductions.
- LRN (a sum of squares over a channel window) and DFT (a direct sum in
  float64, forward / inverse / one-sided).
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .elementwise import check_dtypes, compute_type, is_narrow, load, pointer_type, store, with_helpers
from .kernel import Kernel, KernelCall, Lowered, Source, const_input, dims_strides, kernel_header, literal

# op: (initial accumulator, per-element update of `acc` with `v`, final expression of acc and n)
_REDUCTIONS = {
    "ReduceSum": ("ZERO", "acc + v", "acc"),
    "ReduceMean": ("ZERO", "acc + v", "acc / N"),
    "ReduceMax": ("LOWEST", "v if v > acc else acc", "acc"),
    "ReduceMin": ("HIGHEST", "v if v < acc else acc", "acc"),
    "ReduceProd": ("ONE", "acc * v", "acc"),
    "ReduceL1": ("ZERO", "acc + abs(v)", "acc"),
    "ReduceL2": ("ZERO", "acc + v * v", "math.sqrt(acc)"),
    "ReduceLogSum": ("ZERO", "acc + v", "math.log(acc)"),
    "ReduceSumSquare": ("ZERO", "acc + v * v", "acc"),
    "ReduceLogSumExp": None,  # two passes, see _reduce_kernel
}


def reduce_axes(node, graph) -> list[int] | None:
    """Normalised reduction axes; None means 'no reduction' (noop_with_empty_axes)."""
    rank = len(graph.values[node.inputs[0]].shape)
    axes = const_input(node, graph, 1, "axes")
    if axes is None:
        axes = node.attr("axes")
    axes = [] if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    if not axes:
        return None if node.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted({a + rank if a < 0 else a for a in axes})


def _groups(shape, axes):
    """Merge adjacent dims of the same class; returns [(size, stride, reduced)]."""
    strides = dims_strides(shape)
    groups = []
    for d, (size, stride) in enumerate(zip(shape, strides)):
        reduced = d in axes
        if size == 1:
            continue
        if groups and groups[-1][2] == reduced:
            groups[-1] = (groups[-1][0] * size, stride, reduced)
        else:
            groups.append((int(size), stride, reduced))
    return groups


def _is_float(dtype) -> bool:
    """float16/32/64 and the narrow floats (bfloat16, float8: numpy kind 'V'), computed in a float."""
    return compute_type(dtype).kind == "f"


def _acc_type(dtype) -> str:
    dtype = np.dtype(dtype)
    if _is_float(dtype):
        return compute_type(dtype).name
    return "uint64" if dtype.kind in "ub" or dtype.name.startswith("uint") else "int64"


def _limits(dtype):
    dtype = np.dtype(dtype)
    if _is_float(dtype):
        return float("-inf"), float("inf")
    if dtype.kind == "b":
        return 0, 1
    if is_narrow(dtype):  # int4, uint4...: ml_dtypes knows their range
        import ml_dtypes
        info = ml_dtypes.iinfo(dtype)
    else:
        info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _reduce_kernel(op, x_shape, axes, in_dtype, out_dtype) -> tuple[Kernel, int]:
    groups = _groups(x_shape, axes)
    kept = [(s, st) for s, st, r in groups if not r]
    reduced = [(s, st) for s, st, r in groups if r]
    n = int(np.prod([s for s, _ in reduced], dtype=np.int64)) if reduced else 1
    if any(int(d) == 0 for d in x_shape):
        n = int(np.prod([int(x_shape[a]) for a in axes], dtype=np.int64))
    work = int(np.prod([s for s, _ in kept], dtype=np.int64)) if kept else 1
    acc_t = _acc_type(in_dtype)
    is_float = _is_float(in_dtype)
    lowest, highest = _limits(in_dtype)
    consts = {"ZERO": literal(0, acc_t), "ONE": literal(1, acc_t),
              "LOWEST": literal(lowest, acc_t), "HIGHEST": literal(highest, acc_t)}
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    # The input offset of output element w: decompose w over the kept groups.
    terms, below = [], 1
    for size, stride in reversed(kept):
        idx = "w" if below == 1 else f"(w // {below})"
        if below * size != work:
            idx = f"({idx} % {size})"
        terms.append(f"{idx} * {stride}")
        below *= size
    src.line(f"base = {' + '.join(reversed(terms)) if terms else '0'}")
    names = [f"r{k}" for k in range(len(reduced))]

    def walk(body):
        depth = 0
        for name, (size, _) in zip(names, reduced):
            src.line(f"for {name} in range({size}):").indent()
            depth += 1
        offset = " + ".join(["base"] + [f"{nm} * {st}" if st != 1 else nm for nm, (_, st) in zip(names, reduced)])
        value = load("p0", offset, in_dtype)
        src.line(f"v = {value}" if is_float else f"v = np.{acc_t}({value})")
        for line in body:
            src.line(line)
        for _ in range(depth):
            src.dedent()

    if op == "ReduceLogSumExp":
        src.line(f"m = {consts['LOWEST']}")
        walk(["m = v if v > m else m"])
        src.line(f"if m == {consts['LOWEST']}:").indent().line(f"m = {consts['ZERO']}").dedent()
        src.line(f"acc = {consts['ZERO']}")
        walk(["acc += math.exp(v - m)"])
        final = "math.log(acc) + m"
    else:
        init, update, final = _REDUCTIONS[op]
        src.line(f"acc = {consts[init]}")
        walk([f"acc = {update}"])
        final = final.replace("N", literal(n, acc_t) if is_float else str(n))
    if not is_float and op in ("ReduceMean", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp"):
        final = final.replace("acc", "np.float64(acc)")  # numpy's mean/sqrt/log of integers, then truncated
    src.line(store("p1", "w", final, out_dtype))
    return Kernel(op, with_helpers(src.text()), (pointer_type(in_dtype), pointer_type(out_dtype))), work


def lower_reduce(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y], float16=True)
    axes = reduce_axes(node, graph)
    if axes is None:  # noop_with_empty_axes: the output is the input
        axes = []
    kernel, work = _reduce_kernel(node.op, tuple(int(d) for d in x.shape), axes, x.dtype, y.dtype)
    if y.size == 0:
        work = 0
    return Lowered([KernelCall(kernel, [x.name, y.name], work, node.name)])


# -- ArgMax / ArgMin --------------------------------------------------------------------------

def _outer_n_inner(shape, axis):
    shape = [int(d) for d in shape]
    return (int(np.prod(shape[:axis], dtype=np.int64)), shape[axis] if shape else 1,
            int(np.prod(shape[axis + 1:], dtype=np.int64)))


def _axis(node, rank, default=0):
    axis = int(node.attr("axis", default))
    return axis + rank if axis < 0 else axis


def lower_arg_extreme(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x])
    outer, n, inner = _outer_n_inner(x.shape, _axis(node, len(x.shape)))
    better = ">" if node.op == "ArgMax" else "<"
    if node.attr("select_last_index", 0):
        better += "="
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"o = w // {inner}" if inner > 1 else "o = w")
    src.line(f"j = w % {inner}" if inner > 1 else "j = 0")
    src.line(f"base = o * {n * inner} + j")
    src.line("best = p0[base]").line("arg = 0")
    src.line(f"for k in range(1, {n}):").indent()
    src.line(f"v = p0[base + k * {inner}]")
    src.line(f"if v {better} best:").indent().line("best = v").line("arg = k").dedent().dedent()
    src.line("p1[w] = np.int64(arg)")
    kernel = Kernel(node.op, src.text(), (pointer_type(x.dtype), "int64"))
    work = outer * inner if n > 0 else 0
    return Lowered([KernelCall(kernel, [x.name, y.name], work, node.name)])


# -- CumSum -----------------------------------------------------------------------------------

def lower_cumsum(node, graph) -> Lowered:
    """CumSum and CumProd."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y])
    axis_data = const_input(node, graph, 1, "axis")
    rank = len(x.shape)
    axis = int(axis_data.reshape(-1)[0]) if axis_data is not None else 0
    axis = axis + rank if axis < 0 else axis
    outer, n, inner = _outer_n_inner(x.shape, axis)
    exclusive, reverse = bool(node.attr("exclusive", 0)), bool(node.attr("reverse", 0))
    op, identity = ("*", 1) if node.op == "CumProd" else ("+", 0)
    t = np.dtype(x.dtype).name
    src = Source().line(kernel_header(2)).indent()
    src.line("for o in range(begin, end):").indent()
    src.line(f"base = o * {n * inner}")
    order = f"range({n} - 1, -1, -1)" if reverse else f"range({n})"
    step = f"-{inner}" if reverse else f"{inner}"
    src.line("first = True")
    src.line(f"for k in {order}:").indent()
    src.line(f"row = base + k * {inner}")
    src.line("if first:").indent()
    src.line(f"for j in range({inner}):").indent()
    src.line(f"p1[row + j] = {literal(identity, t)}" if exclusive else "p1[row + j] = p0[row + j]").dedent()
    src.line("first = False").dedent()
    src.line("else:").indent()
    prev = f"row - {step}" if not reverse else f"row + {inner}"
    src.line(f"for j in range({inner}):").indent()
    read = f"p0[{prev} + j]" if exclusive else "p0[row + j]"
    src.line(f"p1[row + j] = np.{t}(p1[{prev} + j] {op} {read})")
    kernel = Kernel(node.op, src.text(), (pointer_type(x.dtype),) * 2)
    return Lowered([KernelCall(kernel, [x.name, y.name], outer if x.size else 0, node.name)])


# -- TopK -------------------------------------------------------------------------------------

def lower_topk(node, graph) -> Lowered:
    x = graph.values[node.inputs[0]]
    values, indices = graph.values[node.outputs[0]], graph.values[node.outputs[1]]
    check_dtypes(node, [x, values])
    rank = len(x.shape)
    axis = _axis(node, rank, -1)
    outer, n, inner = _outer_n_inner(x.shape, axis)
    k_data = const_input(node, graph, 1, "K")
    k = int(k_data.reshape(-1)[0]) if k_data is not None else int(node.attr("k"))
    largest = bool(node.attr("largest", 1))
    # `a` ranks before `b` when it is better, or equal with a lower index.
    better, worse = (">", "<") if largest else ("<", ">")
    src = Source().line(kernel_header(3)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"o = w // {inner}" if inner > 1 else "o = w")
    src.line(f"j = w % {inner}" if inner > 1 else "j = 0")
    src.line(f"base = o * {n * inner} + j")
    src.line(f"obase = o * {k * inner} + j")
    src.line("pv = p0[base]").line("pi = -1")
    src.line(f"for t in range({k}):").indent()
    src.line("bi = -1").line("bv = p0[base]")
    src.line(f"for i in range({n}):").indent()
    src.line(f"v = p0[base + i * {inner}]")
    # after the previous pick in (value, index) order?
    src.line(f"if pi >= 0 and not (v {worse} pv or (v == pv and i > pi)):").indent().line("continue").dedent()
    src.line(f"if bi < 0 or v {better} bv:").indent().line("bi = i").line("bv = v").dedent()
    src.dedent()
    src.line(f"p1[obase + t * {inner}] = bv")
    src.line(f"p2[obase + t * {inner}] = np.int64(bi)")
    src.line("pv = bv").line("pi = bi")
    kernel = Kernel("TopK", src.text(), (pointer_type(x.dtype), pointer_type(x.dtype), "int64"))
    work = outer * inner if k > 0 else 0
    return Lowered([KernelCall(kernel, [x.name, values.name, indices.name], work, node.name, n_outputs=2)])


# -- LogSoftmax, Hardmax ----------------------------------------------------------------------

def _softmax_layout(node, graph, shape):
    from .softmax import softmax_layout
    default_axis = -1 if graph.opset >= 13 else 1
    return softmax_layout(shape, int(node.attr("axis", default_axis)), graph.opset)


def lower_log_softmax(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y])
    if np.dtype(x.dtype).kind != "f":
        raise UnsupportedOpError(f"node '{node.name}' (LogSoftmax): dtype {np.dtype(x.dtype).name} is not supported")
    outer, n, inner = _softmax_layout(node, graph, x.shape)
    t = np.dtype(x.dtype).name
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"base = (w // {inner}) * {n * inner} + w % {inner}" if inner > 1 else f"base = w * {n}")
    src.line("m = p0[base]")
    src.line(f"for i in range({n}):").indent().line(f"m = vmax(m, p0[base + i * {inner}])").dedent()
    src.line(f"s = {literal(0, t)}")
    src.line(f"for i in range({n}):").indent().line(f"s += math.exp(p0[base + i * {inner}] - m)").dedent()
    src.line("ls = math.log(s) + m")
    src.line(f"for i in range({n}):").indent().line(f"p1[base + i * {inner}] = p0[base + i * {inner}] - ls").dedent()
    kernel = Kernel("LogSoftmax", src.text(), (pointer_type(x.dtype),) * 2)
    return Lowered([KernelCall(kernel, [x.name, y.name], outer * inner if x.size else 0, node.name)])


def lower_hardmax(node, graph) -> Lowered:
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y])
    outer, n, inner = _softmax_layout(node, graph, x.shape)
    t = np.dtype(x.dtype).name
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"base = (w // {inner}) * {n * inner} + w % {inner}" if inner > 1 else f"base = w * {n}")
    src.line("m = p0[base]").line("arg = 0")
    src.line(f"for i in range(1, {n}):").indent().line(f"v = p0[base + i * {inner}]")
    src.line("if v > m:").indent().line("m = v").line("arg = i").dedent().dedent()
    src.line(f"for i in range({n}):").indent()
    src.line(f"p1[base + i * {inner}] = {literal(1, t)} if i == arg else {literal(0, t)}").dedent()
    kernel = Kernel("Hardmax", src.text(), (pointer_type(x.dtype),) * 2)
    return Lowered([KernelCall(kernel, [x.name, y.name], outer * inner if x.size else 0, node.name)])


# -- NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss ------------------------------------------

def _loss(node, graph, log_softmax: bool) -> Lowered:
    """One work item: the per-element losses, then the reduction, as ONNX's
    reference defines them (the `mean` divides by the summed target weights
    whenever target weights exist, else by the element count)."""
    x, target = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    weight = graph.values[node.inputs[2]] if len(node.inputs) > 2 and node.inputs[2] else None
    loss = graph.values[node.outputs[0]]
    log_prob = graph.values[node.outputs[1]] if len(node.outputs) > 1 and node.outputs[1] else None
    check_dtypes(node, [x, loss] + ([weight] if weight else []), float16=True)
    shape = [int(d) for d in x.shape]
    n, c = shape[0], shape[1]
    d_size = int(np.prod(shape[2:], dtype=np.int64))
    reduction = str(node.attr("reduction", "mean"))
    ignore = node.attr("ignore_index")
    if weight is not None:
        weighted = True
    elif log_softmax:
        weighted = ignore is not None
    else:
        weighted = ignore is None or int(ignore) != -1
    args = [x.name, target.name] + ([weight.name] if weight else []) + [loss.name] + ([log_prob.name] if log_prob else [])
    out_p = f"p{3 if weight else 2}"
    src = Source().line(kernel_header(len(args))).indent()
    src.line("for _w in range(begin, end):").indent()
    src.line("total = 0.0").line("wsum = 0.0")
    src.line(f"for i in range({n}):").indent()
    src.line(f"for d in range({d_size}):").indent()
    src.line(f"t = np.int64(p1[i * {d_size} + d])")
    if log_softmax:
        src.line(f"m = np.float64({load('p0', f'(i * {c}) * {d_size} + d', x.dtype)})")
        src.line(f"for k in range(1, {c}):").indent()
        src.line(f"v = np.float64({load('p0', f'(i * {c} + k) * {d_size} + d', x.dtype)})").line("m = v if v > m else m").dedent()
        src.line("s = 0.0")
        src.line(f"for k in range({c}):").indent()
        src.line(f"s += math.exp(np.float64({load('p0', f'(i * {c} + k) * {d_size} + d', x.dtype)}) - m)").dedent()
        src.line("lse = math.log(s) + m")
        if log_prob is not None:
            lp = f"p{len(args) - 1}"
            src.line(f"for k in range({c}):").indent()
            src.line(store(lp, f"(i * {c} + k) * {d_size} + d",
                           f"np.float64({load('p0', f'(i * {c} + k) * {d_size} + d', x.dtype)}) - lse", x.dtype)).dedent()
    src.line(f"tc = 0 if t < 0 else ({c - 1} if t > {c - 1} else t)")
    value = f"np.float64({load('p0', f'(i * {c} + tc) * {d_size} + d', x.dtype)})"
    if log_softmax:
        value = f"({value} - lse)"
    src.line(f"g = np.float64({load('p2', 'tc', weight.dtype)})" if weight else "g = 1.0")
    if ignore is not None:
        src.line(f"if t == {int(ignore)}:").indent().line("l = 0.0").line("g = 0.0").dedent()
        src.line("else:").indent().line(f"l = -{value} * g").dedent()
    else:
        src.line(f"l = -{value} * g")
    if reduction == "none":
        src.line(store(out_p, f"i * {d_size} + d", "l", loss.dtype))
    src.line("total += l").line("wsum += g")
    src.dedent().dedent()
    if reduction == "mean":
        src.line(store(out_p, "0", "total / wsum" if weighted else f"total / {float(n * d_size)!r}", loss.dtype))
    elif reduction == "sum":
        src.line(store(out_p, "0", "total", loss.dtype))
    elif reduction != "none":
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): reduction '{reduction}' is not supported")
    arg_types = [pointer_type(x.dtype), np.dtype(target.dtype).name] + ([pointer_type(weight.dtype)] if weight else []) \
        + [pointer_type(loss.dtype)] + ([pointer_type(log_prob.dtype)] if log_prob else [])
    kernel = Kernel(node.op, with_helpers(src.text()), tuple(arg_types))
    return Lowered([KernelCall(kernel, args, 1, node.name, n_outputs=2 if log_prob else 1)])


def lower_nll_loss(node, graph) -> Lowered:
    return _loss(node, graph, log_softmax=False)


def lower_softmax_cross_entropy(node, graph) -> Lowered:
    return _loss(node, graph, log_softmax=True)


# -- LRN ----------------------------------------------------------------------------------------

def lower_lrn(node, graph) -> Lowered:
    """y = x / (bias + alpha / size * sum of x^2 over the channel window) ** beta,
    the window [c - floor((size-1)/2), c + ceil((size-1)/2)] cut to the channels."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y], float16=True)
    size = int(node.attr("size"))
    alpha, beta, bias = float(node.attr("alpha", 1e-4)), float(node.attr("beta", 0.75)), float(node.attr("bias", 1.0))
    shape = [int(d) for d in x.shape]
    n, c = shape[0], shape[1]
    inner = int(np.prod(shape[2:], dtype=np.int64))
    before, after = (size - 1) // 2, -(-(size - 1) // 2)
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"b = w // {c}").line(f"ch = w % {c}")
    src.line(f"lo = max(0, ch - {before})").line(f"hi = min({c - 1}, ch + {after})")
    src.line(f"for j in range({inner}):").indent()
    src.line("s = 0.0")
    src.line("for k in range(lo, hi + 1):").indent()
    src.line(f"v = np.float64({load('p0', f'(b * {c} + k) * {inner} + j', x.dtype)})").line("s += v * v").dedent()
    src.line(f"v = np.float64({load('p0', f'w * {inner} + j', x.dtype)})")
    src.line(store("p1", f"w * {inner} + j", f"v / ({bias!r} + {alpha / size!r} * s) ** {beta!r}", y.dtype))
    kernel = Kernel("LRN", with_helpers(src.text()), (pointer_type(x.dtype), pointer_type(y.dtype)))
    return Lowered([KernelCall(kernel, [x.name, y.name], n * c if y.size else 0, node.name)])


# -- DFT ----------------------------------------------------------------------------------------

def lower_dft(node, graph) -> Lowered:
    """DFT as a direct sum, in float64: X_k = sum_n x_n e^(-+2 pi i k n / N) (1/N when
    inverse), the signal padded with zeros or cut to N = dft_length; `onesided`
    keeps N//2+1 frequencies, or (inverse) reads them as a Hermitian half and
    gives the real signal, as numpy's rfft / irfft do."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y], float16=True)
    shape = [int(d) for d in x.shape]
    rank = len(shape)
    if graph.opset >= 20:
        axis_data = const_input(node, graph, 2, "axis")
        axis = int(axis_data.reshape(-1)[0]) if axis_data is not None else -2
    else:
        axis = int(node.attr("axis", 1))
    axis = axis + rank if axis < 0 else axis
    inverse, onesided = bool(node.attr("inverse", 0)), bool(node.attr("onesided", 0))
    length_data = const_input(node, graph, 1, "dft_length")
    size = shape[axis]
    n_fft = int(length_data.reshape(-1)[0]) if length_data is not None else (
        2 * (size - 1) if inverse and onesided else size)
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:-1], dtype=np.int64))
    c_in, c_out = shape[-1], int(y.shape[-1])
    k_out = int(y.shape[axis])
    used = min(size, n_fft // 2 + 1 if inverse and onesided else n_fft)  # input points that count
    sign = 1.0 if inverse else -1.0
    src = Source().line(kernel_header(2)).indent()
    src.line("for w in range(begin, end):").indent()
    src.line(f"o = w // {inner}").line(f"j = w % {inner}")
    src.line(f"for k in range({k_out}):").indent()
    src.line("re = 0.0").line("im = 0.0")
    src.line(f"for n in range({used}):").indent()
    src.line(f"at = ((o * {size} + n) * {inner} + j) * {c_in}")
    src.line(f"a = np.float64({load('p0', 'at', x.dtype)})")
    src.line(f"b = np.float64({load('p0', 'at + 1', x.dtype)})" if c_in == 2 else "b = 0.0")
    src.line(f"t = {sign * 2 * np.pi / n_fft!r} * np.float64((k * n) % {n_fft})")
    src.line("cs = math.cos(t)").line("sn = math.sin(t)")
    if inverse and onesided:
        # Hermitian half: bins 1 .. (N-1)/2 count twice; the imaginary parts of
        # bin 0 and (N even) bin N/2 are dropped, as numpy's irfft does.
        src.line(f"f = 1.0 if n == 0 or 2 * n == {n_fft} else 2.0")
        src.line(f"if n == 0 or 2 * n == {n_fft}:").indent().line("b = 0.0").dedent()
        src.line("re += f * (a * cs - b * sn)")
    else:
        src.line("re += a * cs - b * sn").line("im += a * sn + b * cs")
    src.dedent()
    if inverse:
        src.line(f"re = re / {float(n_fft)!r}").line(f"im = im / {float(n_fft)!r}")
    dst = f"((o * {k_out} + k) * {inner} + j) * {c_out}"
    src.line(store("p1", dst, "re", y.dtype))
    if c_out == 2:
        src.line(store("p1", f"{dst} + 1", "im", y.dtype))
    kernel = Kernel("DFT", with_helpers(src.text()), (pointer_type(x.dtype), pointer_type(y.dtype)))
    return Lowered([KernelCall(kernel, [x.name, y.name], outer * inner if y.size else 0, node.name)])
