"""The one path from a model to a library. Every caller goes through it.

    model file  --read_source / export_onnx-->  ONNX bytes           (TorchScript, TensorFlow are exported first)
                --import_model-->               CIR Graph            cuvil/frontends/
                --run_pass, in order-->         rewritten Graph      passes/
                --plan-->                       Planned: kernel calls, weights blob, arena plan
                                                                     backends/numba_cpu lowers, backends/native plans
                --generate-->                   driver.c, header, info (the manifest's figures)
    each kernel --compile_kernel-->             object file          backends/numba_cpu/
                --link-->                       lib<name>.so         backends/native/link.py (SCons)

`cuvil build` runs each arrow as one cached step (build.py); `cuvil explain`,
`cuvil check` and `cuvil graph` call these same functions with the same
parameters (`VariantParams`), so what they report is what the build makes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CuvilError, UnsupportedOpError
from .ops import RANDOM_OPS, RNG_STATE, is_random_dropout

# What the compiler computes in today; config.PRECISIONS are the values cuvil.yaml may name.
# bf16 and fp16: the weight products compute in that precision (passes/assign_precision.py);
# int4: weight-only, the weight matrices quantised to 4 bits by group (passes/quantize_weights.py);
# int8: the float model calibrated and written as QDQ (cuvil/calibrate.py), lowered by fold_qdq.
PRECISIONS_SUPPORTED = ("fp32", "bf16", "fp16", "int4", "int8")
# Precisions whose model is rewritten before import (a calibrate step), not by a pass.
CALIBRATED = ("int8",)
# Weight-only precisions: the pass that quantises the weights runs first, with these bits.
WEIGHT_ONLY_BITS = {"int4": 4}
# What the CUDA targets build: bf16 / fp16 weight products on tensor cores (docs/cuda.md).
GPU_PRECISIONS = ("fp32", "bf16", "fp16")

TORCHSCRIPT_SUFFIXES = (".pt", ".pth")


# -- the source --------------------------------------------------------------------------------

def source_kind(path) -> str:
    """'onnx', 'torchscript' or 'tensorflow', from a model path's suffix (a folder: a SavedModel)."""
    from .frontends import tensorflow
    path = Path(path)
    if path.is_dir() and not tensorflow.is_savedmodel(path):
        raise CuvilError(f"{path} is a folder but not a TensorFlow SavedModel (it has no saved_model.pb)",
                         hint="a model source is an .onnx, .pt/.pth, .keras/.h5 or frozen .pb file, "
                              "or a SavedModel folder")
    if tensorflow.is_tensorflow_source(path):
        return "tensorflow"
    return "torchscript" if path.suffix.lower() in TORCHSCRIPT_SUFFIXES else "onnx"


def read_source(source) -> tuple[bytes, str]:
    """The model's bytes and its kind ('onnx', 'torchscript' or 'tensorflow'): a path, bytes or an
    onnx.ModelProto. A TensorFlow SavedModel folder's "bytes" list its files' hashes."""
    if isinstance(source, bytes):
        return source, "onnx"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise CuvilError(f"model file not found: {path}")
        kind = source_kind(path)
        if kind == "tensorflow":
            from .frontends.tensorflow import source_bytes
            return source_bytes(path), kind
        return path.read_bytes(), kind
    import onnx
    if isinstance(source, onnx.ModelProto):
        return source.SerializeToString(), "onnx"
    raise CuvilError(f"cannot build a model from {type(source).__name__}")


def export_onnx(source, input_shapes: dict, signature: str | None = None) -> bytes:
    """A TorchScript file or torch module (cuvil/frontends/torch.py), or a TensorFlow source
    (cuvil/frontends/tensorflow.py; `signature` picks a SavedModel's signature), as ONNX bytes."""
    from .frontends import tensorflow
    if tensorflow.is_tensorflow_source(source):
        return tensorflow.to_onnx_proto(source, input_shapes, signature).SerializeToString()
    from .frontends.torch import to_onnx_proto
    return to_onnx_proto(source, input_shapes).SerializeToString()


def exported_kind(kind: str) -> bool:
    """Whether a source of this kind is exported to ONNX before the import."""
    return kind in ("torchscript", "tensorflow")


