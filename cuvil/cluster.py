"""Builds on a Dask cluster: each step of the build graph one task, the step cache between them.

This machine (the client) plans the build as a local build does and walks the
graph from the outputs it wants: a step whose key is in the cache is a leaf,
any other becomes a task that depends on the tasks of its uncached inputs.
Tasks carry names and keys, not data: a worker plans the same graph from the
same BuildSpec once per build (`_planned`), checks that it derives the same
key for the step (same cuvil, numba, llvmlite, C compiler and model bytes,
else the bytes could differ), then evaluates the step exactly as a local build
would (`StepGraph.get`): inputs are read from the shared cache and the output
is written to it. The cache writes are atomic (a temporary name renamed into
place on a folder, one PUT on S3), so a worker killed mid-step leaves no half
entry behind and the scheduler reruns the task on another worker, which finds
either nothing or the whole entry.

A step that adds steps while it runs (the link step: one kernel step per
kernel the code generator made) has an `expand` hook: once its inputs are in
the cache the client adds those steps to its graph, submits them as tasks of
their own (sent along, as the worker cannot know them yet) and then the step
itself, so kernels compile on every worker at once.

The workers need: the same cuvil and tools installed, the model files at the
same paths, and the cache: `cache.url` (an fsspec URL such as s3://bucket/x,
credentials from each worker's environment; each worker keeps its own local
folder in front of it, CUVIL_CACHE_DIR or ~/.cache/cuvil), or without a URL
`cache.dir` on a filesystem every worker mounts at the same path (one
machine's LocalCluster, NFS).
"""
from __future__ import annotations

import collections
import threading
import time
import uuid
from dataclasses import dataclass

from .dag import StepGraph, StepRecord
from .errors import BuildError, CuvilError

_CONNECT_TIMEOUT_S = 15


@dataclass(frozen=True)
class ClusterPlan:
    """What a worker needs to plan the client's graph: the spec, the models and the client's tool versions."""
    token: str
    spec: object                 # config.BuildSpec
    models: tuple | None
    versions: dict
    planner: object              # project.plan_project (pickled by reference: cluster.py stays below project.py)


# -- the client ---------------------------------------------------------------------------------

def connect(address: str):
    """A distributed.Client of the scheduler at `address`; every failure is a CuvilError that says what to do."""
    try:
        from distributed import Client
    except ImportError:
        raise CuvilError("a build on a Dask cluster needs the `distributed` package, which is not installed",
                         hint="pip install 'cuvil[dask]'") from None
    try:
        return Client(address, timeout=_CONNECT_TIMEOUT_S, set_as_default=False)
    except Exception as exc:  # OSError, TimeoutError, ValueError of a malformed address...
        raise CuvilError(f"cannot reach the Dask scheduler at {address!r}: {type(exc).__name__}: {exc}",
                         hint="start one with `dask scheduler` and workers with `dask worker tcp://HOST:8786`, "
                              "then pass its address (tcp://HOST:8786) to --scheduler or executor.address") from None


def run_on_cluster(dag: StepGraph, spec, models, wanted: list[str], address: str, say=None, *, planner,
                   where) -> None:
    """Evaluate the steps `wanted` (and what they need) on the cluster at `address`, filling dag.records;
    their outputs are then in the cache, where `dag.get` reads them. `planner(spec, models, progress=,
    cache=)` plans the graph on a worker; `where(model)` is the config location put before a model's error."""
    if spec.cache.read_only:
        raise CuvilError(f"{spec.path}: a build on a Dask cluster writes every step to the shared cache, "
                         "which is configured read_only",
                         hint="set `cache: read_only: false`, or build locally (without --scheduler)")
    say = say or (lambda message: None)
    client = connect(address)
    try:
        workers = len(client.scheduler_info().get("workers", {}))
        if workers == 0:
            raise CuvilError(f"the Dask scheduler at {address} has no workers: the build would wait forever",
                             hint=f"start some with `dask worker {address}` on the build machines")
        say(f"building on the Dask cluster at {address} ({workers} worker{'s' if workers != 1 else ''})")
        plan = ClusterPlan(_token(), spec, tuple(models) if models else None, dag.versions,
                           planner)
        _ClusterRun(dag, spec, where, client, client.scatter(plan, broadcast=True, hash=False), plan.token, say).run(wanted)
    finally:
        client.close()
    missing = [name for name in wanted if not dag.is_cached(name)]
    if missing:
        raise CuvilError(f"the cluster built {', '.join(missing)} but this machine cannot read the result from "
                         f"its cache ({spec.cache.url or spec.cache.dir})",
                         hint="the workers need a cache this machine shares: set `cache: url:` to an fsspec URL "
                              "(s3://bucket/prefix) or put `cache: dir:` on a filesystem every worker mounts")


