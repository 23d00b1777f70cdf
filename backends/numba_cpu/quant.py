"""Linear quantisation (ONNX opsets 10-21): QuantizeLinear, DequantizeLinear,
DynamicQuantizeLinear, MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv.

    QuantizeLinear    q = saturate(rint(x / scale) + zero_point)   (round half to even)
    DequantizeLinear  x = (q - zero_point) * scale
    QLinear*          q = saturate(rint(acc * (s_a * s_b / s_y)) + zp_y),
                      acc = sum (a - zp_a) * (b - zp_b) in int32

Scale and zero point are per tensor, per `axis` (1-D) or, from opset 21, per
block of `block_size` along `axis`. Quantised outputs must equal onnxruntime's
exactly, so every rounding step is its: x / scale correctly rounded to float32
(which fast-math would not give; see `_exact_quotient`), int32 accumulation,
the requantisation multiply in float32 (float16 scales: each operation rounded
to float16, as ONNX's reference does). Constant weights are unpacked at build
time to int32 with their zero point subtracted (and transposed for
QLinearMatMul, so the dot product is unit-stride); multipliers and
reciprocals of constant scales are computed at build time.
"""
from __future__ import annotations

import numpy as np

from cuvil.errors import UnsupportedOpError

from . import qconv, qgemm
from .qconv import conv_pads, node_input
from .kernel import Kernel, KernelCall, Lowered, Source, broadcast_strides, dims_strides, kernel_header, literal
from .narrow import SMALL_FLOATS, SMALL_INTS, load, pointer_type, store, with_helpers

_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767)}
# QuantizeLinear/DequantizeLinear also take the narrow formats (opset 19+: float8, 21+: int4, 23+: float4,
# 25+: int2); kernels reach them through narrow.py's load/store.
_NARROW_INT_RANGES = {"int4": (-8, 7), "uint4": (0, 15), "int2": (-2, 1), "uint2": (0, 3)}
_SMALL_FLOATS = set(SMALL_FLOATS) - {"float16", "bfloat16", "float8_e8m0fnu"}
_QUANTIZED = set(_RANGES) | set(_NARROW_INT_RANGES) | _SMALL_FLOATS
_FLOATS = {"float32", "float64", "float16"}


def _unsupported(node, why):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}")


def _check(node, value, allowed):
    name = np.dtype(value.dtype).name
    if name not in allowed:
        raise _unsupported(node, f"dtype {name} of '{value.name}' is not supported ({', '.join(sorted(allowed))})")
    return np.dtype(value.dtype)


class _Args:
    """Kernel pointer arguments in order, with their dtypes."""

    def __init__(self):
        self.values, self.types = [], []

    def add(self, value, dtype) -> str:
        self.values.append(value)
        self.types.append(np.dtype(dtype).name)
        return f"p{len(self.values) - 1}"


# ---------------------------------------------------------------- QuantizeLinear / DequantizeLinear

