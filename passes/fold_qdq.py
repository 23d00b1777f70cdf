"""fold_qdq: quantised matrix products become one integer product, FusedMatMulInteger.

Quantisation tools write an integer product as integer ops with float arithmetic around them, or
as float ops between QuantizeLinear / DequantizeLinear (QDQ). Executed as written, every product
runs in float32 on dequantised weights. This pass finds the two forms and writes each as one
node whose kernel multiplies the bytes (backends/numba_cpu/qgemm.py, AVX512-VNNI):

    quantize_dynamic:  DynamicQuantizeLinear(x) -> (xq, s_x, z_x)
                       Cast(MatMulInteger(xq, W, z_x, z_w)) * Mul(s_x, s_w) [+ bias]
    QDQ (quantize_static):
                       MatMul(DQ(xq, s_x, z_x), DQ(W, s_w, z_w)) [+ DQ(bias_i32)]  [-> Q(s_y, z_y)]
                       Gemm(DQ(xq), DQ(W), DQ(bias_i32), transB)                   [-> Q(s_y, z_y)]
                       Q(Conv(DQ(xq), DQ(W), DQ(bias_i32)))  -> QLinearConv (group 1 or depthwise; its
                       kernels are backends/numba_cpu/qconv.py; attribute fallback = "float": a
                       target without them runs the float QDQ form, not the scalar integer loops)
    and the ops around them, so that integer tensors flow from one to the next:
                       Q(MaxPool|Flatten|Reshape|Transpose..(DQ(x))), same
                       scale and zero point                                -> the op on x
                       Q(DQ(a) + DQ(b)), equal shapes                      -> QLinearAdd (domain "cuvil")
                       Q(Relu|Clip(DQ(x))), 8-bit x                        -> QLookup(x, table) (domain
                       "cuvil"): y = table[x - min]; 256 entries computed at build time

    FusedMatMulInteger(A, B, a_zero, b_zero, a_scale, b_scale, bias, y_scale, y_zero)  (domain "cuvil")
        acc = sum_k (A - a_zero)(B - b_zero)                       int32, exact
        no y_scale:  y = float(acc) * (a_scale * b_scale[n]) + bias[n]                 float32
        y_scale:     y = saturate(rint(float(acc + bias[n]) * (a_scale b_scale[n] / y_scale)) + y_zero)

The float form is what onnxruntime's unfused graph computes (MatMulInteger -> Cast -> Mul(Mul(s_x,
s_w)) -> Add), rounding for rounding. The quantised form is onnxruntime's own integer path for
QDQ (its QDQ transformer makes QLinearMatMul/QGemm with the bias as int32 sums): the bias must
be a DequantizeLinear of int32 with scale s_x * s_w (what quantize_static writes), so that
bias = bias_i32 * s_x s_w exactly and it joins the integer sums. Against the float emulation of
the QDQ graph it differs by float32 rounding (a value near a .5 boundary of y / s_y can round
to the neighbouring step), which tests bound in output steps.

Must not fire: weights computed at run time, a product whose intermediate value is read by
another node, per-row (non-scalar) activation scales or zero points, a bias that is not a
constant vector over N, a quantised output whose bias scale is not s_x * s_w, float16 scales.
It runs first in the fusion levels, before fold_constants folds the weights' DequantizeLinear
to float (frontends/onnx.py keeps those nodes for it).
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Graph, Node

from ._rewrite import add_constant, drop_unused_values, node_names, only_reader, unique_node_name

FUSED = "FusedMatMulInteger"


def _const(graph: Graph, name: str):
    if not name:
        return None
    v = graph.values[name]
    return np.asarray(v.data) if v.is_const else None


def _is_f32(graph: Graph, name: str) -> bool:
    return bool(name) and np.dtype(graph.values[name].dtype) == np.float32


def _input(node: Node, k: int) -> str:
    return node.inputs[k] if len(node.inputs) > k else ""


def _column_vector(data: np.ndarray | None, N: int) -> bool:
    """A constant that broadcasts to (M, N) as one value per column (or one value)."""
    return data is not None and (data.size == 1 or (data.shape[-1] == N and data.size == N))


def _dynamic(graph: Graph, mul: Node, consumers, producers):
    """Cast(MatMulInteger(...)) * Mul(s_x, s_w) -> (nodes replaced, inputs of the fused node, last node)."""
    if mul.op != "Mul" or mul.domain or len(mul.inputs) != 2:
        return None
    for k in (0, 1):
        cast, scales = producers.get(mul.inputs[k]), producers.get(mul.inputs[1 - k])
        if cast is None or cast.op != "Cast" or scales is None or scales.op != "Mul" or scales.domain:
            continue
        mmi = producers.get(cast.inputs[0])
        if mmi is None or mmi.op != "MatMulInteger" or only_reader(graph, consumers, mmi.outputs[0]) is not cast \
                or only_reader(graph, consumers, cast.outputs[0]) is not mul or not _is_f32(graph, mul.outputs[0]):
            continue
        A, B, za, zb = (_input(mmi, i) for i in range(4))
        w = graph.values[B]
        if not w.is_const or len(w.shape) != 2 or (zb and _const(graph, zb) is None):
            continue
        if za and graph.values[za].size != 1:
            continue
        N = w.shape[1]
        sx, sw = scales.inputs
        if _const(graph, sx) is not None and _const(graph, sw) is None:
            sx, sw = sw, sx
        if not (_is_f32(graph, sx) and _is_f32(graph, sw)) or graph.values[sx].size != 1 \
                or not _column_vector(_const(graph, sw), N):
            continue
        nodes, last, bias = [mmi, cast, mul], mul, ""
        add = only_reader(graph, consumers, mul.outputs[0])
        if add is not None and add.op == "Add" and not add.domain and len(add.inputs) == 2:
            other = add.inputs[1] if add.inputs[0] == mul.outputs[0] else add.inputs[0]
            data = _const(graph, other)
            if _is_f32(graph, other) and _column_vector(data, N) and data.ndim <= 1 \
                    and tuple(graph.values[add.outputs[0]].shape) == tuple(graph.values[mul.outputs[0]].shape):
                nodes, last, bias = nodes + [add], add, other
        return nodes, [A, B, za, zb, sx, sw, bias, "", ""], last
    return None


def _dequantized_weight(graph: Graph, name: str, producers, trans: bool):
    """(integer weight [K, N], zero point, scale) of DQ(W const) feeding a product, or None."""
    dq = producers.get(name)
    if dq is None or dq.op != "DequantizeLinear" or dq.domain or not _is_f32(graph, name):
        return None
    w, s, z = (_const(graph, _input(dq, i)) for i in range(3))
    if w is None or s is None or w.ndim != 2 or np.dtype(w.dtype).name not in ("int8", "uint8") \
            or int(dq.attr("block_size", 0)):
        return None
    axis = int(dq.attr("axis", 1)) % 2
    n_axis = 0 if trans else 1
    if s.size > 1 and axis != n_axis:
        return None
    return (w.T if trans else w), z, s


def _qdq(graph: Graph, prod: Node, consumers, producers):
    """DQ(x) @ DQ(W) [+ bias] [-> Q] -> (nodes replaced, fused inputs, last node)."""
    if prod.domain or prod.op not in ("MatMul", "Gemm"):
        return None
    trans_b = prod.op == "Gemm" and int(prod.attr("transB", 0))
    if prod.op == "Gemm" and (int(prod.attr("transA", 0)) or float(prod.attr("alpha", 1.0)) != 1.0
                              or float(prod.attr("beta", 1.0)) != 1.0):
        return None
    dqa = producers.get(prod.inputs[0])
    if dqa is None or dqa.op != "DequantizeLinear" or dqa.domain:
        return None
    A, sx, zx = (_input(dqa, i) for i in range(3))
    if np.dtype(graph.values[A].dtype).name not in ("uint8", "int8") or _const(graph, sx) is None \
            or graph.values[sx].size != 1 or not _is_f32(graph, sx) or (zx and _const(graph, zx) is None):
        return None
    weight = _dequantized_weight(graph, prod.inputs[1], producers, bool(trans_b))
    if weight is None:
        return None
    w, zw, sw = weight
    K, N = w.shape
    if len(graph.values[A].shape) < 2 or graph.values[A].shape[-1] != K:
        return None
    nodes, last, bias_dq = [prod], prod, None
    if prod.op == "Gemm" and _input(prod, 2):
        bias_dq = producers.get(prod.inputs[2])
        if bias_dq is None:
            return None
    else:
        add = only_reader(graph, consumers, prod.outputs[0])
        if add is not None and add.op == "Add" and not add.domain and len(add.inputs) == 2:
            other = add.inputs[1] if add.inputs[0] == prod.outputs[0] else add.inputs[0]
            cand = producers.get(other)
            if cand is not None and cand.op == "DequantizeLinear" \
                    and tuple(graph.values[add.outputs[0]].shape) == tuple(graph.values[prod.outputs[0]].shape):
                nodes, last, bias_dq = nodes + [add], add, cand
    bias = ""
    mult = np.float32(np.asarray(_const(graph, sx), np.float32).reshape(-1)[0]) * np.asarray(sw, np.float32).reshape(-1)
    if bias_dq is not None:
        b, bs, bz = (_const(graph, _input(bias_dq, i)) for i in range(3))
        if b is None or bs is None or np.dtype(b.dtype) != np.int32 or b.ndim != 1 or b.size != N \
                or (bz is not None and np.any(bz != 0)) \
                or not np.array_equal(np.broadcast_to(np.asarray(bs, np.float32).reshape(-1), (N,)),
                                      np.broadcast_to(mult, (N,))):
            return None
        bias = _input(bias_dq, 0)
    q = only_reader(graph, consumers, last.outputs[0])
    sy = zy = ""
    if q is not None and q.op == "QuantizeLinear" and not q.domain and _const(graph, _input(q, 1)) is not None \
            and graph.values[_input(q, 1)].size == 1 and _is_f32(graph, _input(q, 1)) and _input(q, 2) \
            and _const(graph, _input(q, 2)) is not None and graph.values[_input(q, 2)].size == 1:
        nodes, last, sy, zy = nodes + [q], q, _input(q, 1), _input(q, 2)
    elif bias:
        return None   # a float output adds the bias as float32 (fold_constants' path is exact enough)
    b_name = add_constant(graph, f"{prod.name}_wq", np.ascontiguousarray(w))
    sw_name = add_constant(graph, f"{prod.name}_ws", np.asarray(sw, np.float32).reshape(-1))
    zw_name = add_constant(graph, f"{prod.name}_wz", np.asarray(zw).reshape(-1)) if zw is not None else ""
    return nodes, [A, b_name, zx, zw_name, sx, sw_name, bias, sy, zy], last


def _qdq_conv(graph: Graph, conv: Node, consumers, producers):
    """Q(Conv(DQ(x), DQ(W), DQ(bias_i32))) -> QLinearConv (group 1, or depthwise: the convolutions
    with an integer kernel; other grouped ones stay in float)."""
    if conv.op != "Conv" or conv.domain:
        return None
    group = int(conv.attr("group", 1))
    dqx, dqw = producers.get(conv.inputs[0]), producers.get(conv.inputs[1])
    if dqx is None or dqw is None or dqx.op != "DequantizeLinear" or dqw.op != "DequantizeLinear" or dqx.domain \
            or dqw.domain:
        return None
    X, sx, zx = (_input(dqx, i) for i in range(3))
    W, sw, zw = (_input(dqw, i) for i in range(3))
    w = _const(graph, W)
    if w is None or w.ndim != 4 or np.dtype(w.dtype).name not in ("int8", "uint8") or _const(graph, sw) is None \
            or (zw and _const(graph, zw) is None) or int(dqw.attr("axis", 1)) % 4 != 0 and graph.values[sw].size > 1:
        return None
    if np.dtype(graph.values[X].dtype).name not in ("uint8", "int8") or _const(graph, sx) is None \
            or graph.values[sx].size != 1 or not _is_f32(graph, sx) or not _is_f32(graph, sw) \
            or (zx and _const(graph, zx) is None):
        return None
    OC = w.shape[0]
    if group != 1 and not (group == OC == graph.values[X].shape[1] and w.shape[1] == 1):
        return None   # grouped convs other than depthwise stay in float
    mult = np.float32(np.asarray(_const(graph, sx), np.float32).reshape(-1)[0]) * np.asarray(_const(graph, sw), np.float32).reshape(-1)
    bias = ""
    if _input(conv, 2):
        bdq = producers.get(conv.inputs[2])
        if bdq is None or bdq.op != "DequantizeLinear":
            return None
        b, bs, bz = (_const(graph, _input(bdq, i)) for i in range(3))
        if b is None or bs is None or np.dtype(b.dtype) != np.int32 or b.size != OC \
                or (bz is not None and np.any(bz != 0)) \
                or not np.array_equal(np.broadcast_to(np.asarray(bs, np.float32).reshape(-1), (OC,)),
                                      np.broadcast_to(mult, (OC,))):
            return None
        bias = _input(bdq, 0)
    q = only_reader(graph, consumers, conv.outputs[0])
    if q is None or q.op != "QuantizeLinear" or q.domain or _const(graph, _input(q, 1)) is None \
            or graph.values[_input(q, 1)].size != 1 or not _is_f32(graph, _input(q, 1)) or not _input(q, 2) \
            or _const(graph, _input(q, 2)) is None or graph.values[_input(q, 2)].size != 1:
        return None
    sy, zy = _input(q, 1), _input(q, 2)
    if not zx:
        zx = add_constant(graph, f"{conv.name}_xz", np.zeros((), graph.values[X].dtype))
    if not zw:
        zw = add_constant(graph, f"{conv.name}_wz", np.zeros((), w.dtype))
    attrs = {k: v for k, v in conv.attrs.items() if k in ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")}
    # where the target has no int8 kernel for it, compute it as the QDQ graph did (qconv.py), not exactly
    attrs["fallback"] = "float"
    return [conv, q], [X, sx, zx, W, sw, zw, sy, zy] + ([bias] if bias else []), q, ("QLinearConv", "", attrs)


def _same_quantisation(graph: Graph, dq: Node, q: Node) -> bool:
    """Whether Q requantises with DQ's own constant, per-tensor scale and zero point."""
    pairs = [(_input(dq, 1), _input(q, 1)), (_input(dq, 2), _input(q, 2))]
    for a, b in pairs:
        da, db = _const(graph, a), _const(graph, b)
        if da is None or db is None or da.size != 1 or db.size != 1 or da.dtype != db.dtype \
                or da.reshape(-1)[0] != db.reshape(-1)[0]:
            return False
    return True


