"""`cuvil serve` under load, on loopback: scheduling at ~2x capacity, hot swaps, memory per model.

A temporary project holds three models with different `serve:` classes
(`--models zoo`, the default: the benchmark zoo's models, benchmarks/bench.py,
seeded random weights)

    lstm      critical  deadline  50 ms  2-layer LSTM, hidden 128, x [32, 1, 64]
    encoder   normal    deadline 200 ms  BERT-style encoder, 4 layers, d 256, x [1, 128, 256]
    resnet18  low       deadline 1 s     ResNet-18, input [1, 3, 224, 224], max_concurrency 1

or (`--models mlp`, a quicker run) three MLPs

    fraud   critical  deadline  50 ms   [16, 512] -> 1024 -> 1024 -> 2
    ranker  normal    deadline 200 ms   [32, 1024] -> 1024 -> 1024 -> 1024 -> 1
    batch   low       deadline 1 s      [64, 1024] -> 2048 -> 2048 -> 10

(and, with --resnet, a ResNet-18 [1, 3, 224, 224] at low priority outside the
request mix). The
server runs as its own process (`python -m cuvil serve --port 0`, loopback,
`--stop-after` bounds its life); the clients are tritonclient.http greenlets
in this process. Phases:

1. memory: every model unloaded, then loaded one at a time through the
   repository API; the server's RSS (VmRSS) grows by the model's cost,
   compared with the library's weights + arena x sessions + 10 MB;
2. capacity: closed loop, 4 clients per compute thread, the request mix
   below: answers per second;
3. overload: open loop (Poisson arrivals) at `--overload` x capacity for
   `--seconds` (capacity measured in the same run, just before); per class:
   sent, answered, 429, 503, other failures, p50/p99 latency from the
   scheduled send to the answer, share of answers within the deadline, and
   where the time went by the server's own clock (request parameter
   `cuvil_timing`: send -> handler, parse, queue, compute, back to the event
   loop, answer -> client; p50/p99 and the mean over the slowest 1 %); the
   server's and the client's CPU (cores) during the phase; every 10th
   answer checked against onnxruntime (max |diff| / max |ref| <= 1e-4);
4. hot swaps (`--swap-load mix`, the default): the whole request mix at the
   overload phase's rate, the critical model's requests at a constant rate
   (its share: a pause stands out from the spacing of arrivals) and the
   others' Poisson, while `--swaps` rewrites of the critical model's file
   (lstm; fraud with --models mlp) with new weights (a zoo model: one weight
   changed; an MLP: all new) follow one another, then one semantically null
   edit (internal names changed). `--swap-load alone`: requests for the set's
   swapped model alone (resnet18; fraud) at a constant half of its own
   capacity (closed loop on it alone, measured just before) instead. Every answer is checked
   against onnxruntime on the weights of the version that answered; reports
   failed requests, time from the write to the first new answer, the longest
   gap between two answers of that model (and the median gap);
5. with --resnet: one weight of ResNet-18 changed; time from the write until
   the first answer of the new version (the metadata names it, then one
   request), and the parts of the server's own measure (watch notice, diff,
   the build's parts in the worker, load, warm-up, swap). `--rebuilds N`
   runs this phase alone N times on a server of ResNet-18 alone and reports
   the medians.

    python benchmarks/serve_load.py [--models zoo|mlp] [--seconds 20] [--swaps 20] [--swap-load mix|alone]
                                    [--overload 2] [--resnet]
                                    [--json out.json]
    python benchmarks/serve_load.py --rebuilds 12
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gevent  # noqa: E402  (tritonclient.http runs on gevent; greenlets are the load generator)
import gevent.pool  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tritonclient.http as triton  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

@dataclass(frozen=True)
class Spec:
    """One served model of the load: its `serve:` class, its share of the requests, and its versions
    (`make(0, salt)` the first; `make(k, salt)` the file the k-th hot swap writes, its weights new for
    each `salt`: a run's builds are never step-cache hits of an earlier run's)."""
    priority: str
    deadline_ms: int
    share: float
    concurrency: int  # max_concurrency
    make: Callable[[int, int], onnx.ModelProto]
    input: str
    shape: tuple
    output: str


def mlp(batch, sizes, seed):
    rng = np.random.default_rng(seed)
    nodes, inits, last = [], {}, "x"
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        tag = f"l{i}"
        w, bias = f"{tag}_w", f"{tag}_b"
        inits[w] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        inits[bias] = (0.1 * rng.standard_normal(b)).astype(np.float32)
        out = "y" if i == len(sizes) - 2 else f"{tag}_out"
        nodes += [helper.make_node("MatMul", [last, w], [f"{tag}_mm"]),
                  helper.make_node("Add", [f"{tag}_mm", bias], [f"{tag}_add" if out != "y" else "y"])]
        if out != "y":
            nodes.append(helper.make_node("Relu", [f"{tag}_add"], [out]))
        last = out
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [batch, sizes[0]])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [batch, sizes[-1]])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def mlp_spec(priority, deadline, batch, sizes, share, concurrency) -> Spec:
    return Spec(priority, deadline, share, concurrency,
                lambda seed, salt: mlp(batch, sizes, (salt, seed) if seed else 0), "x", (batch, sizes[0]), "y")


@functools.lru_cache(maxsize=None)
def zoo_model(name: str) -> onnx.ModelProto:
    """The benchmark zoo's model (benchmarks/bench.py MODELS: seeded random weights, exported by torch)."""
    from benchmarks import bench
    module, shapes = bench.MODELS[name]()
    from tests import zoo
    return zoo.export(module, shapes)


