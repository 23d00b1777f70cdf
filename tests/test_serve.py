"""`cuvil serve` end to end: one server (in this process, on a free loopback port) driven by tritonclient.

Two tiny models are built once into a temporary project; every answer is
compared with onnxruntime on the same ONNX file. The bad-request corpus goes
through raw HTTP (tritonclient checks some mistakes before sending) and must
get 4xx with a v2 error body while the server keeps serving. The hot-update
cases rewrite the `scale` model's file under the running server; they come
last in this file because they change that model.
"""
from __future__ import annotations

import gc
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

import tritonclient.http as tritonclient_http
from tritonclient.utils import InferenceServerException

from cuvil.serve import Server
from tests.helpers import make_model, run_ort

# One server for the module, whose hot-update tests are a sequence (each swaps from the version the
# one before left): the module runs in one pytest-xdist worker (pyproject's --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serve")

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-3f1c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # tritonclient adds to a headers dict: pass copies
RTOL, ATOL = 1e-5, 1e-6

CONFIG = """version: 1
output_dir: out
cache: {{dir: {cache}}}
models:
  - name: affine
    source: models/affine.onnx
    serve: {{priority: critical, deadline_ms: 5000, max_concurrency: 2}}
  - name: scale
    source: models/scale.onnx
    inputs: {{x: [2, 4]}}
    serve: {{priority: low}}
watch: {{debounce_ms: 50}}
incremental: {{enabled: true, diff_mode: semantic}}
"""


def affine_model(seed=0):
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["pre"]),
             helper.make_node("Relu", ["pre"], ["y"]), helper.make_node("Sigmoid", ["h"], ["z"])]
    return make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [2, 4]), ("z", np.float32, [2, 4])],
                      {"w": rng.standard_normal((8, 4)).astype(np.float32),
                       "b": rng.standard_normal(4).astype(np.float32)})


def scale_model(factor, output="y", rename=False):
    """x * s with s = factor; `rename` gives every internal name another spelling (a semantically null edit)."""
    s, node = ("scale_by", "mul_renamed") if rename else ("s", "mul")
    nodes = [helper.make_node("Mul", ["x", s], [output], name=node)]
    return make_model(nodes, [("x", np.float32, [2, 4])], [(output, np.float32, None)],
                      {s: np.array([factor, 2 * factor, -factor, 0.5], np.float32)})


def save(model, path: Path):
    """Write as an editor would: a temporary file renamed over the old one."""
    partial = path.with_suffix(".partial")
    partial.write_bytes(model.SerializeToString() if hasattr(model, "SerializeToString") else model)
    partial.replace(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    (folder / "models").mkdir()
    save(affine_model(), folder / "models" / "affine.onnx")
    save(scale_model(2.0), folder / "models" / "scale.onnx")
    (folder / "cuvil.yaml").write_text(CONFIG.format(cache=os.environ["CUVIL_CACHE_DIR"]))
    log = []
    srv = Server(folder / "cuvil.yaml", port=0, token=TOKEN, max_body_bytes=1 << 20, say=log.append)
    srv.folder, srv.log = folder, log
    srv.factors = {}  # version of `scale` -> its factor: each hot-update case starts from whatever serves
    # a safety net: the server stops itself even if the teardown below never runs
    timer = threading.Timer(600, srv.stop)
    timer.daemon = True
    timer.start()
    srv.start()
    srv.factors[srv.registry.entries["scale"].current.version] = 2.0
    yield srv
    timer.cancel()
    srv.stop()


def client(server):
    return tritonclient_http.InferenceServerClient(f"127.0.0.1:{server.port}", connection_timeout=30,
                                                   network_timeout=30)


def infer(c, model, x, binary=True, outputs=None, **kwargs):
    tensor = tritonclient_http.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    requested = [tritonclient_http.InferRequestedOutput(n, binary_data=binary) for n in outputs] if outputs else None
    return c.infer(model, [tensor], outputs=requested, headers=dict(AUTH), **kwargs)


def x_affine(seed):
    return np.random.default_rng(seed).standard_normal((2, 8)).astype(np.float32)


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_health_metadata_and_index(server):
    c = client(server)
    assert c.is_server_live() and c.is_server_ready()  # health needs no token
    assert c.is_model_ready("affine", headers=dict(AUTH))
    meta = c.get_model_metadata("affine", headers=dict(AUTH))
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [2, 8]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [2, 4]},
                               {"name": "z", "datatype": "FP32", "shape": [2, 4]}]
    assert c.get_server_metadata(headers=dict(AUTH))["name"] == "cuvil"
    index = {m["name"]: m for m in c.get_model_repository_index(headers=dict(AUTH))}
    assert set(index) == {"affine", "scale"} and all(m["state"] == "READY" for m in index.values())
    assert index["affine"]["version"] == meta["versions"][0]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_matches_onnxruntime(server, binary):
    c = client(server)
    model = affine_model()
    for seed in range(3):
        x = x_affine(seed)
        result = infer(c, "affine", x, binary=binary, outputs=["y", "z"], request_id=f"r{seed}")
        want = run_ort(model, {"x": x})
        assert_close(result.as_numpy("y"), want["y"])
        assert_close(result.as_numpy("z"), want["z"])
        assert result.get_response()["id"] == f"r{seed}"
        assert ("parameters" in result.get_output("y")) == binary


