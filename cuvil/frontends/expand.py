"""Expand ops that have no kernel into the function bodies ONNX defines for them.

Many recent ONNX ops (Attention, RMSNormalization, RotaryEmbedding,
GroupNormalization, CenterCropPad, the window functions...) are specified as
a function: a subgraph of simpler ops. When cuvil has no kernel for such an
op, the op is replaced by its body before import, so it compiles from the
kernels of the simpler ops. An op with a kernel is never expanded: its kernel
is faster than the body. Ops of ONNX's other schema domains that define a
body (ai.onnx.preview's FlexAttention) are expanded the same way.

Model-local functions (`model.functions`) are inlined too: the importer only
knows the ops of ONNX's schemas.

For each such node the schema's body is built (a context-dependent body from
the node's attributes and its inputs' types, which ONNX's shape inference
gives), the schema's default attribute values are written onto the node (the
inliner does not read them), the node becomes a call of a model-local
function holding the body, and ONNX's inliner (`onnx.inliner`) replaces the
call by the body, renaming its values, resolving its attribute references
and converting a body written for an older opset. A body may contain ops
without kernels in turn: they are expanded in the next round. Anything that
fails leaves the node as it was: the importer then names the op it cannot
compile.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import onnx
import onnx.inliner

# Ops the importer handles itself although no kernel exists for them: it
# evaluates them at build time (Constant, Shape, Size, Range of constants...)
# or unrolls them (If, Loop, Scan). Their bodies would only be slower to fold.
FRONTEND_OPS = frozenset({"Constant", "ConstantOfShape", "Shape", "Size", "Range", "If", "Loop", "Scan"})

# Ops whose body cannot compile either, so expanding them would only make the
# error name an op the model does not contain: random numbers and sequences.
_NOT_EXPANDED = frozenset({"Bernoulli", "SequenceMap"})

# The private domain of the functions made here; none is left after inlining.
DOMAIN = "cuvil.expand"

# A body may itself contain ops without kernels; they are expanded in the next round.
_MAX_ROUNDS = 4


def _domain(name: str) -> str:
    return "" if name == "ai.onnx" else name


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {_domain(o.domain): o.version for o in model.opset_import}


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every subgraph nested in its nodes' attributes."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _graphs(g)


def _nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    for graph in _graphs(model.graph):
        yield from graph.node


def _schema(op: str, domain: str, opset: int):
    """The op's schema at the model's opset when it defines a function body, else None."""
    try:
        schema = onnx.defs.get_schema(op, opset, domain)
    except Exception:  # SchemaError: not an ONNX op at this opset
        return None
    return schema if schema.has_function or schema.has_context_dependent_function else None


def expandable_ops(model: onnx.ModelProto, has_kernel: Callable[[str, str], bool]) -> list[tuple[str, str]]:
    """The (domain, op) pairs of the model that have no kernel but a function
    body in ONNX's schemas (the default domain's, or ai.onnx.preview's)."""
    opsets = _opsets(model)
    ops = {(_domain(n.domain), n.op_type) for n in _nodes(model) if _domain(n.domain) in opsets}
    return sorted((domain, op) for domain, op in ops
                  if not (domain == "" and (op in FRONTEND_OPS or op in _NOT_EXPANDED))
                  and not has_kernel(domain, op) and _schema(op, domain, opsets[domain]) is not None)


def _typed(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, onnx.TypeProto]]:
    """The model with the type of every value ONNX's shape inference can tell
    written as value_info (context-dependent bodies and the inliner's version
    conversion need them), and these types by name."""
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference failed somewhere: the declared types are all there is
        model = onnx.ModelProto.FromString(model.SerializeToString())
    types = {}
    for graph in _graphs(model.graph):
        declared = {vi.name for vi in [*graph.input, *graph.value_info, *graph.output]}
        for tensor in graph.initializer:
            t = onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
            types[tensor.name] = t
            if tensor.name not in declared:
                graph.value_info.append(onnx.helper.make_value_info(tensor.name, t))
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            if vi.type.WhichOneof("value") is not None:
                types.setdefault(vi.name, vi.type)
    return model, types


def _latest(versions, opset: int) -> int | None:
    """The newest body version the model's opset may use."""
    usable = [v for v in versions if v <= opset]
    return max(usable) if usable else None


