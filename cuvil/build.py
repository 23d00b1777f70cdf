"""Variants (model x target x precision) as steps of one build graph.

For each variant `plan_variant` adds, in pipeline order, one cached step per
function of the pipeline (pipeline.py):

    [export] -> import -> pass:<name> ... -> codegen -> link (-> kernel:<symbol> ...)

`export` (TorchScript / PyTorch and TensorFlow sources only) writes ONNX; `import` makes
CIR; each pass rewrites it; `codegen` lowers it to kernel calls, plans
memory, packs the weights and writes the C driver; `link` compiles every
distinct kernel (one cached step each, shared across variants and models)
and links the library through SCons. `install` then puts the artifacts in
place: each file is written to a temporary name and renamed, and a file
whose bytes did not change is not touched.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from . import __version__, pipeline
from .cache import Cache
from .dag import Step, StepGraph, pack_files, unpack_files
from .errors import CuvilError


@dataclass
class VariantSpec:
    name: str
    source: object                       # path, bytes, onnx.ModelProto
    input_shapes: dict = field(default_factory=dict)
    target: str = "native"
    precision: str = "fp32"
    opt_level: int = 2
    passes: list | None = None
    disable_passes: list = field(default_factory=list)
    pass_options: dict = field(default_factory=dict)  # {pass name: {option: value}}
    threads: int = 1
    symbol_prefix: str = "cuvil_"
    max_arena_mb: int = 4096
    sanitize: bool = False
    # bf16 / fp16: {samples, inputs, min_cosine} of the report against the float32 build (accuracy.py)
    accuracy: dict | None = None
    # int8: {inputs, samples, method, per_channel} of the calibration (calibrate.py)
    calibration: dict | None = None
    link: str = "shared"                 # shared: lib<name>.so, static: lib<name>.a, both
    signature: str | None = None         # TensorFlow SavedModel: the signature to build (serving_default)
    # a generation library (cuvil/generation.py): {max_context, prefill_buckets, tokenizer, pad_token}
    generate: dict | None = None
    # batch buckets (cuvil/batching.py): the batch sizes with a compiled entry, dim 0 of every input
    # (or input_shapes listing one shape per bucket)
    batch: list | None = None
    # how each node's kernel is chosen (cuvil/select.py): "rules" (shape rules, the default) or
    # "measure" (timed here, cached); select_candidates: the kernels measure times (None: all)
    select: str = "rules"
    select_candidates: list | None = None


@dataclass
class Artifacts:
    library: Path          # lib<name>.so, or lib<name>.a when only the static archive was built
    header: Path
    manifest: Path
    info: dict
    seconds: float
    kernels: int
    changed: bool = True   # False when every installed file already had these bytes
    files: list[Path] = field(default_factory=list)  # every installed file, the manifest last


# -- versions and fingerprints ----------------------------------------------------------

@lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """sha256 of cuvil's own source: a changed generator or pass must never reuse old steps."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    files = [root / "cuvil" / name for name in _OUTPUT_AFFECTING] + sorted((root / "cuvil" / "frontends").rglob("*.py"))
    for package in ("passes", "backends"):
        files += sorted((root / package).rglob("*.py"))
    for path in files:
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# The modules of cuvil/ that shape what a step produces (the CLI, the config
# loader, the runtime loader and the cache do not).
_OUTPUT_AFFECTING = ("__init__.py", "build.py", "pipeline.py", "generation.py", "batching.py", "semantic.py", "ops.py", "dag.py", "ir.py", "ir_io.py", "errors.py",
                     "consumers.py", "calibrate.py", "accuracy.py", "select.py")


@lru_cache(maxsize=None)
def tool_versions() -> dict:
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    return {"cuvil": __version__, "code": code_fingerprint()[:16], "numba": version("numba"),
            "llvmlite": version("llvmlite"), "onnx": version("onnx"), "numpy": version("numpy")}


@lru_cache(maxsize=None)
def compiler_version(cc: str | None = None) -> str:
    """The first line of `cc --version` (default $CC, else gcc): in every link step's key."""
    cc = cc or os.environ.get("CC", "gcc")
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        raise CuvilError(f"the C compiler '{cc}' cannot be run", hint="install gcc or set CC") from None


# -- step bodies: each wraps one function of the pipeline (pipeline.py) ----------------------

def _graph_codec(cache):
    from . import ir_io
    return (lambda g: ir_io.dumps(g, store=cache)), (lambda data: ir_io.loads(data, store=cache))


def _variant_params(params: dict) -> pipeline.VariantParams:
    """The lowering and planning parameters in a codegen step's parameters."""
    from backends.targets import target_from_key
    return pipeline.VariantParams(params["name"], target_from_key(params["target"]), params["threads"],
                                  params["memory"], params["max_arena_mb"])


