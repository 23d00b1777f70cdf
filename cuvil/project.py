"""A whole cuvil.yaml: build every variant of every model, or check them without building.

`build_project` turns each (model, target) pair of a `BuildSpec` into a
`VariantSpec` and builds it into `<output_dir>/<model>/<target>/`, all
variants sharing one step cache. `check_project` imports each model (TorchScript
files are exported to ONNX first, as the build does) and lowers it to kernel
calls without compiling anything, so an unsupported op is found in seconds
instead of after a long build.

An error from one model is re-raised with the config file and line of that
model's entry in front (`cuvil.yaml:12: model 'resnet': ...`), so the user
knows which entry to look at when a file lists many.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

from .cache import Cache
from .config import BuildSpec, ModelConfig
from .errors import CuvilError, UnsupportedOpError

TORCHSCRIPT_SUFFIXES = (".pt", ".pth")


@dataclass
class ModelReport:
    """What `check` knows of one model after importing it: tensors, ops, and what cannot be compiled."""
    name: str
    source: Path
    inputs: list[dict]          # {"name", "dtype", "shape"}
    outputs: list[dict]
    op_counts: dict[str, int]   # the imported graph's ops (constant subgraphs already folded)
    unsupported: list[str] = field(default_factory=list)  # one line per node that has no kernel


def select_models(spec: BuildSpec, names: list[str] | None = None) -> list[ModelConfig]:
    """The models named (in the order given, each once), or all of them."""
    if not names:
        return list(spec.models)
    known = {m.name: m for m in spec.models}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CuvilError(f"{_file(spec)}: no model named {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(known)})",
                         hint="model names are the `name:` keys under `models:`")
    return [known[n] for n in dict.fromkeys(names)]


@dataclass
class ProjectBuild:
    """What a build of a cuvil.yaml produced: one Artifacts per variant, and the step graph."""
    artifacts: list
    dag: object
    seconds: float


def plan_project(spec: BuildSpec, models: list[str] | None = None, jobs: int = 1, progress=print,
                 cache=None):
    """One step graph for every selected (model, target): identical kernels are one step.
    Returns the graph and, per variant, (model config, target, output folder, link step)."""
    from .build import VariantSpec, plan_variant, tool_versions
    from .dag import StepGraph

    say = progress or (lambda message: None)
    if cache is None:
        cache = open_project_cache(spec)
    dag = StepGraph(cache, tool_versions(), progress=say, jobs=jobs)
    planned = []
    for model in select_models(spec, models):
        for target in model.targets:
            with _located(spec, model):
                variant = VariantSpec(
                    name=model.name, source=model.source, input_shapes=dict(model.inputs), target=target,
                    precision=model.precision, opt_level=model.opt_level, passes=model.passes,
                    disable_passes=list(model.disable_passes), pass_options=dict(model.pass_options),
                    threads=model.threads,
                    symbol_prefix=model.symbol_prefix, max_arena_mb=model.max_arena_mb, sanitize=model.sanitize)
                planned.append((model, target, spec.output_dir / model.name / target, plan_variant(dag, variant)))
    dag.check()
    return dag, planned


def build_project(spec: BuildSpec, models: list[str] | None = None, jobs: int = 1, progress=print,
                  cache=None, output_dir: Path | None = None) -> ProjectBuild:
    """Build each selected model for each of its targets into <output_dir>/<model>/<target>/."""
    import time

    from .build import _artifacts, install

    start = time.perf_counter()
    say = progress or (lambda message: None)
    dag, planned = plan_project(spec, models, jobs, progress, cache)
    built = []
    for model, target, out_dir, link in planned:
        if output_dir is not None:
            out_dir = Path(output_dir) / model.name / target
        with _located(spec, model):
            t0 = time.perf_counter()
            files = dag.get(link)
            changed = install(files, out_dir)
            built.append(_artifacts(files, out_dir, time.perf_counter() - t0, changed))
            say(f"[{model.name}/{target}] {'built' if changed else 'up to date'}: {_relative(out_dir)}")
    return ProjectBuild(built, dag, time.perf_counter() - start)


def open_project_cache(spec: BuildSpec):
    """The step cache a cuvil.yaml asks for: a local folder, with a shared fsspec URL behind it if set."""
    from . import cache as cache_module
    if hasattr(cache_module, "open_cache"):
        return cache_module.open_cache(spec.cache)
    return cache_module.Cache(spec.cache.dir, read_only=spec.cache.read_only)


def check_model(spec: BuildSpec, model: ModelConfig) -> ModelReport:
    """Import one model, run its passes and lower each node, compiling nothing."""
    from backends.numba_cpu import registry
    from passes import resolve_passes, run_passes

    from .build import has_kernel
    from .frontends.onnx import import_onnx

    with _located(spec, model):
        source = model.source
        if source.suffix.lower() in TORCHSCRIPT_SUFFIXES:  # the build's export step, run here uncached
            from .frontends.torch import to_onnx_proto
            source = to_onnx_proto(source, dict(model.inputs))
        graph, _ = import_onnx(source, dict(model.inputs), has_kernel=has_kernel)
        report = ModelReport(model.name, model.source, _tensors(graph, graph.inputs),
                             _tensors(graph, graph.outputs), graph.op_counts())
        graph = run_passes(graph, resolve_passes(model.opt_level, model.passes, model.disable_passes),
                           options=model.pass_options)
        for node in graph.nodes:
            problem = _lowering_problem(registry, node, graph)
            if problem:
                report.unsupported.append(f"node '{node.name}' ({node.op}): {problem}")
    return report


def check_project(spec: BuildSpec, models: list[str] | None = None) -> list[str]:
    """Every node of every selected model that cannot be compiled, each prefixed with its model's location."""
    problems = []
    for model in select_models(spec, models):
        report = check_model(spec, model)
        problems.extend(f"{_where(spec, model)}{line}" for line in report.unsupported)
    return problems


