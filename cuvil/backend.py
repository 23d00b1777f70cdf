"""`onnx.backend.base.Backend` on top of `cuvil.compile`, so ONNX's own backend
tests (and any tool written against that interface) can drive cuvil.

Cuvil compiles for static shapes. A model input whose *value* decides a
shape or a kernel parameter (Reshape's shape, Slice's starts, TopK's k...)
cannot be a run-time input of a compiled library, so the rep compiles when it
first sees such a value, with the value baked in as a constant, and keeps one
library per distinct value. Models with symbolic input dims are likewise
compiled per input-shape signature. Everything else is compiled once, in
`prepare`. Sequence and optional inputs (docs/sequences.md) are compiled per
signature too: the length and element shapes of a sequence, the presence of an
optional, are fixed in a library.
"""
from __future__ import annotations

import warnings
from collections import namedtuple
from functools import lru_cache

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep

from .errors import CuvilError
from .frontends.sequences import element_name, is_tensor_type
from .ops import RANDOM_OPS

# Inputs (by position) whose values decide output shapes or kernel parameters.
# Shape inputs of these ops that come from the graph's inputs are specialised
# per value (see the module docstring).
BUILD_TIME_INPUTS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Pad": (1, 3),
    "Split": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "TopK": (1,), "Range": (0, 1, 2),
    "ConstantOfShape": (0,), "OneHot": (1,), "Resize": (1, 2, 3), "Upsample": (1,), "CumSum": (1,), "CumProd": (1,),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,),
    "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,), "ReduceLogSumExp": (1,),
    "ReduceSumSquare": (1,), "Trilu": (1,), "CenterCropPad": (1,), "Compress": (1,),
    "MaxUnpool": (2,), "Col2Im": (1, 2), "BlackmanWindow": (0,), "HannWindow": (0,),
    "HammingWindow": (0,), "DFT": (1, 2), "STFT": (1, 3), "MelWeightMatrix": (0, 1, 2, 3, 4), "AffineGrid": (1,),
    "Dropout": (1, 2), "SequenceAt": (1,), "SequenceInsert": (2,), "SequenceErase": (1,), "SplitToSequence": (1,),
}


def _is_static(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    # a negative dim_value (Paddle2ONNX's way of writing a dynamic dim) is not static
    return vi.type.HasField("tensor_type") and t.HasField("shape") \
        and all(d.HasField("dim_value") and d.dim_value >= 0 for d in t.shape.dim)


def _subgraphs(node: onnx.NodeProto) -> list:
    return [g for attr in node.attribute
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else
                      list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else [])]


def _all_nodes(graph: onnx.GraphProto):
    """The graph's nodes and, recursively, those of its subgraphs (If branches, Loop bodies)."""
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from _all_nodes(sub)


def build_time_inputs(model: onnx.ModelProto) -> list[str]:
    """Graph inputs whose values a build-time position (BUILD_TIME_INPUTS) depends
    on, directly or through the nodes that compute it (shape arithmetic)."""
    inits = {t.name for t in model.graph.initializer}
    # a sequence or optional input is compiled for its structure, never as a constant
    graph_inputs = [vi.name for vi in model.graph.input if vi.name not in inits and is_tensor_type(vi.type)]
    nodes = list(_all_nodes(model.graph))
    producer = {out: node for node in nodes for out in node.output if out}
    wanted, stack = set(), []
    for node in nodes:
        if node.domain not in ("", "ai.onnx"):
            continue
        for pos in BUILD_TIME_INPUTS.get(node.op_type, ()):
            if pos < len(node.input) and node.input[pos]:
                stack.append(node.input[pos])
        if node.op_type in ("If", "Loop"):  # the condition / trip count decide the graph
            stack.extend(node.input[:2] if node.op_type == "Loop" else node.input[:1])
    while stack:
        name = stack.pop()
        if name in wanted:
            continue
        wanted.add(name)
        node = producer.get(name)
        # those read only the static shape, or the build-time length / presence of a sequence / optional
        if node is not None and node.op_type not in ("Shape", "Size", "SequenceLength", "OptionalHasElement"):
            stack.extend(i for i in node.input if i)
            # an If or Loop also reads whatever its subgraphs read from the outer scope
            stack.extend(i for sub in _subgraphs(node) for inner in _all_nodes(sub) for i in inner.input if i)
    return [n for n in graph_inputs if n in wanted]


