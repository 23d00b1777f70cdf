"""Time a built cuvil library from C: no Python in the loop (see
cuvil/bench.py for the harness).

    python benchmarks/ctime.py LIB.so [--runs 100] [--warmup 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuvil.bench import harness, time_library  # noqa: E402,F401


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("library")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    times = time_library(args.library, args.runs, args.warmup)
    print(f"{Path(args.library).name}: median {statistics.median(times) * 1e3:.3f} ms, "
          f"min {min(times) * 1e3:.3f} ms over {len(times)} runs (timed in C)")


if __name__ == "__main__":
    main()
