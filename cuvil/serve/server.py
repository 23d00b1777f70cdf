"""`Server`: a cuvil.yaml's models behind the KServe v2 protocol.

Start-up builds what is missing (`project.build_project` in the build worker:
the step cache makes an up-to-date model cost a few hashes), loads every
model's library, warms it up and gives the scheduler its first compute-time
estimate. Then one event loop serves HTTP and one pool of `workers` threads
(default: the CPU cores this process may use) runs the libraries; a library
built with `threads: N` takes N of them per run. With `incremental.enabled`
a watcher thread hot-updates the models (updater.py).

`Server.start()` runs it all on a background thread (tests, benchmarks);
`serve_forever()` runs it in the foreground until SIGINT/SIGTERM (`cuvil serve`).
"""
from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from ..config import load_config
from ..errors import CuvilError
from .app import Dispatcher, make_app
from .builder import Builder
from .metrics import Metrics
from .registry import Registry
from .scheduler import Scheduler
from .updater import Updater

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


def store_folder(output_dir: Path) -> Path:
    """Where the loaded libraries' files go: a new folder in the tmpfs /dev/shm where there is one (the
    build worker writes a rebuilt library there and the server links it, never waiting on a busy
    disk), else <output_dir>/.serve/<pid>. One folder per server process: two servers of one project
    never remove each other's files."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        try:
            return Path(tempfile.mkdtemp(prefix=f"cuvil-serve-{os.getpid()}-", dir=shm))
        except OSError:
            pass
    return Path(output_dir) / ".serve" / str(os.getpid())


def event_loop_factory():
    """uvloop's event loop when it is installed (the `serve` extra installs it: a faster event loop for
    the HTTP side, whose backlog is what a critical request waits for under overload), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _lower_priority(nice: int):
    """In a new compute thread of the lower classes: raise its nice value by `nice` (a thread may
    always lower its own priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (AttributeError, OSError):
        pass


class CollectorWatch:
    """Keeps the garbage collector's full collections short and measured.

    A collection holds the GIL: while it runs, the event loop reads nothing and no compute thread
    starts or hands back a run. A full collection walks every object the process tracks, and most of
    them are the ones start-up made (modules, aiohttp's, uvloop's and numpy's state: ~58k objects, a
    full collection 18-94 ms on a busy two-core machine). Once the models are loaded those
    objects are frozen (`gc.freeze`: moved out of the generations the collector walks; they live as
    long as the server anyway), so a collection walks only what was made since. Each collection's
    time goes to `cuvil_gc_pause_seconds{generation}`."""

    # servers of this process that froze (tests and scripts may run several): the last one to stop
    # gives the collector its objects back
    _freezers = 0
    _lock = threading.Lock()

    def __init__(self, histogram):
        self.histogram = histogram
        self._started = None
        self._frozen = False

    def __call__(self, phase, info):  # a gc.callbacks entry: runs on the collecting thread, GIL held
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.histogram.labels(str(info["generation"])).observe(time.perf_counter() - self._started)
            self._started = None

    def start(self):
        with CollectorWatch._lock:
            if CollectorWatch._freezers == 0:
                gc.collect()  # start-up's garbage goes first: what is frozen is never collected
                gc.freeze()
            CollectorWatch._freezers += 1
            self._frozen = True
        gc.callbacks.append(self)

    def stop(self):
        if self in gc.callbacks:
            gc.callbacks.remove(self)
        with CollectorWatch._lock:
            if self._frozen:
                self._frozen = False
                CollectorWatch._freezers -= 1
                if CollectorWatch._freezers == 0:  # a script that embeds a server gets its collector back
                    gc.unfreeze()


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Server:
    def __init__(self, config_path, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
                 workers: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queue: int = 256,
                 say=print, reserve: int | None = None, lower_nice: int = 10):
        self.config_path = Path(config_path)
        self.spec = load_config(self.config_path)
        self.host, self.port, self.token = host, port, token
        self.workers = workers or default_workers()
        self.max_body_bytes = max_body_bytes
        self.say = say
        self.metrics = Metrics()
        # one folder per server process: two servers of one project never remove each other's copies
        self.registry = Registry(self.spec.models, store_folder(self.spec.output_dir), say)
        priorities = {model.serve.priority for model in self.spec.models}
        # one compute slot kept for the critical models when others share the pool (scheduler.py)
        if reserve is None:
            reserve = 1 if self.workers >= 2 and "critical" in priorities and len(priorities) > 1 else 0
        self.scheduler = Scheduler(self.workers, max_queue=max_queue, reserve=min(reserve, self.workers - 1))
        for model in self.spec.models:
            s = model.serve
            self.scheduler.add_model(model.name, s.priority, s.deadline_ms, s.max_concurrency, model.threads)
        self.executor = ThreadPoolExecutor(self.workers, thread_name_prefix="cuvil-serve-compute")
        # the lower classes' runs on threads of a lower OS priority (nice +lower_nice): on a machine
        # short of cores, the HTTP event loop and the critical runs get the CPU first
        self.lower_executor = None
        if lower_nice and "critical" in priorities and len(priorities) > 1:
            self.lower_executor = ThreadPoolExecutor(self.workers, thread_name_prefix="cuvil-serve-lower",
                                                     initializer=_lower_priority, initargs=(lower_nice,))
        self.dispatcher = Dispatcher(self.scheduler, self.executor, self.metrics, self.lower_executor)
        self.builder = Builder(self.config_path)
        self.collector = CollectorWatch(self.metrics.gc_pause_seconds)
        self.updater = Updater(self) if self.spec.incremental.enabled else None
        self._install_lock = threading.Lock()
        self._loop = self._runner = self._thread = None
        self._started = threading.Event()
        self._stopping = None
        self._failure = None

    # --- models

    def ready(self) -> bool:
        """Every model is loaded, except those unloaded on request."""
        return all(e.ready or not e.wanted for e in self.registry.entries.values())

    def load_all(self):
        keys = {}
        if self.updater is not None:
            try:
                keys = self.updater.keys([m.name for m in self.spec.models])
            except CuvilError as error:
                self.say(f"cuvil: error: {error}")
        for model in self.spec.models:
            problem = self.load_model(model.name, keys.get(model.name, {}).get("key"))
            if problem:
                self.say(f"cuvil: error: [{model.name}] not served: {problem}")

    def load_model(self, name: str, key: str | None = None) -> str | None:
        """Build (what is missing) and load one model; None when it serves, else why not."""
        start = time.perf_counter()
        try:
            if key is None and self.updater is not None:  # what hot updates compare the next change with
                key = self.updater.keys([name]).get(name, {}).get("key")
            installed = self.build_and_install(name, key)
            for warning in self.builder.settle():  # a load returns with the output folder written
                self.say(f"warning: {warning}")     # (a hot update does not wait for it)
        except CuvilError as error:
            self.registry.fail(name, str(error))
            return str(error)
        self.say(f"[{name}] {installed.outcome}: version {installed.version.version}, "
                 f"{installed.estimate_s * 1000:.2f} ms a run, {time.perf_counter() - start:.2f} s")
        return None

    def build_and_install(self, name: str, key: str | None, steps: dict | None = None):
        """Build `name` in the worker (staged in the registry's store) and install it; `steps` gets the
        seconds of the build and of the load."""
        stage = self.registry.stage(name)
        try:
            start = time.perf_counter()
            try:
                built = self.builder.build(name, stage)
            finally:
                for warning in self.builder.warnings:
                    self.say(f"warning: {warning}")
            middle = time.perf_counter()
            installed = self.install(name, built.library, key, built.sha256)
            if steps is not None:
                steps.update(build=middle - start, load=time.perf_counter() - middle)
            return installed
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def install(self, name: str, library: Path, key: str | None, sha256: str | None = None):
        with self._install_lock:  # one load at a time: startup, repository loads and hot updates
            installed = self.registry.install(name, library, key, sha256)
        if installed.outcome in ("loaded", "swapped"):
            version = installed.version
            same_cost = installed.outcome == "swapped" and installed.previous_threads == version.threads
            self._locked(self.scheduler.set_threads, name, version.threads)
            if not same_cost:  # a swap of the same signature and threads keeps the measured history
                self._locked(self.scheduler.set_estimate, name, installed.estimate_s)
            self.metrics.ready.labels(name).set(1)
        return installed

    def _locked(self, fn, *args):
        with self.dispatcher.lock:  # the scheduler's lock
            fn(*args)

    # --- running

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _serve(self):
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._runner = web.AppRunner(make_app(self, self.max_body_bytes), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port the OS chose for --port 0
        self._started.set()
        await self._stopping.wait()
        await self._runner.cleanup()

    def _run_thread(self):
        try:
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                runner.run(self._serve())
        except BaseException as error:  # noqa: BLE001  reported to start(), which raises it
            self._failure = error
            self._started.set()

    def start(self, timeout: float = 600) -> "Server":
        """Build and load the models, then serve on a background thread; returns once listening."""
        self.load_all()
        self.collector.start()
        self._thread = threading.Thread(target=self._run_thread, name="cuvil-serve-http", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise CuvilError(f"the server did not start listening within {timeout} s")
        if self._failure is not None:
            raise CuvilError(f"cannot serve on {self.host}:{self.port}: {self._failure}")
        if self.updater is not None:
            self.updater.start()
        self.say(f"serving {len(self.registry.entries)} model(s) on {self.url} (KServe v2; {self.workers} compute "
                 f"threads){'; bearer token required' if self.token else ''}")
        if self.token is None and self.host not in ("127.0.0.1", "localhost", "::1"):
            self.say(f"warning: {self.host} is reachable from other machines and no --token-file was given: "
                     f"anyone who can connect can run and unload the models")
        return self

    def stop(self):
        if self.updater is not None:
            self.updater.stop()
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.lower_executor is not None:
            self.lower_executor.shutdown(wait=True, cancel_futures=True)
        self.builder.close()
        self.registry.close()
        self.collector.stop()

    def serve_forever(self, stop_after: float | None = None) -> None:
        """Serve until SIGINT or SIGTERM (or `stop_after` seconds, for tests)."""
        done = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            done.wait(stop_after)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.say("stopping")
            self.stop()
