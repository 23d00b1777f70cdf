"""GEMM throughput of the reduced-precision micro-kernels (backends/numba_cpu/ukernel_lowp.py) in a
standalone blocked driver, as GFLOP/s and as a fraction of this machine's measured bf16 and
float32 peaks (benchmarks/peak_lowp.py, peak.py), with float32 alongside: cuvil's own MatMul
(benchmarks/gemm.py) and float32 UKSpec in this same driver.

    C (M x N, float32) = X (M x K, float32) @ W (K x N)

W is packed once, untimed (weights are packed at build time): bf16 in the VNNI pair panels of
nr columns, float16 in row panels. Each timed run converts X to the 16-bit format (the CvtSpec
kernel, row-major, lda = K) and multiplies: for each column block of NC, k block of KC, row
block of MC, for each nr-column panel, mr-row tiles (an edge kernel for the last M % mr rows)
read A in rows mode (a_packed=0). One thread, median of the runs. "rel err": max |C - ref| / max
|ref| with ref the float64 product of the inputs as the kernel sees them (rounded to bf16 /
float16): the accumulation error; "vs f32 in": the same against the float32 inputs, rounding of
the inputs included.

    python benchmarks/gemm_lowp.py [--size 1024] [--methods dpbf16,widen,f16c,f32] [--runs 30]
                                   [--kc 512] [--mc 96] [--no-cuvil]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from backends.numba_cpu.hostjit import object_code  # noqa: E402
from backends.numba_cpu.ukernel import UKSpec, ukernel_ir  # noqa: E402
from backends.numba_cpu.ukernel_lowp import LowpUKSpec, lowp_ukernel_ir  # noqa: E402
from backends.numba_cpu.lowp import CvtSpec, cvt_ir  # noqa: E402
from backends.numba_cpu.lowp_pack import bf16_bits, f16_bits, pack_a_panel, pack_b_pairs  # noqa: E402
from benchmarks import peak, peak_lowp  # noqa: E402

MR, NR = 6, 64
DTYPE = {"dpbf16": "bf16", "widen": "bf16", "f16c": "f16", "f32": "f32"}

DRIVER = r"""
#include <stdint.h>
typedef int32_t uk_t(const void *, int64_t, int64_t, const void *, int64_t, int64_t, float *, int64_t, int64_t,
                     int64_t, int64_t, int64_t, const float *, int64_t);
uk_t UK_MAIN, UK_EDGE;
int32_t CVT(const void *, int64_t, void *, int64_t, int64_t);

/* C = X W: X (M x K) converted into a (row-major, lda = K) unless CONVERT is 0 (a = x), W packed in
   panels of NR columns, each of KU k units (a pair of k for bf16) of E*NR elements. */
void gemm(const float *x, void *a, const void *w, float *c, int64_t M, int64_t N, int64_t K, int64_t E,
          int64_t KC, int64_t MC) {
    const int64_t KU = K / E, ESIZE = CONVERT ? 2 : 4;
    if (CONVERT) CVT(x, 0, a, 0, M * K);
    else a = (void *)x;
    for (int64_t pc = 0; pc < KU; pc += KC) {
        int64_t kc = KU - pc < KC ? KU - pc : KC;
        for (int64_t ic = 0; ic < M; ic += MC) {
            int64_t mc = M - ic < MC ? M - ic : MC;
            for (int64_t jr = 0; jr < N; jr += NR) {
                const char *panel = (const char *)w + (jr / NR) * KU * E * NR * ESIZE;
                int64_t ir = ic;
                for (; ir + MR <= ic + mc; ir += MR)
                    UK_MAIN(a, ir * K + pc * E, K, panel, pc * E * NR, E * NR, c, ir * N + jr, N, kc, -1, pc > 0, 0, 0);
                if (ir < ic + mc)
                    UK_EDGE(a, ir * K + pc * E, K, panel, pc * E * NR, E * NR, c, ir * N + jr, N, kc, -1, pc > 0, 0, 0);
            }
        }
    }
}
"""


def _kernels(method: str, M: int) -> tuple[list[str], dict]:
    """The IR texts and the driver's macro names for `method` (tiles of MR rows and one of M % MR)."""
    edge = M % MR or MR
    if method == "f32":
        specs = [UKSpec(mr=MR, nr=NR, a_packed=0, prefetch_b=0), UKSpec(mr=edge, nr=NR, a_packed=0, prefetch_b=0)]
        irs = [ukernel_ir(s, 512) for s in specs]
        cvt = None
    else:
        specs = [LowpUKSpec(mr=r, nr=NR, dtype=DTYPE[method], method=method, a_packed=0) for r in (MR, edge)]
        cvt = CvtSpec("f32", DTYPE[method], "hw" if method == "f16c" else "exact")
        irs = [lowp_ukernel_ir(s, 512) for s in specs] + [cvt_ir(cvt, 512)]
    names = {"UK_MAIN": specs[0].name, "UK_EDGE": specs[1].name, "CVT": cvt.name if cvt else "cvt_unused",
             "CONVERT": int(cvt is not None), "MR": MR, "NR": NR}
    return irs, names


