"""Speed on models nobody tuned for: cuvil against onnxruntime and OpenVINO over a broad corpus.

The corpus (benchmarks/corpus_models.py, 25 models) is built here from code and configs, with
seeded random weights; nothing is downloaded: transformers configs (ViT-tiny, DeiT, ConvNeXt,
Whisper-tiny's encoder, Wav2Vec2's feature encoder, DistilBERT, T5-small's encoder), torch
definitions of classic CNNs (VGG, DenseNet, EfficientNet, U-Net, a YOLO-style neck with
Upsample + Concat, a DBNet-style text detector at 640 x 640), audio front ends (the STFT as a
Conv1d, 1 -> 258 channels, kernel 256, stride 128; the issue's STFT + Conv1d + LSTM model; a
log-mel front end; a dilated 1-D conv stack; a streaming VAD with its LSTM state in and out)
and the zoo of benchmarks/bench.py. Each model runs at batch 1 and at a larger batch.

For every (model, batch, threads): export to ONNX (torch's TorchScript exporter, opset 17),
build with cuvil, check its first output against onnxruntime's, then time, each engine in its
own process and `--rounds` processes each (cuvil.bench): cuvil from C (`cuvil C`) and through
its Python runtime (`cuvil py`), onnxruntime and OpenVINO (float32, latency mode) through
Python. An engine's figure is its best process's median; ratio = cuvil py / engine (both timed
through Python: the same call overhead); < 1 means cuvil is faster. An export or build error is
a row of the table, not the end of the run. The last three columns say what else took the
cores while a row was timed: the hypervisor's steal time (ms) and the timing processes' involuntary
context switches (`disturbance`), and how far apart the first two CPUs were (`c2c ns`: a cache
line's round trip between them before and after the row, the larger; cuvil.ctime.PINGPONG). On a VM
it reads 80-120 ns or, for minutes at a time, 350-370 ns; then a 2-thread row whose steps read what
the other core wrote can take twice as long (docs/performance.md, fifth session).

`--report` adds per-op accounting: cuvil's per-step profile (CUVIL_PROFILE=1, from C) next to
onnxruntime's own profiler (SessionOptions.enable_profiling, per-node kernel times), both
mapped to the ONNX nodes of the exported model and grouped by op and shape class (a Conv's
rank, kernel, stride, groups and output size; a MatMul's operand kind and its N tail), one
table per model and one over the corpus with the worst model ratio of each class.

    python benchmarks/corpus.py [--models vit_tiny,stft_conv] [--quick] [--batches 1,big] [--threads 1,2]
                                [--runs 30] [--rounds 3] [--report] [--json out.json] [--no-openvino]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/profile.py would shadow the standard library's `profile` (see bench.py).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.corpus_models import CORPUS, QUICK  # noqa: E402


def export(name: str, batch: int, path: Path) -> dict:
    """The model exported to `path`; returns its input shapes."""
    from tests import zoo
    module, shapes = CORPUS[name][0](batch)
    path.write_bytes(zoo.export(module, shapes).SerializeToString())
    return shapes


def rel_err(got, ref) -> float:
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-6))


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text[:150]


# -- per-op accounting ---------------------------------------------------------------------------------

_ORT_PROFILE = r"""
import json, sys, numpy as np, onnxruntime as ort
job = json.loads(sys.argv[1])
so = ort.SessionOptions()
so.intra_op_num_threads = job["threads"]
so.inter_op_num_threads = 1
so.enable_profiling = True
so.profile_file_prefix = job["prefix"]
sess = ort.InferenceSession(job["model"], so, providers=["CPUExecutionProvider"])
feeds = {k: np.random.default_rng(1).standard_normal(s).astype(np.float32) for k, s in job["shapes"].items()}
for _ in range(job["warmup"]):
    sess.run(None, feeds)
