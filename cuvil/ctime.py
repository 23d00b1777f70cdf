"""The C timing program: a library's session_run timed from C, no Python in the loop.

`time_library` runs a small C program (compiled once into $TMPDIR/cuvil-bench/) that opens the
library with dlopen, creates a session, fills the inputs with fixed pseudo-random values in
[-1, 1), runs a warm-up (calls, and at least WARMUP_SECONDS) and then times each call of
session_run. cuvil/bench.py (`cuvil bench`, benchmarks/) and measured kernel selection
(cuvil/select.py) time with it; it imports nothing of cuvil's but its errors and runtime.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .errors import CuvilError

BUILD = Path(tempfile.gettempdir()) / "cuvil-bench"

# Every timing process warms up for at least this long as well as its warm-up calls: a new
# thread pool runs slowly until the OS has spread its threads over the cores (the first
# milliseconds; a 0.1 ms model's 3 warm-up calls end long before).
WARMUP_SECONDS = 0.2

HARNESS = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void* (*create_fn)(void);
typedef int (*run_fn)(void*, const void* const*, void* const*);
typedef void (*destroy_fn)(void*);

#define WARMUP_NS {warmup_ns}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }

int main(int argc, char** argv) {
    /* ctime LIB PREFIX RUNS WARMUP N_IN bytes... N_OUT bytes... */
    if (argc < 6) { fprintf(stderr, "usage\n"); return 2; }
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    char name[256];
    snprintf(name, sizeof name, "%ssession_create", argv[2]); create_fn create = (create_fn)dlsym(lib, name);
    snprintf(name, sizeof name, "%ssession_run", argv[2]); run_fn run = (run_fn)dlsym(lib, name);
    snprintf(name, sizeof name, "%ssession_destroy", argv[2]); destroy_fn destroy = (destroy_fn)dlsym(lib, name);
    if (!create || !run || !destroy) { fprintf(stderr, "missing symbols\n"); return 1; }
    int runs = atoi(argv[3]), warmup = atoi(argv[4]);
    int a = 5, n_in = atoi(argv[a++]);
    void** ins = calloc(n_in + 1, sizeof(void*));
    uint32_t seed = 12345;
    for (int i = 0; i < n_in; i++) {
        size_t bytes = strtoull(argv[a++], NULL, 10);
        float* p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
        for (size_t j = 0; j < bytes / 4; j++) { seed = seed * 1664525u + 1013904223u; p[j] = (seed >> 8) * (2.0f / 16777216.0f) - 1.0f; }
        ins[i] = p;
    }
    int n_out = atoi(argv[a++]);
    void** outs = calloc(n_out + 1, sizeof(void*));
    for (int i = 0; i < n_out; i++) { size_t bytes = strtoull(argv[a++], NULL, 10); outs[i] = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64); }
    void* s = create();
    if (!s) { fprintf(stderr, "session_create failed\n"); return 1; }
    double start = now();
    for (int i = 0; i < warmup || now() - start < WARMUP_NS; i++)
        if (run(s, (const void* const*)ins, outs)) { fprintf(stderr, "run failed\n"); return 1; }
    for (int i = 0; i < runs; i++) {
        double t = now();
        run(s, (const void* const*)ins, outs);
        printf("%.0f\n", now() - t);
    }
    destroy(s);
    /* the process's peak resident memory (Linux; benchmarks/resident.py reads it) */
    FILE* status = fopen("/proc/self/status", "r");
    char line[256];
    while (status && fgets(line, sizeof line, status))
        if (strncmp(line, "VmHWM:", 6) == 0) fputs(line, stderr);
    if (status) fclose(status);
    return 0;
}
"""


HARNESS = HARNESS.replace("{warmup_ns}", f"{WARMUP_SECONDS * 1e9:.0f}")


def harness() -> Path:
    """The C timing program, compiled on first use with $CC (default gcc)."""
    return _program("ctime", HARNESS, ["-ldl"])