def _specialise(model: onnx.ModelProto, values: dict) -> onnx.ModelProto:
    """The model with the given inputs turned into initializers."""
    special = onnx.ModelProto()
    special.CopyFrom(model)
    keep = [vi for vi in special.graph.input if vi.name not in values]
    del special.graph.input[:]
    special.graph.input.extend(keep)
    for name, arr in values.items():
        special.graph.initializer.append(numpy_helper.from_array(np.asarray(arr), name))
    return special


def _structured_feed(name: str, value):
    """A sequence or optional input's value: a list of arrays, an array, or None (an empty optional)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [np.asarray(v) for v in value]
    return np.asarray(value)


def _signature(value):
    """What of an input's value a library is built for: its shape (a tensor), its elements' shapes
    and dtypes (a sequence), or None (an empty optional)."""
    if value is None:
        return None
    if isinstance(value, list):
        return tuple((v.dtype.str, v.shape) for v in value)
    return value.shape


def _structured_shapes(name: str, value) -> dict:
    """input_shapes entries for a sequence or optional input (docs/sequences.md)."""
    if value is None:
        return {name: None}
    if isinstance(value, list):
        return {element_name(name, i): list(v.shape) for i, v in enumerate(value)} if value else {name: []}
    return {name: list(value.shape)}


class CuvilRep(BackendRep):
    """A prepared model: one compiled library, or one per specialised input signature."""

    def __init__(self, model: onnx.ModelProto, compile_options: dict):
        self.model = model
        self.options = compile_options
        inits = {t.name for t in model.graph.initializer}
        self.inputs = [vi for vi in model.graph.input if vi.name not in inits]
        self.input_names = [vi.name for vi in self.inputs]
        self.output_names = [o.name for o in model.graph.output]
        # sequence and optional inputs: a list of arrays, an array or None each (frontends/sequences.py)
        self.structured = {vi.name for vi in self.inputs if not is_tensor_type(vi.type)}
        self.specialised = build_time_inputs(model)
        self.dynamic_shapes = not all(_is_static(vi) for vi in self.inputs)
        self._libraries: dict = {}
        self._outputs_type = namedtuple("Outputs", [f"o{i}" for i in range(len(self.output_names))]) \
            if self.output_names else tuple
        if not self.specialised and not self.dynamic_shapes:
            self._libraries[()] = self._compile(model, None)

    def _compile(self, model, shapes):
        from .api import compile as cuvil_compile
        return cuvil_compile(model, input_shapes=shapes, **self.options)

    def _feeds(self, inputs) -> dict:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
            if len(inputs) != len(self.input_names):
                raise CuvilError(f"the model takes {len(self.input_names)} input(s) {self.input_names}, got {len(inputs)}")
            feeds = dict(zip(self.input_names, inputs))
        arrays = {}
        for name, value in feeds.items():
            if name in self.structured:
                arrays[name] = _structured_feed(name, value)
                continue
            try:
                arrays[name] = np.asarray(value)
            except ValueError as exc:  # a ragged list: a sequence, not a tensor
                raise CuvilError(f"input '{name}' is not a tensor ({exc})") from None
        return arrays

    def library_for(self, feeds: dict):
        """The library for these feeds (compiled now if their signature is new)."""
        key = tuple((n, feeds[n].dtype.str, feeds[n].shape, feeds[n].tobytes()) for n in self.specialised)
        if self.dynamic_shapes:
            key += tuple((n, _signature(feeds[n])) for n in self.input_names if n not in self.specialised)
        lib = self._libraries.get(key)
        if lib is None:
            model = _specialise(self.model, {n: feeds[n] for n in self.specialised}) if self.specialised else self.model
            shapes = None
            if self.dynamic_shapes:
                shapes = {vi.name: list(feeds[vi.name].shape) for vi in self.inputs
                          if vi.name not in self.specialised and not _is_static(vi) and vi.name not in self.structured}
                for name in self.structured:
                    shapes.update(_structured_shapes(name, feeds[name]))
            lib = self._libraries[key] = self._compile(model, shapes)
        return lib

    def run(self, inputs, **kwargs):
        feeds = self._feeds(inputs)
        lib = self.library_for(feeds)
        results = lib.run({n: feeds[n] for n in self.input_names if n not in self.specialised})
        return self._outputs_type(*[results[n] for n in self.output_names])


class CuvilBackend(Backend):
    """prepare() compiles with cuvil.compile; keyword arguments are compile options (threads, opt_level...)."""

    @classmethod
    def is_compatible(cls, model, device: str = "CPU", **kwargs) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs) -> CuvilRep:
        if not cls.supports_device(device):
            raise CuvilError(f"device {device!r} is not supported", hint="cuvil compiles for the CPU")
        if isinstance(model, (bytes, str)):
            model = onnx.load_model_from_string(model) if isinstance(model, bytes) else onnx.load(model)
        options = {k: v for k, v in kwargs.items() if k not in ("rtol", "atol")}
        return CuvilRep(model, options)

    @classmethod
    def run_model(cls, model, inputs, device: str = "CPU", **kwargs):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node, inputs, device: str = "CPU", outputs_info=None, **kwargs):
        raise NotImplementedError("cuvil compiles whole models; wrap the node in a model and use run_model")

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return str(device).upper().split(":")[0] == "CPU"


prepare = CuvilBackend.prepare
run_model = CuvilBackend.run_model
supports_device = CuvilBackend.supports_device


# -- ONNX's node tests, by op ---------------------------------------------------------------

@lru_cache(maxsize=1)
def load_node_tests() -> list[tuple[object, str]]:
    """ONNX's backend node tests (generated in memory by the installed onnx) as
    (TestCase, op) pairs. The op of a test is the op of the node its generator
    exported, so a function's `_expanded` variant counts for the function's op."""
    import onnx.backend.test.case.node as node_cases
    origin: dict[str, str] = {}
    original = node_cases.expect

    def expect(node_op, *args, **kwargs):
        before = len(node_cases._NodeTestCases)
        original(node_op, *args, **kwargs)
        for case in node_cases._NodeTestCases[before:]:
            origin[case.name] = node_op.op_type

    node_cases.expect = expect
    try:
        from onnx.backend.test.loader import load_model_tests
        with warnings.catch_warnings():  # the generators overflow casts on purpose
            warnings.simplefilter("ignore")
            cases = load_model_tests(kind="node")
    finally:
        node_cases.expect = original
    single = {c.name: c.model.graph.node[0].op_type for c in cases if len(c.model.graph.node) == 1}
    return [(c, origin.get(c.name) or _op_from_name(c, single)) for c in cases]


def _op_from_name(case, single: dict) -> str:
    """Fallback when the generators ran before (their `expect` was already bound)."""
    base = case.name
    for suffix in ("_expanded_ver18", "_expanded"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    if base in single:
        return single[base]
    ops = [n.op_type for n in case.model.graph.node if n.op_type != "Constant"]
    return ops[0] if ops else "Constant"


# ONNX's generators give every case rtol=1e-3, atol=1e-7 unless a test needs
# looser ones; an atol of 1e-7 is below float32 rounding of values near 1, so
# the default cases are compared at atol=1e-5 (onnxruntime's own default).
DEFAULT_RTOL, DEFAULT_ATOL = 1e-3, 1e-5


def tolerances(case) -> tuple[float, float]:
    rtol, atol = getattr(case, "rtol", None), getattr(case, "atol", None)
    if rtol is None or atol is None or (rtol, atol) == (1e-3, 1e-7):
        return DEFAULT_RTOL, DEFAULT_ATOL
    return rtol, atol


class OutputMismatch(AssertionError):
    """run_node_test: cuvil ran the model, but an output differs from the expected one."""


def internal_exception(exc: BaseException) -> bool:
    """Whether a node test's failure is an exception cuvil let escape (a bug: every failure
    of cuvil's own should be a CuvilError) rather than a CuvilError or an OutputMismatch."""
    return not isinstance(exc, (CuvilError, OutputMismatch, KeyboardInterrupt))


