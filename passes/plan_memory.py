"""plan_memory: choose the schedule for a small arena, and say how to place buffers.

Memory planning has two halves. The order of the nodes decides which tensors
are alive together; this pass chooses it: among the nodes whose inputs are
ready it runs the one that frees the most bytes and allocates the fewest
(ties keep the original order), and keeps the new order only if its peak of
live bytes is lower. The other half, offsets in one arena, needs the kernel
schedule (views, in-place reuse), so codegen does it with
`backends/native/memory.py` (`plan_arena`), using this pass's options:

    strategy   greedy_by_size | best_fit | none    (none: no reuse at all)
    in_place   an elementwise kernel may overwrite an input it reads last; a
               Concat whose inputs are each one contiguous run of its output
               (outer extent 1) has their producers write there directly, where
               the arena does not grow (backends/native/memory.py); at batch > 1
               only the producers that can write their batch blocks a row of
               the output apart (Resize, ConvTranspose, elementwise ops)
    reorder    run the scheduling above

Without this pass in the pass list, codegen places every buffer apart (the
`none` strategy), so `opt_level: 0` shows what planning saves.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from cuvil.ir import Graph
from cuvil.ops import VIEW_OPS, is_random_dropout  # their output shares the input's bytes (backends/numba_cpu/views.py)


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    strategy: Literal["greedy_by_size", "best_fit", "none"] = "greedy_by_size"
    in_place: bool = True
    reorder: bool = True


def _storage(graph: Graph) -> dict[str, str]:
    """value -> the value that owns its bytes (views share their source's)."""
    owner = {}
    for node in graph.nodes:
        for out in node.outputs:
            if out:
                owner[out] = owner.get(node.inputs[0], node.inputs[0]) if node.op in VIEW_OPS and not node.domain \
                    and not is_random_dropout(node, graph) else out
    return owner


def peak_bytes(graph: Graph, order) -> int:
    """The most bytes of intermediate tensors alive at once when nodes run in `order`."""
    owner = _storage(graph)
    external = set(graph.inputs) | set(graph.outputs) | {v.name for v in graph.constants()}
    last = {}
    for step, node in enumerate(order):
        for name in node.inputs:
            if name:
                last[owner.get(name, name)] = step
    live = peak = 0
    dying: dict[int, list[str]] = {}
    for step, node in enumerate(order):
        for out in node.outputs:
            if out and owner.get(out) == out and out not in external:
                live += graph.values[out].nbytes
                dying.setdefault(last.get(out, step), []).append(out)
        peak = max(peak, live)
        live -= sum(graph.values[v].nbytes for v in dying.pop(step, []))
    return peak


def _memory_order(graph: Graph) -> list:
    owner = _storage(graph)
    external = set(graph.inputs) | set(graph.outputs) | {v.name for v in graph.constants()}
    index = {n.name: k for k, n in enumerate(graph.nodes)}
    producers = graph.producers()
    readers: dict[str, set[str]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            if name:
                readers.setdefault(owner.get(name, name), set()).add(node.name)
    waiting = {n.name: {producers[i].name for i in n.inputs if i in producers} for n in graph.nodes}
    users = {}
    for name, deps in waiting.items():
        for dep in deps:
            users.setdefault(dep, set()).add(name)
    by_name = {n.name: n for n in graph.nodes}
    ready = sorted((index[n], n) for n, deps in waiting.items() if not deps)
    done, order = set(), []

    def gain(node):
        allocated = sum(graph.values[o].nbytes for o in node.outputs if o and owner.get(o) == o and o not in external)
        freed = sum(graph.values[b].nbytes for b in {owner.get(i, i) for i in node.inputs if i}
                    if b not in external and readers.get(b, set()) - done <= {node.name})
        return allocated - freed

    while ready:
        best = min(ready, key=lambda item: (gain(by_name[item[1]]), item[0]))
        ready.remove(best)
        node = by_name[best[1]]
        done.add(node.name)
        order.append(node)
        for user in sorted(users.get(node.name, ()), key=index.get):
            waiting[user].discard(node.name)
            if not waiting[user]:
                ready.append((index[user], user))
    return order


def plan_memory(graph: Graph, options: Options = Options()) -> Graph:
    if not options.reorder or len(graph.nodes) < 3:
        return graph
    order = _memory_order(graph)
    if [n.name for n in order] == [n.name for n in graph.nodes] or \
            peak_bytes(graph, order) >= peak_bytes(graph, graph.nodes):
        return graph
    result = graph.copy()
    by_name = {n.name: n for n in result.nodes}
    result.nodes = [by_name[n.name] for n in order]
    return result


def describe(before: Graph, after: Graph) -> str:
    if before is after or [n.name for n in before.nodes] == [n.name for n in after.nodes]:
        return "schedule kept (no order with a lower peak found)"
    return (f"schedule reordered: peak of live tensors {peak_bytes(before, before.nodes) / 2**20:.2f} MiB -> "
            f"{peak_bytes(after, after.nodes) / 2**20:.2f} MiB")
