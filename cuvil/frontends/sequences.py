"""Sequence- and optional-typed values, lowered to tensors at import (docs/sequences.md).

Cuvil compiles static shapes, so a sequence is known at build time as a list of
tensors: its length and each element's shape are fixed (given for a graph input
as `input_shapes={"x[0]": [...], "x[1]": [...]}`, or `"x": []` for an empty one;
computed for every other sequence). An optional is known at build time to be
empty or to hold its element (`input_shapes={"o": None}` builds for an empty
optional input). The importer keeps two maps beside its tensor values:

    sequences[name] = [tensor value names]          # SequenceConstruct, SplitToSequence...
    optionals[name] = element name, or None (empty) # the element: a tensor or a sequence

and the ops on them become the tensor ops they mean: SequenceAt an Identity,
ConcatFromSequence a Concat, SplitToSequence Slices (or Gathers), SequenceMap its
body once per element, SequenceLength / OptionalHasElement constants. If and Loop
carrying sequences are inlined by control_flow.py (their control is known at build
time). A graph input or output of these types crosses the C ABI as consecutive
tensors named `x[0]`, `x[1]`... (a present optional tensor keeps its name); the
library's description lists them under "structure" (`describe_io`). A position,
a split or a presence that depends on run-time data is an UnsupportedOpError
naming the node.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..errors import ShapeError, UnsupportedOpError

# Ops on sequences and optionals this module lowers (If, Loop and Identity are lowered by it only when
# they carry such values).
OPS = {"SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceAt", "SequenceErase", "SequenceLength",
       "ConcatFromSequence", "SplitToSequence", "SequenceMap", "Optional", "OptionalHasElement",
       "OptionalGetElement"}


def element_name(name: str, index: int) -> str:
    """The C ABI name of element `index` of the sequence input or output `name`."""
    return f"{name}[{index}]"


def is_tensor_type(type_proto: onnx.TypeProto) -> bool:
    return type_proto.WhichOneof("value") in (None, "tensor_type")


def _kind(type_proto: onnx.TypeProto, where: str) -> tuple[str, onnx.TypeProto]:
    """('sequence' | 'optional' | 'optional_sequence', the tensor type of the elements)."""
    which = type_proto.WhichOneof("value")
    if which == "sequence_type" and is_tensor_type(type_proto.sequence_type.elem_type):
        return "sequence", type_proto.sequence_type.elem_type
    if which == "optional_type":
        inner = type_proto.optional_type.elem_type
        if is_tensor_type(inner):
            return "optional", inner
        if inner.WhichOneof("value") == "sequence_type" and is_tensor_type(inner.sequence_type.elem_type):
            return "optional_sequence", inner.sequence_type.elem_type
    raise UnsupportedOpError(f"{where} is a {which.replace('_type', '')} of a type cuvil does not compile "
                             "(maps, sparse tensors, sequences of sequences)",
                             hint="make it a tensor, a sequence of tensors or an optional of either")


def _dtype_name(tensor_type: onnx.TypeProto) -> str | None:
    elem = tensor_type.tensor_type.elem_type
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem)).name if elem else None


class Sequences:
    """The sequence and optional values of one import; `imp` is the ONNX importer (frontends/onnx.py):
    its `values`, `import_node(proto)`, `add_constant(name, array)`, `opsets`."""

    def __init__(self, importer):
        self.imp = importer
        self.sequences: dict[str, list[str]] = {}
        self.optionals: dict[str, str | None] = {}
        self.structure: dict[str, list[dict]] = {}
        self._emitting = False  # the tensor nodes this module emits go to the importer's tensor path

    def defines(self, name: str) -> bool:
        return name in self.sequences or name in self.optionals

    def handles(self, proto: onnx.NodeProto) -> bool:
        """Whether this node is lowered here: an op of OPS, or any node reading a sequence or an optional."""
        if self._emitting:  # (a present optional tensor input shares its name with its tensor)
            return False
        if proto.domain not in ("", "ai.onnx"):
            return any(self.defines(i) for i in proto.input)
        return proto.op_type in OPS or (proto.op_type not in ("If", "Loop") and any(self.defines(i) for i in proto.input))

    # -- graph inputs and outputs -----------------------------------------------------------------

    def declare_input(self, vi: onnx.ValueInfoProto, given: dict, make_tensor) -> list[str]:
        """A sequence or optional graph input: its tensors' names (the library's inputs), in order.
        `make_tensor(name, tensor_type_proto)` declares one tensor input the way the importer does."""
        kind, elem = _kind(vi.type, f"input '{vi.name}'")
        if kind == "optional" or (kind == "optional_sequence" and vi.name in given and given[vi.name] is None):
            if vi.name in given and given[vi.name] is None:
                self.optionals[vi.name] = None
                self._record("inputs", vi.name, kind, elem, [], present=False)
                return []
            if kind == "optional":
                self.optionals[vi.name] = vi.name
                self._record("inputs", vi.name, kind, elem, [vi.name], present=True)
                return [make_tensor(vi.name, elem)]
        names = self._sequence_input(vi.name, elem, given)
        tensors = [make_tensor(n, elem) for n in names]
        if kind == "optional_sequence":
            inner = f"{vi.name}/sequence"
            self.sequences[inner] = tensors
            self.optionals[vi.name] = inner
        else:
            self.sequences[vi.name] = tensors
        self._record("inputs", vi.name, kind, elem, tensors, present=True if kind != "sequence" else None)
        return tensors

    def _sequence_input(self, name: str, elem, given: dict) -> list[str]:
        count = 0
        while element_name(name, count) in given:
            count += 1
        if count == 0 and not (name in given and list(given[name] or []) == []):
            raise ShapeError(f"input '{name}' is a sequence: its length and element shapes must be known at build "
                             "time", hint=f"give each element's shape: input_shapes={{'{element_name(name, 0)}': "
                                          f"[...], '{element_name(name, 1)}': [...], ...}} (or {{'{name}': []}} for "
                                          "an empty sequence)")
        return [element_name(name, i) for i in range(count)]

    def declare_output(self, vi: onnx.ValueInfoProto) -> list[str]:
        """A sequence or optional graph output: Identity nodes write its tensors under their ABI names."""
        if is_tensor_type(vi.type):  # untyped (or typed a tensor) in the model: the value says what it is
            held = self.optionals.get(vi.name, vi.name)
            kind = "sequence" if vi.name in self.sequences else \
                "optional_sequence" if held in self.sequences else "optional"
            elem = onnx.TypeProto()
        else:
            kind, elem = _kind(vi.type, f"output '{vi.name}'")
        if not self.defines(vi.name):
            raise UnsupportedOpError(f"output '{vi.name}' is declared a {kind.replace('_', ' ')} but is a tensor",
                                     hint="check the model's output types")
        present = None
        value = vi.name
        if kind != "sequence":
            if vi.name not in self.optionals:  # a sequence returned where the type says optional: present
                present = True
            else:
                value = self.optionals[vi.name]
                present = value is not None
            if value is None:
                self._record("outputs", vi.name, kind, elem, [], present=False)
                return []
        if kind == "optional" and value not in self.sequences:
            self._emit("Identity", [value], [vi.name], f"{vi.name}/output")
            self._record("outputs", vi.name, kind, elem, [vi.name], present=True)
            return [vi.name]
        if value not in self.sequences:
            raise UnsupportedOpError(f"output '{vi.name}' is declared a {kind.replace('_', ' ')} but holds a tensor",
                                     hint="check the model's output types")
        names = []
        for i, item in enumerate(self.sequences[value]):
            names.append(element_name(vi.name, i))
            if names[-1] in self.imp.values:
                raise UnsupportedOpError(f"output '{vi.name}': its element name '{names[-1]}' is already a value "
                                         "of the model", hint="rename that value")
            self._emit("Identity", [item], [names[-1]], f"{vi.name}/element{i}")
        self._record("outputs", vi.name, kind, elem, names, present=present)
        return names

    def _record(self, kind, name, what, elem, tensors, present):
        dtype = _dtype_name(elem) or (np.dtype(self.imp.values[tensors[0]].dtype).name if tensors else None)
        entry = {"name": name, "kind": what, "dtype": dtype, "tensors": list(tensors)}
        if present is not None:
            entry["present"] = present
        self.structure.setdefault(kind, []).append(entry)

    # -- nodes ------------------------------------------------------------------------------------

    def paired_elements(self, name: str, out: str, a: str, b: str) -> list[tuple[str, str, str]]:
        """An If decided at run time whose branches give the sequences / optionals `a` and `b` of one
        structure: `out` becomes that structure over fresh tensors, returned as (tensor, from a,
        from b) triples for the If to select between (control_flow.Inliner._select_if)."""
        def shape_of(value):
            if value in self.optionals:
                element = self.optionals[value]
                return ("optional", None if element is None else shape_of(element))
            if value in self.sequences:
                return ("sequence", self.sequences[value])
            return ("tensor", value)
        left, right = shape_of(a), shape_of(b)
        same = (left[0] == right[0] and (left[1] is None) == (right[1] is None)
                and (left[0] != "sequence" or len(left[1]) == len(right[1])))
        if same and left[0] == "optional" and left[1] is not None:
            same = left[1][0] == right[1][0] and (left[1][0] != "sequence" or len(left[1][1]) == len(right[1][1]))
        if not same:
            raise UnsupportedOpError(f"node '{name}' (If): its condition is only known at run time and output "
                                     f"'{out}' has another length or presence in each branch, which cuvil fixes "
                                     "at build time", hint="make the condition known at build time (a constant, or "
                                                          "a model input the backend specialises)")
        if not out:
            return []
        if left[0] == "optional":
            if left[1] is None:
                self.optionals[out] = None
                return []
            inner = self._fresh(f"{out}/element")
            self.optionals[out] = inner
            return self.paired_elements(name, inner, self.optionals[a], self.optionals[b])
        if left[0] == "tensor":
            return [(out, a, b)]
        triples = [(self._fresh(f"{out}/item{k}"), x, y)
                   for k, (x, y) in enumerate(zip(self.sequences[a], self.sequences[b]))]
        self.sequences[out] = [t for t, _, _ in triples]
        return triples

    def _emit(self, op, inputs, outputs, name, **attrs):
        self._emitting = True
        try:
            self.imp.import_node(helper.make_node(op, inputs, outputs, name=name, **attrs))
        finally:
            self._emitting = False

    def _fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.imp.values or self.defines(name):
            i += 1
            name = f"{base}~{i}"
        return name

    def _const(self, base, array) -> str:
        name = self._fresh(base)
        self.imp.add_constant(name, np.asarray(array))
        return name

    def _static_int(self, proto, name, index, what) -> int | list[int] | None:
        """The build-time value of input `index` (None when omitted), or an error naming the node."""
        if index >= len(proto.input) or not proto.input[index]:
            return None
        value = self.imp.values.get(proto.input[index])
        if value is None or not value.is_const:
            raise UnsupportedOpError(f"node '{name}' ({proto.op_type}): its {what} '{proto.input[index]}' is known "
                                     "only at run time, and cuvil compiles sequences of static length",
                                     hint=f"make the {what} a constant (or a model input the backend specialises)")
        data = np.asarray(value.data).astype(np.int64)
        return int(data.reshape(-1)[0]) if data.ndim == 0 else [int(v) for v in data.reshape(-1)]

    def _sequence(self, proto, name, index=0) -> list[str]:
        source = proto.input[index] if index < len(proto.input) else ""
        if source in self.optionals and self.optionals[source] in self.sequences:
            source = self.optionals[source]
        if source not in self.sequences:
            raise UnsupportedOpError(f"node '{name}' ({proto.op_type}): input {index} '{source}' is not a sequence")
        return self.sequences[source]

    def _position(self, proto, name, length, index, default, what, inclusive):
        position = self._static_int(proto, name, index, what)
        if position is None:
            return default
        if isinstance(position, list):
            position = position[0]
        limit = length + 1 if inclusive else length
        if not -limit <= position < limit:
            raise UnsupportedOpError(f"node '{name}' ({proto.op_type}): {what} {position} is outside the sequence "
                                     f"of {length} element(s)")
        return position + length if position < 0 else position

    def import_node(self, proto: onnx.NodeProto, name: str) -> None:
        op = proto.op_type
        handler = getattr(self, f"_op_{op}", None) if proto.domain in ("", "ai.onnx") else None
        if handler is None:
            read = next(i for i in proto.input if self.defines(i))
            raise UnsupportedOpError(f"node '{name}' ({op}) reads '{read}', a sequence or an optional; cuvil lowers "
                                     f"only the sequence ops ({', '.join(sorted(OPS))}), Identity, If and Loop on them",
                                     hint="take the tensors out with SequenceAt or OptionalGetElement first")
        handler(proto, name)

    def _set(self, out: str, value) -> None:
        if not out:
            return
        if isinstance(value, list):
            self.sequences[out] = list(value)
        else:
            self.optionals[out] = value

    def _op_Identity(self, proto, name):
        source = proto.input[0]
        if source in self.sequences:
            self._set(proto.output[0], self.sequences[source])
        else:
            self.optionals[proto.output[0]] = self.optionals[source]

    def _op_SequenceConstruct(self, proto, name):
        self._set(proto.output[0], [i for i in proto.input])

    def _op_SequenceEmpty(self, proto, name):
        self._set(proto.output[0], [])

    def _op_SequenceLength(self, proto, name):
        self.imp.add_constant(proto.output[0], np.array(len(self._sequence(proto, name)), np.int64))

    def _op_SequenceAt(self, proto, name):
        items = self._sequence(proto, name)
        position = self._position(proto, name, len(items), 1, None, "position", inclusive=False)
        if position is None:
            raise UnsupportedOpError(f"node '{name}' (SequenceAt): no position given")
        self._emit("Identity", [items[position]], [proto.output[0]], f"{name}/at")

    def _op_SequenceInsert(self, proto, name):
        items = self._sequence(proto, name)
        position = self._position(proto, name, len(items), 2, len(items), "position", inclusive=True)
        self._set(proto.output[0], items[:position] + [proto.input[1]] + items[position:])

    def _op_SequenceErase(self, proto, name):
        items = self._sequence(proto, name)
        if not items:
            raise UnsupportedOpError(f"node '{name}' (SequenceErase): the sequence is empty")
        position = self._position(proto, name, len(items), 1, len(items) - 1, "position", inclusive=False)
        self._set(proto.output[0], items[:position] + items[position + 1:])

    def _op_ConcatFromSequence(self, proto, name):
        items = self._sequence(proto, name)
        attrs = {a.name: helper.get_attribute_value(a) for a in proto.attribute}
        if not items:
            raise UnsupportedOpError(f"node '{name}' (ConcatFromSequence): the sequence is empty, so the "
                                     "output's type is unknown")
        axis, new_axis = int(attrs["axis"]), int(attrs.get("new_axis", 0))
        if new_axis:
            rank = len(self.imp.values[items[0]].shape) + 1
            axis = axis + rank if axis < 0 else axis
            axes = self._const(f"{name}/axes", np.array([axis], np.int64))
            expanded = []
            for k, item in enumerate(items):
                expanded.append(self._fresh(f"{name}/item{k}"))
                self._unsqueeze(item, expanded[-1], axis, axes, f"{name}/unsqueeze{k}")
            items = expanded
        self._emit("Concat", items, [proto.output[0]], f"{name}/concat", axis=axis)

    def _unsqueeze(self, item, out, axis, axes, name):
        if self.imp.opsets.get("", self.imp.opsets.get("ai.onnx", 0)) >= 13:
            self._emit("Unsqueeze", [item, axes], [out], name)
        else:  # before opset 13 Unsqueeze takes its axes as an attribute
            self._emit("Unsqueeze", [item], [out], name, axes=[axis])

    def _op_SplitToSequence(self, proto, name):
        attrs = {a.name: helper.get_attribute_value(a) for a in proto.attribute}
        source = self.imp.values[proto.input[0]]
        rank = len(source.shape)
        axis = int(attrs.get("axis", 0))
        axis = axis + rank if axis < 0 else axis
        size = source.shape[axis]
        split = self._static_int(proto, name, 1, "split")
        items = []
        if split is None:  # one element per index along the axis; keepdims=0 drops that axis
            keep = int(attrs.get("keepdims", 1))
            for k in range(size):
                items.append(self._fresh(f"{name}/item{k}"))
                index = self._const(f"{name}/index{k}", np.array(k if not keep else [k], np.int64))
                self._emit("Gather", [proto.input[0], index], [items[-1]], f"{name}/gather{k}", axis=axis)
            self._set(proto.output[0], items)
            return
        if isinstance(split, int):
            if split <= 0:
                raise UnsupportedOpError(f"node '{name}' (SplitToSequence): split {split} must be positive")
            sizes = [min(split, size - start) for start in range(0, size, split)]
        else:
            sizes = split
            if sum(sizes) != size or any(s < 0 for s in sizes):
                raise UnsupportedOpError(f"node '{name}' (SplitToSequence): split {sizes} does not add up to the "
                                         f"{size} elements of axis {axis}")
        start = 0
        axes = self._const(f"{name}/axes", np.array([axis], np.int64))
        for k, length in enumerate(sizes):
            items.append(self._fresh(f"{name}/item{k}"))
            begin = self._const(f"{name}/start{k}", np.array([start], np.int64))
            end = self._const(f"{name}/end{k}", np.array([start + length], np.int64))
            self._emit("Slice", [proto.input[0], begin, end, axes], [items[-1]], f"{name}/slice{k}")
            start += length
        self._set(proto.output[0], items)

    def _op_SequenceMap(self, proto, name):
        from .control_flow import Inliner
        body = next((a.g for a in proto.attribute if a.name == "body"), None)
        if body is None:
            raise UnsupportedOpError(f"node '{name}' (SequenceMap) has no 'body' subgraph")
        lengths = {len(self.sequences[i]) for i in proto.input if i in self.sequences}
        if not proto.input or proto.input[0] not in self.sequences:
            raise UnsupportedOpError(f"node '{name}' (SequenceMap): its first input is not a sequence")
        if len(lengths) != 1:
            raise UnsupportedOpError(f"node '{name}' (SequenceMap): its sequences have different lengths "
                                     f"{sorted(lengths)}")
        count = lengths.pop()
        inliner = Inliner(self.imp)
        results: list[list[str]] = [[] for _ in body.output]
        body_inputs = [i.name for i in body.input]
        for k in range(count):
            bindings = {inner: (self.sequences[outer][k] if outer in self.sequences else outer)
                        for inner, outer in zip(body_inputs, proto.input)}
            for j, value in enumerate(inliner.run_body(body, f"{name}/item{k}/", bindings)):
                results[j].append(value)
        for out, items in zip(proto.output, results):
            self._set(out, items)

    def _op_Optional(self, proto, name):
        element = proto.input[0] if proto.input and proto.input[0] else None
        self.optionals[proto.output[0]] = element

    def _op_OptionalHasElement(self, proto, name):
        if not proto.output or not proto.output[0]:
            return
        source = proto.input[0] if proto.input else ""
        present = bool(source) and (source not in self.optionals or self.optionals[source] is not None)
        self.imp.add_constant(proto.output[0], np.array(present))

    def _op_OptionalGetElement(self, proto, name):
        source = proto.input[0]
        element = self.optionals.get(source, source)
        if element is None:
            raise UnsupportedOpError(f"node '{name}' (OptionalGetElement): the optional '{source}' is empty",
                                     hint="check OptionalHasElement first; an empty optional has no element")
        if element in self.sequences:
            self._set(proto.output[0], self.sequences[element])
        else:
            self._emit("Identity", [element], [proto.output[0]], f"{name}/get")


def describe_io(structure: dict) -> dict:
    """The library description's "structure" entry (omitted for a model of tensors only)."""
    return {"structure": structure} if structure else {}