def _cpu_provenance(target: dict) -> dict:
    """A CPU target's machine in the provenance: its CPU and triple, and the features it names (not
    native's: those are this machine's, a long list; its cpu says as much)."""
    named = {"features": target["features"]} if target["features"] and target["name"] != "native" else {}
    from backends.targets import WASM_TRIPLE, data_layout
    if target["triple"] == WASM_TRIPLE:   # the pointer width is what a host must know of a wasm32 module
        named.update(data_layout=data_layout(target["triple"]), vector_bits=target["vector_bits"])
    return {"cpu": target["cpu"], "triple": target["triple"], **named}


def _run_codegen(dag, graph, params):
    from .select import apply
    planned = pipeline.plan(apply(graph, params.get("select", {}).get("kernels")), _variant_params(params))
    info = pipeline.describe(planned, _provenance(dag, params))
    return pipeline.generate(planned, info, params["symbol_prefix"], params["threads"])


def _run_codegen_generation(dag, graphs, params, layout):
    """The codegen of a generation library: every entry's graph planned, one driver (pipeline.py)."""
    planned = pipeline.plan_generation(list(graphs), _variant_params(params), layout)
    info = pipeline.describe_generation(planned, layout, _provenance(dag, params))
    return pipeline.generate_generation(planned, layout, info, params["symbol_prefix"], params["threads"])


def _run_codegen_batched(dag, graphs, params, batches):
    """The codegen of a library with batch buckets: every bucket's graph planned, one driver."""
    planned = pipeline.plan_batched(list(graphs), _variant_params(params), batches)
    info = pipeline.describe_batched(planned, batches, _provenance(dag, params))
    return pipeline.generate_batched(planned, batches, info, params["symbol_prefix"], params["threads"])


def _provenance(dag, params) -> dict:
    return {
        "name": params["name"],
        "target": params["target_name"],
        **(_cpu_provenance(params["target"]) if "cpu" in params["target"] else {"gpu_arch": "sm_%d%d" % tuple(params["target"]["cc"])}),
        "precision": params["precision"],
        "threads": params["threads"],
        "symbol_prefix": params["symbol_prefix"],
        "passes": params["passes"],
        **({"pass_options": params["pass_options"]} if params.get("pass_options") else {}),
        **({"select": params["select"]} if params.get("select") else {}),
        "cuvil_version": __version__,
        "versions": {k: v for k, v in dag.versions.items() if k != "code"},
        # a library keyed by its imported graph names that graph's semantic hash (the same library
        # from any file of the same model); the source file's sha256 is in the installed manifest
        **({"graph_sha256": params["graph_sha256"]} if "graph_sha256" in params
           else {"source_sha256": params["source_sha256"]}),
        "spec_hash": params["spec_hash"],
    }


def kernel_step(target, spec: dict) -> Step:
    """The cached step that compiles one kernel (a kernels.json entry) for `target`: shared by
    every variant and model that has the same kernel."""
    params = {**{k: spec[k] for k in ("source", "arg_types", "symbol", "in_place")}, "target": target.as_key()}
    if spec.get("block"):
        from backends.numba_cuda.emit import tool_versions as cuda_tools
        params.update(block=spec["block"], cuda_tools=cuda_tools())
    return Step(name=f"kernel:{spec['symbol']}@{target.name}", kind="kernel", params=params,
                deps=[], run=lambda dag: pipeline.compile_kernel(spec, target), encode=bytes, decode=bytes,
                parallel=True)


def compiled_kernels(dag, target, specs: list[dict]) -> dict[str, bytes]:
    """symbol -> object file of each kernel spec, from their cached kernel steps (measured
    selection's one-node libraries, cuvil/select.py)."""
    steps = [dag.add(kernel_step(target, spec)) for spec in specs]
    return dict(zip([spec["symbol"] for spec in specs], dag.get_many(steps)))


def add_kernel_steps(dag, link_step: str, bundle: dict) -> list[str]:
    """Add the kernel steps of a codegen bundle as dependencies of its link step."""
    from backends.targets import target_from_key
    target = target_from_key(dag.step(link_step).params["target"])
    steps = [dag.add(kernel_step(target, k)) for k in json.loads(bundle["kernels.json"])]
    for name in steps:
        dag.g.add_edge(name, link_step)
    return steps