def one_weight_edit(model: onnx.ModelProto, seed: int, salt: int) -> onnx.ModelProto:
    """`model` with one value of its largest weight changed by 0.5 x seed (+ 1e-4 x salt, salt < 1000):
    two versions differ by >= 0.5 in that weight, which moves ResNet-18's output by ~4e-4 of its
    largest value per 0.25, above the 1e-4 of the answers' check, so a check against the wrong version
    fails."""
    model = copy.deepcopy(model)
    init = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    array = numpy_helper.to_array(init).copy()
    array.flat[0] += 0.5 * seed + 1e-4 * salt
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    return model


def rename_internal(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every internal value, weight and node renamed (graph inputs and outputs
    keep their names): a semantically null edit (no subgraphs: the models here have none)."""
    model = copy.deepcopy(model)
    graph = model.graph
    keep = {v.name for v in graph.input} | {v.name for v in graph.output} | {""}
    names = {}

    def new(name):
        return name if name in keep else names.setdefault(name, f"renamed{len(names)}")

    for init in graph.initializer:
        init.name = new(init.name)
    for i, node in enumerate(graph.node):
        node.name = f"renamed_node{i}"
        node.input[:] = [new(n) for n in node.input]
        node.output[:] = [new(n) for n in node.output]
    for info in graph.value_info:
        info.name = new(info.name)
    return model


def zoo_spec(name, priority, deadline, share, concurrency, shape, input_name="x") -> Spec:
    return Spec(priority, deadline, share, concurrency,
                lambda seed, salt: one_weight_edit(zoo_model(name), seed, salt) if seed else zoo_model(name),
                input_name, shape, "output")


# the model sets (--models): the classes as docs/serving.md describes them, each one model, the
# request mix 30/40/30; and the model whose file the hot-swap phase rewrites
MODEL_SETS = {
    # the three models: the design document's fraud detector is an LSTM (critical, the
    # shortest runs), a BERT-style encoder ranks (normal), ResNet-18 classifies in bulk (low)
    "zoo": ({"lstm": zoo_spec("lstm", "critical", 50, 0.3, 2, (32, 1, 64)),
             "encoder": zoo_spec("encoder", "normal", 200, 0.4, 2, (1, 128, 256)),
             # its runs are the longest: on one core at most, so a critical request never waits for two
             "resnet18": zoo_spec("resnet18", "low", 1000, 0.3, 1, (1, 3, 224, 224), "input")},
            "resnet18"),
    # three MLPs: a quicker run (small libraries, builds of seconds)
    "mlp": ({"fraud": mlp_spec("critical", 50, 16, (512, 1024, 1024, 2), 0.3, 2),
             "ranker": mlp_spec("normal", 200, 32, (1024, 1024, 1024, 1024, 1), 0.4, 2),
             # its runs are the longest (~13 ms): on one core at most
             "batch": mlp_spec("low", 1000, 64, (1024, 2048, 2048, 10), 0.3, 1)},
            "fraud"),
}
MODELS: dict[str, Spec] = {}
SWAPPED = ""


def select(models: str) -> None:
    global MODELS, SWAPPED
    MODELS, SWAPPED = MODEL_SETS[models]


def select_none() -> None:
    """No model under load (`--rebuilds`: a server of ResNet-18 alone)."""
    global MODELS, SWAPPED
    MODELS, SWAPPED = {}, ""


def save(model, path: Path):
    save_bytes(model.SerializeToString(), path)


def save_bytes(data: bytes, path: Path):
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(path)


def ort_session(model):
    """onnxruntime on one thread, for `model` (a ModelProto or its bytes)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def write_project(folder: Path, resnet: bool, cache: Path) -> Path:
    """The project: every model of MODELS at its first version, and with `resnet` ResNet-18 (low
    priority, not in the request mix) when MODELS has none."""
    (folder / "models").mkdir(parents=True)
    lines = ["version: 1", "output_dir: out", f"cache: {{dir: {cache}}}", "models:"]
    for name, spec in MODELS.items():
        save(spec.make(0, 0), folder / "models" / f"{name}.onnx")
        lines += [f"  - name: {name}", f"    source: models/{name}.onnx", f"    symbol_prefix: {name}_",
                  f"    serve: {{priority: {spec.priority}, deadline_ms: {spec.deadline_ms}, "
                  f"max_concurrency: {spec.concurrency}}}"]
    if resnet and "resnet18" not in MODELS:
        save(zoo_model("resnet18"), folder / "models" / "resnet18.onnx")
        lines += ["  - name: resnet18", "    source: models/resnet18.onnx", "    symbol_prefix: resnet18_",
                  "    serve: {priority: low, deadline_ms: 2000}"]
    lines += ["watch: {debounce_ms: 20}", "incremental: {enabled: true, diff_mode: semantic}", ""]
    (folder / "cuvil.yaml").write_text("\n".join(lines))
    return folder / "cuvil.yaml"


class ServerProcess:
    def __init__(self, config: Path, lifetime: float, workers: int | None, nice_lower: int | None = None):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        extra = ["--workers", str(workers)] if workers else []
        extra += ["--nice-lower", str(nice_lower)] if nice_lower is not None else []
        self.proc = subprocess.Popen([sys.executable, "-m", "cuvil", "serve", "-f", str(config), "--port", "0",
                                      "--stop-after", str(lifetime), *extra], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines = []
        for line in self.proc.stdout:
            self.lines.append(line)
            print("  server:", line.rstrip(), flush=True)
            if line.startswith("serving "):
                break
        else:
            raise SystemExit("the server did not start:\n" + "".join(self.lines))
        self.port = int(re.search(r"127\.0\.0\.1:(\d+)", self.lines[-1]).group(1))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def cpu_seconds(self) -> float:
        """The server process's CPU time so far (user + system, all its threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- one request

NOT_SENT = -2  # the status of an arrival the client did not send: all its connections were busy

class Recorder:
    def __init__(self, timing=False, sample=0):
        self.sample = sample  # keep the output of every `sample`-th request (0: none), to check it
        self.rows = []  # (model, scheduled, done, status, version, output, sent, server marks)
        # ask the server for its clock at each stage (response parameters cuvil_received, _parsed,
        # _started, _computed, _resumed: time.monotonic, the clock of perf_counter here)
        self.parameters = {"cuvil_timing": True} if timing else None

    def send(self, client, model, x, scheduled, keep_output=False):
        keep_output = keep_output or (self.sample and len(self.rows) % self.sample == 0)
        sent = time.perf_counter()  # later than `scheduled` when the client itself lags
        spec = MODELS[model]
        tensor = triton.InferInput(spec.input, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        marks = None
        try:
            result = client.infer(model, [tensor], parameters=self.parameters)
            status = 200
            response = result.get_response()
            version = response["model_version"]
            output = result.as_numpy(spec.output) if keep_output else None
            marks = response.get("parameters")
        except triton.InferenceServerException as error:
            status, version, output = int(error.status() or 0), None, error.message()
        except Exception as error:  # noqa: BLE001  a transport failure: counted, never hidden
            status, version, output = -1, None, repr(error)
        self.rows.append((model, scheduled, time.perf_counter(), status, version, output, sent, marks))


def inputs():
    return {name: np.random.default_rng(7).standard_normal(spec.shape).astype(np.float32)
            for name, spec in MODELS.items()}


def pick(rng):
    names = list(MODELS)
    return names[rng.choice(len(names), p=[MODELS[n].share for n in names])]


def closed_loop(client, seconds, clients, only=None) -> float:
    """Answers per second of the request mix (or of the model `only`), `clients` in a closed loop."""
    rec, rng, xs, end = Recorder(), np.random.default_rng(1), inputs(), time.perf_counter() + seconds

    def one():
        while time.perf_counter() < end:
            model = only or pick(rng)
            rec.send(client, model, xs[model], time.perf_counter())

    gevent.joinall([gevent.spawn(one) for _ in range(clients)])
    ok = sum(1 for row in rec.rows if row[3] == 200)
    return ok / seconds


def class_client(models, port, model, rate, seconds, start_at, seed, pipe):
    """In a process of its own: Poisson arrivals of `model` (of the set `models`) at `rate` per second
    for `seconds` from `start_at` (perf_counter: the machine's monotonic clock); sends its rows back
    through `pipe`."""
    select(models)
    client = triton.InferenceServerClient(f"127.0.0.1:{port}", concurrency=256, connection_timeout=60,
                                          network_timeout=120)
    rec, rng, x = Recorder(timing=True, sample=SAMPLE), np.random.default_rng(seed), inputs()[model]
    greenlets = []
    delay = start_at - time.perf_counter()
    if delay > 0:
        gevent.sleep(delay)
    t = t0 = start_at
    while t - t0 < seconds:
        t += rng.exponential(1 / rate)
        delay = t - time.perf_counter()
        if delay > 0:
            gevent.sleep(delay)
        greenlets.append(gevent.spawn(rec.send, client, model, x, t))
    gevent.joinall(greenlets, timeout=120)
    pipe.send(rec.rows)
    pipe.close()


def open_loop_processes(models, port, rate, seconds) -> Recorder:
    """The request mix at `rate` per second as one client process per model (each its own Poisson
    arrivals at its share): a class's answers are not held up by another class's load on the
    client's single gevent thread (the server still shares the cores with all of them)."""
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    start_at = time.perf_counter() + 3.0  # the processes start (imports) before the load does
    procs = []
    for seed, (name, spec) in enumerate(MODELS.items()):
        ours, theirs = context.Pipe(duplex=False)
        proc = context.Process(target=class_client, args=(models, port, name, rate * spec.share, seconds, start_at, 10 + seed,
                                                          theirs))
        proc.start()
        procs.append((proc, ours))
    rec = Recorder()
    for proc, pipe in procs:
        rec.rows += pipe.recv()
        proc.join(60)
    return rec


def open_loop(client, rate, seconds, timing=False, limit=256) -> Recorder:
    """Poisson arrivals of the request mix at `rate` per second for `seconds`, at most `limit` in flight
    (the client's connections): an arrival while every connection is busy is recorded as NOT_SENT and
    reported, not queued in the client, where its wait for a connection would count as the server's
    latency (a pool of greenlets, so finished ones are not kept either: a list of every greenlet of
    the phase made the client's garbage collections longer as the phase went on)."""
    rec, rng, xs = Recorder(timing, sample=SAMPLE), np.random.default_rng(2), inputs()
    pool = gevent.pool.Pool(limit)
    t0 = time.perf_counter()
    t = t0
    while t - t0 < seconds:
        t += rng.exponential(1 / rate)
        delay = t - time.perf_counter()
        if delay > 0:
            gevent.sleep(delay)
        model = pick(rng)
        if pool.full():
            now = time.perf_counter()
            rec.rows.append((model, t, now, NOT_SENT, None, "every connection of the client busy", now, None))
        else:
            pool.spawn(rec.send, client, model, xs[model], t)
    pool.join(timeout=120)
    return rec


class Pauses:
    """This process's garbage collections while it generates load (gc.callbacks): a collection stops
    every greenlet, so a long one is the client's lag, not the server's latency. Entering collects
    and freezes what exists (the phase's collections then walk only its own objects)."""

    def __enter__(self):
        gc.collect()
        gc.freeze()
        self.times, self._start = [], None
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.times.append(time.perf_counter() - self._start)

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)
        gc.unfreeze()

    def summary(self) -> dict:
        return {"collections": len(self.times), "total_ms": 1000 * sum(self.times),
                "max_ms": 1000 * max(self.times, default=0.0)}


SAMPLE = 10  # the overload phase keeps every 10th request's output and checks it against onnxruntime
# cuvil's output against onnxruntime's: max |diff| / max |ref|, the float32 whole-model tolerance of
# tests/test_models.py (float32 kernels that sum in another order, Winograd convolutions)
TOL = 1e-4


def rel_err(got, want) -> float:
    scale = max(float(np.max(np.abs(want))), 1e-6)
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) / scale


def check_answers(rec: Recorder) -> dict:
    """Every kept output of the overload phase (all from the first version) against onnxruntime."""
    result, xs = {}, inputs()
    for name, spec in MODELS.items():
        outputs = [r[5] for r in rec.rows if r[0] == name and r[3] == 200 and isinstance(r[5], np.ndarray)]
        want = ort_session(spec.make(0, 0)).run(None, {spec.input: xs[name]})[0] if outputs else None
        errors = [rel_err(out, want) for out in outputs]
        result[name] = {"checked": len(errors), "wrong": sum(e > TOL for e in errors),
                        "max_rel_err": max(errors, default=float("nan"))}
    return result


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def class_table(rec: Recorder, seconds: float) -> dict:
    table = {}
    for name, spec in MODELS.items():
        priority, deadline = spec.priority, spec.deadline_ms
        rows = [r for r in rec.rows if r[0] == name]
        ok = [(r[2] - r[1]) * 1000 for r in rows if r[3] == 200]
        rows_sent = [r for r in rows if r[3] != NOT_SENT]
        from_send = [(r[2] - r[6]) * 1000 for r in rows if r[3] == 200]
        table[name] = {
            "priority": priority, "deadline_ms": deadline, "sent": len(rows), "answered": len(ok),
            "rejected_429": sum(r[3] == 429 for r in rows), "shed_503": sum(r[3] == 503 for r in rows),
            "other_failures": sum(r[3] not in (200, 429, 503, NOT_SENT) for r in rows),
            "not_sent_client_busy": sum(r[3] == NOT_SENT for r in rows),
            "p50_ms": percentile(ok, 50), "p99_ms": percentile(ok, 99),
            "within_deadline": (sum(v <= deadline for v in ok) / len(ok)) if ok else float("nan"),
            "p99_from_send_ms": percentile(from_send, 99),
            "within_deadline_from_send": (sum(v <= deadline for v in from_send) / len(ok)) if ok else float("nan"),
            "client_lag_p99_ms": percentile([(r[6] - r[1]) * 1000 for r in rows_sent], 99),
            "answers_per_s": len(ok) / seconds}
        timed = [r for r in rows if r[3] == 200 and r[7]]
        if timed:
            # where an answer's time went, by the server's stamps (one monotonic clock on the machine)
            stages = {"send_to_handler": lambda r, m: m["cuvil_received"] - r[6],
                      "parse": lambda r, m: m["cuvil_parsed"] - m["cuvil_received"],
                      "queue": lambda r, m: m["cuvil_started"] - m["cuvil_parsed"],
                      "compute": lambda r, m: m["cuvil_computed"] - m["cuvil_started"],
                      "back_to_loop": lambda r, m: m["cuvil_resumed"] - m["cuvil_computed"],
                      "answer_to_client": lambda r, m: r[2] - m["cuvil_resumed"]}
            table[name]["stages_ms"] = {
                stage: {"p50": percentile([f(r, r[7]) * 1000 for r in timed], 50),
                        "p99": percentile([f(r, r[7]) * 1000 for r in timed], 99)} for stage, f in stages.items()}
            # the stages of the answers slower than the class's p99 from the send: what made them slow
            slow_cut = np.percentile([(r[2] - r[6]) for r in timed], 99)
            slow = [r for r in timed if r[2] - r[6] >= slow_cut]
            table[name]["slowest_1pct_stages_mean_ms"] = {
                stage: float(np.mean([f(r, r[7]) * 1000 for r in slow])) for stage, f in stages.items()}
    return table


def server_means(port) -> dict:
    """From the server's /metrics: (queue|compute, model) -> (sum of seconds, count), and
    ("within", model) -> (answers within the deadline by the handler's own clock, answers)."""
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    found = {}
    for name, spec in MODELS.items():
        deadline = spec.deadline_ms
        le = f"{deadline / 1000:g}" if deadline < 1000 else "1.0"
        within = re.search(rf'^cuvil_request_seconds_bucket{{le="{le}",model="{name}"}} (\S+)$', text, re.M)
        count = re.search(rf'^cuvil_request_seconds_count{{model="{name}"}} (\S+)$', text, re.M)
        found[("within", name)] = (float(within.group(1)) if within else 0.0, float(count.group(1)) if count else 0.0)
    for what in ("queue", "compute"):
        for name in MODELS:
            values = []
            for suffix in ("sum", "count"):
                match = re.search(rf'^cuvil_{what}_seconds_{suffix}{{model="{name}"}} (\S+)$', text, re.M)
                values.append(float(match.group(1)) if match else 0.0)
            found[(what, name)] = tuple(values)
    for generation in "012":  # the server's garbage collections (cuvil_gc_pause_seconds)
        values = []
        for suffix in ("sum", "count"):
            match = re.search(rf'^cuvil_gc_pause_seconds_{suffix}{{generation="{generation}"}} (\S+)$', text, re.M)
            values.append(float(match.group(1)) if match else 0.0)
        found[("gc", generation)] = tuple(values)
        under = re.search(rf'^cuvil_gc_pause_seconds_bucket{{generation="{generation}",le="0.005"}} (\S+)$',
                          text, re.M)
        found[("gc>5ms", generation)] = (values[1] - (float(under.group(1)) if under else 0.0),)
    return found


def wait_version(client, model, old, timeout=300):
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        version = client.get_model_metadata(model)["versions"][0]
        if version != old:
            return version, time.perf_counter()
        gevent.sleep(0.005)
    raise SystemExit(f"{model}: no new version within {timeout} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", choices=sorted(MODEL_SETS), default="zoo",
                        help="zoo: the LSTM (critical), the encoder (normal) and ResNet-18 (low), the swaps "
                        "rewrite ResNet-18; mlp: three MLPs, the swaps rewrite the critical one (a quicker run)")
    parser.add_argument("--seconds", type=float, default=20, help="length of the overload phase")
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--swap-load", choices=("mix", "alone"), default="mix",
                        help="mix: the swaps rewrite the critical model while the whole request mix arrives at "
                        "the overload phase's rate; alone: they rewrite the set's swapped model (ResNet-18 or "
                        "fraud) with requests for it alone at half its own capacity")
    parser.add_argument("--overload", type=float, default=2.0, help="offered load / measured capacity")
    parser.add_argument("--rate", type=float, help="offered load in requests/s instead of --overload x capacity "
                        "(to compare two servers at one rate; the capacity is still measured and reported)")
    parser.add_argument("--resnet", action="store_true", help="also time a one-weight change of ResNet-18 "
                        "(with --models mlp: served beside the MLPs, outside the request mix)")
    parser.add_argument("--workers", type=int, help="the server's compute threads (default: its own, the cores)")
    parser.add_argument("--nice-lower", type=int, help="the server's --nice-lower (default: its own)")
    parser.add_argument("--rebuilds", type=int, metavar="N",
                        help="only phase 5: a server of ResNet-18 alone, its one-weight change timed N times")
    parser.add_argument("--cache", type=Path, default=ROOT / ".cuvil-cache" / "bench", help="the step cache")
    parser.add_argument("--client-per-class", action="store_true",
                        help="overload phase: one client process per model instead of one for all")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    select(args.models)
    if args.rebuilds:
        return rebuilds_only(args)

    report = {"machine": {"cpus": len(os.sched_getaffinity(0))}, "command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="cuvil-serve-bench-") as tmp:
        folder = Path(tmp)
        config = write_project(folder, args.resnet, args.cache)
        report["models"] = {name: {"priority": spec.priority, "deadline_ms": spec.deadline_ms, "share": spec.share,
                                   "max_concurrency": spec.concurrency, "input": [spec.input, list(spec.shape)]}
                            for name, spec in MODELS.items()}
        print("building and starting the server...", flush=True)
        server = ServerProcess(config, lifetime=3600, workers=args.workers, nice_lower=args.nice_lower)
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}", concurrency=256,
                                              connection_timeout=60, network_timeout=120)
        try:
            report["memory"] = memory_phase(client, server, folder)
            capacity = closed_loop(client, 8, clients=4 * report["machine"]["cpus"])
            if not capacity:
                raise SystemExit("no answers in the capacity phase:\n" + "".join(server.lines[-20:]))
            report["capacity_per_s"] = capacity
            print(f"capacity (closed loop): {capacity:.0f} answers/s", flush=True)
            offered = args.rate or args.overload * capacity
            before = server_means(server.port)
            load_before = os.getloadavg()
            cpu_before, client_cpu_before = server.cpu_seconds(), time.process_time()
            with Pauses() as client_pauses:
                if args.client_per_class:
                    rec = open_loop_processes(args.models, server.port, offered, args.seconds)
                else:
                    rec = open_loop(client, offered, args.seconds, timing=True)
            report["overload"] = {"server_cpu_cores": (server.cpu_seconds() - cpu_before) / args.seconds,
                                  "client_cpu_cores": (time.process_time() - client_cpu_before) / args.seconds,
                                  "client_gc": client_pauses.summary()}
            report["load_average_overload"] = [load_before, os.getloadavg()]
            report["overload"].update({"offered_per_s": offered, "offered_over_capacity": offered / capacity,
                                       "seconds": args.seconds,
                                       "classes": class_table(rec, args.seconds),
                                       "answers_checked": check_answers(rec)})
            after = server_means(server.port)
            report["overload"]["server_gc"] = {
                generation: {"collections": after[("gc", generation)][1] - before[("gc", generation)][1],
                             "total_ms": 1000 * (after[("gc", generation)][0] - before[("gc", generation)][0]),
                             "over_5ms": after[("gc>5ms", generation)][0] - before[("gc>5ms", generation)][0]}
                for generation in "012"}
            for name, row in report["overload"]["classes"].items():
                for what in ("queue", "compute"):
                    total = after[(what, name)][0] - before[(what, name)][0]
                    count = after[(what, name)][1] - before[(what, name)][1]
                    row[f"server_{what}_mean_ms"] = 1000 * total / count if count else float("nan")
                within = after[("within", name)][0] - before[("within", name)][0]
                answered = after[("within", name)][1] - before[("within", name)][1]
                row["within_deadline_in_server"] = within / answered if answered else float("nan")
            if args.swaps and args.swap_load == "mix":
                # the case: the critical model's file rewritten while the whole mix arrives at the
                # overload phase's rate (the critical class is the one the server never turns away)
                swapped = next(name for name, spec in MODELS.items() if spec.priority == "critical")
                load_before = os.getloadavg()
                report["swaps"] = swap_phase(client, folder, offered * MODELS[swapped].share, args.swaps,
                                             model_name=swapped, mix_rate=offered)
                report["swaps"]["load_average"] = [load_before, os.getloadavg()]
            elif args.swaps:
                # half the swapped model's own capacity (closed loop on it alone): the mix's capacity is
                # mostly the cheap models' and would overload a ResNet-18 alone
                own = closed_loop(client, 5, clients=4 * report["machine"]["cpus"], only=SWAPPED)
                report["swapped_model_capacity_per_s"] = own
                report["swaps"] = swap_phase(client, folder, own / 2, args.swaps)
            if args.resnet:
                report["resnet18"] = resnet_phase(client, server, folder)
        finally:
            server.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def memory_phase(client, server, folder) -> dict:
    names = [m["name"] for m in client.get_model_repository_index()]
    for name in names:
        client.unload_model(name)
    time.sleep(0.5)
    rows, base = {}, server.rss_bytes()
    for name in names:
        before = server.rss_bytes()
        client.load_model(name)
        after = server.rss_bytes()
        info = json.loads(next((folder / "out" / name / "native").glob("manifest.json")).read_text())
        memory = info.get("memory", info.get("info", {}).get("memory", {}))
        sessions = MODELS[name].concurrency if name in MODELS else 1
        budget = (memory.get("weights_bytes", 0) + sessions * memory.get("arena_bytes", 0)
                  + memory.get("shared_bytes", 0) + 10 * 2 ** 20)
        rows[name] = {"rss_delta_mb": (after - before) / 2 ** 20, "budget_mb": budget / 2 ** 20,
                      "shared_mb": memory.get("shared_bytes", 0) / 2 ** 20,
                      "weights_mb": memory.get("weights_bytes", 0) / 2 ** 20,
                      "arena_mb": memory.get("arena_bytes", 0) / 2 ** 20, "sessions": sessions}
        print(f"  load {name}: RSS +{rows[name]['rss_delta_mb']:.1f} MB (budget {rows[name]['budget_mb']:.1f} MB)",
              flush=True)
    return {"rss_without_models_mb": base / 2 ** 20, "models": rows}


