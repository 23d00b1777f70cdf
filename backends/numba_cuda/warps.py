"""Reductions across threads for generated GPU source, and the portable fallback of GPU generators.

A row kernel (rows.py, attention.py) reduces a value over the threads of a group: a power of
two of lanes within one warp (a butterfly of `lane_xor` exchanges leaves the result on every
lane of the group), or a whole block (a butterfly per warp, then the warps' partials through
shared memory, combined by every thread in warp order). Both orders are fixed, so the same
inputs give the same bits; and every lane of a group computes `a + b` from the same two
values (in either order, which float addition does not mind), so all lanes agree.

`lane_xor` is a warp shuffle (`shfl_xor_sync`) on the GPU. Numba's CUDA simulator has no
warp shuffles, so there it is the same exchange through shared memory with the whole block in
step: the kernels call it from every thread of the block alike (no thread returns early), which
the GPU does not need but the emulation does.
"""
from __future__ import annotations

from backends.schedule import KernelCall, Lowered
from cuvil.errors import UnsupportedOpError

from .portable import PORTABLE_THREADS, portable_call

LANE_XOR = '''
if hasattr(cuda, "shfl_xor_sync"):
    @cuda.jit(device=True, inline="always")
    def lane_xor(v, m):
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, m)
else:  # Numba's CUDA simulator (no warp shuffles): an exchange through shared memory
    def lane_xor(v, m):
        exchange = cuda.shared.array(1024, float32)
        t = cuda.threadIdx.x
        exchange[t] = v
        cuda.syncthreads()
        w = exchange[t ^ m]
        cuda.syncthreads()
        return w
'''

WARP = 32

_COMBINE = {"sum": "{a} + {b}", "max": "max({a}, {b})", "min": "min({a}, {b})"}


def combine(op: str, a: str, b: str) -> str:
    return _COMBINE[op].format(a=a, b=b)


def allreduce(src, var: str, op: str, group: int, partials: str | None = None) -> None:
    """Lines leaving in `var`, on every thread of its group, `op` ('sum', 'max', 'min') of `var`
    over the group: `group` lanes of a warp (a power of two up to 32), or the whole block when
    `group` > 32, the warps' partials passing through the shared array `partials` (group // 32
    floats, declared by the kernel, one per reduction: no barrier is needed to reuse it)."""
    m = min(group, WARP) // 2
    while m >= 1:
        src.line(f"{var} = {combine(op, var, f'lane_xor({var}, {m})')}")
        m //= 2
    if group <= WARP:
        return
    assert partials is not None and group % WARP == 0
    src.line("if cuda.threadIdx.x % 32 == 0:").indent().line(f"{partials}[cuda.threadIdx.x // 32] = {var}").dedent()
    src.line("cuda.syncthreads()")
    src.line(f"{var} = {partials}[0]")
    for w in range(1, group // WARP):
        src.line(f"{var} = {combine(op, var, f'{partials}[{w}]')}")


def next_pow2(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def portable_lowering(node, graph, cpu_generator) -> Lowered:
    """The node as the CPU generator lowers it, each kernel run as portable GPU threads: what a GPU
    generator returns for the variants it does not specialise (other dtypes, layouts)."""
    from backends.numba_cpu.kernel import lowering_for
    with lowering_for(PORTABLE_THREADS):
        calls = cpu_generator(node, graph).calls
    out = []
    for call in calls:
        gpu = portable_call(call) if isinstance(call, KernelCall) else call
        if gpu is None:
            raise UnsupportedOpError(f"node '{node.name}' ({node.op}): no GPU kernel for this variant")
        out.append(gpu)
    return Lowered(out)
