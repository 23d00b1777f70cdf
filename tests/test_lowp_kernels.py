"""Reduced-precision kernels (bf16, fp16): conversions bit-exact against ml_dtypes / numpy, and the
micro-kernels against float64 products of the same rounded inputs within a derived bound.

Paths: code for this machine's CPU (BF16: it must have AVX512-BF16, as AMD Zen 4 and Intel Sapphire
Rapids do), and code built for `haswell` (AVX2, F16C) and `x86-64` (SSE2), which any x86-64 machine
with AVX2 runs. The AVX512-FP16 kernel runs on the host's CPU: for real where it has AVX512-FP16,
through LLVM's float16 emulation elsewhere (the bound says which). AMX runs only where the CPU
and kernel grant tile state (skipped elsewhere: not run on Zen 4); its object is checked anywhere."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from backends.numba_cpu.hostjit import HostJit
from backends.numba_cpu.lowp import CvtSpec, PairCvtSpec, cvt_ir

BF16 = "host-avx512bf16"   # the path of code for this machine's CPU (which needs AVX512-BF16 and F16C)
# vector bits of each path's code: haswell has F16C, x86-64 neither.
CPUS = {BF16: 512, "haswell": 256, "x86-64": 128}


def _host() -> tuple[str, set]:
    from backends.targets import init_llvm
    import llvmlite.binding as llvm
    init_llvm()
    features = llvm.get_host_cpu_features().flatten()
    return llvm.get_host_cpu_name(), {f[1:] for f in features.split(",") if f.startswith("+")}


HOST_CPU, HOST_FEATURES = _host()


def cpu_for(path: str) -> tuple[str, str]:
    """(LLVM cpu, features) of a path; the host path is skipped on a CPU without AVX512-BF16."""
    if path != BF16:
        return path, ""
    if "avx512bf16" not in HOST_FEATURES:
        pytest.skip(f"{HOST_CPU} has no AVX512-BF16")
    return HOST_CPU, ",".join(f"+{f}" for f in sorted(HOST_FEATURES))


_jits = {}


def _bind_libgcc_half_rounding() -> bool:
    """LLVM emulates float16 arithmetic on a CPU without AVX512-FP16 (the "fp16" micro-kernel run on
    AMD Zen 4) in double, rounded to float16 by libgcc's `__truncdfhf2` (GCC 12 on): bind it for the
    JIT. False where libgcc has none."""
    import llvmlite.binding as llvm
    try:
        rounding = ctypes.CDLL("libgcc_s.so.1").__truncdfhf2
    except (OSError, AttributeError):
        return False
    llvm.add_symbol("__truncdfhf2", ctypes.cast(rounding, ctypes.c_void_p).value)
    return True


HALF_ROUNDING_BOUND = _bind_libgcc_half_rounding()


def jit_for(cpu: str) -> HostJit:
    if cpu not in _jits:
        _jits[cpu] = HostJit(*cpu_for(cpu), vector_bits=CPUS[cpu])
    return _jits[cpu]


def kernel(spec, cpu: str):
    """spec's kernel (LowpUKSpec, CvtSpec, PairCvtSpec) compiled for a path, callable through ctypes."""
    from backends.numba_cpu.ukernel_lowp import ukernel_lowp_ir
    jit = jit_for(cpu)
    if not jit.has(spec.name):
        jit.add(ukernel_lowp_ir(spec, CPUS[cpu]))
    return jit.function(spec.name, ctypes.c_int32, *(ctypes.c_void_p if c == "p" else ctypes.c_int64 for c in spec._ARGS))


def run_conversion(spec: CvtSpec, cpu: str, src: np.ndarray, soff: int = 0) -> np.ndarray:
    """dst (uint16 or uint32 bits) of the conversion kernel over src[soff:], one guard element past the end."""
    fn = kernel(spec, cpu)
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
             if method == "exact" or (cpu == BF16 if fmt == "bf16" else cpu != "x86-64")]


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
    exact = run_conversion(CvtSpec("f32", "bf16", "exact"), BF16, bits)
    hw = run_conversion(CvtSpec("f32", "bf16", "hw"), BF16, bits)
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


