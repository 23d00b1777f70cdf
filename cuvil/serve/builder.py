"""Builds and diff hashes for the server, run in a separate process.

The server process never imports the compiler: `Builder` keeps one spawned
worker process that does (once, so later builds do not pay for the imports),
and runs there `project.build_project` for one model, or the hash of a model
source that decides whether a watched change needs a rebuild at all:

- syntactic: the sha256 of the file's bytes;
- semantic: a hash of the imported graph (cuvil's CIR after the frontend:
  constants folded, static shapes) that is blind to value and node names and
  to node order (cuvil/semantic.py graph_hash, which also keys the build's
  steps after the import). A re-export that renames internal values or
  reorders nodes hashes the same; a changed weight, op or attribute does not.

Either hash is combined with the model's settings in cuvil.yaml (all but
`serve:`), so a changed `threads:` or pass list also rebuilds.

A worker that dies is replaced on the next call. Errors come back as
`BuildFailed` carrying the message the CLI would print.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path


from ..errors import CuvilError
from ..semantic import graph_hash  # noqa: F401  (the one semantic hash: the build's step keys use it too)



class BuildFailed(CuvilError):
    """A build or a diff hash failed in the worker; the message is the worker's error."""


def _sha(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# --- run in the worker process

def _source_hash(model, diff_mode: str) -> str:
    if diff_mode == "syntactic":
        from ..pipeline import read_source   # a SavedModel folder: its files' hashes
        digest = hashlib.sha256(read_source(Path(model.source))[0]).hexdigest()
        return _sha("bytes", digest)
    return _sha("graph", graph_hash(_import_graph(model.source, dict(model.inputs), model.signature)))


def _import_graph(source, input_shapes, signature=None):
    """The graph the build imports (TorchScript, TensorFlow exported first), through the pipeline's own import."""
    from .. import pipeline
    _remember_imports(pipeline)
    return pipeline.import_any(source, input_shapes, signature)


# The semantic diff imports a changed file; the build that follows imports it again. In the worker,
# the pipeline's import_model remembers its last graph of a file (path, size, mtime, inode and the
# shapes, the same before and after reading it) and gives it to the next import of that same file
# once: a rebuild after a diff does not import twice (~0.1-0.3 s for ResNet-18). CIR graphs are
# not changed in place (passes return new ones), so the diff's graph is the build's.
_LAST_IMPORT: dict = {}


def _file_state(source, input_shapes):
    try:
        stat = os.stat(source)
    except (OSError, TypeError):
        return None
    shapes = json.dumps({k: list(v) for k, v in sorted(dict(input_shapes or {}).items())})
    return (str(Path(source).resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, shapes)


def _remember_imports(pipeline):
    original = pipeline.import_model
    if getattr(original, "remembers", False):
        return

    def import_model(source, input_shapes):
        state = _file_state(source, input_shapes) if isinstance(source, (str, os.PathLike)) else None
        last = _LAST_IMPORT.pop("graph", None)
        if state is not None and last is not None and last[0] == state:
            return last[1]
        graph = original(source, input_shapes)
        if state is not None and _file_state(source, input_shapes) == state:
            _LAST_IMPORT["graph"] = (state, graph)
        return graph
    import_model.remembers = True
    pipeline.import_model = import_model


def model_key(model, diff_mode: str) -> str:
    """What a served version was built from: the source's diff hash and the model's build settings."""
    settings = model.model_dump(mode="json", exclude={"serve", "line"})
    return _sha(_source_hash(model, diff_mode), settings)


def _keys_job(config_path: str, names: list[str], diff_mode: str) -> dict:
    from ..config import load_config
    try:
        spec = load_config(config_path)
    except CuvilError as error:
        return {"error": str(error)}
    keys = {}
    for model in spec.models:
        if model.name in names:
            try:
                keys[model.name] = {"key": model_key(model, diff_mode)}
            except (CuvilError, OSError) as error:
                keys[model.name] = {"error": f"model '{model.name}': {error}"}
    return {"keys": keys}


# The cache entries of the last build, written on a thread of the worker after it has answered (the
# server loads the installed library meanwhile); the next build waits for them first (the entries are
# written atomically, so nothing reads half of one; waiting bounds the memory and the disk traffic).
_PENDING_WRITES: list[threading.Thread] = []
_WRITE_ERRORS: list[str] = []  # what those writes could not do, for the next answer to report


def _write_errors() -> list[str]:
    errors = list(_WRITE_ERRORS)
    _WRITE_ERRORS.clear()
    return errors


def _wait_for_writes():
    while _PENDING_WRITES:
        _PENDING_WRITES.pop().join()


def _build_job(config_path: str, name: str, stage: str | None = None) -> dict:
    """Build one model. With `stage` (a new folder in the server's store, on the same file system),
    the variants are installed there and the job answers with the served library and its sha256;
    the install into the output folder follows on a thread after the answer, with the cache
    writes (a 50 MB file written to a busy disk takes ~1 s; the store is a tmpfs where one exists)."""
    import time

    from ..build import install, installed_files
    from ..config import load_config
    from ..project import build_project
    start = time.perf_counter()
    _wait_for_writes()
    warnings = _write_errors()
    timings = {"wait_writes": time.perf_counter() - start}
    try:
        spec = load_config(config_path)
        model = spec.model(name)
        folder_of = (lambda m, target: Path(stage) / target) if stage else None
        result = build_project(spec, [name], progress=None, defer_cache_writes=True, timings=timings,
                               folder_of=folder_of)
    except CuvilError as error:
        return {"error": str(error), "warnings": warnings}
    served = next(a for a in result.artifacts if a.info["target"] == model.targets[0])
    answer = {"library": str(served.library), "warnings": warnings}
    if stage:
        t0 = time.perf_counter()
        answer["sha256"] = file_sha256(served.library)
        timings["hash"] = time.perf_counter() - t0

    def after_answer():
        try:  # behind the server's load and warm-up of the new library on the same cores
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        try:
            if stage:  # the output folder as `cuvil build` leaves it, from the outputs still in memory
                for model_name, target, final in result.finals:
                    install(installed_files(result.dag, final), spec.output_dir / model_name / target)
            result.dag.flush()
        except Exception as error:  # noqa: BLE001  reported with the next answer (the build has served)
            _WRITE_ERRORS.append(f"model '{name}': writing the output folder or the step cache after the "
                                 f"build failed: {error}")
    writes = threading.Thread(target=after_answer, name="cuvil-cache-writes", daemon=True)
    writes.start()
    _PENDING_WRITES.append(writes)
    # the steps that ran (or were read from the cache) by kind: import, pass, codegen, kernel, link
    for record in result.dag.records.values():
        kind = record.kind if record.status == "ran" else "cached"
        timings[kind] = timings.get(kind, 0.0) + record.seconds
    timings["worker"] = time.perf_counter() - start
    answer["timings"] = timings
    return answer


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _exit_with_parent(parent: int):
    """In the worker: exit when the server process is gone (killed, say), instead of living on idle."""
    import os
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, name="cuvil-build-worker-watch", daemon=True).start()


def _settle_job() -> list[str]:
    _wait_for_writes()
    return _write_errors()


def _warm_job() -> bool:
    from .. import pipeline, project  # noqa: F401  (imports the compiler once, before the first build needs it)
    _remember_imports(pipeline)
    return True


@dataclass
class Built:
    library: Path
    sha256: str | None = None  # the library's, when the worker hashed it (a staged build)
    stage: Path | None = None  # the staging folder the library is in: the caller removes it


class Builder:
    """One worker process for builds and diff hashes, started on first use."""

    def __init__(self, config_path: Path):
        self.config_path = str(config_path)
        self._pool = None
        self.timings: dict = {}  # seconds of the last build's parts in the worker (plan, steps by kind, install)
        self.warnings: list[str] = []  # what the worker's writes after the build before failed to do

    def _call(self, fn, *args):
        for attempt in (1, 2):
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_exit_with_parent, initargs=(os.getpid(),))
            try:
                return self._pool.submit(fn, *args).result()
            except BrokenProcessPool:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
                if attempt == 2:
                    raise BuildFailed("the build worker process died twice in a row") from None

    def warm(self):
        self._call(_warm_job)

    def settle(self) -> list[str]:
        """Wait until the worker has written what it defers (the output folder, the cache entries);
        what it could not write."""
        return self._call(_settle_job)

    def keys(self, names: list[str], diff_mode: str) -> dict[str, dict]:
        """{model: {"key": ...} or {"error": ...}} from the config as it is on disk now."""
        result = self._call(_keys_job, self.config_path, list(names), diff_mode)
        if "error" in result:
            raise BuildFailed(result["error"])
        return result["keys"]

    def build(self, name: str, stage: Path | None = None) -> "Built":
        """Build one model (what is cached is not rebuilt); its served library. With `stage` (a folder
        that does not exist yet) the worker installs there and hashes the library, and installs into
        the output folder after answering (see _build_job)."""
        import time
        start = time.perf_counter()
        result = self._call(_build_job, self.config_path, name, str(stage) if stage else None)
        self.warnings = result.get("warnings", [])
        if "error" in result:
            raise BuildFailed(result["error"])
        self.timings = dict(result.get("timings", {}))
        if "worker" in self.timings:  # the round trip to the worker and back
            self.timings["ipc"] = time.perf_counter() - start - self.timings.pop("worker")
        return Built(Path(result["library"]), result.get("sha256"), stage)

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
