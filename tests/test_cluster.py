"""`cuvil build --scheduler`: the build's steps as tasks of a real Dask cluster (cuvil/cluster.py).

One `distributed.LocalCluster` of two worker processes on 127.0.0.1 serves the
module and stops at its end; the shared cache is moto's S3 server on the
loopback (as in test_cache.py) or a folder both workers see. Nothing leaves
the machine.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import uuid
from pathlib import Path

import pytest

from cuvil import cluster
from cuvil.cli import main
from cuvil.config import load_config

from tests.test_c_abi import SECOND_MODEL
from tests.test_cli import TEST_CACHE, write_example_project

distributed = pytest.importorskip("distributed", reason="dask[distributed] is not installed")
BUCKET = "cuvil-cluster-test"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _aws_env(endpoint: str, folder: Path) -> dict:
    """The documented environment that points botocore at the moto server, and at nothing of this machine."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
            "AWS_CONFIG_FILE": str(folder / "no-config"), "AWS_SHARED_CREDENTIALS_FILE": str(folder / "no-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield _aws_env(f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("aws"))
    finally:
        server.stop()


@pytest.fixture(scope="module")
def scheduler(s3, tmp_path_factory):
    """The address of a LocalCluster of 2 worker processes, 1 thread each, on the loopback only."""
    workers_cache = tmp_path_factory.mktemp("workers-cache")   # the workers' own folder in front of S3
    env = {**s3, "CUVIL_CACHE_DIR": str(workers_cache)}
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                                  dashboard_address=None, env=env) as local_cluster:
        yield local_cluster.scheduler_address


@pytest.fixture
def aws(s3, monkeypatch):
    for name, value in s3.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "HTTP_PROXY", "HTTPS_PROXY",
                 "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    import boto3
    client = boto3.client("s3")
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def _project(folder: Path, cache_lines: str) -> Path:
    """The example project with a second model, its cache section replaced by `cache_lines`."""
    config = write_example_project(folder, extra_models=SECOND_MODEL)
    text = config.read_text().replace(f"  dir: {TEST_CACHE}\n", cache_lines)
    assert cache_lines in text
    config.write_text(text)
    return config


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def local_build(tmp_path_factory):
    """The same project built on this machine, the bytes to compare with."""
    folder = tmp_path_factory.mktemp("local")
    config = _project(folder, f"  dir: {TEST_CACHE}\n")
    assert main(["build", "-f", str(config)]) == 0
    return _files(folder / "build" / "cuvil")


def test_cluster_build_is_byte_identical_to_the_local_build(scheduler, aws, local_build, tmp_path, capsys):
    config = _project(tmp_path, f"  dir: {tmp_path / 'cache'}\n  url: {aws}\n")
    assert main(["build", "-f", str(config), "--scheduler", scheduler, "--report", str(tmp_path / "r.json"),
                 "--timeline", str(tmp_path / "timeline.html")]) == 0
    assert _files(tmp_path / "build" / "cuvil") == local_build
    steps = json.loads((tmp_path / "r.json").read_text())["steps"]
    ran = [s for s in steps if s["status"] == "ran"]
    assert {s["kind"] for s in ran} >= {"import", "graph", "pass", "codegen", "kernel", "link"}
    # The import runs where the build is planned: the steps after it are keyed by its graph's
    # identity (cuvil/semantic.py), known once it has run. Every other step ran on a worker.
    assert all(s["worker"].startswith("tcp://127.0.0.1:") for s in ran if s["kind"] not in ("import", "export")), \
        "every step after the import ran on a worker"
    assert " on tcp://127.0.0.1:" in capsys.readouterr().out
    assert '"worker": "tcp://127.0.0.1:' in (tmp_path / "timeline.html").read_text()   # one lane per worker

    # A second machine with an empty folder of its own builds nothing: the cluster's steps are on S3.
    other = tmp_path / "laptop"
    other.mkdir()
    config2 = _project(other, f"  dir: {other / 'cache'}\n  url: {aws}\n")
    assert main(["build", "-f", str(config2), "--scheduler", scheduler]) == 0
    assert "ran 0, cached" in capsys.readouterr().out
    assert _files(other / "build" / "cuvil") == local_build


def _sealed(blob: bytes) -> bool:
    return hashlib.sha256(blob[32:]).digest() == blob[:32]