def _token() -> str:
    """A build's own name: workers plan afresh for each build (a model file may have changed since the last)."""
    return uuid.uuid4().hex[:16]


class _ClusterRun:
    def __init__(self, dag, spec, where, client, plan_future, token, say):
        from distributed import as_completed
        self.dag, self.spec, self.where, self.client = dag, spec, where, client
        self.plan, self.token, self.say = plan_future, token, say
        self.futures = {}            # step name -> its task
        self.cached = set()          # steps found in the cache: no task
        self.deferred = {}           # expandable step -> its inputs still running
        self.added = set()           # steps added by expanding: sent with their task
        self.pending = as_completed(loop=client.loop)
        # dag.records count from when the graph was made, on this machine's clock
        self.t0_wall = time.time() - (time.perf_counter() - dag._t0)

    def run(self, wanted):
        try:
            for name in wanted:
                self.schedule(name)
            for future in self.pending:
                self.finished(future)
        except BaseException:
            self.client.cancel(list(self.futures.values()))
            raise

    def schedule(self, name) -> bool:
        """Submit the task of `name` and of what it needs; False when it is cached (no task)."""
        if name in self.futures or name in self.deferred:
            return True
        if name in self.cached:
            return False
        if self.dag.is_cached(name):
            self.cached.add(name)
            return False
        step = self.dag.step(name)
        running = [d for d in step.deps if self.schedule(d)]
        if step.expand is not None:
            if running:  # what it adds is known once its inputs are built
                self.deferred[name] = set(running)
                return True
            self.expand(name)
        self.submit(name)
        return True

    def expand(self, name):
        step = self.dag.step(name)
        inputs = [self.load(d) for d in step.deps]
        for added in step.expand(self.dag, *inputs):
            self.added.add(added)
            self.schedule(added)

    def load(self, name):
        if not self.dag.is_cached(name):
            raise CuvilError(f"the output of {name} is not in this machine's cache after the cluster built it",
                             hint="the workers need a cache this machine shares: set `cache: url:` to an fsspec "
                                  "URL (s3://bucket/prefix) or put `cache: dir:` on a filesystem every worker mounts")
        return self.dag.get(name)

    def submit(self, name):
        step, key = self.dag.step(name), self.dag.key(name)
        inputs = [self.futures[d] for d in sorted(self.dag.g.predecessors(name)) if d in self.futures]
        future = self.client.submit(run_step, self.plan, name, key, step if name in self.added else None, *inputs,
                                    key=f"cuvil-{step.kind}-{key[:24]}-{self.token}", pure=False)
        self.futures[name] = future
        self.pending.add(future)

    def located(self, name, message) -> str:
        """A worker's error with the config entry of its model in front (as a local build says it)."""
        model = next((m for m in self.spec.models if name.startswith(m.name + "/")), None)
        where = self.where(model) if model is not None else ""
        return message if message.startswith(where) or message.startswith(str(self.spec.path)) else where + message

    def finished(self, future):
        try:
            result = future.result()
        except Exception as exc:
            name = next((n for n, f in self.futures.items() if f.key == future.key), future.key)
            if isinstance(exc, RuntimeError) and "deserializ" in str(exc):
                raise CuvilError(f"the Dask scheduler at {self.client.scheduler.address} cannot load cuvil's tasks "
                                 f"({str(exc).splitlines()[0]})",
                                 hint="install the same cuvil in the scheduler's environment as in the workers' and "
                                      "this machine's (Dask unpickles each task on the scheduler too)") from None
            if type(exc).__name__ == "KilledWorker":
                raise BuildError(f"step {name} was running on each of the workers that died in a row ({exc}); "
                                 "it is not retried further",
                                 hint="a step that kills its worker (out of memory?) would kill every worker: "
                                      "check the workers' logs and memory limits") from None
            raise
        name = result["name"]
        if "error" in result:
            error = result["error"]
            raise CuvilError(self.located(name, error["message"]), hint=error["hint"])
        self.dag.record(StepRecord(name, self.dag.step(name).kind, self.dag.key(name), result["status"],
                                   result["seconds"], result["started"] - self.t0_wall, result["worker"]))
        if result["status"] == "ran":
            self.dag.announce(name)
        for waiting, inputs in list(self.deferred.items()):
            inputs.discard(name)
            if not inputs:
                del self.deferred[waiting]
                self.expand(waiting)
                self.submit(waiting)