def has_kernel(domain: str, op: str) -> bool:
    """Whether cuvil compiles the op as it is; the import expands the others into
    their ONNX function bodies where they have one (frontends/expand.py)."""
    from backends.numba_cpu.registry import DOMAIN_GENERATORS, GENERATORS

    from .ops import CONTROL_OPS, FUSED_DOMAIN, FUSED_OPS
    if domain == FUSED_DOMAIN:
        return op in FUSED_OPS or op in CONTROL_OPS
    if (domain, op) in DOMAIN_GENERATORS:
        return True
    return domain in ("", "ai.onnx") and op in GENERATORS


def import_model(source, input_shapes: dict):
    """CIR of an ONNX model (a path, bytes or onnx.ModelProto), shapes made static."""
    from .frontends.onnx import import_onnx
    graph, _ = import_onnx(source, input_shapes, has_kernel=has_kernel)
    return graph


def import_any(source, input_shapes: dict, signature: str | None = None):
    """CIR of any source a variant may name: TorchScript and TensorFlow sources are exported to ONNX first."""
    if isinstance(source, (str, os.PathLike)) and exported_kind(source_kind(source)):
        return import_model(export_onnx(source, input_shapes, signature), input_shapes)
    return import_model(source, input_shapes)


def calibrated_source(source, input_shapes: dict, precision: str, calibration: dict | None = None,
                      signature: str | None = None):
    """The source as the variant imports it: for int8 the float model calibrated and written as
    QDQ ONNX bytes (cuvil/calibrate.py; `cuvil build` caches this as its calibrate step)."""
    if precision not in CALIBRATED:
        return source
    from .calibrate import quantize_model
    data, kind = read_source(source)
    if exported_kind(kind):
        data = export_onnx(source, input_shapes, signature)
    return quantize_model(data, input_shapes, calibration or {})


# -- passes ------------------------------------------------------------------------------------

# Passes whose rewrites only the CPU backend lowers (x86 kernels for the fused or transformed
# ops they make): a GPU target's default pass list leaves them out.
CPU_ONLY_PASSES = ("winograd", "fuse_depthwise_block", "fold_qdq", "fuse_conv_prologue")
# Passes float32 builds only run: assign_precision marks Conv nodes for bf16 / fp16 / int8, not the
# PrologueConv this one makes (the reduced-precision convs keep their separate elementwise step).
FP32_ONLY_PASSES = ("fuse_conv_prologue",)


# An fp16 build leaves the winograd pass out of the opt level's list (an explicit `passes:` list
# that names it keeps it): its Winograd convs would compute in float32 on weights transformed at
# load time, 16/9-4x the convs' float32 weights, next to the 16-bit copy the library holds
# (ResNet-50 with enable_fp16=True peaked at 167 MB resident with it and 62 MB without, a C
# program, benchmarks/resident.py). A bf16 build keeps it: its 3x3 stride-1 convs run as bf16
# Winograd F(2x2, 3x3) (backends/numba_cpu/winograd_bf16.py: U in bf16, packed at build time in
# place of W, GEMMs on vdpbf16ps), faster than the direct bf16 conv and within 1.5-1.7x its error.
REDUCED_WITHOUT_WINOGRAD = ("fp16",)

# A bf16 build fuses every depthwise block, however small its tensors (fuse_depthwise_block's
# min_bytes 0, unless the variant's pass_options set it): its DepthwiseBlock runs both 1x1 convs
# on the bf16 micro-kernel with u passed in channel pairs (backends/numba_cpu/dwblock.py), where the
# separate convs copy each 1x1 conv's input into pairs (ConvPad_pairs16) and round t and u to bf16
# in memory. MobileNetV2 at 224, AMD Zen 5, 1 thread: see docs/performance.md (2026-12-07).
FUSE_ALL_BLOCKS = ("bf16",)