def _lowering_problem(registry, node, graph) -> str | None:
    """Why `node` cannot be lowered, or None. Lowering only writes kernel source, so it is cheap."""
    # The "cuvil" domain holds the ops the fusion passes make (FusedConv, FusedElementwise...).
    cuvil_op = node.domain == "cuvil" and node.op in getattr(registry, "CUVIL_DOMAIN_OPS", ())
    if node.domain not in ("", "ai.onnx") and not cuvil_op:
        return f"op {node.domain}::{node.op} is outside the default ONNX domain"
    generator = registry.GENERATORS.get(node.op)
    if generator is None:
        return f"no kernel generator for op {node.op}"
    try:
        generator(node, graph)
    except NotImplementedError:
        return f"the kernel generator for {node.op} is not written yet"
    except UnsupportedOpError as error:  # an attribute or dtype the generator does not cover
        return error.message
    return None


def _tensors(graph, names) -> list[dict]:
    return [{"name": n, "dtype": graph.values[n].dtype.name, "shape": list(graph.values[n].shape)} for n in names]


def _relative(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when below it."""
    try:
        return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
    except (OSError, ValueError):
        return str(path)


def _file(spec: BuildSpec) -> str:
    return _relative(spec.path)


def _where(spec: BuildSpec, model: ModelConfig) -> str:
    line = f":{model.line}" if model.line is not None else ""
    return f"{_file(spec)}{line}: model '{model.name}': "


@contextlib.contextmanager
def _located(spec: BuildSpec, model: ModelConfig):
    """Re-raise a model's errors with its config location in front, keeping the error's class."""
    try:
        yield
    except CuvilError as error:
        located = copy.copy(error)
        located.message = _where(spec, model) + error.message
        located.args = (str(located),)
        raise located.with_traceback(error.__traceback__) from error
    except NotImplementedError as error:
        # A generator stub, or a case a generator does not cover yet: a limitation, not a crash.
        what = str(error) or "an op"
        raise UnsupportedOpError(_where(spec, model) + f"{what} is not implemented yet",
                                 hint="`cuvil check` lists every node cuvil cannot compile yet") from error
