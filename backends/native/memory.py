"""Static memory plan: every intermediate tensor gets an offset in one arena.

Liveness runs over the schedule: a buffer lives from the step that writes it
to the last step that reads it, views included (a view shares its source's
bytes, so it extends the source's life).

In-place reuse: an elementwise kernel computes output element i from input
element i only, so when one of its inputs has the output's size and dtype and
no later step reads that input's buffer, the output takes over the buffer
(as onnxruntime's allocation planner does). A chain of such ops then runs in
one buffer.

Concat in place: a Concat whose inputs are each one contiguous run of its
output (outer extent 1: numba_cpu/concat.py lists them as ConcatParts) need
not copy. An input whose buffer is its own (not external, not a view into a
larger buffer, not already placed elsewhere) becomes a slice of the output
(`alias` to the output plus `alias_offsets`), so its producer writes straight
into the output; the Concat call goes when every input is placed, or keeps a
one-input copy for each input that is not. At outer extent > 1 (a channel
Concat at batch > 1) an input is `rows` blocks a row of the output apart: it
is placed the same way only where the call writing it has a Strided form for
that row (its generator declared it) and the Concat is its one reader; the
call then becomes that form. Such a Concat is never made a slice of a buffer
its inputs already lie in (there they lie contiguously, not a row apart). A
Concat whose inputs already lie in order in one buffer (a DenseNet block's
growing concatenations of the same features) becomes a slice of that buffer
itself. Concats are taken last first, so the largest one of a chain owns the
features and the earlier ones become its prefixes. A placed buffer lives as
long as the output, from its first producer to the last reader of any part:
each placement (and each Concat made a slice) is kept only if the arena does
not grow (greedy, in that order: a U-Net's long-lived skip feature stays a
copy, the upsampled feature made right before the Concat is placed). Not in
loops (LoopMark), and never into or out of external storage (graph inputs,
outputs, weights).

Placement (64-byte aligned offsets, buffers largest first):
  greedy_by_size  the lowest offset that overlaps no buffer alive at the same
                  time (TFLite's planner);
  best_fit        the smallest gap between such buffers that fits, else the end;
  none            every buffer its own bytes (arena = naive; for debugging).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from backends.schedule import KernelCall, LoopMark, View

ALIGN = 64
STRATEGIES = ("greedy_by_size", "best_fit", "none")



def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class MemoryPlan:
    offsets: dict[str, int]   # root intermediate value -> arena offset
    alias: dict[str, str]     # value -> the value whose storage it shares (views, in-place outputs)
    arena_bytes: int
    naive_bytes: int          # sum of every intermediate, as if nothing were reused
    in_place: dict[str, str] = field(default_factory=dict)  # output -> the input whose buffer it took over
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)  # root -> (first step, last step)
    strategy: str = "greedy_by_size"
    shared: dict[str, int] = field(default_factory=dict)  # value -> offset in the block the sessions share
    shared_bytes: int = 0
    alias_offsets: dict[str, int] = field(default_factory=dict)  # value -> byte offset in its alias (Concat slices)
    concats: dict[str, str] = field(default_factory=dict)  # Concat node -> how it was written in place


def shared_values(schedule) -> list[str]:
    """The values run-once calls (KernelCall.once) write: made once, shared by every session."""
    return [a for c in schedule if isinstance(c, KernelCall) and c.once for a in c.args[len(c.args) - c.n_outputs:]]


def place_shared_values(plan: MemoryPlan, graph, names) -> MemoryPlan:
    """Give `names` (planned as external: never reused) their bytes in the shared block, which
    the first session of a loaded library allocates and fills and the last one frees."""
    offset = 0
    for name in names:
        plan.shared[name] = offset
        offset += _align(graph.values[name].nbytes)
    plan.shared_bytes = offset
    return plan


def plan_arena(graph, schedule, external: set[str], strategy: str = "greedy_by_size",
                in_place: bool = True, concats: bool = True) -> MemoryPlan:
    """external: values that live outside the arena (graph inputs, outputs, constants). A call
    whose output takes over an input's buffer in its in-place form (KernelCall.in_place) is
    rewritten to that form in `schedule`; with `concats` (and `in_place`), Concats written in
    place are removed from it (or replaced by the copies of the inputs that could not be placed)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown memory strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    views = {call.dst: call.src for call in schedule if isinstance(call, View)}
    chosen: set = set()
    if concats and in_place and strategy != "none":
        plan = _plan(graph, schedule, external, views, strategy, in_place, chosen, trial=True)[0]
        # Greedy: every placement at once, then each Concat's placements together, then each one
        # alone, twice over what was refused (a placement that grows the arena alone may not once
        # others are made: the outer Concat of a chain, once the inner ones are slices of it).
        groups = _concat_choices(graph, schedule, external, views)
        every = {choice for group in groups for choice in group}
        for trying in [[every], [set(group) for group in groups]] + [[{c} for g in groups for c in g]] * 2:
            for choice in trying:
                if choice <= chosen:
                    continue
                trial = _plan(graph, schedule, external, views, strategy, in_place, chosen | choice, trial=True)[0]
                if trial.arena_bytes <= plan.arena_bytes:
                    chosen |= choice
                    plan = trial
            if chosen == every:
                break
    # the chosen plan once more, now rewriting the schedule's own calls
    plan, calls = _plan(graph, schedule, external, views, strategy, in_place, chosen)
    schedule[:] = calls
    return plan


