"""Sizes of the libraries of the example and ResNet-18 for this machine and the cross targets
(docs/cross.md), and how long one run takes under qemu-aarch64 or Wine (emulated: not the speed
of an aarch64 machine; Wine runs x86-64 code natively but starts a Windows environment) or, for
wasm32, in wasmtime (with the module's compilation by Cranelift; benchmarks/wasm_speed.py times
the runs alone).

    python benchmarks/cross_sizes.py [--targets native aarch64-linux] [--no-run]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def models():
    from tests import zoo
    yield "tiny_cnn (the example)", ROOT / "examples/models/tiny_cnn.onnx", {"input": [1, 3, 32, 32]}
    yield "resnet18 (224x224)", zoo.export(zoo.resnet((2, 2, 2, 2)), {"input": (1, 3, 224, 224)}), \
        {"input": [1, 3, 224, 224]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["native", "aarch64-linux"])
    parser.add_argument("--no-run", action="store_true", help="do not time a run under qemu or Wine")
    args = parser.parse_args()
    import numpy as np

    from cuvil.build import VariantSpec, build_variant
    from cuvil.cache import Cache, default_cache_dir
    from cuvil.cross import run_emulated
    cache = Cache(default_cache_dir())
    print("| model | target | library bytes | weights bytes | one run (qemu-aarch64 / Wine / wasmtime, with start) |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, source, shapes in models():
            source = source if isinstance(source, Path) else source.SerializeToString()
            for target in args.targets:
                out = Path(tmp) / f"{label.split()[0]}-{target}"
                artifacts = build_variant(VariantSpec("m", source, shapes, target=target), out, cache)
                seconds = "-"
                if target != "native" and not args.no_run:
                    feeds = {k: np.random.default_rng(0).standard_normal(v).astype(np.float32) for k, v in shapes.items()}
                    start = time.perf_counter()
                    run_emulated(artifacts.library, feeds)
                    seconds = f"{time.perf_counter() - start:.2f} s"
                print(f"| {label} | {target} | {artifacts.library.stat().st_size:,} | "
                      f"{artifacts.info['memory']['weights_bytes']:,} | {seconds} |", flush=True)


if __name__ == "__main__":
    main()
