"""Every op the GPU target compiles, and how.

GENERATORS holds the GPU generators (one module per op family, like numba_cpu/registry.py); a
generator returns None for a case it leaves to the portable path (another dtype, say). An op
without one is lowered by its CPU generator and runs on the GPU when that generator's
kernels are portable (portable.py), else it is a CuvilError naming the node.
"""
from __future__ import annotations

import dataclasses

from backends.numba_cpu.kernel import lowering_for
from backends.numba_cpu.registry import generator_for as cpu_generator_for
from backends.schedule import KernelCall, View
from cuvil.errors import UnsupportedOpError
from cuvil.ops import FUSED_DOMAIN

from . import conv, conv_tc, gemm, gemm_tc, movement, pool, rnn, rows
from .portable import PORTABLE_THREADS, portable_call

# op -> generator(node, graph) -> Lowered, one module per family (each defines GENERATORS);
# gemm_tc's and conv_tc's wrap gemm's and conv's, taking the bf16 / fp16 products assign_precision marked
GENERATORS: dict = {**gemm.GENERATORS, **gemm_tc.GENERATORS, **conv.GENERATORS, **conv_tc.GENERATORS, **rows.GENERATORS,
                   **rnn.GENERATORS, **pool.GENERATORS, **movement.GENERATORS}



def float32_node(node):
    """The node without assign_precision's mark: a CPU kernel run as portable GPU threads computes in
    float32 (the CPU's 16-bit micro-kernels are x86 code)."""
    if "precision" not in node.attrs:
        return node
    return dataclasses.replace(node, attrs={k: v for k, v in node.attrs.items() if k != "precision"})


def generator_for(node):
    if node.domain in ("", "ai.onnx", FUSED_DOMAIN) and node.op in GENERATORS:
        return GENERATORS[node.op]
    return None


def lower(graph, target=None) -> list:
    """The GPU schedule of a graph: kernel calls and views in node order."""
    schedule = []
    for node in graph.nodes:
        gen = generator_for(node)
        lowered = gen(node, graph) if gen is not None else None   # None: a case it leaves to the portable path
        if lowered is not None:
            schedule.extend(lowered.calls)
            continue
        with lowering_for(PORTABLE_THREADS):
            calls = cpu_generator_for(node)(float32_node(node), graph).calls
        for call in calls:
            if isinstance(call, View):
                schedule.append(call)
                continue
            gpu = portable_call(call) if isinstance(call, KernelCall) else None
            if gpu is None:
                raise UnsupportedOpError(f"node '{node.name}' ({node.op}): no GPU kernel yet for this op "
                                         f"(its CPU kernel '{call.kernel.family}' uses x86 micro-kernels)",
                                         hint="build this model for a CPU target, or see docs/cuda.md for the "
                                              "ops the CUDA targets compile")
            schedule.append(gpu)
    return schedule


def gpu_problem(node, graph) -> str | None:
    """None when the node (one cuvil has a generator for: pipeline.has_kernel) lowers for the GPU,
    else why not (cuvil check)."""
    try:
        lower_node = generator_for(node)
        if lower_node is not None and lower_node(node, graph) is not None:
            return None
        with lowering_for(PORTABLE_THREADS):
            calls = cpu_generator_for(node)(float32_node(node), graph).calls
        for call in calls:
            if isinstance(call, KernelCall) and portable_call(call) is None:
                return f"no GPU kernel yet for {node.op} (its CPU kernel uses x86 micro-kernels)"
    except NotImplementedError:
        return f"the kernel generator for {node.op} is not written yet"
    except UnsupportedOpError as error:
        return error.message
    return None