# ops that commute with an increasing elementwise map: they move or pick elements (MaxPool the largest)
_ORDER_PRESERVING = ("MaxPool", "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose")


def _qdq_maxpool(graph: Graph, pool: Node, consumers, producers):
    """Q(op(DQ(x))) with Q's scale and zero point DQ's, op MaxPool or one that moves elements
    (Flatten, Reshape, Transpose...) -> op(x): op commutes with the increasing map q -> (q - z) s,
    and Q(DQ(q)) = q exactly."""
    if pool.op not in _ORDER_PRESERVING or pool.domain or len(pool.outputs) > 1 and pool.outputs[1]:
        return None
    if pool.op != "MaxPool" and any(not graph.values[i].is_const for i in pool.inputs[1:] if i):
        return None
    dq = producers.get(pool.inputs[0])
    q = only_reader(graph, consumers, pool.outputs[0])
    if dq is None or dq.op != "DequantizeLinear" or dq.domain or q is None or q.op != "QuantizeLinear" or q.domain:
        return None
    if not _same_quantisation(graph, dq, q) or np.dtype(graph.values[_input(dq, 0)].dtype).name not in ("uint8", "int8"):
        return None
    scale = _const(graph, _input(dq, 1))
    if not float(scale.reshape(-1)[0]) > 0:
        return None
    return [pool, q], [_input(dq, 0)] + list(pool.inputs[1:]), q, (pool.op, "", dict(pool.attrs))