def _compare(outputs, expected, rtol, atol) -> None:
    if len(outputs) != len(expected):
        raise OutputMismatch(f"{len(outputs)} outputs, expected {len(expected)}")
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if want is None or isinstance(want, list):  # an optional or a sequence
            if type(got) is not type(want):
                raise OutputMismatch(f"output {i}: a {type(got).__name__}, expected a {type(want).__name__}")
            if want is not None:
                if len(got) != len(want):
                    raise OutputMismatch(f"output {i}: a sequence of {len(got)} tensors, expected {len(want)}")
                _compare(got, want, rtol, atol)
            continue
        if not isinstance(got, (np.ndarray, np.generic)):
            raise OutputMismatch(f"output {i}: a {type(got).__name__}, expected a tensor")
        if got.shape != want.shape:
            raise OutputMismatch(f"output {i}: shape {got.shape}, expected {want.shape}")
        if got.dtype != want.dtype:
            raise OutputMismatch(f"output {i}: dtype {got.dtype}, expected {want.dtype}")
        try:
            if want.dtype == object or want.dtype.kind in "biuSU":
                np.testing.assert_array_equal(got, want, err_msg=f"output {i}")
            else:
                np.testing.assert_allclose(got.astype(np.float64) if got.dtype.kind == "f" else got,
                                           want.astype(np.float64) if want.dtype.kind == "f" else want,
                                           rtol=rtol, atol=atol, err_msg=f"output {i}")
        except AssertionError as exc:
            raise OutputMismatch(str(exc)) from None


