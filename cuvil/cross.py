"""Libraries built for another machine (the cross targets, backends/targets.py CROSS_TOOLCHAINS).

An aarch64 library or a Windows DLL cannot be loaded into this x86-64 Linux process. What can be
done with one here:

- read its description: the ELF or PE header names its platform (runtime.library_platform), and
  the info JSON that `<prefix>model_info()` returns sits in its read-only data, which `describe`
  finds (`cuvil inspect` uses it);
- run it: `run_emulated` compiles a small C program (HARNESS) with the target's cross compiler,
  which loads the library (dlopen; LoadLibrary on Windows), runs one session on raw input files
  and writes the outputs as raw files; qemu-aarch64 runs the program with the target's libc from
  the Debian cross packages (-L /usr/aarch64-linux-gnu), Wine runs the Windows one. A wasm32
  module runs in this process through wasmtime's Python API (`run_wasm`): what a host program in
  a browser or another engine does, in a few lines.

The same program runs on the real machine: `cuvil-run libm.so cuvil_ 1 in.bin 1 out.bin:4000`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CuvilError, RuntimeFailure
from .runtime import HOST_PLATFORM, elf_arch, find_prefix, library_platform  # noqa: F401  (elf_arch: for callers)

HARNESS = r"""/* cuvil-run: run a cuvil library once on raw input files (no Python on the machine).
   usage: cuvil-run LIB PREFIX N_IN in_0 ... N_OUT out_0:bytes ... [the same again: another run]... */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _WIN32
#include <malloc.h>
#include <windows.h>
#define dlopen(path, flags) ((void*)LoadLibraryA(path))
#define dlsym(lib, name) ((void*)GetProcAddress((HMODULE)(lib), (name)))
#define dlerror() "LoadLibrary failed"
#define aligned_alloc(align, size) _aligned_malloc((size), (align))
#else
#include <dlfcn.h>
#endif

typedef void* (*create_fn)(void);
typedef int (*run_fn)(void*, const void* const*, void* const*);
typedef const char* (*error_fn)(const void*);
typedef void (*destroy_fn)(void*);

static void* symbol(void* lib, const char* prefix, const char* name) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    void* p = dlsym(lib, full);
    if (!p) { fprintf(stderr, "cuvil-run: missing symbol %s\n", full); exit(2); }
    return p;
}

static void* read_file(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cuvil-run: cannot open %s\n", path); exit(2); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void* p = aligned_alloc(64, ((size_t)n + 63) / 64 * 64 + 64);
    if (!p || fread(p, 1, (size_t)n, f) != (size_t)n) { fprintf(stderr, "cuvil-run: cannot read %s\n", path); exit(2); }
    fclose(f);
    return p;
}

