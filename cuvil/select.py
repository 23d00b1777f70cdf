"""Measured kernel selection (`select: measure`): per node, the kernel that ran fastest here.

By default the backend picks a node's kernel by shape rules (backends/numba_cpu/winograd.choose:
Winograd F(4x4, 3x3) when the output has enough 4x4 tiles, else F(2x2, 3x3), else direct), which
makes the same library on every machine. With `select: measure` a `select` step after the passes
finds the nodes where more than one kernel applies (conv.kernel_candidates: today the float32
3x3 stride-1 convs the winograd pass marked: winograd_f4, winograd_f2, direct), builds each
candidate as a one-node library (the node with its real shapes and weights, the variant's target
and threads), times the candidates in interleaved rounds and takes the fastest, unless the rules'
kernel is within MARGIN of it.

Timing: each (round, candidate) is one process of the C timing program (cuvil/bench.py: dlopen,
warm-up, `RUNS` timed calls of session_run); a process gives the minimum of its calls, a
candidate the median of its ROUNDS processes. Rounds alternate the candidates, so load that
comes and goes on a shared machine falls on all of them.

Caching: one node's measurement is stored under a key of its content (op, attributes, shapes and
dtypes of its inputs and outputs, which inputs are constant; not the weights' values, which do
not change the time), its candidates, the target, the threads, the CPU model string and the tool
versions, so a rebuild, or a conv of the same shape in another model, is not measured again. The
step's output (node -> kernel and times) is read when the build is planned, and the chosen kernels
go into the codegen step's parameters: the library follows from the choices (two machines that
choose alike build the same bytes), and its manifest records `select` with them.
"""
from __future__ import annotations

import json
import platform
import statistics
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from .cache import step_key
from .config import SELECT_MODES
from .errors import CuvilError

ROUNDS = 3      # interleaved rounds: a candidate's time is the median of its rounds
RUNS = 10       # timed calls per process (after the harness's warm-up); the process gives their minimum
# The rules' kernel stays unless another is this much faster (a fraction of its time): two kernels
# within the noise of a shared machine do not make builds flip between them.
MARGIN = 0.05


def kernel_names() -> tuple[str, ...]:
    """Every kernel name measured selection knows (what `select_candidates` may list)."""
    from backends.numba_cpu.winograd import KERNELS
    return tuple(KERNELS)


def check_options(select: str, candidates, where: str) -> list[str] | None:
    """The candidate list of a variant (None: every applicable kernel), or a CuvilError naming
    what is allowed."""
    if select not in SELECT_MODES:
        raise CuvilError(f"{where}: unknown select {select!r}", hint=f"one of: {', '.join(SELECT_MODES)}")
    if candidates is None:
        return None
    if select != "measure":
        raise CuvilError(f"{where}: select_candidates is given but select is {select!r}",
                         hint="select_candidates restricts what `select: measure` times; set select: measure")
    if isinstance(candidates, str) or not all(isinstance(c, str) for c in candidates):
        raise CuvilError(f"{where}: select_candidates must be a list of kernel names, got {candidates!r}",
                         hint=f"kernel names: {', '.join(kernel_names())}")
    unknown = [c for c in candidates if c not in kernel_names()]
    if unknown or len(candidates) < 2:
        what = f"unknown kernel {unknown[0]!r}" if unknown else "select_candidates needs at least two kernels"
        raise CuvilError(f"{where}: {what}", hint=f"kernel names: {', '.join(kernel_names())}")
    return sorted(set(candidates), key=kernel_names().index)


@lru_cache(maxsize=None)
def cpu_model() -> str:
    """The build machine's CPU model string (/proc/cpuinfo's model name, else the platform's)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def choices_to_measure(graph, allowed) -> list[tuple[object, list[str], str]]:
    """(node, candidates, the kernel the shape rules take) for every node with two or more
    candidates among `allowed` (None: all)."""
    from backends.numba_cpu.conv import kernel_candidates
    found = []
    for node in graph.nodes:
        names, rules = kernel_candidates(node, graph)
        names = [c for c in names if allowed is None or c in allowed]
        if len(names) > 1:
            found.append((node, names, rules))
    return found


def node_content(node, graph) -> dict:
    """What a node's time depends on: op, attributes, shapes and dtypes (no names, no weight values)."""
    def tensor(name):
        if not name:
            return None
        v = graph.values[name]
        return {"shape": list(v.shape), "dtype": str(v.dtype), "const": v.is_const}
    attrs = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(node.attrs.items()) if k != "select"}
    return {"op": node.op, "domain": node.domain, "attrs": json.loads(json.dumps(attrs, default=str)),
            "inputs": [tensor(n) for n in node.inputs], "outputs": [tensor(n) for n in node.outputs]}