def _run_link(dag, bundle, params, extra_files=None):
    """The library (shared, static or both), its header, its pkg-config file and CMake package
    (consumers.py), and the manifest listing each file's sha256."""
    from backends.targets import target_from_key

    from .consumers import consumer_files
    kernels = json.loads(bundle["kernels.json"])
    steps = add_kernel_steps(dag, params["link_step"], bundle)
    objects = dict(zip([k["symbol"] for k in kernels], dag.get_many(steps)))
    name = params["name"]
    gpu = params["target"].get("kind") == "cuda"
    files = pipeline.link(name, params["symbol_prefix"], bundle["driver.c"], bundle["weights.bin"], objects,
                          sanitize=params["sanitize"], gpu=gpu, mode=params["link"],
                          target=None if gpu else target_from_key(params["target"]), cache=dag.cache)
    info = json.loads(bundle["info.json"])
    # A WebAssembly module is loaded by its host's engine, not linked: no pkg-config file or CMake package.
    wasm = any(file.endswith(".wasm") for file in files)
    files = {**files, f"{name}.h": bundle["header.h"], **({} if wasm else consumer_files(info, sorted(files), gpu)),
             **(extra_files or {})}
    if params["sanitize"]:
        info["sanitize"] = ["address", "undefined"]
    manifest = {**info, "files": {file: hashlib.sha256(data).hexdigest() for file, data in sorted(files.items())}}
    return {**files, "manifest.json": (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()}


# -- planning --------------------------------------------------------------------------------

def _shape(name, dims) -> list[int] | None:
    if dims is None:  # an empty optional input (docs/sequences.md)
        return None
    if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__"):
        raise CuvilError(f"input '{name}': the shape {dims!r} is not a list of integers")
    shape = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int,)) and not (hasattr(d, "__index__")):
            raise CuvilError(f"input '{name}': the shape {list(dims)!r} is not a list of integers")
        if int(d) <= 0:
            raise CuvilError(f"input '{name}': every dim of the shape {list(dims)} must be positive")
        shape.append(int(d))
    return shape


def spec_hash(model_sha: str, spec: VariantSpec, pass_names, by_graph: bool = False) -> str:
    """The hash of what a variant is built from; `by_graph`: `model_sha` is the imported graph's
    identity (semantic.identity), which a SavedModel's signature already chose."""
    inputs = {k: None if v is None else list(v) for k, v in sorted(spec.input_shapes.items())}  # None: empty optional
    payload = {"model": model_sha, "inputs": inputs,
               "target": spec.target, "precision": spec.precision, "passes": pass_names,
               "threads": spec.threads, "symbol_prefix": spec.symbol_prefix}
    if spec.pass_options:
        payload["pass_options"] = spec.pass_options
    if spec.signature and not by_graph:
        payload["signature"] = spec.signature
    if spec.batch:
        payload["batch"] = sorted(spec.batch)
    if spec.select != "rules":
        payload["select"] = {"mode": spec.select, "candidates": spec.select_candidates}
    if spec.precision in pipeline.CALIBRATED and spec.calibration:
        payload["calibration"] = {k: v for k, v in sorted(spec.calibration.items()) if k != "inputs"}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def plan_variant(dag: StepGraph, spec: VariantSpec, tag: str = "") -> str:
    """Add the steps of one variant; returns the name of its last step, whose output is the files
    to install: the link step, or for bf16 / fp16 the accuracy step after it (which also plans
    the float32 build it compares with, its steps named with the tag "fp32-reference")."""
    from .config import LINK_MODES
    if spec.link not in LINK_MODES:
        raise CuvilError(f"model '{spec.name}': unknown link {spec.link!r}", hint=f"one of: {', '.join(LINK_MODES)}")
    target = pipeline.resolve_variant_target(spec.target, spec.precision)
    from backends.targets import check_link, check_threads
    check_link(target, spec.link, spec.sanitize)   # before anything is compiled (and before the C compiler is looked for)
    check_threads(target, spec.threads)
    from .select import check_options
    check_options(spec.select, spec.select_candidates, f"model '{spec.name}'")
    pass_names, pass_options = pipeline.pass_list(spec.opt_level, spec.passes, spec.disable_passes, spec.pass_options,
                                                  spec.precision, gpu=pipeline.is_gpu(target))
    from .batching import split_input_shapes
    input_shapes, batches = split_input_shapes(spec.input_shapes, spec.batch, f"model '{spec.name}'")
    model_bytes, kind = pipeline.read_source(spec.source)
    model_sha = hashlib.sha256(model_bytes).hexdigest()
    shapes = {k: _shape(k, v) for k, v in sorted(input_shapes.items())}
    base = f"{spec.name}/{spec.target}" + (f"/{tag}" if tag else "")
    last = _plan_variant_steps(dag, spec, target, base, model_bytes, kind, model_sha, pass_names, pass_options,
                               shapes, batches)
    dag.source_sha256[last] = model_sha
    return last


