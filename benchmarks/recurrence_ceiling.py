"""How fast one LSTM step's recurrent product can run from float32, fp16 and bf16 weights on this
core: the ceiling under rnn_uk.py's kernels, measured with a few lines of C (gcc intrinsics), no
cuvil involved.

A step of a batch-1 LSTM multiplies h (H values) by R^T (H x 4H gate rows): for H = 128, 64 K
multiply-adds over 256 KB of float32 R, read once per step from L2 (rnn_uk.py's broadcast form:
R^T in panels of 64 gate rows, k-major; four 16-float accumulators per panel). The variants:

    fp32   R float32, one FMA per 16 products, R's 256 KB streamed from L2 each step
    f16c   R float16 (128 KB): each 16 weights widened by vcvtph2ps, then the same FMA (what a
           CPU without avx512_fp16 does for fp16 weights: Zen 4 / Zen 5)
    bf16   R bfloat16 in pairs (128 KB), h rounded to bf16: vdpbf16ps, two products per lane

each with 4 accumulators per panel (one panel at a time) and with 8 (two panels interleaved).
Pinned to one core (`taskset -c 0`), best of several repetitions, microseconds per step.

    python benchmarks/recurrence_ceiling.py [--hidden 128] [--steps 20000]

It needs gcc and an AVX-512 CPU (avx512_bf16 for the bf16 line). docs/performance.md quotes it
for issue 19's fp16 LSTM bar: without avx512_fp16 the widening, not R's bytes, bounds the step.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef H
#define H 128
#endif
#define G (4 * H)
#define NR 64
#define PANELS (G / NR)

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static float Rf[PANELS * H * NR] __attribute__((aligned(64)));
static uint16_t Rh[PANELS * H * NR] __attribute__((aligned(64)));   /* fp16 bits, same layout */
static uint16_t Rb[PANELS * H * NR] __attribute__((aligned(64)));   /* bf16 pairs: [panel, k/2, NR, 2] */
static float h[H] __attribute__((aligned(64)));
static uint16_t hb[H] __attribute__((aligned(64)));
static float gates[G] __attribute__((aligned(64)));

/* One panel, k-major: acc[0..3] += h[k] * R[panel, k, 0..63]. */
#define STEP_FP32(ACC, P, K) { __m512 b = _mm512_set1_ps(h[K]); const float* r = Rf + ((P) * H + (K)) * NR; \
    ACC##0 = _mm512_fmadd_ps(b, _mm512_load_ps(r), ACC##0); ACC##1 = _mm512_fmadd_ps(b, _mm512_load_ps(r + 16), ACC##1); \
    ACC##2 = _mm512_fmadd_ps(b, _mm512_load_ps(r + 32), ACC##2); ACC##3 = _mm512_fmadd_ps(b, _mm512_load_ps(r + 48), ACC##3); }
#define W16(p) _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(p)))
#define STEP_F16C(ACC, P, K) { __m512 b = _mm512_set1_ps(h[K]); const uint16_t* r = Rh + ((P) * H + (K)) * NR; \
    ACC##0 = _mm512_fmadd_ps(b, W16(r), ACC##0); ACC##1 = _mm512_fmadd_ps(b, W16(r + 16), ACC##1); \
    ACC##2 = _mm512_fmadd_ps(b, W16(r + 32), ACC##2); ACC##3 = _mm512_fmadd_ps(b, W16(r + 48), ACC##3); }
#ifdef __AVX512BF16__
#define LB(p) ((__m512bh)_mm512_load_si512((const void*)(p)))
#define STEP_BF16(ACC, P, K) { uint32_t pair; memcpy(&pair, hb + (K), 4); __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair); \
    const uint16_t* r = Rb + ((P) * H + (K)) * NR; \
    ACC##0 = _mm512_dpbf16_ps(ACC##0, b, LB(r)); ACC##1 = _mm512_dpbf16_ps(ACC##1, b, LB(r + 32)); \
    ACC##2 = _mm512_dpbf16_ps(ACC##2, b, LB(r + 64)); ACC##3 = _mm512_dpbf16_ps(ACC##3, b, LB(r + 96)); }
#endif
#define ZERO(ACC) __m512 ACC##0 = _mm512_setzero_ps(), ACC##1 = _mm512_setzero_ps(), ACC##2 = _mm512_setzero_ps(), ACC##3 = _mm512_setzero_ps();
#define STORE(ACC, P) { float* g = gates + (P) * NR; _mm512_store_ps(g, ACC##0); _mm512_store_ps(g + 16, ACC##1); \
    _mm512_store_ps(g + 32, ACC##2); _mm512_store_ps(g + 48, ACC##3); }

#define PRODUCT(NAME, STEPM, KSTEP) \
static void NAME##_4(void) { for (int p = 0; p < PANELS; p++) { ZERO(a) for (int k = 0; k < H; k += KSTEP) STEPM(a, p, k) STORE(a, p) } } \
static void NAME##_8(void) { for (int p = 0; p < PANELS; p += 2) { ZERO(a) ZERO(c) \
    for (int k = 0; k < H; k += KSTEP) { STEPM(a, p, k) STEPM(c, p + 1, k) } STORE(a, p) STORE(c, p + 1) } }
PRODUCT(fp32, STEP_FP32, 1)
PRODUCT(f16c, STEP_F16C, 1)
#ifdef __AVX512BF16__
PRODUCT(bf16, STEP_BF16, 2)
#endif

/* The step's h from its gates (cheap, but a true dependence from step to step). */
static void next_h(void) { for (int j = 0; j < H; j++) { h[j] = 0.5f * gates[j] / (1.0f + (gates[j] < 0 ? -gates[j] : gates[j])); }
    for (int j = 0; j < H; j++) { uint32_t u; memcpy(&u, h + j, 4); hb[j] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); } }

static double per_step(void (*product)(void), int steps) {
    double best = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        double t = now();
        for (int s = 0; s < steps; s++) { product(); next_h(); }
        double us = (now() - t) / steps * 1e6;
        if (us < best) best = us;
    }
    return best;
}

static double time_h(int steps) {   /* next_h alone: subtracted from every line */
    double best = 1e9;
    for (int rep = 0; rep < 7; rep++) { double t = now(); for (int s = 0; s < steps; s++) next_h();
        double us = (now() - t) / steps * 1e6; if (us < best) best = us; }
    return best;
}

int main(int argc, char** argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 20000;
    srand(1);
    for (int i = 0; i < PANELS * H * NR; i++) {
        float w = ((float)rand() / RAND_MAX - 0.5f) * 0.1f;
        Rf[i] = w;
        Rh[i] = _cvtss_sh(w, 0);
    }
    for (int p = 0; p < PANELS; p++) for (int k = 0; k < H; k++) for (int n = 0; n < NR; n++) {
        uint32_t u; float w = Rf[(p * H + k) * NR + n]; memcpy(&u, &w, 4);
        Rb[(p * H + (k & ~1)) * NR + 2 * n + (k & 1)] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
    for (int j = 0; j < H; j++) h[j] = 0.01f * (j % 7);
    double base = time_h(steps);
    printf("fp32_4 %.4f\nfp32_8 %.4f\n", per_step(fp32_4, steps) - base, per_step(fp32_8, steps) - base);
    printf("f16c_4 %.4f\nf16c_8 %.4f\n", per_step(f16c_4, steps) - base, per_step(f16c_8, steps) - base);
#ifdef __AVX512BF16__
    printf("bf16_4 %.4f\nbf16_8 %.4f\n", per_step(bf16_4, steps) - base, per_step(bf16_8, steps) - base);
#endif
    printf("gates %f\n", gates[0] + gates[G - 1]);
    return 0;
}
"""

