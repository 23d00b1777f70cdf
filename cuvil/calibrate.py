"""`precision: int8` — Cuvil's own static quantisation: the float model, calibrated on a few inputs,
rewritten into the QDQ form onnxruntime's `quantize_static` writes, so that passes/fold_qdq.py
lowers it exactly as it lowers an imported quantised model (one lowering for both).

Calibration runs the float32 model on the samples with every tensor it needs exposed as an output
and keeps each tensor's range. It runs onnxruntime on the imported float ONNX graph, not Cuvil's
own float32 library: a library exposes only its graph outputs, and the ranges of intermediate
tensors would need a second library built with every one of them as an output; onnxruntime
computes the same float32 values to rounding, and the ranges only set scales.

    activations (uint8, asymmetric):  lo = min(range_min, 0), hi = max(range_max, 0)
                                      s = (hi - lo) / 255, z = rint(-lo / s)
        method minmax:     range = the smallest and largest value over the samples
        method percentile: range = the `percentile` and 100 - `percentile` percentiles of all values
    weights (int8, symmetric, per output channel when per_channel):
                                      s_w = max|w| / 127, q = clamp(rint(w / s_w), -127, 127)
    bias (int32):                     q_b = rint(b / (s_x s_w)), scale s_x s_w (float32 product)

Which tensors are quantised (each gets QuantizeLinear -> DequantizeLinear):
    the activation input and the output of Conv, MatMul (constant B), Gemm (transA 0, alpha = beta = 1);
    a MatMul's constant bias Add is part of it (the Add's output is quantised, the bias is int32);
    a Relu that is the only reader of such an output is dropped: the output's range starts at 0, so
    its zero point is 0 and QuantizeLinear's saturation at 0 is the Relu (as onnxruntime does);
    both inputs and the output of an Add of two activations (residual), a Relu after it dropped
    the same way (fold_qdq's QLinearAdd requantises with the same saturation);
    MaxPool / Flatten / Reshape / Transpose / Squeeze / Unsqueeze of a quantised tensor: the output
    takes the input's scale and zero point (fold_qdq runs them on the bytes).
Everything else stays float32 between a DequantizeLinear and the next QuantizeLinear.
"""
from __future__ import annotations

import hashlib

import numpy as np

from .errors import ConfigError, CuvilError

