"""Static memory plan: every intermediate tensor gets an offset in one arena.

Liveness runs over the schedule (a buffer lives from the step that writes it
to the last step that reads it, views included); buffers are then placed
largest first at the lowest 64-byte aligned offset that overlaps no buffer
alive at the same time (greedy by size, as TFLite's planner does).
"""
from __future__ import annotations

from dataclasses import dataclass

from backends.numba_cpu.kernel import KernelCall, View

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class MemoryPlan:
    offsets: dict[str, int]   # root intermediate value -> arena offset
    alias: dict[str, str]     # value -> the value whose storage it shares (views)
    arena_bytes: int
    naive_bytes: int          # sum of every intermediate, as if nothing were reused


def plan_memory(graph, schedule, external: set[str]) -> MemoryPlan:
    """external: values that live outside the arena (graph inputs, outputs, constants)."""
    alias: dict[str, str] = {}

    def root(name):
        while name in alias:
            name = alias[name]
        return name

    first, last = {}, {}
    for step, call in enumerate(schedule):
        if isinstance(call, View):
            alias[call.dst] = call.src
            uses, defs = [call.src], []
        else:
            names = [a for a in call.args if isinstance(a, str)]
            outs = set(call_outputs(graph, call))
            defs = [a for a in names if a in outs]
            uses = [a for a in names if a not in outs]
        for name in defs:
            r = root(name)
            first.setdefault(r, step)
            last[r] = max(last.get(r, step), step)
        for name in uses:
            r = root(name)
            last[r] = max(last.get(r, step), step)
    buffers = sorted(((graph.values[r].nbytes, r) for r in first if r not in external),
                     key=lambda t: (-t[0], t[1]))
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets = {}
    for size, name in buffers:
        size = _align(max(size, 1))
        lo, hi = first[name], last[name]
        conflicts = sorted((o, e) for o, e, f, l in placed if not (l < lo or f > hi))
        offset = 0
        for o, e in conflicts:
            if offset + size <= o:
                break
            offset = max(offset, e)
        offsets[name] = offset
        placed.append((offset, offset + size, lo, hi))
    arena = max((e for _, e, _, _ in placed), default=0)
    naive = sum(_align(graph.values[r].nbytes) for r in first if r not in external)
    return MemoryPlan(offsets, alias, arena, naive)


def call_outputs(graph, call: KernelCall) -> list[str]:
    """The value names a kernel call writes: by convention its trailing `n_outputs` arguments."""
    return [a for a in call.args[len(call.args) - call.n_outputs:] if isinstance(a, str)]
