"""A whole cuvil.yaml: build every variant of every model, or check them without building.

`build_project` turns each (model, target) pair of a `BuildSpec` into a
`VariantSpec` and builds it into `<output_dir>/<model>/<target>/`, all
variants sharing one step cache. `check_project` runs the same pipeline
(pipeline.py) up to the memory plan for each model and target (TorchScript
files are exported to ONNX first, as the build does) without compiling
anything, so an unsupported op, target or precision is found in seconds
instead of after a long build, with the kernels, arena and weights the build
would make.

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

from .config import BuildSpec, ModelConfig
from .errors import CuvilError, UnsupportedOpError


@dataclass
class ModelReport:
    """What `check` knows of one model: tensors, ops, what cannot be compiled, and per target
    the kernels, arena and weights the build would make."""
    name: str
    source: Path
    inputs: list[dict]          # {"name", "dtype", "shape"}
    outputs: list[dict]
    op_counts: dict[str, int]   # the imported graph's ops (constant subgraphs already folded)
    unsupported: list[str] = field(default_factory=list)  # one line per node, target or precision refused
    variants: dict[str, dict] = field(default_factory=dict)  # target -> {"kernels", "steps", "memory"}
    # target -> one line per quantised op not on an int8 kernel, and what it runs as (pipeline.quantised_fallbacks)
    fallbacks: dict[str, list[str]] = field(default_factory=dict)


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
    # (model, target, the step whose output is the installed files) per variant: what a caller that
    # installed into other folders (folder_of) can install again from memory (the serve worker)
    finals: list = field(default_factory=list)


def plan_project(spec: BuildSpec, models: list[str] | None = None, jobs: int = 1, progress=print,
                 cache=None, listener=None):
    """One step graph for every selected (model, target): identical kernels are one step.
    Returns the graph and, per variant, (model config, target, output folder, link step)."""
    from .build import VariantSpec, plan_variant, tool_versions
    from .dag import StepGraph

    say = progress or (lambda message: None)
    if cache is None:
        cache = open_project_cache(spec)
    dag = StepGraph(cache, tool_versions(), progress=say, jobs=jobs)
    dag.listener = listener
    planned = []
    for model in select_models(spec, models):
        for target in model.targets:
            with _located(spec, model):
                variant = VariantSpec(
                    name=model.name, source=model.source, input_shapes=dict(model.inputs), target=target,
                    precision=model.precision, opt_level=model.opt_level, passes=model.passes,
                    disable_passes=list(model.disable_passes), pass_options=dict(model.pass_options),
                    threads=model.threads,
                    symbol_prefix=model.symbol_prefix, max_arena_mb=model.max_arena_mb, sanitize=model.sanitize,
                    accuracy=model.accuracy.model_dump(), link=model.link,
                    calibration=model.calibration.model_dump(), signature=model.signature,
                    generate=model.generate, batch=model.batch, select=model.select,
                    select_candidates=model.select_candidates)
                planned.append((model, target, spec.output_dir / model.name / target, plan_variant(dag, variant)))
    dag.check()
    return dag, planned


def build_project(spec: BuildSpec, models: list[str] | None = None, jobs: int = 1, progress=print,
                  cache=None, output_dir: Path | None = None, scheduler: str | None = None,
                  listener=None, folder_of=None, defer_cache_writes: bool = False,
                  timings: dict | None = None) -> ProjectBuild:
    """Build each selected model for each of its targets into <output_dir>/<model>/<target>/
    (or the folder `folder_of(model, target)` names: cuvil-compile's --output).
    With `defer_cache_writes` it returns once the files are installed, the steps' cache entries
    possibly still being written: the caller then calls `result.dag.flush()` (the server's build
    worker does, after answering). `timings`, when given, gets the seconds of the planning (config,
    the sources read and hashed, step keys) and of the installs; the steps' own are in `dag.records`.

    The steps run on this machine, or on the Dask cluster whose scheduler is at `scheduler`
    (default: `executor:` of the config; cluster.py), whose workers write them to the shared
    cache (the config's `cache:`, which `cache` must then be a view of); either way the outputs
    are then read from the cache and installed here."""
    import time

    from .build import artifacts_of, install, installed_files

    start = time.perf_counter()
    say = progress or (lambda message: None)
    dag, planned = plan_project(spec, models, jobs, progress, cache, listener)
    dag.defer_writes = defer_cache_writes
    planned_at = time.perf_counter()
    installing = 0.0
    if scheduler is None and spec.executor.kind == "dask":
        scheduler = spec.executor.address
    if scheduler:
        from .cluster import run_on_cluster
        run_on_cluster(dag, spec, models, [link for _, _, _, link in planned], scheduler, say,
                       planner=plan_project, where=lambda model: _where(spec, model))
    built = []
    for model, target, out_dir, link in planned:
        if folder_of is not None:
            out_dir = Path(folder_of(model, target))
        elif output_dir is not None:
            out_dir = Path(output_dir) / model.name / target
        with _located(spec, model):
            t0 = time.perf_counter()
            files = installed_files(dag, link)
            t1 = time.perf_counter()
            changed = install(files, out_dir)
            installing += time.perf_counter() - t1
            built.append(artifacts_of(files, out_dir, time.perf_counter() - t0, changed))
            say(f"[{model.name}/{target}] {'built' if changed else 'up to date'}: {_relative(out_dir)}")
    if timings is not None:
        timings.update(plan=planned_at - start, install=installing)
    return ProjectBuild(built, dag, time.perf_counter() - start,
                        [(model.name, target, link) for model, target, _, link in planned])


def open_project_cache(spec: BuildSpec):
    """The step cache a cuvil.yaml asks for: a local folder, with a shared fsspec URL behind it if set."""
    from . import cache as cache_module
    if hasattr(cache_module, "open_cache"):
        return cache_module.open_cache(spec.cache)
    return cache_module.Cache(spec.cache.dir, read_only=spec.cache.read_only)


def check_model(spec: BuildSpec, model: ModelConfig) -> ModelReport:
    """Run one model through the pipeline up to the memory plan for each of its targets,
    compiling nothing: what cannot be built (nodes, targets, precision), and what would be."""
    from . import pipeline

    with _located(spec, model):
        source = model.source
        inputs = dict(model.inputs)
        if model.generate is not None:   # a generation library: checked at its decode entry's shapes
            from . import generation
            inputs = generation.decode_shapes(source, model.generate, model.name)
        if model.precision in pipeline.CALIBRATED:
            source = pipeline.calibrated_source(source, inputs, model.precision,
                                                model.calibration.model_dump(), model.signature)
        imported = pipeline.import_any(source, inputs, model.signature)
        # the passes run on the canonical graph, as the build's do (cuvil/semantic.py); what the
        # report says of a node names it as the file does
        from . import semantic
        graph = pipeline.canonical_graph(imported, model.pass_options) if model.generate is None else imported
        original = semantic.original_names(imported) if graph is not imported else {}
        report = ModelReport(model.name, model.source, _tensors(imported, imported.inputs),
                             _tensors(imported, imported.outputs), imported.op_counts())
        # A precision not built yet is reported per target below (as the build refuses it).
        precision = model.precision if model.precision in pipeline.PRECISIONS_SUPPORTED else "fp32"
        passed = {}   # gpu? -> (graph after its passes, pass names, options); CPU and GPU lists differ

        def run(gpu: bool):
            if gpu not in passed:
                names, options = pipeline.pass_list(model.opt_level, model.passes, model.disable_passes,
                                                    model.pass_options, precision, gpu=gpu)
                g = pipeline.run_passes(graph, names, options)
                passed[gpu] = (g, names, options)
                problems = pipeline.lowering_problems(g, gpu=gpu)
                problems = [semantic.rename_in_text(p, original) for p in problems]
                report.unsupported.extend(f"GPU targets: {p}" if gpu else p for p in problems)
            return passed[gpu]

        targets = {}
        for target_name in model.targets:
            try:
                targets[target_name] = pipeline.resolve_variant_target(target_name, model.precision)
            except CuvilError as error:
                report.unsupported.append(f"target '{target_name}', precision '{model.precision}': {error.message}")
        for gpu in sorted({pipeline.is_gpu(t) for t in targets.values()} or {False}):
            run(gpu)
        for target_name, target in targets.items():
            if report.unsupported:
                continue
            g, names, options = run(pipeline.is_gpu(target))
            params = pipeline.VariantParams(model.name, target, model.threads,
                                            pipeline.memory_options(names, options), model.max_arena_mb)
            planned = pipeline.plan(g, params)
            report.variants[target_name] = {"kernels": len(planned.kernels), "steps": len(planned.calls),
                                            "memory": planned.figures()}
            if not pipeline.is_gpu(target):
                report.fallbacks[target_name] = [semantic.rename_in_text(line, original)
                                                 for line in pipeline.quantised_fallbacks(planned)]
    return report


def check_project(spec: BuildSpec, models: list[str] | None = None) -> list[str]:
    """Everything in the selected models that cannot be built, each prefixed with its model's location."""
    problems = []
    for model in select_models(spec, models):
        report = check_model(spec, model)
        problems.extend(f"{_where(spec, model)}{line}" for line in report.unsupported)
    return problems


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
