"""A synthetic monorepo of many small models, built on this machine and on Dask clusters.

    python benchmarks/monorepo.py --models 200 --workers 1,2 [--json out.json]
    python benchmarks/monorepo.py --models 200 --scheduler tcp://HOST:8786 --cache-url s3://bucket/x

Writes N small ONNX models (two Gemm layers with a ReLU or a Sigmoid between,
widths drawn from a few sizes, so some kernels are shared between models as in
a real monorepo) and one cuvil.yaml listing them all, then times `cuvil build`
from an empty cache: locally (-j 1), and on a LocalCluster of each worker
count given (processes, one thread each, on 127.0.0.1), or on the cluster at
--scheduler. Reports steps run, wall seconds, steps/s and the speed-up over the
local build, and checks that every library is byte-identical to the local one.
The clusters are started before the clock starts; each worker's first task
still pays for importing numba and llvmlite.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDTHS = (8, 16, 24, 32, 48, 64)


def write_monorepo(folder: Path, count: int, seed: int = 0) -> Path:
    import numpy as np
    from onnx import helper, numpy_helper
    rng = np.random.default_rng(seed)
    models = folder / "models"
    models.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(count):
        d_in, d_hidden, d_out = (int(rng.choice(WIDTHS)) for _ in range(3))
        act = "Relu" if rng.random() < 0.5 else "Sigmoid"
        w1 = rng.standard_normal((d_in, d_hidden)).astype(np.float32)
        w2 = rng.standard_normal((d_hidden, d_out)).astype(np.float32)
        graph = helper.make_graph(
            [helper.make_node("Gemm", ["x", "w1"], ["h"]), helper.make_node(act, ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "w2"], ["y"])],
            f"m{i}", [helper.make_tensor_value_info("x", 1, [1, d_in])],
            [helper.make_tensor_value_info("y", 1, [1, d_out])],
            initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        (models / f"m{i:03d}.onnx").write_bytes(model.SerializeToString())
        entries.append(f"  - {{name: m{i:03d}, source: models/m{i:03d}.onnx}}")
    config = folder / "cuvil.yaml"
    config.write_text("version: 1\noutput_dir: out\ncache: {dir: cache}\nmodels:\n" + "\n".join(entries) + "\n")
    return config


def build(config: Path, out: Path, scheduler: str | None, cache_url: str | None) -> dict:
    """One build from an empty cache; returns its figures."""
    from cuvil.cache import Cache
    from cuvil.config import load_config
    from cuvil.project import build_project, open_project_cache
    spec = load_config(config)
    cache_dir = Path(tempfile.mkdtemp(prefix="cuvil-bench-cache-"))
    update = {"dir": cache_dir}
    if cache_url:
        update["url"] = f"{cache_url.rstrip('/')}/{os.urandom(6).hex()}"
    spec = spec.model_copy(update={"cache": spec.cache.model_copy(update=update)})
    cache = open_project_cache(spec) if cache_url else Cache(cache_dir)
    start = time.perf_counter()
    result = build_project(spec, progress=None, cache=cache, output_dir=out, scheduler=scheduler)
    seconds = time.perf_counter() - start
    steps = result.dag.report()["steps"]
    ran = [s for s in steps if s["status"] == "ran"]
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {"steps": len(ran), "kernels": sum(s["kind"] == "kernel" for s in ran), "seconds": round(seconds, 2),
            "steps_per_s": round(len(ran) / seconds, 1), "workers": len({s["worker"] for s in ran})}


def files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--workers", default="1,2", help="LocalCluster sizes to time (comma-separated)")
    parser.add_argument("--scheduler", help="time this cluster instead of LocalClusters")
    parser.add_argument("--cache-url", help="the shared cache of --scheduler's workers (fsspec URL)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    folder = Path(tempfile.mkdtemp(prefix="cuvil-monorepo-"))
    config = write_monorepo(folder, args.models)
    rows = []
    local = build(config, folder / "out-local", None, None)
    rows.append({"run": "local -j 1", **local})
    print(f"local -j 1: {local}", flush=True)
    reference = files(folder / "out-local")

    def timed(name, scheduler, cache_url, out):
        figures = build(config, out, scheduler, cache_url)
        figures["speedup"] = round(local["seconds"] / figures["seconds"], 2)
        figures["identical"] = files(out) == reference
        rows.append({"run": name, **figures})
        print(f"{name}: {figures}", flush=True)

    if args.scheduler:
        timed(f"cluster {args.scheduler}", args.scheduler, args.cache_url, folder / "out-cluster")
    else:
        from distributed import LocalCluster
        for n in [int(w) for w in args.workers.split(",")]:
            with LocalCluster(n_workers=n, processes=True, threads_per_worker=1, host="127.0.0.1",
                              dashboard_address=None) as cluster:
                timed(f"LocalCluster {n} worker{'s' if n > 1 else ''}", cluster.scheduler_address, None,
                      folder / f"out-{n}")
    print(f"\n{args.models} models, {os.cpu_count()} CPUs")
    print("| run | steps run | kernels | seconds | steps/s | speed-up | identical |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['run']} | {r['steps']} | {r['kernels']} | {r['seconds']} | {r['steps_per_s']} | "
              f"{r.get('speedup', 1.0)} | {r.get('identical', '')} |")
    if args.json:
        args.json.write_text(json.dumps({"models": args.models, "cpus": os.cpu_count(), "runs": rows}, indent=2))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
