"""Old against new on a shared machine: per-step minima of two (or more) libraries' single-run
profiles taken in turn, so both see the same load.

    # once per code tree (e.g. from /work/main and from a branch's worktree, each with its PYTHONPATH)
    python benchmarks/profile_ab.py build resnet18 --threads 1 --precision bf16 --out /tmp/rn18-old.json
    # then, from either tree
    python benchmarks/profile_ab.py compare /tmp/rn18-old.json /tmp/rn18-new.json --samples 40 --nodes Conv_0,Conv_14

`build` compiles a bench.py / corpus model and keeps its library next to the JSON (the build's own
folder is temporary; `--select measure` builds it with measured kernel selection and prints each
measured node's times and choice; `--batch N` builds a corpus model at batch N); `compare` prints each
library's total, its largest kernel families and the listed nodes' sums (pads and conversions
included) and the listed families' sums, each step the minimum of `--samples` runs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# As bench.py: this folder leaves the path (its profile.py would shadow the standard library's), and
# the repository joins it last, so that a PYTHONPATH naming another checkout builds with that one.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.append(str(ROOT))


def build(args) -> None:
    import cuvil
    from benchmarks.bench import MODELS
    from benchmarks.corpus_models import CORPUS
    from tests import zoo
    module, shapes = MODELS[args.model]() if args.model in MODELS else CORPUS[args.model][0](args.batch)
    lib = cuvil.compile(zoo.export(module, shapes), input_shapes=shapes, threads=args.threads, jobs=2,
                        precision=args.precision, select=args.select,
                        progress=(lambda line: line.startswith("select:") and print(line, flush=True)))
    out = Path(args.out)
    library = out.with_suffix(".so")
    shutil.copy(lib.artifacts.library, library)
    out.write_text(json.dumps({"library": str(library), "info": lib.info}, default=str))
    print(f"{cuvil.__file__}: {library}")


def compare(args) -> None:
    from benchmarks.profile import _minima, profile_library
    libs = [json.loads(Path(p).read_text()) for p in args.libraries]
    minima = [None] * len(libs)
    for _ in range(args.samples):
        for i, lib in enumerate(libs):
            minima[i] = _minima(minima[i], profile_library(lib["library"], lib["info"], 1)[1])
    nodes = [n for n in args.nodes.split(",") if n]
    families = [f for f in args.families.split(",") if f]
    for path, steps in zip(args.libraries, minima):
        family, node = defaultdict(float), defaultdict(float)
        for _, ms, fam, name in steps:
            family[fam] += ms
            node[name] += ms
        top = sorted(family.items(), key=lambda kv: -kv[1])[:8]
        print(f"{path}: {sum(s[1] for s in steps):.3f} ms  " + "  ".join(f"{f} {ms:.3f}" for f, ms in top))
        if nodes:
            print("    " + "  ".join(f"{n} {node[n]:.3f}" for n in nodes if n in node))
        if families:
            print("    " + "  ".join(f"{f} {family.get(f, 0.0):.3f}" for f in families))


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
sub = parser.add_subparsers(dest="command", required=True)
b = sub.add_parser("build")
b.add_argument("model")
b.add_argument("--threads", type=int, default=1)
b.add_argument("--batch", type=int, default=1, help="a corpus model's batch size")
b.add_argument("--precision", default="bf16")
b.add_argument("--select", default="rules", help="rules, or measure: each node's kernel timed here (cuvil/select.py)")
b.add_argument("--out", required=True, help="JSON to write; the library goes beside it (.so)")
c = sub.add_parser("compare")
c.add_argument("libraries", nargs="+")
c.add_argument("--samples", type=int, default=20)
c.add_argument("--nodes", default="", help="nodes whose steps to sum, comma separated")
c.add_argument("--families", default="", help="kernel families whose steps to sum, comma separated")

if __name__ == "__main__":
    args = parser.parse_args()
    build(args) if args.command == "build" else compare(args)
