"""Content-addressed store for build steps' outputs.

An entry lives at `<root>/<key[:2]>/<key>`; its first 32 bytes are the sha256
of the rest, checked on every read. A corrupt entry is logged, removed and
treated as a miss. Writes go to a temporary file in the same folder and are
renamed into place, so a reader never sees half an entry and two builds
writing the same key at once both succeed.

A cache only ever makes a build faster: a folder that cannot be written (read
only, disk full), an unreachable shared cache or a damaged entry is logged and
the step runs as if nothing were cached; none of them fails a build.

Three shapes, chosen by `open_cache(cache_config)`:

- `Cache`: a local folder. `stats()` and `prune(max_bytes)` keep it in bounds;
  a hit refreshes an entry's mtime, so pruning drops the least recently used.
- `RemoteCache`: the same entries on any fsspec URL (`s3://bucket/prefix`),
  shared by a fleet of machines.
- `TieredCache`: the local folder in front of a remote one; a remote hit is
  copied into the local folder so the next read stays on the machine.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from .errors import CuvilError

log = logging.getLogger("cuvil.cache")

_DIGEST_SIZE = 32
_TEMP_PREFIX = ".tmp-"
# A temporary file this old belongs to a writer that died; prune removes it.
_STALE_TEMP_SECONDS = 3600
# Keys become file and object names: keep them to one path component.
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def default_cache_dir() -> Path:
    env = os.environ.get("CUVIL_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cuvil"


def step_key(payload) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of what a step depends on.

    Only JSON values have a canonical form: anything else (a Path, a set, an object whose
    str() holds an address or depends on the process) is a TypeError, never a string that
    could make two different steps share a key or one step miss its own."""
    def refuse(value):
        raise TypeError(f"a step parameter of type {type(value).__name__} ({value!r:.60}) has no canonical JSON "
                        f"form: convert it to str, int, float, bool, None, a list or a dict first")
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=refuse)
    return hashlib.sha256(blob.encode()).hexdigest()


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}