CALIBRATION_SEED = 1        # the accuracy report uses seed 0: its inputs are held out from calibration
METHODS = ("minmax", "percentile")
PRODUCTS = ("Conv", "MatMul", "Gemm")
MOVERS = ("MaxPool", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze")
DEFAULTS = {"inputs": "random", "samples": 8, "method": "minmax", "percentile": 99.99, "per_channel": True}


def engine_version() -> str:
    """The version of what runs the float model (onnxruntime)."""
    import onnxruntime
    return onnxruntime.__version__


def options_key(options: dict) -> dict:
    """The calibration's step parameters: its options, and the samples file by content hash."""
    key = {**DEFAULTS, **options, "seed": CALIBRATION_SEED}
    if key["inputs"] != "random":
        from pathlib import Path
        path = Path(key["inputs"])
        if not path.is_file():
            raise ConfigError(f"calibration.inputs: file not found: {path}",
                              hint="'random', or an .npz file with an array per input name")
        key["inputs"] = {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return key


def _input_info(model, input_shapes: dict) -> dict:
    """The model's inputs as accuracy.sample_inputs wants them (a library's `info`)."""
    from onnx import helper
    initializers = {t.name for t in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape = input_shapes.get(value.name)
        if shape is None:
            shape = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
            if any(d < 0 for d in shape):
                raise CuvilError(f"calibration: input '{value.name}' has no static shape",
                                 hint="give its shape (inputs: in cuvil.yaml, input_shapes= or --shape)")
        dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        inputs.append({"name": value.name, "dtype": np.dtype(dtype).name, "shape": [int(d) for d in shape]})
    return {"inputs": inputs}


def calibration_feeds(model, input_shapes: dict, options: dict) -> list[dict]:
    from .accuracy import sample_inputs
    return sample_inputs(_input_info(model, input_shapes), int(options["samples"]), options["inputs"],
                         seed=CALIBRATION_SEED, what="calibration.inputs")


def tensor_ranges(model, feeds: list[dict], names: list[str], method: str, percentile: float) -> dict:
    """{tensor: (lo, hi)} of the float model's tensors `names` over the feeds (onnxruntime)."""
    import onnx
    import onnxruntime as ort
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    probe.graph.output.extend([onnx.ValueInfoProto(name=n) for n in names if n not in have])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = {n: [] for n in names}
    for feed in feeds:
        for name, out in zip(names, session.run(names, feed)):
            values[name].append(np.asarray(out, np.float32).ravel())
    ranges = {}
    for name, parts in values.items():
        data = np.concatenate(parts) if parts else np.zeros(1, np.float32)
        if method == "percentile":
            lo, hi = np.percentile(data, [100 - percentile, percentile])
        else:
            lo, hi = data.min(), data.max()
        ranges[name] = (float(lo), float(hi))
    return ranges


def activation_params(lo: float, hi: float) -> tuple[np.float32, np.uint8]:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = np.float32((hi - lo) / 255.0)
    if not np.isfinite(scale) or scale <= 0:
        scale = np.float32(1.0)
    zero = np.uint8(np.clip(np.rint(-lo / scale), 0, 255))
    return scale, zero


def weight_params(w: np.ndarray, axis: int, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes, float32 scales: one per index of `axis`, or one) of a symmetric weight."""
    if per_channel:
        other = tuple(i for i in range(w.ndim) if i != axis)
        amax = np.abs(w).max(axis=other) if other else np.abs(w)
        shape = [1] * w.ndim
        shape[axis] = -1
    else:
        amax, shape = np.asarray(np.abs(w).max()), [1] * w.ndim
    scale = np.atleast_1d(np.asarray(amax / np.float32(127), np.float32))
    scale[scale == 0] = np.float32(1.0)
    q = np.clip(np.rint(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale.reshape(-1) if per_channel else scale.reshape(())


class _Writer:
    """Adds initializers and nodes with fresh names."""

    def __init__(self, model):
        self.model = model
        self.names = {t.name for t in model.graph.initializer} | {n for node in model.graph.node
                                                                   for n in list(node.input) + list(node.output)} \
            | {v.name for v in model.graph.input} | {v.name for v in model.graph.output}
        self.nodes = []

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def constant(self, base: str, data) -> str:
        from onnx import numpy_helper
        name = self.fresh(base)
        self.model.graph.initializer.append(numpy_helper.from_array(np.asarray(data), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs):
        from onnx import helper
        self.nodes.append(helper.make_node(op, inputs, [output], name=self.fresh(f"{output}_{op}"), **attrs))


def _attr(node, name, default):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def quantize_model(model_bytes: bytes, input_shapes: dict, options: dict) -> bytes:
    """The float ONNX model as a QDQ model calibrated with `options` (DEFAULTS' keys)."""
    import onnx
    from onnx import numpy_helper
    options = {**DEFAULTS, **options}
    if options["method"] not in METHODS:
        raise ConfigError(f"calibration.method: unknown method {options['method']!r}", hint=f"one of: {', '.join(METHODS)}")
    model = onnx.load_model_from_string(model_bytes)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13:
        raise CuvilError(f"calibration: the model is at opset {opset}; per-channel QuantizeLinear needs 13 or later",
                         hint="export the model at opset 13 or later")
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    readers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}

    def activation(name):
        return name and name not in weights

    def only_reader(name, op):
        users = readers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op and users[0].domain in ("", "ai.onnx") \
            and name not in outputs else None

    # 1. the products to quantise, their bias, and the tensor that ends each (after bias / Relu)
    products = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in PRODUCTS or len(node.input) < 2:
            continue
        if not activation(node.input[0]) or node.input[1] not in weights:
            continue
        w = numpy_helper.to_array(weights[node.input[1]])
        if w.dtype != np.float32:
            continue
        bias_add, bias = None, (node.input[2] if len(node.input) > 2 and node.input[2] else "")
        if node.op_type == "Gemm":
            if _attr(node, "transA", 0) or _attr(node, "alpha", 1.0) != 1.0 or _attr(node, "beta", 1.0) != 1.0 \
                    or w.ndim != 2:
                continue
            axis = 0 if _attr(node, "transB", 0) else 1
            if bias and (bias not in weights or numpy_helper.to_array(weights[bias]).size != w.shape[1 - axis]
                         and numpy_helper.to_array(weights[bias]).size != w.shape[axis]):
                continue
        elif node.op_type == "MatMul":
            if w.ndim != 2:
                continue
            axis = 1
            add = only_reader(node.output[0], "Add")
            if add is not None:
                other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
                if other in weights and numpy_helper.to_array(weights[other]).size == w.shape[1] \
                        and numpy_helper.to_array(weights[other]).shape[-1:] == (w.shape[1],):
                    bias_add, bias = add, other
        else:
            axis = 0
            if bias and bias not in weights:
                continue
        last = bias_add or node
        relu = only_reader(last.output[0], "Relu")
        products.append({"node": node, "axis": axis, "bias": bias, "bias_add": bias_add, "relu": relu,
                         "end": relu.output[0] if relu is not None else last.output[0]})
    if not products:
        raise CuvilError("calibration: the model has no Conv, MatMul or Gemm with a constant float32 weight to "
                         "quantise", hint="build it in fp32 (or int4 for weight-only MatMul/Gemm)")

    # 2. the quantised tensors: {name: the name whose parameters it takes (itself, or a mover's input)}
    quantised: dict[str, str] = {}
    relus = [(p["bias_add"] or p["node"], p["relu"]) for p in products if p["relu"] is not None]
    for p in products:
        quantised[p["node"].input[0]] = p["node"].input[0]
        quantised[p["end"]] = p["end"]
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Add" and len(node.input) == 2 and all(activation(i) for i in node.input):
            # a Relu reading only the sum goes into its requantisation too (zero point 0 saturates)
            relu = only_reader(node.output[0], "Relu")
            if relu is not None:
                relus.append((node, relu))
            for name in (*node.input, relu.output[0] if relu is not None else node.output[0]):
                quantised[name] = name
    changed = True
    while changed:      # movers: in topological order the input is decided first; repeat for chains
        changed = False
        for node in graph.node:
            if node.op_type in MOVERS and node.domain in ("", "ai.onnx") and len(node.output) == 1 \
                    and node.input[0] in quantised and node.output[0] not in quantised:
                quantised[node.output[0]] = quantised[node.input[0]]
                changed = True
    # a mover's output read again by a product keeps the input's parameters (step 2 set it to itself)
    for node in graph.node:
        if node.op_type in MOVERS and node.input and node.input[0] in quantised:
            quantised[node.output[0]] = quantised[node.input[0]]

    # 3. calibrate
    feeds = calibration_feeds(model, input_shapes, options)
    sources = sorted({v for v in quantised.values()})
    ranges = tensor_ranges(model, feeds, sources, options["method"], float(options["percentile"]))
    params = {name: activation_params(*ranges[source]) for name, source in quantised.items()}

    # 4. rewrite: drop the Relus, quantise weights and biases, put Q -> DQ on the quantised tensors
    writer = _Writer(model)
    dropped = {id(relu) for _, relu in relus}
    kept = [node for node in graph.node if id(node) not in dropped]
    for last, relu in relus:
        last.output[0] = relu.output[0]
    for p in products:
        node, axis = p["node"], p["axis"]
        w = numpy_helper.to_array(weights[node.input[1]]).astype(np.float32)
        q, sw = weight_params(w, axis, bool(options["per_channel"]))
        base = node.input[1]
        wq = writer.constant(f"{base}_quantized", q)
        ws = writer.constant(f"{base}_scale", sw)
        wz = writer.constant(f"{base}_zero_point", np.zeros(sw.shape, np.int8))
        wd = writer.fresh(f"{base}_DequantizeLinear_Output")
        writer.node("DequantizeLinear", [wq, ws, wz], wd, axis=axis)
        node.input[1] = wd
        if p["bias"]:
            sx = params[node.input[0]][0]
            b = numpy_helper.to_array(weights[p["bias"]]).astype(np.float32).reshape(-1)
            n_out = sw.size if sw.ndim else b.size
            bs = (np.float32(sx) * np.broadcast_to(sw, (n_out,)).astype(np.float32)).astype(np.float32)
            b = np.broadcast_to(b, (n_out,))
            bq = np.clip(np.rint(b / bs), -2 ** 31, 2 ** 31 - 1).astype(np.int32)
            bqn = writer.constant(f"{p['bias']}_quantized", bq)
            bsn = writer.constant(f"{p['bias']}_scale", bs)
            bzn = writer.constant(f"{p['bias']}_zero_point", np.zeros(n_out, np.int32))
            bd = writer.fresh(f"{p['bias']}_DequantizeLinear_Output")
            writer.node("DequantizeLinear", [bqn, bsn, bzn], bd, axis=0)
            target = p["bias_add"] or node
            target.input[list(target.input).index(p["bias"]) if p["bias_add"] else 2] = bd
    producer = {o: n for n in kept for o in n.output}
    for name in sorted(quantised):
        scale, zero = params[name]
        s = writer.constant(f"{name}_scale", np.asarray(scale, np.float32))
        z = writer.constant(f"{name}_zero_point", np.asarray(zero, np.uint8))
        qn = writer.fresh(f"{name}_QuantizeLinear_Output")
        if name in producer:       # the producer writes name_float; the DequantizeLinear writes the name itself
            src = writer.fresh(f"{name}_float")
            out = producer[name]
            out.output[list(out.output).index(name)] = src
            dst = name
        else:                      # a graph input: its readers read the DequantizeLinear's output
            src, dst = name, writer.fresh(f"{name}_DequantizeLinear_Output")
            for n in kept:
                for k, i in enumerate(n.input):
                    if i == name:
                        n.input[k] = dst
        writer.node("QuantizeLinear", [src, s, z], qn)
        writer.node("DequantizeLinear", [qn, s, z], dst)
    # topological order: each new node goes right after what it reads
    order = _topological(list(kept) + writer.nodes, {v.name for v in graph.input} | set(weights)
                         | {t.name for t in graph.initializer})
    del graph.node[:]
    graph.node.extend(order)
    used = {i for n in graph.node for i in n.input}
    keep_init = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep_init)
    graph.ClearField("value_info")
    return model.SerializeToString()


def _topological(nodes: list, available: set) -> list:
    available = set(available) | {""}
    pending, order = list(nodes), []
    while pending:
        rest = []
        for node in pending:
            if all(i in available for i in node.input):
                order.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise CuvilError("calibration: the quantised graph has a cycle or an undefined input "
                             f"(node '{rest[0].name}', {rest[0].op_type})")
        pending = rest
    return order