def _param_layout(node, x_shape, scale):
    """How the scale (and zero point) is indexed: rows of `inner` contiguous elements of X, each
    with axis index a; returns (outer, A, inner, index expression of the row's parameter, per
    element offset or None)."""
    rank = len(x_shape)
    size = int(np.prod(x_shape, dtype=np.int64))
    if scale.size == 1 and int(node.attr("block_size", 0)) == 0:
        inner = x_shape[-1] if rank else 1
        return size // max(inner, 1), 1, inner, "0", False
    axis = int(node.attr("axis", 1))
    axis = axis + rank if axis < 0 else axis
    outer = int(np.prod(x_shape[:axis], dtype=np.int64))
    A = x_shape[axis]
    inner = int(np.prod(x_shape[axis + 1:], dtype=np.int64))
    block = int(node.attr("block_size", 0))
    if block == 0:
        if len(scale.shape) != 1 or scale.shape[0] != A:
            raise _unsupported(node, f"scale shape {scale.shape} is neither per-tensor nor per-axis for axis {axis} of {x_shape}")
        return outer, A, inner, "a", False
    Ab = -(-A // block)
    if len(scale.shape) != rank or scale.shape[axis] != Ab:
        raise _unsupported(node, f"scale shape {scale.shape} does not match block_size {block} on axis {axis} of {x_shape}")
    return outer, A, inner, f"(o*{Ab} + a // {block})*{inner}", True


def _rows_kernel(node, family, x, scale, zero, out, body, reciprocal=False):
    """A kernel over rows of X; `body(x_load)` is the stored value, over `s` (the scale) or, with
    `reciprocal`, `r` (1 / scale in float64, see `_exact_quotient`) and `z` (the zero point)."""
    outer, A, inner, pindex, per_element = _param_layout(node, x.shape, scale)
    args = _Args()
    px = args.add(x.name, pointer_type(x.dtype))
    if not reciprocal:
        ps = args.add(scale.name, pointer_type(scale.dtype))
        load_scale = [f"s = {load(ps, '{at}', scale.dtype)}"]
    elif scale.is_const:
        ps = args.add(np.ascontiguousarray(1.0 / np.asarray(scale.data, np.float64).reshape(-1)), np.float64)
        load_scale = [f"r = {ps}[{{at}}]"]
    elif np.dtype(scale.dtype).name == "float32":
        ps = args.add(scale.name, np.int32)  # its bits: see _exact_quotient
        load_scale = _float32_bits_to_float64(f"{ps}[{{at}}]", "sv") + ["r = np.float64(1) / sv"]
    else:
        ps = args.add(scale.name, pointer_type(scale.dtype))
        load_scale = [f"r = np.float64(1) / np.float64({load(ps, '{at}', scale.dtype)})"]
    pz = args.add(zero.name, pointer_type(zero.dtype)) if zero is not None else None
    py = args.add(out.name, pointer_type(out.dtype))
    # The zero point as int64, or float64 for the float8/float4 formats.
    zero_type = "float64" if zero is not None and np.dtype(zero.dtype).name in _SMALL_FLOATS else "int64"
    src = Source().line(kernel_header(len(args.values))).indent()
    src.line("for row in range(begin, end):").indent()
    src.line(f"o = row // {A}").line(f"a = row % {A}")
    src.line(f"pb = {pindex}")
    src.line(f"xb = row*{inner}")

    def load_params(at):
        for line in load_scale:
            src.line(line.format(at=at))
        src.line(f"z = np.{zero_type}({load(pz, at, zero.dtype)})" if pz else f"z = np.{zero_type}(0)")
    if not per_element:
        load_params("pb")
    src.line(f"for e in range({inner}):").indent()
    if per_element:
        load_params("pb + e")
    src.line(store(py, "xb + e", body(load(px, "xb + e", x.dtype)), out.dtype,
                   saturate=bool(node.attr("saturate", 1)), value_dtype=np.float64))
    kernel = Kernel(family, with_helpers(src.text()), tuple(args.types))
    return Lowered([KernelCall(kernel, list(args.values), outer * A, node.name)])


def _float32_bits_to_float64(bits, var) -> list[str]:
    """Lines setting `var` (float64) to the float32 whose bits are the int32 `bits`, built from
    integers so that fast-math cannot see it as a widened float32 (and shrink what uses it)."""
    one = "np.int64(1)"
    # value = mantissa * 2**t, the power of two as (exact) products of integer powers of two
    # (math.ldexp needs Numba's helper library, which kernels are not linked with).
    return [f"sb = np.int64({bits})", "se = (sb >> 23) & 255", "sm = sb & 8388607",
            "st = (1 if se == 0 else se) - 150",
            "sq = st if st >= 0 else -st",
            f"sp = np.float64({one} << min(sq, 62)) * np.float64({one} << min(max(sq - 62, 0), 62)) "
            f"* np.float64({one} << max(sq - 124, 0))",
            "sm2 = np.float64(sm if se == 0 else sm + 8388608)",
            f"{var} = sm2 * sp if st >= 0 else sm2 / sp",
            f"{var} = -{var} if sb < 0 else {var}"]


def _exact_quotient(x, dtype) -> str:
    """x / scale rounded to float32 as onnxruntime computes it (for float64, x * r), from `r`,
    the float64 reciprocal of the scale.

    Kernels compile with fast-math: a division by a loop-invariant scale becomes a multiplication
    by its float32 reciprocal, and `(float)((double)x / (double)s)` is shrunk back to a float
    division, so neither gives the correctly rounded quotient (ties then round the other way).
    A float64 product with a float64 reciprocal the compiler cannot trace back to a float32 (a
    constant table, or one built from the scale's bits) is not shrunk, and rounded to float32 it
    is the correctly rounded quotient: the exact quotient of two float32 numbers is a float32
    rounding midpoint only when the scale is a power of two (its reciprocal is then exact), and
    otherwise lies ~2**-49 or more (relative) from one, far more than the product's error."""
    if np.dtype(dtype).name == "float64":
        return f"(np.float64({x}) * r)"
    return f"np.float32(np.float64({x}) * r)"


def _saturate(expr, dtype):
    name = np.dtype(dtype).name
    if name in _NARROW_INT_RANGES:  # stored by narrow.store from an integral float64
        lo, hi = _NARROW_INT_RANGES[name]
        return f"min(max({expr}, {float(lo)}), {float(hi)})"
    lo, hi = _RANGES[name]
    return f"np.{name}(min(max({expr}, {float(lo)}), {float(hi)}))"


def lower_quantize_linear(node, graph) -> Lowered:
    x, scale, zero = (node_input(node, graph, k) for k in range(3))
    y = graph.values[node.outputs[0]]
    _check(node, x, {"float32", "float64"})
    _check(node, scale, {"float32", "float64"})
    _check(node, y, _QUANTIZED)
    if zero is not None:
        _check(node, zero, _QUANTIZED)
    if np.dtype(y.dtype).name in _SMALL_FLOATS:  # rounded to nearest even by the store, saturating as told
        def body(xv):
            return f"np.float32({_exact_quotient(xv, scale.dtype)} + z)"
    elif np.dtype(scale.dtype).name == "float32" and np.dtype(y.dtype).name in _RANGES:
        # The quotient is a float32 (rounded once, from float64); its rint, the zero point's sum and
        # the clamp stay in float32: 16 lanes a vector, not float64's 8. The sum is exact while
        # |rint(q)| < 2^24 - 65535, and past that it saturates at the same end either way.
        lo, hi = (literal(v, np.float32) for v in _RANGES[np.dtype(y.dtype).name])
        def body(xv):
            return (f"np.{np.dtype(y.dtype).name}(min(max(np.rint({_exact_quotient(xv, scale.dtype)}) + np.float32(z), "
                    f"{lo}), {hi}))")
    else:
        def body(xv):
            return _saturate(f"np.rint({_exact_quotient(xv, scale.dtype)}) + np.float64(z)", y.dtype)
    return _rows_kernel(node, "QuantizeLinear", x, scale, zero, y, body, reciprocal=True)


def lower_dequantize_linear(node, graph) -> Lowered:
    x, scale, zero = (node_input(node, graph, k) for k in range(3))
    y = graph.values[node.outputs[0]]
    _check(node, x, _QUANTIZED | {"int32"})
    _check(node, scale, _FLOATS)
    _check(node, y, _FLOATS)
    # float16 computes in float32 (float16 * float16 products are exact there) and is rounded once on store.
    ydt = "float32" if np.dtype(y.dtype).name == "float16" else np.dtype(y.dtype).name
    if np.dtype(x.dtype).name in _SMALL_FLOATS:
        def body(xv):
            return f"np.{ydt}(np.float64({xv}) - z) * s"
    else:
        def body(xv):
            return f"np.{ydt}(np.int64({xv}) - z) * s"
    return _rows_kernel(node, "DequantizeLinear", x, scale, zero, y, body)


def lower_dynamic_quantize_linear(node, graph) -> Lowered:
    """min/max over all of x (widened to include 0), scale = (max - min) / 255,
    zero point = saturate(rint(-min / scale)), then QuantizeLinear; one work item.

    The scale is rounded to float32 before x is divided by it (as onnxruntime does); for
    `_exact_quotient` the kernel reads its bits back through a second, int32, pointer to the
    y_scale output."""
    x = graph.values[node.inputs[0]]
    _check(node, x, {"float32"})
    outs = [graph.values[o] if o else None for o in node.outputs]
    if len(outs) < 3 or any(o is None for o in outs):
        raise _unsupported(node, "all three outputs (y, y_scale, y_zero_point) must be named")
    y, ys, yz = outs[:3]
    size = x.size
    f = lambda v: literal(v, np.float32)  # noqa: E731
    src = Source().line(kernel_header(5)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"lo = {f(0)}").line(f"hi = {f(0)}")
    src.line(f"for i in range({size}):").indent()
    src.line("v = p0[i]").line("lo = min(lo, v)").line("hi = max(hi, v)").dedent()
    # (hi - lo) / 255 correctly rounded: a float64 product with 1/255, which is no float32.
    src.line(f"p3[0] = np.float32(np.float64(hi - lo) * np.float64({1 / 255!r}))")
    for line in _float32_bits_to_float64("p1[0]", "sv"):
        src.line(line)
    src.line("r = np.float64(1) / sv if sv != np.float64(0) else np.float64(0)")
    src.line(f"z = min(max(np.rint({f(0)} - {_exact_quotient('lo', np.float32)}), {f(0)}), {f(255)})")
    src.line("p4[0] = np.uint8(z)")
    src.line(f"for i in range({size}):").indent()
    quotient = _exact_quotient("p0[i]", np.float32)
    src.line(f"p2[i] = {_saturate(f'np.rint({quotient}) + z', np.uint8)}")
    kernel = Kernel("DynamicQuantizeLinear", src.text(), ("float32", "int32", "uint8", "float32", "uint8"))
    return Lowered([KernelCall(kernel, [x.name, ys.name, y.name, ys.name, yz.name], 1, node.name, n_outputs=3)])


# ---------------------------------------------------------------- helpers for the integer ops

def _zero_expr(args, value, index):
    """Source for the zero point at `index` (0 when the input is omitted), as int32."""
    if value is None:
        return "np.int32(0)"
    p = args.add(value.name, value.dtype)
    return f"np.int32({p}[{index if value.size > 1 else 0}])"


def _multiplier(args, scales, index):
    """The requantisation multiplier s_a * s_b / s_y as onnxruntime computes it in float32
    (in ONNX's reference with float16 scales: each operation rounded to float16).
    Returns (lines computing it, its expression, whether it is float64 (float16 scales)); the
    lines go where `index` (the index of a per-channel s_b) is defined. Constant scales give
    a table computed at build time."""
    a, b, y = scales
    half = any(np.dtype(v.dtype).name == "float16" for v in scales)
    ib = index if b.size > 1 else "0"
    if all(v.is_const for v in scales):
        dtype = np.float16 if half else np.float32
        sa, sb, sy = (np.asarray(v.data).astype(dtype).reshape(-1) for v in scales)
        table = ((sa * sb) / sy).astype(np.float64 if half else np.float32)
        p = args.add(np.ascontiguousarray(table), table.dtype)
        return [], f"{p}[{ib if table.size > 1 else 0}]", half
    if half:
        pa, pb, py = (args.add(v.name, np.uint16) for v in scales)
        lines = (_float16_bits_to_float64(f"{pa}[0]", "ma") + _float16_bits_to_float64(f"{pb}[{ib}]", "mb")
                 + _float16_bits_to_float64(f"{py}[0]", "my"))
        lines += _round_to_float16("ma * mb", "mab")
        # numpy divides float16 in float32, then rounds to float16 (see _exact_quotient).
        lines += ["mq = np.float64(np.float32(mab * (np.float64(1) / my)))"]
        lines += _round_to_float16("mq", "mult")
        return lines, "mult", True
    pa, pb = args.add(a.name, np.float32), args.add(b.name, np.float32)
    py = args.add(y.name, np.int32)  # its bits: see _exact_quotient
    lines = _float32_bits_to_float64(f"{py}[0]", "my")
    lines += [f"mult = np.float32(np.float64({pa}[0] * {pb}[{ib}]) * (np.float64(1) / my))"]
    return lines, "mult", False


def _requantized(acc, mult, wide, zero, dtype) -> str:
    """saturate(rint(acc * multiplier) + zero point)."""
    product = f"np.float64({acc}) * {mult}" if wide else f"np.float32({acc}) * {mult}"
    return _saturate(f"np.rint({product}) + {zero}", dtype)


def _float16_bits_to_float64(bits, var) -> list[str]:
    """Lines setting `var` to the (finite) float16 whose bits are the uint16 `bits`, exactly."""
    return [f"hb = np.int64({bits})", "he = (hb >> 10) & 31", "hm = hb & 1023",
            "hp = np.float64(np.int64(1) << (he - 1 if he > 0 else 0))",
            f"{var} = np.float64(hm if he == 0 else hm + 1024) * hp * {literal(2.0 ** -24, np.float64)}",
            f"{var} = -{var} if (hb & 32768) != 0 else {var}"]


def _round_to_float16(value, var) -> list[str]:
    """Lines setting `var` (float64) to the non-negative float64 `value` rounded to the nearest
    float16, ties to even: scaled by powers of two (exact) to an 11-bit integer part, rint."""
    return [f"rw = {value}", "rk = 0",
            "while rw >= np.float64(2048):", "    rw = rw * np.float64(0.5)", "    rk += 1",
            "while rw < np.float64(1024) and rk > -24 and rw > np.float64(0):", "    rw = rw * np.float64(2)", "    rk -= 1",
            "rw = np.rint(rw)",
            "rq = rk if rk >= 0 else -rk",
            "rp = np.float64(np.int64(1) << rq)",
            f"{var} = rw * rp if rk >= 0 else rw / rp"]


def _unpacked(value, zero, per_axis=0):
    """A constant integer tensor as int32 minus its zero point (per tensor, or one per index
    along `per_axis`)."""
    data = np.asarray(value.data).astype(np.int32)
    if zero is not None:
        z = np.asarray(zero.data).astype(np.int32).reshape(-1)
        if z.size > 1:
            shape = [1] * data.ndim
            shape[per_axis] = z.size
            data = data - z.reshape(shape)
        else:
            data = data - z[0]
    return data


# ---------------------------------------------------------------- MatMulInteger / QLinearMatMul

def _matmul_geometry(node, A, B, Y):
    a_shape, b_shape = list(A.shape), list(B.shape)
    if len(a_shape) == 1:
        a_shape = [1] + a_shape
    if len(b_shape) == 1:
        b_shape = b_shape + [1]
    M, K = a_shape[-2:]
    N = b_shape[-1]
    batch = list(np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))
    nbatch = int(np.prod(batch, dtype=np.int64))
    a_strides = broadcast_strides(a_shape[:-2], batch) if batch else []
    b_strides = broadcast_strides(b_shape[:-2], batch) if batch else []
    a_off = np.zeros(nbatch, np.int64)
    b_off = np.zeros(nbatch, np.int64)
    for i, idx in enumerate(np.ndindex(*batch)) if batch else []:
        a_off[i] = sum(j * s for j, s in zip(idx, a_strides)) * M * K
        b_off[i] = sum(j * s for j, s in zip(idx, b_strides)) * K * N
    if int(np.prod(Y.shape, dtype=np.int64)) != nbatch * M * N:
        raise _unsupported(node, f"output shape {Y.shape} does not match {A.shape} x {B.shape}")
    return M, K, N, nbatch, a_off, b_off


