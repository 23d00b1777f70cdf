"""The step cache: local folder, fsspec remote, the two tiered, and a real S3 API.

What matters is that a cache only ever makes a build faster: damaged entries,
racing writers, unwritable folders and unreachable remotes all read as misses.
The S3 tests run against moto's server on 127.0.0.1; nothing leaves the machine.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from cuvil import cache as cache_module
from cuvil.cache import Cache, RemoteCache, TieredCache, open_cache, parse_size, step_key
from cuvil.config import CacheConfig
from cuvil.dag import Step, StepGraph
from cuvil.errors import CuvilError

ROOT = Path(__file__).resolve().parents[1]
KEY = step_key({"kind": "test", "n": 1})
OTHER = step_key({"kind": "test", "n": 2})


def entry_path(cache: Cache, key: str) -> Path:
    return cache.root / key[:2] / key


def entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# --- local cache ----------------------------------------------------------------------

def test_put_get_contains(tmp_path):
    cache = Cache(tmp_path)
    assert cache.get(KEY) is None and not cache.contains(KEY)
    cache.put(KEY, b"payload")
    assert cache.contains(KEY)
    assert cache.get(KEY) == b"payload"
    assert (cache.hits, cache.misses) == (1, 1)
    blob = entry_path(cache, KEY).read_bytes()
    assert len(blob) == 32 + len(b"payload")  # sha256 prefix, then the data
    assert entry_files(tmp_path) == [entry_path(cache, KEY)]  # no temporary file left behind


def test_empty_data_and_overwrite(tmp_path):
    cache = Cache(tmp_path)
    cache.put(KEY, b"")
    assert cache.get(KEY) == b""
    cache.put(KEY, b"second")
    assert cache.get(KEY) == b"second"


def test_no_root_holds_nothing():
    cache = Cache(None)
    cache.put(KEY, b"x")
    assert cache.get(KEY) is None and not cache.contains(KEY)
    assert cache.stats() == {"entries": 0, "bytes": 0}


@pytest.mark.parametrize("key", ["", "../escape", "a/b", ".hidden", "a b"])
def test_keys_that_are_not_one_path_component_are_refused(tmp_path, key):
    with pytest.raises(ValueError, match="invalid cache key"):
        Cache(tmp_path).put(key, b"x")


def _truncate_to_prefix(blob):
    return blob[:10]


def _truncate_data(blob):
    return blob[:-3]


def _flip_data_byte(blob):
    return blob[:40] + bytes([blob[40] ^ 0x01]) + blob[41:]


def _flip_digest_byte(blob):
    return bytes([blob[0] ^ 0x80]) + blob[1:]


def _empty(blob):
    return b""


CORRUPTIONS = [_truncate_to_prefix, _truncate_data, _flip_data_byte, _flip_digest_byte, _empty]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_entry_is_logged_removed_and_a_miss(tmp_path, caplog, corrupt):
    cache = Cache(tmp_path)
    cache.put(KEY, b"0123456789" * 10)
    path = entry_path(cache, KEY)
    path.write_bytes(corrupt(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="cuvil.cache"):
        assert cache.get(KEY) is None
    assert "corrupt" in caplog.text and KEY in caplog.text
    assert not path.exists()
    assert cache.misses == 1 and cache.hits == 0
    cache.put(KEY, b"rebuilt")
    assert cache.get(KEY) == b"rebuilt"


def test_corrupt_entry_in_read_only_cache_is_a_miss_left_in_place(tmp_path, caplog):
    Cache(tmp_path).put(KEY, b"data")
    path = entry_path(Cache(tmp_path), KEY)
    path.write_bytes(_flip_data_byte(path.read_bytes() + b"padding"))
    cache = Cache(tmp_path, read_only=True)
    with caplog.at_level(logging.WARNING, logger="cuvil.cache"):
        assert cache.get(KEY) is None
    assert "corrupt" in caplog.text and path.exists()


def _counting_step(name, runs, output=b"out"):
    def run(graph):
        runs.append(name)
        return output
    return Step(name=name, kind="test", params={"name": name}, deps=[], run=run,
                encode=lambda value: value, decode=lambda data: data)


def test_build_step_with_corrupt_entry_is_rebuilt(tmp_path):
    runs = []
    first = StepGraph(Cache(tmp_path), versions={"cuvil": "test"})
    first.add(_counting_step("a", runs))
    assert first.get("a") == b"out" and runs == ["a"]
    path = entry_path(Cache(tmp_path), first.key("a"))
    path.write_bytes(_flip_digest_byte(path.read_bytes()))

    second = StepGraph(Cache(tmp_path), versions={"cuvil": "test"})
    second.add(_counting_step("a", runs))
    assert second.get("a") == b"out" and runs == ["a", "a"]
    third = StepGraph(Cache(tmp_path), versions={"cuvil": "test"})
    third.add(_counting_step("a", runs))
    assert third.get("a") == b"out" and runs == ["a", "a"]  # the rebuilt entry is good


WRITER = textwrap.dedent("""
    import hashlib, sys
    from cuvil.cache import Cache
    root, worker, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cache = Cache(root)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(8)]
    def data(key):
        return key.encode() * 200  # the same bytes for a key whichever process writes it
    bad = 0
    for round in range(rounds):
        for key in (keys if worker == 0 else keys[::-1]):
            cache.put(key, data(key))
            got = cache.get(key)
            if got != data(key):
                bad += 1
    print(f"bad={bad} hits={cache.hits} misses={cache.misses}")
    sys.exit(1 if bad or cache.misses else 0)
