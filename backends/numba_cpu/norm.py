"""Normalisations over a group of elements, and Gelu:

    LayerNormalization     rows of X.shape[axis:]:  y = (x - mean) * inv * Scale + B,
                           inv = 1 / sqrt(var + epsilon); optional Mean / InvStdDev outputs
    InstanceNormalization  (image, channel) planes: y = (x - mean) * inv * scale[c] + B[c]
    MeanVarianceNormalization  over `axes`: y = (x - mean) / (sqrt(var) + 1e-9)  (ONNX's function)
    LpNormalization        along `axis`:    y = x / ||x||_p  (0 where the norm is 0)
    Gelu                   x/2 * (1 + erf(x/sqrt 2)), or the tanh approximation (see lower_gelu)

One work item is one group (a row, a plane, a kept index); mean and variance
are two passes over it (the variance of x - mean, not E[x^2] - mean^2, which
cancels badly in float32).
"""
from __future__ import annotations

import math

import numpy as np

from cuvil.errors import UnsupportedOpError

from .elementwise import check_dtypes, loop_nest
from .kernel import Kernel, KernelCall, Lowered, Source, broadcast_strides, dims_strides, kernel_header, literal


def _unsupported(node, why):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}")


def _float_dtype(node, value):
    dtype = np.dtype(value.dtype)
    if dtype.name not in ("float32", "float64"):
        raise _unsupported(node, f"dtype {dtype.name} is not supported (float32, float64)")
    return dtype


def _input(node, graph, k):
    name = node.inputs[k] if len(node.inputs) > k else ""
    return graph.values[name] if name else None


def _per_element(node, value, shape, dtype):
    """An argument for a parameter (Scale, B) read at flat index j of `shape`: its name when it
    already has that many elements, else (constants only) the array broadcast at build time."""
    if value.size == int(np.prod(shape)):
        return value.name
    if not value.is_const:
        raise _unsupported(node, f"'{value.name}' {value.shape} must have shape {tuple(shape)} when it is not a constant")
    return np.ascontiguousarray(np.broadcast_to(np.asarray(value.data, dtype=dtype), shape))


def moments(src, dtype, size, x, base):
    """Lines computing `mean` and `var` (of the deviations, two passes) of x[base : base+size]."""
    src.line(f"acc = {literal(0, dtype)}")
    src.line(f"for j in range({size}):").indent().line(f"acc += {x}[{base} + j]").dedent()
    src.line(f"mean = acc * {literal(1.0 / size, dtype)}")
    src.line(f"acc = {literal(0, dtype)}")
    src.line(f"for j in range({size}):").indent()
    src.line(f"dv = {x}[{base} + j] - mean").line("acc += dv * dv").dedent()
    src.line(f"var = acc * {literal(1.0 / size, dtype)}")


def lower_layer_normalization(node, graph) -> Lowered:
    X, S, Bv = _input(node, graph, 0), _input(node, graph, 1), _input(node, graph, 2)
    dtype = _float_dtype(node, X)
    rank = len(X.shape)
    axis = int(node.attr("axis", -1))
    axis = axis + rank if axis < 0 else axis
    eps = float(node.attr("epsilon", 1e-5))
    rows = int(np.prod(X.shape[:axis], dtype=np.int64))
    size = int(np.prod(X.shape[axis:], dtype=np.int64))
    outputs = [name if k < len(node.outputs) else "" for k, name in enumerate(node.outputs[:3])]
    args = [X.name, _per_element(node, S, X.shape[axis:], dtype)]
    if Bv is not None:
        args.append(_per_element(node, Bv, X.shape[axis:], dtype))
    n_in = len(args)
    args += [o for o in outputs if o]
    pY = f"p{n_in}" if outputs[0] else None
    src = Source().line(kernel_header(len(args))).indent()
    src.line("for r in range(begin, end):").indent()
    src.line(f"base = r*{size}")
    moments(src, dtype, size, "p0", "base")
    src.line(f"inv = {literal(1, dtype)} / math.sqrt(var + {literal(eps, dtype)})")
    if pY:
        src.line(f"for j in range({size}):").indent()
        shift = " + p2[j]" if Bv is not None else ""
        src.line(f"{pY}[base + j] = (p0[base + j] - mean) * inv * p1[j]{shift}")
        src.dedent()
    k = n_in + (1 if pY else 0)
    types = [dtype.name] * (k)
    for name, value in zip(outputs[1:], ("mean", "inv")):
        if name:
            # Mean and InvStdDev have the stash type (float32 unless stash_type says otherwise).
            stat = np.dtype(graph.values[name].dtype)
            _float_dtype(node, graph.values[name])
            src.line(f"p{k}[r] = np.{stat.name}({value})")
            types.append(stat.name)
            k += 1
    kernel = Kernel("LayerNormalization", src.text(), tuple(types))
    return Lowered([KernelCall(kernel, args, rows, node.name, n_outputs=len(args) - n_in)])


