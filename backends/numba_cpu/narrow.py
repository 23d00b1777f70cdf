"""Narrow and odd element types in kernels: bool, float16, bfloat16, the float8
and float4 formats, int4/uint4/int2/uint2.

Numba has no types for them, so a kernel's pointer to such a tensor is an
unsigned integer of its width (`pointer_type`), values are widened on load
and narrowed on store (`load` / `store` write the source), and the helper
functions those calls name (`BIT_HELPERS`, integer arithmetic on the bits:
exact, round to nearest even, NaN-safe under fastmath) are prepended to a
kernel's source by `with_helpers`. The conversions match numpy / ml_dtypes
bit for bit (tests/test_ops_indexing.py checks every code of each format).
"""
from __future__ import annotations

import numpy as np

# Numba's CPointer(boolean) loads an i8 but stores an i1 (an LLVM type error),
# so kernels see bool tensors as uint8 bytes; the graph dtype stays bool.
# Narrow floats compute in float32; int4/uint4/int2/uint2 (one value per byte,
# as numpy holds them) in int64. name: (pointer type, load helper, store helper).
SMALL_FLOATS = {
    "float16": ("uint16", "f16_to_f32", "f32_to_f16"),
    "bfloat16": ("uint16", "bf16_to_f32", "f32_to_bf16"),
    "float8_e5m2": ("uint8", "e5m2_to_f32", "f32_to_e5m2"),
    "float8_e4m3fn": ("uint8", "e4m3fn_to_f32", "f32_to_e4m3fn"),
    "float8_e4m3fnuz": ("uint8", "e4m3fnuz_to_f32", "f32_to_e4m3fnuz"),
    "float8_e5m2fnuz": ("uint8", "e5m2fnuz_to_f32", "f32_to_e5m2fnuz"),
    "float4_e2m1fn": ("uint8", "e2m1fn_to_f32", "f32_to_e2m1fn"),
    "float8_e8m0fnu": ("uint8", "e8m0_to_f32", "f32_to_e8m0"),
}
# The float8 and float4 stores take Cast's `saturate` flag.
_SATURATING = {"float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn"}
SMALL_INTS = {"int4": (4, True), "uint4": (4, False), "int2": (2, True), "uint2": (2, False)}


def _small_float(dtype):
    return SMALL_FLOATS.get(np.dtype(dtype).name)


def is_narrow(dtype) -> bool:
    """A type kernels only reach through load/store (float16, bfloat16, float8, float4, int4...)."""
    name = np.dtype(dtype).name
    return name in SMALL_FLOATS or name in SMALL_INTS


def pointer_type(dtype) -> str:
    """The numpy dtype name a kernel's pointer to values of `dtype` has."""
    dtype = np.dtype(dtype)
    if _small_float(dtype):
        return _small_float(dtype)[0]
    if dtype.name in SMALL_INTS:
        return "uint8"
    return "uint8" if dtype.kind == "b" else dtype.name


def compute_type(dtype) -> np.dtype:
    """The type a kernel computes values of `dtype` in (narrow floats in float32, narrow ints in int64)."""
    dtype = np.dtype(dtype)
    if _small_float(dtype):
        return np.dtype(np.float32)
    return np.dtype(np.int64) if dtype.name in SMALL_INTS else dtype


def load(pointer: str, index: str, dtype) -> str:
    """Source reading one element; bools come back as Numba booleans, narrow types widened."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return f"{pointer}[{index}] != np.uint8(0)"
    if _small_float(dtype):
        return f"{_small_float(dtype)[1]}({pointer}[{index}])"
    if dtype.name in SMALL_INTS:
        bits, signed = SMALL_INTS[dtype.name]
        return f"intn_load({pointer}[{index}], {bits}, {signed})"
    return f"{pointer}[{index}]"


_ROUND_MODES = {"up": 0, "down": 1, "nearest": 2}


def store(pointer: str, index: str, value: str, dtype, saturate: bool = True, value_dtype=None,
          round_mode: str = "up") -> str:
    """Source writing one element, converted to dtype (bools as one 0/1 byte;
    float8/float4 saturate out-of-range values to their largest finite value
    unless saturate=False, as Cast's `saturate` attribute says; a float stored
    into int4 etc. truncates, out of range giving 0, as ml_dtypes does)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return f"{pointer}[{index}] = np.uint8(1) if ({value}) else np.uint8(0)"
    if dtype.name == "float8_e8m0fnu":  # a power of two, rounded as Cast's round_mode says
        return f"{pointer}[{index}] = f32_to_e8m0({value}, {bool(saturate)}, {_ROUND_MODES[round_mode]})"
    if dtype.name in _SATURATING:
        return f"{pointer}[{index}] = {_small_float(dtype)[2]}({value}, {bool(saturate)})"
    if _small_float(dtype):
        return f"{pointer}[{index}] = {_small_float(dtype)[2]}({value})"
    if dtype.name in SMALL_INTS:
        bits, signed = SMALL_INTS[dtype.name]
        source = compute_type(value_dtype if value_dtype is not None else dtype)
        helper = "intn_from_float" if source.kind == "f" else "intn_from_int"
        return f"{pointer}[{index}] = {helper}({value}, {bits}, {signed})"
    return f"{pointer}[{index}] = np.{dtype.name}({value})"


