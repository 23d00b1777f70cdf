"""One variant (model x target x precision) from source model to library.

`build_variant` reads top to bottom as the pipeline: import, passes, lower to
kernels, plan memory, compile kernels, generate the driver, link. Artifacts
are assembled in a private folder and moved into place file by file, the
library last but one and the manifest last, so an interrupted build never
leaves a half-written file where a user looks.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backends.native import driver as c_driver
from backends.native.link import run_scons, write_link_inputs
from backends.native.memory import plan_memory
from backends.native.objects import compile_objects, tool_versions
from backends.native.targets import resolve_target
from backends.numba_cpu.kernel import KernelCall
from backends.numba_cpu.registry import lower
from passes import resolve_passes, run_passes

from . import __version__
from .cache import Cache
from .errors import CuvilError, ModelError

PRECISIONS_SUPPORTED = ("fp32",)


@dataclass
class VariantSpec:
    name: str
    source: object                       # path, bytes or onnx.ModelProto
    input_shapes: dict = field(default_factory=dict)
    target: str = "native"
    precision: str = "fp32"
    opt_level: int = 2
    passes: list | None = None
    disable_passes: list = field(default_factory=list)
    threads: int = 1
    symbol_prefix: str = "cuvil_"


@dataclass
class Artifacts:
    library: Path
    header: Path
    manifest: Path
    info: dict
    seconds: float
    kernels: int


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def _import(spec: VariantSpec):
    from .frontends.onnx import import_onnx
    return import_onnx(spec.source, spec.input_shapes)


def _pack_weights(graph, schedule):
    """Lay out every constant a kernel reads (and every build-time packed array)
    in one blob, each 64-byte aligned; returns (blob, offsets by name, schedule
    with packed arrays replaced by names)."""
    blob = bytearray()
    offsets: dict[str, int] = {}
    by_digest: dict[str, str] = {}

    def place(name, arr):
        arr = np.ascontiguousarray(arr)
        digest = hashlib.sha256(arr.dtype.str.encode() + arr.tobytes()).hexdigest()
        if digest in by_digest:  # identical constants are stored once
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
        for i, arg in enumerate(call.args):
            if isinstance(arg, np.ndarray):
                name = f"__packed_{packed}"
                packed += 1
                place(name, arg)
                call.args[i] = name
            elif arg not in offsets and graph.values[arg].is_const:
                place(arg, graph.values[arg].data)
    for name in graph.outputs:  # an output that is a constant is copied from the blob
        if name not in offsets and graph.values[name].is_const:
            place(name, graph.values[name].data)
    # Views of constants read the same bytes.
    return bytes(blob), offsets


def _io(graph, names):
    return [{"name": n, "dtype": _dtype_name(graph.values[n].dtype), "shape": list(graph.values[n].shape)} for n in names]


def spec_hash(model_sha: str, spec: VariantSpec, pass_names) -> str:
    payload = {"model": model_sha, "inputs": {k: list(v) for k, v in sorted(spec.input_shapes.items())},
               "target": spec.target, "precision": spec.precision, "passes": pass_names,
               "threads": spec.threads, "symbol_prefix": spec.symbol_prefix}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_variant(spec: VariantSpec, out_dir: Path, cache: Cache, jobs: int = 1, progress=None) -> Artifacts:
    """Build one variant into out_dir (lib<name>.so, <name>.h, manifest.json)."""
    start = time.perf_counter()
    say = progress or (lambda message: None)
    if spec.precision not in PRECISIONS_SUPPORTED:
        raise CuvilError(f"model '{spec.name}': precision '{spec.precision}' is not supported yet",
                         hint=f"supported: {', '.join(PRECISIONS_SUPPORTED)}")
    target = resolve_target(spec.target)
    pass_names = resolve_passes(spec.opt_level, spec.passes, spec.disable_passes)

    say(f"[{spec.name}] import")
    graph, model_sha = _import(spec)
    graph = run_passes(graph, pass_names)
    schedule = lower(graph)
    weights, weight_offsets = _pack_weights(graph, schedule)
    external = set(graph.inputs) | set(graph.outputs) | set(weight_offsets)
    plan = plan_memory(graph, schedule, external)
    kernels = [c.kernel for c in schedule if isinstance(c, KernelCall)]
    say(f"[{spec.name}] {len(schedule)} steps, {len({k.symbol for k in kernels})} distinct kernels")
    objects = compile_objects(kernels, target, cache, jobs=jobs, progress=lambda m: say(f"[{spec.name}] {m}"))

    info = {
        "abi_version": c_driver.ABI_VERSION,
        "name": spec.name,
        "inputs": _io(graph, graph.inputs),
        "outputs": _io(graph, graph.outputs),
        "target": spec.target,
        "cpu": target.cpu,
        "precision": spec.precision,
        "threads": spec.threads,
        "symbol_prefix": spec.symbol_prefix,
        "passes": pass_names,
        "cuvil_version": __version__,
        "versions": tool_versions(),
        "source_sha256": model_sha,
        "spec_hash": spec_hash(model_sha, spec, pass_names),
        "memory": {"arena_bytes": plan.arena_bytes, "naive_bytes": plan.naive_bytes, "weights_bytes": len(weights)},
        "kernels": len({k.symbol for k in kernels}),
    }
    driver_c = c_driver.generate(graph, schedule, plan, weight_offsets, info, spec.symbol_prefix, spec.threads)
    library = f"lib{spec.name}.so"

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".cuvil-{spec.name}-", dir=out_dir) as tmp:
        tmp = Path(tmp)
        say(f"[{spec.name}] link {library}")
        write_link_inputs(tmp, spec.symbol_prefix, driver_c, weights, objects, library)
        run_scons(tmp)
        (tmp / f"{spec.name}.h").write_text(c_driver.header(spec.symbol_prefix, spec.name, info))
        manifest = {**info, "files": {library: _sha256_file(tmp / library), f"{spec.name}.h": _sha256_file(tmp / f"{spec.name}.h")}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (f"{spec.name}.h", library, "manifest.json"):
            os.replace(tmp / name, out_dir / name)
    return Artifacts(out_dir / library, out_dir / f"{spec.name}.h", out_dir / "manifest.json", info,
                     time.perf_counter() - start, len({k.symbol for k in kernels}))


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