def lower_instance_normalization(node, graph) -> Lowered:
    X, S, Bv = (_input(node, graph, k) for k in range(3))
    Y = graph.values[node.outputs[0]]
    dtype = _float_dtype(node, X)
    eps = float(node.attr("epsilon", 1e-5))
    N, C = X.shape[:2]
    plane = int(np.prod(X.shape[2:], dtype=np.int64))
    src = Source().line(kernel_header(4)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"base = item*{plane}").line(f"c = item % {C}")
    moments(src, dtype, plane, "p0", "base")
    src.line(f"sc = p1[c] / math.sqrt(var + {literal(eps, dtype)})")
    src.line("sh = p2[c] - mean * sc")
    src.line(f"for j in range({plane}):").indent().line("p3[base + j] = p0[base + j] * sc + sh")
    kernel = Kernel("InstanceNormalization", src.text(), (dtype.name,) * 4)
    return Lowered([KernelCall(kernel, [X.name, S.name, Bv.name, Y.name], N * C, node.name)])


def _offset_table(shape, dims) -> np.ndarray:
    """Flat offsets in a C-contiguous `shape` of every index over `dims` (others 0), in C order."""
    strides = dims_strides(shape)
    offsets = np.zeros([1], np.int64)
    for d in dims:
        offsets = (offsets[:, None] + np.arange(shape[d], dtype=np.int64)[None, :] * strides[d]).reshape(-1)
    return offsets


