"""Variants (model x target x precision) as steps of one build graph.

For each variant `plan_variant` adds, in pipeline order:

    [export] -> import -> pass:<name> ... -> codegen -> link (-> kernel:<symbol> ...)

`export` (TorchScript / PyTorch sources only) writes ONNX; `import` makes
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

from . import __version__
from .cache import Cache
from .dag import Step, StepGraph, pack_files, unpack_files
from .errors import CuvilError

PRECISIONS_SUPPORTED = ("fp32",)


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


@dataclass
class Artifacts:
    library: Path
    header: Path
    manifest: Path
    info: dict
    seconds: float
    kernels: int
    changed: bool = True   # False when every installed file already had these bytes


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
_OUTPUT_AFFECTING = ("__init__.py", "build.py", "dag.py", "ir.py", "ir_io.py", "errors.py")


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
def compiler_version() -> str:
    cc = os.environ.get("CC", "gcc")
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        raise CuvilError(f"the C compiler '{cc}' cannot be run", hint="install gcc or set CC") from None


# -- the source model -------------------------------------------------------------------

def _source_bytes(source) -> tuple[bytes, str]:
    """The model's bytes and its kind ('onnx' or 'torchscript')."""
    if isinstance(source, bytes):
        return source, "onnx"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise CuvilError(f"model file not found: {path}")
        kind = "torchscript" if path.suffix in (".pt", ".pth") else "onnx"
        return path.read_bytes(), kind
    import onnx
    if isinstance(source, onnx.ModelProto):
        return source.SerializeToString(), "onnx"
    raise CuvilError(f"cannot build a model from {type(source).__name__}")


# -- step bodies ----------------------------------------------------------------------------

def _graph_codec(cache):
    from . import ir_io
    return (lambda g: ir_io.dumps(g, store=cache)), (lambda data: ir_io.loads(data, store=cache))


def _run_export(dag, source, input_shapes):
    from .frontends.torch import to_onnx_proto
    return to_onnx_proto(source, input_shapes).SerializeToString()


def has_kernel(domain: str, op: str) -> bool:
    """Whether cuvil compiles the op as it is; the import expands the others into
    their ONNX function bodies where they have one (frontends/expand.py)."""
    from backends.numba_cpu.registry import CUVIL_DOMAIN_OPS, GENERATORS
    if domain == "cuvil":
        return op in CUVIL_DOMAIN_OPS
    return domain in ("", "ai.onnx") and op in GENERATORS


def _run_import(dag, source, input_shapes, model_bytes=None):
    from .frontends.onnx import import_onnx
    graph, _ = import_onnx(model_bytes if model_bytes is not None else source, input_shapes, has_kernel=has_kernel)
    return graph


def _run_pass(dag, graph, name, options):
    from passes import run_pass
    return run_pass(name, graph, options)


def _io(graph, names):
    import numpy as np
    return [{"name": n, "dtype": np.dtype(graph.values[n].dtype).name, "shape": list(graph.values[n].shape)}
            for n in names]


def _pack_weights(graph, schedule):
    """Every constant a kernel reads (and every build-time packed array) in one
    blob, each 64-byte aligned, identical arrays once; packed arrays in the
    schedule are replaced by the names they get here."""
    import numpy as np

    from backends.numba_cpu.kernel import KernelCall
    blob = bytearray()
    offsets: dict[str, int] = {}
    by_digest: dict[str, str] = {}

    def place(name, arr):
        arr = np.ascontiguousarray(arr)
        digest = hashlib.sha256(arr.dtype.str.encode() + arr.tobytes()).hexdigest()
        if digest in by_digest:
            offsets[name] = offsets[by_digest[digest]]
            return
        by_digest[digest] = name
        blob.extend(b"\0" * (-len(blob) % 64))
        offsets[name] = len(blob)
        blob.extend(arr.tobytes())

    packed = 0
    for call in schedule:
        if not isinstance(call, KernelCall):
            continue
        for args in [call.args] + ([call.in_place.args] if call.in_place else []):
            for i, arg in enumerate(args):
                if isinstance(arg, np.ndarray):
                    name = f"__packed_{packed}"
                    packed += 1
                    place(name, arg)
                    args[i] = name
                elif arg not in offsets and graph.values[arg].is_const:
                    place(arg, graph.values[arg].data)
    for name in graph.outputs:
        if name not in offsets and graph.values[name].is_const:
            place(name, graph.values[name].data)
    return bytes(blob), offsets