def _plan(graph, schedule, external, views, strategy, in_place, chosen, trial=False) -> tuple[MemoryPlan, list]:
    """The plan with the Concat placements `chosen` (_concat_choices) and the schedule it runs:
    `schedule` less the Concats placed, its calls rewritten to their in-place forms (copies of
    them for a `trial`, which leaves the calls as they are)."""
    if trial:
        schedule = [copy.copy(c) if isinstance(c, KernelCall) else c for c in schedule]
    alias, offsets_in, concats = dict(views), {}, {}
    if chosen:
        schedule = _place_concats(graph, schedule, external, alias, offsets_in, chosen, concats)

    def root(name):
        while name in alias:
            name = alias[name]
        return name

    # Liveness of each buffer (a value and the views of it).
    first, last = {}, {}
    steps = []
    for step, call in enumerate(schedule):
        if isinstance(call, View):
            defs, uses = [], [call.src]
        else:
            outs = call_outputs(graph, call)
            defs = outs
            uses = [a for a in call.args[:len(call.args) - call.n_outputs] if isinstance(a, str)]
        steps.append((defs, uses))
        for name in defs:
            r = root(name)
            first.setdefault(r, step)
            last[r] = max(last.get(r, step), step)
        for name in uses:
            r = root(name)
            last[r] = max(last.get(r, step), step)
    _extend_over_loops(schedule, first, last)
    internal = [r for r in first if r not in external]
    naive = sum(_align(graph.values[r].nbytes) for r in internal)

    taken_over = {}
    if in_place:
        taken_over = _reuse_in_place(graph, schedule, steps, external, alias, root, first, last)
    buffers = sorted(((graph.values[r].nbytes, r) for r in first if r not in external and r not in alias),
                     key=lambda t: (-t[0], t[1]))
    offsets = _place(buffers, first, last, strategy)
    ends = [offsets[r] + _align(max(size, 1)) for size, r in buffers]
    return MemoryPlan(offsets, alias, max(ends, default=0), naive, taken_over,
                      {r: (first[r], last[r]) for _, r in buffers}, strategy,
                      alias_offsets=offsets_in, concats=concats), schedule


def _concat_choices(graph, schedule, external, views) -> list[list]:
    """The Concat placements to try, one list per Concat, Concats last first: as a slice of a
    buffer its inputs already lie in ("view", step; outer extent 1 only), then each input placed
    in it (step, part; at outer extent > 1 only an input whose writer has a Strided form)."""
    if any(isinstance(c, LoopMark) for c in schedule):
        return []
    writers = _writers(graph, schedule)
    groups = []
    for step in reversed(range(len(schedule))):
        call = schedule[step]
        if isinstance(call, KernelCall) and call.parts and call.args[-1] not in external:
            strided = call.parts[0].rows > 1
            group = [] if strided else [("view", step)]
            group += [(step, k) for k, part in enumerate(call.parts)
                      if part.value not in external and not graph.values[part.value].is_const
                      and (not strided or getattr(writers.get(part.value), "strided", None) is not None)]
            if group:
                groups.append(group)
    return groups