def _qdq_add(graph: Graph, add: Node, consumers, producers):
    """Q(DQ(a) + DQ(b)) of equal shapes -> QLinearAdd (domain "cuvil", com.microsoft's inputs and
    arithmetic: y = saturate(rint(((a - z_a) s_a + (b - z_b) s_b) / s_y) + z_y), in float32)."""
    if add.op != "Add" or add.domain or len(add.inputs) != 2:
        return None
    dqs = [producers.get(i) for i in add.inputs]
    q = only_reader(graph, consumers, add.outputs[0])
    if any(d is None or d.op != "DequantizeLinear" or d.domain for d in dqs) or q is None \
            or q.op != "QuantizeLinear" or q.domain or not _input(q, 2):
        return None
    shapes = {tuple(graph.values[_input(d, 0)].shape) for d in dqs} | {tuple(graph.values[add.outputs[0]].shape)}
    if len(shapes) != 1:
        return None
    inputs = []
    for d in dqs + [q]:
        x, s, z = (_input(d, i) for i in range(3))
        if not z or _const(graph, s) is None or _const(graph, z) is None or graph.values[s].size != 1 \
                or graph.values[z].size != 1 or not _is_f32(graph, s):
            return None
        inputs += [x, s, z] if d is not q else [s, z]
    dtypes = {np.dtype(graph.values[i].dtype).name for i in (inputs[0], inputs[3], q.outputs[0])}
    if len(dtypes) != 1 or dtypes - {"uint8", "int8"}:
        return None
    return [add, q], inputs, q, ("QLinearAdd", "cuvil", {})


