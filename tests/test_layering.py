"""The compiler's layering, read from the import statements of every module
(those inside functions too): no import cycle, each layer imports only the
layers below it, and no module imports another's private name.

    core        cuvil.errors, cuvil.ir, cuvil.ops, cuvil.evaluate, cuvil.nbits, cuvil.contrib (imports nothing of ours)
    passes      passes.*                                    core
    schedule    backends.schedule, backends.targets         core
    numba_cpu   backends.numba_cpu.*                        core, schedule
    native      backends.native.*                           core, schedule
    top         the rest of cuvil (pipeline, build, cli...) anything
"""
import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cuvil", "passes", "backends")
CORE = {"cuvil.errors", "cuvil.ir", "cuvil.ops", "cuvil.evaluate", "cuvil.nbits", "cuvil.contrib"}
SCHEDULE = {"backends.schedule", "backends.targets"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: Path, modules) -> list[tuple[str, str]]:
    """(imported module, imported name or '') for each import of one of our modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full, "") if full in modules else (base, alias.name))
    return [(module, what) for module, what in found if module.split(".")[0] in PACKAGES]


def _layer(module: str) -> str:
    if module in CORE:
        return "core"
    if module in SCHEDULE:
        return "schedule"
    for prefix, layer in (("passes", "passes"), ("backends.numba_cpu", "numba_cpu"), ("backends.native", "native")):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "top"


ALLOWED = {
    "core": {"core"},
    "passes": {"core", "passes"},
    "schedule": {"core", "schedule"},
    "numba_cpu": {"core", "schedule", "numba_cpu"},
    "native": {"core", "schedule", "native"},
    "top": {"core", "passes", "schedule", "numba_cpu", "native", "top"},
}


def _graph():
    modules = _modules()
    graph = nx.DiGraph()
    private = []
    for name, path in modules.items():
        graph.add_node(name)
        for module, what in _imports(name, path, modules):
            if module != name:
                graph.add_edge(name, module)
            if what.startswith("_") and not what.startswith("__") and module != name:
                private.append(f"{name} imports {module}.{what}")
    return graph, private


def test_no_import_cycle():
    graph, _ = _graph()
    # A package's __init__ imported for its own submodule is Python's doing, not a dependency.
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if a.startswith(b + ".")])
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_each_layer_imports_only_the_layers_below():
    graph, _ = _graph()
    wrong = [f"{a} ({_layer(a)}) imports {b} ({_layer(b)})" for a, b in graph.edges
             if _layer(b) not in ALLOWED[_layer(a)] and not a.startswith(b + ".")]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_a_private_name():
    _, private = _graph()
    assert not private, "\n".join(private)


def test_the_walk_sees_the_imports():
    """The checks above would pass on an empty graph: the walk finds the pipeline's known edges."""
    graph, _ = _graph()
    assert {("cuvil.build", "cuvil.pipeline"), ("cuvil.pipeline", "backends.native.memory"),
            ("backends.numba_cpu.kernel", "backends.schedule"), ("passes.fuse_activation", "cuvil.ops"),
            ("backends.numba_cpu.emit", "backends.targets")} <= set(graph.edges)