def _plan_variant_steps(dag, spec, target, base, model_bytes, kind, model_sha, pass_names, pass_options, shapes,
                        batches) -> str:
    if spec.select != "rules" and (spec.generate is not None or batches):
        raise CuvilError(f"model '{spec.name}': select: {spec.select} is not supported with "
                         f"{'generate:' if spec.generate is not None else 'batch buckets'} yet",
                         hint="use select: rules (the default) for this model")
    if spec.generate is not None:
        if batches:
            raise CuvilError(f"model '{spec.name}': batch buckets and generate: cannot be combined",
                             hint="a generation library has its own prefill buckets (generate: prefill_buckets)")
        return _plan_generation(dag, spec, target, base, model_bytes, kind, model_sha, pass_names, pass_options)
    if batches:
        return _plan_batched(dag, spec, target, base, model_bytes, kind, model_sha, pass_names, pass_options,
                             shapes, batches)

    deps = []
    if pipeline.exported_kind(kind):
        export_params = {"model_sha256": model_sha, "inputs": shapes}
        if kind == "tensorflow":  # tf2onnx's output depends on its and TensorFlow's versions
            from .frontends.tensorflow import converter_key
            export_params.update(signature=spec.signature, converter=converter_key())
        export = dag.add(Step(f"{base}/export", "export", export_params, [],
                              lambda d: pipeline.export_onnx(spec.source, shapes, spec.signature), bytes, bytes))
        deps = [export]
        importer = lambda d, onnx_bytes: pipeline.import_model(onnx_bytes, shapes)
    elif isinstance(spec.source, (str, os.PathLike)):
        importer = lambda d: pipeline.import_model(spec.source, shapes)
    else:
        importer = lambda d: pipeline.import_model(model_bytes, shapes)
    import_params = {"model_sha256": model_sha, "inputs": shapes}
    if spec.precision in pipeline.CALIBRATED:
        # The float model calibrated and rewritten as QDQ (ONNX bytes), keyed by the samples' hash
        # and the options; the import then reads those bytes as it reads an imported QDQ model.
        from . import calibrate
        options = {**calibrate.DEFAULTS, **(spec.calibration or {})}
        # onnxruntime runs the float model to find the ranges: its version is part of the key
        key = {"model_sha256": model_sha, "inputs": shapes, "calibration": calibrate.options_key(options),
               "onnxruntime": calibrate.engine_version()}
        if pipeline.exported_kind(kind):
            run_calibration = lambda d, onnx_bytes: calibrate.quantize_model(onnx_bytes, shapes, options)
        else:
            run_calibration = lambda d: calibrate.quantize_model(model_bytes, shapes, options)
        deps = [dag.add(Step(f"{base}/calibrate", "calibrate", key, deps, run_calibration, bytes, bytes))]
        importer = lambda d, onnx_bytes: pipeline.import_model(onnx_bytes, shapes)
        import_params["calibration"] = key["calibration"]
    by_graph = pipeline.keyed_by_graph(pass_options)
    last, graph_sha = _plan_passes(dag, base, import_params, deps, importer, pass_names, pass_options, by_graph)
    params = {"name": spec.name, "target": target.as_key(), "target_name": spec.target, "precision": spec.precision,
              "threads": spec.threads, "symbol_prefix": spec.symbol_prefix, "passes": pass_names,
              **({"graph_sha256": graph_sha} if by_graph else {"source_sha256": model_sha}),
              "spec_hash": spec_hash(graph_sha if by_graph else model_sha, spec, pass_names, by_graph=by_graph),
              "max_arena_mb": spec.max_arena_mb, "memory": pipeline.memory_options(pass_names, pass_options)}
    if spec.pass_options:
        params["pass_options"] = {k: v for k, v in sorted(spec.pass_options.items()) if k in pass_names}
    if spec.select != "rules":
        params["select"] = {"mode": spec.select, "kernels": _plan_select(dag, spec, target, base, last)}
    codegen = dag.add(Step(f"{base}/codegen", "codegen", params, [last],
                           _with_original_names(lambda d, g: _run_codegen(d, g, params), f"{base}/import"),
                           pack_files, unpack_files))
    return _plan_link(dag, spec, target, base, codegen)


