"""cuvil vs onnxruntime latency over the model zoo, each engine in its own process.

For every model: export it to ONNX (GraphSAGE and GAT at 10k nodes / 100k edges, and the
LSTM + GraphSAGE fraud hybrid at batch 256, with the dynamo exporter, on a fixed random edge
list: their inputs are given, not random floats),
build it with cuvil (the cold build time
is measured with an empty cache), then time, each in a fresh process, one
after the other and repeated `--rounds` times:

  cuvil (C)       the library's session_run called from a small C program
                  (benchmarks/ctime.py): no Python in the loop;
  cuvil (Python)  `cuvil.load(lib).session().run(feeds)` (ctypes);
  onnxruntime     `InferenceSession.run` with the same inputs and thread count
                  (intra_op_num_threads = threads, all graph optimisations);
  OpenVINO        when it is installed (`pip install openvino`, or the `bench`
                  extra): its CPU plugin on the same ONNX model, inferring in
                  the precision cuvil is built in (`--precision fp32,bf16,fp16`:
                  one row each; onnxruntime always float32), one stream of
                  `threads` threads, latency mode.

`--precision int8` quantises the exported model first with onnxruntime's own
tools and every engine runs that same file: convolutional models by
`quantize_static` (QDQ, per-channel int8 weights, uint8 activations, calibrated
on two seeded inputs), the others by `quantize_dynamic` (int8 weights,
DynamicQuantizeLinear + MatMulInteger). cuvil builds the file as it is (its
passes fold the quantised products into integer ones, passes/fold_qdq.py);
the rel err column then compares with onnxruntime on the same quantised file.
`--precision int8-own` does the same with the file Cuvil's own calibration
writes (`cuvil quantize`, cuvil/calibrate.py: 8 seeded random inputs, minmax),
which is what `precision: int8` builds.

A spinning thread pool of one engine would slow the other on a small
machine, so they never run at the same time. Each process does a warm-up and
`--runs` timed calls; an engine's figure is the lowest of its processes'
medians (`cuvil.bench.best_process_median` says why; the JSON also has every
process's median and the ratio of the medians over all calls). ratio =
cuvil (Python) / onnxruntime: < 1 means cuvil is faster (the C figure shows
the call overhead Python adds); vs ov = cuvil (Python) / OpenVINO. vs fp32 = cuvil (C) in this precision / cuvil
(C) in float32 at the same thread count (when fp32 is in `--precision`, first). Times
under 1 ms print with four significant digits; c2c ns = the first two CPUs' cache-line round trip
before and after the row, the larger (cuvil.ctime.PINGPONG: on a VM two vCPUs far apart make a
2-thread run slower, see benchmarks/corpus.py). The rel
err columns compare cuvil's and OpenVINO's first output with onnxruntime's.

    python benchmarks/bench.py [--models mlp,resnet18,...] [--threads 1] [--precision fp32,bf16,int8] [--runs 50] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/profile.py would shadow the standard library's `profile`, which torch's dynamo
# exporter imports (through cProfile): this folder leaves the path, the repository joins it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def _zoo():
    from tests import zoo
    return zoo


def encoder(layers=4, d=256, heads=4, ff=1024, seed=0):
    """A BERT-style encoder: post-norm Transformer layers (multi-head self-attention,
    GELU feed-forward), written with plain ops so the exporter emits MatMul/Softmax/LayerNorm."""
    import torch
    nn = torch.nn
    torch.manual_seed(seed)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.ff1, self.ff2 = nn.Linear(d, ff), nn.Linear(ff, d)
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)

        def forward(self, x):
            b, t, _ = x.shape
            split = lambda y: y.reshape(b, t, heads, d // heads).transpose(1, 2)
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            att = torch.softmax(q @ k.transpose(-1, -2) * (d // heads) ** -0.5, dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            x = self.n1(x + self.o(y))
            return self.n2(x + self.ff2(torch.nn.functional.gelu(self.ff1(x))))

    return nn.Sequential(*[Layer() for _ in range(layers)]).eval()


def lstm(inputs=64, hidden=128, layers=2, seed=0):
    import torch
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(inputs, hidden, layers)

        def forward(self, x):
            return self.rnn(x)[0]
    return Net().eval()


def gnn(name, nodes=10_000, edges=100_000, features=32):
    """GraphSAGE or GAT (tests/zoo.py) on a random graph, exported by torch's dynamo exporter
    (the TorchScript one refuses index_add_ with repeated indices): the model, its input shapes
    and its inputs (an edge list cannot be random floats)."""
    import warnings

    import torch
    zoo = _zoo()
    module = getattr(zoo, name)(nodes, features=features)
    x, edge_index = zoo.sample_input((nodes, features)), zoo.random_edges(nodes, edges)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(module.eval(), (torch.from_numpy(x), torch.from_numpy(edge_index)), dynamo=True,
                                  verbose=False, input_names=["x", "edge_index"]).model_proto
    return model, {"x": (nodes, features), "edge_index": (2, edges)}, {"x": x, "edge_index": edge_index}


def fraud_hybrid(nodes=256, steps=16, features=8, edges=2048):
    """The design document's LSTM + GraphSAGE fraud detector at batch 256 (tests/zoo.py), on a
    random transaction graph, exported by torch's dynamo exporter (index_add_ with repeated payees)."""
    import warnings

    import torch
    zoo = _zoo()
    module = zoo.fraud_hybrid(nodes, steps, features, edges=edges)
    seq, edge_index = zoo.sample_input((nodes, steps, features)), zoo.random_edges(nodes, edges)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(module.eval(), (torch.from_numpy(seq), torch.from_numpy(edge_index)), dynamo=True,
                                  verbose=False, input_names=["seq", "edge_index"]).model_proto
    return model, {"seq": (nodes, steps, features), "edge_index": (2, edges)}, {"seq": seq, "edge_index": edge_index}