def _run_codegen(dag, graph, params):
    from backends.native import driver as c_driver
    from backends.native.memory import place_shared_values, plan_memory, shared_values
    from backends.numba_cpu.kernel import KernelCall
    from backends.numba_cpu.registry import lower

    schedule = lower(graph, params["threads"], params["target"]["l1d_ways"])
    weights, weight_offsets = _pack_weights(graph, schedule)
    shared = shared_values(schedule)
    external = set(graph.inputs) | set(graph.outputs) | set(weight_offsets) | set(shared)
    # Without the plan_memory pass every buffer gets bytes of its own (see passes/plan_memory.py).
    memory = params.get("memory") or {"strategy": "none", "in_place": False}
    plan = plan_memory(graph, schedule, external, strategy=memory["strategy"], in_place=memory["in_place"])
    place_shared_values(plan, graph, shared)
    limit = params["max_arena_mb"] << 20
    if plan.arena_bytes > limit:
        raise CuvilError(f"model '{params['name']}': a session would need {plan.arena_bytes / 2**20:.1f} MiB of working "
                         f"memory, over the limit of {params['max_arena_mb']} MiB",
                         hint="check the input shapes, or raise max_arena_mb in cuvil.yaml")
    kernels = {}
    for call in schedule:
        if isinstance(call, KernelCall):
            k = call.kernel
            kernels[k.symbol] = {"symbol": k.symbol, "family": k.family, "source": k.source,
                                 "arg_types": list(k.arg_types)}
    info = {
        "abi_version": c_driver.ABI_VERSION,
        "name": params["name"],
        "inputs": _io(graph, graph.inputs),
        "outputs": _io(graph, graph.outputs),
        "target": params["target_name"],
        "cpu": params["target"]["cpu"],
        "precision": params["precision"],
        "threads": params["threads"],
        "symbol_prefix": params["symbol_prefix"],
        "passes": params["passes"],
        **({"pass_options": params["pass_options"]} if params.get("pass_options") else {}),
        "cuvil_version": __version__,
        "versions": {k: v for k, v in dag.versions.items() if k != "code"},
        "source_sha256": params["source_sha256"],
        "spec_hash": params["spec_hash"],
        "memory": {"arena_bytes": plan.arena_bytes, "naive_bytes": plan.naive_bytes, "weights_bytes": len(weights),
                   "shared_bytes": plan.shared_bytes},
        "kernels": len(kernels),
        "steps": sum(1 for c in schedule if isinstance(c, KernelCall)),
    }
    driver_c = c_driver.generate(graph, schedule, plan, weight_offsets, info, params["symbol_prefix"], params["threads"])
    header = c_driver.header(params["symbol_prefix"], params["name"], info)
    return {"driver.c": driver_c.encode(), "weights.bin": weights, "header.h": header.encode(),
            "info.json": json.dumps(info, sort_keys=True).encode(),
            "kernels.json": json.dumps(sorted(kernels.values(), key=lambda k: k["symbol"])).encode()}


def _kernel_step(target, spec: dict) -> Step:
    from backends.numba_cpu.kernel import Kernel

    def run(dag):
        from backends.native.objects import compile_object
        return compile_object(Kernel(spec["family"], spec["source"], tuple(spec["arg_types"])), target)

    return Step(name=f"kernel:{spec['symbol']}@{target.name}", kind="kernel",
                params={"source": spec["source"], "arg_types": spec["arg_types"], "symbol": spec["symbol"],
                        "target": target.as_key()},
                deps=[], run=run, encode=bytes, decode=bytes, parallel=True)