def _plan_select(dag, spec, target, base: str, last: str) -> dict[str, str]:
    """The select step after the passes (`select: measure`, cuvil/select.py), run now, while the
    build is planned: node -> kernel, which goes into the codegen step's parameters (its key)."""
    from . import select
    if pipeline.is_gpu(target) or getattr(target, "is_cross", False):
        raise CuvilError(f"model '{spec.name}': select: measure runs the candidate kernels on this machine, "
                         f"which cannot run target '{spec.target}'",
                         hint="use select: rules (the default) for this target")
    params = {"candidates": select.check_options(spec.select, spec.select_candidates, f"model '{spec.name}'"),
              "target": target.as_key(), "threads": spec.threads, "cpu": select.cpu_model()}
    step = dag.add(Step(f"{base}/select", "select", params, [last],
                        lambda d, g: select.measure(d, g, params, compiled_kernels),
                        lambda out: json.dumps(out, sort_keys=True).encode(), json.loads))
    return {node: result["kernel"] for node, result in sorted(dag.get(step).items())}


def _plan_passes(dag, base, import_params, deps, importer, pass_names, pass_options, semantic_key=True):
    """The import step, the canonical graph (semantic_key) and one step per pass after it; returns
    the last one's name and the imported graph's identity (None without semantic_key).

    With `semantic_key` the step after the import is keyed by the identity of the imported graph
    (cuvil/semantic.py), not by the import's key: it gives the canonical form of the graph, and
    every step after it is then the same for any file of the same model (an ONNX file, its
    TensorFlow original through tf2onnx, a re-export with other names). The identity is known
    once the import has run: planning runs the import (or reads it, or the identity, from the cache)."""
    from . import semantic
    encode_graph, decode_graph = _graph_codec(dag.cache)
    last = dag.add(Step(f"{base}/import", "import", import_params, deps,
                        importer, encode_graph, decode_graph))
    identity = None
    named = lambda run: run
    if semantic_key:
        import_step = last
        identity = _graph_identity(dag, import_step)
        last = dag.add(Step(f"{base}/graph", "graph", {"graph_sha256": identity}, [import_step],
                            lambda d, g: semantic.canonical(g), encode_graph, decode_graph, key_deps=False))
        named = lambda run: _with_original_names(run, import_step)
    for k, name in enumerate(pass_names):
        options = pass_options[name]
        # A pass listed again (opt 3 cleans up twice) is a step of its own: name#2, name#3...
        repeat = pass_names[:k].count(name)
        step_name = f"{base}/pass:{name}" + (f"#{repeat + 1}" if repeat else "")
        last = dag.add(Step(step_name, "pass", {"pass": name, "options": options}, [last],
                            named(lambda d, g, name=name, options=options: pipeline.run_pass(g, name, options)),
                            encode_graph, decode_graph))
    return last, identity


def _with_original_names(run, import_step: str):
    """A step run whose CuvilError names the nodes and values of the imported graph, not their
    canonical names (semantic.canonical renames them; a variant keyed by its file keeps them)."""
    def named(d, *inputs):
        if f"{import_step.rsplit('/', 1)[0]}/graph" not in d.g:
            return run(d, *inputs)
        try:
            return run(d, *inputs)
        except CuvilError as error:
            from . import semantic
            raise semantic.rename_in_message(error, semantic.original_names(d.get(import_step))) from None
    return named


def _graph_identity(dag, import_step: str) -> str:
    """The identity of an import step's graph (semantic.identity): from the cache, where it is
    stored under a key derived from the import step's, or by getting the import's output."""
    from . import semantic
    from .cache import step_key
    key = step_key({"kind": "graph-identity", "import": dag.key(import_step)})
    data = dag.cache.get(key)
    if data is not None and len(data) == 64:
        return data.decode("ascii")
    identity = semantic.identity(dag.get(import_step))
    dag.cache.put(key, identity.encode("ascii"))
    return identity


def _add_link(dag, spec, target, codegen: str, step_name: str, mode: str, extra_files: dict | None = None) -> str:
    """The link step after `codegen`; `extra_files` ({name: bytes}, in its key by sha256) are
    installed beside the library (a generation library's tokenizer.json)."""
    from backends.native.link import link_flags
    from backends.targets import c_compiler
    cflags, ldflags = link_flags(target, spec.symbol_prefix)
    link_params = {"name": spec.name, "symbol_prefix": spec.symbol_prefix, "cflags": cflags, "ldflags": ldflags,
                   "sanitize": spec.sanitize, "cc": compiler_version(c_compiler(target)), "target": target.as_key(),
                   "link_step": step_name, "link": mode}
    if extra_files:
        link_params["extra_files"] = {n: hashlib.sha256(b).hexdigest() for n, b in sorted(extra_files.items())}
    return dag.add(Step(step_name, "link", link_params, [codegen],
                        lambda d, bundle: _run_link(d, bundle, link_params, extra_files), pack_files, unpack_files,
                        expand=lambda d, bundle: add_kernel_steps(d, step_name, bundle)))