def lower_mean_variance_normalization(node, graph) -> Lowered:
    X = _input(node, graph, 0)
    Y = graph.values[node.outputs[0]]
    dtype = _float_dtype(node, X)
    rank = len(X.shape)
    axes = sorted({a + rank if a < 0 else a for a in node.attr("axes", [0, 2, 3])})
    kept = [d for d in range(rank) if d not in axes]
    # The reduced dims that trail X form one contiguous run; the table holds each run's start.
    run_dims = []
    for d in reversed(range(rank)):
        if d in axes and (not run_dims or run_dims[-1] == d + 1):
            run_dims.append(d)
        else:
            break
    run = int(np.prod([X.shape[d] for d in run_dims], dtype=np.int64))
    starts = _offset_table(X.shape, [d for d in axes if d not in run_dims])
    bases = _offset_table(X.shape, kept)
    count = run * len(starts)
    src = Source().line(kernel_header(4)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line("base = p1[item]")
    src.line(f"acc = {literal(0, dtype)}")

    def over_group(body):
        src.line(f"for q in range({len(starts)}):").indent()
        src.line("o = base + p2[q]")
        src.line(f"for j in range({run}):").indent()
        for line in body:
            src.line(line)
        src.dedent().dedent()
    over_group(["acc += p0[o + j]"])
    src.line(f"mean = acc * {literal(1.0 / count, dtype)}")
    src.line(f"acc = {literal(0, dtype)}")
    over_group(["dv = p0[o + j] - mean", "acc += dv * dv"])
    src.line(f"inv = {literal(1, dtype)} / (math.sqrt(acc * {literal(1.0 / count, dtype)}) + {literal(1e-9, dtype)})")
    over_group(["p3[o + j] = (p0[o + j] - mean) * inv"])
    kernel = Kernel("MeanVarianceNormalization", src.text(), (dtype.name, "int64", "int64", dtype.name))
    return Lowered([KernelCall(kernel, [X.name, bases, starts, Y.name], len(bases), node.name)])


def lower_lp_normalization(node, graph) -> Lowered:
    X = _input(node, graph, 0)
    Y = graph.values[node.outputs[0]]
    dtype = _float_dtype(node, X)
    rank = len(X.shape)
    axis = int(node.attr("axis", -1))
    axis = axis + rank if axis < 0 else axis
    p = int(node.attr("p", 2))
    if p not in (1, 2):
        raise _unsupported(node, f"p={p} is not supported (1 or 2)")
    outer = int(np.prod(X.shape[:axis], dtype=np.int64))
    A = X.shape[axis]
    inner = int(np.prod(X.shape[axis + 1:], dtype=np.int64))
    zero = literal(0, dtype)
    src = Source().line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"base = (item // {inner})*{A * inner} + item % {inner}" if inner > 1 else f"base = item*{A}")
    step = f"a*{inner}" if inner > 1 else "a"
    src.line(f"acc = {zero}")
    src.line(f"for a in range({A}):").indent()
    src.line(f"v = p0[base + {step}]")
    src.line("acc += v * v" if p == 2 else "acc += abs(v)")
    src.dedent()
    src.line("norm = math.sqrt(acc)" if p == 2 else "norm = acc")
    src.line(f"inv = {literal(1, dtype)} / norm if norm != {zero} else {zero}")
    src.line(f"for a in range({A}):").indent()
    src.line(f"p1[base + {step}] = p0[base + {step}] * inv")
    kernel = Kernel("LpNormalization", src.text(), (dtype.name,) * 2)
    return Lowered([KernelCall(kernel, [X.name, Y.name], outer * inner, node.name)])


# Numerical Recipes' erfcc: erfc(z) = t * exp(-z*z + P(t)), t = 1/(1 + z/2), z >= 0, with a
# relative error below 1.2e-7 everywhere (so Gelu's negative tail keeps its accuracy).
_ERFC_P = [-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
           -0.82215223, 0.17087277]


def _horner(coefficients, var, dtype) -> str:
    text = literal(coefficients[-1], dtype)
    for c in reversed(coefficients[:-1]):
        text = f"({text} * {var} + {literal(c, dtype)})"
    return text


def lower_gelu(node, graph) -> Lowered:
    """Gelu = x/2 * (1 + erf(x/sqrt 2)), written with erfc so that the negative tail keeps its
    relative accuracy: x/2 * erfc(-x/sqrt 2). approximate=tanh: x/2 * (1 + tanh(y)) =
    x * sigmoid(2y), y = sqrt(2/pi) * (x + 0.044715 x^3). math.exp becomes vmath.py's
    vectorisable exp (emit.py), so the loop vectorises."""
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    check_dtypes(node, [x, y])
    dtype = _float_dtype(node, x)
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise _unsupported(node, f"approximate={approximate!r} is not supported (none, tanh)")
    lit = lambda v: literal(v, dtype)  # noqa: E731
    src = Source().line(kernel_header(2)).indent()
    (xi, yi), work = loop_nest(src, y.shape, [broadcast_strides(x.shape, y.shape), dims_strides(y.shape)])
    src.line(f"a = p0[{xi}]")
    if approximate == "none":
        src.line(f"u = abs(a) * {lit(1 / math.sqrt(2))}")
        src.line(f"t = {lit(1)} / ({lit(1)} + {lit(0.5)} * u)")
        src.line(f"ec = t * math.exp(-u * u + {_horner(_ERFC_P, 't', dtype)})")
        src.line(f"v = a * {lit(0.5)} * ({lit(2)} - ec) if a >= {lit(0)} else a * {lit(0.5)} * ec")
    else:
        src.line(f"yy = {lit(2 * math.sqrt(2 / math.pi))} * (a + {lit(0.044715)} * a * a * a)")
        src.line(f"v = a / ({lit(1)} + math.exp(-yy))")
    src.line(f"p1[{yi}] = v")
    kernel = Kernel("Gelu", src.text(), (dtype.name, dtype.name), in_place=True)
    return Lowered([KernelCall(kernel, [x.name, y.name], work, node.name)])