""")


def test_two_processes_writing_the_same_keys(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(worker), "150"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
               for worker in (0, 1)]
    for writer in writers:
        output, _ = writer.communicate(timeout=120)
        assert writer.returncode == 0, output
    cache = Cache(tmp_path)
    assert cache.stats()["entries"] == 8
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_unwritable_folder_never_fails_a_put(tmp_path, monkeypatch, caplog):
    cache = Cache(tmp_path / "cache")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module.os, "replace", disk_full)
    with caplog.at_level(logging.WARNING, logger="cuvil.cache"):
        cache.put(KEY, b"data")
        cache.put(OTHER, b"data")
    assert "No space left" in caplog.text
    assert caplog.text.count("could not write") == 1  # one warning, not one per step
    assert cache.get(KEY) is None
    assert not [p for p in (tmp_path / "cache").rglob(".tmp-*")]  # the half-written file is cleaned up


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes through file permissions")
def test_read_only_folder_never_fails_a_put(tmp_path, caplog):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING, logger="cuvil.cache"):
            Cache(root).put(KEY, b"data")
        assert "could not write" in caplog.text
    finally:
        root.chmod(0o755)


def test_cache_dir_that_is_a_file_never_fails_a_build(tmp_path, caplog):
    # Unwritable even for root, unlike a chmod-ed folder.
    root = tmp_path / "not-a-folder"
    root.write_text("oops")
    cache = Cache(root)
    with caplog.at_level(logging.WARNING, logger="cuvil.cache"):
        cache.put(KEY, b"data")
        assert cache.get(KEY) is None and not cache.contains(KEY)
    assert "could not write" in caplog.text
    assert cache.stats() == {"entries": 0, "bytes": 0} and cache.prune(0)["removed"] == 0


def test_read_only_cache_reads_but_does_not_write(tmp_path):
    Cache(tmp_path).put(KEY, b"old")
    os.utime(entry_path(Cache(tmp_path), KEY), (1_000_000, 1_000_000))
    cache = Cache(tmp_path, read_only=True)
    assert cache.get(KEY) == b"old"
    cache.put(OTHER, b"new")
    assert not cache.contains(OTHER)
    assert entry_path(cache, KEY).stat().st_mtime == 1_000_000  # a read-only hit does not touch


# --- stats, prune, sizes ---------------------------------------------------------------

def _keys(n):
    return [step_key({"i": i}) for i in range(n)]


def test_stats_counts_entries_not_temporary_files(tmp_path):
    cache = Cache(tmp_path)
    assert cache.stats() == {"entries": 0, "bytes": 0}
    for key in _keys(3):
        cache.put(key, b"x" * 100)
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / ".tmp-writer").write_bytes(b"partial")
    assert cache.stats() == {"entries": 3, "bytes": 3 * 132}
    assert Cache(tmp_path / "missing").stats() == {"entries": 0, "bytes": 0}


def test_prune_removes_least_recently_used_first(tmp_path):
    cache = Cache(tmp_path)
    oldest, middle, newest = _keys(3)
    for age, key in ((300, oldest), (200, middle), (100, newest)):
        cache.put(key, b"x" * 968)  # 1000 bytes with the digest
        stamp = time.time() - age
        os.utime(entry_path(cache, key), (stamp, stamp))
    assert cache.get(oldest) == b"x" * 968  # a hit makes it the most recently used

    report = cache.prune(2000)
    assert report == {"removed": 1, "removed_bytes": 1000, "entries": 2, "bytes": 2000}
    assert not cache.contains(middle)
    assert cache.contains(oldest) and cache.contains(newest)

    assert cache.prune("1K") == {"removed": 1, "removed_bytes": 1000, "entries": 1, "bytes": 1000}
    assert cache.contains(oldest) and not cache.contains(newest)
    assert cache.prune(10_000)["removed"] == 0
    assert cache.prune(0) == {"removed": 1, "removed_bytes": 1000, "entries": 0, "bytes": 0}


def test_prune_removes_stale_temporary_files(tmp_path):
    cache = Cache(tmp_path)
    cache.put(KEY, b"data")
    stale, fresh = entry_path(cache, KEY).parent / ".tmp-dead", entry_path(cache, KEY).parent / ".tmp-live"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (time.time() - 2 * 3600,) * 2)
    cache.prune(10_000)
    assert not stale.exists() and fresh.exists() and cache.contains(KEY)


def test_prune_refuses_a_read_only_cache(tmp_path):
    with pytest.raises(CuvilError, match="read-only"):
        Cache(tmp_path, read_only=True).prune("1M")


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("123", 123), (4096, 4096), ("1K", 1024), ("500M", 500 * 1024 ** 2), ("2G", 2 * 1024 ** 3),
    ("1.5G", int(1.5 * 1024 ** 3)), ("10k", 10240), (" 3 MB ", 3 * 1024 ** 2), ("1GiB", 1024 ** 3), ("1T", 1024 ** 4),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "-1M", "12X", "1.2.3G", "ten"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(CuvilError, match="invalid size"):
        parse_size(text)


# --- remote cache over fsspec ------------------------------------------------------------

@pytest.fixture
def memory_url():
    url = f"memory://cuvil-test-{uuid.uuid4().hex}"
    yield url
    import fsspec
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_remote_put_get_contains(memory_url):
    remote = RemoteCache(memory_url)
    assert remote.get(KEY) is None and not remote.contains(KEY)
    remote.put(KEY, b"shared")
    assert remote.contains(KEY)
    assert remote.get(KEY) == b"shared"
    assert (remote.hits, remote.misses) == (1, 1)
    raw = remote.fs.cat_file(f"{remote._base}/{KEY[:2]}/{KEY}")
    assert raw[32:] == b"shared" and len(raw) == 38  # the local entry format


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_remote_corrupt_entry_is_removed_and_a_miss(memory_url, caplog, corrupt):
    remote = RemoteCache(memory_url)
    remote.put(KEY, b"0123456789" * 10)
    path = f"{remote._base}/{KEY[:2]}/{KEY}"
    remote.fs.pipe_file(path, corrupt(remote.fs.cat_file(path)))
    with caplog.at_level(logging.WARNING, logger="cuvil.cache"):
        assert remote.get(KEY) is None
    assert "corrupt" in caplog.text
    assert not remote.contains(KEY)


def test_read_only_remote_keeps_corrupt_entry_and_writes_nothing(memory_url):
    writer = RemoteCache(memory_url)
    writer.put(KEY, b"data")
    path = f"{writer._base}/{KEY[:2]}/{KEY}"
    writer.fs.pipe_file(path, b"garbage" * 10)
    reader = RemoteCache(memory_url, read_only=True)
    assert reader.get(KEY) is None
    assert writer.fs.exists(path)
    reader.put(OTHER, b"new")
    assert not writer.contains(OTHER)


def test_remote_on_a_shared_folder(tmp_path):
    url = (tmp_path / "shared").as_uri()
    first, second = RemoteCache(url), RemoteCache(url)
    first.put(KEY, b"over nfs")
    assert second.get(KEY) == b"over nfs"
    assert entry_files(tmp_path / "shared") == [tmp_path / "shared" / KEY[:2] / KEY]


class _Unreachable:
    """A filesystem whose every call fails the way a dead network does."""

    protocol = "s3"

    def __init__(self):
        self.calls = 0

    def _fail(self, *args, **kwargs):
        self.calls += 1
        raise ConnectionError("Could not connect to the endpoint URL")

    cat_file = pipe_file = exists = rm_file = _fail


def test_network_errors_are_misses_and_a_dead_remote_is_left_alone(memory_url, caplog):
    remote = RemoteCache(memory_url)
    remote.fs = dead = _Unreachable()
    with caplog.at_level(logging.WARNING, logger="cuvil.cache"):
        assert remote.get(KEY) is None
        remote.put(KEY, b"data")
        assert remote.contains(KEY) is False
        for _ in range(5):
            assert remote.get(KEY) is None
            remote.put(KEY, b"data")
    assert dead.calls == RemoteCache.max_failures  # then it stops trying
    assert "Could not connect" in caplog.text and "not used for the rest" in caplog.text


def test_a_remote_success_resets_the_failure_count(memory_url):
    remote = RemoteCache(memory_url)
    real_fs = remote.fs
    for _ in range(3):
        remote.fs = _Unreachable()
        remote.get(KEY)
        remote.get(KEY)
        remote.fs = real_fs
        remote.put(KEY, b"ok")
    assert remote.get(KEY) == b"ok"


def test_unknown_protocol_is_a_cuvil_error():
    with pytest.raises(CuvilError, match="cannot be opened") as info:
        RemoteCache("nosuchproto://bucket/prefix")
    assert "s3://bucket/prefix" in info.value.hint


def test_protocol_without_its_package_names_the_package(monkeypatch):
    import fsspec.core

    def missing(url, **options):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    with pytest.raises(CuvilError, match="s3fs") as info:
        RemoteCache("s3://bucket/prefix")
    assert info.value.hint == "pip install 'cuvil[s3]'"
    with pytest.raises(CuvilError, match="gcsfs") as info:
        RemoteCache("gcs://bucket/prefix")
    assert "pip install gcsfs" in info.value.hint


# --- tiered cache, open_cache -----------------------------------------------------------

def test_tiered_reads_local_then_remote_and_fills_local(tmp_path, memory_url):
    remote = RemoteCache(memory_url)
    remote.put(KEY, b"from the fleet")
    tiered = TieredCache(Cache(tmp_path), remote)
    assert tiered.root == tmp_path
    assert tiered.contains(KEY) and not tiered.local.contains(KEY)
    assert tiered.get(KEY) == b"from the fleet"
    assert tiered.local.contains(KEY)  # copied down
    remote.fs.rm_file(f"{remote._base}/{KEY[:2]}/{KEY}")
    assert tiered.get(KEY) == b"from the fleet"  # now served locally
    assert tiered.get(OTHER) is None
    assert (tiered.hits, tiered.misses, tiered.remote_hits) == (2, 1, 1)


def test_tiered_put_writes_both_unless_remote_read_only(tmp_path, memory_url):
    tiered = TieredCache(Cache(tmp_path / "a"), RemoteCache(memory_url))
    tiered.put(KEY, b"both")
    assert tiered.local.contains(KEY) and tiered.remote.contains(KEY)

    consumer = TieredCache(Cache(tmp_path / "b"), RemoteCache(memory_url, read_only=True))
    consumer.put(OTHER, b"local only")
    assert consumer.local.contains(OTHER) and not tiered.remote.contains(OTHER)
    assert consumer.stats() == {"entries": 1, "bytes": 32 + len(b"local only")}
    assert consumer.prune(0)["removed"] == 1


def test_tiered_without_remote_is_the_local_cache(tmp_path):
    tiered = TieredCache(Cache(tmp_path))
    tiered.put(KEY, b"x")
    assert tiered.get(KEY) == b"x" and tiered.contains(KEY) and tiered.get(OTHER) is None
    assert (tiered.hits, tiered.misses) == (1, 1)


def test_open_cache(tmp_path, memory_url):
    local = open_cache(CacheConfig(dir=tmp_path, read_only=True))
    assert type(local) is Cache and local.root == tmp_path and local.read_only

    tiered = open_cache(CacheConfig(dir=tmp_path, url=memory_url, read_only=True))
    assert isinstance(tiered, TieredCache) and tiered.root == tmp_path
    assert tiered.remote.read_only and not tiered.local.read_only  # the private folder still fills
    assert tiered.remote.url == memory_url

    with pytest.raises(CuvilError):
        open_cache(CacheConfig(dir=tmp_path, url="nosuchproto://x"))


# --- a real S3 API: moto's server on the loopback -----------------------------------------

BUCKET = "cuvil-cache-test"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("s3fs", reason="s3fs is not installed")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server, monkeypatch, tmp_path):
    """An empty s3:// prefix on the moto server, reached through the documented environment."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server,
                        "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
                        # no profile, config or instance metadata from this machine
                        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "HTTP_PROXY", "HTTPS_PROXY",
                 "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    import boto3
    client = boto3.client("s3")
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    return f"s3://{BUCKET}/{uuid.uuid4().hex}/cache"