def _batch_offsets(args, src, a_off, b_off):
    """Lines setting `ab`/`bb`, the batch offsets of A and B (constant tables when batched)."""
    if len(a_off) == 1:
        src.line(f"ab = {int(a_off[0])}").line(f"bb = {int(b_off[0])}")
        return
    pa = args.add(a_off, np.int64)
    pb = args.add(b_off, np.int64)
    src.line(f"ab = {pa}[bi]").line(f"bb = {pb}[bi]")


def _vnni_operands(node, graph, A, B, za, zb, Y):
    """(M, K, N, weights, a_zero) for the VNNI path (qgemm.py): B a constant matrix shared by
    every row of A (A's leading dims fold into M), its zero point constant; else None."""
    if not B.is_const or len(B.shape) != 2 or len(A.shape) < 2 or (zb is not None and not zb.is_const):
        return None
    if za is not None and za.size != 1:
        return None
    M = int(np.prod(A.shape[:-1], dtype=np.int64))
    K, N = B.shape
    if A.shape[-1] != K or int(np.prod(Y.shape, dtype=np.int64)) != M * N:
        return None
    weights = qgemm.signed_weights(B.data, zb.data if zb is not None else None)
    a_zero = None if za is None else (np.asarray(za.data) if za.is_const else za)
    return M, K, N, weights, a_zero