def _clip_bounds(graph: Graph, node: Node):
    """(lo, hi) of a Relu or a Clip with constant bounds, else None."""
    if node.domain or node.op not in ("Relu", "Clip"):
        return None
    if node.op == "Relu":
        return 0.0, np.inf
    if len(node.inputs) > 1:   # opset 11+: bounds are inputs
        lo, hi = (_const(graph, _input(node, i)) for i in (1, 2))
        if (_input(node, 1) and lo is None) or (_input(node, 2) and hi is None):
            return None
        return (float(lo) if lo is not None else -np.inf), (float(hi) if hi is not None else np.inf)
    return float(node.attr("min", -np.inf)), float(node.attr("max", np.inf))


def _qdq_lookup(graph: Graph, node: Node, consumers, producers):
    """Q(Relu|Clip(DQ(x))) of 8-bit x -> QLookup(x, table): 256 inputs, so the whole chain is a table
    computed at build time with onnxruntime's arithmetic (cuvil/evaluate.py)."""
    from cuvil.evaluate import evaluate_exact
    bounds = _clip_bounds(graph, node)
    if bounds is None:
        return None
    dq, q = producers.get(node.inputs[0]), only_reader(graph, consumers, node.outputs[0])
    if dq is None or dq.op != "DequantizeLinear" or dq.domain or q is None or q.op != "QuantizeLinear" or q.domain:
        return None
    x = _input(dq, 0)
    params = [_const(graph, _input(d, i)) for d in (dq, q) for i in (1, 2)]
    if any(p is None or p.size != 1 for p in params) or not _input(q, 2):
        return None
    dtype = np.dtype(graph.values[x].dtype)
    if dtype.name not in ("uint8", "int8") or np.dtype(graph.values[q.outputs[0]].dtype).name not in ("uint8", "int8"):
        return None
    info = np.iinfo(dtype)
    values = np.arange(info.min, info.max + 1).astype(dtype)
    real = evaluate_exact("DequantizeLinear", "", [values, params[0], params[1]], {})
    if real is None:
        return None
    clipped = np.clip(real[0], np.float32(bounds[0]), np.float32(bounds[1])).astype(real[0].dtype)
    table = evaluate_exact("QuantizeLinear", "", [clipped, params[2], params[3]], {})
    if table is None:
        return None
    name = add_constant(graph, f"{node.name}_table", np.ascontiguousarray(table[0]))
    return [node, q], [x, name], q, ("QLookup", "cuvil", {})


