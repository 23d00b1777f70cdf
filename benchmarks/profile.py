"""Where a model's time goes: build it, run it from C with CUVIL_PROFILE=1
(the driver then times every step and prints the sums when the session is
destroyed), and print the steps by time and the time per kernel family.

    python benchmarks/profile.py resnet18 [--threads 1] [--runs 30] [--top 25] [--precision bf16]
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


def main(argv=None):
    import cuvil
    from benchmarks.bench import MODELS
    from tests import zoo
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--disable", action="append", default=[], metavar="PASS",
                        help="build without this pass (repeatable): where the time goes without it")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="build in this precision (default fp32)")
    args = parser.parse_args(argv)
    module, shapes = MODELS[args.model]()
    compiled = cuvil.compile(zoo.export(module, shapes), input_shapes=shapes, threads=args.threads, jobs=2,
                              disable_passes=args.disable, precision=args.precision)
    total, steps = profile_library(compiled.artifacts.library, compiled.info, args.runs)
    print(f"# {args.model} {args.precision}, threads={args.threads}: {total:.3f} ms per run (sum of steps), {len(steps)} steps")
    families = defaultdict(float)
    for _, ms, fam, _ in steps:
        families[fam] += ms
    for fam, ms in sorted(families.items(), key=lambda kv: -kv[1]):
        print(f"  {fam:<18}{ms:>9.3f} ms {100 * ms / total:>5.1f}%")
    print("# slowest steps")
    for i, ms, fam, node in sorted(steps, key=lambda s: -s[1])[:args.top]:
        print(f"  {i:>4} {ms:>8.3f} ms  {fam:<14} {node}")


if __name__ == "__main__":
    main()
