"""ai.onnx.preview.training optimiser steps: Adagrad, Momentum, Adam (onnx's operator docs).

Inputs R (learning rate) and T (update count) are scalars read at run time; then, per optimised
tensor X_i, its gradient and state. Each tensor is one kernel over its elements, computed in
float64 (g = norm_coefficient x + grad throughout):

    Adagrad   r = R / (1 + T decay_factor);  h' = h + g^2;  x' = x - r g / (sqrt(h') + epsilon)
    Momentum  b = beta if T > 0 else 1;  v' = alpha v + b g;
              x' = x - R v' (standard)  or  x - R (g + alpha v') (nesterov)
    Adam      v' = alpha v + (1 - alpha) g;  h' = beta h + (1 - beta) g^2;
              r = R sqrt(1 - beta^T) / (1 - alpha^T) if T > 0 else R;
              x' = (1 - norm_coefficient_post) (x - r v' / (sqrt(h') + epsilon))

Outputs: every x', then every v' (Momentum, Adam), then every h' (Adagrad, Adam)."""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header

DOMAIN = "ai.onnx.preview.training"


def _groups(node, states: int) -> int:
    n = len(node.inputs) - 2
    if n <= 0 or n % (2 + states):
        raise UnsupportedOpError(f"node '{node.name}' ({node.op}): expected R, T and {2 + states} inputs per tensor, "
                                 f"got {len(node.inputs)} inputs")
    return n // (2 + states)


def _lower(node, graph, states: int, body: list[str]) -> Lowered:
    """One kernel per tensor: p0 R, p1 T, p2 x, p3 g, then the states, then x' and the new states.
    `body` computes from x, grad, v/h (float64) and r, t the names x_new and v_new / h_new."""
    n = _groups(node, states)
    rtype = np.dtype(graph.values[node.inputs[0]].dtype).name
    ttype = np.dtype(graph.values[node.inputs[1]].dtype).name
    calls = []
    for i in range(n):
        ins = [node.inputs[2 + i + k * n] for k in range(2 + states)]
        outs = [node.outputs[i + k * n] if i + k * n < len(node.outputs) else "" for k in range(1 + states)]
        if any(not o for o in outs):
            raise UnsupportedOpError(f"node '{node.name}' ({node.op}): every output must be used")
        x = graph.values[ins[0]]
        t = np.dtype(x.dtype).name
        if t not in ("float32", "float64"):
            raise UnsupportedOpError(f"node '{node.name}' ({node.op}): {t} tensors are not supported")
        names = ["x", "grad", "v", "h"][:2] + (["v", "h"] if states == 2 else ["s"] if states == 1 else [])
        src = Source().line(kernel_header(4 + 2 * states + 1)).indent()
        src.line("r = np.float64(p0[0])").line("t = np.int64(p1[0])")
        src.line("for i in range(begin, end):").indent()
        for k, name in enumerate(names):
            src.line(f"{name} = np.float64(p{2 + k}[i])")
        for line in body:
            src.line(line)
        results = ["x_new"] + (["v_new", "h_new"] if states == 2 else ["s_new"])
        for k, name in enumerate(results):
            src.line(f"p{2 + len(names) + k}[i] = np.{t}({name})")
        kernel = Kernel(node.op, src.text(), (rtype, ttype) + (t,) * (len(names) + len(results)))
        calls.append(KernelCall(kernel, [node.inputs[0], node.inputs[1], *ins, *outs], int(x.size), node.name,
                                n_outputs=len(results)))
    return Lowered(calls)


def lower_adagrad(node, graph) -> Lowered:
    decay, eps = float(node.attr("decay_factor", 0.0)), float(node.attr("epsilon", 0.0))
    norm = float(node.attr("norm_coefficient", 0.0))
    return _lower(node, graph, 1, [
        f"g = {norm!r} * x + grad",
        f"rate = r / (1.0 + np.float64(t) * {decay!r})",
        "s_new = s + g * g",
        f"x_new = x - rate * g / (math.sqrt(s_new) + {eps!r})",
    ])


def lower_momentum(node, graph) -> Lowered:
    alpha, beta = float(node.attr("alpha")), float(node.attr("beta"))
    norm = float(node.attr("norm_coefficient"))
    mode = node.attr("mode")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("standard", "nesterov"):
        raise UnsupportedOpError(f"node '{node.name}' (Momentum): mode {mode!r} is not standard or nesterov")
    step = "x - r * s_new" if mode == "standard" else f"x - r * (g + {alpha!r} * s_new)"
    return _lower(node, graph, 1, [
        f"g = {norm!r} * x + grad",
        f"b = {beta!r} if t > 0 else 1.0",
        f"s_new = {alpha!r} * s + b * g",
        f"x_new = {step}",
    ])


def lower_adam(node, graph) -> Lowered:
    alpha, beta = float(node.attr("alpha", 0.9)), float(node.attr("beta", 0.999))
    eps, norm = float(node.attr("epsilon", 0.0)), float(node.attr("norm_coefficient", 0.0))
    post = float(node.attr("norm_coefficient_post", 0.0))
    return _lower(node, graph, 2, [
        f"g = {norm!r} * x + grad",
        f"v_new = {alpha!r} * v + {1.0 - alpha!r} * g",
        f"h_new = {beta!r} * h + {1.0 - beta!r} * g * g",
        f"rate = r * math.sqrt(1.0 - {beta!r} ** t) / (1.0 - {alpha!r} ** t) if t > 0 else r",
        f"x_new = {1.0 - post!r} * (x - rate * v_new / (math.sqrt(h_new) + {eps!r}))",
    ])