def _writers(graph, schedule) -> dict:
    """value -> the kernel call that writes it last."""
    return {name: call for call in schedule if isinstance(call, KernelCall) for name in call_outputs(graph, call)}


def _strided_writer(graph, writers, readers, call, part):
    """The call writing `part` (an input of the Concat `call` at outer extent > 1) when it can
    write straight into the Concat's output: it has a Strided form for the distance between the
    output's rows, and the Concat is the one reader of the value, once; else None."""
    writer = writers.get(part.value)
    form = getattr(writer, "strided", None)
    if form is None or form.row_bytes * part.rows != graph.values[call.args[-1]].nbytes \
            or readers.get(part.value) != 1 or [p.value for p in call.parts].count(part.value) != 1:
        return None
    return writer


def _place_concats(graph, schedule, external, alias, offsets_in, chosen, report) -> list:
    """Apply the placements `chosen` (see _concat_choices) that are valid where they come, last
    Concat first: set `alias` / `offsets_in` of each placed buffer (and each Concat made a slice),
    and return the schedule without the Concats that no longer copy anything."""
    def resolve(name):
        """(the buffer that holds `name`, its byte offset there)."""
        offset = 0
        while name in alias:
            offset += offsets_in.get(name, 0)
            name = alias[name]
        return name, offset

    # Buffers that external values share (a view of a graph input, a graph output's source...).
    touched = {resolve(name)[0] for name in external}
    # The last step writing each buffer: one written again after a Concat (a value some later call
    # updates in place) keeps its copy, which holds the bytes as they were at the Concat.
    # (by the buffer of each value before any placement: alias holds only the views yet)
    own = {name: resolve(name)[0] for call in schedule if isinstance(call, KernelCall)
           for name in call.args if isinstance(name, str)}
    last_write = {}
    for step, call in enumerate(schedule):
        if isinstance(call, KernelCall):
            for name in call_outputs(graph, call):
                last_write[own[name]] = step
    # Who writes each value, and how many times it is read (a value placed at outer extent > 1
    # lies in blocks a row apart, which only the Concat reads: see _strided_writer).
    writers, readers = _writers(graph, schedule), {}
    for call in schedule:
        names = [call.src] if isinstance(call, View) else \
            [a for a in call.args[:len(call.args) - call.n_outputs] if isinstance(a, str)]
        for name in names:
            readers[name] = readers.get(name, 0) + 1
    result: dict[int, list] = {}
    for step in reversed(range(len(schedule))):
        call = schedule[step]
        if not isinstance(call, KernelCall) or not call.parts:
            continue
        y = call.args[-1]
        y_root = resolve(y)[0]
        if y in external or y_root in touched:
            continue
        where = [resolve(part.value) for part in call.parts]
        if any(last_write.get(own.get(part.value, part.value), -1) > step for part in call.parts):
            continue
        base = where[0][1] - call.parts[0].offset
        rows = call.parts[0].rows
        if ("view", step) in chosen and rows == 1 and y not in alias and where[0][0] not in touched and all(
                r == where[0][0] != y and off - part.offset == base >= 0
                for (r, off), part in zip(where, call.parts)):
            alias[y], offsets_in[y] = where[0][0], base
            report[call.node] = f"a slice of '{where[0][0]}' (its inputs already lie there in order)"
            result[step] = []
            continue
        copies = []
        for k, part in enumerate(call.parts):
            r, off = resolve(part.value)   # (again: an input met twice is placed at its first run)
            value = graph.values[part.value]
            placed = (step, k) in chosen and off == 0 and r != resolve(y)[0] and r not in touched \
                and graph.values[r].nbytes == value.nbytes and graph.values[r].shape_from is None
            writer = _strided_writer(graph, writers, readers, call, part) if placed and rows > 1 else None
            if placed and (rows == 1 or (writer is not None and r == part.value)):
                alias[r], offsets_in[r] = y, part.offset
                if writer is not None:   # it now writes its blocks a row of the output apart
                    form = writer.strided
                    writer.kernel, writer.work, writer.strided, writer.in_place = form.kernel, form.work, None, None
            else:
                copies.append(copy.copy(part.copy))
        if len(copies) < len(call.parts):
            strided = f" ({rows} blocks each, a row of {graph.values[y].nbytes // rows} bytes apart)" if rows > 1 else ""
            report[call.node] = f"{len(call.parts) - len(copies)} of {len(call.parts)} inputs written in place{strided}"
            result[step] = copies
    return [c for step, call in enumerate(schedule) for c in result.get(step, [call])]