def _plan_generation(dag, spec, target, base, model_bytes, kind, model_sha, pass_names, pass_options) -> str:
    """A generation library (cuvil/generation.py): for each entry (every prefill bucket, decode) the
    import and passes with that entry's static shapes, then one codegen step over all of them and
    one link: one library, one weights blob, one KV cache per session."""
    import onnx

    from . import generation
    where = f"model '{spec.name}': generate"
    if kind != "onnx":
        raise CuvilError(f"{where}: generation libraries are built from ONNX decoders (onnxruntime-genai's "
                         f"model builder writes them, or torch.onnx.export of a transformers decoder), not {kind}",
                         hint="export the decoder to ONNX with past_key_values inputs (docs/generation.md)")
    if pipeline.is_gpu(target) or spec.precision in pipeline.CALIBRATED:
        raise CuvilError(f"{where}: target {spec.target!r} / precision {spec.precision!r} is not supported for "
                         f"generation yet", hint="build on a CPU target in fp32 or int4 (or a MatMulNBits model in fp32)")
    settings = generation.check_settings(spec.generate, where)
    model = onnx.load_model_from_string(model_bytes)
    layout = generation.layout(model, settings, generation.genai_config(spec.source), spec.name)
    external = generation.external_data_sha256(model, spec.source)
    if isinstance(spec.source, (str, os.PathLike)):
        source = spec.source
    else:
        source = model_bytes
    lasts = []
    for tokens in layout.entries:
        shapes = layout.input_shapes(tokens)
        params = {"model_sha256": model_sha, "inputs": shapes, **({"external_data": external} if external else {}),
                  **({"kv_form": layout.kv_form} if layout.kv_form != "static" else {})}
        importer = lambda d, shapes=shapes: generation.prepare_entry(pipeline.import_model(source, shapes), layout,
                                                                     f"model '{spec.name}'")
        last, _ = _plan_passes(dag, f"{base}/{tokens}-tokens", params, [], importer, pass_names, pass_options,
                               semantic_key=False)
        lasts.append(last)
    spec_key = hashlib.sha256(json.dumps({"spec": spec_hash(model_sha, spec, pass_names), "generate": layout.as_key(),
                                          "external_data": external}, sort_keys=True).encode()).hexdigest()
    params = {"name": spec.name, "target": target.as_key(), "target_name": spec.target, "precision": spec.precision,
              "threads": spec.threads, "symbol_prefix": spec.symbol_prefix, "passes": pass_names,
              "source_sha256": model_sha, "spec_hash": spec_key, "max_arena_mb": spec.max_arena_mb,
              "memory": pipeline.memory_options(pass_names, pass_options), "generate": layout.as_key()}
    if spec.pass_options:
        params["pass_options"] = {k: v for k, v in sorted(spec.pass_options.items()) if k in pass_names}
    codegen = dag.add(Step(f"{base}/codegen", "codegen", params, lasts,
                           lambda d, *graphs: _run_codegen_generation(d, graphs, params, layout),
                           pack_files, unpack_files))
    extra = {"tokenizer.json": Path(settings["tokenizer"]).read_bytes()} if settings["tokenizer"] else None
    # No accuracy step: a reduced precision is measured by the tokens it generates (tests, benchmarks).
    return _add_link(dag, spec, target, codegen, f"{base}/link", spec.link, extra)