# -- the workers --------------------------------------------------------------------------------

_PLANNED: collections.OrderedDict[str, StepGraph] = collections.OrderedDict()
_PLANNED_LOCK = threading.Lock()
_PLANS_KEPT = 4   # builds of several clients at once each keep their graph


def worker_cache(config):
    """The cache a worker reads and writes: the shared URL behind the worker's own folder, or the folder."""
    from .cache import Cache, RemoteCache, TieredCache, default_cache_dir
    if config.url:
        return TieredCache(Cache(default_cache_dir()), RemoteCache(config.url))
    return Cache(config.dir)


def _planned(plan: ClusterPlan) -> StepGraph:
    with _PLANNED_LOCK:
        if plan.token in _PLANNED:
            _PLANNED.move_to_end(plan.token)
            return _PLANNED[plan.token]
        from .build import tool_versions
        mine = tool_versions()
        differ = sorted(k for k in set(mine) | set(plan.versions) if mine.get(k) != plan.versions.get(k))
        if differ:
            shown = ", ".join(f"{k} {mine.get(k)} (client: {plan.versions.get(k)})" for k in differ)
            raise CuvilError(f"this worker runs other versions than the client: {shown}",
                             hint="install the same cuvil and tools on every worker (a different code fingerprint "
                                  "means a different cuvil source tree)")
        dag, _ = plan.planner(plan.spec, list(plan.models) if plan.models else None, progress=None,
                              cache=worker_cache(plan.spec.cache))
        _PLANNED[plan.token] = dag
        while len(_PLANNED) > _PLANS_KEPT:
            _PLANNED.popitem(last=False)
        return dag


def run_step(plan: ClusterPlan, name: str, key: str, added_step, *inputs_done) -> dict:
    """A task: evaluate step `name` of the planned graph on this worker. A CuvilError comes back as data
    (the client raises it), so it is neither retried nor lost in pickling."""
    try:
        dag = _planned(plan).fork()
        wall0 = time.time() - (time.perf_counter() - dag._t0)   # the fork's records count from its making
        if added_step is not None:
            dag.add(added_step)
        if dag.key(name) != key:
            raise CuvilError(f"step {name} has key {dag.key(name)[:16]} on worker {_worker_address()} but "
                             f"{key[:16]} on the client: the worker sees other inputs",
                             hint="every worker needs the same model files at the same paths and the same C "
                                  "compiler (its `--version` is in the link step's key)")
        dag.get(name)
        record = dag.records[name]
        return {"name": name, "status": record.status, "seconds": record.seconds,
                "started": wall0 + record.started, "worker": _worker_address()}
    except CuvilError as error:
        return {"name": name, "error": {"message": error.message, "hint": error.hint}}


def _worker_address() -> str:
    try:
        from distributed import get_worker
        return get_worker().address
    except (ImportError, ValueError):
        return "local"
