"""Kernel objects for a variant: each distinct kernel compiled once, cached by
content, compiled in parallel worker processes when several are missing."""
from __future__ import annotations

import atexit
import base64
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading
from importlib import metadata

from cuvil.cache import Cache, step_key
from cuvil.errors import BuildError

from .targets import CpuTarget


def tool_versions() -> dict:
    from cuvil import __version__
    return {"cuvil": __version__, "numba": metadata.version("numba"), "llvmlite": metadata.version("llvmlite")}


class _Worker:
    """One compile worker process, reused for many kernels."""

    def __init__(self):
        env = dict(os.environ, NUMBA_OPT="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "backends.native.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        self.lock = threading.Lock()

    def compile(self, kernel, target: CpuTarget) -> bytes:
        job = {"source": kernel.source, "arg_types": list(kernel.arg_types), "symbol": kernel.symbol,
               "target": {"name": target.name, "triple": target.triple, "cpu": target.cpu, "features": target.features,
                          "vector_bits": target.vector_bits, "gcc_flags": list(target.gcc_flags)}}
        with self.lock:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the compile worker died")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"] + "\n" + answer.get("traceback", ""))
        return base64.b64decode(answer["ok"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


_workers: list[_Worker] = []
_workers_lock = threading.Lock()


def _get_workers(n: int) -> list[_Worker]:
    with _workers_lock:
        _workers[:] = [w for w in _workers if w.alive()]
        while len(_workers) < n:
            _workers.append(_Worker())
        return _workers[:n]


@atexit.register
def _shutdown():
    for worker in _workers:
        worker.close()
    _workers.clear()


def object_key(kernel, target: CpuTarget) -> str:
    return step_key({"step": "kernel-object", "kernel": kernel.key, "target": target.as_key(), "versions": tool_versions()})


def compile_objects(kernels, target: CpuTarget, cache: Cache, jobs: int = 1, progress=None) -> dict[str, bytes]:
    """symbol -> object bytes for every kernel, from the cache or freshly compiled."""
    objects, missing = {}, []
    for kernel in {k.symbol: k for k in kernels}.values():
        data = cache.get(object_key(kernel, target))
        if data is None:
            missing.append(kernel)
        else:
            objects[kernel.symbol] = data
    if not missing:
        return objects
    workers = _get_workers(max(1, min(jobs, len(missing))))
    pool = cf.ThreadPoolExecutor(max_workers=len(workers))
    futures = {pool.submit(workers[i % len(workers)].compile, k, target): k for i, k in enumerate(missing)}
    done = 0
    for future in cf.as_completed(futures):
        kernel = futures[future]
        try:
            data = future.result()
        except Exception as exc:
            raise BuildError(f"compiling kernel {kernel.symbol} ({kernel.family}) failed: {type(exc).__name__}: {exc}\n"
                             f"kernel source:\n{kernel.source}", hint="this is a bug in cuvil; please report it with the model") from None
        cache.put(object_key(kernel, target), data)
        objects[kernel.symbol] = data
        done += 1
        if progress:
            progress(f"kernel {done}/{len(missing)} {kernel.family}")
    pool.shutdown()
    return objects
