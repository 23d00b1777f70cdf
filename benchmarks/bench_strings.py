"""String ops: cuvil against onnxruntime, each engine in its own process, rounds interleaved.

    PYTHONPATH=$PWD python benchmarks/bench_strings.py [--rounds 7] [--calls 20] [--threads 1]

Both are timed from Python on the same numpy object arrays (so cuvil's time includes encoding the
inputs to C strings and decoding the outputs, as onnxruntime's includes its own conversions), one
thread each (onnxruntime: intra_op_num_threads). Prints per workload the median seconds per call of
each engine and the ratio cuvil / onnxruntime.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from onnx import TensorProto as T
from onnx import helper

N = 10_000


def _model(node, inputs, outputs, opset=20, ml=False):
    graph = helper.make_graph([node], "bench", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs])
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("ai.onnx.ml", 4)] if ml else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def workloads() -> dict:
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz.@"))
    words = np.array(["".join(rng.choice(letters, rng.integers(4, 24))) + rng.choice(["@gmail.com", "@x.org", ""])
                      for _ in range(N)], dtype=object)
    csv = np.array([",".join(str(v) for v in rng.integers(0, 1000, rng.integers(1, 12))) for _ in range(N)], dtype=object)
    keys = [f"key{k}" for k in range(1000)]
    lookups = np.array([f"key{k}" for k in rng.integers(0, 1200, N)], dtype=object)
    return {
        "RegexFullMatch (email, 10k)": (
            _model(helper.make_node("RegexFullMatch", ["x"], ["y"], pattern=r"[\w.\-]{0,25}@(yahoo|gmail)\.com"),
                   [("x", T.STRING, [N])], [("y", T.BOOL, [N])]), {"x": words}),
        "StringSplit (csv, 10k)": (
            _model(helper.make_node("StringSplit", ["x"], ["y", "n"], delimiter=",", maxsplit=15),
                   [("x", T.STRING, [N])], [("y", T.STRING, None), ("n", T.INT64, [N])]), {"x": csv}),
        "LabelEncoder (1k keys, 10k)": (
            _model(helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", keys_strings=keys,
                                    values_int64s=list(range(1000))),
                   [("x", T.STRING, [N])], [("y", T.INT64, [N])], ml=True), {"x": lookups}),
        "StringNormalizer (upper, stopwords, 10k)": (
            _model(helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="UPPER",
                                    stopwords=["key1", "key2"], locale="C.UTF-8"),
                   [("x", T.STRING, [N])], [("y", T.STRING, [None])], opset=10), {"x": lookups}),
    }


WORKER = r"""
import json, sys, time, pickle
import numpy as np
engine, model_path, feeds_path, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
feeds = pickle.load(open(feeds_path, "rb"))
if engine == "cuvil":
    import onnx, cuvil
    run = cuvil.compile(onnx.load(model_path), threads=threads).run
    call = lambda: run(feeds)
else:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    call = lambda: session.run(None, feeds)
call()
print("ready", flush=True)
for line in sys.stdin:
    calls = int(line)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    print(json.dumps((time.perf_counter() - start) / calls), flush=True)
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import pickle
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results = {}
        for name, (model, feeds) in workloads().items():
            model_path, feeds_path = tmp / "model.onnx", tmp / "feeds.pkl"
            model_path.write_bytes(model.SerializeToString())
            feeds_path.write_bytes(pickle.dumps(feeds))
            workers = {engine: subprocess.Popen([sys.executable, "-c", WORKER, engine, str(model_path), str(feeds_path),
                                                 str(args.threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                text=True)
                       for engine in ("cuvil", "onnxruntime")}
            for worker in workers.values():
                assert worker.stdout.readline().strip() == "ready"
            times = {engine: [] for engine in workers}
            for _ in range(args.rounds):   # interleaved: one round of each engine in turn
                for engine, worker in workers.items():
                    worker.stdin.write(f"{args.calls}\n")
                    worker.stdin.flush()
                    times[engine].append(json.loads(worker.stdout.readline()))
            for worker in workers.values():
                worker.stdin.close()
                worker.wait()
            medians = {engine: statistics.median(t) for engine, t in times.items()}
            results[name] = medians
            print(f"{name:42s} cuvil {medians['cuvil'] * 1e3:8.3f} ms  onnxruntime "
                  f"{medians['onnxruntime'] * 1e3:8.3f} ms  ratio {medians['cuvil'] / medians['onnxruntime']:.2f}",
                  flush=True)
    with open("/proc/loadavg") as f:
        print("loadavg", f.read().strip())


if __name__ == "__main__":
    main()
