"""TensorFlow / Keras -> ONNX, so the ONNX frontend takes it from there.

Every TensorFlow source but a frozen GraphDef becomes one `tf.function` over
named, static-shaped inputs that returns a dict of named outputs; tf2onnx
freezes it (variables become constants, convert_variables_to_constants_v2) and
converts the frozen GraphDef to ONNX at opset 17: Keras layers, fused LSTM/GRU
where TensorFlow has them, and `tf.cond` / `tf.while_loop` as ONNX If / Loop.

    SavedModel folder    tf.saved_model.load, one signature (serving_default unless named)
    .keras / .h5         keras.models.load_model (no training config)
    frozen GraphDef .pb  converted as it is (from_graph_def): Placeholders in, unconsumed nodes out
    keras.Model, tf.function, ConcreteFunction   (cuvil.compile)

Why tf2onnx.convert.from_function and not from_keras: from_keras of tf2onnx
1.17 reads `model.output_names`, which Keras 3 no longer sets (KeyError:
'keras_tensor_N'); a Keras model is called inside a tf.function instead.

TensorFlow and tf2onnx are optional (`pip install 'cuvil[tf]'`) and imported
only here, only when a TensorFlow source is compiled. Loading a SavedModel or
a Keras file runs code from it: compile only files you trust.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from ..errors import CuvilError, ModelError, ShapeError, UnsupportedOpError

OPSET = 17
# Bumped when this module changes what it makes from the same files (part of the conversion step's key).
CONVERTER_REVISION = 2
KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")
GRAPHDEF_SUFFIXES = (".pb",)
DEFAULT_SIGNATURE = "serving_default"
# GraphDef nodes that are never a model output, even when nothing consumes them.
_NOT_OUTPUTS = {"Const", "NoOp", "Placeholder", "PlaceholderWithDefault", "Assert", "VarHandleOp", "SaveV2",
                "RestoreV2"}


def is_savedmodel(path) -> bool:
    return Path(path).is_dir() and (Path(path) / "saved_model.pb").is_file()


def is_tensorflow_source(source) -> bool:
    """A path TensorFlow reads (SavedModel folder, .keras/.h5, frozen .pb), or a TensorFlow object."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return is_savedmodel(path) or path.suffix.lower() in KERAS_SUFFIXES + GRAPHDEF_SUFFIXES
    # by the class's bases: a user's subclass of keras.Model lives in the user's module
    return any((cls.__module__ or "").split(".")[0] in ("keras", "tensorflow", "tf_keras")
               for cls in type(source).__mro__)


def source_bytes(path) -> bytes:
    """What the conversion step's key hashes: a file's bytes, or for a SavedModel folder one line
    per file (relative path and sha256, sorted), so any changed variable or asset changes it."""
    path = Path(path)
    if not path.is_dir():
        return path.read_bytes()
    lines = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        lines.append(f"{file.relative_to(path).as_posix()}\t{digest}\n")
    return ("savedmodel\n" + "".join(lines)).encode()


def triton_first() -> None:
    """Import Triton (when installed: PyTorch's CUDA builds bring it) before TensorFlow. Imported
    after TensorFlow, in the same process, Triton's import crashes the process (a segmentation
    fault, seen with tensorflow-cpu 2.21 and triton 3.7.1: both carry LLVM), and torch.export /
    torch.onnx.export(dynamo=True) import Triton: a build of a TensorFlow model followed by a
    dynamo export in one process died. Imported first, both load."""
    from importlib.util import find_spec
    if "tensorflow" not in sys.modules and "triton" not in sys.modules and find_spec("triton") is not None:
        import triton  # noqa: F401


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    triton_first()
    try:
        import tensorflow as tf
        import tf2onnx  # noqa: F401  (checked here so the hint names both)
    except ImportError as exc:
        raise CuvilError(f"compiling a TensorFlow model needs tensorflow and tf2onnx ({exc})",
                         hint="pip install 'cuvil[tf]'") from None
    import logging
    logging.getLogger("tf2onnx").setLevel(logging.CRITICAL)  # its failures become our errors
    return tf


def _installed_version(*distributions) -> str | None:
    from importlib import metadata
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def converter_key() -> dict:
    """What decides the ONNX a TensorFlow source converts to, for the export step's cache key;
    read from the installed packages' metadata, so a cached conversion never imports TensorFlow."""
    key = {"tensorflow": _installed_version("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tf-nightly"),
           "keras": _installed_version("keras"), "tf2onnx": _installed_version("tf2onnx"),
           "opset": OPSET, "revision": CONVERTER_REVISION}
    if key["tensorflow"] is None or key["tf2onnx"] is None:
        raise CuvilError("compiling a TensorFlow model needs tensorflow and tf2onnx",
                         hint="pip install 'cuvil[tf]'")
    return key


