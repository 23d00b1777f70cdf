"""Hot updates: watch the models, rebuild what changed in the build worker, swap it in.

The watch is `cuvil watch`'s (cuvil/watch.py): the folders of cuvil.yaml, of
every model source and of `watch.paths`, here with `incremental.watch_paths`
added, and changes under the output and cache folders ignored. After a change
each loaded model's key (`builder.model_key`: the diff hash of its source in
the configured `diff_mode` with its build settings) is recomputed; a model
whose key moved is rebuilt through the step cache and handed to
`Registry.install`, which warms the new library up, checks its signature and
swaps it. A key is remembered for `cache_ttl` seconds against the file's
size and mtime, so a change to one model does not re-import the others.

A failed build, a broken intermediate save or a changed signature is reported
(printed, counted in `cuvil_swaps_total{result=...}` and kept in `events`) and
the old version keeps serving.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CuvilError
from ..watch import relevant_change, watched_paths


# How long the watcher waits for changes before it yields an empty round (and looks at its stop flag).
WATCH_TIMEOUT_MS = 200
# After a change, the watcher yields once no further change came for this long (or `watch.debounce_ms`
# passed): watchfiles' `step`, 50 ms by default. A save is a write and a rename, microseconds apart.
WATCH_STEP_MS = 5


@dataclass
class UpdateEvent:
    model: str
    # swapped; same_key (the file changed, its diff hash did not: nothing rebuilt); unchanged (rebuilt
    # to the same library bytes); signature_changed; build_failed
    result: str
    version: str | None
    seconds: float  # from the change being seen to the new version serving (or the failure)
    reason: str = ""
    # seconds of each part: notice (last write -> the watcher's yield), diff, build, load; `seconds`
    # starts after notice
    steps: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)  # the parts of build and load (Updater._update)


def _notice_lag(changes) -> float | None:
    """Seconds from the newest change among the changed files (inode change time: a rename sets it, and
    a write; a large write's modification time is its start) to now: how long the watch (its debounce
    included) took to report the change. None when none of them exists any more."""
    import os
    newest = None
    for _, path in changes:
        try:
            mtime = os.stat(path).st_ctime_ns
        except OSError:
            continue
        newest = mtime if newest is None else max(newest, mtime)
    return None if newest is None else max(0.0, time.time() - newest / 1e9)


class Updater:
    def __init__(self, server):
        self.server = server
        self.spec = server.spec
        self.config = server.spec.incremental
        self.events: list[UpdateEvent] = []
        self._memo: dict[str, tuple[tuple, float, str]] = {}  # model -> (file stats, when, key)
        self._touched: set[str] = set()  # models whose files changed since their key was computed
        self._diff_s = 0.0  # how long the last round's keys took
        self._notice_s = None
        self._stop = threading.Event()
        self._watching = threading.Event()  # set once the file watch is in place
        self._thread = None
        self.checks = 0  # rounds of checks done, for tests and logs

    def paths(self) -> list[Path]:
        extra = set()
        for entry in self.config.watch_paths:
            p = Path(entry)
            if any(c in p.name for c in "*?["):
                p = p.parent
            extra.add(p if p.is_dir() else p.parent)
        return sorted(set(watched_paths(self.spec.path, self.spec)) | {p for p in extra if p.exists()})

    def start(self, timeout: float = 30):
        """Watch on a thread of its own; returns once the watch is in place (or after `timeout`), so a
        change saved after start() returns is never missed."""
        self._thread = threading.Thread(target=self._loop, name="cuvil-serve-updater", daemon=True)
        self._thread.start()
        self._watching.wait(timeout)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self):
        import watchfiles
        paths = self.paths()
        self.server.say(f"hot updates: watching {', '.join(str(p) for p in paths)} "
                        f"(diff_mode: {self.config.diff_mode})")
        # yield_on_timeout: the first (empty) round says the watch is in place; a change made between
        # the models' keys at start-up and that moment is then found by one check against those keys.
        for changes in watchfiles.watch(*paths, debounce=self.spec.watch.debounce_ms,
                                        step=max(1, min(WATCH_STEP_MS, self.spec.watch.debounce_ms)), stop_event=self._stop,
                                        rust_timeout=WATCH_TIMEOUT_MS, yield_on_timeout=True,
                                        raise_interrupt=False):
            if not self._watching.is_set():
                self._watching.set()
                self._round()
            elif changes and relevant_change(changes, self.spec.path, self.spec):
                self._round(_notice_lag(changes))

    def _round(self, notice: float | None = None):
        try:
            self.check(notice)
        except Exception as error:  # the watcher must outlive any one bad round
            self.server.say(f"hot update: internal error: {type(error).__name__}: {error}")

    def check(self, notice: float | None = None) -> list[UpdateEvent]:
        """Recompute every loaded model's key; rebuild and swap those that moved. `notice`: seconds
        from the change's last write to the watcher yielding it (reported as the event's first part)."""
        seen = time.perf_counter()
        self._notice_s = notice
        registry = self.server.registry
        names = [name for name, entry in registry.entries.items() if entry.ready]
        events = []
        try:
            keys = self.keys(names)
            self._diff_s = time.perf_counter() - seen
        except CuvilError as error:  # e.g. cuvil.yaml saved half-way: wait for the next change
            events = [self._report(name, "build_failed", None, seen, str(error)) for name in names]
            self.checks += 1
            return events
        for name in names:
            entry = registry.entries[name]
            found = keys.get(name, {"error": f"model '{name}' is no longer in {self.spec.path.name}"})
            if "error" in found:
                events.append(self._report(name, "build_failed", entry.current, seen, found["error"]))
            elif found["key"] != entry.source_key:
                events.append(self._update(name, found["key"], seen))
            elif name in self._touched:
                events.append(self._report(name, "same_key", entry.current, seen))
        self.checks += 1
        return events

    def keys(self, names: list[str]) -> dict[str, dict]:
        """Each model's key, from the memo while its file and cuvil.yaml are untouched and the key is fresh."""
        now, keys, stale = time.monotonic(), {}, []
        self._touched = set()
        for name in names:
            stats = self._stats(self.server.registry.entries[name].config.source)
            memo = self._memo.get(name)
            if memo and memo[0] == stats and now - memo[1] < self.config.cache_ttl:
                keys[name] = {"key": memo[2]}
            else:
                stale.append(name)
                if memo and memo[0] != stats:
                    self._touched.add(name)
        if stale:
            fresh = self.server.builder.keys(stale, self.config.diff_mode)
            for name in stale:
                if name in fresh:
                    keys[name] = fresh[name]
                    if "key" in fresh[name]:
                        self._memo[name] = (self._stats(self.server.registry.entries[name].config.source),
                                            now, fresh[name]["key"])
        return keys

    def _stats(self, source: Path) -> tuple:
        def stat(path):
            try:
                s = Path(path).stat()
                return (s.st_size, s.st_mtime_ns, s.st_ino)
            except OSError:
                return None
        return (stat(source), stat(self.spec.path))

    def _update(self, name: str, key: str, seen: float) -> UpdateEvent:
        steps = {"notice": self._notice_s} if self._notice_s is not None else {}
        steps["diff"] = self._diff_s
        builder = self.server.builder
        try:
            installed = self.server.build_and_install(name, key, steps)
        except CuvilError as error:
            return self._report(name, "build_failed", self.server.registry.entries[name].current, seen, str(error),
                                steps)
        # the parts: the build's in the worker (wait_writes, plan, steps by kind, install, ipc) and
        # the load's (store, open, warmup, check, swap)
        details = {**{f"build.{k}": v for k, v in builder.timings.items()},
                   **{f"load.{k}": v for k, v in installed.steps.items()}}
        return self._report(name, installed.outcome, installed.version, seen, installed.reason, steps, details)

    def _report(self, name, result, version, seen, reason="", steps=None, details=None) -> UpdateEvent:
        event = UpdateEvent(name, result, getattr(version, "version", None), time.perf_counter() - seen, reason,
                            steps or {}, details or {})
        self.events.append(event)
        self.server.metrics.swaps.labels(name, result).inc()
        what = {"swapped": f"swapped in version {event.version}",
                "same_key": f"changed on disk, same {self.config.diff_mode} hash: nothing rebuilt or swapped",
                "unchanged": f"rebuilt to the same library ({event.version}): nothing swapped",
                "signature_changed": "not swapped: the signature changed",
                "build_failed": "not swapped: the update failed"}[result]
        parts = ", ".join(f"{step} {seconds * 1000:.0f}" for step, seconds in event.steps.items())
        detail = ", ".join(f"{step} {seconds * 1000:.0f}" for step, seconds in event.details.items())
        self.server.say(f"hot update [{name}]: {what} ({event.seconds * 1000:.0f} ms{': ' + parts if parts else ''})"
                        + (f"\n  parts (ms): {detail}" if detail else "") + (f"\n  {reason}" if reason else ""))
        return event