def test_s3_fleet_shares_one_prefix(s3_url, tmp_path):
    ci = open_cache(CacheConfig(dir=tmp_path / "ci", url=s3_url))
    laptop = open_cache(CacheConfig(dir=tmp_path / "laptop", url=s3_url))
    assert not laptop.contains(KEY)
    ci.put(KEY, b"compiled kernel")
    assert laptop.contains(KEY)
    assert laptop.get(KEY) == b"compiled kernel"
    assert laptop.local.get(KEY) == b"compiled kernel"  # copied to the laptop's own folder
    laptop.put(OTHER, b"from the laptop")
    assert ci.get(OTHER) == b"from the laptop"

    import boto3
    listed = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix=s3_url.split("/", 3)[3])
    names = sorted(obj["Key"].split("/", 1)[1] for obj in listed["Contents"])
    assert names == sorted(["cache/" + KEY[:2] + "/" + KEY, "cache/" + OTHER[:2] + "/" + OTHER])


def test_s3_read_only_consumers_do_not_write(s3_url, tmp_path):
    producer = open_cache(CacheConfig(dir=tmp_path / "ci", url=s3_url))
    consumer = open_cache(CacheConfig(dir=tmp_path / "dev", url=s3_url, read_only=True))
    producer.put(KEY, b"built in CI")
    assert consumer.get(KEY) == b"built in CI"
    consumer.put(OTHER, b"built on a laptop")
    assert consumer.local.contains(OTHER)
    assert not producer.remote.contains(OTHER) and producer.get(OTHER) is None


