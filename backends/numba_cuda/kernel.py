"""The GPU kernels' contract and the generators' toolkit.

A GPU kernel is a `backends.schedule.Kernel` with `block` > 0. Its source, written for
Numba CUDA, defines

    def kernel(p0, p1, ..., n):

over raw pointers (inputs first, then outputs, as on the CPU; `p[i]` indexes them) and
`n`, the call's `work`: the driver launches ceil(work / block) blocks of `block` threads
and every thread with `cuda.grid(1) >= n` must do nothing. A kernel that works on tiles
(a GEMM, a row reduction) takes `work = tiles * block` and finds its tile in
`cuda.blockIdx.x`. Shared memory is static (`cuda.shared.array` with literal shapes).
The names the source may use: `cuda`, `math`, `np`, `float32`, `int32`, `int64`, `uint32`,
`libdevice` (numba.cuda.libdevice), the PRELUDE's device functions and mma.py's (tensor-core
products, 16-bit packing).

The same source runs three ways: compiled to PTX for a CudaTarget (emit.py), in Numba's
CUDA simulator over numpy arrays (simulate.py: the CI checks without a GPU), and on a GPU
through the generated driver (backends/native/driver_cuda.py).
"""
from __future__ import annotations

import math

import numpy as np

from backends.schedule import InPlace, Kernel, KernelCall, Lowered, View  # noqa: F401  (the generators' types)

BLOCK = 256   # threads per block of an elementwise kernel: 8 warps, the usual occupancy sweet spot


def blocks(work: int, block: int) -> int:
    return max(1, -(-int(work) // int(block)))


def gpu_kernel(family: str, source: str, arg_types, block: int = BLOCK, in_place: bool = False) -> Kernel:
    return Kernel(family, source, tuple(np.dtype(t).name for t in arg_types), in_place=in_place, block=int(block))


# Device functions every kernel may call: the CPU kernels' vectorisable math (vmath.py) by the
# same names, so that the CPU generators' portable kernels (portable.py) compile here unchanged.
PRELUDE = """
@cuda.jit(device=True, inline="always")
def vexp(x):
    return math.exp(x)

@cuda.jit(device=True, inline="always")
def vtanh(x):
    return math.tanh(x)

@cuda.jit(device=True, inline="always")
def verf(x):
    return math.erf(x)

@cuda.jit(device=True, inline="always")
def vsigmoid(x):
    return float32(1) / (float32(1) + math.exp(-x))

@cuda.jit(device=True, inline="always")
def vmax(a, b):
    return max(a, b)
"""


def namespace(cuda_module) -> dict:
    """The globals a kernel's source is executed in (cuda_module: numba.cuda, real or simulated),
    with the tensor-core and 16-bit functions of mma.py (FUNCTIONS) for the reduced-precision kernels."""
    import os

    from numba import float32, int32, int64, uint32

    from .mma import namespace_entries
    ns = {"__name__": "cuvil_kernel", "cuda": cuda_module, "math": math, "np": np,
          "float32": float32, "int32": int32, "int64": int64, "uint32": uint32, "libdevice": _libdevice()}
    exec(compile(PRELUDE, "<cuvil gpu prelude>", "exec"), ns)
    ns.update(namespace_entries(ns, simulator=os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"))
    return ns


class _SimulatedLibdevice:
    """libdevice for the CUDA simulator, whose own libdevice module is only signatures: each
    function by numpy's of the same name (`floorf` and `floor` are both np.floor)."""

    def __getattr__(self, name):
        fn = getattr(np, name, None) or getattr(np, name[:-1], None)
        if fn is None:
            raise AttributeError(f"libdevice.{name} has no numpy counterpart in the simulator")
        return fn


def _libdevice():
    import os
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return _SimulatedLibdevice()
    from numba.cuda import libdevice
    return libdevice


def kernel_function(source: str, cuda_module):
    """The kernel's Python function (not yet compiled)."""
    ns = namespace(cuda_module)
    exec(compile(source, "<cuvil gpu kernel>", "exec"), ns)
    return ns["kernel"]