def pass_list(opt_level: int, passes=None, disable_passes=(), pass_options=None,
              precision: str = "fp32", gpu: bool = False) -> tuple[list[str], dict]:
    """The passes a variant runs, in order, and each one's options (defaults filled in). A reduced
    precision adds assign_precision at the end, with the precision among its options; fp16 leaves
    out winograd unless `passes` names it (REDUCED_WITHOUT_WINOGRAD), bf16 fuses every depthwise block
    (FUSE_ALL_BLOCKS); a weight-only one, int4, adds
    quantize_weights first instead of assign_precision; a GPU target leaves out CPU_ONLY_PASSES and
    keeps every activation float32 (assign_precision's narrow_activations off)."""
    from passes import resolve_pass_options, resolve_passes
    names = resolve_passes(opt_level, passes, disable_passes)
    if gpu:
        names = [n for n in names if n not in CPU_ONLY_PASSES]
    if precision != "fp32":
        names = [n for n in names if n not in FP32_ONLY_PASSES]
    if precision in REDUCED_WITHOUT_WINOGRAD and passes is None:
        names = [n for n in names if n != "winograd"]
    options = dict(pass_options or {})
    if precision in WEIGHT_ONLY_BITS:
        if "quantize_weights" not in names:
            names.insert(0, "quantize_weights")
        options["quantize_weights"] = {**options.get("quantize_weights", {}), "bits": WEIGHT_ONLY_BITS[precision]}
    elif precision not in ("fp32", *CALIBRATED) and "assign_precision" not in names:
        names.append("assign_precision")
    if precision in FUSE_ALL_BLOCKS and "fuse_depthwise_block" in names:
        options["fuse_depthwise_block"] = {"min_bytes": 0, **options.get("fuse_depthwise_block", {})}
    if "assign_precision" in names:
        options["assign_precision"] = {**options.get("assign_precision", {}), "precision": precision}
        if gpu:   # the GPU kernels read and write float32 activations only (docs/cuda.md)
            options["assign_precision"]["narrow_activations"] = False
    return names, resolve_pass_options(names, options)


# Pass options that name nodes: a variant that sets them keeps the file's node names (it is keyed
# by its file, not by its imported graph's semantic identity: cuvil/semantic.py).
NODE_NAMING_OPTIONS = ("keep_fp32",)


def keyed_by_graph(pass_options: dict) -> bool:
    """Whether a variant's steps after the import read the canonical graph and are keyed by its
    identity (semantic.py): unless a pass option names nodes, which only the file's names match."""
    return not any(options.get(key) for options in (pass_options or {}).values() for key in NODE_NAMING_OPTIONS)


def canonical_graph(graph, pass_options: dict):
    """The graph the passes of a variant with `pass_options` read (what the build's do)."""
    if not keyed_by_graph(pass_options):
        return graph
    from .semantic import canonical
    return canonical(graph)


def run_pass(graph, name: str, options: dict):
    from passes import run_pass as run
    return run(name, graph, options)


def run_passes(graph, names: list[str], options: dict, on_pass=None):
    """Each pass in turn; `on_pass(name, before, after)` sees every stage (explain)."""
    from passes import run_passes as run
    return run(graph, names, on_pass=on_pass, options=options)


def memory_options(names: list[str], options: dict) -> dict:
    """How codegen places buffers: the plan_memory pass's options, or every buffer apart
    without that pass (see passes/plan_memory.py)."""
    if "plan_memory" in names:
        return {"strategy": options["plan_memory"]["strategy"], "in_place": options["plan_memory"]["in_place"]}
    return {"strategy": "none", "in_place": False}


# -- the variant -------------------------------------------------------------------------------

def resolve_variant_target(target: str, precision: str):
    """The CpuTarget a (target, precision) builds for, or the CuvilError that `cuvil build` and
    `cuvil check` both give for what cannot be built yet (CUDA targets, reduced precision)."""
    from backends.targets import resolve_target
    if precision not in PRECISIONS_SUPPORTED:
        raise UnsupportedOpError(f"precision '{precision}' is not supported yet",
                                 hint=f"supported: {', '.join(PRECISIONS_SUPPORTED)}")
    resolved = resolve_target(target)
    from backends.targets import is_cuda
    if is_cuda(resolved) and precision not in GPU_PRECISIONS:
        raise UnsupportedOpError(f"precision '{precision}' is not supported yet for CUDA targets ('{target}')",
                                 hint=f"build CUDA targets in {', '.join(GPU_PRECISIONS)}; int4/int8 run on the CPU targets")
    return resolved