# -- sources -> (callable, input specs, output names) -----------------------------------------------

def _shape_text(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _static_specs(declared, input_shapes, where):
    """[(name, shape, dtype)] of the model's inputs with every unknown dim given by input_shapes:
    by name, or, when the names differ but the counts match, in order (as for a torch module)."""
    tf = _tf()
    given = dict(input_shapes or {})
    names = [name for name, _, _ in declared]
    if given and set(given) != set(names):
        if len(given) != len(names):
            raise ShapeError(f"{where}: the model's inputs are {', '.join(names)}; input shapes were given for "
                             f"{', '.join(given)}", hint="give one shape per model input, by its name")
        given = dict(zip(names, given.values()))
        renamed = list(input_shapes)
    else:
        renamed = names
    specs = []
    for (name, shape, dtype), new_name in zip(declared, renamed):
        shape = list(shape) if shape is not None else None
        if name in given:
            want = [int(d) for d in given[name]]
            if shape is not None and (len(shape) != len(want) or any(d is not None and d != w
                                                                      for d, w in zip(shape, want))):
                raise ShapeError(f"{where}: input {name} has shape {_shape_text(shape)} in the model but "
                                 f"{want} was given", hint="give the model's fixed dims as they are")
            shape = want
        if shape is None or any(d is None for d in shape):
            raise ShapeError(f"{where}: input {name} has shape {_shape_text(shape or [])} in the model; "
                             f"its unknown dims need values",
                             hint=f"give inputs: {{{name}: [...]}} in cuvil.yaml, or input_shapes= to cuvil.compile")
        specs.append(tf.TensorSpec(shape, dtype, name=new_name))
    return specs


def tf_float32():
    return _tf().float32


def _keras_callable(model, input_shapes, where):
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # a subclassed model has none
        inputs = None
    if inputs:
        declared = [(t.name, tuple(t.shape), t.dtype) for t in inputs]
    elif input_shapes:  # a subclassed model: float32 inputs of the given shapes, in call order
        declared = [(name, tuple(shape), tf_float32()) for name, shape in input_shapes.items()]
    else:
        raise ModelError(f"{where}: the Keras model declares no inputs (a subclassed model)",
                         hint="give input_shapes={name: shape, ...} in the order call() takes them, "
                              "or build the model with keras.Input")
    specs = _static_specs(declared, input_shapes, where)
    names = None   # output_0, output_1, ... as many as the call returns (as model.export names them)

    def call(*args):
        result = model(args[0] if len(args) == 1 else list(args), training=False)
        return _tf().nest.flatten(result)   # a tensor, a list, or a dict (by sorted key)
    return call, specs, names


def _concrete_callable(function, input_shapes, where):
    """A ConcreteFunction (a SavedModel signature, or one traced by the user)."""
    tf = _tf()
    args, kwargs = function.structured_input_signature
    flat = [(spec.name or f"input_{k}", tuple(spec.shape), spec.dtype)
            for k, spec in enumerate(tf.nest.flatten(args))]
    keyword = [(key, tuple(spec.shape), spec.dtype) for key, spec in sorted(kwargs.items())]
    if flat and keyword:
        raise ModelError(f"{where}: the function takes both positional and keyword tensors",
                         hint="trace it with only positional (or only keyword) tensor arguments")
    specs = _static_specs(flat or keyword, input_shapes, where)
    outputs = function.structured_outputs
    if isinstance(outputs, dict):
        names = sorted(outputs)
    else:
        names = [f"output_{k}" for k in range(len(tf.nest.flatten(outputs)))]

    def call(*values):
        result = function(**dict(zip([name for name, _, _ in keyword], values))) if keyword else function(*values)
        if isinstance(result, dict):
            return [result[name] for name in names]
        return tf.nest.flatten(result)
    return call, specs, names


def _savedmodel_callable(path, input_shapes, signature):
    tf = _tf()
    try:
        loaded = tf.saved_model.load(str(path))
    except Exception as exc:
        raise ModelError(f"{path}: cannot be loaded as a SavedModel ({type(exc).__name__}: {exc})") from None
    signatures = dict(loaded.signatures)
    if not signatures:
        raise ModelError(f"{path}: the SavedModel has no signatures",
                         hint="save it with signatures= (tf.saved_model.save) or keras model.export()")
    name = signature or DEFAULT_SIGNATURE
    if name not in signatures:
        if signature is None and len(signatures) == 1:
            name = next(iter(signatures))
        else:
            raise ModelError(f"{path}: the SavedModel has no signature {name!r} "
                             f"(it has {', '.join(sorted(signatures))})",
                             hint="name one with `signature:` in cuvil.yaml")
    call, specs, names = _concrete_callable(signatures[name], input_shapes, f"{path} (signature {name})")
    call.keep_alive = loaded  # the signature's variables live as long as the loaded object
    return call, specs, names


def _keras_file_callable(path, input_shapes):
    _tf()
    import keras
    try:
        model = keras.models.load_model(str(path), compile=False)
    except Exception as exc:
        raise ModelError(f"{path}: cannot be loaded as a Keras model ({type(exc).__name__}: {exc})",
                         hint="custom layers must be registered (keras.saving.register_keras_serializable) "
                              "in the process that compiles") from None
    return _keras_callable(model, input_shapes, str(path))


def _graphdef_to_onnx(path, input_shapes):
    """A frozen GraphDef, converted by tf2onnx as it is (no re-tracing: functional control flow
    stays as the file has it): its Placeholders are the inputs, the nodes nothing reads the outputs."""
    tf = _tf()
    import tf2onnx
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(Path(path).read_bytes())
    except Exception as exc:
        raise ModelError(f"{path}: not a frozen TensorFlow GraphDef ({type(exc).__name__}: {exc})",
                         hint="write it with tf.io.write_graph(frozen.graph.as_graph_def(), ..., "
                              "as_text=False)") from None
    nodes = list(graph_def.node)
    if any(n.op in ("VarHandleOp", "VariableV2", "ReadVariableOp") for n in nodes):
        raise ModelError(f"{path}: the GraphDef still has variables; it is not frozen",
                         hint="freeze it with convert_variables_to_constants_v2, or give the SavedModel folder")
    consumed = {inp.lstrip("^").split(":")[0] for n in nodes for inp in n.input}
    # Placeholders nothing reads are left out (freezing a function with control flow leaves
    # `unused_control_flow_input` ones behind).
    placeholders = [n for n in nodes if n.op == "Placeholder" and n.name in consumed]
    outputs = [n.name for n in nodes if n.name not in consumed and n.op not in _NOT_OUTPUTS]
    if not placeholders or not outputs:
        raise ModelError(f"{path}: the GraphDef has {len(placeholders)} Placeholder inputs and "
                         f"{len(outputs)} unconsumed outputs; cuvil needs at least one of each")
    declared = []
    for node in placeholders:
        shape = node.attr["shape"].shape
        dims = None if shape.unknown_rank else tuple(None if d.size < 0 else d.size for d in shape.dim)
        declared.append((node.name, dims, tf.dtypes.as_dtype(node.attr["dtype"].type)))
    specs = _static_specs(declared, input_shapes, str(path))
    inputs = [f"{name}:0" for name, _, _ in declared]
    rename = {**{f"{name}:0": spec.name for (name, _, _), spec in zip(declared, specs)},
              **{f"{name}:0": name for name in outputs}}
    proto, _ = tf2onnx.convert.from_graph_def(
        graph_def, input_names=inputs, output_names=[f"{name}:0" for name in outputs], opset=OPSET,
        shape_override={tensor: list(spec.shape) for tensor, spec in zip(inputs, specs)},
        tensors_to_rename=rename, custom_op_handlers=dict(_HANDLERS))
    return proto


def _callable(source, input_shapes, signature):
    tf = _tf()
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if is_savedmodel(path):
            return _savedmodel_callable(path, input_shapes, signature)
        if not path.is_file():
            raise ModelError(f"TensorFlow model not found: {path}",
                             hint="a SavedModel folder (with saved_model.pb), a .keras/.h5 file or a frozen .pb")
        return _keras_file_callable(path, input_shapes)
    import keras
    if isinstance(source, keras.Model):
        return _keras_callable(source, input_shapes, "the Keras model")
    if hasattr(source, "structured_input_signature") and hasattr(source, "structured_outputs"):
        return _concrete_callable(source, input_shapes, "the concrete function")
    if hasattr(source, "get_concrete_function"):  # a tf.function: traced at the given shapes
        if not input_shapes:
            raise ShapeError("a tf.function needs input_shapes={name: shape, ...} (in the order it takes them), "
                             "or pass a ConcreteFunction (f.get_concrete_function(tf.TensorSpec(...)))")
        specs = [tf.TensorSpec(tuple(int(d) for d in shape), tf.float32, name=name)
                 for name, shape in input_shapes.items()]
        return _concrete_callable(source.get_concrete_function(*specs), input_shapes, "the tf.function")
    raise CuvilError(f"cannot compile an object of type {type(source).__name__} as a TensorFlow model",
                     hint="pass a SavedModel folder, a .keras/.h5/.pb path, a keras.Model, a tf.function or a "
                          "ConcreteFunction")


def _erfc(ctx, node, name, args):
    """tf2onnx 1.17 has no Erfc (exact GELU, keras `activation="gelu"`, computes with it):
    erfc(x) = 1 - erf(x), written as Erf, Neg, Add 1. The absolute error stays within float32's
    (erfc's relative accuracy is lost only where it is below ~1e-7, where GELU multiplies it by x)."""
    import numpy as np
    from tf2onnx import utils
    dtype = utils.ONNX_TO_NUMPY_DTYPE[ctx.get_dtype(node.input[0])]
    node.type = "Erf"
    neg = ctx.insert_new_node_on_output("Neg", node.output[0], name=utils.make_name(f"{name}_neg"))
    one = ctx.make_const(utils.make_name(f"{name}_one"), np.array(1, dtype))
    ctx.insert_new_node_on_output("Add", neg.output[0], name=utils.make_name(f"{name}_add"),
                                  inputs=[neg.output[0], one.output[0]])


# TensorFlow ops tf2onnx does not convert, written here with ONNX ops (its custom_op_handlers).
_HANDLERS = {"Erfc": (_erfc, [])}


def _function_to_onnx(tf, tf2onnx, where, call, specs, names):
    """`names`: the outputs' names, or None for output_0, output_1, ..."""
    if names is not None and len(set(names)) != len(names):
        raise ModelError(f"{where}: output names repeat: {names}")

    def named(*values):
        results = call(*values)
        given = names or [f"output_{k}" for k in range(len(results))]
        if len(results) != len(given):
            raise ModelError(f"{where}: the model returned {len(results)} outputs, expected {len(given)}")
        return {name: tf.identity(value) for name, value in zip(given, results)}
    proto, _ = tf2onnx.convert.from_function(tf.function(named), input_signature=specs, opset=OPSET,
                                             custom_op_handlers=dict(_HANDLERS))
    return proto


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == attr.GRAPH:
                yield from _all_nodes(attr.g)
            for sub in attr.graphs:
                yield from _all_nodes(sub)


def to_onnx_proto(source, input_shapes: dict | None = None, signature: str | None = None):
    """Convert a TensorFlow source (path or object) to an onnx.ModelProto whose inputs and outputs
    carry the model's names (signature keys, Keras input names, placeholder names)."""
    tf = _tf()
    import onnx
    import tf2onnx
    where = str(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__
    try:
        if isinstance(source, (str, os.PathLike)) and Path(source).suffix.lower() in GRAPHDEF_SUFFIXES:
            proto = _graphdef_to_onnx(source, input_shapes)
        else:
            proto = _function_to_onnx(tf, tf2onnx, where, *_callable(source, input_shapes, signature))
    except CuvilError:
        raise
    except Exception as exc:
        message = str(exc).strip().splitlines()
        raise ModelError(f"{where}: converting the TensorFlow graph to ONNX (tf2onnx) failed: "
                         f"{type(exc).__name__}: {message[0] if message else ''}",
                         hint="ops tf2onnx cannot convert are listed in docs/tensorflow.md") from None
    # tf2onnx leaves an op it cannot convert in the graph under its TensorFlow name
    unconverted = {}
    for node in _all_nodes(proto.graph):
        if node.domain not in ("", "ai.onnx") or not onnx.defs.has(node.op_type):
            unconverted.setdefault(node.op_type, node.name)
    if unconverted:
        found = ", ".join(f"{op} (node '{name}')" for op, name in sorted(unconverted.items()))
        raise UnsupportedOpError(f"{where}: TensorFlow ops with no ONNX conversion (tf2onnx): {found}",
                                 hint="rewrite them with ops tf2onnx converts (docs/tensorflow.md), or export "
                                      "the model to ONNX another way")
    proto.producer_name, proto.producer_version = "cuvil-tf2onnx", ""
    return proto
