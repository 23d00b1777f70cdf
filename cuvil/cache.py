"""Content-addressed store for build steps' outputs.

An entry lives at `<root>/<key[:2]>/<key>`; its first 32 bytes are the sha256
of the rest, checked on every read. A corrupt entry is logged, removed and
treated as a miss. Writes go to a temporary file in the same folder and are
renamed into place, so a reader never sees half an entry and two builds
writing the same key at once both succeed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("cuvil.cache")


def default_cache_dir() -> Path:
    env = os.environ.get("CUVIL_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cuvil"


def step_key(payload) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of what a step depends on."""
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class Cache:
    def __init__(self, root: Path | None, read_only: bool = False):
        self.root = Path(root) if root is not None else None
        self.read_only = read_only
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

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
        digest, data = blob[:32], blob[32:]
        if len(blob) < 32 or hashlib.sha256(data).digest() != digest:
            log.warning("cache entry %s is corrupt: removed, will be rebuilt", path)
            try:
                path.unlink()
            except OSError:
                pass
            self.misses += 1
            return None
        self.hits += 1
        return data

    def contains(self, key: str) -> bool:
        return self.root is not None and self._path(key).is_file()

    def put(self, key: str, data: bytes) -> None:
        if self.root is None or self.read_only:
            return
        folder = self._path(key).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(hashlib.sha256(data).digest())
                f.write(data)
            os.replace(tmp, self._path(key))
        except OSError as exc:
            # A cache that cannot be written slows builds down; it must not fail them.
            log.warning("could not write cache entry %s: %s", key, exc)