def test_timing_parameter_returns_the_servers_clock_at_each_stage(server):
    c = client(server)
    x = x_affine(3)
    sent = time.monotonic()  # the server runs in this process: one clock
    result = infer(c, "affine", x, parameters={"cuvil_timing": True})
    done = time.monotonic()
    assert_close(result.as_numpy("y"), run_ort(affine_model(), {"x": x})["y"])
    marks = result.get_response()["parameters"]
    stages = [marks[f"cuvil_{stage}"] for stage in ("received", "parsed", "started", "computed", "resumed")]
    assert sent <= stages[0] and stages == sorted(stages) and stages[-1] <= done
    assert "parameters" not in infer(c, "affine", x).get_response()  # only when asked
    # affine is critical and scale is not: one compute thread is kept for affine when there are two
    assert server.scheduler.reserve == (1 if server.workers >= 2 else 0)
    # and scale's runs go to threads 10 nice levels below the rest
    x = x_scale(1)
    assert_close(infer(c, "scale", x).as_numpy("y"), run_ort(scale_model(serving_factor(server)[1]), {"x": x})["y"])
    lower = list(server.lower_executor._threads)
    assert lower and all(os.getpriority(os.PRIO_PROCESS, t.native_id) == os.getpriority(os.PRIO_PROCESS, 0) + 10
                         for t in lower)


def test_infer_one_output_and_default_outputs(server):
    c = client(server)
    x = x_affine(7)
    want = run_ort(affine_model(), {"x": x})
    only_z = infer(c, "affine", x, outputs=["z"])
    assert [o["name"] for o in only_z.get_response()["outputs"]] == ["z"]
    assert_close(only_z.as_numpy("z"), want["z"])
    everything = infer(c, "affine", x)  # tritonclient then asks for every output as binary
    assert_close(everything.as_numpy("y"), want["y"])


def test_concurrent_clients_get_their_own_answers(server):
    model, errors, checked = affine_model(), [], []

    def worker(index):
        try:
            c = client(server)
            for i in range(15):
                x = x_affine(100 * index + i)
                got = infer(c, "affine", x).as_numpy("y")
                assert_close(got, run_ort(model, {"x": x})["y"])
                checked.append(1)
        except Exception as error:  # noqa: BLE001  reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(checked) == 60


# --- the bad-request corpus

