"""ONNX -> CIR.

Every value gets a static shape and a dtype. Symbolic input dims take their
value from the caller's `input_shapes`. Initializers and Constant nodes become
constants, and any node whose inputs are all constant is evaluated here with
ONNX's reference evaluator, so the shape arithmetic exporters write
(Shape -> Gather -> Concat -> Reshape) is gone before the passes run. One exception:
a DequantizeLinear of a constant integer tensor (a quantised weight) stays a node, so that
the passes see the weight in its quantised form; fold_constants folds what they leave.
Output types of the remaining nodes come from ONNX's own shape inference,
run one node at a time with every input type known.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .. import contrib, nbits
from . import data_dependent, quantized_lstm, sequences
from ..evaluate import evaluate_exact
from ..ops import is_random_dropout
from ..errors import CuvilError, ModelError, ShapeError, UnsupportedOpError
from ..ir import Graph, Node, Value

# Constant inputs at most this large are handed to shape inference with their
# data (a Reshape target, Slice starts...); larger ones only with their type.
_SMALL_CONST = 4096
# Folded constants larger than this stay as nodes: folding them would only
# copy weights around (a Transpose of a weight is done by the kernel packer).
_MAX_FOLD_ELEMENTS = 1 << 24


def read_model(source) -> tuple[onnx.ModelProto, bytes, Path | None]:
    """Load a model from a path, bytes or a ModelProto; return it, its bytes and its folder."""
    if isinstance(source, onnx.ModelProto):
        return source, source.SerializeToString(), None
    if isinstance(source, bytes):
        try:
            return onnx.load_model_from_string(source), source, None
        except Exception as exc:
            raise ModelError(f"not a valid ONNX protobuf ({type(exc).__name__}: {exc})") from None
    path = Path(os.fspath(source))
    if not path.is_file():
        raise ModelError(f"model file not found: {path}", hint="check the path (relative paths are resolved from the current directory or cuvil.yaml's folder)")
    data = path.read_bytes()
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf raises its own DecodeError and friends
        raise ModelError(f"{path}: not a valid ONNX protobuf ({type(exc).__name__}: {exc})",
                         hint="the file may be truncated or not an ONNX model") from None
    if not model.graph.node and not model.graph.output:
        raise ModelError(f"{path}: the ONNX graph is empty", hint="the file may be truncated or not an ONNX model")
    return model, data, path.parent


def model_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ml_dtypes' narrow formats: kernels reach them through load/store (backends/numba_cpu/narrow.py).
_NARROW_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                            "float8_e8m0fnu", "float4_e2m1fn", "int4", "uint4", "int2", "uint2"})


def _np_dtype(elem_type: int, where: str) -> np.dtype:
    if elem_type == onnx.TensorProto.STRING:
        return np.dtype(object)   # a string tensor: one char pointer an element (docs/strings.md)
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:
        dtype = None
    if dtype is None or (dtype.kind in "OUSVc" and dtype.name not in _NARROW_DTYPES):
        name = onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else elem_type
        raise UnsupportedOpError(f"{where}: tensors of element type {name} are not supported",
                                 hint="supported: float, integer, bool and string tensors (float16, bfloat16, float8, float4, int4, int2 included)")
    return dtype


def _tensor_to_array(tensor: onnx.TensorProto, base_dir: Path | None) -> np.ndarray:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        if base_dir is None:
            raise ModelError(f"initializer '{tensor.name}' uses external data but the model was given without a folder")
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (base_dir / location).resolve()
        if base_dir.resolve() not in target.parents:
            raise ModelError(f"initializer '{tensor.name}': external data location '{location}' is outside the model's folder",
                             hint="external data files must live in the model's folder or below it")
        return numpy_helper.to_array(tensor, base_dir=str(base_dir))
    return numpy_helper.to_array(tensor)


def _attrs(node: onnx.NodeProto) -> dict:
    attrs = {}
    for attr in node.attribute:
        if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            raise UnsupportedOpError(f"node '{node.name}' ({node.op_type}) has a subgraph attribute '{attr.name}'; "
                                     "only If, Loop and Scan take subgraphs here",
                                     hint="If, Loop and Scan are inlined when their control is known at build "
                                          "time (frontends/control_flow.py); other ops with subgraphs are not")
        value = helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, list):
            value = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
        attrs[attr.name] = value
    return attrs


def _fixed_dim(dim) -> bool:
    """Whether a model dim is a fixed size. Paddle2ONNX (and older exporters) write a
    dynamic dim as `dim_value: -1` rather than a `dim_param`; onnxruntime treats a
    negative dim_value as dynamic, and so do we (0 is a real, empty dim)."""
    return dim.HasField("dim_value") and dim.dim_value >= 0


def _static_shape(vi: onnx.ValueInfoProto, given: dict) -> tuple[tuple[int, ...], np.dtype]:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        raise UnsupportedOpError(f"input '{vi.name}' is not a tensor (sequences and maps are not supported)")
    dtype = _np_dtype(t.elem_type, f"input '{vi.name}'")
    dims = list(t.shape.dim) if t.HasField("shape") else None
    if vi.name in given:
        try:
            shape = tuple(int(d) for d in given[vi.name])
        except (TypeError, ValueError):
            raise ShapeError(f"input '{vi.name}': the shape {given[vi.name]!r} is not a list of integers") from None
        if any(d <= 0 for d in shape):
            raise ShapeError(f"input '{vi.name}': every dim of the shape {list(shape)} must be positive")
        if dims is not None and len(dims) != len(shape):
            raise ShapeError(f"input '{vi.name}': the model has rank {len(dims)} but the given shape {list(shape)} has rank {len(shape)}")
        for i, (d, s) in enumerate(zip(dims or [], shape)):
            if _fixed_dim(d) and d.dim_value != s:
                raise ShapeError(f"input '{vi.name}': dim {i} is {d.dim_value} in the model but {s} was given")
        return shape, dtype
    # Every way of giving a shape: cuvil.yaml, the Python API, `cuvil bench`.
    give = (f"give its static shape: inputs: {{{vi.name}: [...]}} in cuvil.yaml, input_shapes= in Python, "
            f"--shape {vi.name}=D1,D2,... with cuvil bench")
    if dims is None:
        raise ShapeError(f"input '{vi.name}' has no shape in the model", hint=give)
    symbolic = [d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?") for d in dims if not _fixed_dim(d)]
    if symbolic:
        raise ShapeError(f"input '{vi.name}' has symbolic dims {symbolic}", hint=give)
    return tuple(d.dim_value for d in dims), dtype


# No tensor may be larger than this (2**40 bytes): sizes beyond it are a mistake in
# the declared shapes, and their byte counts would overflow the driver's arithmetic.
_MAX_TENSOR_BYTES = 1 << 40


def _check_size(shape, dtype, where):
    size = 1
    for d in shape:
        size *= int(d)
    nbytes = size * np.dtype(dtype).itemsize
    if nbytes > _MAX_TENSOR_BYTES:
        raise ShapeError(f"{where}: shape {list(shape)} would take {nbytes:,} bytes, more than the {_MAX_TENSOR_BYTES:,} "
                         "a tensor may", hint="check the input shapes given in inputs: / input_shapes=")


def _topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Order nodes so each comes after its producers; a cycle or an undefined input is an error."""
    producer = {}
    for node in nodes:
        for out in node.output:
            if out:
                if out in producer or out in available:
                    raise ModelError(f"value '{out}' is produced twice (node '{node.name}', op {node.op_type})")
                producer[out] = node
    order, state = [], {}
    for root in nodes:
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            key = id(node)
            if done:
                state[key] = 2
                order.append(node)
                continue
            if state.get(key) == 2:
                continue
            if state.get(key) == 1:
                continue
            state[key] = 1
            stack.append((node, True))
            for name in node.input:
                if not name or name in available:
                    continue
                dep = producer.get(name)
                if dep is None:
                    raise ModelError(f"node '{node.name}' ({node.op_type}) reads '{name}', which no node, input or initializer defines")
                if state.get(id(dep)) == 1:
                    raise ModelError(f"the graph has a cycle through node '{dep.name}' ({dep.op_type}) and node '{node.name}' ({node.op_type})")
                if state.get(id(dep)) != 2:
                    stack.append((dep, False))
    return order