# Models given as (ONNX model, shapes, feeds) rather than a torch module to export with zero inputs.
EXPORTED = {
    "graphsage": lambda: gnn("graphsage"),
    "gat": lambda: gnn("gat"),
    "fraud_hybrid": fraud_hybrid,
}

MODELS = {
    "mlp": lambda: (_zoo().mlp(), {"x": (1, 256)}),
    "resnet18": lambda: (_zoo().resnet((2, 2, 2, 2)), {"input": (1, 3, 224, 224)}),
    "resnet50": lambda: (_zoo().resnet((3, 4, 6, 3), bottleneck=True), {"input": (1, 3, 224, 224)}),
    "mobilenet_v2": lambda: (_zoo().mobilenet_v2(), {"input": (1, 3, 224, 224)}),
    "encoder": lambda: (encoder(), {"x": (1, 128, 256)}),
    "encoder_t16": lambda: (encoder(layers=1), {"x": (1, 16, 256)}),
    "lstm": lambda: (lstm(), {"x": (32, 1, 64)}),
}
DEFAULT_MODELS = "mlp,resnet18,resnet50,mobilenet_v2,encoder,encoder_t16,lstm,graphsage,gat,fraud_hybrid"


def cpu_flags() -> list[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def sample_feeds(shapes: dict) -> dict:
    return {k: np.random.default_rng(1).standard_normal(s).astype(np.float32) for k, s in shapes.items()}


from cuvil.bench import cuvil_py_times, openvino_times, openvino_version, ort_time, ort_times  # noqa: E402,F401,E501
from cuvil.select import cpu_model  # noqa: E402


def reference_output(model_path, shapes, feeds=None) -> np.ndarray:
    """onnxruntime's first output on `feeds` (default `sample_feeds`)."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    return sess.run([sess.get_outputs()[0].name], feeds or sample_feeds(shapes))[0]


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|."""
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-6))


def check_outputs(library, shapes, ref, feeds=None) -> float:
    """cuvil's first output against onnxruntime's, `ref` (`rel_err`)."""
    from cuvil.runtime import Library
    lib = Library(library)
    return rel_err(lib.run(feeds or sample_feeds(shapes))[lib.output_names[0]], ref)


CONVOLUTIONAL = ("resnet18", "resnet50", "mobilenet_v2")


def quantise(name, model_path: Path, shapes, precision: str = "int8") -> Path:
    """The model as onnxruntime's quantisation tools write it (see the module docstring); int8-own:
    as Cuvil's own calibration writes it (`cuvil quantize`, 8 seeded random samples, minmax)."""
    if precision == "int8-own":
        from cuvil.calibrate import quantize_model
        target = model_path.with_suffix(".own-int8.onnx")
        target.write_bytes(quantize_model(model_path.read_bytes(), shapes, {"samples": 8}))
        return target
    target = model_path.with_suffix(".int8.onnx")
    if name in CONVOLUTIONAL:
        quantize_static_qdq(model_path, target, shapes)
    else:
        from onnxruntime import quantization as q
        q.quantize_dynamic(str(model_path), str(target), weight_type=q.QuantType.QInt8)
    return target