LABELS = {
    "fp32": "float32 R (256 KB a step from L2)",
    "f16c": "fp16 R widened by vcvtph2ps (128 KB)",
    "bf16": "bf16 R pairs, h in bf16, vdpbf16ps (128 KB)",
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128, help="H (a multiple of 16; 4H gate rows)")
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--core", default="0", help="taskset core list ('' for no pinning)")
    args = parser.parse_args(argv)
    if shutil.which("gcc") is None:
        raise SystemExit("recurrence_ceiling.py needs gcc")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    march = ["-mavx512f", "-mf16c", "-mfma"] + (["-mavx512bf16", "-mavx512bw", "-mavx512vl"]
                                                 if "avx512_bf16" in flags else [])
    with tempfile.TemporaryDirectory(prefix="recurrence-") as tmp:
        src, exe = Path(tmp) / "r.c", Path(tmp) / "r"
        src.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", *march, f"-DH={args.hidden}", str(src), "-o", str(exe)], check=True)
        cmd = ([shutil.which("taskset"), "-c", args.core] if args.core and shutil.which("taskset") else []) \
            + [str(exe), str(args.steps)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    times = {k: float(v) for k, v in (line.split() for line in out.splitlines()) if k != "gates"}
    print(f"# H={args.hidden}: one step's h . R^T ({4 * args.hidden * args.hidden / 1e3:.0f} K multiply-adds), "
          f"batch 1, one core, microseconds (best of 7 x {args.steps} steps)")
    fp32 = min(times["fp32_4"], times["fp32_8"])
    for kind, label in LABELS.items():
        if f"{kind}_4" not in times:
            continue
        best = min(times[f"{kind}_4"], times[f"{kind}_8"])
        print(f"{kind:5} {label:46} 4 acc {times[f'{kind}_4']:7.3f}  8 acc {times[f'{kind}_8']:7.3f}  "
              f"best / fp32 best {best / fp32:5.2f}")
    return times


if __name__ == "__main__":
    os.environ.setdefault("LC_ALL", "C")
    main()