def lower_matmul_integer(node, graph) -> Lowered:
    A, B, za, zb = (node_input(node, graph, k) for k in range(4))
    Y = graph.values[node.outputs[0]]
    for v in (A, B):
        _check(node, v, {"uint8", "int8"})
    fast = _vnni_operands(node, graph, A, B, za, zb, Y)
    if fast is not None:
        M, K, N, weights, a_zero = fast
        calls = qgemm.int8_gemm(node.name, A, M, K, N, weights, Y, "i32", a_zero=a_zero)
        if calls:
            return Lowered(calls)
    M, K, N, nbatch, a_off, b_off = _matmul_geometry(node, A, B, Y)
    args = _Args()
    src = Source()
    body = Source()
    pA = args.add(A.name, A.dtype)
    if B.is_const and (zb is None or zb.is_const):
        pB = args.add(_unpacked(B, zb, per_axis=-1), np.int32)
        b_term = f"{pB}[bb + k*{N} + n]"
    else:
        pB = args.add(B.name, B.dtype)
        zbe = _zero_expr(args, zb, "n")
        b_term = f"(np.int32({pB}[bb + k*{N} + n]) - {zbe})"
    zae = _zero_expr(args, za, "m")
    body.line(f"bi = row // {M}").line(f"m = row % {M}")
    _batch_offsets(args, body, a_off, b_off)
    pY = args.add(Y.name, np.int32)
    # Y is int32: accumulate in place, the inner loop over n unit-stride.
    body.line(f"yb = row*{N}").line(f"ar = ab + m*{K}")
    body.line(f"za = {zae}")
    body.line(f"for n in range({N}):").indent().line(f"{pY}[yb + n] = np.int32(0)").dedent()
    body.line(f"for k in range({K}):").indent()
    body.line(f"av = np.int32({pA}[ar + k]) - za")
    body.line(f"for n in range({N}):").indent()
    body.line(f"{pY}[yb + n] += av * {b_term}")
    src.line(kernel_header(len(args.values))).indent().line("for row in range(begin, end):").indent()
    for line in body.lines:
        src.line(line)
    kernel = Kernel("MatMulInteger", src.text(), tuple(args.types))
    return Lowered([KernelCall(kernel, list(args.values), nbatch * M, node.name)])


