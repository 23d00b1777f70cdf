"""Graph passes: each a pure `Graph -> Graph` in a module of its own, named here.

The registry below is the one list of passes `cuvil.yaml` can name; each
opt level runs a fixed prefix-free list of them in order.
"""
from __future__ import annotations

from cuvil.errors import ConfigError

from .eliminate_dead import eliminate_dead

PASSES = {
    "eliminate_dead": eliminate_dead,
}

OPT_LEVELS = {
    0: [],
    1: ["eliminate_dead"],
    2: ["eliminate_dead"],
    3: ["eliminate_dead"],
}


def resolve_passes(opt_level: int = 2, passes=None, disable=()) -> list[str]:
    """The ordered pass list for a model: an explicit list, else the opt level's, minus disabled ones."""
    names = list(passes) if passes is not None else list(OPT_LEVELS[opt_level])
    unknown = [n for n in list(names) + list(disable) if n not in PASSES]
    if unknown:
        raise ConfigError(f"unknown pass {unknown[0]!r}", hint=f"known passes: {', '.join(sorted(PASSES))}")
    return [n for n in names if n not in set(disable)]


def run_passes(graph, names, on_pass=None):
    for name in names:
        before = len(graph.nodes)
        graph = PASSES[name](graph)
        if on_pass:
            on_pass(name, before, len(graph.nodes))
    return graph