int main(int argc, char** argv) {
    if (argc < 4) { fprintf(stderr, "usage: cuvil-run LIB PREFIX N_IN in... N_OUT out:bytes... [N_IN in... N_OUT out:bytes...]...\n"); return 2; }
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "cuvil-run: %s\n", dlerror()); return 2; }
    const char* prefix = argv[2];
    create_fn create = (create_fn)symbol(lib, prefix, "session_create");
    run_fn run = (run_fn)symbol(lib, prefix, "session_run");
    error_fn error = (error_fn)symbol(lib, prefix, "session_error");
    destroy_fn destroy = (destroy_fn)symbol(lib, prefix, "session_destroy");
    void* s = create();
    if (!s) { fprintf(stderr, "cuvil-run: session_create failed: %s\n", error(NULL)); return 3; }
    int a = 3;
    while (a < argc) {   /* one run per group of inputs and outputs, on the same session */
        int n_in = atoi(argv[a++]);
        if (n_in < 0 || a + n_in >= argc) { fprintf(stderr, "cuvil-run: bad input count\n"); return 2; }
        void** ins = calloc((size_t)n_in + 1, sizeof(void*));
        for (int i = 0; i < n_in; i++) ins[i] = read_file(argv[a++]);
        int n_out = atoi(argv[a++]);
        if (n_out < 0 || a + n_out > argc) { fprintf(stderr, "cuvil-run: bad output count\n"); return 2; }
        void** outs = calloc((size_t)n_out + 1, sizeof(void*));
        size_t* sizes = calloc((size_t)n_out + 1, sizeof(size_t));
        char** paths = calloc((size_t)n_out + 1, sizeof(char*));
        for (int i = 0; i < n_out; i++) {
            paths[i] = argv[a++];
            char* colon = strrchr(paths[i], ':');
            if (!colon) { fprintf(stderr, "cuvil-run: output %d: give PATH:BYTES\n", i); return 2; }
            *colon = 0;
            sizes[i] = strtoull(colon + 1, NULL, 10);
            outs[i] = aligned_alloc(64, (sizes[i] + 63) / 64 * 64 + 64);
        }
        int code = run(s, (const void* const*)ins, outs);
        if (code) { fprintf(stderr, "cuvil-run: session_run returned %d: %s\n", code, error(s)); return 4; }
        for (int i = 0; i < n_out; i++) {
            FILE* f = fopen(paths[i], "wb");
            if (!f || fwrite(outs[i], 1, sizes[i], f) != sizes[i]) { fprintf(stderr, "cuvil-run: cannot write %s\n", paths[i]); return 2; }
            fclose(f);
        }
    }
    destroy(s);
    return 0;
}
"""


@dataclass
class Description:
    """What a library says about itself, read from its bytes (not loaded)."""
    path: Path
    platform: str | None     # "aarch64-linux", "x86_64-windows", "x86_64-linux" (runtime.library_platform)
    prefix: str
    info: dict


def describe(path) -> Description:
    """The description of a library for any machine, from its file: its platform, symbol prefix and
    info JSON (the string its model_info() returns)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise CuvilError(f"library not found: {path}")
    data = path.read_bytes()
    prefix = wasm_prefix(data, path) if data[:4] == b"\0asm" else find_prefix(path)
    # json.dumps(sort_keys=True) puts "abi_version" first; the string ends at its NUL.
    match = re.search(rb'\{"abi_version": [^\x00]*', data)
    try:
        info = json.loads(match.group(0).decode("utf-8")) if match else None
    except ValueError:
        info = None
    if not isinstance(info, dict) or "inputs" not in info:
        raise CuvilError(f"{path}: no cuvil description found in the library",
                         hint="was it built by cuvil? manifest.json beside it describes it too")
    return Description(path, library_platform(path), prefix, info)


def _leb128(data: bytes, at: int) -> tuple[int, int]:
    """An unsigned LEB128 number at `at`: (value, the offset after it)."""
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        shift += 7
        if byte < 0x80:
            return value, at


def wasm_exports(data: bytes) -> list[str]:
    """The names a WebAssembly module exports (its export section, id 7), in their order."""
    at, names = 8, []
    try:
        while at < len(data):
            section, at = data[at], at + 1
            size, at = _leb128(data, at)
            if section == 7:
                count, k = _leb128(data, at)
                for _ in range(count):
                    length, k = _leb128(data, k)
                    names.append(data[k:k + length].decode("utf-8"))
                    _, k = _leb128(data, k + length + 1)   # the export's kind (a byte), then its index
                return names
            at += size
    except (IndexError, UnicodeDecodeError):
        pass
    return names


def wasm_function_names(data: bytes) -> list[str]:
    """The function names of a WebAssembly module's "name" section (its debug names: the C library's
    functions a module links show there), in index order; [] when it has none."""
    at = 8
    try:
        while at < len(data):
            section, at = data[at], at + 1
            size, at = _leb128(data, at)
            end = at + size
            if section == 0:
                length, k = _leb128(data, at)
                if data[k:k + length] == b"name":
                    k += length
                    while k < end:
                        sub, k = data[k], k + 1
                        sub_size, k = _leb128(data, k)
                        if sub == 1:
                            count, k = _leb128(data, k)
                            names = []
                            for _ in range(count):
                                _, k = _leb128(data, k)
                                length, k = _leb128(data, k)
                                names.append(data[k:k + length].decode("utf-8", "replace"))
                                k += length
                            return names
                        k += sub_size
            at = end
    except IndexError:
        pass
    return []


def wasm_prefix(data: bytes, path: Path) -> str:
    """The symbol prefix of a wasm32 module built by cuvil: the name before `abi_version` in its exports."""
    candidates = sorted(name[: -len("abi_version")] for name in wasm_exports(data) if name.endswith("abi_version"))
    if not candidates:
        raise CuvilError(f"{path}: not a module built by cuvil (no *abi_version export)")
    return candidates[0]