def swap_phase(client, folder, rate, swaps, model_name=None, mix_rate=None) -> dict:
    """`swaps` rewrites of `model_name`'s file (default SWAPPED) while its requests arrive at a
    constant `rate` (a pause stands out from the spacing of arrivals); with `mix_rate`, the other
    models' requests arrive too (Poisson, each at its share of `mix_rate`), so the swaps happen under
    the whole mix's load."""
    model_name = model_name or SWAPPED
    spec = MODELS[model_name]
    x = inputs()[model_name]
    first = client.get_model_metadata(model_name)["versions"][0]
    weights = {first: 0}
    times, windows = [], []  # windows: (file written, new version seen + 100 ms)
    named = []  # (when the metadata first named version k, k)

    # made before the load starts: building a model takes the client's only thread for ~0.1 s,
    # which would show up as a pause in the answers
    path = folder / "models" / f"{model_name}.onnx"
    # serialized beforehand too: SerializeToString holds the GIL for tens of ms (a client-side gap)
    # version k (seeds from this run's clock: never a build the step cache has seen)
    salt = time.time_ns() // 10 ** 6 % 1000
    files = {seed: spec.make(seed, salt).SerializeToString() for seed in range(swaps + 1)}
    null_edit = rename_internal(onnx.load_model_from_string(files[swaps])).SerializeToString()

    def swapper(t0):
        version = first
        gevent.sleep(1.0)
        # the file is written on a thread of gevent's pool: a write blocks on a busy disk for tens of
        # ms, which on the hub would stall this client's requests and show as a gap in the answers
        pool = gevent.get_hub().threadpool
        for seed in range(1, swaps + 1):
            pool.apply(save_bytes, (files[seed], path))
            written = time.perf_counter()
            version, seen = wait_version(client, model_name, version)
            weights[version] = seed
            named.append((seen, seed))
            times.append(seen - written)
            windows.append((written, seen + 0.1))
            gevent.sleep(0.3)
        # a semantically null edit: the same weights, every internal name changed
        pool.apply(save_bytes, (null_edit, path))
        gevent.sleep(2.0)
        null_version = client.get_model_metadata(model_name)["versions"][0]
        weights["null_edit_swapped"] = null_version != version
        gevent.sleep(0.5)

    # requests at a constant rate (not Poisson: a pause must stand out from the gaps between
    # arrivals) until the swapper is done
    start = time.perf_counter()
    rec = Recorder(timing=True)
    others = Recorder()
    side = gevent.spawn(swapper, start)
    pool = gevent.pool.Pool(256)

    def rest():
        # the other models of the mix: Poisson arrivals at their shares of `mix_rate`
        names = [n for n in MODELS if n != model_name]
        shares = np.array([MODELS[n].share for n in names])
        rng, xs, t = np.random.default_rng(3), inputs(), time.perf_counter()
        while not side.ready():
            t += rng.exponential(1 / (mix_rate * shares.sum()))
            delay = t - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            name = names[rng.choice(len(names), p=shares / shares.sum())]
            if pool.full():
                now = time.perf_counter()
                others.rows.append((name, t, now, NOT_SENT, None, "every connection of the client busy", now, None))
            else:
                pool.spawn(others.send, client, name, xs[name], t)

    background = gevent.spawn(rest) if mix_rate else None
    greenlets, t = [], start
    while not side.ready():
        t += 1 / rate
        delay = t - time.perf_counter()
        if delay > 0:
            gevent.sleep(delay)
        greenlets.append(gevent.spawn(rec.send, client, model_name, x, t, True))
    gevent.joinall(greenlets, timeout=120)
    if background is not None:
        background.get()
        pool.join(timeout=120)
    side.get()
    null_swapped = weights.pop("null_edit_swapped")
    sessions = {}
    wrong = 0
    for _, _, _, status, version, output, *_ in rec.rows:
        if status != 200:
            continue
        if version not in sessions:
            sessions[version] = ort_session(files[weights[version]]).run(None, {spec.input: x})[0]
        if rel_err(output, sessions[version]) > TOL:
            wrong += 1
    # answers to requests sent after the metadata named version k that came from an older version
    stale = sum(1 for r in rec.rows if r[3] == 200
                and weights[r[4]] < max((k for seen, k in named if seen <= r[6]), default=0))
    done = sorted(r[2] for r in rec.rows if r[3] == 200)
    gaps = np.diff(done) * 1000 if len(done) > 1 else np.array([0.0])
    in_window = [(r[2] - r[6]) * 1000 for r in rec.rows
                 if r[3] == 200 and any(a <= r[6] <= b for a, b in windows)]
    outside = [(r[2] - r[6]) * 1000 for r in rec.rows
               if r[3] == 200 and not any(a <= r[6] <= b for a, b in windows)]
    result = {"swaps": len(times), "requests": len(rec.rows), "failed": sum(r[3] != 200 for r in rec.rows),
              "failed_by_status": {str(code): sum(r[3] == code for r in rec.rows)
                                   for code in sorted({r[3] for r in rec.rows} - {200})},
              "wrong_answers": wrong, "older_version_after_swap": stale, "versions_seen": len(sessions),
              "write_to_new_version_ms": {"median": statistics.median(times) * 1000, "max": max(times) * 1000},
              "longest_gap_between_answers_ms": float(gaps.max()), "median_gap_ms": float(np.median(gaps)),
              "latency_during_swaps_ms": {"p50": percentile(in_window, 50), "p99": percentile(in_window, 99),
                                          "max": max(in_window, default=float("nan")), "n": len(in_window)},
              "latency_otherwise_ms": {"p50": percentile(outside, 50), "p99": percentile(outside, 99),
                                       "max": max(outside, default=float("nan")), "n": len(outside)},
              "model": model_name, "offered_per_s": rate, "arrival_period_ms": 1000 / rate,
              "null_edit_swapped": null_swapped}
    if mix_rate:
        result["mix_offered_per_s"] = mix_rate
        result["other_models"] = {
            name: {"sent": sum(r[0] == name and r[3] != NOT_SENT for r in others.rows),
                   "answered": sum(r[0] == name and r[3] == 200 for r in others.rows),
                   "status": {str(code): sum(r[0] == name and r[3] == code for r in others.rows)
                              for code in sorted({r[3] for r in others.rows if r[0] == name} - {200})}}
            for name in MODELS if name != model_name}
    # the answers around the longest gaps: where their time went (server stamps, as in class_table)
    timed = sorted((r for r in rec.rows if r[3] == 200 and r[7]), key=lambda r: r[2])
    # the longest gap between two answers as the server gave them (its event loop had them back): the
    # pauses of the server alone, without this client's own (the gap above counts both)
    resumed = np.sort([r[7]["cuvil_resumed"] for r in timed])
    result["longest_gap_in_server_ms"] = float(np.diff(resumed).max() * 1000) if len(resumed) > 1 else 0.0
    # the client's own share: how late it sent (a request sent late cannot be answered in time, and a
    # pause in sending shows as a gap in answers that no request waited through)
    sent = np.sort([r[6] for r in rec.rows])
    result["longest_gap_between_sends_ms"] = float(np.diff(sent).max() * 1000) if len(sent) > 1 else 0.0
    result["client_send_lag_max_ms"] = max(((r[6] - r[1]) * 1000 for r in rec.rows), default=0.0)
    # from the scheduled send to the answer: what a caller sending on time would have waited
    result["longest_wait_from_schedule_ms"] = max(((r[2] - r[1]) * 1000 for r in rec.rows if r[3] == 200),
                                                  default=float("nan"))
    slow = sorted(timed, key=lambda r: r[2] - r[6])[-10:]
    result["slowest_answers_stages_ms"] = [
        {"total": (r[2] - r[6]) * 1000, "send_to_handler": (r[7]["cuvil_received"] - r[6]) * 1000,
         "queue": (r[7]["cuvil_started"] - r[7]["cuvil_parsed"]) * 1000,
         "compute": (r[7]["cuvil_computed"] - r[7]["cuvil_started"]) * 1000,
         "back_to_loop": (r[7]["cuvil_resumed"] - r[7]["cuvil_computed"]) * 1000,
         "answer_to_client": (r[2] - r[7]["cuvil_resumed"]) * 1000,
         "in_swap_window": any(a <= r[6] <= b for a, b in windows)} for r in slow]
    print(f"  swaps: {result}", flush=True)
    return result