def build(method: str, M: int, workdir: Path) -> ctypes.CDLL:
    """The driver and kernels of `method` linked into a shared library (gcc)."""
    cpu, _ = peak.host_cpu()
    irs, names = _kernels(method, M)
    obj = workdir / f"{method}.o"
    obj.write_bytes(object_code(irs, cpu, vector_bits=512))
    src = workdir / f"{method}.c"
    defines = "".join(f"#define {k} {v}\n" for k, v in names.items())
    stub = "" if names["CONVERT"] else "int32_t cvt_unused(const void *s, int64_t a, void *d, int64_t b, int64_t n) { return 0; }\n"
    src.write_text(defines + DRIVER.replace("int32_t CVT(", stub + "int32_t CVT(", 1))
    lib = workdir / f"lib{method}.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src), str(obj)], check=True)
    return ctypes.CDLL(str(lib))


def packed_weights(method: str, w: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """(packed W, E: elements of a k unit, W as the kernel sees it in float64) of a 16-bit method."""
    if DTYPE[method] == "bf16":
        bits = bf16_bits(w)
        return pack_b_pairs(bits, NR), 2, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    bits = f16_bits(w)
    return pack_a_panel(bits.T, NR), 1, bits.view(np.float16).astype(np.float64)


def f32_panels(w: np.ndarray) -> np.ndarray:
    """float32 W in row panels of NR columns: [q, k, j] = W(k, q NR + j)."""
    K, N = w.shape
    return np.ascontiguousarray(w.reshape(K, N // NR, NR).transpose(1, 0, 2))


def run_method(method: str, M: int, N: int, K: int, runs: int, kc: int, mc: int, workdir: Path) -> dict:
    assert N % NR == 0 and K % 2 == 0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    lib = build(method, M, workdir)
    if method == "f32":
        packed, E, w_seen = f32_panels(w), 1, w.astype(np.float64)
        x_seen = x.astype(np.float64)
    else:
        packed, E, w_seen = packed_weights(method, w)
        x_bits = bf16_bits(x) if DTYPE[method] == "bf16" else f16_bits(x)
        x_seen = ((x_bits.astype(np.uint32) << 16).view(np.float32) if DTYPE[method] == "bf16"
                  else x_bits.view(np.float16)).astype(np.float64)
    a = np.zeros(M * K, np.uint16)
    c = np.zeros((M, N), np.float32)
    args = (x.ctypes.data, a.ctypes.data, packed.ctypes.data, c.ctypes.data, M, N, K, E, kc, mc)
    fn = lib.gemm
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
    fn(*args)
    ref = x_seen @ w_seen
    err = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    err_f32_inputs = float(np.max(np.abs(c - exact)) / np.max(np.abs(exact)))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    t = statistics.median(times)
    return {"method": method, "ms": t * 1e3, "gflops": 2 * M * N * K / t / 1e9, "rel_err": err,
            "rel_err_f32_inputs": err_f32_inputs}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--methods", default="dpbf16,widen,f16c,f32")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--kc", type=int, default=512, help="k units (bf16: pairs) per k block")
    parser.add_argument("--mc", type=int, default=96, help="rows per row block")
    parser.add_argument("--no-cuvil", action="store_true", help="skip cuvil's float32 MatMul (benchmarks/gemm.py)")
    args = parser.parse_args(argv)
    n = args.size
    # best of more runs than peak.py's default: the peaks are maxima, a busy machine only lowers them
    f32_peak = peak.measure(repeats=15)["gflops"]
    bf16 = peak_lowp.measure(repeats=15)
    bf16_peak = bf16["gflops"] if bf16 else float("nan")
    print(f"# single-core peaks: FP32 FMA {f32_peak:.1f} GFLOP/s, BF16 vdpbf16ps {bf16_peak:.1f} GFLOP/s; "
          f"{n}^3, kc={args.kc} mc={args.mc}, 1 thread")
    print(f"{'kernel':>24}{'ms':>9}{'GFLOP/s':>10}{'% bf16 pk':>11}{'% f32 pk':>10}{'rel err':>10}{'vs f32 in':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            r = run_method(method, n, n, n, args.runs, args.kc, args.mc, Path(tmp))
            print(f"{'driver + ' + method:>24}{r['ms']:>9.2f}{r['gflops']:>10.1f}{100 * r['gflops'] / bf16_peak:>10.0f}%"
                  f"{100 * r['gflops'] / f32_peak:>9.0f}%{r['rel_err']:>10.1e}{r['rel_err_f32_inputs']:>11.1e}", flush=True)
    if not args.no_cuvil:
        from benchmarks import gemm
        r = gemm.run_case(n, n, n, runs=args.runs)
        print(f"{'cuvil MatMul f32':>24}{r['ms']:>9.2f}{r['gflops']:>10.1f}{100 * r['gflops'] / bf16_peak:>10.0f}%"
              f"{100 * r['gflops'] / f32_peak:>9.0f}%{r['rel_err']:>10.1e}")


if __name__ == "__main__":
    main()
