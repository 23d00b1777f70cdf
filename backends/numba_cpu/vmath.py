"""Vectorisable float32 exp, log, sigmoid, tanh and erf for kernel source.

`math.exp` & co. in a Numba loop are scalar libm calls, so LLVM cannot
vectorise the loop around them. These functions are Numba intrinsics that
expand to straight-line LLVM IR (range reduction, a polynomial, the exponent
built from its bits): inlined in a loop, the loop vectoriser turns them into
16-wide AVX-512 code. For float64 arguments they are the libm functions.

Kernel source calls them by name: `vexp(a)`, `vlog(a)`, `vsigmoid(a)`, `vtanh(a)`,
`verf(a)`, and `vmax(a, b)` for a max reduction that vectorises (emit.py puts
them in every kernel's namespace).

Accuracy (float32): exp and sigmoid within a few ulp (inputs below -87 give
e^-87 ~ 1.6e-38 rather than a smaller number); log within a few ulp (Cephes' logf
polynomial), with log(0) = -inf, log(x < 0) = NaN, log(inf) = inf, NaN -> NaN and
subnormal inputs exact to the same few ulp (the special cases are picked on the bits, which
fast-math does not reason about); tanh within 4e-7 and erf within 1e-7 absolute (rational
approximations, as Eigen's fast float ones).
"""
from __future__ import annotations

import math

from llvmlite import ir
from numba.core import types
from numba.core.extending import intrinsic, overload

_F = ir.FloatType()
_I = ir.IntType(32)

LOG2E = 1.44269504088896341
LN2_HI = 0.693359375
LN2_LO = -2.12194440e-4
EXP_LO, EXP_HI = -87.0, 88.72283   # e^x stays a normal float32 on this range
# Cephes expf polynomial: exp(r) ~ 1 + r + r^2 * P(r) on |r| <= ln2/2.
EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
# Cephes logf: log(1 + f) ~ f - f^2/2 + f^3 * P(f) on sqrt(1/2) - 1 <= f < sqrt(2) - 1.
LOG_P = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
         -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)
SQRT_HALF_BITS = 0x3F3504F3   # sqrt(1/2) as float32 bits: mantissas are taken in [sqrt(1/2), sqrt(2))
# Rational approximations (Eigen's fast float tanh and erf): f(x) = x * P(x^2) / Q(x^2) on a clamped range.
TANH_CLAMP = 7.90531110763549805
TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
          1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
ERF_CLAMP = 4.0
ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
         -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
         -1.42647390514189e-02)


def _c(v):
    return ir.Constant(_F, float(v))


def _call(builder, name, *args):
    module = builder.module
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(_F, [_F] * len(args)), name=name)
    return builder.call(fn, args)


def _fma(builder, a, b, c):
    return _call(builder, "llvm.fma.f32", a, b, c)


def _clamp(builder, x, lo, hi):
    return _call(builder, "llvm.minnum.f32", _call(builder, "llvm.maxnum.f32", x, _c(lo)), _c(hi))


def _exp_ir(builder, x):
    """exp(x) for float32 x, as straight-line IR: x = n ln2 + r, e^r by a polynomial,
    then n added to its exponent bits (no multiply a fast-math pass could reassociate)."""
    x = _clamp(builder, x, EXP_LO, EXP_HI)
    n = _call(builder, "llvm.floor.f32", _fma(builder, x, _c(LOG2E), _c(0.5)))
    r = _fma(builder, n, _c(-LN2_HI), x)
    r = _fma(builder, n, _c(-LN2_LO), r)
    p = _c(EXP_P[0])
    for coef in EXP_P[1:]:
        p = _fma(builder, p, r, _c(coef))
    y = _fma(builder, p, builder.fmul(r, r), builder.fadd(r, _c(1.0)))
    shift = builder.shl(builder.fptosi(n, _I), ir.Constant(_I, 23))
    return builder.bitcast(builder.add(builder.bitcast(y, _I), shift), _F)