def _arm_kill(key: str, marker: str):
    """Runs in each worker: the first put of entry `key` (a link step's output) writes half of it to a
    temporary file and kills its own process with SIGKILL, as a machine lost mid-write would."""
    from cuvil import cache
    original = cache.Cache.put

    def put(self, k, data):
        if k == key:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:   # the one kill happened: the retry writes normally
                return original(self, k, data)
            path = self._path(k)
            path.parent.mkdir(parents=True, exist_ok=True)
            blob = cache._seal(data)
            (path.parent / f"{cache._TEMP_PREFIX}killed").write_bytes(blob[: len(blob) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, k, data)

    cache.Cache.put = put


def test_a_worker_killed_mid_step_is_retried_elsewhere(scheduler, local_build, tmp_path, capsys):
    """The link step's worker dies while writing its output: the task reruns on another worker, the
    build succeeds with the same bytes, and the cache holds only whole entries."""
    cache_dir = tmp_path / "cache"   # a folder both workers see (one machine)
    config = _project(tmp_path, f"  dir: {cache_dir}\n")
    # the cluster named in the config this time, not on the command line
    config.write_text(config.read_text().replace("  kind: local\n", f"  kind: dask\n  address: {scheduler}\n"))
    assert load_config(config).executor.address == scheduler
    from cuvil.project import plan_project
    dag, _ = plan_project(load_config(config), ["tiny_cnn"], progress=None)
    link_key = dag.key("tiny_cnn/native/link")
    marker = tmp_path / "killed"
    with distributed.Client(scheduler, set_as_default=False) as client:
        client.run(_arm_kill, link_key, str(marker))
        before = set(client.scheduler_info()["workers"])
        assert main(["build", "-f", str(config), "--report", str(tmp_path / "r.json")]) == 0
        assert marker.exists(), "no worker was killed"
        client.wait_for_workers(2, timeout=60)   # the nanny restarted it
        assert set(client.scheduler_info()["workers"]) != before
        client.run(_disarm)
    assert _files(tmp_path / "build" / "cuvil") == local_build
    link = next(s for s in json.loads((tmp_path / "r.json").read_text())["steps"] if s["name"] == "tiny_cnn/native/link")
    assert link["status"] == "ran"
    entries = [p for p in cache_dir.rglob("*") if p.is_file()]
    whole = [p for p in entries if not p.name.startswith(".tmp-")]
    assert whole and all(_sealed(p.read_bytes()) for p in whole)
    assert (cache_dir / link_key[:2] / link_key).is_file()


def _disarm():
    import importlib

    from cuvil import cache
    cache.Cache.put = importlib.reload(cache).Cache.put


def test_a_model_error_on_a_worker_names_the_entry_in_the_config(scheduler, tmp_path, capsys):
    import numpy as np
    from onnx import helper

    from tests.helpers import make_model
    from tests.test_cli import _unsupported_op
    op = _unsupported_op()
    model = make_model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                        helper.make_node(op, ["r"], ["y"], name="odd")],
                       [("x", np.float32, [2, 4, 4])], [("y", np.float32, [2, 4, 4])])
    config = _project(tmp_path, f"  dir: {tmp_path / 'cache'}\n")
    (tmp_path / "examples" / "models" / "odd.onnx").write_bytes(model.SerializeToString())
    config.write_text(config.read_text().replace(SECOND_MODEL, "\n  - name: odd\n    source: examples/models/odd.onnx\n"))
    assert main(["build", "-f", str(config), "--scheduler", scheduler]) == 2
    err = capsys.readouterr().err
    assert f"{config.name}:" in err and "model 'odd'" in err and "Traceback" not in err


def test_an_unreachable_scheduler_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cluster, "_CONNECT_TIMEOUT_S", 1)
    config = _project(tmp_path, f"  dir: {tmp_path / 'cache'}\n")
    assert main(["build", "-f", str(config), "--scheduler", f"tcp://127.0.0.1:{_free_port()}"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Dask scheduler" in err and "hint: start one with `dask scheduler`" in err
    assert not (tmp_path / "build").exists()


def test_a_scheduler_without_workers_is_refused(tmp_path, capsys):
    config = _project(tmp_path, f"  dir: {tmp_path / 'cache'}\n")
    with distributed.LocalCluster(n_workers=0, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as empty:
        assert main(["build", "-f", str(config), "--scheduler", empty.scheduler_address]) == 2
    assert "has no workers" in capsys.readouterr().err


def test_a_read_only_cache_is_refused(tmp_path, capsys):
    config = _project(tmp_path, f"  dir: {tmp_path / 'cache'}\n  read_only: true\n")
    config.write_text(config.read_text().replace("  read_only: false\n", ""))
    assert main(["build", "-f", str(config), "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert "read_only" in capsys.readouterr().err


def test_a_worker_with_other_versions_refuses_the_step(tmp_path):
    config = _project(tmp_path, f"  dir: {tmp_path / 'cache'}\n")
    spec = load_config(config)
    from cuvil.build import tool_versions
    from cuvil.project import plan_project
    plan = cluster.ClusterPlan("t-versions", spec, None, {**tool_versions(), "numba": "0.0"}, plan_project)
    result = cluster.run_step(plan, "tiny_cnn/native/import", "0" * 64, None)
    assert "other versions than the client: numba" in result["error"]["message"]

    plan = cluster.ClusterPlan("t-key", spec, None, tool_versions(), plan_project)
    result = cluster.run_step(plan, "tiny_cnn/native/import", "0" * 64, None)
    assert "the worker sees other inputs" in result["error"]["message"]
