"""Reduced-precision kernels (bf16, fp16): conversions bit-exact against ml_dtypes / numpy, and the
micro-kernels against float64 products of the same rounded inputs within a derived bound.

Every path runs here, on an AVX-512 BF16 machine: code built for `haswell` (AVX2, F16C) and
`x86-64` (SSE2) runs too. AMX and AVX512-FP16 code is only assembled (no such hardware here)."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from backends.native.hostjit import HostJit
from backends.numba_cpu.lowp import CvtSpec, cvt_ir

# (cpu, vector bits) of each path's target: znver4 has AVX512-BF16 and F16C, haswell F16C, x86-64 neither.
CPUS = {"znver4": 512, "haswell": 256, "x86-64": 128}

_jits = {}


def jit_for(cpu: str) -> HostJit:
    if cpu not in _jits:
        _jits[cpu] = HostJit(cpu, vector_bits=CPUS[cpu])
    return _jits[cpu]


def run_conversion(spec: CvtSpec, cpu: str, src: np.ndarray, soff: int = 0) -> np.ndarray:
    """dst (uint16 or uint32 bits) of the conversion kernel over src[soff:], one guard element past the end."""
    jit = jit_for(cpu)
    try:
        fn = jit.function(spec.name, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int64)
    except AssertionError:
        jit.add(cvt_ir(spec, CPUS[cpu]))
        fn = jit.function(spec.name, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int64)
    n = len(src) - soff
    guard = 0xABCD
    dst = np.full(n + 3, guard, np.uint32 if spec.dst == "f32" else np.uint16)
    fn(src.ctypes.data, soff, dst.ctypes.data, 2, n)
    assert (dst[:2] == guard).all() and dst[-1] == guard, "wrote outside [doff, doff + n)"
    return dst[2:-1]


F32_SPECIALS = np.array([
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,                  # ±0, ±inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA12345, 0x7FBFFFFF, 0xFFFFFFFF,  # NaNs, quiet and signalling
    0x00000001, 0x80000001, 0x007FFFFF, 0x00400000, 0x00008000, 0x00018000, 0x00017FFF, 0x807F8000,  # subnormals
    0x00800000, 0x00800001, 0x0080FFFF,                               # the smallest normals
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0xBF818000,      # bf16 ties to even and neighbours
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,                  # bf16 max finite; values rounding to inf
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000, 0xC77FF000,      # float16 max (65504), 65519.99.., 65520 (-> inf)
    0x33800000, 0x33000000, 0x33000001, 0x33400000, 0x32FFFFFF,      # 2^-24, 2^-25 (tie -> 0), 3*2^-26
    0x38800000, 0x387FFFFF, 0x387FE000, 0x387FF000,                  # 2^-14 and just below (subnormal/normal edge)
    0x3F801000, 0x3F803000, 0x3F801001, 0x3F800FFF,                  # float16 ties to even at 1.0
], np.uint32)


def random_f32_bits(n: int = 1 << 18, seed: int = 0) -> np.ndarray:
    return np.concatenate([F32_SPECIALS, np.random.default_rng(seed).integers(0, 1 << 32, n, dtype=np.uint32)])


def is_nan32(bits):
    return (bits & 0x7FFFFFFF) > 0x7F800000


def is_nan16(bits, fmt):
    exp_all, frac = (0x7F80, 0x7F) if fmt == "bf16" else (0x7C00, 0x3FF)
    return ((bits & exp_all) == exp_all) & ((bits & frac) != 0)


def expected_narrowing(bits: np.ndarray, fmt: str, flush_subnormal_inputs: bool = False) -> np.ndarray:
    """The oracle (ml_dtypes for bf16, numpy for float16) on non-NaN inputs; NaNs as the module documents
    (quiet, sign and top payload bits kept)."""
    x = bits.copy()
    if flush_subnormal_inputs:
        x[(x & 0x7F800000) == 0] &= 0x80000000
    with np.errstate(all="ignore"):
        if fmt == "bf16":
            out = x.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
            nan = ((x >> 16) | 0x40).astype(np.uint16)
        else:
            out = x.view(np.float32).astype(np.float16).view(np.uint16)
            nan = (((x >> 16) & 0x8000) | 0x7E00 | ((x >> 13) & 0x3FF)).astype(np.uint16)
    return np.where(is_nan32(bits), nan, out)


def expected_widening(bits: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "bf16":
        return bits.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)   # a shift: NaNs keep every bit
    out = bits.view(np.float16).astype(np.float32).view(np.uint32)
    return np.where(is_nan16(bits, "f16"), out | 0x00400000, out)                 # NaNs made quiet


NARROWING = [(fmt, method, cpu) for fmt in ("bf16", "f16") for cpu in CPUS for method in ("exact", "hw")
             if method == "exact" or (cpu == "znver4" if fmt == "bf16" else cpu != "x86-64")]


@pytest.mark.parametrize("fmt,method,cpu", NARROWING)
def test_f32_narrowing_bit_exact(fmt, method, cpu):
    """Every special value and 2^18 random bit patterns (odd length and offset: the masked last step)."""
    bits = random_f32_bits()
    got = run_conversion(CvtSpec("f32", fmt, method), cpu, bits, soff=1)
    # vcvtneps2bf16 treats float32 subnormal inputs as zero (documented in lowp.py)
    want = expected_narrowing(bits, fmt, flush_subnormal_inputs=(fmt, method) == ("bf16", "hw"))[1:]
    bad = np.flatnonzero(got != want)
    assert not len(bad), [(hex(bits[1 + i]), hex(got[i]), hex(want[i])) for i in bad[:8]]
    nan = is_nan32(bits[1:])
    assert is_nan16(got[nan], fmt).all() and (got[nan] & (0x40 if fmt == "bf16" else 0x200)).all()


def test_vcvtneps2bf16_flushes_only_subnormal_inputs():
    """The instruction path differs from the exact one exactly on float32 subnormals (|x| < 2^-126)."""
    bits = random_f32_bits()
    exact = run_conversion(CvtSpec("f32", "bf16", "exact"), "znver4", bits)
    hw = run_conversion(CvtSpec("f32", "bf16", "hw"), "znver4", bits)
    differs = exact != hw
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)
    assert differs.any() and (subnormal >= differs).all()


WIDENING = [(fmt, method, cpu) for fmt in ("bf16", "f16") for cpu in CPUS for method in ("exact", "hw")
            if method == "exact" or (fmt == "f16" and cpu != "x86-64")]


@pytest.mark.parametrize("fmt,method,cpu", WIDENING)
def test_widening_to_f32_bit_exact_for_all_inputs(fmt, method, cpu):
    """All 65536 bit patterns."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = run_conversion(CvtSpec(fmt, "f32", method), cpu, bits)
    want = expected_widening(bits, fmt)
    bad = np.flatnonzero(got != want)
    assert not len(bad), [(hex(bits[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_round_trip_of_every_16_bit_value(fmt):
    """Narrowing a widened value gives it back (NaNs: quiet)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = run_conversion(CvtSpec(fmt, "f32"), "znver4", bits)
    back = run_conversion(CvtSpec("f32", fmt), "znver4", wide)
    quiet = 0x40 if fmt == "bf16" else 0x200
    assert (back == np.where(is_nan16(bits, fmt), bits | quiet, bits)).all()