def parse_size(text: str | int) -> int:
    """"500M" -> 524288000. Units K, M, G, T are powers of 1024; "B"/"iB" after them is allowed."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE.fullmatch(str(text))
    if match is None:
        raise CuvilError(f"invalid size {text!r}", hint="write a number with an optional unit: 800K, 500M, 2G")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def _seal(data: bytes) -> bytes:
    return hashlib.sha256(data).digest() + data


def _unseal(blob: bytes) -> bytes | None:
    """The data of an entry, or None when it is truncated or altered."""
    if len(blob) < _DIGEST_SIZE:
        return None
    digest, data = blob[:_DIGEST_SIZE], blob[_DIGEST_SIZE:]
    return data if hashlib.sha256(data).digest() == digest else None


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"invalid cache key {key!r}: letters, digits, '_', '-' and '.' only")
    return key


class Cache:
    """A local folder of entries; `root=None` is a cache that holds nothing."""

    def __init__(self, root: Path | None, read_only: bool = False):
        self.root = Path(root) if root is not None else None
        self.read_only = read_only
        self.hits = 0
        self.misses = 0
        self._warned_unwritable = False

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / _check_key(key)

    def get(self, key: str) -> bytes | None:
        if self.root is None:
            return None
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as exc:
            log.warning("cache entry %s unreadable (%s): treated as a miss", path, exc)
            self.misses += 1
            return None
        data = _unseal(blob)
        if data is None:
            self._discard_corrupt(path)
            self.misses += 1
            return None
        self._touch(path)
        self.hits += 1
        return data

    def contains(self, key: str) -> bool:
        return self.root is not None and self._path(key).is_file()

    def put(self, key: str, data: bytes) -> None:
        if self.root is None or self.read_only:
            return
        path = self._path(key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=path.parent)
            with os.fdopen(fd, "wb") as f:  # _seal's layout, without a copy of a large entry
                f.write(hashlib.sha256(data).digest())
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            # A cache that cannot be written slows builds down; it must not fail them.
            if tmp is not None:
                _remove_quietly(Path(tmp))
            self._warn_unwritable(key, exc)

    # -- upkeep ----------------------------------------------------------------------
    def stats(self) -> dict:
        """{"entries": n, "bytes": total} of the complete entries (temporary files are not counted)."""
        entries = self._entries()
        return {"entries": len(entries), "bytes": sum(size for _, size, _ in entries)}

    def prune(self, max_bytes: int | str) -> dict:
        """Remove least recently used entries until they total at most `max_bytes`.

        Returns {"removed": n, "removed_bytes": b, "entries": left, "bytes": left_bytes}.
        Temporary files left behind by writers that died are removed too (not counted).
        """
        max_bytes = parse_size(max_bytes)
        if self.read_only:
            raise CuvilError(f"cannot prune the cache at {self.root}: it is configured read-only",
                             hint="set `cache: read_only: false` in cuvil.yaml to prune it")
        self._remove_stale_temps()
        entries = sorted(self._entries())  # oldest mtime first
        total = sum(size for _, size, _ in entries)
        removed = removed_bytes = 0
        for _, size, path in entries:
            if total <= max_bytes:
                break
            try:
                path.unlink()
            except FileNotFoundError:  # another process pruned it first
                pass
            except OSError as exc:
                log.warning("could not remove cache entry %s: %s", path, exc)
                continue
            total -= size
            removed += 1
            removed_bytes += size
        return {"removed": removed, "removed_bytes": removed_bytes,
                "entries": len(entries) - removed, "bytes": total}

    # -- helpers ---------------------------------------------------------------------
    def _entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every complete entry."""
        if self.root is None or not self.root.is_dir():
            return []
        found = []
        for shard in self.root.iterdir():
            if not shard.is_dir():
                continue
            for path in shard.iterdir():
                if path.name.startswith(_TEMP_PREFIX):
                    continue
                try:
                    info = path.stat()
                except OSError:  # removed meanwhile
                    continue
                found.append((info.st_mtime, info.st_size, path))
        return found

    def _remove_stale_temps(self) -> None:
        if self.root is None or not self.root.is_dir():
            return
        cutoff = time.time() - _STALE_TEMP_SECONDS
        for path in self.root.glob(f"*/{_TEMP_PREFIX}*"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
            except OSError:
                pass

    def _touch(self, path: Path) -> None:
        # mtime, not atime: atime is often not kept (noatime, relatime mounts).
        if self.read_only:
            return
        try:
            os.utime(path)
        except OSError:
            pass

    def _discard_corrupt(self, path: Path) -> None:
        if self.read_only:
            log.warning("cache entry %s is corrupt: treated as a miss (read-only cache, left in place)", path)
            return
        log.warning("cache entry %s is corrupt: removed, will be rebuilt", path)
        _remove_quietly(path)

    def _warn_unwritable(self, key: str, exc: OSError) -> None:
        # Once per cache at warning level: a full disk would otherwise repeat it for every step.
        level = logging.DEBUG if self._warned_unwritable else logging.WARNING
        self._warned_unwritable = True
        log.log(level, "could not write cache entry %s in %s: %s (the build goes on without caching it)",
                key, self.root, exc)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class RemoteCache:
    """The same entries as `Cache`, at `<url>/<key[:2]>/<key>` on any fsspec filesystem.

    `url` is an fsspec URL: `s3://bucket/prefix` (needs s3fs: `pip install 'cuvil[s3]'`),
    `file:///shared/folder`, `memory://name` (tests). Every error of the remote
    (unreachable, denied, throttled) is logged and read as a miss, and after
    `max_failures` errors in a row the remote is left alone for the rest of the
    process, so a dead endpoint costs a few timeouts rather than one per step.

    Credentials and endpoint come from the environment, read by botocore as for
    any AWS tool, so nothing secret goes into cuvil.yaml:
    `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (or a profile / instance role),
    `AWS_DEFAULT_REGION`, and `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) for
    an S3-compatible server other than AWS (MinIO, Ceph, R2, moto). Code may
    instead pass fsspec `storage_options`, e.g.
    `RemoteCache(url, client_kwargs={"endpoint_url": ...})`.

    Each RemoteCache gets its own filesystem object (fsspec's instance cache is
    skipped), so its listings cache can never hide another machine's writes.
    """

    max_failures = 3

    def __init__(self, url: str, read_only: bool = False, **storage_options):
        self.url = url
        self.read_only = read_only
        self.hits = 0
        self.misses = 0
        self.fs, path = _filesystem(url, storage_options)
        self._base = path.rstrip("/")
        # On a plain folder a write is not atomic, so it goes through a temporary name.
        self._is_local = "file" in _protocols(self.fs)
        self._failures = 0
        self._disabled = False
        self._lock = threading.Lock()

    def __repr__(self):
        return f"RemoteCache({self.url!r}, read_only={self.read_only})"

    def _path(self, key: str) -> str:
        return f"{self._base}/{key[:2]}/{_check_key(key)}"

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        blob = self._call("read", key, self.fs.cat_file, path)
        data = _unseal(blob) if blob is not None else None
        if blob is not None and data is None:
            if self.read_only:
                log.warning("remote cache entry %s/%s is corrupt: treated as a miss", self.url, key)
            else:
                log.warning("remote cache entry %s/%s is corrupt: removed, will be rebuilt", self.url, key)
                self._call("remove", key, self.fs.rm_file, path)
        if data is None:
            self.misses += 1
            return None
        self.hits += 1
        return data

    def contains(self, key: str) -> bool:
        return bool(self._call("look up", key, self.fs.exists, self._path(key)))

    def put(self, key: str, data: bytes) -> None:
        if self.read_only:
            return
        path = self._path(key)
        if self._is_local:
            self._call("write", key, self._put_local, path, _seal(data))
        else:
            self._call("write", key, self.fs.pipe_file, path, _seal(data))

    def _put_local(self, path: str, blob: bytes) -> None:
        folder = path.rsplit("/", 1)[0]
        self.fs.makedirs(folder, exist_ok=True)
        tmp = f"{folder}/{_TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}"
        try:
            self.fs.pipe_file(tmp, blob)
            self.fs.mv(tmp, path)
        finally:
            if self.fs.exists(tmp):
                self.fs.rm_file(tmp)

    def _call(self, action: str, key: str, function, *args):
        """function(*args), or None when the remote fails; a missing entry is a quiet None."""
        if self._disabled:
            return None
        try:
            result = function(*args)
        except FileNotFoundError:
            self._succeeded()
            return None
        except Exception as exc:  # botocore, aiohttp, OSError...: the remote is flaky, the build is not
            self._failed(action, key, exc)
            return None
        self._succeeded()
        return result

    def _succeeded(self) -> None:
        self._failures = 0

    def _failed(self, action, key, exc) -> None:
        with self._lock:
            self._failures += 1
            log.warning("remote cache %s: could not %s %s (%s: %s); treated as a miss",
                        self.url, action, key, type(exc).__name__, exc)
            if self._failures >= self.max_failures and not self._disabled:
                self._disabled = True
                log.warning("remote cache %s failed %d times in a row: not used for the rest of this build",
                            self.url, self._failures)


def _protocols(fs) -> tuple:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _filesystem(url: str, storage_options: dict):
    """(fsspec filesystem, path) for `url`; a missing package is a CuvilError naming it."""
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise CuvilError(f"the cache url {url!r} needs the fsspec package",
                         hint="pip install 'cuvil[s3]' (or pip install fsspec)") from None
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        return fsspec.core.url_to_fs(url, skip_instance_cache=True, **storage_options)
    except ImportError as exc:
        module = known_implementations.get(protocol, {}).get("class", "").split(".")[0] or str(exc)
        hint = "pip install 'cuvil[s3]'" if protocol in ("s3", "s3a") else f"pip install {module}"
        raise CuvilError(f"the cache url {url!r} needs the {module} package, which is not installed",
                         hint=hint) from None
    except ValueError as exc:
        known = ", ".join(sorted(known_implementations))
        raise CuvilError(f"the cache url {url!r} cannot be opened: {exc}",
                         hint=f"use an fsspec URL such as s3://bucket/prefix (protocols: {known})") from None


class TieredCache:
    """A local `Cache` in front of an optional shared `RemoteCache`.

    get: local, then remote (a remote hit is written to the local folder).
    put: both; the remote is skipped when it is read-only.
    `root`, `stats` and `prune` are the local folder's.
    """

    def __init__(self, local: Cache, remote: RemoteCache | None = None):
        self.local = local
        self.remote = remote
        self.hits = 0
        self.misses = 0
        self.remote_hits = 0

    @property
    def root(self) -> Path | None:
        return self.local.root

    @property
    def read_only(self) -> bool:
        return self.local.read_only and (self.remote is None or self.remote.read_only)

    def get(self, key: str) -> bytes | None:
        data = self.local.get(key)
        if data is None and self.remote is not None:
            data = self.remote.get(key)
            if data is not None:
                self.remote_hits += 1
                self.local.put(key, data)
        if data is None:
            self.misses += 1
        else:
            self.hits += 1
        return data

    def contains(self, key: str) -> bool:
        return self.local.contains(key) or (self.remote is not None and self.remote.contains(key))

    def put(self, key: str, data: bytes) -> None:
        self.local.put(key, data)
        if self.remote is not None and not self.remote.read_only:
            self.remote.put(key, data)

    def stats(self) -> dict:
        return self.local.stats()

    def prune(self, max_bytes: int | str) -> dict:
        return self.local.prune(max_bytes)


def open_cache(config) -> Cache | TieredCache:
    """The cache a `CacheConfig` describes: its `dir`, and in front of its `url` when one is set.

    `read_only` applies to the shared cache when there is a `url` (the local
    folder, private to this machine, is still filled so the next build is fast)
    and to the local folder otherwise.
    """
    if not config.url:
        return Cache(config.dir, read_only=config.read_only)
    remote = RemoteCache(config.url, read_only=config.read_only)
    return TieredCache(Cache(config.dir), remote)
