"""What measured kernel selection (`select: measure`, cuvil/select.py) chooses on corpus models,
against the shape rules: the build is planned (import, passes and the select step, which measures
or reads its cached measurements; no codegen or link), and each node with a choice is printed with
its candidates' times, the kernel measured fastest and the one the rules take.

    python benchmarks/select_corpus.py resnet18,resnet50,vgg_style,unet [--threads 1,2] [--batch 1]

Whether a changed choice changes latency is for benchmarks/profile_ab.py: `build MODEL --select
rules` and `--select measure`, then `compare` (per-step minima of single-run profiles in turn).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# As bench.py: this folder leaves the path (its profile.py would shadow the standard library's).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.append(str(ROOT))


def selection(model: str, batch: int, threads: int) -> dict:
    """The select step's output for one corpus model (node -> kernel, rules, times)."""
    from benchmarks.corpus_models import CORPUS
    from cuvil.build import VariantSpec, plan_variant, tool_versions
    from cuvil.cache import Cache, default_cache_dir
    from cuvil.dag import StepGraph
    from tests import zoo
    module, shapes = CORPUS[model][0](batch)
    spec = VariantSpec(name=model, source=zoo.export(module, shapes).SerializeToString(), input_shapes=shapes,
                       threads=threads, select="measure")
    dag = StepGraph(Cache(default_cache_dir()), tool_versions(), progress=lambda line: print(line, flush=True),
                    jobs=2)
    plan_variant(dag, spec)
    return dag.get(f"{model}/native/select")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", help="comma separated corpus models")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for model in args.models.split(","):
            for node, result in selection(model, args.batch, threads).items():
                rows.append((model, threads, node, result))
    print("\n| model | threads | node | measured | rules | times (ms) |\n|---|---|---|---|---|---|")
    for model, threads, node, result in rows:
        times = ", ".join(f"{name} {ms:.3f}" for name, ms in result["times_ms"].items())
        mark = "" if result["kernel"] == result["rules"] else " **changed**"
        print(f"| {model} | {threads} | {node} | {result['kernel']}{mark} | {result['rules']} | {times} |")
    changed = sum(result["kernel"] != result["rules"] for *_, result in rows)
    print(f"\n{len(rows)} nodes with a choice, {changed} chosen otherwise than by the rules")


if __name__ == "__main__":
    main()
