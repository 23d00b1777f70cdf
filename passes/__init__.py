"""Graph passes: each a pure `Graph -> Graph` in a module of its own, named here.

The registry below is the one list of passes `cuvil.yaml` can name; each opt
level runs a fixed list of them in order. A pass with options takes them as a
pydantic model (`Options` in its module, checked strictly: a misspelt or
mistyped option is an error naming what exists); a pass may have a
`describe(before, after) -> str` saying what it did, which `cuvil explain`
prints. It reads the two graphs only, so passes stay pure.

    opt 0  nothing
    opt 1  clean-ups that never change how a kernel computes: constants, identities,
           shape chains, duplicates, dead nodes; memory planning
    opt 2  + quantised products (QDQ, quantize_dynamic's integer ops) into one integer product
           (`fold_qdq`, before constants fold the quantised weights to float),
           folding and fusion into ops the kernels already have: BatchNormalization
           into Conv, a per-channel Mul/Add into InstanceNormalization's scale and bias
           (`fold_batchnorm`), MatMul + bias into Gemm, exporters' decompositions into one op,
           activations and residual adds into Conv/Gemm/MatMul epilogues; a ScatterElements
           over expanded row indices into a ScatterND (`simplify_scatter`); 3x3
           stride-1 convs marked for Winograd (`winograd`: fewer multiply-adds, more
           session memory and slightly different rounding; disable it to keep them direct);
           a depthwise conv and the 1x1 convs before and after it into one DepthwiseBlock
           when the tensors between them are large (`fuse_depthwise_block`); an elementwise
           program of one input read only by a Conv into that conv's input copy
           (`fuse_conv_prologue`: PrologueConv, float32 CPU builds); attention's
           MatMul -> scale -> Softmax -> MatMul (and the Transposes around it) into one
           FusedAttention (`fuse_attention`)
    opt 3  + fusion that generates new kernels: elementwise chains into one loop
           (FusedElementwise), then the clean-ups once more

    in no level  merge_matmuls (sibling MatMul/Gemm of one input -> one product + Split):
                 measured neutral on the encoder, see its module; name it in `passes:`
"""
from __future__ import annotations

from pydantic import ValidationError

from cuvil.errors import ConfigError

from . import (assign_precision, eliminate_common, eliminate_dead, eliminate_identity, fold_batchnorm, fold_constants, fold_qdq,
               fuse_activation, fuse_attention, fuse_conv_prologue, fuse_depthwise_block, fuse_elementwise, fuse_gemm, fuse_patterns, merge_matmuls,
               plan_memory, quantize_weights, simplify_scatter, simplify_shapes, winograd)

_MODULES = {
    "fold_qdq": fold_qdq,
    "fold_constants": fold_constants,
    "eliminate_identity": eliminate_identity,
    "simplify_shapes": simplify_shapes,
    "eliminate_common": eliminate_common,
    "fold_batchnorm": fold_batchnorm,
    "fuse_gemm": fuse_gemm,
    "fuse_patterns": fuse_patterns,
    "simplify_scatter": simplify_scatter,
    "fuse_attention": fuse_attention,
    "fuse_activation": fuse_activation,
    "winograd": winograd,
    "fuse_depthwise_block": fuse_depthwise_block,
    "fuse_conv_prologue": fuse_conv_prologue,
    "merge_matmuls": merge_matmuls,
    "fuse_elementwise": fuse_elementwise,
    "eliminate_dead": eliminate_dead,
    "plan_memory": plan_memory,
    # added by the pipeline, with the variant's precision, when it is not fp32
    "assign_precision": assign_precision,
    # added by the pipeline first for precision int4 (weight-only MatMulNBits)
    "quantize_weights": quantize_weights,
}

PASSES = {name: getattr(module, name) for name, module in _MODULES.items()}

# name -> the pydantic model of its options (passes without options are absent).
PASS_OPTIONS = {name: module.Options for name, module in _MODULES.items() if hasattr(module, "Options")}