def lower_qlinear_matmul(node, graph) -> Lowered:
    a, sa, za, b, sb, zb, sy, zy = (node_input(node, graph, k) for k in range(8))
    Y = graph.values[node.outputs[0]]
    for v in (a, b, Y):
        _check(node, v, {"uint8", "int8"})
    for v in (sa, sb, sy):
        _check(node, v, {"float32", "float16"})
    fast = _vnni_operands(node, graph, a, b, za, zb, Y)
    if fast is not None and all(v.is_const for v in (sa, sb, sy)) and (zy is None or zy.is_const) \
            and not any(np.dtype(v.dtype).name == "float16" for v in (sa, sb, sy)):
        M, K, N, weights, a_zero = fast
        table = (np.asarray(sa.data, np.float32).reshape(-1) * np.asarray(sb.data, np.float32).reshape(-1)) \
            / np.asarray(sy.data, np.float32).reshape(-1)
        zero = int(np.asarray(zy.data).reshape(-1)[0]) if zy is not None else 0
        mode = "u8" if np.dtype(Y.dtype).name == "uint8" else "s8"
        calls = qgemm.int8_gemm(node.name, a, M, K, N, weights, Y, mode, a_zero=a_zero,
                                mult=table.astype(np.float32), zy=zero)
        if calls:
            return Lowered(calls)
    M, K, N, nbatch, a_off, b_off = _matmul_geometry(node, a, b, Y)
    args = _Args()
    body = Source()
    pA = args.add(a.name, a.dtype)
    if b.is_const and (zb is None or zb.is_const):
        # B^T with its zero point subtracted: the dot over k is unit-stride.
        bt = _unpacked(b, zb, per_axis=-1)
        bt = np.ascontiguousarray(np.swapaxes(bt.reshape(K, 1) if bt.ndim == 1 else bt, -1, -2))
        pB = args.add(bt, np.int32)
        b_term = f"{pB}[bb + n*{K} + k]"
    else:
        pB = args.add(b.name, b.dtype)
        zbe = _zero_expr(args, zb, "n")
        b_term = f"(np.int32({pB}[bb + k*{N} + n]) - {zbe})"
    zae = _zero_expr(args, za, "m")
    mult_lines, mult, wide = _multiplier(args, (sa, sb, sy), "n")
    pzy = args.add(zy.name, zy.dtype) if zy is not None else None
    body.line(f"bi = row // {M}").line(f"m = row % {M}")
    _batch_offsets(args, body, a_off, b_off)
    pY = args.add(Y.name, Y.dtype)
    body.line(f"yb = row*{N}").line(f"ar = ab + m*{K}")
    body.line(f"za = {zae}")
    body.line(f"yz = np.float32({pzy}[0])" if pzy else "yz = np.float32(0)")
    body.line(f"for n in range({N}):").indent()
    body.line("acc = np.int32(0)")
    body.line(f"for k in range({K}):").indent()
    body.line(f"acc += (np.int32({pA}[ar + k]) - za) * {b_term}").dedent()
    for line in mult_lines:
        body.line(line)
    body.line(f"{pY}[yb + n] = {_requantized('acc', mult, wide, 'yz', Y.dtype)}")
    src = Source().line(kernel_header(len(args.values))).indent().line("for row in range(begin, end):").indent()
    for line in body.lines:
        src.line(line)
    kernel = Kernel("QLinearMatMul", src.text(), tuple(args.types))
    return Lowered([KernelCall(kernel, list(args.values), nbatch * M, node.name)])


# ---------------------------------------------------------------- ConvInteger / QLinearConv