# -- random ops: statistics, not values -------------------------------------------------------
#
# The node tests of random ops (Bernoulli and its expanded form, training Dropout with a non-zero
# ratio) take their expected outputs from numpy's unseeded generator, which no other generator
# can match value for value. Such a test passes when every output has the expected shape and
# dtype AND a statistical check of the op's law passes (`_check_random`):
#
# - Bernoulli: every value is 0 or 1, and the number of ones S is within 4 standard deviations of
#   its mean: |S - sum(p)| <= 4 sqrt(sum p (1 - p)) (a false failure about once in 16,000 runs);
#   for the `_expanded` form, whose function body draws ones with probability 1 - p, the same
#   with 1 - p (`_random_kind`);
# - Dropout (ratio r): kept elements are x / (1 - r) (float32 rounding: rtol 1e-6), dropped ones
#   0, the mask (when asked) says which, and the kept count K of n is within 4 standard
#   deviations of Binomial(n, 1 - r): |K - n (1 - r)| <= 4 sqrt(n r (1 - r)).
#
# A model without a seed draws new numbers each run, so its library runs RANDOM_RUNS times and the
# check pools the samples (10 Bernoulli draws alone prove little); a seeded one must give the same
# bits every run (checked over 3 runs), and is checked on its one sample.
RANDOM_RUNS = 200


def _random_kind(model: onnx.ModelProto, inputs: list) -> str | None:
    """'Bernoulli' or 'Dropout' when the model's output is random (see above), else None."""
    ops = {n.op_type for n in model.graph.node}
    if "Bernoulli" in ops:
        return "Bernoulli"
    if "RandomUniformLike" in ops and "Greater" in ops:
        # Bernoulli's function body (onnx 1.23) is Cast(Greater(RandomUniformLike(p), p)): a one
        # where u > p, so ones with probability 1 - p, not p as the op says. The compiled graph
        # computes the body as written; the check is of that law.
        uniform = next(n.output[0] for n in model.graph.node if n.op_type == "RandomUniformLike")
        greater = next(n for n in model.graph.node if n.op_type == "Greater")
        return "Bernoulli(1-p)" if greater.input[0] == uniform else "Bernoulli"
    if "Dropout" in ops and len(inputs) > 2 and bool(np.asarray(inputs[2]).reshape(-1)[0]) \
            and float(np.asarray(inputs[1]).reshape(-1)[0]) != 0.0:
        return "Dropout"
    return None


