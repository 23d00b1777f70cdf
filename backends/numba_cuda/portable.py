"""CPU kernels that run on the GPU as they are: one GPU thread per CPU work item.

Most CPU generators write plain scalar loops over `[begin, end)` (elementwise ops, indexing,
pooling, reductions, normalisations): that source compiles for Numba CUDA unchanged, as a
device function that each thread calls on its own item. Such a kernel is correct on the GPU,
but its parallelism is the CPU's work items (rows, channels), not the GPU's thousands of
threads: the families that matter for speed have GPU generators of their own (registry.py).
CPU kernels that call the x86 micro-kernels (GEMM, convolution, attention, recurrent cells)
are not portable; `portable_call` says so and the caller reports the node.
"""
from __future__ import annotations

import re

from backends.schedule import KernelCall

from .kernel import gpu_kernel

# What only the CPU backend can compile: x86 micro-kernel declarations (ukernel.py's
# `# cuvil-ukernel` comments), calls into them, and Numba CPU intrinsics.
_CPU_ONLY = re.compile(r"^# cuvil-ukernel |@intrinsic|\bsame_buffer\(", re.M)

# The CPU generators size their work items by the session's threads: asking for many gives the
# portable kernels more GPU threads (items of a row, a channel) where the generator splits finer.
PORTABLE_THREADS = 64

# Threads per block for portable kernels: their items are heavier than an element's.
PORTABLE_BLOCK = 64


def is_portable(source: str) -> bool:
    return not _CPU_ONLY.search(source)


# numpy's rounding ufuncs, which Numba CUDA does not compile: libdevice's, by the kernel's float
# type (math.floor would return an int64, wrong for infinities, NaN and |x| >= 2**63).
_ROUNDING = {"np.floor(": "floor", "np.ceil(": "ceil", "np.rint(": "rint"}


def gpu_source(cpu_source: str, n_args: int, arg_types=()) -> str:
    params = ", ".join(f"p{i}" for i in range(n_args))
    body = cpu_source.replace("def kernel(", "def _cpu_kernel(", 1)
    single = "float64" not in arg_types
    for call, name in _ROUNDING.items():
        body = body.replace(call, f"libdevice.{name}{'f' if single else ''}(")
    body = body.replace('@njit(inline="always")', '@cuda.jit(device=True, inline="always")')
    return (body + "\n\n_cpu_kernel = cuda.jit(device=True, inline=\"always\")(_cpu_kernel)\n\n\n"
            f"def kernel({params}, n):\n"
            "    i = cuda.grid(1)\n"
            "    if i < n:\n"
            f"        _cpu_kernel({params}, i, i + 1)\n")


def portable_call(call: KernelCall) -> KernelCall | None:
    """The GPU form of a CPU kernel call, or None when its source is CPU-only."""
    k = call.kernel
    if call.in_place is not None or call.once or not is_portable(k.source):
        return None
    kernel = gpu_kernel(k.family, gpu_source(k.source, len(k.arg_types), k.arg_types), k.arg_types, PORTABLE_BLOCK,
                        in_place=k.in_place)
    return KernelCall(kernel, call.args, call.work, node=call.node, n_outputs=call.n_outputs)