_BASIC = ["fold_constants", "eliminate_identity", "simplify_shapes", "eliminate_common", "eliminate_dead"]
_FUSION = ["fold_qdq", "fold_constants", "eliminate_identity", "simplify_shapes", "fold_batchnorm", "fuse_gemm", "fuse_patterns",
           "simplify_scatter", "fuse_attention", "fuse_activation", "winograd", "fuse_depthwise_block", "fuse_conv_prologue",
           "eliminate_common", "eliminate_dead"]
OPT_LEVELS = {
    0: [],
    1: _BASIC + ["plan_memory"],
    2: _FUSION + ["plan_memory"],
    3: _FUSION + ["fuse_elementwise", "fuse_conv_prologue", "eliminate_common", "eliminate_dead", "plan_memory"],
}


def resolve_passes(opt_level: int = 2, passes=None, disable=()) -> list[str]:
    """The ordered pass list for a model: an explicit list, else the opt level's, minus disabled ones."""
    names = list(passes) if passes is not None else list(OPT_LEVELS[opt_level])
    unknown = [n for n in list(names) + list(disable) if n not in PASSES]
    if unknown:
        raise ConfigError(f"unknown pass {unknown[0]!r}", hint=f"known passes: {', '.join(sorted(PASSES))}")
    return [n for n in names if n not in set(disable)]


def check_pass_options(options: dict) -> dict:
    """Validate `pass_options` as cuvil.yaml gives them ({pass: {option: value}}); returns them as given.
    Raises ValueError with a message naming the known passes or options."""
    if not isinstance(options, dict):
        raise ValueError(f"pass_options must be a mapping of pass name to options, got {type(options).__name__}")
    for name, given in options.items():
        if name not in PASSES:
            raise ValueError(f"unknown pass {name!r} (known passes: {', '.join(sorted(PASSES))})")
        model = PASS_OPTIONS.get(name)
        if model is None:
            if given:
                raise ValueError(f"pass {name!r} takes no options (passes with options: "
                                 f"{', '.join(sorted(PASS_OPTIONS))})")
            continue
        if not isinstance(given, dict):
            raise ValueError(f"{name}: expected a mapping of option to value, got {given!r}")
        try:
            model.model_validate(given)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            if first["type"] == "extra_forbidden":
                message = f"unknown option {where!r} (known: {', '.join(model.model_fields)})"
            else:
                message = f"{where}: {first['msg']}, got {first.get('input')!r}"
            raise ValueError(f"{name}: {message}") from None
    return options


def resolve_pass_options(names, options: dict | None = None) -> dict[str, dict]:
    """Every listed pass's options with the defaults filled in ({} for a pass without options):
    what goes into each pass step's key."""
    try:
        options = check_pass_options(dict(options or {}))
    except ValueError as error:
        hint = "each pass's options are the fields of `Options` in passes/<name>.py"
        raise ConfigError(f"pass_options: {error}", hint=hint) from None
    resolved = {}
    for name in names:
        model = PASS_OPTIONS.get(name)
        resolved[name] = model.model_validate(options.get(name, {})).model_dump() if model else {}
    return resolved


def run_pass(name: str, graph, options: dict | None = None):
    model = PASS_OPTIONS.get(name)
    if model is None:
        return PASSES[name](graph)
    return PASSES[name](graph, model.model_validate(options or {}))


def describe(name: str, before, after) -> str:
    """What pass `name` did, in a few words ('' when the module has nothing to say)."""
    module = _MODULES.get(name)
    if before is after:
        return "no change"
    if module is not None and hasattr(module, "describe"):
        text = module.describe(before, after)
        if text:
            return text
    return op_delta(before, after)


def op_delta(before, after) -> str:
    """'-53 BatchNormalization, +2 Gemm': the op counts that changed."""
    b, a = before.op_counts(), after.op_counts()
    parts = [f"{a.get(op, 0) - b.get(op, 0):+d} {op}" for op in sorted(set(a) | set(b)) if a.get(op, 0) != b.get(op, 0)]
    return ", ".join(parts) or "no change in op counts"


def run_passes(graph, names, on_pass=None, options: dict | None = None):
    """Run passes in order; `on_pass(name, before_graph, after_graph)` sees each step."""
    resolved = resolve_pass_options(names, options)
    for name in names:
        before = graph
        graph = run_pass(name, graph, resolved[name])
        if on_pass:
            on_pass(name, before, graph)
    return graph