def is_gpu(target) -> bool:
    from backends.targets import is_cuda
    return is_cuda(target)


@dataclass(frozen=True)
class VariantParams:
    """Everything lowering and planning depend on (the codegen step's parameters)."""
    name: str
    target: object                 # backends.targets.CpuTarget
    threads: int = 1
    memory: dict = field(default_factory=lambda: {"strategy": "none", "in_place": False})
    max_arena_mb: int | None = None  # None: no limit (a build sets one)


@dataclass
class Planned:
    """A graph lowered to kernel calls, with its weights packed and its arena planned."""
    graph: object
    schedule: list                 # KernelCall | View, in run order
    weights: bytes
    weight_offsets: dict[str, int]
    arena: object                  # backends.native.memory.MemoryPlan
    target: object = None          # the backends.targets.CpuTarget it was lowered for

    @property
    def calls(self) -> list:
        from backends.schedule import kernel_calls
        return kernel_calls(self.schedule)

    @property
    def kernels(self) -> dict:
        """symbol -> Kernel, each distinct kernel once."""
        return {call.kernel.symbol: call.kernel for call in self.calls}

    def figures(self) -> dict:
        """The memory figures the manifest, `cuvil inspect`, `explain` and `check` all show."""
        return {"arena_bytes": self.arena.arena_bytes, "naive_bytes": self.arena.naive_bytes,
                "weights_bytes": len(self.weights), "shared_bytes": self.arena.shared_bytes}


def lower(graph, target, threads: int = 1) -> list:
    """The graph's kernel calls and views for a session of `threads` threads on `target` (a GPU
    target's kernels: backends/numba_cuda/). The lowering adds its scratch values to `graph`: give
    it a graph nobody else reads (`plan` lowers a copy)."""
    if is_gpu(target):
        from backends.numba_cuda.registry import lower as lower_gpu
        strings = [v.name for v in graph.values.values() if getattr(v.dtype, "kind", "") == "O"]
        if strings:
            raise UnsupportedOpError(f"'{strings[0]}' is a string tensor, and CUDA targets have no string kernels",
                                     hint="build the model for a CPU target (docs/strings.md)")
        random = [n for n in graph.nodes if n.op in RANDOM_OPS or is_random_dropout(n, graph)]
        if random:
            raise UnsupportedOpError(f"node '{random[0].name}' ({random[0].op}) draws random numbers, and CUDA "
                                     "targets have no random-number kernels (the session's generator state is "
                                     "CPU-only)", hint="build the model for a CPU target, or remove the random op")
        return lower_gpu(graph, target)
    from backends.numba_cpu.registry import lower as lower_graph
    return lower_graph(graph, threads, target=target)


def plan(graph, params: VariantParams, blob=None) -> Planned:
    """Lower the graph, pack the weights and plan the arena: what codegen generates the driver
    from, and what explain and check report. With `blob` (backends/native/weights.Blob) the
    weights go into that shared blob (a generation library's entries)."""
    from backends.native.memory import place_shared_values, plan_arena, shared_values
    from backends.native.weights import pack_weights
    from backends.targets import check_memory, check_threads

    check_threads(params.target, params.threads)
    # Lowering adds its scratch values to the graph it lowers. The graph given is a step's output,
    # which the step cache's writer thread may be encoding right now (dag.StepGraph._write): lower a
    # copy, so that encoding never sees the table change under it and the cached graph never holds
    # scratch values.
    graph = graph.copy()
    schedule = lower(graph, params.target, params.threads)
    weights, weight_offsets = pack_weights(graph, schedule, blob)
    shared = shared_values(schedule)
    # the dims of data-dependent shapes live in the session (driver.dims_slots), not in the arena
    dims = {v.shape_from for v in graph.values.values() if v.shape_from is not None}
    # so does the generator state of unseeded random ops (driver: s->rng)
    external = set(graph.inputs) | set(graph.outputs) | set(weight_offsets) | set(shared) | dims | {RNG_STATE}
    arena = plan_arena(graph, schedule, external, strategy=params.memory["strategy"],
                       in_place=params.memory["in_place"])
    place_shared_values(arena, graph, shared)
    if params.max_arena_mb is not None and arena.arena_bytes > params.max_arena_mb << 20:
        raise CuvilError(f"model '{params.name}': a session would need {arena.arena_bytes / 2**20:.1f} MiB of working "
                         f"memory, over the limit of {params.max_arena_mb} MiB",
                         hint="check the input shapes, or raise max_arena_mb in cuvil.yaml")
    check_memory(params.target, len(weights), arena.arena_bytes + arena.shared_bytes)
    return Planned(graph, schedule, weights, weight_offsets, arena, params.target)