def store_exact(pointer: str, index: str, value: str, dtype) -> str:
    """`store` of a value known to be exactly representable in dtype (a MaxPool's maximum of
    dtype values): bfloat16 is then the top half of the float32 bits, no rounding to do (a shift
    LLVM vectorises, where the rounding helper branches)."""
    if np.dtype(dtype).name == "bfloat16":
        return f"{pointer}[{index}] = np.uint16(_f32_bits(np.float32({value})) >> 16)"
    return store(pointer, index, value, dtype)


# float16 <-> float32/64 by integer arithmetic on the bits (exact, round to
# nearest even, NaN-safe under fastmath; checked against numpy in the tests).
BIT_HELPERS = '''from llvmlite import ir as _ir
from numba import njit, types as _types
from numba.extending import intrinsic


@intrinsic
def _f64_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _ir.IntType(64))
    return _types.int64(_types.float64), codegen


@intrinsic
def _f32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], _ir.IntType(32)), _ir.IntType(64))
    return _types.int64(_types.float32), codegen


@intrinsic
def _f32_from_bits(typingctx, b):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], _ir.IntType(32)), _ir.FloatType())
    return _types.float32(_types.int64), codegen


@njit(inline="always")
def f16_to_f32(h):
    h = np.int64(h)
    sign = (h & 32768) << 16
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        if m == 0:
            return _f32_from_bits(sign)
        e = 113
        while (m & 1024) == 0:
            m <<= 1
            e -= 1
        return _f32_from_bits(sign | (e << 23) | ((m & 1023) << 13))
    if e == 31:
        return _f32_from_bits(sign | 2139095040 | (m << 13))
    return _f32_from_bits(sign | ((e + 112) << 23) | (m << 13))


@njit(inline="always")
def f32_to_f16(x):
    b = _f64_bits(np.float64(x))
    sign = np.uint16(32768) if b < 0 else np.uint16(0)
    e = (b >> 52) & 2047
    m = b & 4503599627370495
    if e == 2047:
        return sign | np.uint16(31744 | (512 if m != 0 else 0))
    ee = e - 1008
    if ee >= 31:
        return sign | np.uint16(31744)
    if ee <= 0:
        if ee < -10:
            return sign
        mm = m | 4503599627370496
        shift = 43 - ee
        half = np.int64(1) << (shift - 1)
        r = mm >> shift
        rem = mm & ((np.int64(1) << shift) - 1)
        if rem > half or (rem == half and (r & 1) == 1):
            r += 1
        return sign | np.uint16(r)
    out = (ee << 10) | (m >> 42)
    rem = m & 4398046511103
    if rem > 2199023255552 or (rem == 2199023255552 and (out & 1) == 1):
        out += 1
    return sign | np.uint16(out)


@njit(inline="always")
def bf16_to_f32(h):
    return _f32_from_bits(np.int64(h) << 16)


@njit(inline="always")
def f32_to_bf16(x):
    b = _f64_bits(np.float64(np.float32(x)))
    sign = np.uint16(32768) if b < 0 else np.uint16(0)
    e = (b >> 52) & 2047
    m = b & 4503599627370495
    if e == 2047:
        return sign | np.uint16(32640 | (64 if m != 0 else 0))
    if e == 0:
        return sign
    ee = e - 896
    if ee <= 0:
        if ee < -7:
            return sign
        mm = m | 4503599627370496
        shift = 46 - ee
        half = np.int64(1) << (shift - 1)
        r = mm >> shift
        rem = mm & ((np.int64(1) << shift) - 1)
        if rem > half or (rem == half and (r & 1) == 1):
            r += 1
        return sign | np.uint16(r)
    out = (ee << 7) | (m >> 45)
    rem = m & 35184372088831
    if rem > 17592186044416 or (rem == 17592186044416 and (out & 1) == 1):
        out += 1
    return sign | np.uint16(out)


@njit(inline="always")
def _pow2(k):
    v = 1.0
    while k >= 60:
        v *= 1152921504606846976.0
        k -= 60
    while k <= -60:
        v /= 1152921504606846976.0
        k += 60
    return v * (np.float64(np.int64(1) << k) if k >= 0 else 1.0 / np.float64(np.int64(1) << (-k)))


@njit(inline="always")
def _small_to_f32(c, E, M, BIAS, KIND):
    # KIND 0: IEEE-like (inf, NaNs); 1: "fn" (no inf, NaN = all ones); 2: "fnuz" (NaN = sign bit alone); 3: no inf/NaN
    c = np.int64(c)
    sign = (c >> (E + M)) & 1
    e = (c >> M) & ((1 << E) - 1)
    m = c & ((1 << M) - 1)
    if KIND == 0 and e == (1 << E) - 1:
        v = np.float64(np.inf) if m == 0 else np.float64(np.nan)
    elif KIND == 1 and e == (1 << E) - 1 and m == (1 << M) - 1:
        v = np.float64(np.nan)
    elif KIND == 2 and sign == 1 and e == 0 and m == 0:
        return np.float32(np.nan)
    elif e == 0:
        v = np.float64(m) * _pow2(1 - BIAS - M)
    else:
        v = np.float64(m + (1 << M)) * _pow2(e - BIAS - M)
    return np.float32(-v if sign == 1 else v)


@njit(inline="always")
def _f32_to_small(x, E, M, BIAS, MAXCODE, KIND, saturate):
    b = _f64_bits(np.float64(x))
    sign = 1 if b < 0 else 0
    sbit = 1 << (E + M)
    e = (b >> 52) & 2047
    m = b & 4503599627370495
    if e == 2047:
        if m != 0:
            if KIND == 0:
                return np.uint8(MAXCODE + 3 + sign * sbit)
            if KIND == 1:
                return np.uint8((sbit - 1) + sign * sbit)
            if KIND == 3:  # no NaN: ml_dtypes gives a zero of the opposite sign
                return np.uint8((1 - sign) * sbit)
            return np.uint8(sbit)
        if saturate or KIND == 3:
            return np.uint8(MAXCODE + sign * sbit)
        if KIND == 0:
            return np.uint8(MAXCODE + 1 + sign * sbit)
        if KIND == 1:
            return np.uint8((sbit - 1) + sign * sbit)
        return np.uint8(sbit)
    ee = e - 1023 + BIAS
    if ee <= 0:
        shift = 53 - M - ee
        if shift > 53:
            code = np.int64(0)
        else:
            mm = m | 4503599627370496
            half = np.int64(1) << (shift - 1)
            code = mm >> shift
            rem = mm & ((np.int64(1) << shift) - 1)
            if rem > half or (rem == half and (code & 1) == 1):
                code += 1
    else:
        code = (ee << M) | (m >> (52 - M))
        rem = m & ((np.int64(1) << (52 - M)) - 1)
        half = np.int64(1) << (51 - M)
        if rem > half or (rem == half and (code & 1) == 1):
            code += 1
    if code > MAXCODE:
        if saturate or KIND == 3:
            code = MAXCODE
        elif KIND == 0:
            code = MAXCODE + 1
        elif KIND == 1:
            code = sbit - 1
        else:
            return np.uint8(sbit)
    if code == 0 and KIND == 2:
        return np.uint8(0)
    return np.uint8(code + sign * sbit)


@njit(inline="always")
def e5m2_to_f32(c):
    return _small_to_f32(c, 5, 2, 15, 0)


@njit(inline="always")
def f32_to_e5m2(x, saturate):
    return _f32_to_small(x, 5, 2, 15, 123, 0, saturate)


@njit(inline="always")
def e4m3fn_to_f32(c):
    return _small_to_f32(c, 4, 3, 7, 1)


@njit(inline="always")
def f32_to_e4m3fn(x, saturate):
    return _f32_to_small(x, 4, 3, 7, 126, 1, saturate)


@njit(inline="always")
def e4m3fnuz_to_f32(c):
    return _small_to_f32(c, 4, 3, 8, 2)


@njit(inline="always")
def f32_to_e4m3fnuz(x, saturate):
    return _f32_to_small(x, 4, 3, 8, 127, 2, saturate)


@njit(inline="always")
def e5m2fnuz_to_f32(c):
    return _small_to_f32(c, 5, 2, 16, 2)


@njit(inline="always")
def f32_to_e5m2fnuz(x, saturate):
    return _f32_to_small(x, 5, 2, 16, 127, 2, saturate)


@njit(inline="always")
def e2m1fn_to_f32(c):
    return _small_to_f32(c, 2, 1, 1, 3)


@njit(inline="always")
def f32_to_e2m1fn(x, saturate):
    return _f32_to_small(x, 2, 1, 1, 7, 3, saturate)


@njit(inline="always")
def e8m0_to_f32(c):
    c = np.int64(c)
    if c == 255:
        return np.float32(np.nan)
    return np.float32(_pow2(c - 127))


@njit(inline="always")
def f32_to_e8m0(x, saturate, mode):
    # the float32 exponent field, rounded by the fraction (mode 0: up, 1: down, 2: nearest)
    b = _f32_bits(np.float32(x))
    e = (b >> 23) & 255
    if e == 255:
        return np.uint8(255)
    f = b & 8388607
    up = False
    if mode == 0:
        up = f > 0
    elif mode == 2:
        g = (b & 4194304) > 0
        r = (b & 2097152) > 0
        st = (b & 2097151) > 0
        up = g and (r or st or e > 0)
    if up and saturate and e == 254:
        up = False
    if up:
        e += 1
    return np.uint8(e & 255)


@njit(inline="always")
def intn_load(c, bits, signed):
    v = np.int64(c) & ((1 << bits) - 1)
    if signed and v >= (1 << (bits - 1)):
        v -= 1 << bits
    return v


@njit(inline="always")
def intn_from_int(v, bits, signed):
    return np.uint8(np.int64(v) & ((1 << bits) - 1))


@njit(inline="always")
def intn_from_float(x, bits, signed):
    lo = -(1 << (bits - 1)) if signed else 0
    hi = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
    if is_nan(x) or is_inf(x) or not (np.float64(x) > np.float64(lo - 1) and np.float64(x) < np.float64(hi + 1)):
        return np.uint8(0)
    return np.uint8(np.int64(x) & ((1 << bits) - 1))


@njit(inline="always")
def is_nan(x):
    return (_f64_bits(np.float64(x)) & 9223372036854775807) > 9218868437227405312


@njit(inline="always")
def is_inf(x):
    return (_f64_bits(np.float64(x)) & 9223372036854775807) == 9218868437227405312


'''