def _program(name: str, source: str, libs: list[str]) -> Path:
    """A C program compiled on first use with $CC (default gcc). Its name holds a hash of its
    source and the compiler, and it is compiled under a temporary name and renamed, so processes
    timing at the same time never run a half-written or stale program."""
    cc = os.environ.get("CC", "gcc")
    digest = hashlib.sha256(f"{cc}\n{source}".encode()).hexdigest()[:16]
    exe = BUILD / f"{name}-{digest}"
    if exe.exists():
        return exe
    BUILD.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BUILD) as tmp:
        src, built = Path(tmp) / f"{name}.c", Path(tmp) / name
        src.write_text(source)
        try:
            subprocess.run([cc, "-O2", "-o", str(built), str(src), *libs], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            raise CuvilError(f"cannot compile the timing program with '{cc}': {detail.strip()}",
                             hint="install gcc or set CC to a working C compiler") from None
        os.replace(built, exe)
    return exe


# Two threads pinned to the first two CPUs this process may use bounce one cache line; prints the
# mean round trip in ns. On a VM the two vCPUs can sit near (80-120 ns here) or, for minutes at a
# time, far apart (350-370 ns), and a 2-thread run whose steps read what the other core wrote then
# takes up to twice as long (docs/performance.md, fifth session): the benchmarks record it per row.
PINGPONG = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static _Alignas(64) atomic_long flag;
static long rounds;
static int cpus[2];
static void pin(int c) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(c, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s); }
static void* pong(void* arg) {
    pin(cpus[1]);
    for (long i = 0; i < rounds; i++) { while (atomic_load(&flag) != 2 * i + 1) ; atomic_store(&flag, 2 * i + 2); }
    return NULL;
}
int main(int argc, char** argv) {
    rounds = argc > 1 ? atol(argv[1]) : 100000;
    cpu_set_t mine; CPU_ZERO(&mine);
    if (sched_getaffinity(0, sizeof mine, &mine) != 0) return 1;
    int n = 0;
    for (int c = 0; c < CPU_SETSIZE && n < 2; c++) if (CPU_ISSET(c, &mine)) cpus[n++] = c;
    if (n < 2) { printf("none\n"); return 0; }
    pthread_t t; pin(cpus[0]);
    if (pthread_create(&t, NULL, pong, NULL) != 0) return 1;
    struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < rounds; i++) { atomic_store(&flag, 2 * i + 1); while (atomic_load(&flag) != 2 * i + 2) ; }
    clock_gettime(CLOCK_MONOTONIC, &b);
    pthread_join(t, NULL);
    printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / rounds);
    return 0;
}
"""


def core_round_trip_ns(rounds: int = 100000) -> float | None:
    """The mean round trip of one cache line between the first two CPUs this process may use, in
    ns (PINGPONG; ~10-40 ms), or None with fewer than two."""
    out = subprocess.run([str(_program("pingpong", PINGPONG, ["-pthread"])), str(rounds)], check=True,
                         capture_output=True, text=True).stdout.strip()
    return None if out == "none" else float(out)


def _info(lib: Path) -> dict:
    from cuvil.runtime import Library
    return Library(lib).info


def run_harness(lib, runs: int = 100, warmup: int = 10, info: dict | None = None) -> subprocess.CompletedProcess:
    """The C timing program run on `lib`: stdout has the nanoseconds of each timed call, stderr
    the process's peak resident memory (VmHWM) as it ends. Raises CalledProcessError if it fails."""
    lib = Path(lib).resolve()
    info = info or _info(lib)
    strings = [v["name"] for v in info["inputs"] + info["outputs"] if v["dtype"] == "string"]
    if strings:   # the C program feeds zeroed buffers: NULL string pointers (docs/strings.md)
        raise CuvilError(f"{lib.name}: '{strings[0]}' is a string tensor; the timing program feeds zeroed "
                         "buffers, which are no strings", hint="time a string library from Python or your own C")
    size = lambda v: int(np.prod(v["shape"], dtype=np.int64)) * np.dtype(v["dtype"]).itemsize
    args = [str(harness()), str(lib), info.get("symbol_prefix", "cuvil_"), str(runs), str(warmup)]
    args += [str(len(info["inputs"]))] + [str(size(v)) for v in info["inputs"]]
    args += [str(len(info["outputs"]))] + [str(size(v)) for v in info["outputs"]]
    return subprocess.run(args, check=True, capture_output=True, text=True)


def time_library(lib, runs: int = 100, warmup: int = 10, info: dict | None = None) -> list[float]:
    """Seconds per call of session_run, measured in C."""
    return [float(line) * 1e-9 for line in run_harness(lib, runs, warmup, info).stdout.split()]