def test_s3_corrupt_object_is_rebuilt(s3_url, tmp_path):
    producer = open_cache(CacheConfig(dir=tmp_path / "ci", url=s3_url))
    producer.put(KEY, b"good")
    remote = producer.remote
    remote.fs.pipe_file(f"{remote._base}/{KEY[:2]}/{KEY}", b"truncated")
    fresh = open_cache(CacheConfig(dir=tmp_path / "fresh", url=s3_url))
    assert fresh.get(KEY) is None and not fresh.remote.contains(KEY)
    fresh.put(KEY, b"good")
    assert open_cache(CacheConfig(dir=tmp_path / "third", url=s3_url)).get(KEY) == b"good"


def test_s3_unreachable_endpoint_is_a_miss(s3_url, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    cache = open_cache(CacheConfig(dir=tmp_path / "local", url=s3_url))
    with caplog.at_level(logging.WARNING, logger="cuvil.cache"):
        assert cache.get(KEY) is None
        cache.put(KEY, b"still cached locally")
    assert cache.get(KEY) == b"still cached locally"
    assert "could not" in caplog.text


def test_step_key_refuses_values_without_canonical_json():
    """Key order does not matter; a value JSON cannot write canonically (a Path, a set, an object whose
    str() holds an address) is an error, never a string standing in for it."""
    assert step_key({"a": [1, 2], "b": {"c": None}}) == step_key({"b": {"c": None}, "a": [1, 2]})
    for value in (Path("model.onnx"), {1, 2}, object()):
        with pytest.raises(TypeError, match="no canonical JSON form"):
            step_key({"kind": "test", "params": {"value": value}})


def test_a_0_d_constant_comes_back_from_a_serialised_graph_0_d():
    # np.ascontiguousarray makes a 0-d array 1-d: a Clip's scalar bounds came back from the step
    # cache with shape (1,), and a later pass (fold_qdq) failed on them with a TypeError
    import numpy as np
    from cuvil import ir_io
    from cuvil.frontends.onnx import import_onnx
    from onnx import helper
    from tests.helpers import make_model
    model = make_model([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], [("x", np.float32, [2, 3])],
                       [("y", np.float32, None)], {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)})
    graph, _ = import_onnx(model)
    back = ir_io.loads(ir_io.dumps(graph))
    for name in ("lo", "hi"):
        assert np.asarray(back.values[name].data).shape == () == back.values[name].shape
        assert np.asarray(back.values[name].data) == np.asarray(graph.values[name].data)