def _plan_batched(dag, spec, target, base, model_bytes, kind, model_sha, pass_names, pass_options, shapes,
                  batches) -> str:
    """A library with batch buckets (cuvil/batching.py): for each batch size the [export,] import
    and passes with that batch in dim 0 of every input, then one codegen step over all of them
    (one driver, one weights blob) and one link."""
    import dataclasses

    from .batching import Buckets
    if spec.precision in pipeline.CALIBRATED:
        raise CuvilError(f"model '{spec.name}': batch buckets are not supported for precision "
                         f"{spec.precision!r} yet", hint="build int8 with one batch size")
    buckets = Buckets(tuple(batches), shapes)
    lasts, identities = [], []
    by_graph = pipeline.keyed_by_graph(pass_options)
    for batch in batches:
        entry_shapes = buckets.input_shapes(batch)
        entry_base = f"{base}/batch-{batch}"
        deps = []
        if pipeline.exported_kind(kind):
            export_params = {"model_sha256": model_sha, "inputs": entry_shapes}
            if kind == "tensorflow":
                from .frontends.tensorflow import converter_key
                export_params.update(signature=spec.signature, converter=converter_key())
            deps = [dag.add(Step(f"{entry_base}/export", "export", export_params, [],
                                 lambda d, s=entry_shapes: pipeline.export_onnx(spec.source, s, spec.signature),
                                 bytes, bytes))]
            importer = lambda d, onnx_bytes, s=entry_shapes: pipeline.import_model(onnx_bytes, s)
        elif isinstance(spec.source, (str, os.PathLike)):
            importer = lambda d, s=entry_shapes: pipeline.import_model(spec.source, s)
        else:
            importer = lambda d, s=entry_shapes: pipeline.import_model(model_bytes, s)
        import_params = {"model_sha256": model_sha, "inputs": entry_shapes}
        last, identity = _plan_passes(dag, entry_base, import_params, deps, importer, pass_names, pass_options,
                                      by_graph)
        lasts.append(last)
        identities.append(identity)
    # the buckets' graphs together (each bucket's graph is its own)
    graph_sha = hashlib.sha256(json.dumps(identities).encode()).hexdigest()
    params = {"name": spec.name, "target": target.as_key(), "target_name": spec.target, "precision": spec.precision,
              "threads": spec.threads, "symbol_prefix": spec.symbol_prefix, "passes": pass_names,
              **({"graph_sha256": graph_sha} if by_graph else {"source_sha256": model_sha}),
              # both ways of writing the buckets (batch: or a shape per bucket) are one spec
              "spec_hash": spec_hash(graph_sha if by_graph else model_sha,
                                     dataclasses.replace(spec, input_shapes=shapes, batch=list(batches)),
                                     pass_names, by_graph=by_graph),
              "max_arena_mb": spec.max_arena_mb, "memory": pipeline.memory_options(pass_names, pass_options),
              "batch": buckets.as_key()}
    if spec.pass_options:
        params["pass_options"] = {k: v for k, v in sorted(spec.pass_options.items()) if k in pass_names}
    codegen = dag.add(Step(f"{base}/codegen", "codegen", params, lasts,
                           _with_original_names(lambda d, *graphs: _run_codegen_batched(d, graphs, params, batches),
                                                f"{base}/batch-{batches[-1]}/import"),
                           pack_files, unpack_files))
    return _plan_link(dag, spec, target, base, codegen)


def _plan_link(dag: StepGraph, spec: VariantSpec, target, base: str, codegen: str) -> str:
    """The link step of a variant and, for a reduced precision, the accuracy step measuring it; returns
    the variant's last step."""
    link_name = _add_link(dag, spec, target, codegen, f"{base}/link", spec.link)
    if spec.precision == "fp32":
        return link_name
    if pipeline.is_gpu(target):
        # Measuring runs the library, which for a CUDA target needs a GPU at build time: its
        # accuracy is checked by benchmarks/gpu_check.sh instead (docs/cuda.md).
        if spec.accuracy and spec.accuracy.get("min_cosine") is not None:
            raise CuvilError(f"model '{spec.name}': accuracy.min_cosine cannot be checked for CUDA target "
                             f"'{spec.target}' (the build would have to run the library on a GPU)",
                             hint="remove accuracy.min_cosine for CUDA targets; benchmarks/gpu_check.sh measures "
                                  "a GPU build against onnxruntime")
        return link_name
    # The measurement loads a shared library: a static-only variant links one beside its archive.
    measured = link_name if spec.link != "static" else _add_link(dag, spec, target, codegen, f"{base}/link:shared",
                                                                 "shared")
    return _plan_accuracy(dag, spec, base, link_name, measured)