def quantize_static_qdq(model_path: Path, target: Path, shapes: dict) -> None:
    """onnxruntime's `quantize_static`: QDQ, per-channel int8 weights, uint8 activations, calibrated
    on two seeded random inputs."""
    from onnxruntime import quantization as q

    class Samples(q.CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{k: np.random.default_rng(10 + i).standard_normal(s).astype(np.float32)
                                for k, s in shapes.items()} for i in range(2)])

        def get_next(self):
            return next(self.feeds, None)
    q.quantize_static(str(model_path), str(target), Samples(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                      activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8)


def build(name, model_path, shapes, threads, cache_dir, jobs, precision="fp32", disable=()):
    import cuvil
    t = time.perf_counter()
    # int8: the file is quantised already; cuvil builds it as it is
    compiled = cuvil.compile(str(model_path), input_shapes=shapes, threads=threads, cache_dir=cache_dir, jobs=jobs,
                             name=name, precision="fp32" if precision.startswith("int8") else precision,
                             disable_passes=tuple(disable))
    return compiled, time.perf_counter() - t


def bench_model(name, threads, runs, rounds, jobs, workdir: Path, cold: bool, openvino: bool = False,
                precision: str = "fp32", disable=()):
    from cuvil import bench as ctime
    from cuvil.ctime import core_round_trip_ns
    feeds = feeds_path = None
    if name in EXPORTED:
        model, shapes, feeds = EXPORTED[name]()
        feeds_path = workdir / f"{name}-feeds.npz"
        np.savez(feeds_path, **feeds)
    else:
        module, shapes = MODELS[name]()
        model = _zoo().export(module, shapes)
    model_path = workdir / f"{name}.onnx"
    model_path.write_bytes(model.SerializeToString())
    if precision.startswith("int8"):
        model_path = quantise(name, model_path, shapes, precision)
    cache_dir = workdir / f"cache-{name}-{threads}" if cold else None
    compiled, build_s = build(name, model_path, shapes, threads, cache_dir, jobs, precision, disable)
    lib_dir = workdir / f"{name}-t{threads}-{precision}"
    compiled.save(lib_dir)
    library = lib_dir / compiled.artifacts.library.name
    ref = reference_output(model_path, shapes, feeds)
    err = check_outputs(library, shapes, ref, feeds)
    # The C harness fills inputs with random floats: a model with given (integer) inputs is timed
    # through Python only.
    processes = {"c": [], "py": [], "ort": []} if feeds is None else {"py": [], "ort": []}
    openvino = openvino and feeds is None
    if openvino:
        processes["ov"] = []
    ov_output = workdir / f"{name}-t{threads}-{precision}-openvino.npy"
    warm = max(3, runs // 10)
    round_trip = core_round_trip_ns()   # the two CPUs' distance around the row (corpus.py's c2c column)
    for round_ in range(rounds):
        if "c" in processes:
            processes["c"].append(ctime.time_library(library, runs=runs, warmup=warm, info=compiled.info))
        processes["py"].append(cuvil_py_times(library, shapes, runs, warm, feeds=feeds_path))
        processes["ort"].append(ort_times(model_path, shapes, threads, runs, warm, feeds=feeds_path))
        if openvino:
            processes["ov"].append(openvino_times(model_path, shapes, threads, runs, warm,
                                                  save_output=ov_output if round_ == 0 else None,
                                                  precision="fp32" if precision.startswith("int8") else precision))
    best = {k: ctime.best_process_median(v) for k, v in processes.items()}
    c, p, o = best.get("c"), best["py"], best["ort"]
    all_calls = lambda k: statistics.median([t for times in processes[k] for t in times])
    round_medians = {k: [round(statistics.median(times) * 1e3, 4) for times in v] for k, v in processes.items()}
    result = {"model": name, "threads": threads, "precision": precision, "cuvil_c_ms": c * 1e3 if c else None,
              "cuvil_py_ms": p * 1e3, "ort_ms": o * 1e3,
              "ratio": p / o, "ratio_c": c / o if c else None, "round_medians_ms": round_medians,
              "all_calls_median_ratio": all_calls("py") / all_calls("ort"),
              "rel_err": err, "build_s": build_s, "cold": cold,
              "kernels": compiled.info["kernels"], "arena_bytes": compiled.info["memory"]["arena_bytes"]}
    if round_trip is not None:
        result["round_trip_ns"] = max(round_trip, core_round_trip_ns())
    if openvino:
        result.update(openvino_ms=best["ov"] * 1e3, ratio_openvino=p / best["ov"],
                      openvino_rel_err=rel_err(np.load(ov_output), ref))
    return result


def _ms(value, width: int) -> str:
    """A time in ms for the table: three decimals, or four significant digits under 1 ms (the MLP's
    few microseconds would otherwise print as 0.004 against 0.009, too coarse for a ratio)."""
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}.3f}" if value >= 1 else f"{value:>{width}.4g}"


