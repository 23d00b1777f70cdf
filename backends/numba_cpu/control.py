"""A Loop compiled as a loop: LoopBegin / LoopEnd (domain "cuvil", made by frontends/control_flow.py)
become the schedule's LoopMarks; the driver writes the C `for` between them (backends/native/driver.py)
and the memory plan keeps what the body reads alive for the whole loop (backends/native/memory.py).

    LoopBegin(trip?, cond?, init...) -> (iteration, cond_in, state...)
    <the body's nodes>
    LoopEnd(cond_out?, body_out..., iteration, cond_in, state...) -> (final...)
"""
from __future__ import annotations

from backends.schedule import LoopMark, Lowered


def lower_loop_begin(node, graph) -> Lowered:
    trip, cond = node.inputs[0], node.inputs[1]
    reads = [n for n in (trip, cond) if n] + list(node.inputs[2:])
    return Lowered([LoopMark("begin", int(node.attr("loop")), reads + list(node.outputs), len(node.outputs),
                             len(node.outputs) - 2, has_trip=bool(trip), has_cond=bool(cond), node=node.name)])


def lower_loop_end(node, graph) -> Lowered:
    cond_out = node.inputs[0]
    reads = ([cond_out] if cond_out else []) + list(node.inputs[1:])
    return Lowered([LoopMark("end", int(node.attr("loop")), reads + list(node.outputs), len(node.outputs),
                             len(node.outputs), has_cond=bool(cond_out), node=node.name)])