def _io(graph, names) -> list[dict]:
    import numpy as np
    # "dynamic": the shape depends on the data; "shape" is then its upper bound (docs/dynamic_shapes.md)
    # "string": an array of char pointers (docs/strings.md)
    def dtype_name(dtype):
        return "string" if np.dtype(dtype) == np.dtype(object) else np.dtype(dtype).name
    return [{"name": n, "dtype": dtype_name(graph.values[n].dtype), "shape": list(graph.values[n].shape),
             **({"dynamic": True} if graph.values[n].shape_from is not None else {})}
            for n in names]


def describe(planned: Planned, provenance: dict) -> dict:
    """The library's description (its info JSON and manifest): tensors, figures, and the
    provenance the caller gives (name, target, precision, passes, versions, hashes...)."""
    from backends.native.driver import ABI_VERSION
    graph = planned.graph
    return {"abi_version": ABI_VERSION, **provenance,
            "inputs": _io(graph, graph.inputs), "outputs": _io(graph, graph.outputs),
            # sequence / optional inputs and outputs as their tensors (docs/sequences.md); absent otherwise
            **({"structure": graph.structure} if graph.structure else {}),
            "memory": planned.figures(), "kernels": len(planned.kernels), "steps": len(planned.calls)}


def generate(planned: Planned, info: dict, symbol_prefix: str, threads: int) -> dict[str, bytes]:
    """The C driver, the weights blob, the header, the info and the kernel list to compile."""
    from backends.native import driver, driver_cuda
    from backends.targets import required_features
    if is_gpu(planned.target):
        driver_c = driver_cuda.generate(planned.graph, planned.schedule, planned.arena, planned.weight_offsets,
                                        len(planned.weights), info, symbol_prefix, planned.target)
        header = driver_cuda.header(symbol_prefix, info["name"], info)
    else:
        driver_c = driver.generate(planned.graph, planned.schedule, planned.arena, planned.weight_offsets, info,
                                   symbol_prefix, threads, required_features(planned.target), planned.target.arch)
        header = driver.header(symbol_prefix, info["name"], info)
    # C kernels (string ops) are defined in the driver itself: nothing to compile apart
    kernels = sorted((k.as_spec() for k in planned.kernels.values() if k.language == "numba"),
                     key=lambda k: k["symbol"])
    return {"driver.c": driver_c.encode(), "weights.bin": planned.weights,
            "header.h": header.encode(),
            "info.json": json.dumps(info, sort_keys=True).encode(), "kernels.json": json.dumps(kernels).encode()}


# -- generation libraries (a decoder's prefill and decode entries, cuvil/generation.py) --------

def plan_generation(graphs: list, params: VariantParams, layout) -> list[Planned]:
    """Each entry's graph planned like `plan`, all their weights in one blob (identical arrays once:
    the weights are stored once for every entry) and each entry's run-once values in a block of
    its own; the arena of a session is the largest entry's (one entry runs at a time). A prefill
    entry computes the logits of the prompt's last row only (generation.last_row_logits)."""
    from .generation import last_row_logits
    graphs = [g if tokens == 1 else last_row_logits(g, layout) for g, tokens in zip(graphs, layout.entries)]
    if is_gpu(params.target):
        raise UnsupportedOpError(f"model '{params.name}': generation libraries (generate:) build for CPU targets only",
                                 hint="build the decoder for a CPU target")
    return plan_entries(graphs, params)


