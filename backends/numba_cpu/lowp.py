"""Conversions between float32 and the 16-bit float formats, as micro-kernels (LLVM vector IR).

bfloat16 is the top half of a float32 (sign, 8 exponent bits, 7 mantissa bits); float16 (IEEE
binary16) has 5 exponent bits and 10 mantissa bits. Widening is exact; narrowing rounds to
nearest, ties to even (RNE). In float32 bits x:

    bf16(x) = (x + 0x7fff + ((x >> 16) & 1)) >> 16             x not NaN (a carry into the
                                                                exponent rounds up to inf)
            = (x >> 16) | 0x0040                                x NaN (kept NaN, made quiet)
    f32(b)  = b << 16

    f16(x): |x| >= 2^16 (as bits >= 0x47800000): inf, or NaN as sign | 0x7e00 | (x >> 13) & 0x3ff
            |x| <  2^-14: a subnormal: the bits of (|x| + 0.5) - 0x3f000000 (the float addition
                          rounds at 2^-24, the unit of a float16 subnormal, by RNE)
            otherwise:    (|x| - (112 << 23) + 0xfff + ((x >> 13) & 1)) >> 13, values in
                          [65520, 65536) carrying into the exponent: inf
            | the sign >> 16
    f32(h): exponent 0: subnormal (h * 2^-24, exact); 31: inf or NaN (NaN made quiet); else
            rebias by 112 << 23.

Methods (CvtSpec.method):
- "exact": the integer formulas above, on every target (SSE2 upwards). Bit-exact against
  ml_dtypes/numpy for every non-NaN input.
- "hw": the instruction: `vcvtneps2bf16` (AVX512-BF16) for float32 -> bf16, F16C `vcvtps2ph` /
  `vcvtph2ps` for float16. F16C is IEEE-exact (and equals "exact", NaNs included); `vcvtneps2bf16`
  treats float32 subnormal inputs (|x| < 2^-126) as zero (measured on AMD Zen 4, as Intel documents
  it: DAZ, MXCSR not consulted): ±0 where "exact" gives the nearest bf16 subnormal.
  Widening bf16 is a shift on every target (no instruction is needed).

NaNs: narrowing keeps a NaN a NaN, quiet, with its sign and its top payload bits (the
instructions' result; ml_dtypes instead writes the canonical 0x7fc0 for bf16 and numpy keeps a
signalling float16 NaN signalling). Widening float16 quiets a NaN as `vcvtph2ps` does; widening
bf16 keeps every bit (a signalling NaN stays signalling, as in ml_dtypes).

Also here: the IR pieces the reduced-precision micro-kernels (ukernel_lowp.py, ukernel_amx.py)
share with these kernels (typed_declaration, column_masks).

Signature: i32 name(ptr src, i64 soff, ptr dst, i64 doff, i64 n) converts dst[doff + i] =
convert(src[soff + i]) for i < n (offsets in elements of each side's type), L lanes per step with
a masked last step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from backends.targets import CpuTarget

from backends.targets import has_feature
from .ukernel import Declared, IRBuilder, float_ir, lanes_for

FORMATS = ("f32", "bf16", "f16")
STORAGE = {"f32": "i32", "bf16": "i16", "f16": "i16"}   # how each format is loaded and stored
_NUMBA_POINTER = {"f32": "float32", "bf16": "uint16", "f16": "uint16"}


@dataclass(frozen=True)
class CvtSpec(Declared):
    """dst = convert(src) elementwise; src and dst are "f32", "bf16" or "f16" (one of them "f32")."""
    src: str
    dst: str
    method: str = "exact"   # "exact" (integer formulas, any target) | "hw" (see the module docstring)
    kind: str = "cvt"
    _ARGS: ClassVar[str] = "pipii"

    def __post_init__(self):
        assert {self.src, self.dst} in ({"f32", "bf16"}, {"f32", "f16"}), (self.src, self.dst)
        assert self.method in ("exact", "hw"), self.method

    def _stem(self) -> str:
        return f"cuvil_cvt_{self.src}_{self.dst}_{self.method}"

    def declaration(self, var: str) -> str:
        """The 16-bit side as a uint16 pointer (a Numba kernel holds bf16/f16 buffers as uint16)."""
        return typed_declaration(self, var, {0: _NUMBA_POINTER[self.src], 2: _NUMBA_POINTER[self.dst]})


def typed_declaration(spec: Declared, var: str, pointers: dict) -> str:
    """Declared.declaration with each pointer argument's Numba element type from `pointers` (by its
    index in spec._ARGS; float32 when absent): a kernel holds bf16 / float16 buffers as uint16."""
    args = [f"_uk_types.CPointer(_uk_types.{pointers.get(n, 'float32')})" if c == "p" else "_uk_types.int64"
            for n, c in enumerate(spec._ARGS)]
    return (f"{spec.comment()}\nfrom numba import types as _uk_types\n"
            f"{var} = _uk_types.ExternalFunction({spec.name!r}, _uk_types.int32({', '.join(args)}))\n")


def column_masks(ir: IRBuilder, V: int, L: int) -> dict:
    """<L x i1> lane masks of the column vectors from the i64 %mask."""
    masks = {}
    for v in range(V):
        shifted = ir.tmp("ms")
        ir(f"{shifted} = lshr i64 %mask, {v * L}")
        bits = ir.tmp("mb")
        ir(f"{bits} = trunc i64 {shifted} to i{L}")
        masks[v] = ir.tmp("m")
        ir(f"{masks[v]} = bitcast i{L} {bits} to <{L} x i1>")
    return masks


def best_method(src: str, dst: str, target: CpuTarget) -> str:
    """"hw" where the instruction exists and is bit-exact (F16C), else "exact". float32 -> bf16
    stays "exact" by default: `vcvtneps2bf16` flushes float32 subnormals (ask for "hw" to take it)."""
    if "f16" in (src, dst) and has_feature(target, "f16c"):
        return "hw"
    return "exact"


def _splat(L: int, value: int, elem: str = "i32") -> str:
    return "<" + ", ".join([f"{elem} {value}"] * L) + ">"


def _op(ir: IRBuilder, text: str, base: str = "v") -> str:
    """One instruction `%t = text`; returns %t."""
    out = ir.tmp(base)
    ir(f"{out} = {text}")
    return out


def f32_to_bf16(ir: IRBuilder, bits: str, L: int, method: str = "exact") -> str:
    """<L x i16> bf16 bits of the <L x i32> float32 bits `bits` (RNE, NaN quiet)."""
    vi, vh = f"<{L} x i32>", f"<{L} x i16>"
    if method == "hw":
        x = _op(ir, f"bitcast {vi} {bits} to <{L} x float>")
        y = _op(ir, f"fptrunc <{L} x float> {x} to <{L} x bfloat>")
        return _op(ir, f"bitcast <{L} x bfloat> {y} to {vh}")
    high = _op(ir, f"lshr {vi} {bits}, {_splat(L, 16)}")
    lsb = _op(ir, f"and {vi} {high}, {_splat(L, 1)}")
    biased = _op(ir, f"add {vi} {bits}, {_splat(L, 0x7FFF)}")
    rounded = _op(ir, f"add {vi} {biased}, {lsb}")
    result = _op(ir, f"lshr {vi} {rounded}, {_splat(L, 16)}")
    magnitude = _op(ir, f"and {vi} {bits}, {_splat(L, 0x7FFFFFFF)}")
    is_nan = _op(ir, f"icmp ugt {vi} {magnitude}, {_splat(L, 0x7F800000)}")
    quiet = _op(ir, f"or {vi} {high}, {_splat(L, 0x40)}")
    chosen = _op(ir, f"select <{L} x i1> {is_nan}, {vi} {quiet}, {vi} {result}")
    return _op(ir, f"trunc {vi} {chosen} to {vh}")


def bf16_to_f32(ir: IRBuilder, bits: str, L: int) -> str:
    """<L x i32> float32 bits of the <L x i16> bf16 bits `bits` (exact)."""
    wide = _op(ir, f"zext <{L} x i16> {bits} to <{L} x i32>")
    return _op(ir, f"shl <{L} x i32> {wide}, {_splat(L, 16)}")


def f32_to_f16(ir: IRBuilder, bits: str, L: int, method: str = "exact") -> str:
    """<L x i16> float16 bits of the <L x i32> float32 bits `bits` (RNE, overflow to inf,
    subnormals, NaN quiet)."""
    vi, vf, vh, vb = f"<{L} x i32>", f"<{L} x float>", f"<{L} x i16>", f"<{L} x i1>"
    if method == "hw":
        x = _op(ir, f"bitcast {vi} {bits} to {vf}")
        y = _op(ir, f"fptrunc {vf} {x} to <{L} x half>")
        return _op(ir, f"bitcast <{L} x half> {y} to {vh}")
    sign = _op(ir, f"and {vi} {bits}, {_splat(L, 0x80000000 - (1 << 32))}")
    magnitude = _op(ir, f"and {vi} {bits}, {_splat(L, 0x7FFFFFFF)}")
    mantissa_top = _op(ir, f"lshr {vi} {magnitude}, {_splat(L, 13)}")
    # |x| >= 2^16: inf, or a quiet NaN keeping the top of the payload
    is_nan = _op(ir, f"icmp ugt {vi} {magnitude}, {_splat(L, 0x7F800000)}")
    payload = _op(ir, f"and {vi} {mantissa_top}, {_splat(L, 0x3FF)}")
    nan = _op(ir, f"or {vi} {payload}, {_splat(L, 0x7E00)}")
    big = _op(ir, f"select {vb} {is_nan}, {vi} {nan}, {vi} {_splat(L, 0x7C00)}")
    # |x| < 2^-14: the float addition of 0.5 rounds at the float16 subnormal unit
    as_float = _op(ir, f"bitcast {vi} {magnitude} to {vf}")
    half = "<" + ", ".join([f"float {float_ir(0.5)}"] * L) + ">"
    shifted = _op(ir, f"fadd {vf} {as_float}, {half}")
    shifted_bits = _op(ir, f"bitcast {vf} {shifted} to {vi}")
    small = _op(ir, f"sub {vi} {shifted_bits}, {_splat(L, 0x3F000000)}")
    # normal: rebias the exponent, round the 13 dropped bits to nearest even
    odd = _op(ir, f"and {vi} {mantissa_top}, {_splat(L, 1)}")
    rebiased = _op(ir, f"add {vi} {magnitude}, {_splat(L, 0xFFF - (112 << 23))}")
    rounded = _op(ir, f"add {vi} {rebiased}, {odd}")
    normal = _op(ir, f"lshr {vi} {rounded}, {_splat(L, 13)}")
    is_small = _op(ir, f"icmp ult {vi} {magnitude}, {_splat(L, 0x38800000)}")
    finite = _op(ir, f"select {vb} {is_small}, {vi} {small}, {vi} {normal}")
    is_big = _op(ir, f"icmp uge {vi} {magnitude}, {_splat(L, 0x47800000)}")
    unsigned = _op(ir, f"select {vb} {is_big}, {vi} {big}, {vi} {finite}")
    sign16 = _op(ir, f"lshr {vi} {sign}, {_splat(L, 16)}")
    signed = _op(ir, f"or {vi} {unsigned}, {sign16}")
    return _op(ir, f"trunc {vi} {signed} to {vh}")


def f16_to_f32(ir: IRBuilder, bits: str, L: int, method: str = "exact") -> str:
    """<L x i32> float32 bits of the <L x i16> float16 bits `bits` (exact; NaN quiet)."""
    vi, vf, vb = f"<{L} x i32>", f"<{L} x float>", f"<{L} x i1>"
    if method == "hw":
        x = _op(ir, f"bitcast <{L} x i16> {bits} to <{L} x half>")
        y = _op(ir, f"fpext <{L} x half> {x} to {vf}")
        return _op(ir, f"bitcast {vf} {y} to {vi}")
    wide = _op(ir, f"zext <{L} x i16> {bits} to {vi}")
    body = _op(ir, f"and {vi} {wide}, {_splat(L, 0x7FFF)}")
    shifted = _op(ir, f"shl {vi} {body}, {_splat(L, 13)}")
    exponent = _op(ir, f"and {vi} {shifted}, {_splat(L, 0x0F800000)}")
    normal = _op(ir, f"add {vi} {shifted}, {_splat(L, 112 << 23)}")
    # exponent 31: inf or NaN (the NaN quiet)
    is_special = _op(ir, f"icmp eq {vi} {exponent}, {_splat(L, 0x0F800000)}")
    special = _op(ir, f"add {vi} {normal}, {_splat(L, 112 << 23)}")
    has_payload = _op(ir, f"icmp ugt {vi} {body}, {_splat(L, 0x7C00)}")
    quiet_bit = _op(ir, f"select {vb} {has_payload}, {vi} {_splat(L, 0x00400000)}, {vi} zeroinitializer")
    special = _op(ir, f"or {vi} {special}, {quiet_bit}")
    # exponent 0: m * 2^-24 as (2^-14 + m * 2^-24) - 2^-14, exact
    is_subnormal = _op(ir, f"icmp eq {vi} {exponent}, zeroinitializer")
    offset = _op(ir, f"add {vi} {normal}, {_splat(L, 1 << 23)}")
    offset_float = _op(ir, f"bitcast {vi} {offset} to {vf}")
    magic = "<" + ", ".join([f"float {float_ir(2.0 ** -14)}"] * L) + ">"
    subnormal_float = _op(ir, f"fsub {vf} {offset_float}, {magic}")
    subnormal = _op(ir, f"bitcast {vf} {subnormal_float} to {vi}")
    chosen = _op(ir, f"select {vb} {is_subnormal}, {vi} {subnormal}, {vi} {normal}")
    chosen = _op(ir, f"select {vb} {is_special}, {vi} {special}, {vi} {chosen}")
    sign = _op(ir, f"and {vi} {wide}, {_splat(L, 0x8000)}")
    sign32 = _op(ir, f"shl {vi} {sign}, {_splat(L, 16)}")
    return _op(ir, f"or {vi} {chosen}, {sign32}")


def convert(ir: IRBuilder, spec: CvtSpec, bits: str, L: int) -> str:
    """The converted bits (dst's storage type) of the <L x ...> src bits."""
    if spec.src == "bf16":
        return bf16_to_f32(ir, bits, L)
    if spec.src == "f16":
        return f16_to_f32(ir, bits, L, spec.method)
    if spec.dst == "bf16":
        return f32_to_bf16(ir, bits, L, spec.method)
    return f32_to_f16(ir, bits, L, spec.method)


def _strip_loop(ir: IRBuilder, L: int, step, whole_bound: str = "%n", last_mask=None) -> None:
    """for i in 0, L, 2L, ...: step(ir, "%i", None) on whole groups of L elements (while
    i + L <= whole_bound), then step(ir, "%i", mask) once on the last 1..L-1 (%rest = n - i of
    them). mask = last_mask(ir, L) (emitted in that last block; default: the <L x i1> lanes below
    %rest)."""
    ir("br label %head")
    ir.label("head")
    ir("%i = phi i64 [ 0, %entry ], [ %inext, %body ]")
    ir(f"%inext = add i64 %i, {L}")
    ir(f"%whole = icmp sle i64 %inext, {whole_bound}")
    ir("br i1 %whole, label %body, label %tail")
    ir.label("body")
    step(ir, "%i", None)
    ir("br label %head")
    ir.label("tail")
    ir("%rest = sub i64 %n, %i")
    ir("%some = icmp sgt i64 %rest, 0")
    ir("br i1 %some, label %last, label %done")
    ir.label("last")
    step(ir, "%i", (last_mask or _lanes_below_rest)(ir, L))
    ir("br label %done")
    ir.label("done")
    ir("ret i32 0")


def _lanes_below_rest(ir: IRBuilder, L: int) -> str:
    """<L x i1>: lane j < %rest."""
    lane_ids = "<" + ", ".join(f"i64 {j}" for j in range(L)) + ">"
    ir(f"%restv0 = insertelement <{L} x i64> poison, i64 %rest, i64 0")
    ir(f"%restv = shufflevector <{L} x i64> %restv0, <{L} x i64> poison, <{L} x i32> zeroinitializer")
    ir(f"%m = icmp slt <{L} x i64> {lane_ids}, %restv")
    return "%m"


def _load_lanes(ir: IRBuilder, base: str, index: str, elem: str, L: int, mask) -> str:
    """<L x elem> from base[index ...] (masked, zeros elsewhere, when mask is given)."""
    p = _op(ir, f"getelementptr {elem}, ptr {base}, i64 {index}", "sp")
    if mask is None:
        return _op(ir, f"load <{L} x {elem}>, ptr {p}, align 2")
    return _op(ir, f"call <{L} x {elem}> @llvm.masked.load.v{L}{elem}.p0(ptr align 2 {p}, <{L} x i1> {mask}, "
                   f"<{L} x {elem}> zeroinitializer)")


def _store_lanes(ir: IRBuilder, value: str, base: str, index: str, elem: str, L: int, mask) -> None:
    p = _op(ir, f"getelementptr {elem}, ptr {base}, i64 {index}", "dp")
    if mask is None:
        ir(f"store <{L} x {elem}> {value}, ptr {p}, align 2")
    else:
        ir(f"call void @llvm.masked.store.v{L}{elem}.p0(<{L} x {elem}> {value}, ptr align 2 {p}, <{L} x i1> {mask})")


def _masked_decls(*typed_lanes) -> list:
    return [decl for elem, L in typed_lanes for decl in (
        f"declare <{L} x {elem}> @llvm.masked.load.v{L}{elem}.p0(ptr, <{L} x i1>, <{L} x {elem}>)",
        f"declare void @llvm.masked.store.v{L}{elem}.p0(<{L} x {elem}>, ptr, <{L} x i1>)")]


def _kernel_module(head: str, ir: IRBuilder, decls: list) -> str:
    return head + "\n" + "\n".join(ir.lines) + "\n}\n\n" + "\n".join(decls) + "\n\nattributes #0 = { nounwind }\n"


# The strip loop and lane pieces above, for other vector micro-kernels built the same way
# (winoin_lanes.py: bf16 Winograd's input transform).
ir_op, splat, load_lanes, store_lanes, masked_decls, strip_loop, kernel_module = \
    _op, _splat, _load_lanes, _store_lanes, _masked_decls, _strip_loop, _kernel_module


def cvt_ir(spec: CvtSpec, vector_bits: int) -> str:
    """The conversion micro-kernel's module (see CvtSpec and the module docstring)."""
    L = min(lanes_for(vector_bits), 16)
    st, dt = STORAGE[spec.src], STORAGE[spec.dst]
    ir = IRBuilder()
    ir.label("entry")
    ir(f"%s0 = getelementptr {st}, ptr %src, i64 %soff")
    ir(f"%d0 = getelementptr {dt}, ptr %dst, i64 %doff")

    def step(ir, i, mask):
        y = convert(ir, spec, _load_lanes(ir, "%s0", i, st, L, mask), L)
        _store_lanes(ir, y, "%d0", i, dt, L, mask)
    _strip_loop(ir, L, step)
    head = f"define i32 @{spec.name}(ptr noalias %src, i64 %soff, ptr noalias %dst, i64 %doff, i64 %n) #0 {{"
    return _kernel_module(head, ir, _masked_decls((st, L), (dt, L)))


@dataclass(frozen=True)
class PairCvtSpec(Declared):
    """Two float32 rows into one row of bf16 pairs, the VNNI layout ukernel_lowp's B is read in
    (k = 2kp, 2kp + 1 -> row kp), at run time (B made of activations):

        dst[doff + 2j + h] = bf16(src[soff + h*sstride + j])     j < n, h in {0, 1}

    Signature: i32 name(ptr src, i64 soff, i64 sstride, ptr dst, i64 doff, i64 n)."""
    method: str = "exact"   # as CvtSpec's float32 -> bf16
    kind: str = "cvtpairs"
    _ARGS: ClassVar[str] = "piipii"

    def _stem(self) -> str:
        return f"cuvil_cvtpairs_bf16_{self.method}"

    def declaration(self, var: str) -> str:
        return typed_declaration(self, var, {3: "uint16"})


@dataclass(frozen=True)
class PairCopySpec(Declared):
    """PairCvtSpec's interleaving of two rows into one row of pairs, from rows already in 16 bits
    (bf16 activations, copied without rounding):

        dst[doff + 2j + h] = src[soff + h*sstride + j]     j < n, h in {0, 1}   (uint16 elements)

    Signature: i32 name(ptr src, i64 soff, i64 sstride, ptr dst, i64 doff, i64 n)."""
    kind: str = "copypairs"
    _ARGS: ClassVar[str] = "piipii"

    def _stem(self) -> str:
        return "cuvil_copypairs16"

    def declaration(self, var: str) -> str:
        return typed_declaration(self, var, {0: "uint16", 3: "uint16"})


@dataclass(frozen=True)
class StridedPairCopySpec(Declared):
    """PairCopySpec reading every `stride`-th element of the two rows (a strided conv's phase image
    columns from its bf16 X, convgemm.padded_narrow_input_kernel):

        dst[doff + 2j + h] = src[soff + h*sstride + stride*j]     j < n, h in {0, 1}   (uint16 elements)

    Per L columns: stride x L elements of each row loaded, every stride-th kept and the two rows
    interleaved by shuffles; nothing is read past src[soff + h*sstride + stride*(n - 1)].
    Signature: PairCopySpec's."""
    stride: int = 2
    kind: str = "copypairs_strided"
    _ARGS: ClassVar[str] = "piipii"

    def _stem(self) -> str:
        return f"cuvil_copypairs16_s{self.stride}"

    def declaration(self, var: str) -> str:
        return typed_declaration(self, var, {0: "uint16", 3: "uint16"})


def strided_pair_copy_ir(spec: StridedPairCopySpec, vector_bits: int) -> str:
    """See StridedPairCopySpec: whole groups of L columns while their last loaded element is one
    the row has (i + L <= n - 1), then the rest with masked loads and stores."""
    L, s = min(lanes_for(vector_bits), 16), spec.stride
    W = s * L
    ir = IRBuilder()
    ir.label("entry")
    ir("%s0 = getelementptr i16, ptr %src, i64 %soff")
    ir("%s1 = getelementptr i16, ptr %s0, i64 %sstride")
    ir("%d0 = getelementptr i16, ptr %dst, i64 %doff")
    ir("%nwhole = sub i64 %n, 1")
    keep = "<" + ", ".join(f"i32 {s * j}" for j in range(L)) + ">"
    interleave = "<" + ", ".join(f"i32 {j // 2 + (j % 2) * L}" for j in range(2 * L)) + ">"
    doubled = "<" + ", ".join(f"i32 {j // 2}" for j in range(2 * L)) + ">"

    def step(ir, i, masks):
        load_mask, mask = masks or (None, None)
        rows = []
        for row in ("%s0", "%s1"):
            at = _op(ir, f"mul i64 {i}, {s}")
            wide = _load_lanes(ir, row, at, "i16", W, load_mask)
            rows.append(_op(ir, f"shufflevector <{W} x i16> {wide}, <{W} x i16> poison, <{L} x i32> {keep}"))
        pairs = _op(ir, f"shufflevector <{L} x i16> {rows[0]}, <{L} x i16> {rows[1]}, <{2 * L} x i32> {interleave}")
        pair_mask = None if mask is None else _op(
            ir, f"shufflevector <{L} x i1> {mask}, <{L} x i1> poison, <{2 * L} x i32> {doubled}")
        _store_lanes(ir, pairs, "%d0", _op(ir, f"shl i64 {i}, 1"), "i16", 2 * L, pair_mask)

    def last_masks(ir, _L):
        """The loads' <W x i1> (s (rest - 1) + 1 elements of each row) and the columns' <L x i1>."""
        ir(f"%restv0 = insertelement <{W} x i64> poison, i64 %rest, i64 0")
        ir(f"%restv = shufflevector <{W} x i64> %restv0, <{W} x i64> poison, <{W} x i32> zeroinitializer")
        lanes = "<" + ", ".join(f"i64 {j}" for j in range(W)) + ">"
        ir(f"%scaled = mul <{W} x i64> %restv, {_splat(W, s, 'i64')}")
        ir(f"%bound = sub <{W} x i64> %scaled, {_splat(W, s - 1, 'i64')}")
        ir(f"%lm = icmp slt <{W} x i64> {lanes}, %bound")
        ir(f"%m = shufflevector <{W} x i1> %lm, <{W} x i1> poison, <{L} x i32> {keep}")
        return "%lm", "%m"

    _strip_loop(ir, L, step, "%nwhole", last_masks)
    head = (f"define i32 @{spec.name}(ptr noalias %src, i64 %soff, i64 %sstride, ptr noalias %dst, i64 %doff, "
            f"i64 %n) #0 {{")
    return _kernel_module(head, ir, _masked_decls(*sorted({("i16", W), ("i16", 2 * L)})))


def pair_cvt_ir(spec: PairCvtSpec | PairCopySpec, vector_bits: int) -> str:
    """See PairCvtSpec (each group of L columns of both rows converted, then interleaved by a
    shuffle) and PairCopySpec (the same shuffle on 16-bit rows, nothing converted)."""
    L = min(lanes_for(vector_bits), 16)
    copy = isinstance(spec, PairCopySpec)
    src_elem = "i16" if copy else "i32"
    ir = IRBuilder()
    ir.label("entry")
    ir(f"%s0 = getelementptr {src_elem}, ptr %src, i64 %soff")
    ir(f"%s1 = getelementptr {src_elem}, ptr %s0, i64 %sstride")
    ir("%d0 = getelementptr i16, ptr %dst, i64 %doff")
    interleave = "<" + ", ".join(f"i32 {j // 2 + (j % 2) * L}" for j in range(2 * L)) + ">"
    doubled = "<" + ", ".join(f"i32 {j // 2}" for j in range(2 * L)) + ">"

    def step(ir, i, mask):
        rows = [_load_lanes(ir, row, i, src_elem, L, mask) for row in ("%s0", "%s1")]
        even, odd = rows if copy else (f32_to_bf16(ir, row, L, spec.method) for row in rows)
        pairs = _op(ir, f"shufflevector <{L} x i16> {even}, <{L} x i16> {odd}, <{2 * L} x i32> {interleave}")
        pair_mask = None if mask is None else _op(
            ir, f"shufflevector <{L} x i1> {mask}, <{L} x i1> poison, <{2 * L} x i32> {doubled}")
        at = _op(ir, f"shl i64 {i}, 1")
        _store_lanes(ir, pairs, "%d0", at, "i16", 2 * L, pair_mask)
    _strip_loop(ir, L, step)
    head = (f"define i32 @{spec.name}(ptr noalias %src, i64 %soff, i64 %sstride, ptr noalias %dst, i64 %doff, "
            f"i64 %n) #0 {{")
    return _kernel_module(head, ir, _masked_decls((src_elem, L), ("i16", 2 * L)))
