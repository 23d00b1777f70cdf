"""The build as a graph of steps, each cached by a key derived from what it depends on.

A step's key is the sha256 of the canonical JSON of its kind, its parameters,
the keys of the steps it reads and the versions of the tools that run it.
Keys are known before anything runs, so evaluation is demand-driven: asking
for a step whose key is in the cache loads its output and runs nothing
upstream of it. Steps may add steps while they run (the link step adds one
step per kernel once the code generator has said which kernels exist).
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import networkx as nx

from .cache import step_key
from .errors import BuildError, CuvilError


@dataclass
class Step:
    name: str                        # unique and readable: "tiny_cnn/native/pass:fold_batchnorm"
    kind: str                        # import | pass | codegen | kernel | link
    params: dict                     # JSON-able: everything but its inputs that changes its output
    deps: list[str]                  # names of the steps whose outputs it reads, in order
    run: Callable[..., Any]          # run(graph, *dep_outputs) -> output
    encode: Callable[[Any], bytes]   # output -> bytes for the cache
    decode: Callable[[bytes], Any]
    parallel: bool = False           # may run in a worker thread beside other such steps
    # expand(graph, *dep_outputs) -> names of the steps `run` will add and read (the link step's
    # kernels): lets a cluster (cluster.py) run those as tasks of their own before this step
    expand: Callable[..., list[str]] | None = None
    # False: the key leaves out the deps' keys, because `params` already name what the step's output
    # is made of (the canonical graph step, keyed by the imported graph's identity: build.py)
    key_deps: bool = True


@dataclass
class StepRecord:
    name: str
    kind: str
    key: str
    status: str      # "ran" | "cached"
    seconds: float
    started: float = 0.0   # seconds after the graph was made (the build's start)
    worker: str = ""       # where it ran: a thread here, or a Dask worker's address


def step_line(record: StepRecord, ran: int, done: int, total: int) -> str:
    """The progress line of a step that ran, as plain output prints it."""
    where = f" on {record.worker}" if "://" in record.worker else ""
    return f"[{ran} ran, {done}/{total} done] {record.name} ({record.seconds:.2f} s{where})"


class StepGraph:
    def __init__(self, cache, versions: dict, progress: Callable[[str], None] | None = None, jobs: int = 1):
        self.g = nx.DiGraph()
        self.cache = cache
        self.versions = versions
        self.progress = progress or (lambda message: None)
        self.jobs = max(1, jobs)
        self.records: dict[str, StepRecord] = {}
        # listener(record, ran, done, total) after each step that ran, instead of a progress line
        self.listener: Callable[[StepRecord, int, int, int], None] | None = None
        self._keys: dict[str, str] = {}
        # last step of a variant -> sha256 of its source file, for the installed manifest (build.py)
        self.source_sha256: dict[str, str] = {}
        self._outputs: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._t0 = time.perf_counter()
        self._ran = 0   # records with status "ran"
        # A step's output is encoded and written to the cache on a writer thread while the steps after
        # it run (hashing and writing release the GIL); the outermost `get` of a thread waits for
        # every write, so when it returns, all it ran is in the cache.
        self._writer: cf.ThreadPoolExecutor | None = None
        self._writes: list[cf.Future] = []
        self._depth = threading.local()
        self.defer_writes = False  # True: the outermost get does not wait; the owner calls flush()

    def fork(self, cache=None) -> "StepGraph":
        """The same steps and keys (shared, so steps added to one are in both) with outputs and
        records of its own: a cluster worker evaluates each task in a fork of its planned graph."""
        forked = StepGraph(self.cache if cache is None else cache, self.versions, jobs=self.jobs)
        forked.g, forked._keys, forked._lock = self.g, self._keys, self._lock
        forked.source_sha256 = self.source_sha256
        return forked

    # -- structure -----------------------------------------------------------------
    def add(self, step: Step) -> str:
        """Add a step (a step of the same name and key is shared, e.g. one kernel used by two models)."""
        with self._lock:
            if step.name in self.g and "step" in self.g.nodes[step.name]:
                return step.name
            self.g.add_node(step.name, step=step)
            for dep in step.deps:
                self.g.add_edge(dep, step.name)
        return step.name

    def step(self, name: str) -> Step:
        return self.g.nodes[name]["step"]

    def check(self) -> None:
        missing = sorted(n for n in self.g if "step" not in self.g.nodes[n])
        if missing:
            raise BuildError(f"steps depend on undefined steps: {missing}")
        try:
            cycle = nx.find_cycle(self.g)
        except nx.NetworkXNoCycle:
            return
        names = " -> ".join([a for a, _ in cycle] + [cycle[0][0]])
        raise BuildError(f"the build graph has a cycle: {names}")

    def key(self, name: str) -> str:
        with self._lock:
            if name not in self._keys:
                step = self.step(name)
                self._keys[name] = step_key({"kind": step.kind, "params": step.params,
                                             "deps": [self.key(d) for d in step.deps] if step.key_deps else [],
                                             "versions": self.versions})
            return self._keys[name]

    # -- evaluation ----------------------------------------------------------------
    def get(self, name: str) -> Any:
        """The output of a step: from memory, from the cache, or by running it."""
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        try:
            return self._get(name)
        finally:
            self._depth.value = depth
            if depth == 0 and not self.defer_writes:
                self.flush()

    def flush(self) -> None:
        """Wait for the cache writes under way (an encoding error is raised here)."""
        while True:
            with self._lock:
                if not self._writes:
                    return
                future = self._writes.pop(0)
            future.result()

    def _write(self, step: Step, key: str, output: Any) -> None:
        with self._lock:
            if self._writer is None:
                self._writer = cf.ThreadPoolExecutor(1, thread_name_prefix="cuvil-cache-writer")
            self._writes.append(self._writer.submit(lambda: self.cache.put(key, step.encode(output))))

    def _get(self, name: str) -> Any:
        with self._lock:
            if name in self._outputs:
                return self._outputs[name]
        step, key = self.step(name), self.key(name)
        start = time.perf_counter()
        data = self.cache.get(key)
        if data is not None:
            try:
                output = step.decode(data)
                self._finish(step, key, "cached", start, output)
                return output
            except Exception as exc:  # an entry we cannot read is a miss, never a failure
                self.progress(f"warning: cache entry for {name} unreadable ({exc}); rebuilding")
        inputs = self.get_many(step.deps)
        start = time.perf_counter()
        output = step.run(self, *inputs)
        self._write(step, key, output)
        self._finish(step, key, "ran", start, output)
        self.announce(name)
        return output

    def announce(self, name: str) -> None:
        """Tell the listener (a live display) or the progress callback that step `name` ran."""
        with self._lock:
            record, ran, done, total = self.records[name], self._ran, len(self.records), len(self.g)
        if self.listener is not None:
            self.listener(record, ran, done, total)
        else:
            self.progress(step_line(record, ran, done, total))

    def get_many(self, names: list[str]) -> list[Any]:
        """Outputs of several steps; those marked parallel run in up to `jobs` threads."""
        parallel = [n for n in names if self.step(n).parallel and n not in self._outputs]
        if self.jobs > 1 and len(parallel) > 1:
            with cf.ThreadPoolExecutor(max_workers=self.jobs) as pool:
                for future in [pool.submit(self.get, n) for n in dict.fromkeys(parallel)]:
                    future.result()
        return [self.get(n) for n in names]

    def _finish(self, step, key, status, start, output):
        with self._lock:
            self._outputs[step.name] = output
            # A step a cluster ran keeps that record when its output is loaded here afterwards.
            if step.name not in self.records:
                self.record(StepRecord(step.name, step.kind, key, status, time.perf_counter() - start,
                                       start - self._t0, threading.current_thread().name))

    def record(self, record: StepRecord) -> None:
        """Note how a step was evaluated (here, or by a cluster worker: cluster.py)."""
        with self._lock:
            previous = self.records.get(record.name)
            self._ran += (record.status == "ran") - (previous is not None and previous.status == "ran")
            self.records[record.name] = record

    def is_cached(self, name: str) -> bool:
        return self.cache.contains(self.key(name))

    # -- reporting -----------------------------------------------------------------
    def report(self) -> dict:
        steps = []
        for name in nx.lexicographical_topological_sort(self.g):
            rec = self.records.get(name)
            if rec is None:  # not needed: something downstream of it was cached
                rec = StepRecord(name, self.step(name).kind, self.key(name), "cached", 0.0)
            steps.append({"name": rec.name, "kind": rec.kind, "key": rec.key, "status": rec.status,
                          "seconds": round(rec.seconds, 4), "started": round(rec.started, 4),
                          "worker": rec.worker})
        return {"steps": steps}

    def summary(self) -> str:
        steps = self.report()["steps"]
        ran = sum(1 for s in steps if s["status"] == "ran")
        return f"ran {ran}, cached {len(steps) - ran}"

    def render(self, fmt: str = "text") -> str:
        order = list(nx.lexicographical_topological_sort(self.g))
        ids = {n: f"s{i}" for i, n in enumerate(order)}
        if fmt == "json":
            import json
            return json.dumps({"steps": [{"name": n, "kind": self.step(n).kind, "key": self.key(n),
                                          "deps": list(self.step(n).deps)} for n in order]}, indent=2)
        if fmt == "dot":
            lines = ["digraph cuvil {", "  rankdir=LR;"]
            lines += [f'  {ids[n]} [label="{n}\\n{self.key(n)[:12]}"];' for n in order]
            lines += [f"  {ids[a]} -> {ids[b]};" for a, b in sorted(self.g.edges)]
            return "\n".join(lines + ["}"])
        if fmt == "mermaid":
            lines = ["graph LR"]
            lines += [f'  {ids[n]}["{n}"]' for n in order]
            lines += [f"  {ids[a]} --> {ids[b]}" for a, b in sorted(self.g.edges)]
            return "\n".join(lines)
        if fmt != "text":
            raise CuvilError(f"unknown graph format {fmt!r}", hint="use text, dot, mermaid or json")
        lines = []
        for n in order:
            deps = self.step(n).deps
            lines.append(f"{n}  [{self.step(n).kind} {self.key(n)[:12]}]" + (f"  <- {', '.join(deps)}" if deps else ""))
        return "\n".join(lines)


def pack_files(files: dict[str, bytes]) -> bytes:
    """Several named byte strings as one cache entry (a JSON index, then the bytes)."""
    import json
    names = sorted(files)
    index = json.dumps([[n, len(files[n])] for n in names]).encode()
    return len(index).to_bytes(8, "little") + index + b"".join(files[n] for n in names)


def unpack_files(data: bytes) -> dict[str, bytes]:
    import json
    size = int.from_bytes(data[:8], "little")
    index = json.loads(data[8:8 + size])
    out, pos = {}, 8 + size
    for name, length in index:
        out[name] = data[pos:pos + length]
        pos += length
    if pos != len(data):
        raise ValueError("file bundle has trailing bytes")
    return out