def _log_ir(builder, x):
    """log(x) for float32 x, as straight-line IR (musl's and Cephes' logf): x = 2^k * m with m in
    [sqrt(1/2), sqrt(2)) taken from the bits, log(m) = log(1 + f) by a polynomial, plus k ln2 (in
    two parts). Subnormals are scaled by 2^23 first. The special cases (zero, negative, inf, NaN)
    are chosen by integer tests of the bits: fast-math lets LLVM assume no float is NaN or inf."""
    i32 = lambda v: ir.Constant(_I, v)
    bits = builder.bitcast(x, _I)
    tiny = builder.icmp_unsigned("<", bits, i32(0x00800000))          # +0 and positive subnormals
    scaled = builder.select(tiny, builder.fmul(x, _c(8388608.0)), x)  # * 2^23, exact
    ix = builder.add(builder.bitcast(scaled, _I), i32(0x3F800000 - SQRT_HALF_BITS))
    k = builder.sub(builder.ashr(ix, i32(23)), builder.select(tiny, i32(127 + 23), i32(127)))
    m = builder.bitcast(builder.add(builder.and_(ix, i32(0x007FFFFF)), i32(SQRT_HALF_BITS)), _F)
    f = builder.fsub(m, _c(1.0))
    kf = builder.sitofp(k, _F)
    z = builder.fmul(f, f)
    p = _c(LOG_P[0])
    for coef in LOG_P[1:]:
        p = _fma(builder, p, f, _c(coef))
    y = builder.fmul(builder.fmul(f, z), p)
    y = _fma(builder, kf, _c(LN2_LO), y)
    y = _fma(builder, z, _c(-0.5), y)
    y = _fma(builder, kf, _c(LN2_HI), builder.fadd(f, y))
    # Special cases, on the bits: +-0 -> -inf, negative -> NaN, inf / NaN -> x.
    magnitude = builder.and_(bits, i32(0x7FFFFFFF))
    inf_nan = builder.icmp_unsigned(">=", magnitude, i32(0x7F800000))
    y = builder.select(inf_nan, x, y)
    negative = builder.icmp_signed("<", bits, i32(0))
    y = builder.select(negative, builder.bitcast(i32(0x7FC00000), _F), y)
    zero = builder.icmp_unsigned("==", magnitude, i32(0))
    return builder.select(zero, builder.bitcast(i32(0xFF800000 - (1 << 32)), _F), y)


def _sigmoid_ir(builder, x):
    e = _exp_ir(builder, builder.fsub(_c(0.0), x))
    return builder.fdiv(_c(1.0), builder.fadd(_c(1.0), e))


def _rational_odd(builder, x, clamp, P, Q):
    x = _clamp(builder, x, -clamp, clamp)
    x2 = builder.fmul(x, x)
    p = _c(P[0])
    for coef in P[1:]:
        p = _fma(builder, p, x2, _c(coef))
    q = _c(Q[0])
    for coef in Q[1:]:
        q = _fma(builder, q, x2, _c(coef))
    return builder.fdiv(builder.fmul(x, p), q)


def _tanh_ir(builder, x):
    return _rational_odd(builder, x, TANH_CLAMP, TANH_P, TANH_Q)


def _erf_ir(builder, x):
    return _rational_odd(builder, x, ERF_CLAMP, ERF_P, ERF_Q)


def _make_intrinsic(body):
    @intrinsic
    def fn(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return body(builder, args[0])
        return types.float32(types.float32), codegen
    return fn


_exp32 = _make_intrinsic(_exp_ir)
_log32 = _make_intrinsic(_log_ir)
_sigmoid32 = _make_intrinsic(_sigmoid_ir)
_tanh32 = _make_intrinsic(_tanh_ir)
_erf32 = _make_intrinsic(_erf_ir)


def vexp(x):
    return math.exp(x)


def vlog(x):
    return math.log(x)


def vsigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def vtanh(x):
    return math.tanh(x)


def verf(x):
    return math.erf(x)


def _dispatch(py_fn, f32_impl, generic):
    @overload(py_fn, inline="always")
    def _ov(x):
        if x == types.float32:
            return lambda x: f32_impl(x)
        return generic


@intrinsic
def _max32(typingctx, a, b):
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return _call(builder, "llvm.maxnum.f32", *args)
    return types.float32(types.float32, types.float32), codegen


def vmax(a, b):
    return max(a, b)


@overload(vmax, inline="always")
def _vmax(a, b):
    """max as llvm.maxnum for float32: a loop reducing with it vectorises (the select `a if a > b
    else b` that Numba makes of max() stays a scalar chain of vmaxss); either argument when one
    is NaN (the kernels' inputs are finite: fastmath already assumes so)."""
    if a == types.float32 and b == types.float32:
        return lambda a, b: _max32(a, b)
    return lambda a, b: max(a, b)


_dispatch(vexp, _exp32, lambda x: math.exp(x))
_dispatch(vlog, _log32, lambda x: math.log(x))
_dispatch(vsigmoid, _sigmoid32, lambda x: 1.0 / (1.0 + math.exp(-x)))
_dispatch(vtanh, _tanh32, lambda x: math.tanh(x))
_dispatch(verf, _erf32, lambda x: math.erf(x))

@intrinsic
def same_buffer(typingctx, a, b):
    """Whether two raw pointers are equal (kernels run in place when the memory planner says so)."""
    if not (isinstance(a, types.CPointer) and isinstance(b, types.CPointer)):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        return builder.icmp_unsigned("==", builder.ptrtoint(args[0], i64), builder.ptrtoint(args[1], i64))
    return types.boolean(a, b), codegen


NAMESPACE = {"vexp": vexp, "vlog": vlog, "vsigmoid": vsigmoid, "vtanh": vtanh, "verf": verf, "vmax": vmax, "same_buffer": same_buffer}