def _integer_conv(node, graph, family, x, zx, w, zw, bias, y, requant):
    """Direct convolution in int32, one (image, output channel) plane per item; `requant` is
    None (ConvInteger: store the int32 sum) or args -> (multiplier lines, expression, wide, zero
    point expression), see `_multiplier`."""
    for v in (x, w):
        _check(node, v, {"uint8", "int8"})
    N, C = x.shape[:2]
    M = w.shape[0]
    group = int(node.attr("group", 1))
    Cg, Mg = C // group, M // group
    in_spatial, out_spatial, kernel = list(x.shape[2:]), list(y.shape[2:]), list(w.shape[2:])
    n = len(in_spatial)
    strides = list(node.attr("strides", [1] * n))
    dilations = list(node.attr("dilations", [1] * n))
    pads = conv_pads(node, in_spatial, kernel, strides, dilations, out_spatial)
    args = _Args()
    px = args.add(x.name, x.dtype)
    if w.is_const and (zw is None or zw.is_const):
        pw = args.add(np.ascontiguousarray(_unpacked(w, zw, per_axis=0)), np.int32)
        w_term = f"{pw}[wb + {{k}}]"
    else:
        pw = args.add(w.name, w.dtype)
        zwe = _zero_expr(args, zw, "oc")
        w_term = f"(np.int32({pw}[wb + {{k}}]) - {zwe})"
    zxe = _zero_expr(args, zx, "0")
    pb = args.add(bias.name, np.int32) if bias is not None else None
    if requant is not None:
        mult_lines, mult, wide, zy = requant(args)
    py = args.add(y.name, y.dtype)
    in_plane, out_plane, ksize = int(np.prod(in_spatial)), int(np.prod(out_spatial)), int(np.prod(kernel))
    in_strides, out_strides, k_strides = dims_strides(in_spatial), dims_strides(out_spatial), dims_strides(kernel)
    src = Source().line(kernel_header(len(args.values))).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {M}").line(f"oc = item % {M}").line(f"g = oc // {Mg}")
    src.line(f"ob = item*{out_plane}")
    src.line(f"zx = {zxe}")
    if requant is not None:
        for line in mult_lines:
            src.line(line)
        src.line(f"mu = {mult}").line(f"yz = {zy}")
    for d in range(n):
        src.line(f"for o{d} in range({out_spatial[d]}):").indent()
    src.line(f"acc = {f'{pb}[oc]' if pb else 'np.int32(0)'}")
    src.line(f"for icl in range({Cg}):").indent()
    src.line(f"xb = (n*{C} + g*{Cg} + icl)*{in_plane}")
    src.line(f"wb = (oc*{Cg} + icl)*{ksize}")
    for d in range(n):
        src.line(f"for k{d} in range({kernel[d]}):").indent()
        src.line(f"i{d} = o{d}*{strides[d]} - {pads[d]} + k{d}*{dilations[d]}")
        src.line(f"if i{d} >= 0 and i{d} < {in_spatial[d]}:").indent()
    x_index = " + ".join(["xb"] + [f"i{d}*{in_strides[d]}" for d in range(n)])
    k_index = " + ".join(f"k{d}*{k_strides[d]}" for d in range(n))
    src.line(f"acc += (np.int32({px}[{x_index}]) - zx) * {w_term.format(k=k_index)}")
    for _ in range(2 * n + 1):
        src.dedent()
    y_index = " + ".join(["ob"] + [f"o{d}*{out_strides[d]}" for d in range(n)])
    if requant is None:
        src.line(f"{py}[{y_index}] = acc")
    else:
        src.line(f"{py}[{y_index}] = {_requantized('acc', 'mu', wide, 'yz', y.dtype)}")
    kernel_obj = Kernel(family, src.text(), tuple(args.types))
    return Lowered([KernelCall(kernel_obj, list(args.values), N * M, node.name)])


def lower_conv_integer(node, graph) -> Lowered:
    x, w, zx, zw = (node_input(node, graph, k) for k in range(4))
    y = graph.values[node.outputs[0]]
    return _integer_conv(node, graph, "ConvInteger", x, zx, w, zw, None, y, None)


def lower_qlinear_conv(node, graph) -> Lowered:
    x, sx, zx, w, sw, zw, sy, zy, bias = (node_input(node, graph, k) for k in range(9))
    y = graph.values[node.outputs[0]]
    _check(node, y, {"uint8", "int8"})
    for v in (sx, sw, sy):
        _check(node, v, {"float32", "float16"})
    pads = None
    if len(x.shape) == 4 and len(y.shape) == 4 and len(w.shape) == 4:
        pads = conv_pads(node, list(x.shape[2:]), list(w.shape[2:]), list(node.attr("strides", [1, 1])),
                          list(node.attr("dilations", [1, 1])), list(y.shape[2:]))
    fast = None
    if pads is not None:
        fast = qconv.lower_qlinear_conv_vnni(node, graph, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads) \
            or qconv.lower_qlinear_depthwise(node, graph, x, sx, zx, w, sw, zw, sy, zy, bias, y, pads)
    fast = fast or _qlinear_conv_float(node, graph, x, sx, zx, w, sw, zw, sy, zy, bias, y)
    if fast:
        return Lowered(fast)

    def requant(args):
        lines, mult, wide = _multiplier(args, (sx, sw, sy), "oc")
        zero = f"np.float32({args.add(zy.name, zy.dtype)}[0])" if zy is not None else "np.float32(0)"
        return lines, mult, wide, zero
    return _integer_conv(node, graph, "QLinearConv", x, zx, w, zw, bias, y, requant)