print(sess.end_profiling())
"""


def ort_node_times(model_path, shapes, threads, runs) -> tuple[dict, dict]:
    """onnxruntime's profiler in its own process: ms per run by node name, and each node's op.
    The profile covers every call; the first (session warm-up) is dropped."""
    with tempfile.TemporaryDirectory(prefix="corpus-ortprof-") as tmp:
        job = {"model": str(model_path), "shapes": {k: list(v) for k, v in shapes.items()}, "threads": threads,
               "warmup": runs + 1, "prefix": str(Path(tmp) / "ort")}
        out = subprocess.run([sys.executable, "-c", _ORT_PROFILE, json.dumps(job)], check=True, capture_output=True,
                             text=True)
        events = json.loads(Path(out.stdout.strip().splitlines()[-1]).read_text())
    per_call = defaultdict(list)
    ops = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            node = e["name"][:-len("_kernel_time")]
            per_call[node].append(e["dur"] * 1e-3)
            ops[node] = e.get("args", {}).get("op_name", "?")
    return {n: sum(sorted(v)[:-1] if len(v) > runs else v) / runs for n, v in per_call.items()}, ops


def onnx_classes(model_path, shapes) -> dict:
    """ONNX node name -> (op, shape class), from the exported model with its static shapes."""
    import onnx
    from onnx import numpy_helper, shape_inference
    model = onnx.load(str(model_path))
    for inp in model.graph.input:
        if inp.name in shapes:
            for d, v in zip(inp.type.tensor_type.shape.dim, shapes[inp.name]):
                d.dim_value = v
    model = shape_inference.infer_shapes(model)
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    consts = {t.name: numpy_helper.to_array(t).shape for t in model.graph.initializer}
    consts.update({n.output[0]: None for n in model.graph.node if n.op_type == "Constant"})
    classes, producers = {}, {}
    for node in model.graph.node:
        shape = lambda name: list(consts[name]) if consts.get(name) is not None else dims.get(name, [])
        classes[node.name] = (node.op_type, shape_class(node, shape, consts))
        producers.update({out: node for out in node.output})
    return classes, producers


def resolve(name: str, op: str, classes: dict, producers: dict):
    """The (op, class) of the ONNX node an engine's step or profiled node stands for: its own name;
    a name an optimiser extended (onnxruntime's '<node>/MatMulAddFusion', cuvil's
    '<node>_residual_view'); or onnxruntime's NCHWc '<tensor>_nchwc' for the node that makes the
    tensor, walking back over the activations it fused to the node of its own op. Fused steps
    count under the node they are named after (cuvil's attention under its Softmax)."""
    if name in classes:
        return classes[name]
    parts = name.split("/")
    for cut in range(len(parts) - 1, 0, -1):
        if "/".join(parts[:cut]) in classes:
            return classes["/".join(parts[:cut])]
    for suffix in ("_nchwc", "_residual_view"):
        if name.endswith(suffix):
            base = name[:-len(suffix)]
            if base in classes:
                return classes[base]
            node = producers.get(base)
            for _ in range(4):
                if node is None or node.op_type == op or not node.input:
                    break
                node = producers.get(node.input[0])
            if node is not None:
                return classes[node.name]
    return None


def shape_class(node, shape, consts) -> str:
    """A coarse class of a node's shapes: what selects a kernel, not the exact sizes."""
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Conv":
        w, y = shape(node.input[1]), shape(node.output[0])
        if len(w) < 3:
            return "?"
        rank, kernel = len(w) - 2, w[2:]
        strides = list(attrs["strides"].ints) if "strides" in attrs else [1] * rank
        group = attrs["group"].i if "group" in attrs else 1
        out = int(np.prod(y[2:])) if len(y) > 2 else 0
        kind = ("depthwise" if group > 1 and w[1] == 1 else f"group{group}" if group > 1
                else "1x1" if max(kernel) == 1 else f"k{'x'.join(map(str, kernel))}")
        if kernel == strides and max(kernel) > 2:
            kind = f"patch{'x'.join(map(str, kernel))}"
        stride = f" s{max(strides)}" if max(strides) > 1 else ""
        size = "out?" if out == 0 else "out<=16" if out <= 16 else "out<=256" if out <= 256 else "out>256"
        return f"{rank}d {kind}{stride} cin{'<8' if w[1] < 8 else '>=8'} {size}"
    if node.op_type in ("MatMul", "Gemm"):
        a, b = shape(node.input[0]), shape(node.input[1])
        if not a or not b:
            return "?"
        weights = node.input[1] in consts
        n = b[-1] if not (node.op_type == "Gemm" and "transB" in attrs and attrs["transB"].i) else b[0]
        m = int(np.prod(a[:-1])) if node.op_type == "MatMul" else a[0]
        tail = "N%16" if n % 16 else "N16"
        return f"{'x@W' if weights else 'x@y'} M{'<=16' if m <= 16 else '>16'} {tail}"
    if node.op_type in ("Resize", "Upsample", "Concat"):
        y = shape(node.output[0])
        return f"rank{len(y)}"
    return "-"


def file_node_names(model_path, shapes):
    """step node name -> the model file's node name. The build's passes read the canonical graph
    (cuvil/semantic.py: nodes named '<op>_<position>'), so the profile names canonical nodes; a
    step named after a node plus a suffix ('Conv_3_residual_view') keeps its suffix."""
    from cuvil.pipeline import import_model
    from cuvil.semantic import original_names
    originals = original_names(import_model(str(model_path), shapes))

    def file_name(step_node: str) -> str:
        match = re.match(r"([A-Za-z]+_\d+)(.*)", step_node)
        if match and match.group(1) in originals:
            return originals[match.group(1)] + match.group(2)
        return originals.get(step_node, step_node)
    return file_name


def report_rows(name, batch, threads, library, info, model_path, shapes, runs) -> list[dict]:
    """Per (op, shape class): cuvil's and onnxruntime's ms per run (see the module docstring)."""
    from benchmarks.profile import profile_library
    classes, producers = onnx_classes(model_path, shapes)
    total, steps = profile_library(library, info, runs)
    ort_times, ort_ops = ort_node_times(model_path, shapes, threads, runs)
    file_names = file_node_names(model_path, shapes)
    groups = defaultdict(lambda: [0.0, 0.0])
    for _, ms, family, node in steps:
        groups[resolve(file_names(node), family, classes, producers) or (f"[{family}]", "-")][0] += ms
    for node, ms in ort_times.items():
        op = ort_ops.get(node, "?")
        groups[resolve(node, op, classes, producers) or (f"[{op}]", "-")][1] += ms
    return [{"model": name, "batch": batch, "threads": threads, "op": op, "class": cls, "cuvil_ms": c, "ort_ms": o,
             "ratio": c / o if o > 0 else None} for (op, cls), (c, o) in sorted(groups.items())]


def print_report(rows: list[dict]):
    print(f"{'op':<20}{'shape class':<34}{'cuvil ms':>10}{'ort ms':>10}{'ratio':>8}")
    for r in sorted(rows, key=lambda r: -max(r["cuvil_ms"], r["ort_ms"])):
        if max(r["cuvil_ms"], r["ort_ms"]) < 0.001:
            continue
        ratio = f"{r['ratio']:>8.2f}" if r["ratio"] else f"{'-':>8}"
        print(f"{r['op']:<20}{r['class']:<34}{r['cuvil_ms']:>10.3f}{r['ort_ms']:>10.3f}{ratio}")


def print_class_summary(rows: list[dict]):
    """Over the corpus: per (op, class), the summed times and the worst model ratio."""
    by_class = defaultdict(list)
    for r in rows:
        by_class[r["op"], r["class"]].append(r)
    print("\n# per op and shape class over the corpus (ratio = cuvil / onnxruntime, summed time)")
    print(f"{'op':<20}{'shape class':<34}{'cuvil ms':>10}{'ort ms':>10}{'ratio':>8}  worst (model b thr)")
    for (op, cls), rs in sorted(by_class.items(), key=lambda kv: -sum(r["cuvil_ms"] for r in kv[1])):
        c, o = sum(r["cuvil_ms"] for r in rs), sum(r["ort_ms"] for r in rs)
        if max(c, o) < 0.001:
            continue
        rated = [r for r in rs if r["ratio"] and max(r["cuvil_ms"], r["ort_ms"]) >= 0.005]
        worst = max(rated, key=lambda r: r["ratio"]) if rated else None
        worst_s = f"{worst['ratio']:.2f} ({worst['model']} b{worst['batch']} t{worst['threads']})" if worst else "-"
        ratio = f"{c / o:>8.2f}" if o > 0 else f"{'-':>8}"
        print(f"{op:<20}{cls:<34}{c:>10.3f}{o:>10.3f}{ratio}  {worst_s}")


# -- the timing run --------------------------------------------------------------------------------

def disturbance() -> tuple[float, int]:
    """What else took the cores so far: the hypervisor's steal time in ms (/proc/stat, all CPUs; a
    virtual machine's vCPU run by the host for someone else) and the involuntary context switches
    of this process's finished children (the timing processes: another process was given their
    core). A row whose figures moved when rerun shows it here (docs/performance.md)."""
    import resource
    steal = 0.0
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        steal = int(fields[8]) * 1e3 / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        pass
    return steal, resource.getrusage(resource.RUSAGE_CHILDREN).ru_nivcsw


def bench_one(name, batch, threads, args, workdir: Path, openvino: bool) -> tuple[dict, list]:
    import cuvil
    from cuvil import bench as ctime
    from cuvil.ctime import core_round_trip_ns
    row = {"model": name, "batch": batch, "threads": threads}
    model_path = workdir / f"{name}-b{batch}.onnx"
    try:
        if not model_path.exists():
            row["shapes"] = export(name, batch, model_path)
            (workdir / f"{name}-b{batch}.json").write_text(json.dumps(row["shapes"]))
        shapes = {k: tuple(v) for k, v in json.loads((workdir / f"{name}-b{batch}.json").read_text()).items()}
    except Exception as error:  # noqa: BLE001 - an export error is a row of the table
        return {**row, "error": f"export: {_short(error)}"}, []
    try:
        t = time.perf_counter()
        compiled = cuvil.compile(str(model_path), input_shapes=shapes, threads=threads, jobs=args.jobs, name=name,
                                 cache_dir=args.cache)
        row["build_s"] = time.perf_counter() - t
        library = compiled.save(workdir / f"{name}-b{batch}-t{threads}")
    except Exception as error:  # noqa: BLE001 - a build error is a row of the table
        if args.verbose:
            traceback.print_exc()
        return {**row, "error": f"build: {_short(error)}"}, []
    feeds = {k: np.random.default_rng(1).standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)[0]
    row["rel_err"] = rel_err(compiled.run(feeds)[compiled.info["outputs"][0]["name"]], ref)
    processes = defaultdict(list)
    warm = max(3, args.runs // 10)
    before, round_trip = disturbance(), core_round_trip_ns()
    for _ in range(args.rounds):
        processes["c"].append(ctime.time_library(library, runs=args.runs, warmup=warm, info=compiled.info))
        processes["py"].append(ctime.cuvil_py_times(library, shapes, args.runs, warm))
        processes["ort"].append(ctime.ort_times(model_path, shapes, threads, args.runs, warm))
        if openvino:
            try:
                processes["ov"].append(ctime.openvino_times(model_path, shapes, threads, args.runs, warm))
            except subprocess.CalledProcessError as error:
                row["ov_error"] = error.stderr.strip().splitlines()[-1][:150] if error.stderr else "failed"
                openvino = False
    row["steal_ms"], row["preempted"] = (after - start for after, start in zip(disturbance(), before))
    if round_trip is not None:   # the two CPUs' distance before and after the row (ctime.PINGPONG): the larger
        row["round_trip_ns"] = max(round_trip, core_round_trip_ns())
    best = {k: ctime.best_process_median(v) * 1e3 for k, v in processes.items() if v}
    row.update(cuvil_c_ms=best["c"], cuvil_py_ms=best["py"], ort_ms=best["ort"], ratio=best["py"] / best["ort"])
    if "ov" in best:
        row.update(ov_ms=best["ov"], ratio_ov=best["py"] / best["ov"])
    report = []
    if args.report:
        report = report_rows(name, batch, threads, library, compiled.info, model_path, shapes, args.runs)
    return row, report


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def print_row(r):
    head = f"{r['model']:<20}{r['batch']:>4}{r['threads']:>4}"
    if "error" in r:
        print(f"{head}  {r['error']}", flush=True)
        return
    ov = f"{r['ov_ms']:>10.3f}{r['ratio_ov']:>7.2f}" if "ov_ms" in r else f"{'-':>10}{'-':>7}"
    print(f"{head}{r['cuvil_c_ms']:>11.3f}{r['cuvil_py_ms']:>11.3f}{r['ort_ms']:>10.3f}{r['ratio']:>7.2f}{ov}"
          f"{r['rel_err']:>9.1e}{r['build_s']:>8.1f}{r.get('steal_ms', 0):>7.0f}{r.get('preempted', 0):>8d}"
          f"{r.get('round_trip_ns', 0):>7.0f}", flush=True)


def main(argv=None):
    import cuvil
    from cuvil.bench import openvino_version
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help=f"comma separated, from: {','.join(CORPUS)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help=f"one model of each kind ({','.join(QUICK)}), batch 1, 1 thread, 20 runs x 2 rounds")
    parser.add_argument("--batches", default="1,big", help="batch sizes; 'big' is each model's larger batch")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=30, help="timed calls per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per engine (alternating)")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="parallel kernel compiles")
    parser.add_argument("--cache", help="cuvil's step cache directory (default: cuvil's own)")
    parser.add_argument("--report", action="store_true", help="per-op accounting against onnxruntime's profiler")
    parser.add_argument("--json", help="also write the rows (and the report) to this file")
    parser.add_argument("--no-openvino", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true", help="print build tracebacks")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.threads, args.runs, args.rounds = "1", "1", 20, 2
    names = args.models.split(",") if args.models else list(QUICK if args.quick else CORPUS)
    unknown = [n for n in names if n not in CORPUS]
    if unknown:
        parser.error(f"unknown models {unknown}; the corpus: {', '.join(CORPUS)}")
    ov_version = None if args.no_openvino else openvino_version()
    import onnxruntime as ort
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, onnxruntime {ort.__version__}, "
          + (f"OpenVINO {ov_version}, " if ov_version else "") + f"cuvil {cuvil.__version__}")
    print(f"{'model':<20}{'b':>4}{'thr':>4}{'cuvil C ms':>11}{'cuvil py':>11}{'ort ms':>10}{'ratio':>7}"
          f"{'ov ms':>10}{'vs ov':>7}{'rel err':>9}{'build s':>8}{'steal':>7}{'preempt':>8}{'c2c ns':>7}")
    rows, report = [], []
    with tempfile.TemporaryDirectory(prefix="corpus-bench-") as tmp:
        for name in names:
            batches = [CORPUS[name][1] if b == "big" else int(b) for b in args.batches.split(",")]
            for batch in dict.fromkeys(batches):
                for threads in (int(t) for t in args.threads.split(",")):
                    row, rep = bench_one(name, batch, threads, args, Path(tmp), bool(ov_version))
                    rows.append(row)
                    report += rep
                    print_row(row)
    for threads in sorted({r["threads"] for r in rows}):
        rs = [r for r in rows if r["threads"] == threads and "ratio" in r]
        gm, gm_ov = geomean(r["ratio"] for r in rs), geomean(r.get("ratio_ov") for r in rs)
        print(f"# geomean, {threads} thread(s), {len(rs)} rows: vs onnxruntime "
              + (f"{gm:.2f}" if gm else "-") + ", vs OpenVINO " + (f"{gm_ov:.2f}" if gm_ov else "-"))
    if args.report and report:
        for key in dict.fromkeys((r["model"], r["batch"], r["threads"]) for r in report):
            print(f"\n# {key[0]} batch {key[1]}, {key[2]} thread(s): per op and shape class")
            print_report([r for r in report if (r["model"], r["batch"], r["threads"]) == key])
        print_class_summary(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "report": report}, indent=1, default=str) + "\n")
    return rows, report


if __name__ == "__main__":
    main()