PART = re.compile(r"(\w[\w.]*) (\d+)")


def server_parts(lines) -> dict:
    """The parts of one hot update as the server logs them, in ms: notice, diff, build, load and their
    own parts (build.plan, build.pass, ..., load.warmup, ...)."""
    parts = {}
    for i, line in enumerate(lines):
        head = re.search(r"\((\d+) ms: (.*)\)\s*$", line)
        if "hot update [" in line and head:
            parts["server_total"] = float(head.group(1))
            parts.update((k, float(v)) for k, v in PART.findall(head.group(2)))
            if i + 1 < len(lines) and "parts (ms):" in lines[i + 1]:
                parts.update((k, float(v)) for k, v in PART.findall(lines[i + 1].split(":", 1)[1]))
    return parts


def resnet_phase(client, server, folder) -> dict:
    path = folder / "models" / "resnet18.onnx"
    model = onnx.load(path)
    old = client.get_model_metadata("resnet18")["versions"][0]
    init = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    array = numpy_helper.to_array(init).copy()
    array.flat[0] += 0.25 + (time.time_ns() % 1000) / 1e6  # a new value each run: the build is never cached
    init.CopyFrom(numpy_helper.from_array(array, init.name))
    data = model.SerializeToString()
    x = triton.InferInput("input", [1, 3, 224, 224], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 224, 224), np.float32))
    seen_lines = len(server.lines)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(path)
    written = time.perf_counter()
    version, seen = wait_version(client, "resnet18", old)
    # the first answer of the new version: a request sent once the metadata names it
    answer = client.infer("resnet18", [x])
    answered = time.perf_counter()
    if answer.get_response()["model_version"] != version:
        raise SystemExit(f"resnet18: answered by {answer.get_response()['model_version']}, not {version}")
    time.sleep(0.5)
    own = [l.strip() for l in server.lines[seen_lines:]]
    result = {"write_to_new_version_s": seen - written, "write_to_first_answer_s": answered - written,
              "parts_ms": server_parts(own), "server_log": [l for l in own if "hot update [resnet18]" in l]}
    print(f"  resnet18: {result}", flush=True)
    return result


def rebuilds_only(args) -> None:
    """`--rebuilds N`: the one-weight change of phase 5, N times in a row on one server (the first
    rebuild after start-up also makes the link's template: relink.py), and their median."""
    report = {"machine": {"cpus": len(os.sched_getaffinity(0))}, "command": " ".join(sys.argv), "runs": []}
    with tempfile.TemporaryDirectory(prefix="cuvil-serve-bench-") as tmp:
        folder = Path(tmp)
        select_none()
        config = write_project(folder, True, args.cache)
        print("building and starting the server...", flush=True)
        server = ServerProcess(config, lifetime=3600, workers=args.workers)
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}", connection_timeout=60, network_timeout=120)
        try:
            for _ in range(args.rebuilds):
                report["runs"].append(resnet_phase(client, server, folder))
        finally:
            server.stop()
    times = [run["write_to_first_answer_s"] for run in report["runs"]]
    report["median_s"], report["max_s"] = statistics.median(times), max(times)
    names = dict.fromkeys(k for run in report["runs"] for k in run["parts_ms"])
    report["parts_median_ms"] = {k: statistics.median(run["parts_ms"].get(k, 0.0) for run in report["runs"])
                                 for k in names}
    report["load_average"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
