"""Kernel objects for a variant: each distinct kernel compiled once, cached by
content, compiled in parallel worker processes when several are missing."""
from __future__ import annotations

import atexit
import base64
import json
import os
import subprocess
import sys
import threading

from backends.targets import CpuTarget
from cuvil.errors import BuildError


# The worker modules: CPU kernels' IR with NUMBA_OPT=0 (emit.py optimises it for the target);
# GPU kernels (numba_cuda/worker.py) with Numba's defaults, NVVM optimising.
CPU_WORKER = ("backends.numba_cpu.worker", {"NUMBA_OPT": "0"})


class _Worker:
    """One compile worker process, reused for many kernels."""

    def __init__(self, kind=CPU_WORKER):
        module, env_extra = kind
        env = dict(os.environ, **env_extra, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        self.lock = threading.Lock()

    def compile(self, kernel, target) -> bytes:
        job = {"kernel": kernel.as_spec(), "target": target.as_key()}
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


_idle: dict[tuple, list[_Worker]] = {}
_all: list[_Worker] = []
_pool_lock = threading.Lock()


def _acquire(kind) -> _Worker:
    with _pool_lock:
        idle = _idle.setdefault(kind[0], [])
        while idle:
            worker = idle.pop()
            if worker.alive():
                return worker
        worker = _Worker(kind)
        worker.kind = kind[0]
        _all.append(worker)
        return worker


def _release(worker: _Worker) -> None:
    with _pool_lock:
        _idle.setdefault(worker.kind, []).append(worker)


@atexit.register
def _shutdown():
    for worker in _all:
        worker.close()
    _all.clear()
    _idle.clear()


def compile_object(kernel, target: CpuTarget, kind=CPU_WORKER) -> bytes:
    """Compile one kernel to an object file in a worker process (one kernel per worker at a time);
    `kind`: the worker module and its environment (a GPU kernel's fatbin: numba_cuda/worker.py)."""
    worker = _acquire(kind)
    try:
        return worker.compile(kernel, target)
    except Exception as exc:
        raise BuildError(f"compiling kernel {kernel.symbol} ({kernel.family}) failed: {exc}\n"
                         f"kernel source:\n{kernel.source}",
                         hint="this is a bug in cuvil; please report it with the model") from None
    finally:
        _release(worker)