# float32 -> bf16 bits, round to nearest even, as a select LLVM vectorises (lowp.py's "exact"
# formula; a NaN stays a quiet NaN): f32_to_bf16 above branches, one value at a time.
BF16_RNE = '''

@njit(inline="always")
def bf16_rne(x):
    b = _f32_bits(np.float32(x))
    r = (b + 32767 + ((b >> 16) & 1)) >> 16
    return ((b >> 16) | 64) if (b & 2147483647) > 2139095040 else r

'''


# The same conversions as 32-bit lane operations, for the loops LLVM vectorises (bf16 Winograd's
# transforms): BF16_RNE's bits come from _f32_bits as an int64, and its int64 adds, shifts and
# compares made those loops 8 lanes of 64 bits, half the vector, the float32 work with them.
# Here every operation is on i32 (no value needs more: b + 0x8000 < 2^32 for every b that is not a
# NaN, and a NaN takes the other branch), so a loop of them is 16 lanes; the results are
# bf16_rne's, bit for bit (tests/test_precision_winograd.py checks every class of input).
BF16_LANES = '''

@intrinsic
def bf16_pair_rne(typingctx, lo, hi):
    """float32 lo, hi -> one uint32 word: bf16_rne(lo) in the low half, bf16_rne(hi) in the high."""
    def codegen(context, builder, signature, args):
        i32 = _ir.IntType(32)
        k = lambda v: _ir.Constant(i32, v)
        out = []
        for x in args:
            b = builder.bitcast(x, i32)
            top = builder.lshr(b, k(16))
            r = builder.add(builder.add(b, k(32767)), builder.and_(top, k(1)))
            nan = builder.icmp_unsigned(">", builder.and_(b, k(2147483647)), k(2139095040))
            out.append((b, top, r, nan))
        (b0, top0, r0, nan0), (b1, top1, r1, nan1) = out
        lo_bits = builder.select(nan0, builder.or_(top0, k(64)), builder.lshr(r0, k(16)))
        hi_bits = builder.select(nan1, builder.or_(builder.and_(b1, k(-65536)), k(4194304)),
                                 builder.and_(r1, k(-65536)))
        return builder.or_(hi_bits, lo_bits)
    return _types.uint32(_types.float32, _types.float32), codegen


@intrinsic
def bf16_rne16(typingctx, x):
    """float32 -> its bf16 bits (bf16_rne) as a uint16."""
    def codegen(context, builder, signature, args):
        i32 = _ir.IntType(32)
        k = lambda v: _ir.Constant(i32, v)
        b = builder.bitcast(args[0], i32)
        top = builder.lshr(b, k(16))
        r = builder.lshr(builder.add(builder.add(b, k(32767)), builder.and_(top, k(1))), k(16))
        nan = builder.icmp_unsigned(">", builder.and_(b, k(2147483647)), k(2139095040))
        return builder.trunc(builder.select(nan, builder.or_(top, k(64)), r), _ir.IntType(16))
    return _types.uint16(_types.float32), codegen


@intrinsic
def pair_lo_f32(typingctx, w):
    """The low bf16 of a uint32 pair word, widened (exact)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(args[0], _ir.Constant(_ir.IntType(32), 16)), _ir.FloatType())
    return _types.float32(_types.uint32), codegen


@intrinsic
def pair_hi_f32(typingctx, w):
    """The high bf16 of a uint32 pair word, widened (exact)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.and_(args[0], _ir.Constant(_ir.IntType(32), -65536)), _ir.FloatType())
    return _types.float32(_types.uint32), codegen


@intrinsic
def pair_join(typingctx, a, b, high):
    """A channel-pair word from two words of bf16 column pairs (one channel's each): the low
    halves of a and b (high == 0) or their high halves (high == 1), a's in the low half."""
    def codegen(context, builder, signature, args):
        i32 = _ir.IntType(32)
        k = lambda v: _ir.Constant(i32, v)
        if signature.args[2].literal_value:
            return builder.or_(builder.lshr(args[0], k(16)), builder.and_(args[1], k(-65536)))
        return builder.or_(builder.and_(args[0], k(65535)), builder.shl(args[1], k(16)))
    if not isinstance(high, _types.IntegerLiteral):
        return None
    return _types.uint32(_types.uint32, _types.uint32, high), codegen


@intrinsic
def bf16_widen(typingctx, h):
    """bf16 bits (uint16) -> float32 (exact)."""
    def codegen(context, builder, signature, args):
        w = builder.shl(builder.zext(args[0], _ir.IntType(32)), _ir.Constant(_ir.IntType(32), 16))
        return builder.bitcast(w, _ir.FloatType())
    return _types.float32(_types.uint16), codegen

'''


def with_bf16_lanes(source: str) -> str:
    """Kernel source with BF16_LANES' 32-bit lane conversions (bf16_pair_rne, bf16_rne16,
    pair_lo_f32, pair_hi_f32, pair_join, bf16_widen) defined before it."""
    return BIT_HELPERS + BF16_LANES + source


def with_bf16_rounding(source: str) -> str:
    """Kernel source with `bf16_rne(x)` (the bf16 bits of float32 x, RNE, as an int64; vectorises),
    `_f32_bits` and `_f32_from_bits` defined before it."""
    return BIT_HELPERS + BF16_RNE + source


def with_helpers(source: str) -> str:
    """Kernel source with the helpers it calls (float16 conversions, NaN/inf tests) defined before it."""
    names = ("_f64_bits", "_f32_bits", "is_nan", "is_inf", "intn_load", "intn_from_int", "intn_from_float") + \
        tuple(n for _, *conv in SMALL_FLOATS.values() for n in conv)
    if any(f"{name}(" in source for name in names):
        return BIT_HELPERS + source
    return source