def plan_entries(graphs: list, params: VariantParams) -> list[Planned]:
    """Several graphs of one library (a generation library's entries, batch buckets) planned like
    `plan`, their weights in one blob: each constant matrix packed in the one layout every row
    count reads (kernel.sharing_weights) and identical arrays stored once; each entry's run-once
    values in a block of its own."""
    from backends.native.weights import Blob
    from backends.numba_cpu.kernel import sharing_weights
    blob = Blob()
    planned, shared_base = [], 0
    for graph in graphs:
        with sharing_weights():     # one packed layout of each weight for every entry's row count
            entry = plan(graph, params, blob)
        entry.arena.shared = {name: offset + shared_base for name, offset in entry.arena.shared.items()}
        shared_base += entry.arena.shared_bytes
        planned.append(entry)
    weights = bytes(blob.data)
    blob.data = bytearray()          # the one copy left is `weights`
    for entry in planned:
        entry.weights = weights
    return planned


def describe_generation(planned: list[Planned], layout, provenance: dict) -> dict:
    """The description of a generation library: the decode entry's tensors (what session_run
    takes), the memory figures (the largest arena, the weights once, the KV cache) and the entries."""
    from backends.native.generation import state_regions
    from backends.native.driver import Entry
    info = describe(planned[0], provenance)
    _, kv_bytes = state_regions([Entry(p.graph, p.schedule, p.arena, p.weight_offsets) for p in planned], layout)
    vocab = planned[0].graph.values[layout.logits].shape[-1]
    info["memory"]["arena_bytes"] = max(p.arena.arena_bytes for p in planned)
    info["memory"]["naive_bytes"] = max(p.arena.naive_bytes for p in planned)
    info["memory"]["shared_bytes"] = sum(p.arena.shared_bytes for p in planned)
    info["memory"]["kv_cache_bytes"] = kv_bytes
    info["kernels"] = len({s for p in planned for s in p.kernels})
    info["steps"] = sum(len(p.calls) for p in planned)
    info["generate"] = {"max_context": layout.max_context, "prefill_buckets": list(layout.buckets),
                        "vocab_size": int(vocab), "pad_token": layout.pad_token, "eos_tokens": list(layout.eos_tokens),
                        "entries": [{"tokens": t, "arena_bytes": p.arena.arena_bytes, "steps": len(p.calls),
                                     "logits_rows": p.graph.values[layout.logits].shape[1]}
                                    for t, p in zip(layout.entries, planned)]}
    return info


def generate_generation(planned: list[Planned], layout, info: dict, symbol_prefix: str, threads: int) -> dict[str, bytes]:
    """The files of a generation library's codegen (as `generate`): one driver with a run function per
    entry and the generation ABI (backends/native/generation.py), one weights blob."""
    from backends.native import driver, generation
    from backends.targets import required_features
    entries = [driver.Entry(p.graph, p.schedule, p.arena, p.weight_offsets) for p in planned]
    vocab = info["generate"]["vocab_size"]
    pieces = generation.generation_c(symbol_prefix, entries, layout, vocab)
    target = planned[0].target
    driver_c = driver.generate_entries(entries, 0, info, symbol_prefix, threads, required_features(target),
                                       target.arch, **pieces)
    header = driver.header(symbol_prefix, info["name"], info, generation.header_section(symbol_prefix, layout, vocab))
    kernels = {}
    for p in planned:
        kernels.update(p.kernels)
    specs = sorted((k.as_spec() for k in kernels.values()), key=lambda k: k["symbol"])
    return {"driver.c": driver_c.encode(), "weights.bin": planned[0].weights, "header.h": header.encode(),
            "info.json": json.dumps(info, sort_keys=True).encode(), "kernels.json": json.dumps(specs).encode()}


# -- batch buckets (one entry per batch size, cuvil/batching.py) -------------------------------

def plan_batched(graphs: list, params: VariantParams, batches) -> list[Planned]:
    """Each bucket's graph planned (`plan_entries`), after checking that dim 0 of every input and
    output is the batch."""
    from .batching import check_entries
    if is_gpu(params.target):
        raise UnsupportedOpError(f"model '{params.name}': batch buckets build for CPU targets only",
                                 hint="build one library per batch size for a GPU target")
    check_entries(graphs, batches, params.name)
    return plan_entries(graphs, params)


