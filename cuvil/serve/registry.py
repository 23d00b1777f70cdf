"""The models a server holds: one loaded version each, swapped atomically, unloaded when drained.

A built library is hard-linked (or copied) under a content-addressed name
(`<store>/lib<model>-<sha256[:16]>.so`) before it is opened: the dynamic
loader keys libraries by path, so the old and the new version of a model can
be open side by side, and the same bytes are never loaded twice. A new version
is warmed up (every session runs once; a few timed runs give the scheduler its
first estimate) and its signature compared with the running one *before* the
swap; a changed signature is reported and the old version keeps serving.

The swap is one assignment under a lock. A request takes a version and one of
its sessions when it starts (not when it is queued), so every request that
starts after the swap runs on the new library, and the ones already running
finish on the old; the old version is closed and its library unloaded when
its last request is done.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..runtime import Library
from .protocol import RequestError, Signature

WARMUP_TIMED_RUNS = 3  # the first version of a model: the scheduler's first estimate
# a new version of a serving model: no run beyond the warm-up's, whose time is the sample (the swap keeps
# the model's measured estimate when the signature and threads are the same)
SWAP_TIMED_RUNS = 0


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ModelVersion:
    """One loaded library of a model and its pool of sessions."""

    def __init__(self, name: str, path: Path, version: str, prefix: str, sessions: int):
        self.name, self.path, self.version = name, path, version
        self.library = Library(path, prefix)
        self.signature = Signature.of(self.library.info)
        self.threads = int(self.library.info.get("threads", 1))
        try:
            self._free = [self.library.session() for _ in range(sessions)]
        finally:
            # the mapping outlives the name: nothing is left in the store when the server is killed,
            # and a later file of the same name (the same bytes again) is never removed by this one
            path.unlink(missing_ok=True)
        self._all = list(self._free)
        self.inflight = 0
        self.retired = False

    def warm_up(self, timed_runs: int = WARMUP_TIMED_RUNS) -> float:
        """Run every session once on zeros; return the median of `timed_runs` timed runs, in seconds
        (with none, the longest of the warm-up runs)."""
        feeds = {t.name: np.zeros(t.shape, t.dtype) for t in self.signature.inputs}
        warm = []
        for session in self._all:
            start = time.perf_counter()
            session.run(feeds)
            warm.append(time.perf_counter() - start)
        if timed_runs == 0:
            return max(warm)
        times = []
        clock = time.thread_time if self.threads == 1 else time.perf_counter  # as Registry.run measures work
        for _ in range(timed_runs):
            start = clock()
            self._all[0].run(feeds)
            times.append(clock() - start)
        return sorted(times)[len(times) // 2]

    def close(self):
        """Destroy the sessions and unload the library (its file was removed once it was open)."""
        for session in self._all:
            session.close()
        self._all, self._free = [], []
        handle = self.library._lib._handle
        self.library = None  # nothing may call into the library from here on
        try:
            import _ctypes
            _ctypes.dlclose(handle)
        except (ImportError, OSError):
            pass


@dataclass
class Installed:
    """What `Registry.install` did: outcome "loaded", "swapped", "unchanged" (the same bytes serve
    already) or "signature_changed" (not swapped: `reason` says how)."""
    outcome: str
    version: "ModelVersion | None"
    estimate_s: float = 0.0
    reason: str = ""
    previous_threads: int | None = None  # "swapped": the threads of the version it replaced
    # seconds of each part: store (link and hash the file), open (dlopen, sessions), warmup, check, swap
    steps: dict = field(default_factory=dict)


@dataclass
class ModelEntry:
    """A model of the config: what it serves now (`current`, None when unloaded) and why not, if not."""
    config: ModelConfig
    current: ModelVersion | None = None
    source_key: str | None = None  # the diff hash of what `current` was built from
    reason: str = "not loaded yet"
    wanted: bool = True  # False once unloaded by a repository request
    history: list[str] = field(default_factory=list)  # versions served, oldest first

    @property
    def ready(self) -> bool:
        return self.current is not None


def _link_or_copy(source: Path, path: Path) -> None:
    """`path` with `source`'s bytes: a hard link where the file system allows (no copy of a large
    library; a build never rewrites its output in place, it renames a new file over it), else a copy."""
    path.unlink(missing_ok=True)
    try:
        os.link(source, path)
    except OSError:
        shutil.copyfile(source, path)


class Registry:
    def __init__(self, models: list[ModelConfig], store: Path, say=print):
        self.entries = {m.name: ModelEntry(m) for m in models}
        self.store = Path(store)
        self.store.mkdir(parents=True, exist_ok=True)
        self.say = say
        self._lock = threading.Lock()
        self._stages = itertools.count()

    def entry(self, name: str) -> ModelEntry:
        """The entry of a configured model; a name is only ever looked up here, never used as a path."""
        entry = self.entries.get(name)
        if entry is None:
            raise RequestError(f"unknown model {name!r} (models: {', '.join(self.entries)})", status=404)
        return entry

    # --- loading and swapping (called from the startup and hot-update threads)

    def stage(self, name: str) -> Path:
        """A new folder name in the store for the build worker to install a build of `name` into (on
        the store's file system, so the library is linked into the store, not copied)."""
        return self.store / f".stage-{name}-{os.getpid()}-{next(self._stages)}"

    def install(self, name: str, built: Path, source_key: str | None = None, sha256: str | None = None) -> Installed:
        """Load `built` as the model's next version, warm it up and swap it in. `sha256`: the file's,
        when the build worker hashed it (a staged build, which nothing rewrites before it is removed)."""
        entry = self.entries[name]
        steps, mark = {}, time.perf_counter()

        def lap(part):
            nonlocal mark
            now = time.perf_counter()
            steps[part] = now - mark
            mark = now
        current = entry.current
        if sha256 is not None:
            version = sha256[:16]
            if current is not None and current.version == version:
                entry.source_key = source_key or entry.source_key
                lap("store")
                return Installed("unchanged", current, steps=steps)
            path = self.store / f"lib{name}-{version}.so"
            _link_or_copy(built, path)
        else:
            partial = self.store / f".lib{name}.{threading.get_ident()}.partial"
            _link_or_copy(built, partial)
            # the version names the bytes that will be loaded: those of the store's file, not of
            # `built`, which a build may replace meanwhile
            version = file_sha256(partial)[:16]
            if current is not None and current.version == version:
                partial.unlink()
                entry.source_key = source_key or entry.source_key
                lap("store")
                return Installed("unchanged", current, steps=steps)
            path = self.store / f"lib{name}-{version}.so"
            partial.replace(path)
        lap("store")
        try:
            fresh = ModelVersion(name, path, version, entry.config.symbol_prefix, entry.config.serve.max_concurrency)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        lap("open")
        try:
            estimate = fresh.warm_up(WARMUP_TIMED_RUNS if current is None else SWAP_TIMED_RUNS)
        except Exception:
            fresh.close()
            raise
        lap("warmup")
        if current is not None and fresh.signature != current.signature:
            reason = (f"model '{name}': the rebuilt library's signature {fresh.signature.describe()} differs from "
                      f"the serving one {current.signature.describe()}; version {current.version} keeps serving")
            fresh.close()
            return Installed("signature_changed", current, reason=reason, steps=steps)
        lap("check")
        with self._lock:
            old, entry.current = entry.current, fresh
            entry.source_key, entry.reason, entry.wanted = source_key, "", True
            entry.history.append(version)
            drained = old is not None and self._retire(old)
        if drained:  # unloaded outside the lock: requests of other models never wait for a dlclose
            old.close()
        lap("swap")
        return Installed("swapped" if old is not None else "loaded", fresh, estimate,
                         previous_threads=old.threads if old is not None else None, steps=steps)

    def unload(self, name: str) -> bool:
        entry = self.entry(name)
        with self._lock:
            old, entry.current = entry.current, None
            entry.reason, entry.wanted = "unloaded by a repository request", False
            drained = old is not None and self._retire(old)
        if drained:
            old.close()
        return old is not None

    def fail(self, name: str, reason: str):
        """A load that failed: the model stays as it is, with the reason to report."""
        self.entries[name].reason = reason

    def _retire(self, version: ModelVersion) -> bool:
        """Mark `version` retired (under the lock); True when no request runs on it: the caller closes
        it, after releasing the lock. Otherwise its last request closes it."""
        version.retired = True
        return version.inflight == 0

    # --- running (called from the compute threads)

    def run(self, name: str, feeds: dict) -> tuple[str, dict, float, float]:
        """Run one request on the version serving now: (version, outputs, compute seconds, work seconds).
        The work is the calling thread's CPU time for a single-threaded library (the wall time of a
        run includes the time the thread waited for a core on a busy machine, which says nothing about
        the model), else the wall time."""
        with self._lock:
            version = self.entries[name].current
            if version is None:
                raise RequestError(f"model '{name}' is not loaded ({self.entries[name].reason})", status=503)
            version.inflight += 1
            session = version._free.pop() if version._free else None
        if session is None:  # the scheduler caps a model's runs at its sessions: only a safety net
            session = version.library.session()
            version._all.append(session)
        try:
            start, cpu = time.perf_counter(), time.thread_time()
            outputs = session.run(feeds)
            wall = time.perf_counter() - start
            return version.version, outputs, wall, (time.thread_time() - cpu) if version.threads == 1 else wall
        finally:
            with self._lock:
                version._free.append(session)
                version.inflight -= 1
                drained = version.retired and version.inflight == 0
            if drained:
                version.close()

    def close(self):
        drained = []
        with self._lock:
            for entry in self.entries.values():
                if entry.current is not None:
                    if self._retire(entry.current):
                        drained.append(entry.current)
                    entry.current = None
        for version in drained:
            version.close()
        shutil.rmtree(self.store, ignore_errors=True)  # stages left by a failed build; the libraries are open
        # (unlinked) or closed