def _rms_lines(src, size, sum_expr, eps):
    """Lines: acc = sum over the row of v*v (v from `sum_expr`), inv = 1 / sqrt(mean + eps)."""
    dtype = np.dtype(np.float32)
    src.line(f"acc = {literal(0, dtype)}")
    src.line(f"for j in range({size}):").indent()
    for line in sum_expr:
        src.line(line)
    src.line("acc += v * v").dedent()
    src.line(f"inv = {literal(1, dtype)} / math.sqrt(acc * {literal(1.0 / size, dtype)} + {literal(eps, dtype)})")


def lower_simplified_layer_normalization(node, graph) -> Lowered:
    """SimplifiedLayerNormalization (RMSNorm): y = x / sqrt(mean(x^2) + epsilon) * scale, one row
    per work item (cuvil/contrib.py checks the form)."""
    from cuvil import contrib
    form = contrib.norm_form(node, graph.values, skip=False)
    size = form["size"]
    x, scale = node.inputs[0], node.inputs[1]
    src = Source().line(kernel_header(3)).indent()
    src.line("for r in range(begin, end):").indent().line(f"base = r * {size}")
    _rms_lines(src, size, ["v = p0[base + j]"], form["epsilon"])
    src.line(f"for j in range({size}):").indent().line("p2[base + j] = p0[base + j] * inv * p1[j]")
    kernel = Kernel("RMSNorm", src.text(), ("float32",) * 3)
    return Lowered([KernelCall(kernel, [x, np.asarray(graph.values[scale].data, np.float32).reshape(-1)
                                        if graph.values[scale].is_const else scale, node.outputs[0]],
                               form["rows"], node.name)])


def lower_skip_simplified_layer_normalization(node, graph) -> Lowered:
    """SkipSimplifiedLayerNormalization (com.microsoft), fused: s = input + skip (+ bias) is written
    (output 3) as it is summed; y = s / sqrt(mean(s^2) + epsilon) * gamma. One row per work item."""
    from cuvil import contrib
    form = contrib.norm_form(node, graph.values, skip=True)
    size = form["size"]
    ins = list(node.inputs) + [""] * 4
    x, skip, gamma, bias = ins[:4]
    outs = list(node.outputs) + [""] * 4
    y, s_out = outs[0], outs[3]

    def param(name):
        v = graph.values[name]
        return np.asarray(v.data, np.float32).reshape(-1) if v.is_const else name
    args = [x, skip, param(gamma)] + ([param(bias)] if bias else [])
    k = len(args)
    plus = f" + p{k - 1}[j]" if bias else ""
    targets = [o for o in (y, s_out) if o]
    py = f"p{k}" if y else None
    ps = f"p{k + (1 if y else 0)}" if s_out else None
    src = Source().line(kernel_header(k + len(targets))).indent()
    src.line("for r in range(begin, end):").indent().line(f"base = r * {size}")
    body = [f"v = p0[base + j] + p1[base + j]{plus}"] + ([f"{ps}[base + j] = v"] if ps else [])
    _rms_lines(src, size, body, form["epsilon"])
    if py:
        src.line(f"for j in range({size}):").indent()
        src.line(f"{py}[base + j] = (p0[base + j] + p1[base + j]{plus}) * inv * p2[j]")
    kernel = Kernel("SkipRMSNorm", src.text(), ("float32",) * (k + len(targets)))
    return Lowered([KernelCall(kernel, args + targets, form["rows"], node.name, n_outputs=len(targets))])
