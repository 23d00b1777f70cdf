"""A kernel compile worker: reads one JSON job per line on stdin, answers one
JSON line on stdout. Started by `objects.py` as `python -m
backends.numba_cpu.worker` with NUMBA_OPT=0, so it never re-imports the caller's
main module (as multiprocessing's spawn would) and never inherits a Numba
configured for something else (as fork would)."""
from __future__ import annotations

import base64
import json
import sys
import traceback


def main() -> None:
    from backends.schedule import Kernel
    from backends.targets import CpuTarget

    from .emit import build_kernel_object
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the protocol stream
    for line in sys.stdin:
        job = json.loads(line)
        try:
            target = CpuTarget.from_key(job["target"])
            data = build_kernel_object(Kernel.from_spec(job["kernel"]), target)
            answer = {"ok": base64.b64encode(data).decode()}
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