def is_foreign(path) -> bool:
    """Whether `path` is a library for another platform than this machine's (aarch64, Windows)."""
    if not Path(path).is_file():
        return False
    platform = library_platform(Path(path))
    return platform is not None and platform != HOST_PLATFORM


def _toolchain(platform: str):
    """(triple, CrossToolchain) of a platform such as "aarch64-linux"."""
    from backends.targets import CROSS_TOOLCHAINS
    arch, system = platform.split("-", 1)
    for triple, toolchain in CROSS_TOOLCHAINS.items():
        if triple.split("-", 1)[0] == arch and system in triple:
            return triple, toolchain
    raise CuvilError(f"no way to run a {platform} library on this machine")


def _cross_cc(platform: str) -> str:
    from backends.targets import cc_variable
    triple, toolchain = _toolchain(platform)
    return os.environ.get(cc_variable(triple), toolchain.cc)


def emulator_problem(platform: str) -> str | None:
    """Why a library for `platform` ("aarch64-linux", "x86_64-windows", "wasm32") cannot be built and
    run here (its cross compiler, C library or emulator is missing, naming the Debian package), or None."""
    if platform == "wasm32":
        return wasm_problem()
    _, toolchain = _toolchain(platform)
    cc = _cross_cc(platform)
    if shutil.which(cc) is None:
        return f"the {platform} C cross compiler {cc} is not installed (apt-get install {toolchain.package})"
    if not Path(toolchain.sysroot).is_dir():
        return f"the {platform} C library ({toolchain.sysroot}) is not installed (apt-get install {toolchain.package})"
    if toolchain.find_emulator() is None:
        return f"{toolchain.emulators[0]} is not installed (apt-get install {toolchain.emulator_package})"
    return None