@pytest.mark.parametrize("cpu", list(CPUS))
@pytest.mark.parametrize("n", [1, 37, 1000])
def test_pair_rows_conversion_is_the_vnni_packing(cpu, n):
    """Two float32 rows (k = 2kp, 2kp + 1) into one row of bf16 pairs: the bits pack_b_pairs gives."""
    from backends.numba_cpu.lowp_pack import pack_b_pairs
    spec = PairCvtSpec("hw" if cpu == BF16 else "exact")
    fn = kernel(spec, cpu)
    stride = n + 5
    rows = np.random.default_rng(n).standard_normal(1 + 2 * stride).astype(np.float32)
    rows[1:1 + min(n, len(F32_SPECIALS))] = F32_SPECIALS[:n].view(np.float32)
    dst = np.full(2 * n + 4, 0xABCD, np.uint16)
    fn(rows.ctypes.data, 1, stride, dst.ctypes.data, 2, n)
    pair = np.stack([rows[1:1 + n], rows[1 + stride:1 + stride + n]]).view(np.uint32)
    flush = spec.method == "hw"   # vcvtneps2bf16: float32 subnormals as zero
    want = pack_b_pairs(expected_narrowing(pair.ravel(), "bf16", flush).reshape(2, n), n)[0, 0]
    assert (dst[2:-2] == want).all() and (dst[:2] == 0xABCD).all() and (dst[-2:] == 0xABCD).all()


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_numpy_packing_rounds_as_the_kernels(fmt):
    """lowp_pack's build-time rounding (weights) gives the bits of the "exact" kernels, NaNs included."""
    from backends.numba_cpu.lowp_pack import bf16_bits, f16_bits
    bits = random_f32_bits()
    got = (bf16_bits if fmt == "bf16" else f16_bits)(bits.view(np.float32))
    assert (got == expected_narrowing(bits, fmt)).all()


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_round_trip_of_every_16_bit_value(fmt):
    """Narrowing a widened value gives it back (NaNs: quiet)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = run_conversion(CvtSpec(fmt, "f32"), BF16, bits)
    back = run_conversion(CvtSpec("f32", fmt), BF16, wide)
    quiet = 0x40 if fmt == "bf16" else 0x200
    assert (back == np.where(is_nan16(bits, fmt), bits | quiet, bits)).all()


# ---------------------------------------------------------------------------------------------
# Micro-kernels: C (+)= A B with bf16 / float16 A and B and float32 accumulation.

from backends.numba_cpu.ukernel_lowp import LowpUKSpec, lowp_ukernel_ir  # noqa: E402
from backends.numba_cpu.lowp_pack import (bf16_bits, f16_bits, pack_a_pairs, pack_a_panel,  # noqa: E402
                                          pack_b_pairs)

U32 = 2.0 ** -24     # unit roundoff of float32
U16 = 2.0 ** -11     # of float16


def gamma(n: int, u: float = U32) -> float:
    return n * u / (1 - n * u)


def error_bound(spec: LowpUKSpec, k_steps: int, magnitude: np.ndarray, emulated_fp16: bool = False) -> np.ndarray:
    """The bound on |kernel - exact| derived in ukernel_lowp.py's docstring. `magnitude` is
    |C0| + sum_k |A(i,k) B(k,j)| + |bias(i)| (what every rounding is relative to), `k_steps` the
    products the k loop adds (padding zeros included: adding an exact zero does not round).

    float32 accumulation: the k loop is a recursive sum of K + 1 terms (C0 and K exact products),
    |error| <= gamma(K) * sum |terms|; the bias adds one more rounding: gamma(K + 1).
    "fp16": each chunk of c products is summed in float16 from zero (c roundings, gamma_16(c)), the
    chunk sums then join a float32 recursive sum of K/c + 1 terms and the bias:
    gamma_16(c) + gamma(K/c + 1) (1 + gamma_16(c)). Emulated float16 (LLVM computes each float16 FMA
    in double and rounds it to float16: a double rounding) has unit 2^-11 + 2^-53 + 2^-64.
    The float64 reference adds at most (K + 2) 2^-53 of the magnitude."""
    reference = (k_steps + 2) * 2.0 ** -53
    if spec.method != "fp16":
        return (gamma(k_steps + 1) + reference) * magnitude
    c = spec.fp16_chunk
    u = U16 + 2.0 ** -53 + 2.0 ** -64 if emulated_fp16 else U16
    per_chunk = gamma(c, u)
    return (per_chunk + gamma(k_steps // c + 1) * (1 + per_chunk) + reference) * magnitude


def run_tile(spec: LowpUKSpec, cpu: str, K: int, valid: int, loadc: int, seed: int = 0):
    """The kernel's C on random inputs, the float64 reference of the same rounded inputs, the bound."""
    rng = np.random.default_rng(seed)
    mr, nr = spec.mr, spec.nr
    a = rng.standard_normal((mr, K)).astype(np.float32)
    b = rng.standard_normal((K, valid)).astype(np.float32)
    to_bits, to_value = ((bf16_bits, ml_dtypes.bfloat16) if spec.dtype == "bf16" else (f16_bits, np.float16))
    a16, b16 = to_bits(a), to_bits(b)
    k_steps = K
    if spec.k_pairs:
        k_steps = 2 * (-(-K // 2))
        kc = k_steps // 2
        bpack = pack_b_pairs(b16, nr)[0]
        ldb = 2 * nr
        if spec.a_packed:
            apack, lda = pack_a_pairs(a16, spec.a_panel)[0], 0
        else:
            lda = k_steps + 6                       # a row-major matrix wider than K (even: pairs stay aligned)
            apack = np.zeros((mr, lda), np.uint16)
            apack[:, :K] = a16
    else:
        kc = K
        ldb = nr + 32
        bpack = np.zeros((K, ldb), np.uint16)
        bpack[:, :valid] = b16
        if spec.a_packed:
            apack, lda = pack_a_panel(a16, spec.a_panel)[0], 0
        else:
            lda = K + 3
            apack = np.zeros((mr, lda), np.uint16)
            apack[:, :K] = a16
    aoff, boff, coff, biasoff = 2, 4, 1, 1
    a_buf = np.concatenate([np.zeros(aoff, np.uint16), apack.ravel()])
    b_buf = np.concatenate([np.zeros(boff, np.uint16), bpack.ravel()])
    ldc = nr + 5
    c_buf = rng.standard_normal(coff + mr * ldc + 8).astype(np.float32)
    c0 = c_buf.copy()
    bias = rng.standard_normal(mr + biasoff).astype(np.float32)
    fn = kernel(spec, cpu)
    mask = (1 << valid) - 1 if valid < 64 else -1
    fn(a_buf.ctypes.data, aoff, lda, b_buf.ctypes.data, boff, ldb, c_buf.ctypes.data, coff, ldc, kc, mask, loadc,
       bias.ctypes.data, biasoff)
    a64 = a16.view(to_value).astype(np.float64)
    b64 = b16.view(to_value).astype(np.float64)
    tile = lambda buf: buf[coff:coff + mr * ldc].reshape(mr, ldc)
    start = tile(c0)[:, :valid].astype(np.float64) if loadc & 1 else np.zeros((mr, valid))
    ref = start + a64 @ b64
    magnitude = np.abs(start) + np.abs(a64) @ np.abs(b64)
    if loadc & 2:
        if spec.bias:
            ref += bias[biasoff:biasoff + mr, None]
            magnitude += np.abs(bias[biasoff:biasoff + mr, None])
        if spec.act == "Relu":
            ref = np.maximum(ref, 0)
        elif spec.act == "Clip":
            ref = np.clip(ref, spec.act_lo, spec.act_hi)
    got = tile(c_buf)
    # columns past the mask and everything outside the tile are left as they were
    untouched = np.ones(c_buf.shape, bool)
    untouched[coff:coff + mr * ldc].reshape(mr, ldc)[:, :valid] = False
    assert (c_buf[untouched] == c0[untouched]).all(), "the kernel wrote outside its masked tile"
    return got[:, :valid].astype(np.float64), ref, error_bound(spec, k_steps, magnitude,
                                                                  "avx512fp16" not in HOST_FEATURES)


def assert_within_bound(got, ref, bound):
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"|err| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    return float((err / np.maximum(bound, 1e-300)).max())


# (method, cpu) of every path that runs here; fp16 runs emulated (see error_bound).
RUNNABLE = [("bf16", "dpbf16", BF16), ("bf16", "widen", BF16), ("bf16", "widen", "haswell"),
            ("bf16", "widen", "x86-64"), ("f16", "f16c", BF16), ("f16", "f16c", "haswell")]
TILES = [  # mr, nr, a_packed, K, valid columns, loadc
    (6, 64, 1, 256, 64, 0), (6, 64, 0, 255, 64, 1), (4, 32, 1, 7, 19, 1), (1, 16, 0, 1, 1, 0),
    (12, 32, 1, 64, 32, 3), (3, 48, 0, 33, 40, 3)]


def _spec(dtype, method, mr, nr, a_packed, cpu, **epilogue):
    lanes = 16 if method == "dpbf16" else CPUS[cpu] // 32
    nr = -(-nr // lanes) * lanes
    return LowpUKSpec(mr=mr, nr=nr, dtype=dtype, method=method, a_packed=a_packed,
                      a_panel=mr + 2 if a_packed else 0, **epilogue), nr


@pytest.mark.parametrize("dtype,method,cpu", RUNNABLE)
@pytest.mark.parametrize("mr,nr,a_packed,K,valid,loadc", TILES)
def test_lowp_microkernel_matches_float64(dtype, method, cpu, mr, nr, a_packed, K, valid, loadc):
    epilogue = dict(bias=1, act="Relu") if loadc == 3 and mr == 12 else dict(bias=1, act="Clip", act_lo=-0.5,
                                                                               act_hi=2.0) if loadc == 3 else {}
    spec, nr = _spec(dtype, method, mr, nr, a_packed, cpu, **epilogue)
    got, ref, bound = run_tile(spec, cpu, K, min(valid, nr), loadc)
    assert_within_bound(got, ref, bound)


@pytest.mark.parametrize("mr,nr,a_packed,K,valid,loadc", TILES[:3] + TILES[4:5])
def test_fp16_microkernel_emulated(mr, nr, a_packed, K, valid, loadc):
    """The AVX512-FP16 kernel (float16 FMAs in chunks of 4, float32 sums of the chunks) against the
    float16 error bound: on a CPU with AVX512-FP16 its instructions, elsewhere (AMD Zen 4) LLVM's
    emulation of float16 arithmetic, which checks the layout, chunking and epilogue; the instructions
    are checked below by assembling for Sapphire Rapids."""
    if "avx512fp16" not in HOST_FEATURES and not HALF_ROUNDING_BOUND:
        pytest.skip("no AVX512-FP16, and no libgcc __truncdfhf2 for LLVM's float16 emulation")
    K = -(-K // 4) * 4                           # kc is a multiple of fp16_chunk
    nr = -(-nr // 32) * 32
    epilogue = dict(bias=1, act="Relu") if loadc == 3 else {}
    spec = LowpUKSpec(mr=mr, nr=nr, dtype="f16", method="fp16", a_packed=a_packed,
                      a_panel=mr + 2 if a_packed else 0, **epilogue)
    got, ref, bound = run_tile(spec, BF16, K, min(valid, nr), loadc)
    assert_within_bound(got, ref, bound)


def _instructions(ir: str, cpu: str, tmp_path) -> set:
    """The mnemonics of the object `ir` makes for `cpu` (objdump)."""
    import subprocess

    from backends.numba_cpu.hostjit import object_code
    path = tmp_path / "k.o"
    path.write_bytes(object_code(ir, cpu, vector_bits=512))
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                             check=True).stdout
    return {line.split()[1] for line in listing.splitlines() if line.startswith(" ") and len(line.split()) > 1}


@pytest.mark.parametrize("mr,nr", [(16, 16), (32, 32), (16, 32)])
def test_amx_microkernel_assembles(mr, nr, tmp_path):
    """AMX-BF16 (never run: no AMX here): the object configures tiles and multiplies in them, the C
    tiles staying in tile registers through the k loop (one tdpbf16ps per C tile per step)."""
    spec = LowpUKSpec(mr=mr, nr=nr, dtype="bf16", method="amx", a_packed=0, bias=1, act="Clip", act_lo=0.0,
                      act_hi=6.0)
    found = _instructions(lowp_ukernel_ir(spec, 512), "sapphirerapids", tmp_path)
    assert {"ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease"} <= found


@pytest.mark.parametrize("mr,nr,K,valid,loadc", [(16, 16, 64, 16, 0), (32, 32, 256, 29, 1), (16, 32, 32, 32, 3)])
def test_amx_microkernel_matches_float64(mr, nr, K, valid, loadc):
    """AMX-BF16 against the same bound as the other methods (tdpbf16ps: products exact, one rounding
    per addition). Runs only where the CPU has AMX and Linux grants the tile state."""
    from backends.numba_cpu.ukernel_amx import request_amx_permission
    if "amx-bf16" not in HOST_FEATURES or not request_amx_permission():
        pytest.skip(f"{HOST_CPU}: no AMX tile state for this process")
    epilogue = dict(bias=1, act="Relu") if loadc == 3 else {}
    spec = LowpUKSpec(mr=mr, nr=nr, method="amx", a_packed=0, **epilogue)
    got, ref, bound = run_tile(spec, BF16, K, valid, loadc)
    assert_within_bound(got, ref, bound)


def test_fp16_microkernel_assembles(tmp_path):
    """AVX512-FP16 (never run here): float16 FMAs on 32 lanes, widened into float32 sums."""
    spec = LowpUKSpec(mr=6, nr=64, dtype="f16", method="fp16", a_packed=1, a_panel=6)
    found = _instructions(lowp_ukernel_ir(spec, 512), "sapphirerapids", tmp_path)
    assert {"vfmadd231ph", "vcvtph2psx"} <= found


def test_dpbf16_microkernel_uses_vdpbf16ps(tmp_path):
    found = _instructions(lowp_ukernel_ir(LowpUKSpec(mr=6, nr=64, method="dpbf16", a_panel=6), 512), "znver4",
                          tmp_path)
    assert "vdpbf16ps" in found


def test_amx_permission_follows_the_cpu():
    """arch_prctl(ARCH_REQ_XCOMP_PERM) succeeds exactly where the CPU has AMX tiles."""
    from pathlib import Path

    from backends.numba_cpu.ukernel_amx import request_amx_permission
    assert request_amx_permission() == ("amx_tile" in Path("/proc/cpuinfo").read_text())


def test_default_methods_follow_the_target_features():
    from backends.numba_cpu.lowp_targets import LOWP_TARGETS
    from backends.targets import TARGETS
    from backends.numba_cpu.ukernel_lowp import method_for
    from backends.numba_cpu.lowp import best_method
    got = {name: (method_for("bf16", t), method_for("f16", t), best_method("f32", "f16", t))
           for name, t in {**TARGETS, **LOWP_TARGETS}.items()}
    assert set(LOWP_TARGETS) <= set(TARGETS)
    # AArch64 converts half <-> single in NEON (FCVTL / FCVTN: F16C's equivalent); baseline x86-64
    # (the Windows DLL) and WebAssembly SIMD128 have no such conversion
    assert got == {"generic": ("widen", None, "exact"), "x86_64-avx2": ("widen", "f16c", "hw"),
                   "x86_64-avx512": ("widen", "f16c", "hw"), "x86_64-znver4": ("dpbf16", "f16c", "hw"),
                   "x86_64-sapphirerapids": ("dpbf16", "f16c", "hw"),
                   "aarch64-linux": ("widen", "f16c", "hw"), "aarch64-neon-fp16-dotprod": ("widen", "f16c", "hw"),
                   "x86_64-windows": ("widen", None, "exact"), "wasm32": ("widen", None, "exact")}


def test_specs_round_trip_through_their_comment_lines():
    """What ukernel.specs_in needs to find these kernels in a kernel's source: kind -> spec, same name."""
    import json

    from backends.numba_cpu.ukernel_lowp import kinds, ukernel_lowp_ir
    for spec in (LowpUKSpec(mr=6, nr=64, method="dpbf16", a_panel=6, bias=1, act="Relu"), CvtSpec("f32", "bf16"),
                 PairCvtSpec("hw")):
        name, blob = spec.comment().split(" ", 3)[2:]
        again = kinds()[json.loads(blob)["kind"]](json.loads(blob))
        assert again == spec and again.name == name and f"@{name}(" in ukernel_lowp_ir(again, 512)


def test_numba_kernel_calls_the_lowp_kernels():
    """A generated Numba kernel calls the micro-kernels through their declarations (uint16 pointers
    for bf16 data), as the GEMM drivers call UKSpec: here it converts float32 X into bf16 rows and
    multiplies them by VNNI-packed W. Compiled by Numba, linked with the kernels' IR, run."""
    import llvmlite.binding as llvm
    from numba import cfunc, types
    M, K, N = 7, 64, 64
    cvt = CvtSpec("f32", "bf16")
    main, edge = (LowpUKSpec(mr=mr, nr=N, method="dpbf16", a_packed=0) for mr in (6, 1))
    source = cvt.declaration("cvt") + main.declaration("uk6") + edge.declaration("uk1") + f"""
def kernel(x, w, a16, y, begin, end):
    cvt(x, 0, a16, 0, {M * K})
    for i in range(0, {M - M % 6}, 6):
        uk6(a16, i * {K}, {K}, w, 0, {2 * N}, y, i * {N}, {N}, {K // 2}, -1, 0, y, 0)
    uk1(a16, {(M - 1) * K}, {K}, w, 0, {2 * N}, y, {(M - 1) * N}, {N}, {K // 2}, -1, 0, y, 0)
"""
    placeholder = ctypes.CFUNCTYPE(ctypes.c_int32)(lambda: 0)
    for spec in (cvt, main, edge):
        llvm.add_symbol(spec.name, ctypes.cast(placeholder, ctypes.c_void_p).value)
    namespace = {}
    exec(source, namespace)
    p = lambda t: types.CPointer(t)
    compiled = cfunc(types.void(p(types.float32), p(types.uint16), p(types.uint16), p(types.float32), types.int64,
                                types.int64), nopython=True, error_model="numpy")(namespace["kernel"])
    jit = HostJit(*cpu_for(BF16), vector_bits=512)
    for spec in (cvt, main, edge):
        jit.add(cvt_ir(spec, 512) if spec is cvt else lowp_ukernel_ir(spec, 512))
    jit.add(compiled.inspect_llvm())
    run = jit.function(compiled.native_name, None, *[ctypes.c_void_p] * 4, ctypes.c_int64, ctypes.c_int64)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    packed = pack_b_pairs(bf16_bits(w), N)
    a16 = np.zeros(M * K, np.uint16)
    y = np.zeros((M, N), np.float32)
    run(x.ctypes.data, packed.ctypes.data, a16.ctypes.data, y.ctypes.data, 0, 1)
    x64, w64 = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (x, w))
    assert (a16 == bf16_bits(x).ravel()).all()
    assert_within_bound(y.astype(np.float64), x64 @ w64, gamma(K + 1) * (np.abs(x64) @ np.abs(w64)))


@pytest.mark.parametrize("dtype,method,cpu", [("bf16", "dpbf16", BF16), ("bf16", "widen", "haswell"),
                                              ("bf16", "widen", "x86-64"), ("f16", "f16c", BF16)])
def test_lowp_microkernel_conv_taps(dtype, method, cpu):
    """A 3x3 conv's taps over a padded input (as UKSpec's taps): bf16 activations with channel pairs
    interleaved, 5 channels (the sixth a zero pad), C (+)= sum_{c, t} W(i, c, t) X(c, off[t] + j)."""
    rng = np.random.default_rng(7)
    mr, C, Wp, valid = 4, 5, 40, 29
    lanes = 16 if method == "dpbf16" else CPUS[cpu] // 32
    nr = -(-32 // lanes) * lanes
    taps = tuple(dy * Wp + dx for dy in range(3) for dx in range(3))
    T, P, plane = len(taps), mr + 2, 3 * Wp + nr
    to_bits, to_value = (bf16_bits, ml_dtypes.bfloat16) if dtype == "bf16" else (f16_bits, np.float16)
    x16 = to_bits(rng.standard_normal((C, plane)).astype(np.float32))
    w16 = to_bits(rng.standard_normal((mr, C, T)).astype(np.float32))
    x64, w64 = x16.view(to_value).astype(np.float64), w16.view(to_value).astype(np.float64)
    if dtype == "bf16":
        C2 = -(-C // 2)
        xp = np.zeros((2 * C2, plane), np.uint16)
        xp[:C] = x16
        b = np.ascontiguousarray(xp.reshape(C2, 2, plane).transpose(0, 2, 1)).ravel()     # (C/2, plane, 2)
        wp = np.zeros((P, 2 * C2, T), np.uint16)
        wp[:mr, :C] = w16
        a = np.ascontiguousarray(wp.reshape(P, C2, 2, T).transpose(1, 3, 0, 2)).ravel()  # [cp, t, i, h]
        kc, ldb, k_steps = C2, 2 * plane, 2 * C2 * T
    else:
        b = x16.ravel()
        wp = np.zeros((P, C, T), np.uint16)
        wp[:mr] = w16
        a = np.ascontiguousarray(wp.transpose(1, 2, 0)).ravel()                          # [c, t, i]
        kc, ldb, k_steps = C, plane, C * T
    spec = LowpUKSpec(mr=mr, nr=nr, dtype=dtype, method=method, a_packed=1, a_panel=P, taps=taps, bias=1,
                      act="Relu")
    fn = kernel(spec, cpu)
    c = rng.standard_normal((mr, nr)).astype(np.float32)
    c0 = c.astype(np.float64)
    bias = rng.standard_normal(mr).astype(np.float32)
    fn(a.ctypes.data, 0, 0, b.ctypes.data, 0, ldb, c.ctypes.data, 0, nr, kc, (1 << valid) - 1, 3,
       bias.ctypes.data, 0)
    windows = np.stack([x64[:, off:off + valid] for off in taps], axis=1)             # (C, T, valid)
    exact = c0[:, :valid] + np.einsum("ict,ctj->ij", w64, windows) + bias[:, None]
    magnitude = np.abs(c0[:, :valid]) + np.einsum("ict,ctj->ij", np.abs(w64), np.abs(windows)) + np.abs(bias[:, None])
    assert_within_bound(c[:, :valid].astype(np.float64), np.maximum(exact, 0), error_bound(spec, k_steps, magnitude))
    assert (c[:, valid:] == c0[:, valid:]).all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype,method,cpu", RUNNABLE)
def test_lowp_microkernel_every_tile_shape(dtype, method, cpu):
    """Every mr 1..12 with every nr the lanes allow (the accumulator chunking differs for each), K = 4096."""
    lanes = 16 if method == "dpbf16" else CPUS[cpu] // 32
    for mr in range(1, 13):
        for nr in range(lanes, 65, lanes):
            spec = LowpUKSpec(mr=mr, nr=nr, dtype=dtype, method=method, a_packed=mr % 2, a_panel=mr if mr % 2 else 0)
            got, ref, bound = run_tile(spec, cpu, 4096 if mr == 6 else 65, nr - 1, 1, seed=mr * 100 + nr)
            assert_within_bound(got, ref, bound)


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_nan_free_bf16_rounding_is_the_exact_rounding_bit_for_bit(cpu):
    """ukernel_lowp._bf16_rne_not_nan (LowpOut16Spec's rounding after Relu) against ml_dtypes on every
    non-NaN special value and 2^18 random non-NaN bit patterns (subnormals, ties, overflow to inf)."""
    from backends.numba_cpu.ukernel import IRBuilder
    from backends.numba_cpu.ukernel_lowp import _bf16_rne_not_nan
    ir = IRBuilder()
    ir.label("entry")
    ir("br label %loop")
    ir.label("loop")
    ir("%i = phi i64 [ 0, %entry ], [ %i1, %loop ]")
    ir("%sp = getelementptr <16 x i32>, ptr %src, i64 %i")
    ir("%bits = load <16 x i32>, ptr %sp, align 4")
    out = _bf16_rne_not_nan(ir, "%bits", 16)
    ir("%dp = getelementptr <16 x i16>, ptr %dst, i64 %i")
    ir(f"store <16 x i16> {out}, ptr %dp, align 2")
    ir("%i1 = add i64 %i, 1")
    ir("%more = icmp slt i64 %i1, %n")
    ir("br i1 %more, label %loop, label %done")
    ir.label("done")
    ir("ret void")
    name = "test_bf16_rne_not_nan"
    jit = jit_for(cpu)
    if not jit.has(name):
        jit.add(f"define void @{name}(ptr %src, ptr %dst, i64 %n) {{\n" + "\n".join(ir.lines) + "\n}\n")
    fn = jit.function(name, None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    bits = random_f32_bits()
    bits = bits[~is_nan32(bits)]
    bits = np.concatenate([bits, np.zeros(-len(bits) % 16, np.uint32)])
    got = np.zeros(len(bits), np.uint16)
    fn(bits.ctypes.data, got.ctypes.data, len(bits) // 16)
    want = expected_narrowing(bits, "bf16")
    bad = np.flatnonzero(got != want)
    assert not len(bad), [(hex(bits[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]
