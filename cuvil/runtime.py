"""Load a library built by cuvil with ctypes and run it from numpy.

Needs numpy and the standard library only: no numba, no onnx, no compiler.
"""
from __future__ import annotations

import ctypes
import json
import re
import threading
from pathlib import Path

import numpy as np

from .errors import CuvilError, RuntimeFailure

SUPPORTED_ABI = 1


def _find_prefix(path: Path) -> str:
    """The symbol prefix of a library: the name before `abi_version` in its dynamic symbols."""
    data = path.read_bytes()
    candidates = sorted(set(re.findall(rb"\x00([A-Za-z_][A-Za-z0-9_]*?)abi_version\x00", data)))
    if not candidates:
        raise CuvilError(f"{path}: not a library built by cuvil (no *abi_version symbol)")
    return candidates[0].decode()


class Session:
    """One session of a loaded library: owns its working memory; use one per thread."""

    def __init__(self, library: "Library"):
        self.library = library
        self._handle = library._create()
        if not self._handle:
            raise RuntimeFailure(f"{library.path}: session_create failed (out of memory?)")
        self._lock = threading.Lock()

    def run(self, feeds: dict) -> dict:
        lib = self.library
        arrays = lib._check_feeds(feeds)
        results = {}
        out_ptrs = (ctypes.c_void_p * len(lib.output_names))()
        for i, spec in enumerate(lib.info["outputs"]):
            name = spec["name"]
            if name in results:
                arr = np.empty_like(results[name])
            else:
                arr = np.empty(spec["shape"], dtype=np.dtype(spec["dtype"]))
                results[name] = arr
            out_ptrs[i] = arr.ctypes.data
        in_ptrs = (ctypes.c_void_p * max(1, len(arrays)))(*[a.ctypes.data for a in arrays])
        with self._lock:
            code = lib._run(self._handle, in_ptrs, out_ptrs)
            if code != 0:
                message = lib._error(self._handle).decode("utf-8", "replace")
                raise RuntimeFailure(f"{lib.path.name}: run failed with code {code}: {message}")
        return {name: results[name] for name in lib.output_names}

    def close(self):
        if getattr(self, "_handle", None):
            self.library._destroy(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Library:
    """A built model library opened with ctypes."""

    def __init__(self, path, prefix: str | None = None):
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise CuvilError(f"library not found: {self.path}")
        try:
            self._lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise CuvilError(f"{self.path}: cannot be loaded: {exc}") from None
        self.prefix = prefix if prefix is not None else _find_prefix(self.path)
        p = self.prefix
        try:
            self._abi = getattr(self._lib, f"{p}abi_version")
            info = getattr(self._lib, f"{p}model_info")
            self._create = getattr(self._lib, f"{p}session_create")
            self._run = getattr(self._lib, f"{p}session_run")
            self._error = getattr(self._lib, f"{p}session_error")
            self._destroy = getattr(self._lib, f"{p}session_destroy")
        except AttributeError as exc:
            raise CuvilError(f"{self.path}: missing cuvil ABI symbol ({exc})") from None
        self._abi.restype = ctypes.c_int
        info.restype = ctypes.c_char_p
        self._create.restype = ctypes.c_void_p
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._error.restype = ctypes.c_char_p
        self._error.argtypes = [ctypes.c_void_p]
        self._destroy.restype = None
        self._destroy.argtypes = [ctypes.c_void_p]
        abi = self._abi()
        if abi != SUPPORTED_ABI:
            raise CuvilError(f"{self.path}: ABI version {abi}, this cuvil reads version {SUPPORTED_ABI}",
                             hint="rebuild the library with this version of cuvil")
        self.info = json.loads(info().decode("utf-8"))
        self.input_names = [v["name"] for v in self.info["inputs"]]
        self.output_names = list(dict.fromkeys(v["name"] for v in self.info["outputs"]))
        self._session = None

    def session(self) -> Session:
        """A new session: sessions run concurrently, one run at a time each."""
        return Session(self)

    def run(self, feeds: dict) -> dict:
        """Run the model on numpy arrays by input name; return outputs by name, in graph order."""
        if self._session is None:
            self._session = Session(self)
        return self._session.run(feeds)

    def _check_feeds(self, feeds: dict) -> list[np.ndarray]:
        if not isinstance(feeds, dict):
            raise CuvilError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        unknown = sorted(set(feeds) - set(self.input_names))
        missing = [n for n in self.input_names if n not in feeds]
        if unknown or missing:
            raise CuvilError(f"{self.path.name}: " + "; ".join(
                ([f"unknown input(s) {unknown}"] if unknown else []) + ([f"missing input(s) {missing}"] if missing else [])),
                hint=f"inputs are {self.input_names}")
        arrays = []
        for spec in self.info["inputs"]:
            name, dtype, shape = spec["name"], np.dtype(spec["dtype"]), tuple(spec["shape"])
            arr = feeds[name]
            if not isinstance(arr, np.ndarray):
                arr = np.asarray(arr)
                if arr.dtype != dtype and np.can_cast(arr.dtype, dtype, "same_kind"):
                    arr = arr.astype(dtype)
            if arr.dtype != dtype:
                raise CuvilError(f"input '{name}': dtype {arr.dtype}, the model takes {dtype}",
                                 hint=f"convert it with .astype(np.{dtype.name})")
            if tuple(arr.shape) != shape:
                raise CuvilError(f"input '{name}': shape {list(arr.shape)}, the model was built for {list(shape)}",
                                 hint="rebuild with other input shapes to change them")
            if not arr.flags.c_contiguous or not arr.flags.aligned:
                arr = np.ascontiguousarray(arr)
            arrays.append(arr)
        return arrays

    def close(self):
        if self._session is not None:
            self._session.close()
            self._session = None


def load(path, prefix: str | None = None) -> Library:
    return Library(path, prefix)