def harness(platform: str, build_dir: Path | None = None) -> Path:
    """The HARNESS program compiled for `platform` with its cross compiler, once per (source,
    compiler): its name holds their hash, and it is compiled under a temporary name and renamed."""
    problem = emulator_problem(platform)
    if problem:
        raise CuvilError(f"cannot run a {platform} library here: {problem}")
    cc = _cross_cc(platform)
    windows = platform.endswith("-windows")
    build_dir = Path(build_dir or Path(tempfile.gettempdir()) / f"cuvil-run-{os.getuid()}")
    digest = hashlib.sha256(f"{cc}\n{HARNESS}".encode()).hexdigest()[:16]
    exe = build_dir / f"cuvil-run-{platform}-{digest}{'.exe' if windows else ''}"
    if exe.exists():
        return exe
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        src, built = Path(tmp) / "cuvil-run.c", Path(tmp) / exe.name
        src.write_text(HARNESS)
        result = subprocess.run([cc, "-O2", "-std=c11", "-o", str(built), str(src), *([] if windows else ["-ldl"])],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise CuvilError(f"cannot compile the run program with {cc}: {result.stderr.strip()[-2000:]}")
        os.replace(built, exe)
    return exe


# Wine: no debug output, no offer to install Mono or Gecko in a new prefix (nothing is downloaded).
WINE_ENV = {"WINEDEBUG": "-all", "WINEDLLOVERRIDES": "mscoree,mshtml="}


def _windows_path(path: Path) -> str:
    """A path as a Windows program under Wine sees it (Wine's Z: drive is the root folder)."""
    return "Z:" + str(path).replace("/", "\\")


def run_emulated(library, feeds: dict, cpu: str | None = None, timeout: float = 600) -> dict:
    """Run a library built for another platform once, under qemu-user (aarch64) or Wine (Windows),
    on numpy arrays by input name; its outputs by name (graph order). `cpu`: the CPU qemu emulates
    (its -cpu; default: qemu's "max", every feature). Raises RuntimeFailure with the program's
    message when a session cannot be made or the run fails."""
    return run_emulated_many(library, [feeds], cpu, timeout)[0]


def run_emulated_many(library, feeds_list: list, cpu: str | None = None, timeout: float = 600) -> list:
    """run_emulated for each feeds of `feeds_list`, in turn on one session of one emulated process
    (Wine takes seconds to start); the outputs of each run."""
    described = describe(library)
    platform = described.platform
    if platform is None or platform == HOST_PLATFORM:
        raise CuvilError(f"{described.path}: not a library for another machine", hint="load it with cuvil.load")
    if platform == "wasm32":
        module = WasmModule(described.path)
        return [run_wasm(module, feeds) for feeds in feeds_list]
    exe = harness(platform)
    _, toolchain = _toolchain(platform)
    windows = platform.endswith("-windows")
    shown = _windows_path if windows else str
    info = described.info
    with tempfile.TemporaryDirectory(prefix="cuvil-emulated-") as tmp:
        tmp = Path(tmp)
        args = []
        for r, feeds in enumerate(feeds_list):
            args.append(str(len(info["inputs"])))
            for i, spec in enumerate(info["inputs"]):
                arr = _checked_input(feeds, spec, info)
                (tmp / f"in{r}_{i}.bin").write_bytes(arr.tobytes())
                args.append(shown(tmp / f"in{r}_{i}.bin"))
            args.append(str(len(info["outputs"])))
            for i, spec in enumerate(info["outputs"]):
                nbytes = int(np.prod(spec["shape"], dtype=np.int64)) * np.dtype(spec["dtype"]).itemsize
                args.append(f"{shown(tmp / f'out{r}_{i}.bin')}:{nbytes}")
        cmd = [*toolchain.run_prefix(cpu), str(exe), shown(described.path), described.prefix, *args]
        env = dict(os.environ, **WINE_ENV) if windows else None
        emulator = Path(cmd[0]).name
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeFailure(f"{described.path.name} under {emulator}: no answer in {timeout:g} s") from None
        if result.returncode != 0:
            raise RuntimeFailure(f"{described.path.name} under {emulator}: exit {result.returncode}: "
                                 f"{(result.stderr or result.stdout).strip()[-2000:]}")
        results = []
        for r in range(len(feeds_list)):
            outputs = {}
            for i, spec in enumerate(info["outputs"]):
                if spec["name"] in outputs:
                    continue
                data = np.fromfile(tmp / f"out{r}_{i}.bin", dtype=np.dtype(spec["dtype"]))
                outputs[spec["name"]] = data.reshape(spec["shape"])
            results.append(outputs)
        return results


# -- wasm32 modules: run with wasmtime (pip install wasmtime; the test extra) ----------------------

def wasm_problem() -> str | None:
    """Why a wasm32 module cannot be built and run here (clang, wasm-ld, wasi-libc or wasmtime
    missing, naming the package), or None."""
    from backends.targets import CROSS_TOOLCHAINS, WASM_TRIPLE, cc_variable, wasm_link_problem
    toolchain = CROSS_TOOLCHAINS[WASM_TRIPLE]
    cc = os.environ.get(cc_variable(WASM_TRIPLE), toolchain.cc)
    if shutil.which(cc) is None:
        return f"the wasm32 C compiler {cc} is not installed (apt-get install {toolchain.package})"
    missing = wasm_link_problem()
    if missing:
        return f"the wasm32 link needs {missing}"
    try:
        import wasmtime  # noqa: F401
    except ImportError:
        return "the WebAssembly engine wasmtime is not installed (pip install wasmtime)"
    return None


class WasmModule:
    """A wasm32 module built by cuvil, instantiated in wasmtime: the same C ABI as a native library,
    with the tensors copied into and out of the module's memory (allocated by its exported malloc)."""

    def __init__(self, path):
        try:
            import wasmtime
        except ImportError:
            raise CuvilError("running a wasm32 module needs wasmtime", hint="pip install wasmtime") from None
        self.described = describe(path)
        if self.described.platform != "wasm32":
            raise CuvilError(f"{self.described.path}: not a WebAssembly module")
        self.store = wasmtime.Store(wasmtime.Engine())
        module = wasmtime.Module.from_file(self.store.engine, str(self.described.path))
        # imports nothing (backends/native/driver.py WASM_PRELUDE): an empty import list
        self.exports = wasmtime.Instance(self.store, module, []).exports(self.store)
        self.memory = self.exports["memory"]
        self.exports["_initialize"](self.store)   # a WASI reactor: its constructors, once (link.py LDFLAGS_WASM)

    def call(self, name: str, *args):
        """Call an exported function: a C ABI one by its name without the prefix ("session_run"),
        or malloc / free."""
        from backends.native.link import WASM_HOST_EXPORTS
        export = name if name in WASM_HOST_EXPORTS else self.described.prefix + name
        return self.exports[export](self.store, *args)

    def malloc(self, nbytes: int) -> int:
        pointer = self.call("malloc", max(int(nbytes), 1))
        if not pointer:
            raise RuntimeFailure(f"{self.described.path.name}: the module is out of memory ({nbytes} bytes)")
        return pointer

    def string(self, pointer: int) -> str:
        data = bytearray()
        while pointer and (byte := self.memory.read(self.store, pointer, pointer + 1)) != b"\0":
            data += byte
            pointer += 1
        return data.decode("utf-8", "replace")

    def run(self, feeds: dict) -> dict:
        """One session on numpy arrays by input name: its outputs by name (graph order)."""
        info = self.described.info
        pointers, blocks = [], []
        try:
            for spec in info["inputs"]:
                arr = _checked_input(feeds, spec, info)
                pointer = self.malloc(arr.nbytes)
                blocks.append(pointer)
                self.memory.write(self.store, arr.tobytes(), pointer)
                pointers.append(pointer)
            outs = []
            for spec in info["outputs"]:
                nbytes = int(np.prod(spec["shape"], dtype=np.int64)) * np.dtype(spec["dtype"]).itemsize
                outs.append((self.malloc(nbytes), nbytes))
                blocks.append(outs[-1][0])
            table = self.malloc(4 * (len(pointers) + len(outs)))   # const void* inputs[], void* outputs[]
            blocks.append(table)
            addresses = np.array(pointers + [p for p, _ in outs], dtype="<u4")
            self.memory.write(self.store, addresses.tobytes(), table)
            session = self.call("session_create")
            if not session:
                raise RuntimeFailure(f"{self.described.path.name}: session_create failed: "
                                     f"{self.string(self.call('session_error', 0))}")
            try:
                code = self.call("session_run", session, table, table + 4 * len(pointers))
                if code:
                    raise RuntimeFailure(f"{self.described.path.name}: session_run returned {code}: "
                                         f"{self.string(self.call('session_error', session))}")
            finally:
                self.call("session_destroy", session)
            outputs = {}
            for spec, (pointer, nbytes) in zip(info["outputs"], outs):
                if spec["name"] not in outputs:
                    data = self.memory.read(self.store, pointer, pointer + nbytes)
                    outputs[spec["name"]] = np.frombuffer(data, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])
            return outputs
        finally:
            for pointer in blocks:
                self.call("free", pointer)


