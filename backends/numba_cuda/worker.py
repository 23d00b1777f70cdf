"""A GPU kernel compile worker (the CPU one's protocol, backends/numba_cpu/worker.py): one JSON
job per line on stdin, the kernel's fatbin (base64) as one JSON line on stdout. Numba CUDA
compiles under a process-wide lock, so a build compiles its GPU kernels in several of these."""
from __future__ import annotations

import base64
import json
import sys
import traceback


def main() -> None:
    from backends.schedule import Kernel
    from backends.targets import CudaTarget

    from .emit import build_kernel_fatbin
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the protocol stream
    for line in sys.stdin:
        job = json.loads(line)
        try:
            data = build_kernel_fatbin(Kernel.from_spec(job["kernel"]), CudaTarget.from_key(job["target"]))
            answer = {"ok": base64.b64encode(data).decode()}
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