def main(argv=None):
    import onnxruntime as ort

    import cuvil
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--threads", default="1", help="thread counts, comma separated (e.g. 1,2)")
    parser.add_argument("--runs", type=int, default=50, help="timed calls per process")
    parser.add_argument("--rounds", type=int, default=5, help="processes per engine (alternating)")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="parallel kernel compiles")
    parser.add_argument("--cold", action="store_true", help="build every model with an empty cache (cold build time)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--no-openvino", action="store_true", help="leave OpenVINO out even when it is installed")
    parser.add_argument("--precision", default="fp32",
                        help="cuvil's (and OpenVINO's) precisions, comma separated (fp32,bf16,fp16,int8,int8-own); "
                             "onnxruntime: fp32, or with int8 / int8-own the same quantised file (int8-own: "
                             "quantised by cuvil's own calibration)")
    parser.add_argument("--disable", action="append", default=[], metavar="PASS",
                        help="build cuvil without this pass (repeatable; e.g. winograd: bf16 3x3 convs direct)")
    args = parser.parse_args(argv)
    ov_version = None if args.no_openvino else openvino_version()
    flags = set(cpu_flags())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                       "amx_tile") if f in flags]
    print(f"# {cpu_model()} ({os.cpu_count()} cores; {' '.join(isa)}), onnxruntime {ort.__version__}, "
          + (f"OpenVINO {ov_version}, " if ov_version else "") + f"cuvil {cuvil.__version__}"
          + (f", cuvil built without {', '.join(args.disable)}" if args.disable else ""))
    print(f"{'model':<14}{'thr':>4}{'prec':>9}{'cuvil C ms':>12}{'vs fp32':>8}{'cuvil py ms':>13}{'ort ms':>10}"
          f"{'ratio':>7}{'rel err':>9}" + (f"{'ov ms':>10}{'vs ov':>7}{'ov err':>9}" if ov_version else "") + f"{'build s':>9}"
          f"{'c2c ns':>8}")
    results, fp32_c = [], {}   # fp32_c: (model, threads) -> cuvil's float32 C ms, for the 'vs fp32' column
    workdir = Path(tempfile.mkdtemp(prefix="cuvil-bench-"))
    try:
        for name in args.models.split(","):
            for threads, precision in ((int(t), p) for t in args.threads.split(",") for p in args.precision.split(",")):
                r = bench_model(name, threads, args.runs, args.rounds, args.jobs, workdir, args.cold, bool(ov_version),
                                precision, args.disable)
                results.append(r)
                c = r["cuvil_c_ms"]
                if precision == "fp32" and c is not None:
                    fp32_c[name, threads] = c
                if c is not None and (name, threads) in fp32_c:
                    r["c_vs_fp32"] = c / fp32_c[name, threads]
                ov = (f"{_ms(r['openvino_ms'], 10)}{r['ratio_openvino']:>7.2f}{r['openvino_rel_err']:>9.1e}"
                      if "openvino_ms" in r else " " * 26 if ov_version else "")
                vs = f"{r['c_vs_fp32']:>8.2f}" if "c_vs_fp32" in r else f"{'-':>8}"
                print(f"{name:<14}{threads:>4}{precision:>9}{_ms(c, 12)}{vs}{_ms(r['cuvil_py_ms'], 13)}"
                      f"{_ms(r['ort_ms'], 10)}{r['ratio']:>7.2f}{r['rel_err']:>9.1e}{ov}{r['build_s']:>9.1f}"
                      f"{r.get('round_trip_ns', 0):>8.0f}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "openvino": ov_version, "results": results},
                                              indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