def _seeded(model: onnx.ModelProto) -> bool:
    return all(any(a.name == "seed" for a in n.attribute) for n in model.graph.node
               if n.op_type in RANDOM_OPS or n.op_type == "Dropout")


def _check_random(kind: str, inputs: list, runs: list[list]) -> None:
    """The statistical check of the comment above, over the outputs of one or more runs."""
    if kind.startswith("Bernoulli"):
        p = np.concatenate([np.asarray(inputs[0], np.float64).reshape(-1)] * len(runs))
        p = 1 - p if kind == "Bernoulli(1-p)" else p
        y = np.concatenate([np.asarray(r[0], np.float64).reshape(-1) for r in runs])
        if not np.isin(y, (0.0, 1.0)).all():
            raise OutputMismatch("Bernoulli: a value other than 0 or 1")
        sigma = float(np.sqrt(np.sum(p * (1 - p))))
        if abs(y.sum() - p.sum()) > 4 * sigma + 1e-9:
            raise OutputMismatch(f"Bernoulli: {y.sum():.0f} ones, expected {p.sum():.1f} +- {4 * sigma:.1f}")
        return
    x = np.asarray(inputs[0], np.float64)
    ratio = float(np.asarray(inputs[1]).reshape(-1)[0])
    kept = total = 0
    for outputs in runs:
        y = np.asarray(outputs[0], np.float64)
        mask = np.asarray(outputs[1]) if len(outputs) > 1 else (y != 0)
        np.testing.assert_allclose(y[mask], x[mask] / (1 - ratio), rtol=1e-6, err_msg="Dropout: kept values")
        if np.any(y[~mask] != 0):
            raise OutputMismatch("Dropout: a dropped element is not 0")
        kept, total = kept + int(mask.sum()), total + mask.size
    sigma = float(np.sqrt(total * ratio * (1 - ratio)))
    if abs(kept - total * (1 - ratio)) > 4 * sigma:
        raise OutputMismatch(f"Dropout: kept {kept} of {total}, expected {total * (1 - ratio):.1f} +- {4 * sigma:.1f}")


def _compare_random(kind, rep, model, inputs, outputs, expected) -> None:
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise OutputMismatch(f"output {i}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
    if len(outputs) != len(expected):
        raise OutputMismatch(f"{len(outputs)} outputs, expected {len(expected)}")
    if _seeded(model):
        for _ in range(2):
            again = list(rep.run(inputs))
            if any(a.tobytes() != b.tobytes() for a, b in zip(again, outputs)):
                raise OutputMismatch("a seeded random op gave other values on another run")
        runs = [outputs]
    else:
        runs = [outputs] + [list(rep.run(inputs)) for _ in range(RANDOM_RUNS - 1)]
    try:
        _check_random(kind, inputs, runs)
    except AssertionError as exc:
        raise OutputMismatch(str(exc)) from None


def run_node_test(case, **compile_options) -> None:
    """Prepare the case's model with CuvilBackend, run every data set, compare
    with the expected outputs (shape, dtype, values; statistics for random ops,
    see above); raises OutputMismatch or a CuvilError (anything else is a bug:
    `internal_exception`). Returns how many kernel calls the libraries ran (0:
    every node was folded at build time)."""
    from onnx.backend.test.runner import _normalize_tensor
    rtol, atol = tolerances(case)
    rep = CuvilBackend.prepare(case.model, "CPU", **compile_options)
    for inputs, expected in case.data_sets:
        inputs = [_normalize_tensor(x) for x in inputs]
        expected = [_normalize_tensor(x) for x in expected]
        outputs = list(rep.run(inputs))
        kind = _random_kind(case.model, inputs)
        if kind:
            _compare_random(kind, rep, case.model, inputs, outputs, expected)
        else:
            _compare(outputs, expected, rtol, atol)
    return sum(lib.artifacts.info.get("steps", 0) for lib in rep._libraries.values())