class _Importer:
    def __init__(self, model: onnx.ModelProto, base_dir: Path | None, input_shapes: dict):
        self.model = model
        self.base_dir = base_dir
        self.opsets = {o.domain or "": o.version for o in model.opset_import}
        self.values: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.given = {k: tuple(v) if v is not None else None for k, v in (input_shapes or {}).items()}
        self.node_names: set[str] = set()
        self.seqs = sequences.Sequences(self)  # sequence- and optional-typed values (frontends/sequences.py)

    def run(self) -> Graph:
        g = self.model.graph
        for tensor in g.initializer:
            arr = _tensor_to_array(tensor, self.base_dir)
            self.values[tensor.name] = Value(tensor.name, arr.dtype, tuple(arr.shape), arr)
        inputs = []
        for vi in g.input:
            if vi.name in self.values:
                continue  # an initializer listed as input (old exporters): a constant
            if not sequences.is_tensor_type(vi.type):
                inputs.extend(self.seqs.declare_input(vi, self.given, self._tensor_input))
                continue
            shape, dtype = _static_shape(vi, self.given)
            _check_size(shape, dtype, f"input '{vi.name}'")
            self.values[vi.name] = Value(vi.name, dtype, shape)
            inputs.append(vi.name)
        unknown = sorted(set(self.given) - set(inputs) - {e["name"] for e in self.seqs.structure.get("inputs", [])})
        if unknown:
            raise ShapeError(f"input_shapes names {unknown}, which are not inputs of the model (inputs: {inputs})")
        if not self.opsets:
            raise ModelError("the model imports no opset (opset_import is empty)",
                             hint="re-export it; every ONNX model names the versions of the domains it uses")
        if "" not in self.opsets and "ai.onnx" not in self.opsets \
                and any(n.domain in ("", "ai.onnx") for n in g.node):   # ai.onnx.ml alone is fine
            raise UnsupportedOpError("the model imports no version of the default ONNX domain")
        for node in _topological(list(g.node), set(self.values) | set(self.seqs.sequences) | set(self.seqs.optionals)):
            self._import_node(node)
        outputs = []
        for vi in g.output:
            if sequences.is_tensor_type(vi.type) and not self.seqs.defines(vi.name):
                outputs.append(vi.name)
            else:
                outputs.extend(self.seqs.declare_output(vi))
        for name in outputs:
            if name not in self.values:
                raise ModelError(f"graph output '{name}' is never produced")
        self._check_data_dependent(outputs)
        return Graph(name=g.name or "model", values=self.values, nodes=self.nodes, inputs=inputs,
                     outputs=outputs, opset=self.opsets.get("", self.opsets.get("ai.onnx", 0)),
                     structure=self.seqs.structure)

    def _tensor_input(self, name: str, tensor_type: onnx.TypeProto) -> str:
        """One tensor of a sequence or optional input, declared like a tensor input (the given shape
        of a sequence's element wins over the sequence's element type, which only bounds it)."""
        vi = onnx.ValueInfoProto(name=name)
        vi.type.CopyFrom(tensor_type)
        if name in self.given and self.given[name] is not None:
            vi.type.tensor_type.ClearField("shape")
        shape, dtype = _static_shape(vi, self.given)
        _check_size(shape, dtype, f"input '{name}'")
        self.values[name] = Value(name, dtype, shape)
        return name

    def _unique_node_name(self, base: str) -> str:
        """ONNX does not require node names to be unique (a Scan body inlined per step, or a
        function body, holds several unnamed nodes of one op), but the passes tell nodes apart
        by name: a repeated name gets a suffix."""
        name, i = base, 0
        while name in self.node_names:
            i += 1
            name = f"{base}~{i}"
        self.node_names.add(name)
        return name

    # The interface control_flow.Inliner uses.
    def import_node(self, proto: onnx.NodeProto) -> None:
        self._import_node(proto)

    def add_node(self, node: Node) -> None:
        """A CIR node the inliner makes itself (a compiled loop's LoopBegin / LoopEnd)."""
        node.name = self._unique_node_name(node.name)
        self.nodes.append(node)

    def add_constant(self, name: str, array: np.ndarray) -> None:
        self.values[name] = Value(name, array.dtype, tuple(array.shape), array)

    def tensor_to_array(self, tensor) -> np.ndarray:
        return _tensor_to_array(tensor, self.base_dir)

    def _import_node(self, proto: onnx.NodeProto) -> None:
        name = self._unique_node_name(proto.name or f"{proto.op_type}_{len(self.nodes)}")
        domain = "" if proto.domain in ("", "ai.onnx") else proto.domain
        if self.seqs.handles(proto):
            self.seqs.import_node(proto, name)
            return
        if domain == "" and proto.op_type in ("If", "Loop", "Scan"):
            from .control_flow import Inliner
            getattr(Inliner(self), f"inline_{proto.op_type.lower()}")(proto, name)
            return
        if domain not in self.opsets and not (domain == "" and "ai.onnx" in self.opsets):
            raise UnsupportedOpError(f"node '{name}' ({proto.op_type}) is in domain '{proto.domain}', which the model does not import")
        if domain == "" and proto.op_type == "STFT":
            self._import_stft(proto, name)
            return
        if domain == quantized_lstm.DOMAIN and proto.op_type == quantized_lstm.OP:
            lstm = quantized_lstm.lstm_node(proto, name, self.values, self._fresh_value, self.add_constant)
            self.node_names.discard(name)   # the LSTM keeps the node's name
            self._import_node(lstm)
            # its recurrence multiplies on 16-bit operands, as accurate as 8-bit activations or more
            self.nodes[-1].attrs["precision"] = quantized_lstm.RECURRENCE_PRECISION
            return
        attrs = _attrs(proto)
        if proto.op_type == "Constant" and domain == "":
            arr = self._evaluate(proto, name)[0]
            self.values[proto.output[0]] = Value(proto.output[0], arr.dtype, tuple(arr.shape), arr)
            return
        inputs = list(proto.input)
        in_values = [self.values[i] for i in inputs if i]
        # Shape and Size only read the (static) shape, so their result is known now.
        if domain == "" and (all(v.is_const for v in in_values) or proto.op_type in ("Shape", "Size")) \
                and proto.op_type not in _NEVER_FOLD and not _keeps_quantised(proto, in_values) and in_values \
                and not self._random_dropout(proto, domain):
            if sum(v.size for v in in_values if v.is_const) <= _MAX_FOLD_ELEMENTS or proto.op_type in ("Shape", "Size"):
                results = self._evaluate(proto, name)
                for out, arr in zip(proto.output, results):
                    if out:
                        arr = np.asarray(arr)
                        self.values[out] = Value(out, arr.dtype, tuple(arr.shape), arr)
                return
        outputs = list(proto.output)
        if domain == "" and proto.op_type in data_dependent.OPS:
            # Data-dependent shapes: an upper bound, and a dims value (one more output of the
            # node) that the kernel fills with the actual shape (frontends/data_dependent.py).
            inferred = data_dependent.bounds(proto.op_type, name, attrs, [self.values[i] if i else None for i in inputs])
        else:
            inferred = [(shape, dtype, False) for shape, dtype in self._infer(proto, name)]
        for out, (shape, dtype, dynamic) in zip(proto.output, inferred):
            if out:
                _check_size(shape, dtype, f"node '{name}' ({proto.op_type}) output '{out}'")
                self.values[out] = Value(out, dtype, shape)
                if dynamic:
                    dims = self._fresh_value(f"{out}:shape")
                    self.values[dims] = Value(dims, np.dtype(np.int64), (len(shape),))
                    self.values[out].shape_from = dims
                    outputs.append(dims)
        self.nodes.append(Node(op=proto.op_type, name=name, inputs=inputs, outputs=outputs,
                               attrs=attrs, domain=domain))

    def _random_dropout(self, proto: onnx.NodeProto, domain: str) -> bool:
        """A training Dropout draws its mask at run time: not folded, even of a constant."""
        node = SimpleNamespace(op=proto.op_type, domain=domain, inputs=list(proto.input))
        return is_random_dropout(node, SimpleNamespace(values=self.values))

    def _import_stft(self, proto: onnx.NodeProto, name: str) -> None:
        """STFT as the frames (a Gather of constant positions), times the window, and a DFT over
        each frame: the ops it is defined by, each with its kernel."""
        inputs = list(proto.input) + [""] * (4 - len(proto.input))
        signal, step, window, length = inputs[:4]
        x = self.values[signal]
        const = lambda n: self.values[n].is_const if n else False
        if not const(step) or (length and not const(length)) or (not length and not window):
            raise UnsupportedOpError(f"node '{name}' (STFT): frame_step and frame_length (or a window) must be "
                                     "known at build time")
        step = int(np.asarray(self.values[step].data).reshape(-1)[0])
        frame = int(np.asarray(self.values[length].data).reshape(-1)[0]) if length else int(self.values[window].shape[0])
        frames = 1 + (int(x.shape[1]) - frame) // step
        onesided = int(next((helper.get_attribute_value(a) for a in proto.attribute if a.name == "onesided"), 1))
        if frames < 1 or frame < 1:
            raise UnsupportedOpError(f"node '{name}' (STFT): a frame of {frame} does not fit the signal of "
                                     f"{x.shape[1]} samples")
        fresh = lambda tag: self._fresh_value(f"{name}/{tag}")
        positions = fresh("positions")
        self.add_constant(positions, (np.arange(frames)[:, None] * step + np.arange(frame)[None, :]).astype(np.int64))
        framed = fresh("frames")
        self._import_node(helper.make_node("Gather", [signal, positions], [framed], name=f"{name}/frames", axis=1))
        if window:
            shape = fresh("window_shape")
            self.add_constant(shape, np.array([1, 1, frame, 1], np.int64))
            column = fresh("window")
            self._import_node(helper.make_node("Reshape", [window, shape], [column], name=f"{name}/window"))
            windowed = fresh("windowed")
            self._import_node(helper.make_node("Mul", [framed, column], [windowed], name=f"{name}/windowed"))
            framed = windowed
        opset = self.opsets.get("", self.opsets.get("ai.onnx", 0))
        if opset >= 20:
            axis = fresh("axis")
            self.add_constant(axis, np.array(2, np.int64))
            dft = helper.make_node("DFT", [framed, "", axis], [proto.output[0]], name=f"{name}/dft", onesided=onesided)
        else:
            dft = helper.make_node("DFT", [framed], [proto.output[0]], name=f"{name}/dft", onesided=onesided, axis=2)
        self._import_node(dft)

    def _fresh_value(self, base: str) -> str:
        name, i = base, 0
        while name in self.values:
            i += 1
            name = f"{base}~{i}"
        return name

    def _check_data_dependent(self, outputs) -> None:
        """A value of data-dependent shape may only be a graph output: no kernel downstream of it
        is compiled for a shape known at run time only."""
        for node in self.nodes:
            for name in node.inputs:
                value = self.values.get(name) if name else None
                if value is not None and value.shape_from is not None:
                    maker = next(n for n in self.nodes if name in n.outputs)
                    raise UnsupportedOpError(
                        f"node '{node.name}' ({node.op}) reads '{name}', whose shape depends on the data "
                        f"(made by node '{maker.name}' ({maker.op}))",
                        hint="cuvil compiles data-dependent shapes (NonZero, Unique, NonMaxSuppression, Compress, "
                             "StringNormalizer with stopwords, StringSplit) only as graph outputs; return the value "
                             "from the model, or make its shape static")

    def _single_node_model(self, proto: onnx.NodeProto, with_data) -> onnx.ModelProto:
        inputs, inits = [], []
        for name in dict.fromkeys(i for i in proto.input if i):
            v = self.values[name]
            if v.is_const and with_data(v):
                inits.append(numpy_helper.from_array(np.asarray(v.data), name))
            else:
                inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(v.dtype)), list(v.shape)))
                if v.is_const:
                    # Shape/Size only need the type; other folds need the data as an input feed.
                    pass
        outputs = [helper.make_empty_tensor_value_info(o) for o in proto.output if o]
        graph = helper.make_graph([proto], "node", inputs, outputs, initializer=inits)
        # IR version 4 at least: before it, initializers count only when also listed as graph inputs
        return helper.make_model(graph, opset_imports=self.model.opset_import, ir_version=max(self.model.ir_version, 4))

    def _evaluate(self, proto: onnx.NodeProto, name: str) -> list[np.ndarray]:
        from onnx.reference import ReferenceEvaluator
        try:
            exact = evaluate_exact(proto.op_type, proto.domain,
                                   [self.values[i].data if i else None for i in proto.input], _attrs(proto))
            if exact is not None:
                return exact
            model = self._single_node_model(proto, with_data=lambda v: True)
            feeds = {i.name: np.zeros(self.values[i.name].shape, self.values[i.name].dtype) for i in model.graph.input}
            return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, feeds)]
        except Exception as exc:
            raise ModelError(f"node '{name}' ({proto.op_type}): evaluating it at build time failed: {exc}") from None

    def _drop_padding_window(self, proto, shape):
        """With ceil_mode, ONNX's shape inference keeps a last window that starts
        inside the end padding; onnxruntime and the reference evaluator drop it."""
        attrs = _pool_attrs(proto)
        if not attrs.get("ceil_mode") or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            return shape
        in_shape = self.values[proto.input[0]].shape
        spatial = len(in_shape) - 2
        strides = list(attrs.get("strides", [1] * spatial))
        pads = list(attrs.get("pads", [0] * 2 * spatial))
        shape = list(shape)
        for i in range(spatial):
            if shape[2 + i] > 1 and (shape[2 + i] - 1) * strides[i] >= in_shape[2 + i] + pads[i]:
                shape[2 + i] -= 1
        return tuple(shape)

    def _infer(self, proto: onnx.NodeProto, name: str) -> list[tuple[tuple[int, ...], np.dtype]]:
        if proto.domain == nbits.DOMAIN and proto.op_type == nbits.OP:
            # A contrib op ONNX's shape inference does not know: its rule checks what Cuvil compiles.
            node = Node(op=proto.op_type, name=name, inputs=list(proto.input), outputs=list(proto.output),
                        attrs=_attrs(proto), domain=proto.domain)
            return [nbits.check(node, self.values)]
        domain = "" if proto.domain in ("", "ai.onnx") else proto.domain
        if (domain, proto.op_type) in contrib.RULES:
            # onnxruntime's LLM contrib ops (cuvil/contrib.py): shapes and checks of their own.
            node = Node(op=proto.op_type, name=name, inputs=list(proto.input), outputs=list(proto.output),
                        attrs=_attrs(proto), domain=domain)
            return contrib.infer(node, self.values)
        if proto.op_type == "MeanVarianceNormalization" and proto.domain in ("", "ai.onnx"):
            # ONNX's strict inference trips over this op's function body when `axes` is
            # left at its default; the output is the input's shape and type in any case.
            x = self.values[proto.input[0]]
            return [(tuple(x.shape), np.dtype(x.dtype))]
        if proto.op_type == "MaxUnpool" and domain == "" and len(proto.input) > 2 and proto.input[2] \
                and self.values[proto.input[2]].is_const:
            # ONNX's inference leaves the output dims unknown when output_shape is given; it is the shape
            x = self.values[proto.input[0]]
            return [(tuple(int(d) for d in np.asarray(self.values[proto.input[2]].data).reshape(-1)), np.dtype(x.dtype))]
        if proto.op_type == "ArrayFeatureExtractor" and proto.domain == "ai.onnx.ml":
            # ONNX infers no shape here; onnxruntime's: x's leading dims (one row for a 1-D x) and
            # one column per index
            x, indices = self.values[proto.input[0]], self.values[proto.input[1]]
            lead = tuple(x.shape[:-1]) if len(x.shape) > 1 else (1,)
            return [(lead + (int(np.prod(indices.shape, dtype=np.int64)),), np.dtype(x.dtype))]
        model = self._single_node_model(proto, with_data=lambda v: v.size <= _SMALL_CONST)
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except Exception as exc:
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if "No Op registered" in str(exc) or "not registered" in str(exc):
                raise UnsupportedOpError(f"node '{name}': op {proto.op_type} (domain '{proto.domain}') is not known to ONNX at opset {self.opsets}") from None
            raise ShapeError(f"node '{name}' ({proto.op_type}): shape inference failed: {message}") from None
        types = {vi.name: vi.type for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
        result = []
        for out in proto.output:
            if not out:
                result.append(((), np.dtype(np.float32)))
                continue
            t = types.get(out)
            if (t is None or not t.HasField("tensor_type")) and domain not in ("", "ai.onnx", "ai.onnx.ml"):
                # ONNX's inference knows no op of this domain, and neither does Cuvil
                raise UnsupportedOpError(f"node '{name}': op {proto.op_type} of domain '{proto.domain}' is not "
                                         "supported", hint="README.md, 'Supported ops', lists the contrib ops Cuvil compiles; "
                                         "export the model without it (with onnxruntime's quantisation tools: "
                                         "leave its float op out of op_types_to_quantize)")
            if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape") \
                    or any(not d.HasField("dim_value") for d in t.tensor_type.shape.dim) or t.tensor_type.elem_type == 0:
                raise ShapeError(f"node '{name}' ({proto.op_type}): the shape of output '{out}' cannot be inferred statically",
                                 hint="give every model input a static shape; data-dependent shapes are not supported")
            shape = tuple(int(d.dim_value) for d in t.tensor_type.shape.dim)
            if proto.op_type in ("MaxPool", "AveragePool") and out == proto.output[0]:
                shape = self._drop_padding_window(proto, shape)
            result.append((shape, _np_dtype(t.tensor_type.elem_type, f"node '{name}' output '{out}'")))
        return result


def _pool_attrs(proto):
    return {a.name: helper.get_attribute_value(a) for a in proto.attribute}


# Ops whose result is random or whose folding would only bloat the weights.
_NEVER_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


def _keeps_quantised(proto: onnx.NodeProto, in_values) -> bool:
    """A DequantizeLinear of a constant integer tensor (a quantised weight or bias) stays a node:
    the passes see the weight in its quantised form (an integer pass can compute products on it),
    and fold_constants folds what they leave to float."""
    return proto.op_type == "DequantizeLinear" and np.dtype(in_values[0].dtype).kind in "iu"


def import_onnx(source, input_shapes: dict | None = None, has_kernel=None) -> tuple[Graph, str]:
    """Import a model (path, bytes or ModelProto) as a statically shaped CIR graph.

    With `has_kernel(domain, op)`, ops it rejects are first replaced by their
    ONNX function bodies where the schema defines one (frontends/expand.py).
    Returns the graph and the sha256 of the model's bytes."""
    model, data, base_dir = read_model(source)
    if has_kernel is not None:
        from .expand import expand_functions
        model = expand_functions(model, has_kernel)
    try:
        graph = _Importer(model, base_dir, input_shapes or {}).run()
    except CuvilError:
        raise
    except Exception as exc:
        # A malformed protobuf that parsed (an undefined element type, a tensor whose
        # data does not match its dims...) surfaces as an error of the onnx library.
        where = f"{source}: " if isinstance(source, (str, os.PathLike)) else ""
        raise ModelError(f"{where}the model is malformed: {type(exc).__name__}: {exc}",
                         hint="check it with onnx.checker.check_model; re-export it if it is damaged") from None
    return graph, model_sha256(data)