def raw(server, method, path, body=b"", headers=None, token=True):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={**(AUTH if token else {}), **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def v2_json(inputs, **extra):
    return json.dumps({"inputs": inputs, **extra}).encode()


GOOD_INPUT = {"name": "x", "datatype": "FP32", "shape": [2, 8], "data": [0.5] * 16}
BINARY_HEADER = json.dumps({"inputs": [{**{k: v for k, v in GOOD_INPUT.items() if k != "data"},
                                        "parameters": {"binary_data_size": 64}}]}).encode()

BAD_REQUESTS = {
    # id: (path, body, extra headers, status, words the error must contain)
    "truncated json": ("affine", v2_json([GOOD_INPUT])[:-7], {}, 400, ["affine", "not valid JSON"]),
    "not an object": ("affine", b"[1, 2]", {}, 400, ["affine", "JSON object"]),
    "deeply nested": ("affine", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400, ["affine", "JSON"]),
    "not utf-8": ("affine", b'{"inputs": "\xff\xfe"}', {}, 400, ["affine", "not valid JSON"]),
    "no inputs": ("affine", b"{}", {}, 400, ["affine", "'inputs'"]),
    "wrong datatype": ("affine", v2_json([{**GOOD_INPUT, "datatype": "INT32"}]), {}, 400,
                       ["affine", "'x'", "INT32", "FP32"]),
    "wrong shape": ("affine", v2_json([{**GOOD_INPUT, "shape": [4, 4]}]), {}, 400, ["'x'", "[4, 4]", "[2, 8]"]),
    "huge dims": ("affine", v2_json([{**GOOD_INPUT, "shape": [2, 10 ** 12]}]), {}, 400, ["'x'", "shape"]),
    "negative dims": ("affine", v2_json([{**GOOD_INPUT, "shape": [-2, 8]}]), {}, 400, ["'x'", "shape"]),
    "too few values": ("affine", v2_json([{**GOOD_INPUT, "data": [1.0] * 15}]), {}, 400, ["'x'", "15 values"]),
    "strings as data": ("affine", v2_json([{**GOOD_INPUT, "data": ["1"] * 16}]), {}, 400, ["'x'", "strings"]),
    "ragged data": ("affine", v2_json([{**GOOD_INPUT, "data": [[1.0] * 8, [1.0] * 7]}]), {}, 400, ["'x'", "regular"]),
    "no data": ("affine", v2_json([{k: v for k, v in GOOD_INPUT.items() if k != "data"}]), {}, 400, ["'x'", "data"]),
    "unknown input": ("affine", v2_json([GOOD_INPUT, {**GOOD_INPUT, "name": "q"}]), {}, 400, ["'q'", "inputs: x"]),
    "missing input": ("affine", v2_json([]), {}, 400, ["affine", "missing input", "x"]),
    "input twice": ("affine", v2_json([GOOD_INPUT, GOOD_INPUT]), {}, 400, ["'x'", "twice"]),
    "unknown output": ("affine", v2_json([GOOD_INPUT], outputs=[{"name": "w"}]), {}, 400, ["'w'", "outputs: y, z"]),
    "binary size wrong": ("affine", BINARY_HEADER.replace(b"64", b"60") + bytes(60),
                          {"Inference-Header-Content-Length": str(len(BINARY_HEADER))}, 400,
                          ["'x'", "binary_data_size", "64 bytes"]),
    "binary data short": ("affine", BINARY_HEADER + bytes(10),
                          {"Inference-Header-Content-Length": str(len(BINARY_HEADER))}, 400, ["'x'", "10 bytes"]),
    "binary data extra": ("affine", BINARY_HEADER + bytes(80),
                          {"Inference-Header-Content-Length": str(len(BINARY_HEADER))}, 400, ["16 bytes"]),
    "header length bad": ("affine", v2_json([GOOD_INPUT]), {"Inference-Header-Content-Length": "99999"}, 400,
                          ["Inference-Header-Content-Length"]),
    "unknown model": ("resnet", v2_json([GOOD_INPUT]), {}, 404, ["unknown model 'resnet'", "affine, scale"]),
    "path in model name": ("..%2F..%2Fetc%2Fpasswd", v2_json([GOOD_INPUT]), {}, 404, ["unknown model"]),
    "body too large": ("affine", b"{" + b" " * (2 << 20) + b"}", {}, 413, ["larger than", "limit"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_request_gets_4xx_and_a_v2_error(server, case):
    model, body, headers, status, words = BAD_REQUESTS[case]
    got, _, text = raw(server, "POST", f"/v2/models/{model}/infer", body,
                       {"Content-Type": "application/json", **headers})
    assert got == status, text
    message = json.loads(text)["error"]
    for word in words:
        assert word in message, message
    assert "Traceback" not in message


def test_bad_requests_leave_the_server_serving(server):
    before = server.metrics.failures.labels("affine", "bad_request")._value.get()
    for case in ("truncated json", "huge dims", "wrong datatype"):
        model, body, headers, status, _ = BAD_REQUESTS[case]
        assert raw(server, "POST", f"/v2/models/{model}/infer", body, headers)[0] == status
    assert server.metrics.failures.labels("affine", "bad_request")._value.get() == before + 3
    x = x_affine(3)
    assert_close(infer(client(server), "affine", x).as_numpy("y"), run_ort(affine_model(), {"x": x})["y"])


def test_tritonclient_sees_the_error_message(server):
    c = client(server)
    tensor = tritonclient_http.InferInput("x", [2, 8], "FP64")
    tensor.set_data_from_numpy(np.zeros((2, 8), np.float64))
    with pytest.raises(InferenceServerException) as error:
        c.infer("affine", [tensor], headers=dict(AUTH))
    assert error.value.status() == "400" and "FP64" in error.value.message() and "'x'" in error.value.message()


def test_bearer_token_is_required_except_for_health(server):
    for path in ("/v2", "/v2/models/affine", "/v2/models/affine/ready", "/metrics"):
        status, headers, body = raw(server, "GET", path, token=False)
        assert status == 401 and "bearer token" in json.loads(body)["error"] and "WWW-Authenticate" in headers
        assert raw(server, "GET", path, headers={"Authorization": "Bearer wrong"}, token=False)[0] == 401
    status, _, body = raw(server, "POST", "/v2/models/affine/infer", v2_json([GOOD_INPUT]), token=False)
    assert status == 401
    assert raw(server, "GET", "/v2/health/live", token=False)[0] == 200
    assert raw(server, "GET", "/v2/health/ready", token=False)[0] == 200


def test_unknown_endpoint_and_method(server):
    status, _, body = raw(server, "GET", "/v2/models/affine/infer")
    assert status == 405 and "GET" in json.loads(body)["error"]
    status, _, body = raw(server, "GET", "/v1/models")
    assert status == 404 and "no endpoint" in json.loads(body)["error"]
    status, _, body = raw(server, "GET", "/v2/models/affine/versions/0123/ready")
    assert status == 400 and json.loads(body)["ready"] is False


def test_unload_and_load_through_the_repository_api(server):
    c = client(server)
    version = c.get_model_metadata("affine", headers=dict(AUTH))["versions"][0]
    c.unload_model("affine", headers=dict(AUTH))
    assert not c.is_model_ready("affine", headers=dict(AUTH))
    index = {m["name"]: m for m in c.get_model_repository_index(headers=dict(AUTH))}
    assert index["affine"]["state"] == "UNAVAILABLE" and "unloaded" in index["affine"]["reason"]
    with pytest.raises(InferenceServerException) as error:
        infer(c, "affine", x_affine(0))
    assert error.value.status() == "503" and "not loaded" in error.value.message()
    assert c.is_server_ready()  # an unloaded model is not a missing one
    c.load_model("affine", headers=dict(AUTH))
    assert c.is_model_ready("affine", headers=dict(AUTH))
    assert c.get_model_metadata("affine", headers=dict(AUTH))["versions"] == [version]  # same bytes
    x = x_affine(11)
    assert_close(infer(c, "affine", x).as_numpy("y"), run_ort(affine_model(), {"x": x})["y"])
    with pytest.raises(InferenceServerException) as error:
        c.load_model("nothere", headers=dict(AUTH))
    assert error.value.status() == "404"


def _requests_total(server, model: str) -> tuple[float, str]:
    status, headers, body = raw(server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    prefix = f'cuvil_requests_total{{model="{model}"}}'
    return float(next(l for l in text.splitlines() if l.startswith(prefix)).split()[-1]), text


def test_metrics_count_requests_and_compute_time(server):
    """Counted by this test alone: under pytest-xdist the module's other tests may run in another
    worker, against another server."""
    infer(client(server), "affine", x_affine(0))
    before, text = _requests_total(server, "affine")
    for line in ('cuvil_requests_total{model="affine"}', 'cuvil_compute_seconds_count{model="affine"}',
                 'cuvil_queue_seconds_bucket{le="+Inf",model="affine"}',
                 'cuvil_model_ready{model="affine"} 1.0'):
        assert line in text, line
    for k in range(5):
        infer(client(server), "affine", x_affine(k))
    assert raw(server, "POST", "/v2/models/affine/infer", b"{not json")[0] == 400
    after, text = _requests_total(server, "affine")
    assert after - before >= 5
    assert 'cuvil_request_failures_total{model="affine",reason="bad_request"}' in text


def test_startup_objects_are_frozen_and_collections_are_measured(server):
    """The objects of start-up are out of the collector's reach while serving (CollectorWatch), and
    every collection's time is in cuvil_gc_pause_seconds; the answers stay right."""
    assert gc.get_freeze_count() > 0
    gc.collect()  # a full collection on this thread: the server's callback measures it
    text = raw(server, "GET", "/metrics")[2].decode()
    assert 'cuvil_gc_pause_seconds_count{generation="2"}' in text
    count = float(next(l.split()[-1] for l in text.splitlines()
                       if l.startswith('cuvil_gc_pause_seconds_count{generation="2"}')))
    assert count >= 1
    x = x_affine(3)
    assert_close(infer(client(server), "affine", x).as_numpy("y"), run_ort(affine_model(), {"x": x})["y"])


# --- hot updates of `scale` (they change it: keep them last)

def scale_events(server):
    return [e for e in server.updater.events if e.model == "scale"]


def wait_for_event(server, count, timeout=120):
    """The `count`th hot-update event of `scale`, once it happened (a bounded wait, not a timing check)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        events = scale_events(server)
        if len(events) >= count:
            return events[count - 1]
        time.sleep(0.02)
    raise AssertionError(f"no hot-update event #{count}; log:\n" + "\n".join(server.log))


def swaps_counted(server, result):
    """cuvil_swaps_total{model="scale", result=...} as /metrics shows it."""
    text = raw(server, "GET", "/metrics")[2].decode()
    prefix = f'cuvil_swaps_total{{model="scale",result="{result}"}} '
    return float(next((l[len(prefix):] for l in text.splitlines() if l.startswith(prefix)), 0))


def serving_factor(server):
    """The version of `scale` serving now and its factor (the cases below do not depend on their order)."""
    version = server.registry.entries["scale"].current.version
    return version, server.factors[version]


def x_scale(seed):
    return np.random.default_rng(seed).standard_normal((2, 4)).astype(np.float32)


def test_hot_swap_under_load_fails_nothing_and_serves_the_new_weights(server):
    folder, events = server.folder, len(scale_events(server))
    old_version, old_factor = serving_factor(server)
    new_factor = old_factor + 1.0
    stop, answers, errors = threading.Event(), [], []

    def load():
        c = client(server)
        for i in range(5000):  # bounded: stop is set long before
            if stop.is_set():
                return
            x = x_scale(i % 7)
            try:
                result = infer(c, "scale", x)
                answers.append((i % 7, result.get_response()["model_version"], result.as_numpy("y")))
            except Exception as error:  # noqa: BLE001  counted as a failure
                errors.append(repr(error))
            time.sleep(0.002)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        while len(answers) < 20 and thread.is_alive():
            time.sleep(0.01)
        save(scale_model(new_factor), folder / "models" / "scale.onnx")
        event = wait_for_event(server, events + 1)
        server.factors[event.version] = new_factor
        after = len(answers)
        while len(answers) < after + 20 and thread.is_alive():
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert event.result == "swapped", event
    assert not errors, errors[:3]
    weights = {old_version: scale_model(old_factor), event.version: scale_model(new_factor)}
    versions = [v for _, v, _ in answers]
    assert set(versions) == {old_version, event.version}
    first_new = versions.index(event.version)
    assert all(v == event.version for v in versions[first_new:]), "an old answer came after a new one"
    for seed, version, got in answers:
        assert_close(got, run_ort(weights[version], {"x": x_scale(seed)})["y"])
    # the worker installs into the output folder after the swap: there, once it is done, the same bytes
    server.builder.settle()
    library = next((folder / "out" / "scale" / "native").glob("lib*.so"))
    assert hashlib.sha256(library.read_bytes()).hexdigest()[:16] == event.version


def test_semantically_null_edit_swaps_nothing(server):
    folder, events = server.folder, len(scale_events(server))
    version, factor = serving_factor(server)
    save(scale_model(factor, rename=True), folder / "models" / "scale.onnx")
    event = wait_for_event(server, events + 1)
    assert event.result == "same_key" and event.version == version
    assert server.registry.entries["scale"].current.version == version


def test_broken_save_keeps_the_old_version_and_says_why(server):
    folder, events = server.folder, len(scale_events(server))
    version, factor = serving_factor(server)
    save(scale_model(5.0).SerializeToString()[:40], folder / "models" / "scale.onnx")
    event = wait_for_event(server, events + 1)
    assert event.result == "build_failed" and "scale" in event.reason
    x = x_scale(1)
    result = infer(client(server), "scale", x)
    assert result.get_response()["model_version"] == version
    assert_close(result.as_numpy("y"), run_ort(scale_model(factor), {"x": x})["y"])


def test_changed_signature_is_reported_not_swapped(server):
    folder, events = server.folder, len(scale_events(server))
    version = server.registry.entries["scale"].current.version
    save(scale_model(4.0, output="renamed"), folder / "models" / "scale.onnx")
    event = wait_for_event(server, events + 1)
    assert event.result == "signature_changed" and "renamed" in event.reason
    assert server.registry.entries["scale"].current.version == version
    assert swaps_counted(server, "signature_changed") >= 1
    swapped = swaps_counted(server, "swapped")
    # the fix: the next good save swaps again
    save(scale_model(6.0), folder / "models" / "scale.onnx")
    event = wait_for_event(server, events + 2)
    assert event.result == "swapped" and swaps_counted(server, "swapped") == swapped + 1
    server.factors[event.version] = 6.0
    x = x_scale(2)
    assert_close(infer(client(server), "scale", x).as_numpy("y"), run_ort(scale_model(6.0), {"x": x})["y"])


def test_a_model_that_does_not_build_is_unavailable_with_its_reason(tmp_path):
    (tmp_path / "models").mkdir()
    save(scale_model(2.0), tmp_path / "models" / "good.onnx")
    (tmp_path / "models" / "broken.onnx").write_bytes(b"not an onnx model")
    (tmp_path / "cuvil.yaml").write_text(
        f"version: 1\noutput_dir: out\ncache: {{dir: {os.environ['CUVIL_CACHE_DIR']}}}\nmodels:\n"
        f"  - {{name: good, source: models/good.onnx, inputs: {{x: [2, 4]}}}}\n"
        f"  - {{name: broken, source: models/broken.onnx}}\n")
    log = []
    srv = Server(tmp_path / "cuvil.yaml", port=0, say=log.append).start()
    try:
        assert raw(srv, "GET", "/v2/health/ready", token=False)[0] == 503  # not every model is loaded
        index = {m["name"]: m for m in json.loads(raw(srv, "POST", "/v2/repository/index", token=False)[2])}
        assert index["good"]["state"] == "READY"
        assert index["broken"]["state"] == "UNAVAILABLE" and "broken" in index["broken"]["reason"]
        status, _, body = raw(srv, "POST", "/v2/models/broken/infer", v2_json([GOOD_INPUT]), token=False)
        assert status == 503 and "not loaded" in json.loads(body)["error"]
        x = x_scale(0)
        result = infer(tritonclient_http.InferenceServerClient(f"127.0.0.1:{srv.port}"), "good", x)
        assert_close(result.as_numpy("y"), run_ort(scale_model(2.0), {"x": x})["y"])
    finally:
        srv.stop()
    assert any("[broken] not served" in line for line in log)


@pytest.mark.slow
def test_repeated_swaps_under_load_from_four_clients(server):
    folder, events = server.folder, len(scale_events(server))
    version, factor = serving_factor(server)
    weights = {version: factor}
    stop, answers, errors = threading.Event(), [], []

    def load(index):
        c = client(server)
        for i in range(20_000):  # bounded: stop is set long before
            if stop.is_set():
                return
            x = x_scale(index * 10 + i % 5)
            try:
                result = infer(c, "scale", x)
                answers.append((index * 10 + i % 5, result.get_response()["model_version"], result.as_numpy("y")))
            except Exception as error:  # noqa: BLE001  counted as a failure
                errors.append(repr(error))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for k, factor in enumerate([7.0, 8.0, 9.0, 10.0, 11.0], start=1):
            save(scale_model(factor), folder / "models" / "scale.onnx")
            event = wait_for_event(server, events + k)
            assert event.result == "swapped", event
            weights[event.version] = server.factors[event.version] = factor
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors[:3]
    assert {v for _, v, _ in answers} == set(weights)
    for seed, version, got in answers:
        assert_close(got, run_ort(scale_model(weights[version]), {"x": x_scale(seed)})["y"])


def test_cli_serve_starts_answers_and_stops_on_sigterm(server, tmp_path):
    """`cuvil serve` as a user runs it: a port chosen by the OS, a token file, SIGTERM to stop."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    config = server.folder / "cuvil.yaml"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "cuvil", "serve", "-f", str(config), "--port", "0",
                             "--token-file", str(tmp_path / "token"), "--stop-after", "300"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        end = time.monotonic() + 240
        while not any(line.startswith("serving ") for line in lines):
            assert proc.poll() is None and time.monotonic() < end, "no 'serving' line:\n" + "".join(lines)
            time.sleep(0.05)
        serving = next(line for line in lines if line.startswith("serving "))
        port = int(serving.split("http://127.0.0.1:")[1].split()[0])
        c = tritonclient_http.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=30)
        x = x_affine(5)
        assert_close(infer(c, "affine", x).as_numpy("y"), run_ort(affine_model(), {"x": x})["y"])
        with pytest.raises(InferenceServerException) as error:
            c.get_model_metadata("affine")  # no token
        assert error.value.status() == "401"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)
        assert proc.returncode == 0, "".join(lines)
        assert "stopping\n" in lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
