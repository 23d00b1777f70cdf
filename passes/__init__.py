"""Graph passes: each a pure `Graph -> Graph` in a module of its own, named here.

The registry below is the one list of passes `cuvil.yaml` can name; each
opt level runs a fixed prefix-free list of them in order.
"""
from __future__ import annotations

from cuvil.errors import ConfigError

from .eliminate_common import eliminate_common
from .eliminate_dead import eliminate_dead
from .eliminate_identity import eliminate_identity
from .fold_batchnorm import fold_batchnorm
from .fold_constants import fold_constants

PASSES = {
    "fold_constants": fold_constants,
    "eliminate_identity": eliminate_identity,
    "eliminate_common": eliminate_common,
    "fold_batchnorm": fold_batchnorm,
    "eliminate_dead": eliminate_dead,
}

_BASIC = ["fold_constants", "eliminate_identity", "eliminate_common", "eliminate_dead"]
OPT_LEVELS = {
    0: [],
    1: _BASIC,
    2: _BASIC[:2] + ["fold_batchnorm"] + _BASIC[2:],
    3: _BASIC[:2] + ["fold_batchnorm"] + _BASIC[2:],
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