def fold_qdq(graph: Graph) -> Graph:
    consumers, producers = graph.consumers(), graph.producers()
    result = graph.copy()
    plans, claimed = {}, set()
    for node in graph.nodes:
        plan = _dynamic(result, node, consumers, producers) or _qdq(result, node, consumers, producers) \
            or _qdq_conv(result, node, consumers, producers) or _qdq_maxpool(result, node, consumers, producers) \
            or _qdq_add(result, node, consumers, producers) or _qdq_lookup(result, node, consumers, producers)
        if plan is None or any(n.name in claimed for n in plan[0]):
            continue
        claimed.update(n.name for n in plan[0])
        plans[plan[2].name] = plan
    if not plans:
        return graph
    taken = node_names(result)
    nodes = []
    for node in result.nodes:
        if node.name in plans:
            replaced, inputs, last, *made = plans[node.name]
            op, domain, attrs = made[0] if made else (FUSED, "cuvil", {})
            name = unique_node_name(taken, f"{replaced[0].name}_int8")
            nodes.append(Node(op, name, inputs, [last.outputs[0]], attrs, domain=domain))
        elif node.name not in claimed:
            nodes.append(node)
    result.nodes = nodes
    return drop_unused_values(result)


def describe(before: Graph, after: Graph) -> str:
    n = sum(1 for node in after.nodes if node.op == FUSED and node.domain == "cuvil")
    convs = sum(1 for node in after.nodes if node.op == "QLinearConv") - sum(1 for node in before.nodes if node.op == "QLinearConv")
    adds = sum(1 for node in after.nodes if node.op == "QLinearAdd")
    parts = ([f"{n} quantised product{'s' if n != 1 else ''} into {FUSED}"] if n else []) \
        + ([f"{convs} QDQ Conv{'s' if convs != 1 else ''} into QLinearConv"] if convs else []) \
        + ([f"{adds} QDQ Add{'s' if adds != 1 else ''} into QLinearAdd"] if adds else [])
    return ", ".join(parts)