def _body(node: onnx.NodeProto, opset: int, types: dict) -> onnx.FunctionProto | None:
    """The function body of the node's op at the opset, built for its attributes
    and input types; None when ONNX cannot give one."""
    schema = _schema(node.op_type, _domain(node.domain), opset)
    if schema.has_function:
        version = _latest(schema.function_opset_versions, opset)
        data = schema.get_function_with_opset_version(version) if version is not None else None
    else:
        version = _latest(schema.context_dependent_function_opset_versions, opset)
        if version is None or any(name and name not in types for name in node.input):
            return None
        inputs = [(types[name] if name else onnx.TypeProto()).SerializeToString() for name in node.input]
        data = schema.get_context_dependent_function_with_opset_version(version, node.SerializeToString(), inputs)
    body = onnx.FunctionProto.FromString(data) if data else None
    return body if body is not None and body.node else None


def _add_defaults(node: onnx.NodeProto, opset: int) -> None:
    """Spell out every attribute the schema gives a default, so that the body's
    references to them resolve (the inliner does not read schema defaults)."""
    present = {a.name for a in node.attribute}
    for name, attr in sorted(_schema(node.op_type, _domain(node.domain), opset).attributes.items()):
        if name not in present and attr.default_value.type != onnx.AttributeProto.UNDEFINED:
            value = node.attribute.add()
            value.CopyFrom(attr.default_value)
            value.name = name


def _key(node: onnx.NodeProto) -> tuple:
    return (_domain(node.domain), node.op_type, *node.output)


def _expand(model: onnx.ModelProto, keys: set, types: dict, serial: Iterator[int]) -> onnx.ModelProto | None:
    """A copy of the model whose nodes named by `keys` are replaced by their
    bodies, or None when a body cannot be built or inlined."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    opsets = _opsets(model)
    imports = set(opsets)
    try:
        for node in _nodes(model):
            if _key(node) not in keys:
                continue
            opset = opsets[_domain(node.domain)]
            _add_defaults(node, opset)
            body = _body(node, opset, types)
            if body is None:
                return None
            body.domain, body.name = DOMAIN, f"{node.op_type}_{next(serial)}"
            declared = set(body.attribute) | {a.name for a in body.attribute_proto}
            body.attribute.extend(a.name for a in node.attribute if a.name not in declared)
            node.domain, node.op_type = DOMAIN, body.name
            model.functions.append(body)
            for opset_id in body.opset_import:
                if _domain(opset_id.domain) not in imports:
                    model.opset_import.append(opset_id)
                    imports.add(_domain(opset_id.domain))
        if DOMAIN not in imports:
            model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
        # convert_version: a body written for an older opset is converted to the model's.
        model = onnx.inliner.inline_local_functions(model, convert_version=True)
    except Exception:  # a schema or the inliner failed (their C++ errors have no common base)
        return None
    keep = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model


def _inline_local_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    if not model.functions:
        return model
    try:  # with the inferred types: converting a body's opset version needs them
        return onnx.inliner.inline_local_functions(_typed(model)[0], convert_version=True)
    except Exception:
        return model


def expand_functions(model: onnx.ModelProto, has_kernel: Callable[[str, str], bool]) -> onnx.ModelProto:
    """The model with every op that `has_kernel(domain, op)` rejects and whose
    schema defines a function body replaced by that body (the model itself is
    returned when there is nothing to expand)."""
    model = _inline_local_functions(model)
    failed: set[tuple] = set()
    serial = itertools.count(1)  # names the functions, unique across rounds
    for _ in range(_MAX_ROUNDS):
        ops = set(expandable_ops(model, has_kernel))
        keys = {_key(n) for n in _nodes(model) if _key(n)[:2] in ops} - failed
        if not keys:
            break
        typed, types = _typed(model)
        expanded = _expand(typed, keys, types, serial)
        if expanded is None:  # one body failed: expand the others one at a time
            for key in sorted(keys):
                expanded = _expand(typed, {key}, types, serial)
                if expanded is not None:
                    typed = model = expanded
        else:
            model = expanded
        # A node still there was not expanded: it is left to the importer.
        failed |= keys & {_key(n) for n in _nodes(model)}
    return model