# ---------------------------------------------------------------- FusedMatMulInteger (passes/fold_qdq.py)

def lower_fused_matmul_integer(node, graph) -> Lowered:
    """FusedMatMulInteger(A, B, a_zero, b_zero, a_scale, b_scale, bias, y_scale, y_zero), see
    passes/fold_qdq.py: the VNNI kernel (qgemm.py), else one scalar loop of the same arithmetic."""
    A, B, za, zb, sa, sb, bias, sy, zy = (node_input(node, graph, k) for k in range(9))
    Y = graph.values[node.outputs[0]]
    _check(node, A, {"uint8", "int8"})
    if not B.is_const or len(B.shape) != 2 or (zb is not None and not zb.is_const) or not sb.is_const:
        raise _unsupported(node, "the weight, its zero point and its scale must be constants")
    K, N = B.shape
    M = int(np.prod(A.shape[:-1], dtype=np.int64))
    quantised = sy is not None
    b_scale = np.asarray(sb.data, np.float32).reshape(-1)
    if quantised:
        if not (sa.is_const and sy.is_const and zy is not None and zy.is_const and (za is None or za.is_const)):
            raise _unsupported(node, "a quantised output needs constant scales and zero points")
        s_a = np.asarray(sa.data, np.float32).reshape(-1)[0]
        mult = ((s_a * b_scale) / np.asarray(sy.data, np.float32).reshape(-1)[0]).astype(np.float32)
        ibias = np.asarray(bias.data, np.int32) if bias is not None else None
        mode = "u8" if np.dtype(Y.dtype).name == "uint8" else "s8"
        zero = int(np.asarray(zy.data).reshape(-1)[0])
    else:
        mult, ibias, mode, zero = b_scale, None, "f32", 0
    a_zero = None if za is None else (np.asarray(za.data) if za.is_const else za)
    weights = qgemm.signed_weights(B.data, zb.data if zb is not None else None)
    fbias = np.asarray(bias.data, np.float32).reshape(-1) if bias is not None and not quantised else None
    runtime_scale = sa if not quantised and not sa.is_const else None
    if not quantised and sa.is_const:
        mult = (np.asarray(sa.data, np.float32).reshape(-1)[0] * b_scale).astype(np.float32)
    calls = qgemm.int8_gemm(node.name, A, M, K, N, weights, Y, mode, a_zero=a_zero, mult=mult,
                            ascale=runtime_scale, bias=fbias, ibias=ibias, zy=zero)
    if calls:
        return Lowered(calls)
    return _fused_matmul_integer_loops(node, A, B, za, zb, runtime_scale, M, K, N, mult, fbias, ibias, zero, Y)


def _fused_matmul_integer_loops(node, A, B, za, zb, runtime_scale, M, K, N, mult, fbias, ibias, zero, Y):
    """The scalar form (targets without AVX512-VNNI): int32 dot products over B^T, then the same
    epilogue, one row of the output per work item."""
    args = _Args()
    pA = args.add(A.name, A.dtype)
    pB = args.add(np.ascontiguousarray(_unpacked(B, zb, per_axis=-1).T), np.int32)
    zae = _zero_expr(args, za, "0")
    pm = args.add(np.broadcast_to(mult, (N,)).astype(np.float32), np.float32)
    ps = args.add(runtime_scale.name, np.float32) if runtime_scale is not None else None
    pb = args.add(np.broadcast_to(fbias, (N,)).astype(np.float32), np.float32) if fbias is not None else None
    pi = args.add(np.broadcast_to(ibias, (N,)).astype(np.int32), np.int32) if ibias is not None else None
    pY = args.add(Y.name, Y.dtype)
    src = Source().line(kernel_header(len(args.values))).indent()
    src.line("for m in range(begin, end):").indent()
    src.line(f"za = {zae}")
    src.line(f"for n in range({N}):").indent()
    src.line(f"acc = {pi}[n]" if pi else "acc = np.int32(0)")
    src.line(f"for k in range({K}):").indent()
    src.line(f"acc += (np.int32({pA}[m*{K} + k]) - za) * {pB}[n*{K} + k]").dedent()
    if np.dtype(Y.dtype).name == "float32":
        scale = f"({pm}[n] * {ps}[0])" if ps else f"{pm}[n]"
        value = f"np.float32(acc) * {scale}" + (f" + {pb}[n]" if pb else "")
        src.line(f"{pY}[m*{N} + n] = {value}")
    else:
        src.line(f"{pY}[m*{N} + n] = {_requantized('acc', f'{pm}[n]', False, f'np.float32({zero})', Y.dtype)}")
    kernel = Kernel("FusedMatMulInteger", src.text(), tuple(args.types))
    return Lowered([KernelCall(kernel, list(args.values), M, node.name)])


# ---------------------------------------------------------------- QLinearAdd (domain "cuvil", passes/fold_qdq.py)