def describe_batched(planned: list[Planned], batches, provenance: dict) -> dict:
    """The description of a library with batch buckets: the largest bucket's tensors (what
    session_run takes), the memory figures (the largest arena, the weights once) and the buckets."""
    info = describe(planned[-1], provenance)
    info["memory"]["arena_bytes"] = max(p.arena.arena_bytes for p in planned)
    info["memory"]["naive_bytes"] = max(p.arena.naive_bytes for p in planned)
    info["memory"]["shared_bytes"] = sum(p.arena.shared_bytes for p in planned)
    info["kernels"] = len({s for p in planned for s in p.kernels})
    info["steps"] = sum(len(p.calls) for p in planned)
    info["batch"] = {"axis": 0, "buckets": list(batches),
                     "entries": [{"batch": b, "arena_bytes": p.arena.arena_bytes, "steps": len(p.calls)}
                                 for b, p in zip(batches, planned)]}
    return info


def generate_batched(planned: list[Planned], batches, info: dict, symbol_prefix: str, threads: int) -> dict[str, bytes]:
    """The files of a batch-bucket library's codegen (as `generate`): one driver with a run function
    per bucket, session_run on the largest, session_run_batch (backends/native/batching.py)."""
    from backends.native import batching, driver
    from backends.targets import required_features
    entries = [driver.Entry(p.graph, p.schedule, p.arena, p.weight_offsets) for p in planned]
    pieces = batching.batching_c(symbol_prefix, entries, list(batches))
    target = planned[0].target
    driver_c = driver.generate_entries(entries, len(entries) - 1, info, symbol_prefix, threads,
                                       required_features(target), target.arch, **pieces)
    header = driver.header(symbol_prefix, info["name"], info, batching.header_section(symbol_prefix, list(batches)))
    kernels = {}
    for p in planned:
        kernels.update(p.kernels)
    specs = sorted((k.as_spec() for k in kernels.values()), key=lambda k: k["symbol"])
    return {"driver.c": driver_c.encode(), "weights.bin": planned[0].weights, "header.h": header.encode(),
            "info.json": json.dumps(info, sort_keys=True).encode(), "kernels.json": json.dumps(specs).encode()}


def compile_kernel(spec: dict, target) -> bytes:
    """One kernel (a kernels.json entry) as an object file for a CPU target, or as a fatbin
    (machine code + PTX) for a GPU target."""
    from backends.schedule import Kernel
    from backends.numba_cpu.objects import compile_object
    if is_gpu(target):
        return compile_object(Kernel.from_spec(spec), target, kind=("backends.numba_cuda.worker", {}))
    return compile_object(Kernel.from_spec(spec), target)


def link(name: str, symbol_prefix: str, driver_c: bytes, weights: bytes, objects: dict[str, bytes],
         sanitize: bool = False, gpu: bool = False, mode: str = "shared", target=None, cache=None) -> dict[str, bytes]:
    """The driver, the weights and the kernel objects linked by SCons (for a GPU target `objects`
    are the kernels' fatbins, embedded as data) into `lib<name>.so` (mode "shared"; `<name>.dll` and
    its import library `lib<name>.dll.a` for Windows), the static archive `lib<name>.a` ("static")
    or both ("both"): {file name: bytes}. The C compiler is the target's (backends/targets.py
    c_compiler: a cross gcc for the cross targets). With the step `cache`, a link whose inputs differ
    from an earlier one's only in the weights' data is spliced from it (backends/native/relink.py)."""
    import tempfile

    from backends.native.link import link_files
    from backends.targets import c_compiler, cross_toolchain
    toolchain = cross_toolchain(target)
    tools = {"cc": c_compiler(target)} if toolchain else {}
    if getattr(target, "system", "linux") == "windows":   # a DLL and its import library lib<name>.dll.a
        if mode != "shared":
            raise CuvilError(f"model '{name}': link: {mode} is not supported for the Windows target",
                             hint="link: shared builds <name>.dll and its import library lib<name>.dll.a")
        tools.update(system="windows", import_library=f"lib{name}.dll.a", libs=("m", "pthread"))
    if getattr(target, "system", "linux") == "wasm":   # <name>.wasm, linked by clang + wasm-ld (targets.check_link)
        tools.update(system="wasm", libs=("m",))
    library = (target.library_file(name) if target is not None else f"lib{name}.so") if mode in ("shared", "both") else None
    archive = f"lib{name}.a" if mode in ("static", "both") else None
    kernels, fatbins = ({}, objects) if gpu else (objects, None)
    with tempfile.TemporaryDirectory(prefix="cuvil-link-") as tmp:
        tmp = Path(tmp)
        return link_files(tmp, symbol_prefix, driver_c.decode(), weights, kernels, library, cache=cache,
                          sanitize=sanitize, fatbins=fatbins, archive=archive, **tools)