def _plan_accuracy(dag: StepGraph, spec: VariantSpec, base: str, link_name: str, measured: str) -> str:
    """The step measuring a reduced-precision variant (the shared library of link step `measured`)
    against its float32 build (accuracy.py); its output is `link_name`'s files with the report."""
    import dataclasses

    from . import accuracy
    options = {"samples": 8, "inputs": "random", "min_cosine": None, **(spec.accuracy or {})}
    reference = plan_variant(dag, dataclasses.replace(spec, precision="fp32", sanitize=False, accuracy=None,
                                                      calibration=None, link="shared", select="rules",
                                                      select_candidates=None), tag="fp32-reference")
    params = {**options, "seed": accuracy.SEED}
    if options["inputs"] != "random":
        path = Path(options["inputs"])
        if not path.is_file():
            raise CuvilError(f"model '{spec.name}': accuracy inputs not found: {path}")
        params["inputs"] = {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    deps = [link_name, reference] + ([measured] if measured != link_name else [])
    return dag.add(Step(f"{base}/accuracy", "accuracy", params, deps,
                        lambda d, files, ref, *shared: accuracy.measure(files, ref, options, *shared),
                        pack_files, unpack_files))


def link_step_of(dag: StepGraph, last: str) -> str:
    """The link step of a variant, from the last step plan_variant returned."""
    return last if dag.step(last).kind == "link" else dag.step(last).deps[0]


def variant_params(dag: StepGraph, link_step: str) -> pipeline.VariantParams:
    """The lowering and planning parameters of a planned variant, as its codegen step runs them."""
    return _variant_params(dag.step(dag.step(link_step_of(dag, link_step)).deps[0]).params)


def installed_files(dag: StepGraph, last: str) -> dict[str, bytes]:
    """The files a variant installs: its last step's output, the manifest with the sha256 of the
    source file the variant was built from (`source_sha256`). The library and the cached steps
    know the imported graph only (`graph_sha256`): the same model from two files is one library."""
    files = dag.get(last)
    sha = dag.source_sha256.get(last)
    if sha is None or "manifest.json" not in files:
        return files
    manifest = json.loads(files["manifest.json"])
    if manifest.get("source_sha256") == sha:
        return files
    manifest["source_sha256"] = sha
    return {**files, "manifest.json": (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()}


def install(files: dict[str, bytes], out_dir: Path) -> bool:
    """Put files in out_dir: write each to a temporary name and rename it over the old
    one (readers never see half a file); the manifest goes last. Unchanged files are
    not touched. A file the previous manifest listed that is no longer built (the
    shared library after a switch to `link: static`) is removed, so no build tool
    finds it. Returns whether anything changed."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CuvilError(f"cannot create the output folder {out_dir}: {exc.strerror}") from None
    # A build killed between writing a temporary file and renaming it leaves
    # the temporary behind: such leftovers are removed by the next install.
    for stale in out_dir.glob(".cuvil-tmp-*"):
        try:
            stale.unlink()
        except OSError:
            pass
    changed = False
    previous = _listed_files(out_dir / "manifest.json")
    for name in sorted(files, key=lambda n: (n == "manifest.json", n)):
        path = out_dir / name
        data = files[name]
        try:
            if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
                continue
            fd, tmp = tempfile.mkstemp(prefix=f".cuvil-tmp-{name}.", dir=out_dir)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, 0o755 if name.endswith((".so", ".dll")) else 0o644)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            raise CuvilError(f"cannot write {path}: {exc.strerror}",
                             hint="check that the output folder is writable and the disk is not full") from None
        changed = True
    for name in sorted(previous - set(files)):
        try:
            (out_dir / name).unlink(missing_ok=True)
        except OSError as exc:
            raise CuvilError(f"cannot remove the obsolete {out_dir / name}: {exc.strerror}") from None
        changed = True
    return changed


def _listed_files(manifest: Path) -> set[str]:
    """The plain file names an installed manifest lists (none when there is no readable one)."""
    try:
        listed = json.loads(manifest.read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return set()
    return {name for name in listed
            if isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..", "manifest.json")}


def artifacts_of(files, out_dir, seconds, changed) -> Artifacts:
    lib = (next((n for n in files if n.endswith((".so", ".dll", ".wasm"))), None)
           or next(n for n in files if n.endswith(".a")))
    header = next(n for n in files if n.endswith(".h"))
    info = json.loads(files["manifest.json"])
    info.pop("files", None)
    installed = [out_dir / n for n in sorted(files, key=lambda n: (n == "manifest.json", n))]
    return Artifacts(out_dir / lib, out_dir / header, out_dir / "manifest.json", info, seconds,
                     info.get("kernels", 0), changed, installed)


def build_variants(variants: list[tuple[VariantSpec, Path]], cache: Cache, jobs: int = 1, progress=None,
                   dag: StepGraph | None = None) -> tuple[list[Artifacts], StepGraph]:
    """Build several variants in one step graph (identical kernels are compiled once)."""
    import time
    dag = dag or StepGraph(cache, tool_versions(), progress=progress, jobs=jobs)
    links = [plan_variant(dag, spec) for spec, _ in variants]
    dag.check()
    results = []
    for (spec, out_dir), link in zip(variants, links):
        start = time.perf_counter()
        files = installed_files(dag, link)
        changed = install(files, Path(out_dir))
        results.append(artifacts_of(files, Path(out_dir), time.perf_counter() - start, changed))
    return results, dag


def build_variant(spec: VariantSpec, out_dir: Path, cache: Cache, jobs: int = 1, progress=None) -> Artifacts:
    """Build one variant into out_dir (lib<name>.so and/or .a, <name>.h, <name>.pc, the CMake package,
    manifest.json)."""
    return build_variants([(spec, Path(out_dir))], cache, jobs=jobs, progress=progress)[0][0]
