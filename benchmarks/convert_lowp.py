"""Throughput of the float32 <-> bf16 / float16 conversion kernels (backends/numba_cpu/lowp.py),
each method, on 65536 elements (in L2), JIT-compiled for this CPU, best of 200 calls through
ctypes (the call's ~1 us included):

    python benchmarks/convert_lowp.py
"""
from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from backends.numba_cpu.hostjit import HostJit  # noqa: E402
from backends.numba_cpu.lowp import CvtSpec, cvt_ir  # noqa: E402
from backends.targets import has_feature  # noqa: E402
from backends.targets import resolve_target  # noqa: E402

SPECS = [CvtSpec("f32", "bf16", "exact"), CvtSpec("f32", "bf16", "hw"), CvtSpec("bf16", "f32"),
         CvtSpec("f32", "f16", "exact"), CvtSpec("f32", "f16", "hw"), CvtSpec("f16", "f32", "exact"),
         CvtSpec("f16", "f32", "hw")]


def main(n: int = 1 << 16, calls: int = 200) -> None:
    host = resolve_target("native")
    jit = HostJit(host.cpu, host.features, host.vector_bits)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    for spec in SPECS:
        needs = "avx512bf16" if spec.dst == "bf16" else "f16c"
        if spec.method == "hw" and not has_feature(host, needs):
            continue
        jit.add(cvt_ir(spec, host.vector_bits))
        fn = jit.function(spec.name, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int64)
        src = x if spec.src == "f32" else np.zeros(n, np.uint16)
        dst = np.zeros(n, np.float32 if spec.dst == "f32" else np.uint16)
        best = float("inf")
        for _ in range(calls):
            t = time.perf_counter()
            fn(src.ctypes.data, 0, dst.ctypes.data, 0, n)
            best = min(best, time.perf_counter() - t)
        print(f"{spec.src:>4} -> {spec.dst:<4} {spec.method:<5} {n / best / 1e9:6.2f} Gelem/s")


if __name__ == "__main__":
    main()
