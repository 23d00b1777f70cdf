"""`cuvil watch`: rebuild what changed whenever a watched file changes.

Watched: cuvil.yaml, every model's source file and the config's `watch.paths`.
Changes are debounced (`watch.debounce_ms`); then the config is reloaded and
the whole project is built again through the step graph, which reruns only
the steps whose inputs changed, so only the affected variants are rebuilt.
A broken intermediate save (invalid YAML, a truncated model) prints the error
and the watcher keeps going. Artifacts are installed by rename, so a process
that loads a library never sees half a file.
"""
from __future__ import annotations

import time
from pathlib import Path

from .config import load_config
from .errors import CuvilError


def watched_paths(config_path: Path, spec) -> list[Path]:
    paths = {config_path.resolve().parent}  # the folder: editors replace files by rename
    if spec is not None:
        for model in spec.models:
            paths.add(Path(model.source).resolve().parent)
        for entry in spec.watch.paths:
            p = Path(entry)
            paths.add(p if p.is_dir() else p.parent)
    return sorted(p for p in paths if p.exists())


def relevant_change(changes, config_path: Path, spec) -> bool:
    """Ignore our own outputs and cache: only inputs of the build count."""
    ignored = []
    if spec is not None:
        ignored = [spec.output_dir.resolve(), spec.cache.dir.resolve()]
    for _, name in changes:
        path = Path(name).resolve()
        if any(path == d or d in path.parents for d in ignored):
            continue
        if path.name.startswith(".") or path.suffix in (".tmp", ".swp") or path.name.endswith("~"):
            continue
        return True
    return False


def build_once(config_path: Path, jobs: int, say) -> object:
    """One build; returns the spec (or None if the config is broken). Errors are printed, not raised."""
    from .project import build_project
    try:
        spec = load_config(config_path)
    except CuvilError as error:
        say(f"cuvil: error: {error}")
        say("watching for a fix...")
        return None
    start = time.perf_counter()
    try:
        result = build_project(spec, jobs=jobs, progress=None)
    except CuvilError as error:
        say(f"cuvil: error: {error}")
        say("watching for a fix...")
        return spec
    rebuilt = [f"{a.info['name']}/{a.info['target']}" for a in result.artifacts if a.changed]
    what = ", ".join(rebuilt) if rebuilt else "nothing changed"
    say(f"rebuilt {what} in {time.perf_counter() - start:.2f} s ({result.dag.summary()} steps)")
    return spec


def watch(config_path: Path, jobs: int = 1, say=print, stop_event=None, max_builds: int | None = None) -> int:
    import watchfiles

    config_path = Path(config_path)
    spec = build_once(config_path, jobs, say)
    builds = 1
    while max_builds is None or builds < max_builds:
        debounce = spec.watch.debounce_ms if spec is not None else 300
        paths = watched_paths(config_path, spec)
        announced = False
        # The watcher is live once it first yields (a change, or an empty set after rust_timeout): only
        # then is "watching" said, so a save made after the message is never lost (one made while the
        # watcher started was, under load: tests/test_watch.py).
        for changes in watchfiles.watch(*paths, debounce=debounce, stop_event=stop_event, rust_timeout=200,
                                        yield_on_timeout=True, raise_interrupt=False):
            if not announced:
                say(f"watching {', '.join(str(p) for p in paths)} (Ctrl-C to stop)")
                announced = True
            if changes and relevant_change(changes, config_path, spec):
                break
        else:
            return 0  # stopped
        spec = build_once(config_path, jobs, say) or spec
        builds += 1
    return 0