def _checked_input(feeds: dict, spec: dict, info: dict) -> np.ndarray:
    if spec["name"] not in feeds:
        raise CuvilError(f"missing input '{spec['name']}'", hint=f"inputs are {[s['name'] for s in info['inputs']]}")
    strings = [s["name"] for s in info["inputs"] + info["outputs"] if s["dtype"] == "string"]
    if strings:
        raise CuvilError(f"'{strings[0]}' is a string tensor: libraries of other machines with string tensors are "
                         "built but not run here (under an emulator)", hint="run the library on its machine (docs/strings.md)")
    arr = np.array(feeds[spec["name"]], dtype=np.dtype(spec["dtype"]), order="C")   # (0-d stays 0-d)
    if list(arr.shape) != list(spec["shape"]):
        raise CuvilError(f"input '{spec['name']}': shape {list(arr.shape)}, the model was built for {spec['shape']}")
    return arr


def run_wasm(library, feeds: dict) -> dict:
    """Run a wasm32 module once in wasmtime on numpy arrays by input name; its outputs by name.
    Raises RuntimeFailure with the module's message when a session cannot be made or the run
    fails, or when the module traps."""
    import wasmtime
    module = library if isinstance(library, WasmModule) else WasmModule(
        library.path if isinstance(library, Description) else library)
    try:
        return module.run(feeds)
    except wasmtime.Trap as trap:
        raise RuntimeFailure(f"{module.described.path.name} trapped in wasmtime: {str(trap).strip()[:2000]}") from None