def lower_qlinear_add(node, graph) -> Lowered:
    """QLinearAdd(a, s_a, z_a, b, s_b, z_b, s_y, z_y), com.microsoft's inputs, equal shapes:
    y = saturate(rint(((a - z_a) s_a + (b - z_b) s_b) * (1 / s_y)) + z_y), float32, one vectorised
    loop. The products and the sum round as DequantizeLinear and Add do; the reciprocal multiply
    (fast-math's form of the division) can put a sum within an ulp of a .5 boundary on the other
    step."""
    a, sa, za, b, sb, zb, sy, zy = (node_input(node, graph, k) for k in range(8))
    y = graph.values[node.outputs[0]]
    for v in (a, b, y):
        _check(node, v, {"uint8", "int8"})
    if not all(v is not None and v.is_const and v.size == 1 for v in (sa, za, sb, zb, sy, zy)):
        raise _unsupported(node, "scales and zero points must be per-tensor constants")
    f = lambda v: literal(np.asarray(v.data, np.float32).reshape(-1)[0], np.float32)  # noqa: E731
    lo, hi = _RANGES[np.dtype(y.dtype).name]
    recip = literal(np.float32(1) / np.asarray(sy.data, np.float32).reshape(-1)[0], np.float32)
    src = Source().line(kernel_header(3)).indent()
    src.line("for i in range(begin, end):").indent()
    src.line(f"va = (np.float32(np.int32(p0[i])) - {f(za)}) * {f(sa)}")
    src.line(f"vb = (np.float32(np.int32(p1[i])) - {f(zb)}) * {f(sb)}")
    src.line(f"r = np.rint((va + vb) * {recip}) + {f(zy)}")
    src.line(f"p2[i] = np.{np.dtype(y.dtype).name}(np.int32(min(max(r, np.float32({lo})), np.float32({hi}))))")
    kernel = Kernel("QLinearAdd", src.text(), (np.dtype(a.dtype).name, np.dtype(b.dtype).name, np.dtype(y.dtype).name))
    return Lowered([KernelCall(kernel, [a.name, b.name, y.name], y.size, node.name)])


def lower_qlookup(node, graph) -> Lowered:
    """QLookup(x, table) (domain "cuvil", passes/fold_qdq.py): y = table[x - min(x's dtype)], x 8-bit."""
    x, table = (node_input(node, graph, k) for k in range(2))
    y = graph.values[node.outputs[0]]
    _check(node, x, {"uint8", "int8"})
    offset = 128 if np.dtype(x.dtype).name == "int8" else 0
    src = Source().line(kernel_header(3)).indent()
    src.line("for i in range(begin, end):").indent()
    src.line(f"p2[i] = p1[np.int32(p0[i]) + {offset}]")
    kernel = Kernel("QLookup", src.text(), (np.dtype(x.dtype).name, np.dtype(table.dtype).name, np.dtype(y.dtype).name))
    return Lowered([KernelCall(kernel, [x.name, np.ascontiguousarray(table.data), y.name], y.size, node.name)])


# ---------------------------------------------------------------- float fallback

FLOAT_FALLBACK = "float32 (the QDQ form: no int8 kernel on this target)"

def _qlinear_conv_float(node, graph, x, sx, zx, w, sw, zw, sy, zy, bias, y) -> list | None:
    """A QLinearConv that passes/fold_qdq.py made from a QDQ Conv (attribute `fallback` = "float"),
    on a target without the int8 kernel: computed as the QDQ graph it came from (DequantizeLinear,
    a float32 conv on the weights dequantised at build time, QuantizeLinear), on the float conv
    kernels, not on the scalar integer loops, which are many times slower."""
    from cuvil.evaluate import evaluate_exact
    from cuvil.ir import Node, Value

    from . import conv as float_conv
    from .scratch import scratch_value
    if node.attr("fallback") != "float" or not (w.is_const and sw.is_const and (zw is None or zw.is_const)
                                                and sx.is_const and (bias is None or bias.is_const)):
        return None
    axis = {"axis": 0}
    wf = evaluate_exact("DequantizeLinear", "", [np.asarray(w.data), np.asarray(sw.data),
                                                 None if zw is None else np.asarray(zw.data)], axis)
    if wf is None:
        return None

    def constant(tag, array):
        name = f"__{tag}__{node.name}"
        graph.values[name] = Value(name, array.dtype, tuple(array.shape), array)
        return name
    inputs = [None, constant("qconv_wf", wf[0].astype(np.float32))]
    if bias is not None:
        scale = (np.asarray(sx.data, np.float32).reshape(-1)[0]
                 * np.asarray(sw.data, np.float32).reshape(-1)).astype(np.float32)
        bf = evaluate_exact("DequantizeLinear", "", [np.asarray(bias.data), scale, None], axis)
        inputs.append(constant("qconv_bf", bf[0].astype(np.float32)))
    xf = scratch_value(graph, node, x.shape, np.float32, tag="qconv_xf")
    yf = scratch_value(graph, node, y.shape, np.float32, tag="qconv_yf")
    inputs[0] = xf
    attrs = {k: v for k, v in node.attrs.items() if k != "fallback"}
    calls = lower_dequantize_linear(Node("DequantizeLinear", node.name, [x.name, sx.name, zx.name if zx else ""],
                                               [xf]), graph).calls
    calls += float_conv.lower_conv(Node("Conv", node.name, inputs, [yf], attrs), graph).calls
    calls += lower_quantize_linear(Node("QuantizeLinear", node.name, [yf, sy.name, zy.name if zy else ""],
                                              [y.name]), graph).calls
    for call in calls:
        call.precision = FLOAT_FALLBACK
    return calls
