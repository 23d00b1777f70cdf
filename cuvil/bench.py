"""Latency measurement of built libraries, each engine in its own process.

- `time_library` (cuvil/ctime.py): a small C program (compiled once into
  $TMPDIR/cuvil-bench/) opens the library with dlopen, creates a session, fills the
  inputs with fixed pseudo-random values in [-1, 1), runs a warm-up (calls, and at
  least WARMUP_SECONDS) and then times each call of session_run: no Python in the loop.
- `cuvil_py_times`: the same through the Python runtime (ctypes), in a fresh process.
- `ort_times`: onnxruntime on the ONNX model, same thread count, in a fresh process.
- `openvino_times`: OpenVINO's CPU plugin on the ONNX model, when it is installed
  (`openvino_version`), same thread count, float32 inference, in a fresh process.

`run_bench` is `cuvil bench`: it builds a model when given one, times each engine
in rounds of processes and compares their best process medians. benchmarks/
(bench.py, gemm.py, convs.py) use the timing functions directly.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# the C timing program (cuvil/ctime.py), which benchmarks/ use from here
from .ctime import BUILD, HARNESS, WARMUP_SECONDS, harness, run_harness, time_library  # noqa: F401
from .errors import CuvilError

ROOT = Path(__file__).resolve().parents[1]


# The timing processes: each reads a JSON job on argv, prints a JSON list of seconds. A worker
# is _PRELUDE (the job, the inputs), an engine's part, which binds `run` to one call of the engine
# on `feeds` (functools.partial: no Python frame of ours around the call), then _TIMED_CALLS.
_PRELUDE = r"""
import functools, json, sys, time
import numpy as np
job = json.loads(sys.argv[1])
feeds = {k: np.random.default_rng(1).standard_normal(s).astype(np.float32) for k, s in job["shapes"].items()}
if job.get("feeds"):  # given inputs (.npz): integer inputs such as a graph's edge list
    feeds.update(np.load(job["feeds"]))
"""

_TIMED_CALLS = r"""
start = time.perf_counter()
calls = 0
while calls < job["warmup"] or time.perf_counter() - start < job["warmup_seconds"]:
    run()
    calls += 1
times = []
for _ in range(job["runs"]):
    t = time.perf_counter()
    run()
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""

_ORT_WORKER = r"""
import onnxruntime as ort
so = ort.SessionOptions()
so.intra_op_num_threads = job["threads"]
so.inter_op_num_threads = 1
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
sess = ort.InferenceSession(job["model"], so, providers=["CPUExecutionProvider"])
run = functools.partial(sess.run, [o.name for o in sess.get_outputs()], feeds)
"""

_CUVIL_WORKER = r"""
sys.path.insert(0, sys.argv[2])
from cuvil.runtime import Library
run = functools.partial(Library(job["library"]).session().run, feeds)
"""


# OpenVINO's CPU plugin infers in bfloat16 by default on CPUs with AVX512_BF16 or AMX: the
# precision hint keeps it in the precision cuvil is timed in (float32 unless asked). One stream of `threads` threads,
# latency mode. The inputs are shared with the request (no copy per call); the outputs come
# back as new arrays, as onnxruntime's and cuvil's do.
_OV_WORKER = r"""
import openvino as ov
core = ov.Core()
model = core.read_model(job["model"])
model.reshape({name: ov.PartialShape(shape) for name, shape in job["shapes"].items()})
config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": job["hint"], "NUM_STREAMS": 1,
          "INFERENCE_NUM_THREADS": job["threads"]}
request = core.compile_model(model, "CPU", config).create_infer_request()
if job.get("save_output"):
    np.save(job["save_output"], request.infer(feeds)[0])
run = functools.partial(request.infer, feeds, share_inputs=True)
"""


def _worker(script: str, job: dict) -> list[float]:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + script + _TIMED_CALLS, json.dumps(job), str(ROOT)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ort_times(model_path, shapes, threads, runs, warmup=None, feeds=None) -> list[float]:
    """`feeds`: an .npz of inputs that replace the random float ones (integer inputs)."""
    return _worker(_ORT_WORKER, {"model": str(model_path), "shapes": {k: list(v) for k, v in shapes.items()},
                                 "threads": threads, "runs": runs, "warmup": warmup or max(3, runs // 10),
                                 "warmup_seconds": WARMUP_SECONDS, "feeds": str(feeds) if feeds else None})


def openvino_version() -> str | None:
    """OpenVINO's version when it is installed, else None (it is an optional engine)."""
    import importlib.metadata
    try:
        return importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        return None


OPENVINO_HINTS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}   # INFERENCE_PRECISION_HINT by cuvil precision