# -- check -------------------------------------------------------------------------------------

def lowering_problems(graph, gpu: bool = False) -> list[str]:
    """One line per node that cannot be lowered to kernels (lowering only writes kernel source,
    so this is cheap), naming the node, its op and why; for the GPU targets' kernels with `gpu`."""
    from backends.numba_cpu.registry import generator_for
    if gpu:
        from backends.numba_cuda.registry import gpu_problem
        problems = []
        for node in graph.nodes:
            if not has_kernel(node.domain, node.op):
                problem = f"no kernel generator for op {node.op}"
            else:
                problem = gpu_problem(node, graph)
            if problem:
                problems.append(f"node '{node.name}' ({node.op}): {problem}")
        return problems
    problems = []
    for node in graph.nodes:
        problem = None
        if not has_kernel(node.domain, node.op):
            problem = (f"no kernel generator for op {node.op}" if node.domain in ("", "ai.onnx")
                       else f"op {node.domain}::{node.op} is outside the default ONNX domain")
        else:
            try:
                generator_for(node)(node, graph)
            except NotImplementedError:
                problem = f"the kernel generator for {node.op} is not written yet"
            except UnsupportedOpError as error:  # an attribute or dtype the generator does not cover
                problem = error.message
        if problem:
            problems.append(f"node '{node.name}' ({node.op}): {problem}")
    return problems


# Quantised ops and what cuvil runs them with (`cuvil check` names every one that is not integer).
INTEGER_PRODUCTS = ("MatMulInteger", "QLinearMatMul", "ConvInteger", "QLinearConv", "FusedMatMulInteger")


def quantised_fallbacks(planned) -> list[str]:
    """One line per quantised op of a lowered graph that does not run on an int8 kernel, and what it
    runs as instead: an integer product the target or its operands give no int8 kernel (exact
    scalar loops), or float32 ops between a DequantizeLinear and a QuantizeLinear that
    passes/fold_qdq.py could not make integer (they compute in float32, as onnxruntime's
    unoptimised graph does). A DequantizeLinear writing a graph output is the model's boundary,
    not a fallback."""
    graph = planned.graph
    labels: dict[str, set] = {}
    for call in planned.calls:
        labels.setdefault(call.node, set()).add(call.precision or "")
    consumers = graph.consumers()
    lines = []
    for node in graph.nodes:
        if node.op in INTEGER_PRODUCTS and not any(label.startswith("int8") for label in labels.get(node.name, ())):
            float_form = any(label.startswith("float32") for label in labels.get(node.name, ()))
            lines.append(f"node '{node.name}' ({node.op}): no int8 kernel for it on this target (AVX512-VNNI, "
                         f"constant weights and scales); runs as "
                         + ("float32 in its QDQ form (dequantise, float conv, quantise)" if float_form
                            else "exact scalar integer loops"))
        elif node.op == "DequantizeLinear" and node.outputs[0] not in graph.outputs \
                and not graph.values[node.inputs[0]].is_const:
            readers = sorted({n.op for n in consumers.get(node.outputs[0], [])})
            lines.append(f"node '{node.name}' (DequantizeLinear): its readers ({', '.join(readers)}) run in float32 "
                         f"on the dequantised tensor (not folded into an integer op)")
        elif node.op == "DynamicQuantizeLinear" and not any(
                n.op in ("FusedMatMulInteger", "MatMulInteger") for n in consumers.get(node.outputs[0], [])):
            lines.append(f"node '{node.name}' (DynamicQuantizeLinear): quantises for ops that run in float32")
    return lines