def one_node_graph(node, graph, kernel: str):
    """A graph of `node` alone, running on `kernel`: its constants kept, its other inputs the
    graph's inputs, its outputs the graph's outputs."""
    import dataclasses

    from .ir import Graph
    names = [n for n in dict.fromkeys(list(node.inputs) + list(node.outputs)) if n]
    values = {n: dataclasses.replace(graph.values[n]) for n in names}
    single = dataclasses.replace(node, inputs=list(node.inputs), outputs=list(node.outputs),
                                 attrs={**node.attrs, "select": kernel})
    inputs = [n for n in dict.fromkeys(node.inputs) if n and not values[n].is_const]
    return Graph("select", values, [single], inputs, list(node.outputs), graph.opset)


def apply(graph, kernels: dict[str, str]):
    """The graph with each named node's kernel set (node attribute `select`); the graph itself if none."""
    if not kernels:
        return graph
    graph = graph.copy()
    for node in graph.nodes:
        if node.name in kernels:
            node.attrs["select"] = kernels[node.name]
    return graph


def measure(dag, graph, params: dict, compiled) -> dict:
    """The select step: {node name: {"kernel": the fastest, "rules": the shape rules' kernel,
    "times_ms": {candidate: ms}}} for every node with a choice; each node's times from the cache or
    measured (progress lines as it goes). `compiled(dag, target, kernel specs)`: their objects
    (build.compiled_kernels: cached kernel steps)."""
    found = choices_to_measure(graph, params["candidates"])
    results = {}
    for k, (node, names, rules) in enumerate(found, 1):
        key = step_key({"kind": "select-node", "node": node_content(node, graph), "candidates": names,
                        "target": params["target"], "threads": params["threads"], "cpu": params["cpu"],
                        "rounds": ROUNDS, "runs": RUNS, "versions": dag.versions})
        data = dag.cache.get(key)
        times = json.loads(data) if data is not None else None
        if times is None:
            shape = "x".join(str(d) for d in graph.values[node.outputs[0]].shape)
            dag.progress(f"select: measuring {node.name} ({node.op} -> {shape}), {k}/{len(found)}: "
                         f"{', '.join(names)}")
            times = time_candidates(dag, node, graph, names, params, compiled)
            dag.cache.put(key, json.dumps(times, sort_keys=True).encode())
        fastest = pick(names, times, rules)
        results[node.name] = {"kernel": fastest, "rules": rules, "times_ms": {name: times[name] for name in names}}
        dag.progress(f"select: {node.name}: {fastest} (rules: {rules}; "
                     + ", ".join(f"{name} {times[name]:.3f} ms" for name in names) + ")")
    return results


def pick(names: list[str], times: dict[str, float], rules: str | None) -> str:
    """The fastest candidate, unless the rules' kernel is within MARGIN of it (ties: the first)."""
    fastest = min(names, key=lambda name: (times[name], names.index(name)))
    if rules in names and times[rules] <= times[fastest] * (1 + MARGIN):
        return rules
    return fastest


def time_candidates(dag, node, graph, names: list[str], params: dict, compiled) -> dict[str, float]:
    """Milliseconds per call of each candidate's one-node library: the median over ROUNDS
    interleaved rounds of each process's fastest call."""
    from backends.targets import target_from_key

    from .ctime import run_harness
    target = target_from_key(params["target"])
    minima = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="cuvil-select-") as tmp:
        libraries = {name: one_node_library(dag, one_node_graph(node, graph, name), target, params["threads"],
                                            Path(tmp) / name, compiled) for name in names}
        for _ in range(ROUNDS):
            for name in names:
                library, info = libraries[name]
                try:
                    out = run_harness(library, runs=RUNS, warmup=3, info=info).stdout
                except subprocess.CalledProcessError as error:   # the library cannot run here
                    raise CuvilError(f"select: measure: the one-node library of node '{node.name}' ({name}) "
                                     f"did not run on this machine: {(error.stderr or '').strip() or error}",
                                     hint="measured selection runs the candidates: build for a target this "
                                          "machine can run, or use select: rules") from None
                minima[name].append(min(float(t) for t in out.split()) * 1e-6)
    return {name: round(statistics.median(values), 6) for name, values in minima.items()}


def one_node_library(dag, graph, target, threads: int, folder: Path, compiled) -> tuple[Path, dict]:
    """The shared library of a one-node graph (pipeline.plan, generate, link); its kernels from
    `compiled` (the build's cached kernel steps: the winner's are compiled already when the model's
    build wants them)."""
    from . import pipeline
    planned = pipeline.plan(graph, pipeline.VariantParams(graph.name, target, threads))
    info = pipeline.describe(planned, {"name": graph.name, "symbol_prefix": "cuvil_select_"})
    bundle = pipeline.generate(planned, info, "cuvil_select_", threads)
    objects = compiled(dag, target, json.loads(bundle["kernels.json"]))
    files = pipeline.link(graph.name, "cuvil_select_", bundle["driver.c"], bundle["weights.bin"], objects,
                          target=target)
    folder.mkdir(parents=True)
    library = folder / target.library_file(graph.name)
    library.write_bytes(files[library.name])
    return library, info
