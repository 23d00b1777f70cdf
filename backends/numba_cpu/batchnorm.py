"""BatchNormalization per channel (axis 1) over any rank >= 2. Inference form:

    y = (x - mean) / sqrt(var + epsilon) * scale + B  =  x * s + t,
    s = scale / sqrt(var + epsilon),  t = B - mean * s

With constant parameters (the usual case) s and t are computed at build time
in float64 and the kernel is one multiply-add per element. With run-time
parameters the kernel computes s and t itself. One work item is one
(image, channel) plane, unit-stride; rank-2 inputs (no plane) run one image
per item with the inner loop over channels.

Training form (opset 14+, training_mode=1): the batch's own mean and (biased)
variance normalise x, and the optional outputs are the updated running
statistics, running = input * momentum + batch * (1 - momentum); one work item
per channel, statistics accumulated in float64.
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, literal


def _unsupported(node, why):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}")


def lower_batchnorm(node, graph) -> Lowered:
    X = graph.values[node.inputs[0]]
    params = [graph.values[name] for name in node.inputs[1:5]]  # scale, B, mean, var
    Y = graph.values[node.outputs[0]]
    dtype = np.dtype(Y.dtype)
    if int(node.attr("training_mode", 0)):
        return _lower_training(node, graph, X, params, Y)
    consumers = graph.consumers()
    for extra in node.outputs[1:]:
        if extra and (extra in consumers or extra in graph.outputs):
            raise _unsupported(node, f"output '{extra}' (training statistics) is used; only inference is supported")
    if dtype.kind != "f":
        raise _unsupported(node, f"{dtype.name} inputs are not supported (float only)")
    if len(X.shape) < 2:
        raise _unsupported(node, f"input rank {len(X.shape)} is not supported (N, C, ...)")
    eps = float(node.attr("epsilon", 1e-5))
    N, C = X.shape[:2]
    plane = int(np.prod(X.shape[2:], dtype=np.int64))
    # Opset < 9 with spatial=0 has one parameter per (channel, position): shape (C, *spatial).
    per_element = any(p.size != C for p in params)
    if all(p.is_const for p in params):
        per_channel = (C,) + (1,) * (len(X.shape) - 2)
        scale, bias, mean, var = (np.asarray(p.data, dtype=np.float64).reshape(per_channel if p.size == C else X.shape[1:])
                                  for p in params)
        s = scale / np.sqrt(var + eps)
        t = bias - mean * s
        shape = X.shape[1:] if per_element else (C,)
        s, t = (np.broadcast_to(a, X.shape[1:]).reshape(shape) if per_element else a.reshape(shape) for a in (s, t))
        kernel, work = _scale_shift_kernel(dtype, N, C, plane, per_element)
        args = [X.name, np.ascontiguousarray(s.astype(dtype)), np.ascontiguousarray(t.astype(dtype)), Y.name]
    else:
        if per_element:
            raise _unsupported(node, "per-position (spatial=0) parameters must be constants")
        kernel, work = _runtime_params_kernel(dtype, N, C, plane, eps)
        args = [X.name] + [p.name for p in params] + [Y.name]
    return Lowered([KernelCall(kernel, args, work, node.name)])


def _scale_shift_kernel(dtype, N, C, plane, per_element):
    """y = x * s + t with s, t per channel (or per channel and position)."""
    src = Source().line(kernel_header(4)).indent()
    if plane == 1:
        src.line("for n in range(begin, end):").indent()
        src.line(f"for c in range({C}):").indent()
        src.line(f"p3[n*{C} + c] = p0[n*{C} + c] * p1[c] + p2[c]")
        work = N
    else:
        src.line("for item in range(begin, end):").indent()
        src.line(f"base = item*{plane}")
        if per_element:
            src.line(f"pbase = (item % {C})*{plane}")
            src.line(f"for i in range({plane}):").indent()
            src.line("p3[base + i] = p0[base + i] * p1[pbase + i] + p2[pbase + i]")
        else:
            src.line(f"c = item % {C}")
            src.line("s = p1[c]").line("t = p2[c]")
            src.line(f"for i in range({plane}):").indent()
            src.line("p3[base + i] = p0[base + i] * s + t")
        work = N * C
    return Kernel("BatchNormalization", src.text(), (dtype.name,) * 4), work


def _runtime_params_kernel(dtype, N, C, plane, eps):
    """Parameters known only at run time: s and t computed per channel in the kernel."""
    E = literal(eps, dtype)
    one = literal(1, dtype)
    src = Source().line(kernel_header(6)).indent()
    if plane == 1:
        src.line("for n in range(begin, end):").indent()
        src.line(f"for c in range({C}):").indent()
        src.line(f"s = p1[c] * ({one} / math.sqrt(p4[c] + {E}))")
        src.line(f"p5[n*{C} + c] = (p0[n*{C} + c] - p3[c]) * s + p2[c]")
        work = N
    else:
        src.line("for item in range(begin, end):").indent()
        src.line(f"base = item*{plane}").line(f"c = item % {C}")
        src.line(f"s = p1[c] * ({one} / math.sqrt(p4[c] + {E}))")
        src.line("t = p2[c] - p3[c] * s")
        src.line(f"for i in range({plane}):").indent()
        src.line("p5[base + i] = p0[base + i] * s + t")
        work = N * C
    return Kernel("BatchNormalization", src.text(), (dtype.name,) * 6), work


def _lower_training(node, graph, X, params, Y):
    dtype = np.dtype(Y.dtype)
    if dtype.kind != "f" or len(X.shape) < 2:
        raise _unsupported(node, f"training_mode=1 needs a float input of rank >= 2, not {dtype.name} of rank {len(X.shape)}")
    N, C = X.shape[:2]
    if any(p.size != C for p in params):
        raise _unsupported(node, "training_mode=1 needs one parameter per channel")
    plane = int(np.prod(X.shape[2:], dtype=np.int64))
    eps, momentum = float(node.attr("epsilon", 1e-5)), float(node.attr("momentum", 0.9))
    stats = [name for name in node.outputs[1:3] if name]
    count = N * plane
    f64 = lambda v: literal(v, np.float64)  # noqa: E731
    src = Source().line(kernel_header(6 + len(stats))).indent()
    src.line("for c in range(begin, end):").indent()
    src.line(f"acc = {f64(0)}")
    src.line(f"for n in range({N}):").indent().line(f"base = (n*{C} + c)*{plane}")
    src.line(f"for i in range({plane}):").indent().line("acc += np.float64(p0[base + i])").dedent().dedent()
    src.line(f"mean = acc / {f64(count)}")
    src.line(f"acc = {f64(0)}")
    src.line(f"for n in range({N}):").indent().line(f"base = (n*{C} + c)*{plane}")
    src.line(f"for i in range({plane}):").indent().line("d = np.float64(p0[base + i]) - mean").line("acc += d * d")
    src.dedent().dedent()
    src.line(f"var = acc / {f64(count)}")
    src.line(f"s = np.float64(p1[c]) / math.sqrt(var + {f64(eps)})")
    src.line("t = np.float64(p2[c]) - mean * s")
    src.line(f"for n in range({N}):").indent().line(f"base = (n*{C} + c)*{plane}")
    src.line(f"for i in range({plane}):").indent()
    src.line(f"p5[base + i] = np.{dtype.name}(np.float64(p0[base + i]) * s + t)").dedent().dedent()
    for k, (name, batch) in enumerate(zip(node.outputs[1:3], ("mean", "var"))):
        if name:
            src.line(f"p{6 + stats.index(name)}[c] = np.{dtype.name}(np.float64(p{3 + k}[c]) * {f64(momentum)} "
                     f"+ {batch} * {f64(1 - momentum)})")
    kernel = Kernel("BatchNormalizationTraining", src.text(), (dtype.name,) * (6 + len(stats)))
    args = [X.name] + [p.name for p in params] + [Y.name] + stats
    return Lowered([KernelCall(kernel, args, C, node.name, n_outputs=1 + len(stats))])
