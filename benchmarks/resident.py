"""Peak resident memory of a C program that loads a library and runs it: the design document's
per-instance figure (ResNet-50 compiled with enable_fp16=True: <= 85 MB).

Each library runs in cuvil's C timing program (cuvil/bench.py: dlopen, session_create, runs,
session_destroy; no Python in the process), and the figure is that process's peak RSS as the
kernel reports it (VmHWM of /proc/self/status, printed by the program as it ends).

    python benchmarks/resident.py                               # ResNet-50: fp32, bf16, fp16
    python benchmarks/resident.py --models resnet18 --precision fp16 --passes-with-winograd
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = {
    "resnet50": lambda zoo: zoo.resnet((3, 4, 6, 3), bottleneck=True),
    "resnet18": lambda zoo: zoo.resnet(),
    "mobilenet_v2": lambda zoo: zoo.mobilenet_v2(),
}
IMAGE = (1, 3, 224, 224)


def peak_rss_mb(library: Path, runs: int) -> tuple[float, float]:
    """(peak RSS in MB, median ms per run) of the C program running `library`."""
    from cuvil.bench import run_harness
    try:
        result = run_harness(library, runs, warmup=1)
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"{library}: the C program failed ({error.returncode}): {error.stderr.strip()}") from None
    # VmHWM, the peak of this process's own memory map: a fork's ru_maxrss would count the pages
    # of the Python process it was forked from (Linux keeps the high-water mark across exec)
    hwm = next(int(line.split()[1]) for line in result.stderr.splitlines() if line.startswith("VmHWM:"))
    return hwm / 1024, float(np.median([float(t) for t in result.stdout.split()])) * 1e-6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--precision", default="fp32,bf16,fp16")
    parser.add_argument("--passes-with-winograd", action="store_true",
                        help="also build reduced precisions with the winograd pass (an explicit pass list)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)

    import cuvil
    from passes import resolve_passes
    from tests import zoo
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = zoo.export(MODELS[name](zoo), {"input": IMAGE})
            variants = [(p, None) for p in args.precision.split(",")]
            if args.passes_with_winograd:
                variants += [(p, resolve_passes(2, None, ())) for p in args.precision.split(",") if p != "fp32"]
            for precision, passes in variants:
                compiled = cuvil.compile(model, input_shapes={"input": list(IMAGE)}, precision=precision,
                                         passes=passes, name=name, jobs=2, cache_dir=args.cache_dir)
                library = Path(tmp) / f"{name}-{precision}{'-winograd' if passes else ''}.so"
                library.write_bytes(Path(compiled.path).read_bytes())
                compiled.close()
                rss, ms = peak_rss_mb(library, args.runs)
                rows.append((name, precision + (" + winograd" if passes else ""), library.stat().st_size / 1e6, rss, ms))
                print(f"{name:14s} {rows[-1][1]:16s} library {rows[-1][2]:7.1f} MB   peak RSS {rss:7.1f} MB   "
                      f"median {ms:8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