def _extend_over_loops(schedule, first, last) -> None:
    """A loop's body runs again after its last step: a buffer made before the loop and read in it
    lives to the loop's end (LoopMark; its state is read by the end mark, so it lives as long)."""
    begins = {}
    for step, call in enumerate(schedule):
        if isinstance(call, LoopMark):
            if call.kind == "begin":
                begins[call.loop] = step
            else:
                b = begins[call.loop]
                for r in list(last):
                    if first.get(r, -1) < b <= last[r] < step:
                        last[r] = step


def _reuse_in_place(graph, schedule, steps, external, alias, root, first, last) -> dict[str, str]:
    """Let an elementwise kernel's output take over an input buffer whose last reader it is, and a
    call with an in-place form (KernelCall.in_place) the buffer of its in-place input: the call
    then becomes that form."""
    taken_over = {}
    for step, call in enumerate(schedule):
        # (an in-place form may also write a scratch output before its output: a conv's float32 tiles)
        if not isinstance(call, KernelCall) or (call.n_outputs != 1 and call.in_place is None):
            continue
        if call.kernel.in_place:
            candidates = steps[step][1]
        elif call.in_place is not None:
            # Not when the call reads the same buffer through another argument (a conv whose
            # residual is its own input): other work items would read what one overwrote.
            value = call.in_place.value
            others = list(steps[step][1])
            others.remove(value)
            candidates = [] if root(value) in {root(a) for a in others} else [value]
        else:
            continue
        out = steps[step][0][-1]
        if out in external or out in alias:
            continue
        out_value = graph.values[out]
        for name in candidates:
            r = root(name)
            value = graph.values[name]
            if r in external or r == out or last.get(r) != step or value.size != out_value.size \
                    or np.dtype(value.dtype) != np.dtype(out_value.dtype):
                continue
            alias[out] = name
            last[r] = max(last[r], last.pop(out))
            first.pop(out)
            taken_over[out] = name
            if call.in_place is not None and call.in_place.value == name:
                form = call.in_place
                call.kernel, call.args, call.work, call.in_place = form.kernel, form.args, form.work, None
            break
    return taken_over


def _place(buffers, first, last, strategy) -> dict[str, int]:
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets = {}
    cursor = 0
    for size, name in buffers:
        size = _align(max(size, 1))
        if strategy == "none":
            offsets[name], cursor = cursor, cursor + size
            continue
        lo, hi = first[name], last[name]
        conflicts = sorted((o, e) for o, e, f, l in placed if not (l < lo or f > hi))
        gaps, offset = [], 0
        for o, e in conflicts:
            if o - offset >= size:
                gaps.append((o - offset, offset))
            offset = max(offset, e)
        if strategy == "greedy_by_size":
            offset = gaps[0][1] if gaps else offset
        else:  # best_fit: the tightest gap, else after every conflict
            offset = min(gaps)[1] if gaps else offset
        offsets[name] = offset
        placed.append((offset, offset + size, lo, hi))
    return offsets


def call_outputs(graph, call: KernelCall) -> list[str]:
    """The value names a kernel call writes: by convention its trailing `n_outputs` arguments."""
    return [a for a in call.args[len(call.args) - call.n_outputs:] if isinstance(a, str)]
