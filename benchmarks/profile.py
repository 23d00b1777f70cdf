"""Where a model's time goes: build it, run it from C with CUVIL_PROFILE=1
(the driver then times every step and prints the sums when the session is
destroyed), and print the steps by time and the time per kernel family.

    python benchmarks/profile.py resnet18 [--threads 1] [--runs 30] [--top 25] [--precision bf16|int8]

MODEL is one of benchmarks/bench.py's or of the corpus (benchmarks/corpus_models.py, at
`--batch`, default 1). Thread scaling: `--threads 1,2` builds one library per thread count and
prints each step's time at every count, the speedup, and the time it loses against perfect
scaling (t2 - t1 / 2), worst first: which steps do not scale. `--samples N` takes each step's
minimum over N single-run profiles (each its own process, thread counts interleaved) instead of
the mean of `--runs`: on a shared machine a step a preempted thread held up is then left out.
`--peak G` (GFLOP/s of one core, e.g. 563 for this Zen 5 core's vdpbf16ps) adds a table of the
Conv / Gemm nodes: each node's steps summed (pads, conversions, Winograd transforms included), its
multiply-adds x 2 over that time, the fraction of `threads x G`, and the ms it loses against 85 %
of that peak, the largest loss first: which convs to work on.

    python benchmarks/profile.py yolo_neck --threads 1,2 --samples 50
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def profile_library(library, info, runs=30, warmup=3):
    from cuvil import bench as ctime
    import numpy as np
    size = lambda v: int(np.prod(v["shape"], dtype=np.int64)) * np.dtype(v["dtype"]).itemsize
    args = [str(ctime.harness()), str(library), info.get("symbol_prefix", "cuvil_"), str(runs), str(warmup)]
    args += [str(len(info["inputs"]))] + [str(size(v)) for v in info["inputs"]]
    args += [str(len(info["outputs"]))] + [str(size(v)) for v in info["outputs"]]
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=dict(os.environ, CUVIL_PROFILE="1"))
    steps, total = [], None
    for line in out.stderr.splitlines():
        m = re.match(r"cuvil profile: \d+ runs, ([\d.]+) ms per run", line)
        if m:
            total = float(m.group(1))
            continue
        m = re.match(r"cuvil profile: +(\d+) +([\d.]+) ms +([\d.]+)% +(\S*)\t?(.*)", line)
        if m:
            steps.append((int(m.group(1)), float(m.group(2)), m.group(4), m.group(5)))
    return total, steps


def _build(name, batch, threads, disable, precision):
    import cuvil
    from benchmarks.bench import MODELS
    from benchmarks.corpus_models import CORPUS
    from tests import zoo
    module, shapes = MODELS[name]() if name in MODELS else CORPUS[name][0](batch)
    model = zoo.export(module, shapes)
    if precision == "int8":     # bench.py's quantised file (quantize_static QDQ / quantize_dynamic), built as it is
        import tempfile
        from benchmarks.bench import quantise
        path = Path(tempfile.mkdtemp(prefix="cuvil-profile-")) / f"{name}.onnx"
        path.write_bytes(model.SerializeToString())
        model, precision = str(quantise(name, path, shapes)), "fp32"
    return cuvil.compile(model, input_shapes=shapes, threads=threads, jobs=2, disable_passes=disable,
                         precision=precision)


def node_flops(name: str, batch: int) -> dict:
    """{node name: FLOPs} of the model's Conv, Gemm and MatMul nodes (2 x multiply-adds), named as
    the profile names them: the canonical graph's names (semantic.canonical), which the passes
    keep on the nodes they fuse into a conv."""
    import numpy as np
    from benchmarks.bench import MODELS
    from benchmarks.corpus_models import CORPUS
    from cuvil import pipeline
    from tests import zoo
    module, shapes = MODELS[name]() if name in MODELS else CORPUS[name][0](batch)
    graph = pipeline.canonical_graph(pipeline.import_model(zoo.export(module, shapes), shapes), {})
    flops = {}
    for node in graph.nodes:
        y = graph.values[node.outputs[0]].shape
        if node.op == "Conv":
            w = graph.values[node.inputs[1]].shape
            flops[node.name] = 2 * int(np.prod(y, dtype=np.int64)) * int(np.prod(w[1:], dtype=np.int64))
        elif node.op in ("Gemm", "MatMul"):
            a = graph.values[node.inputs[0]].shape
            k = a[0] if node.op == "Gemm" and node.attr("transA", 0) else a[-1]
            flops[node.name] = 2 * int(np.prod(y, dtype=np.int64)) * int(k)
    return flops


def _print_flops(model, batch, counts, profiles, peak, top):
    """Per Conv / Gemm node at each thread count: ms (its steps summed), GFLOP/s, % of the peak and
    the ms lost against 85 % of it; the largest loss at the last count first."""
    flops = node_flops(model, batch)
    rows = {}
    for t in counts:
        per_node = defaultdict(float)
        for _, ms, _, node in profiles[t][1]:
            per_node[node] += ms
        for node, f in flops.items():
            if node in per_node:
                ms = per_node[node]
                rows.setdefault(node, {})[t] = (ms, f / ms / 1e6, f / ms / 1e6 / (peak * t),
                                                ms - f / (0.85 * peak * t) / 1e6)
    last = counts[-1]
    total = {t: sum(r[t][0] for r in rows.values()) for t in counts}
    lost = {t: sum(r[t][3] for r in rows.values()) for t in counts}
    gflop = sum(flops[n] for n in rows) / 1e9
    print(f"# Conv/Gemm nodes: {gflop:.2f} GFLOP; peak {peak:g} GFLOP/s per core; "
          + "; ".join(f"t={t}: {total[t]:.3f} ms, {gflop / total[t] * 1e3:.0f} GFLOP/s, "
                      f"{lost[t]:.3f} ms over 85 % of peak" for t in counts))
    print(f"{'node':<10}{'MFLOP':>8}" + "".join(f"{f't={t} ms':>9}{'GF/s':>6}{'%pk':>5}{'lost':>7}" for t in counts))
    for node in sorted(rows, key=lambda n: -rows[n][last][3])[:top]:
        print(f"{node:<10}{flops[node] / 1e6:>8.0f}" + "".join(
            f"{rows[node][t][0]:>9.3f}{rows[node][t][1]:>6.0f}{100 * rows[node][t][2]:>5.0f}{rows[node][t][3]:>7.3f}"
            for t in counts))


def _minima(minima, steps):
    """Step by step, the smaller time of two profiles of one library."""
    return steps if minima is None else [(i, min(ms, m[1]), fam, node) for m, (i, ms, fam, node) in zip(minima, steps)]


def main(argv=None):
    from benchmarks.bench import MODELS
    from benchmarks.corpus_models import CORPUS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help=f"one of {', '.join(sorted(set(MODELS) | set(CORPUS)))}")
    parser.add_argument("--batch", type=int, default=1, help="a corpus model's batch size")
    parser.add_argument("--threads", default="1", help="thread count, or counts to compare (1,2)")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--samples", type=int, default=0,
                        help="per-step minimum over this many single-run profiles (instead of --runs' mean)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--disable", action="append", default=[], metavar="PASS",
                        help="build without this pass (repeatable): where the time goes without it")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "int8"),
                        help="build in this precision (default fp32; int8: bench.py's quantised file)")
    parser.add_argument("--peak", type=float, default=0.0,
                        help="GFLOP/s of one core: add the per-node FLOP table (see the docstring)")
    args = parser.parse_args(argv)
    if args.model not in MODELS and args.model not in CORPUS:
        parser.error(f"unknown model {args.model!r}")
    counts = [int(t) for t in args.threads.split(",")]
    built = {t: _build(args.model, args.batch, t, args.disable, args.precision) for t in counts}
    profiles = {}
    if args.samples:
        minima = dict.fromkeys(counts)
        for _ in range(args.samples):   # thread counts interleaved: both see the same machine
            for t in counts:
                minima[t] = _minima(minima[t], profile_library(built[t].artifacts.library, built[t].info, 1)[1])
        profiles = {t: (sum(step[1] for step in minima[t]), minima[t]) for t in counts}
    else:
        profiles = {t: profile_library(built[t].artifacts.library, built[t].info, args.runs) for t in counts}
    how = f"minimum of {args.samples} single runs per step" if args.samples else f"mean of {args.runs} runs"
    if args.peak:
        _print_flops(args.model, args.batch, counts, profiles, args.peak, args.top)
    if len(counts) > 1:
        _print_scaling(args.model, counts, profiles, how, args.top)
        return
    total, steps = profiles[counts[0]]
    print(f"# {args.model} {args.precision}, threads={counts[0]}: {total:.3f} ms per run (sum of steps, {how}), "
          f"{len(steps)} steps")
    families = defaultdict(float)
    for _, ms, fam, _ in steps:
        families[fam] += ms
    for fam, ms in sorted(families.items(), key=lambda kv: -kv[1]):
        print(f"  {fam:<18}{ms:>9.3f} ms {100 * ms / total:>5.1f}%")
    print("# slowest steps")
    for i, ms, fam, node in sorted(steps, key=lambda s: -s[1])[:args.top]:
        print(f"  {i:>4} {ms:>8.3f} ms  {fam:<14} {node}")


def _print_scaling(model, counts, profiles, how, top):
    """Per step: ms at each thread count, the speedup of the last count, and the ms it loses
    against perfect scaling (t_last - t_first * first / last), the largest loss first."""
    first, last = counts[0], counts[-1]
    for t in counts:
        print(f"# {model}, threads={t}: {profiles[t][0]:.3f} ms per run (sum of steps, {how})")
    if len({len(profiles[t][1]) for t in counts}) != 1:
        print("# the builds have different step lists: compare the totals only")
        return
    rows = []
    for k, (i, ms, fam, node) in enumerate(profiles[first][1]):
        times = [profiles[t][1][k][1] for t in counts]
        rows.append((times[-1] - times[0] * first / last, i, times, fam, node))
    print(f"{'step':>5} " + "".join(f"{f't={t} ms':>10}" for t in counts) + f"{'speedup':>9}{'lost ms':>9}  family / node")
    for lost, i, times, fam, node in sorted(rows, key=lambda r: -r[0])[:top]:
        speed = times[0] / times[-1] if times[-1] else float("inf")
        print(f"{i:>5} " + "".join(f"{t:>10.4f}" for t in times) + f"{speed:>9.2f}{lost:>9.4f}  {fam:<14} {node}")
    print(f"# lost in all: {sum(r[0] for r in rows):.3f} ms")


if __name__ == "__main__":
    main()