def _run_link(dag, bundle, params, target):
    from backends.native.link import run_scons, write_link_inputs
    kernels = json.loads(bundle["kernels.json"])
    steps = [dag.add(_kernel_step(target, k)) for k in kernels]
    for name in steps:
        dag.g.add_edge(name, params["link_step"])
    objects = dict(zip([k["symbol"] for k in kernels], dag.get_many(steps)))
    name = params["name"]
    library = f"lib{name}.so"
    with tempfile.TemporaryDirectory(prefix="cuvil-link-") as tmp:
        tmp = Path(tmp)
        write_link_inputs(tmp, params["symbol_prefix"], bundle["driver.c"].decode(), bundle["weights.bin"], objects,
                          library, sanitize=params["sanitize"])
        run_scons(tmp)
        lib_bytes = (tmp / library).read_bytes()
    info = json.loads(bundle["info.json"])
    if params["sanitize"]:
        info["sanitize"] = ["address", "undefined"]
    manifest = {**info, "files": {library: hashlib.sha256(lib_bytes).hexdigest(),
                                  f"{name}.h": hashlib.sha256(bundle["header.h"]).hexdigest()}}
    return {library: lib_bytes, f"{name}.h": bundle["header.h"],
            "manifest.json": (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()}


# -- planning --------------------------------------------------------------------------------

def _shape(name, dims) -> list[int]:
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


def spec_hash(model_sha: str, spec: VariantSpec, pass_names) -> str:
    payload = {"model": model_sha, "inputs": {k: list(v) for k, v in sorted(spec.input_shapes.items())},
               "target": spec.target, "precision": spec.precision, "passes": pass_names,
               "threads": spec.threads, "symbol_prefix": spec.symbol_prefix}
    if spec.pass_options:
        payload["pass_options"] = spec.pass_options
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def plan_variant(dag: StepGraph, spec: VariantSpec) -> str:
    """Add the steps of one variant; returns the name of its link step."""
    from backends.native.link import CFLAGS, LDFLAGS
    from backends.native.targets import resolve_target
    from passes import resolve_pass_options, resolve_passes

    if spec.precision not in PRECISIONS_SUPPORTED:
        raise CuvilError(f"model '{spec.name}': precision '{spec.precision}' is not supported yet",
                         hint=f"supported: {', '.join(PRECISIONS_SUPPORTED)}")
    target = resolve_target(spec.target)
    pass_names = resolve_passes(spec.opt_level, spec.passes, spec.disable_passes)
    pass_options = resolve_pass_options(pass_names, spec.pass_options)
    model_bytes, kind = _source_bytes(spec.source)
    model_sha = hashlib.sha256(model_bytes).hexdigest()
    shapes = {k: _shape(k, v) for k, v in sorted(spec.input_shapes.items())}
    base = f"{spec.name}/{spec.target}"
    encode_graph, decode_graph = _graph_codec(dag.cache)

    source_for_import = spec.source
    deps = []
    if kind == "torchscript":
        export = dag.add(Step(f"{base}/export", "export", {"model_sha256": model_sha, "inputs": shapes}, [],
                              lambda d: _run_export(d, spec.source, shapes), bytes, bytes))
        deps = [export]
        importer = lambda d, onnx_bytes: _run_import(d, None, shapes, onnx_bytes)
    elif isinstance(spec.source, (str, os.PathLike)):
        importer = lambda d: _run_import(d, source_for_import, shapes)
    else:
        importer = lambda d: _run_import(d, None, shapes, model_bytes)
    last = dag.add(Step(f"{base}/import", "import", {"model_sha256": model_sha, "inputs": shapes}, deps,
                        importer, encode_graph, decode_graph))
    for k, name in enumerate(pass_names):
        options = pass_options[name]
        # A pass listed again (opt 3 cleans up twice) is a step of its own: name#2, name#3...
        repeat = pass_names[:k].count(name)
        step_name = f"{base}/pass:{name}" + (f"#{repeat + 1}" if repeat else "")
        last = dag.add(Step(step_name, "pass", {"pass": name, "options": options}, [last],
                            lambda d, g, name=name, options=options: _run_pass(d, g, name, options),
                            encode_graph, decode_graph))
    params = {"name": spec.name, "target": target.as_key(), "target_name": spec.target, "precision": spec.precision,
              "threads": spec.threads, "symbol_prefix": spec.symbol_prefix, "passes": pass_names,
              "source_sha256": model_sha, "spec_hash": spec_hash(model_sha, spec, pass_names),
              "max_arena_mb": spec.max_arena_mb}
    if spec.pass_options:
        params["pass_options"] = {k: v for k, v in sorted(spec.pass_options.items()) if k in pass_names}
    if "plan_memory" in pass_names:
        memory = pass_options["plan_memory"]
        params["memory"] = {"strategy": memory["strategy"], "in_place": memory["in_place"]}
    codegen = dag.add(Step(f"{base}/codegen", "codegen", params, [last],
                           lambda d, g: _run_codegen(d, g, params), pack_files, unpack_files))
    link_name = f"{base}/link"
    link_params = {"name": spec.name, "symbol_prefix": spec.symbol_prefix, "cflags": CFLAGS, "ldflags": LDFLAGS,
                   "sanitize": spec.sanitize, "cc": compiler_version(), "target": target.as_key(),
                   "link_step": link_name}
    dag.add(Step(link_name, "link", link_params, [codegen],
                 lambda d, bundle: _run_link(d, bundle, link_params, target), pack_files, unpack_files))
    return link_name


def install(files: dict[str, bytes], out_dir: Path) -> bool:
    """Put files in out_dir: write each to a temporary name and rename it over the old
    one (readers never see half a file); the manifest goes last. Unchanged files are
    not touched. Returns whether anything changed."""
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
                os.chmod(tmp, 0o755 if name.endswith(".so") else 0o644)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            raise CuvilError(f"cannot write {path}: {exc.strerror}",
                             hint="check that the output folder is writable and the disk is not full") from None
        changed = True
    return changed


def _artifacts(files, out_dir, seconds, changed) -> Artifacts:
    lib = next(n for n in files if n.endswith(".so"))
    header = next(n for n in files if n.endswith(".h"))
    info = json.loads(files["manifest.json"])
    info.pop("files", None)
    return Artifacts(out_dir / lib, out_dir / header, out_dir / "manifest.json", info, seconds,
                     info.get("kernels", 0), changed)


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
        files = dag.get(link)
        changed = install(files, Path(out_dir))
        results.append(_artifacts(files, Path(out_dir), time.perf_counter() - start, changed))
    return results, dag


def build_variant(spec: VariantSpec, out_dir: Path, cache: Cache, jobs: int = 1, progress=None) -> Artifacts:
    """Build one variant into out_dir (lib<name>.so, <name>.h, manifest.json)."""
    return build_variants([(spec, Path(out_dir))], cache, jobs=jobs, progress=progress)[0][0]
