"""Load a library built by cuvil with ctypes and run it from numpy.

Needs numpy and the standard library only: no numba, no onnx, no compiler.
"""
from __future__ import annotations

import ctypes
import math
import json
import re
import threading
from pathlib import Path

import numpy as np

from .errors import CuvilError, RuntimeFailure

SUPPORTED_ABI = 1

# e_machine of the ELF header (the System V ABI's list) -> the ISA names of backends/targets.py.
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
HOST_ARCH = "x86_64"


def elf_arch(path) -> str | None:
    """The ISA of an ELF file ("x86_64", "aarch64"), or None when it is not a 64-bit little-endian ELF
    of a known machine (a library of a cross target is not loadable here: cuvil/cross.py)."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    return ELF_MACHINES.get(int.from_bytes(head[18:20], "little"))


HOST_PLATFORM = "x86_64-linux"


def library_platform(path) -> str | None:
    """Where a library runs, as "<ISA>-<system>": "x86_64-linux", "aarch64-linux" (ELF),
    "x86_64-windows" (a PE DLL of machine AMD64) or "wasm32" (a WebAssembly module, any engine);
    None for anything else."""
    arch = elf_arch(path)
    if arch:
        return f"{arch}-linux"
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:8] == b"\0asm\x01\0\0\0":
        return "wasm32"
    if head[:2] == b"MZ" and len(head) >= 64:
        pe = int.from_bytes(head[60:64], "little")
        if head[pe:pe + 4] == b"PE\0\0" and int.from_bytes(head[pe + 4:pe + 6], "little") == 0x8664:
            return "x86_64-windows"
    return None


def find_prefix(path: Path) -> str:
    """The symbol prefix of a library: the name before `abi_version` in its dynamic symbols."""
    data = path.read_bytes()
    candidates = sorted(set(re.findall(rb"\x00([A-Za-z_][A-Za-z0-9_]*?)abi_version\x00", data)))
    if not candidates:
        raise CuvilError(f"{path}: not a library built by cuvil (no *abi_version symbol)")
    return candidates[0].decode()


# Tensors up to this many bytes go through buffers the session owns, copied in
# and out, so their addresses are found once per session. Larger ones are passed
# by address: finding a numpy array's address from Python costs ~0.25 us, about
# what copying 16 KiB does.
STAGED_BYTES = 16 * 1024


def tensor_dtype(spec: dict) -> np.dtype:
    """The numpy dtype of a model_info tensor: "string" tensors are object arrays of str."""
    return np.dtype(object) if spec["dtype"] == "string" else np.dtype(spec["dtype"])


def _string_table(arr: np.ndarray, name: str):
    """A string input as the C ABI takes it: an array of pointers to NUL-terminated UTF-8 strings, C
    order (docs/strings.md), as (the pointers, the bytes they point into: keep both alive). All the
    strings are encoded at once, back to back; elements that are not all str take the slow way."""
    flat = arr.reshape(-1)
    n = flat.size
    try:
        text = "\0".join(flat.tolist())
    except TypeError:
        text = None
    if text is not None and text.count("\0") == max(n - 1, 0):
        data = text.encode("utf-8", "surrogatepass") + b"\0"
        if len(data) == len(text) + 1:   # ASCII: a string's bytes are its characters
            lengths = np.fromiter(map(len, flat.tolist()), np.int64, n)
        else:
            lengths = np.fromiter(map(len, data.split(b"\0")[:n]), np.int64, n)
        offsets = np.zeros(n, np.int64)
        np.cumsum(lengths[:-1] + 1, out=offsets[1:])
        block = ctypes.create_string_buffer(data, len(data))
        pointers = (offsets + ctypes.addressof(block)).astype(np.uint64) if n else np.zeros(1, np.uint64)
        return pointers, block
    return _string_table_slow(flat, name)


def _string_table_slow(flat: np.ndarray, name: str):
    encoded = []
    for item in flat:
        data = item.encode("utf-8") if isinstance(item, str) else item if isinstance(item, bytes) else None
        if data is None:
            raise CuvilError(f"input '{name}': an element is a {type(item).__name__}, not a str",
                             hint="a string input takes a numpy array of str (dtype object or str)")
        if b"\0" in data:
            raise CuvilError(f"input '{name}': an element holds a NUL character, which a C string cannot",
                             hint="remove the NUL characters")
        encoded.append(data)
    table = (ctypes.c_char_p * max(1, len(encoded)))(*encoded)
    return table, None


def _strings_from(pointers: np.ndarray) -> np.ndarray:
    """A string output: the element pointers the run wrote, read as UTF-8 into an object array. The
    library writes an output's strings back to back in element order (docs/strings.md): one copy of
    that block, split at its NULs; pointers laid out otherwise are read one by one."""
    out = np.empty(pointers.shape, dtype=object)
    flat = out.reshape(-1)
    addresses = pointers.reshape(-1).astype(np.int64)
    n = addresses.size
    if n == 0:
        return out
    last = ctypes.string_at(int(addresses[-1]))
    end = int(addresses[-1]) + len(last) + 1
    steps = np.diff(addresses)
    if np.all(steps > 0) and end - int(addresses[0]) < 1 << 40:
        block = ctypes.string_at(int(addresses[0]), end - int(addresses[0]))
        nuls = np.flatnonzero(np.frombuffer(block, np.uint8) == 0)
        if len(nuls) == n and np.array_equal(nuls[:-1] + 1, addresses[1:] - addresses[0]):
            flat[:] = block.decode("utf-8", "replace").split("\0")[:-1]
            return out
    for k, address in enumerate(addresses):
        flat[k] = ctypes.string_at(int(address)).decode("utf-8", "replace")
    return out


def _address(arr: np.ndarray) -> int:
    """The data address of a C-contiguous array.

    ctypes' from_buffer is ~3x faster than `arr.ctypes.data`, but needs a
    writable, non-empty buffer; anything else takes the slow way.
    """
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(arr))
    except (TypeError, ValueError, BufferError):
        return arr.ctypes.data


class Session:
    """One session of a loaded library: owns its working memory; use one per thread.

    A run holds the session's lock, so a session shared between threads (as
    `Library.run` does) runs one call at a time. Each run returns new arrays.
    """

    def __init__(self, library: "Library"):
        self.library = library
        self._handle = library._create()
        if not self._handle:
            reason = library._error(None).decode("utf-8", "replace")
            raise RuntimeFailure(f"{library.path}: session_create failed: {reason}")
        self._lock = threading.Lock()
        self._structure = library.info.get("structure")  # sequence / optional inputs and outputs
        # session_run without argtypes: ctypes then converts the arguments ~2x faster
        # (~0.15 us a call), so every argument must already be a ctypes object or None.
        self._run_c = library._lib[f"{library.prefix}session_run"]
        self._run_c.restype = ctypes.c_int
        self._handle_arg = ctypes.c_void_p(self._handle)
        inputs, outputs = library.info["inputs"], library.info["outputs"]
        self._in_ptrs = (ctypes.c_void_p * max(1, len(inputs)))()
        self._out_ptrs = (ctypes.c_void_p * max(1, len(outputs)))()
        self._staged_inputs, self._addressed_inputs = [], []
        self._input_checks = []  # (name, dtype, shape, passed by address), for the fast check
        # string tensors are passed by address, as arrays of char pointers (docs/strings.md)
        self._string_inputs = {i for i, spec in enumerate(inputs) if spec["dtype"] == "string"}
        self._string_outputs = {i for i, spec in enumerate(outputs) if spec["dtype"] == "string"}
        for i, spec in enumerate(inputs):
            dtype, shape = tensor_dtype(spec), tuple(spec["shape"])
            staged = self._stage(self._in_ptrs, i, dtype, shape)
            if staged is None:
                self._addressed_inputs.append(i)
            else:
                self._staged_inputs.append((i, staged))
            self._input_checks.append((spec["name"], dtype, shape, staged is None))
        self._addressed_outputs = []
        self._results = []  # (name, output index, staged buffer or None): each name once, in graph order
        for i, spec in enumerate(outputs):
            dtype, shape = tensor_dtype(spec), tuple(spec["shape"])
            staged = self._stage(self._out_ptrs, i, dtype, shape)
            if staged is None:
                self._addressed_outputs.append((i, shape, dtype))
            if all(spec["name"] != name for name, _, _ in self._results):  # a name listed twice: the first
                self._results.append((spec["name"], i, staged))
        # outputs whose shape depends on the data: the run writes the tensor at the start of the
        # upper-bound buffer, and session_output_shape says its shape (docs/dynamic_shapes.md)
        self._dynamic = {i: len(spec["shape"]) for i, spec in enumerate(outputs) if spec.get("dynamic")}
        if self._dynamic:
            self._output_shape = library._lib[f"{library.prefix}session_output_shape"]
            self._output_shape.restype = ctypes.POINTER(ctypes.c_int64)
            self._output_shape.argtypes = [ctypes.c_void_p, ctypes.c_int]
        # Plain tensors (no sequences or optionals, strings, data-dependent shapes or batch buckets):
        # run calls _plain_run's closure, whose per-call work is the checks, the copies and the call.
        plain = self._structure is None and not (self._string_inputs or self._string_outputs or self._dynamic
                                                 or "batch" in library.info)
        self._plain = self._plain_run() if plain else None

    @staticmethod
    def _stage(ptrs, index, dtype, shape):
        """A buffer for a small tensor, its address stored in ptrs[index] once; None for a large one
        (or a string tensor)."""
        if math.prod(shape) * dtype.itemsize > STAGED_BYTES or dtype == object:
            return None
        buf = np.zeros(shape, dtype)
        ptrs[index] = _address(buf)
        return buf

    def _feeds_as_given(self, feeds) -> list | None:
        """The feeds in input order when they can be used as they are, else None:
        the full check in `Library._check_feeds` then converts them or names the problem."""
        return _as_given(self._input_checks, feeds)

    def run(self, feeds: dict) -> dict:
        """Run on numpy arrays by input name; return new output arrays by name, in graph order. A
        sequence input or output is a list of arrays, an optional one an array (or list) or None
        (docs/sequences.md)."""
        if self._plain is not None:
            outputs = self._plain(feeds)
            if outputs is not None:
                return outputs
        if self._structure is None:
            return self._run_tensors(feeds)
        flat = _flatten_feeds(self._structure, feeds, self.library.path.name)
        return _regroup_results(self._structure, self._run_tensors(flat))

    def _run_tensors(self, feeds: dict) -> dict:
        arrays = self._feeds_as_given(feeds)
        if arrays is None:
            if "batch" in self.library.info:
                arrays, rows = self.library._check_feeds(feeds, batched=True)
                if rows != self.library.info["batch"]["buckets"][-1]:
                    return self._run_rows(arrays, rows)
            else:
                arrays = self.library._check_feeds(feeds)
        in_ptrs, out_ptrs = self._in_ptrs, self._out_ptrs
        with self._lock:
            for i, staged in self._staged_inputs:
                staged[...] = arrays[i]
            tables = []   # string inputs' pointer arrays, alive until the run returns
            for i in self._addressed_inputs:
                if i in self._string_inputs:
                    table, block = _string_table(arrays[i], self._input_checks[i][0])
                    tables.append((table, block))
                    in_ptrs[i] = _address(table) if isinstance(table, np.ndarray) else ctypes.addressof(table)
                else:
                    in_ptrs[i] = _address(arrays[i])
            fresh = {}
            for i, shape, dtype in self._addressed_outputs:
                arr = fresh[i] = np.zeros(shape, np.uintp) if i in self._string_outputs else np.empty(shape, dtype)
                out_ptrs[i] = _address(arr)
            code = self._run_c(self._handle_arg, in_ptrs, out_ptrs)
            if code != 0:
                raise _run_failure(self.library, self._handle_arg, code)
            results = {}
            for name, i, staged in self._results:
                results[name] = fresh[i] if staged is None else staged.copy()
                if i in self._dynamic:
                    results[name] = self._actual(i, results[name])
                if i in self._string_outputs:   # read now: the next run frees the strings
                    results[name] = _strings_from(results[name])
            return results

    def _plain_run(self):
        """run's fast path for a library of plain tensors: a closure over what it reads (no method
        calls, no attribute lookups; it holds no reference to the session, whose __del__ closes it).
        It runs on feeds that _feeds_as_given takes as they are and returns the outputs; for any
        others it returns None, and run takes _run_tensors, which converts them or names the problem."""
        checks, lock, run_c, handle = self._input_checks, self._lock, self._run_c, self._handle_arg
        staged_copies = tuple((staged, i) for i, staged in self._staged_inputs)
        addressed_inputs, addressed_outputs = tuple(self._addressed_inputs), tuple(self._addressed_outputs)
        in_ptrs, out_ptrs, results, library, empty = self._in_ptrs, self._out_ptrs, tuple(self._results), \
            self.library, np.empty

        def run(feeds):
            arrays = _as_given(checks, feeds)
            if arrays is None:
                return None
            lock.acquire()
            try:
                for staged, i in staged_copies:
                    staged[...] = arrays[i]
                for i in addressed_inputs:
                    in_ptrs[i] = _address(arrays[i])
                fresh = {}
                for i, shape, dtype in addressed_outputs:
                    arr = fresh[i] = empty(shape, dtype)
                    out_ptrs[i] = _address(arr)
                code = run_c(handle, in_ptrs, out_ptrs)
                if code != 0:
                    raise _run_failure(library, handle, code)
                outputs = {}   # (a loop: a comprehension is a call of its own)
                for name, i, staged in results:
                    outputs[name] = fresh[i] if staged is None else staged.copy()
                return outputs
            finally:
                lock.release()
        return run

    def _actual(self, index: int, buffer: np.ndarray) -> np.ndarray:
        """A data-dependent output: the C-contiguous prefix of its upper-bound buffer, in the shape
        the run wrote."""
        dims = self._output_shape(self._handle, index)
        shape = tuple(int(dims[k]) for k in range(self._dynamic[index]))
        return buffer.reshape(-1)[:math.prod(shape)].reshape(shape).copy()

    def _run_rows(self, arrays, rows: int) -> dict:
        """A batch-bucket library's run on `rows` rows (session_run_batch: the smallest bucket that
        holds them, padded); new output arrays of `rows` rows."""
        lib = self.library
        if getattr(self, "_run_batch_c", None) is None:
            self._run_batch_c = lib._lib[f"{lib.prefix}session_run_batch"]
            self._run_batch_c.restype = ctypes.c_int
        in_ptrs = (ctypes.c_void_p * max(1, len(arrays)))(*[_address(a) for a in arrays])
        outputs = [np.empty((rows, *spec["shape"][1:]), tensor_dtype(spec)) for spec in lib.info["outputs"]]
        out_ptrs = (ctypes.c_void_p * max(1, len(outputs)))(*[_address(a) for a in outputs])
        with self._lock:
            code = self._run_batch_c(self._handle_arg, ctypes.c_int64(rows), in_ptrs, out_ptrs)
            if code != 0:
                message = lib._error(self._handle).decode("utf-8", "replace")
                raise RuntimeFailure(f"{lib.path.name}: run of batch {rows} failed with code {code}: {message}")
        results = {}
        for spec, arr in zip(lib.info["outputs"], outputs):
            results.setdefault(spec["name"], arr)
        return results

    # -- generation libraries (built with generate:): the session owns the KV cache ------------

    def _check(self, code: int, what: str):
        if code != 0:
            message = self.library._error(self._handle).decode("utf-8", "replace")
            raise RuntimeFailure(f"{self.library.path.name}: {what} failed with code {code}: {message}")

    def prefill(self, tokens) -> np.ndarray:
        """Append prompt tokens to the cache; returns the logits after the last one."""
        lib = self.library._generation()
        ids = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1))
        logits = np.empty(lib.vocab_size, np.float32)
        with self._lock:
            self._check(lib.prefill(self._handle, _address(ids) if ids.size else None, ids.size, _address(logits)),
                        "prefill")
        return logits

    def decode(self, token: int) -> np.ndarray:
        """Append one token; returns the logits after it."""
        lib = self.library._generation()
        logits = np.empty(lib.vocab_size, np.float32)
        with self._lock:
            self._check(lib.decode(self._handle, int(token), _address(logits)), "decode")
        return logits

    def reset(self):
        """Empty the KV cache."""
        self._check(self.library._generation().reset(self._handle), "reset")

    @property
    def position(self) -> int:
        """Tokens in the KV cache."""
        return int(self.library._generation().position(self._handle))

    def kv_cache(self) -> np.ndarray:
        """The session's KV cache as bytes (a view: it changes as the session runs, valid while it lives)."""
        size = ctypes.c_int64()
        address = self.library._generation().kv_cache(self._handle, ctypes.byref(size))
        return np.ctypeslib.as_array((ctypes.c_uint8 * size.value).from_address(address))

    def generate(self, prompt_ids, max_new_tokens: int = 32, sampling=None, seed: int = 0, stop_tokens=None,
                 reset: bool = True):
        """Yield up to `max_new_tokens` new token ids, one at a time (streaming), after the prompt.
        sampling: None (greedy) or {temperature, top_k, top_p} (generation.py's algorithm, in C),
        drawn from a generator seeded with `seed`. Stops after a token of `stop_tokens` (default:
        the model's EOS tokens, from genai_config.json). reset=False continues the cached text."""
        lib = self.library._generation()
        params = lib.sampling_params(sampling)
        stops = set(lib.eos_tokens if stop_tokens is None else stop_tokens)
        rng = ctypes.c_uint64(seed & 0xFFFFFFFFFFFFFFFF)
        if reset:
            self.reset()
        if max_new_tokens < 1:
            return
        logits = self.prefill(prompt_ids)
        for produced in range(max_new_tokens):
            token = lib.sample(_address(logits), params, ctypes.byref(rng))
            if token < 0:
                raise RuntimeFailure(f"{self.library.path.name}: sampling failed (out of memory)")
            yield int(token)
            if token in stops or produced + 1 == max_new_tokens:
                return
            logits = self.decode(token)

    def close(self):
        if getattr(self, "_handle", None):
            self._handle_arg.value = None  # a closed session runs with NULL: an error, not a use after free
            self.library._destroy(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Sampling(ctypes.Structure):
    """<prefix>sampling of a generation library's header."""
    _fields_ = [("temperature", ctypes.c_float), ("top_k", ctypes.c_int32), ("top_p", ctypes.c_float)]


class _Generation:
    """The generation functions of a library built with generate: (backends/native/generation.py)."""

    def __init__(self, lib, prefix: str, info: dict):
        def fn(name, restype, *argtypes):
            f = lib[f"{prefix}{name}"]
            f.restype, f.argtypes = restype, list(argtypes)
            return f
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.prefill = fn("session_prefill", ctypes.c_int, p, p, i64, p)
        self.decode = fn("session_decode", ctypes.c_int, p, i64, p)
        self.reset = fn("session_reset", ctypes.c_int, p)
        self.position = fn("session_position", i64, p)
        self.kv_cache = fn("session_kv_cache", p, p, ctypes.POINTER(i64))
        self.sample = fn("sample", i64, p, ctypes.POINTER(Sampling), ctypes.POINTER(ctypes.c_uint64))
        self.vocab_size = int(fn("vocab_size", i64)())
        self.max_context = int(fn("max_context", i64)())
        self.eos_tokens = tuple(info["generate"].get("eos_tokens", ()))

    @staticmethod
    def sampling_params(sampling):
        """None (greedy), or a dict / Sampling of temperature, top_k, top_p."""
        if sampling is None:
            return None
        if isinstance(sampling, Sampling):
            return ctypes.pointer(sampling)
        if not isinstance(sampling, dict) or set(sampling) - {"temperature", "top_k", "top_p"}:
            raise CuvilError(f"sampling={sampling!r}: expected None (greedy) or a dict of temperature, top_k, top_p")
        return ctypes.pointer(Sampling(float(sampling.get("temperature", 1.0)), int(sampling.get("top_k", 0)),
                                       float(sampling.get("top_p", 1.0))))


def _as_given(checks: list, feeds) -> list | None:
    """Session._feeds_as_given over the session's (name, dtype, shape, passed by address) checks."""
    if type(feeds) is not dict or len(feeds) != len(checks):
        return None
    arrays = []
    for name, dtype, shape, addressed in checks:
        arr = feeds.get(name)
        if type(arr) is not np.ndarray or arr.dtype is not dtype or arr.shape != shape:
            return None
        if addressed:
            flags = arr.flags
            if not (flags.c_contiguous and flags.aligned):
                return None
        arrays.append(arr)
    return arrays


def _run_failure(library: "Library", handle: ctypes.c_void_p, code: int) -> RuntimeFailure:
    """The error of a session_run that returned `code`, with the session's last error message."""
    message = library._error(handle).decode("utf-8", "replace")
    return RuntimeFailure(f"{library.path.name}: run failed with code {code}: {message}")


def _flatten_feeds(structure: dict, feeds, library: str) -> dict:
    """Feeds with each sequence / optional input replaced by the tensors it crosses the ABI as."""
    if not isinstance(feeds, dict):
        raise CuvilError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
    entries = structure.get("inputs", [])
    flat = {k: v for k, v in feeds.items() if k not in {e["name"] for e in entries}}
    for entry in entries:
        name, tensors = entry["name"], entry["tensors"]
        value = feeds.get(name)
        if entry.get("present") is False:
            if value is not None:
                raise CuvilError(f"{library}: input '{name}' is an optional built empty, but a value was given",
                                 hint="pass None (or rebuild with the optional present)")
            continue
        if name not in feeds or value is None:
            if all(t in feeds for t in tensors):
                continue  # given tensor by tensor, under their ABI names
            raise CuvilError(f"{library}: missing input '{name}'",
                             hint=f"the library takes it as {len(tensors)} tensor(s) {tensors}")
        if entry["kind"] == "optional":
            flat[tensors[0]] = value
            continue
        if not isinstance(value, (list, tuple)) or len(value) != len(tensors):
            got = f"{len(value)} tensors" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
            raise CuvilError(f"{library}: input '{name}' is a sequence of {len(tensors)} tensors, got {got}",
                             hint="a sequence's length and element shapes are fixed at build time; rebuild with "
                                  "input_shapes {'" + name + "[0]': [...], ...} for another length")
        flat.update(zip(tensors, value))
    return flat


def _regroup_results(structure: dict, results: dict) -> dict:
    """Results with each sequence / optional output's tensors gathered back under its name, at the
    place of its first tensor (an empty optional output, which has none, comes last)."""
    groups = {e["tensors"][0]: e for e in structure.get("outputs", []) if e["tensors"]}
    members = {t for e in structure.get("outputs", []) for t in e["tensors"]}
    regrouped = {}
    for name, value in results.items():
        if name in groups:
            entry = groups[name]
            items = [results[t] for t in entry["tensors"]]
            regrouped[entry["name"]] = items[0] if entry["kind"] == "optional" else items
        elif name not in members:
            regrouped[name] = value
    for entry in structure.get("outputs", []):
        if not entry["tensors"]:
            regrouped[entry["name"]] = [] if entry["kind"] == "sequence" else None
    return regrouped


class Library:
    """A built model library opened with ctypes."""

    def __init__(self, path, prefix: str | None = None):
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise CuvilError(f"library not found: {self.path}")
        if self.path.suffix == ".a":
            raise CuvilError(f"{self.path}: a static archive cannot be loaded, only linked into a program",
                             hint="load the shared library (build with `link: shared` or `both`); the "
                                  "archive's description is in manifest.json beside it")
        platform = library_platform(self.path)
        if platform is not None and platform != HOST_PLATFORM:
            raise CuvilError(f"{self.path}: a library for {platform} (a cross target), which this {HOST_PLATFORM} "
                             f"machine cannot load",
                             hint=(f"run it on an {platform} machine, or here under qemu-user or Wine "
                                   if platform != "wasm32" else "run it with a WebAssembly engine, here wasmtime ")
                                  + "(cuvil.cross.run_emulated; the README's \"Cross targets\"); `cuvil inspect` "
                                    "describes it")
        try:
            self._lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise CuvilError(f"{self.path}: cannot be loaded: {exc}") from None
        self.prefix = prefix if prefix is not None else find_prefix(self.path)
        p = self.prefix
        try:
            self._abi = getattr(self._lib, f"{p}abi_version")
            info = getattr(self._lib, f"{p}model_info")
            self._create = getattr(self._lib, f"{p}session_create")
            getattr(self._lib, f"{p}session_run")  # sessions call it through their own function object
            self._error = getattr(self._lib, f"{p}session_error")
            self._destroy = getattr(self._lib, f"{p}session_destroy")
        except AttributeError as exc:
            raise CuvilError(f"{self.path}: missing cuvil ABI symbol ({exc})") from None
        self._abi.restype = ctypes.c_int
        info.restype = ctypes.c_char_p
        self._create.restype = ctypes.c_void_p
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

    # -- generation libraries: on the library's own session (lib.session() makes others) ---------

    def _generation(self) -> _Generation:
        if "generate" not in self.info:
            raise CuvilError(f"{self.path.name} is not a generation library",
                             hint="build the decoder with a generate: block (cuvil.yaml) or generate={...} (compile)")
        if getattr(self, "_gen", None) is None:
            self._gen = _Generation(self._lib, self.prefix, self.info)
        return self._gen

    def _default(self) -> Session:
        if self._session is None:
            self._session = Session(self)
        return self._session

    def generate(self, prompt_ids, max_new_tokens: int = 32, sampling=None, seed: int = 0, stop_tokens=None,
                 reset: bool = True):
        """Token ids generated after `prompt_ids`, as an iterator (Session.generate)."""
        self._generation()
        return self._default().generate(prompt_ids, max_new_tokens, sampling, seed, stop_tokens, reset)

    def prefill(self, tokens) -> np.ndarray:
        return self._default().prefill(tokens)

    def decode(self, token: int) -> np.ndarray:
        return self._default().decode(token)

    def reset(self):
        self._default().reset()

    @property
    def position(self) -> int:
        return self._default().position

    @property
    def tokenizer(self):
        """The `tokenizers.Tokenizer` of the tokenizer.json installed beside the library."""
        if getattr(self, "_tokenizer", None) is None:
            path = self.path.parent / "tokenizer.json"
            if not path.is_file():
                raise CuvilError(f"{self.path.name}: no tokenizer.json beside the library",
                                 hint="name one in the generate block (generate: {tokenizer: path/to/tokenizer.json})")
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise CuvilError("text in/out needs the `tokenizers` package", hint="pip install 'cuvil[llm]'") from None
            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def generate_text(self, prompt: str, max_new_tokens: int = 32, sampling=None, seed: int = 0,
                      stream: bool = False):
        """The text generated after `prompt` (tokenized with the library's tokenizer.json); with
        stream=True an iterator of the text of each new token."""
        tokenizer = self.tokenizer
        ids = tokenizer.encode(prompt).ids
        tokens = self.generate(ids, max_new_tokens, sampling, seed)
        if stream:
            return (tokenizer.decode([t]) for t in tokens)
        return tokenizer.decode(list(tokens))

    def run(self, feeds: dict) -> dict:
        """Run the model on numpy arrays by input name; return outputs by name, in graph order."""
        if self._session is None:
            self._session = Session(self)
        return self._session.run(feeds)

    def run_tensors(self, feeds: dict) -> dict:
        """Run on the tensors of the C ABI by their own names (a sequence input's `x[0]`, `x[1]`...)
        and return the output tensors the same way: `run` without grouping sequences and optionals."""
        return self._default()._run_tensors(feeds)

    def _check_feeds(self, feeds: dict, batched: bool = False):
        """The feeds as contiguous arrays of the inputs' dtypes and shapes, in input order; with
        `batched` (a batch-bucket library) dim 0 may be any batch from 1 to the largest bucket, the
        same for every input, and (arrays, that batch) is returned."""
        if not isinstance(feeds, dict):
            raise CuvilError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        unknown = sorted(set(feeds) - set(self.input_names))
        missing = [n for n in self.input_names if n not in feeds]
        if unknown or missing:
            raise CuvilError(f"{self.path.name}: " + "; ".join(
                ([f"unknown input(s) {unknown}"] if unknown else []) + ([f"missing input(s) {missing}"] if missing else [])),
                hint=f"inputs are {self.input_names}")
        arrays, rows, first = [], None, None
        for spec in self.info["inputs"]:
            name, dtype, shape = spec["name"], tensor_dtype(spec), tuple(spec["shape"])
            arr = feeds[name]
            if not isinstance(arr, np.ndarray):
                arr = np.asarray(arr)
                if arr.dtype != dtype and np.can_cast(arr.dtype, dtype, "same_kind"):
                    arr = arr.astype(dtype)
            if dtype == object and arr.dtype.kind in "US":   # numpy str / bytes arrays: as objects
                arr = arr.astype(object)
            if arr.dtype != dtype:
                raise CuvilError(f"input '{name}': dtype {arr.dtype}, the model takes {dtype}",
                                 hint=f"convert it with .astype(np.{dtype.name})")
            if batched:
                buckets = self.info["batch"]["buckets"]
                if arr.ndim != len(shape) or tuple(arr.shape[1:]) != shape[1:]:
                    raise CuvilError(f"input '{name}': shape {list(arr.shape)}, the model takes [n, "
                                     f"{', '.join(map(str, shape[1:]))}] with a batch n of 1 to {buckets[-1]}",
                                     hint="rebuild with other input shapes to change them")
                if rows is None:
                    rows, first = arr.shape[0], name
                elif arr.shape[0] != rows:
                    raise CuvilError(f"input '{name}': batch {arr.shape[0]}, but input '{first}' has batch {rows}",
                                     hint="every input takes the same batch in dim 0")
                if not 1 <= rows <= buckets[-1]:
                    raise CuvilError(f"input '{name}': batch {rows} is outside 1..{buckets[-1]} (this library's "
                                     f"batch buckets: {buckets})",
                                     hint=f"split the batch into runs of at most {buckets[-1]} rows, or rebuild with "
                                          f"a larger bucket")
            elif tuple(arr.shape) != shape:
                raise CuvilError(f"input '{name}': shape {list(arr.shape)}, the model was built for {list(shape)}",
                                 hint="rebuild with other input shapes to change them")
            if not arr.flags.c_contiguous or not arr.flags.aligned:
                arr = np.require(arr, requirements="CA")  # ascontiguousarray keeps a misaligned array
            arrays.append(arr)
        return (arrays, rows) if batched else arrays

    def close(self):
        if self._session is not None:
            self._session.close()
            self._session = None


def load(path, prefix: str | None = None) -> Library:
    return Library(path, prefix)