def openvino_times(model_path, shapes, threads, runs, warmup=None, save_output=None,
                   precision: str = "fp32") -> list[float]:
    """Seconds per call of OpenVINO's CPU plugin on the ONNX model, inferring in `precision`
    (OPENVINO_HINTS), in a fresh process; `save_output`: a .npy path for the model's first output
    on the same inputs (to check it)."""
    return _worker(_OV_WORKER, {"model": str(model_path), "shapes": {k: list(v) for k, v in shapes.items()},
                                "hint": OPENVINO_HINTS[precision],
                                "threads": threads, "runs": runs, "warmup": warmup or max(3, runs // 10),
                                "warmup_seconds": WARMUP_SECONDS,
                                "save_output": str(save_output) if save_output else None})


def cuvil_py_times(library, shapes, runs, warmup=None, feeds=None) -> list[float]:
    """`feeds`: as for ort_times."""
    return _worker(_CUVIL_WORKER, {"library": str(library), "shapes": {k: list(v) for k, v in shapes.items()},
                                   "runs": runs, "warmup": warmup or max(3, runs // 10),
                                   "warmup_seconds": WARMUP_SECONDS, "feeds": str(feeds) if feeds else None})


def ort_time(model, threads=1, runs=20) -> float:
    """Median seconds of onnxruntime on an onnx.ModelProto (its own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        path.write_bytes(model.SerializeToString())
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
                  if i.name not in {t.name for t in model.graph.initializer}}
        return statistics.median(ort_times(path, shapes, threads, runs))



def best_process_median(processes: list[list[float]]) -> float:
    """The lowest of several processes' median call times: how one engine is compared with
    another. On a small shared VM a process keeps the thread placement it was given for its
    whole life (at 2 threads one MobileNetV2 library ran 4.3 ms in one process and 7.0 ms in the
    next, onnxruntime alike), so a median over all calls of a few processes measures the
    placements drawn; each engine's best process compares both at the machine's best."""
    return min(statistics.median(times) for times in processes)


def summary(times: list[float]) -> dict:
    """median / min / p90 in milliseconds."""
    s = sorted(times)
    return {"median_ms": statistics.median(s) * 1e3, "min_ms": s[0] * 1e3,
            "p90_ms": s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3, "runs": len(s)}


VS_ENGINES = ("onnxruntime", "openvino")  # what `cuvil bench --vs` times besides cuvil


def parse_shapes(specs: list[str]) -> dict:
    """`NAME=D1,D2,...` strings (cuvil bench --shape) as {name: [dims]}."""
    shapes = {}
    for spec in specs:
        name, _, dims = spec.partition("=")
        try:
            shapes[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            raise CuvilError(f"--shape {spec!r}: expected NAME=D1,D2,...") from None
    return shapes


def run_bench(target: Path, vs=(), onnx_path: Path | None = None, threads: int = 1, runs: int = 100,
              rounds: int = 1, shapes: dict | None = None, precision: str | None = None) -> dict:
    """`cuvil bench`: time a built library (.so) or build and time an ONNX model, from C and
    through the Python runtime, and each engine of `vs` on the same model, in `rounds` rounds of
    one process per engine. An engine's figure is its best process's median (best_process_median);
    "ratio" compares cuvil with onnxruntime, "ratio_<engine>" with the others. `precision`: the
    model's build precision (a library has its own); OpenVINO infers in the same one,
    onnxruntime in float32."""
    target = Path(target)
    if not target.is_file():
        raise CuvilError(f"file not found: {target}")
    vs = list(dict.fromkeys(vs))
    if "openvino" in vs and openvino_version() is None:
        raise CuvilError("--vs openvino: OpenVINO is not installed",
                         hint="pip install openvino (or this project's bench extra), or leave --vs openvino out")
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as tmp:
        if target.suffix == ".so":
            from .runtime import load
            library_path = target
            info = load(target).info
            if precision and precision != info.get("precision"):
                raise CuvilError(f"--precision {precision}: {target} was built in {info.get('precision')}",
                                 hint="time a model file with --precision, or leave it out for a library")
        else:
            from .api import compile as compile_model
            onnx_path = onnx_path or target
            compiled = compile_model(str(target), input_shapes=shapes or None, threads=threads,
                                     precision=precision or "fp32")
            library_path = compiled.save(Path(tmp) / "lib")
            info = compiled.info
        if vs and onnx_path is None:
            raise CuvilError(f"--vs {vs[0]} needs the ONNX model of the library", hint="pass --onnx FILE.onnx")
        in_shapes = {t["name"]: t["shape"] for t in info["inputs"]}
        warmup = max(3, runs // 10)
        rows = {"cuvil (C)": [], "cuvil (Python)": []} | {engine: [] for engine in vs}  # times per process
        threads = int(info.get("threads", threads))
        for _ in range(rounds):
            rows["cuvil (C)"].append(time_library(library_path, runs, warmup, info))
            rows["cuvil (Python)"].append(cuvil_py_times(library_path, in_shapes, runs, warmup))
            if "onnxruntime" in vs:
                rows["onnxruntime"].append(ort_times(onnx_path, in_shapes, threads, runs, warmup))
            if "openvino" in vs:
                rows["openvino"].append(openvino_times(onnx_path, in_shapes, threads, runs, warmup,
                                                       precision=info.get("precision", "fp32")))
    results = {}
    for key, processes in rows.items():
        results[key] = summary([t for times in processes for t in times])
        results[key]["process_median_ms"] = best_process_median(processes) * 1e3
    for engine in vs:
        for key in ("cuvil (C)", "cuvil (Python)"):
            results[key][ratio_name(engine)] = results[key]["process_median_ms"] / results[engine]["process_median_ms"]
    return {"library": str(library_path) if target.suffix == ".so" else None, "model": info.get("name"),
            "target": info.get("target"), "threads": info.get("threads"), "precision": info.get("precision"),
            "vs": vs, "results": results}


def ratio_name(engine: str) -> str:
    """The results key of cuvil's ratio to `engine`: "ratio" for onnxruntime, else "ratio_<engine>"."""
    return "ratio" if engine == "onnxruntime" else f"ratio_{engine}"
