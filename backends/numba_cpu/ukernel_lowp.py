"""GEMM micro-kernels over bf16 / float16 operands with float32 accumulation, as LLVM vector IR.

The same tile and call as UKSpec (ukernel.py), with A and B in a 16-bit format and C in float32:

    C[i, j] (+)= sum_k  A(i, k) * B(k, j)      i < mr, j < nr (nr <= 64), float32 accumulators

bf16 (methods "dpbf16", "widen", "amx") works on k pairs: K is padded to even (a zero column of A,
a zero row of B) and `kc` counts pairs. Units of offsets and strides are 16-bit elements.
- A packed panel (a_packed=1): a[aoff + kp*2P + 2i + h] = A(i, 2kp + h), P = a_panel >= mr: for each
  pair, P rows of one 32-bit word (A(i, 2kp), A(i, 2kp + 1)).
  A rows (a_packed=0): a[aoff + i*lda + 2kp + h], a row-major bf16 matrix (lda even).
- B in the VNNI pair layout: b[boff + kp*ldb + 2j + h] = B(2kp + h, j), ldb >= 2 nr: one 64-byte
  vector holds columns j..j+15 of both k of a pair, the operand order `vdpbf16ps` and AMX
  `tdpbf16ps` read.
- "dpbf16" (AVX512-BF16): acc(i, j) += A(i,2kp)B(2kp,j) + A(i,2kp+1)B(2kp+1,j), one
  `vdpbf16ps` per 16 columns with the A word broadcast.
  "widen" (any target): the pair split into two float32 vectors (bf16 -> f32 is a 16-bit shift:
  `word << 16` is the even element, `word & 0xffff0000` the odd one) and two `llvm.fma`.
  "amx" (AMX-BF16): see amx_ir; A in rows, kc a multiple of 16, mr and nr 16 or 32.
Taps (a conv over a padded input, as UKSpec's; methods dpbf16, widen, f16c; A packed): the k loop
runs over channels (bf16: channel pairs cp) and each has T taps with compile-time offsets off[t]:
bf16 reads B(channels 2cp + h, pixel off[t] + j) at b[boff + cp*ldb + 2 off[t] + 2j + h] (the
activations stored with channel pairs interleaved: (C/2, H, W, 2), see lowp.PairCvtSpec) and
A(i, 2cp + h, t) at a[aoff + (cp*T + t)*2P + 2i + h]; float16 reads b[boff + c*ldb + off[t] + j]
and a[aoff + (c*T + t)*P + i].
float16 (methods "f16c", "fp16") works on single k, as UKSpec: A packed a[aoff + k*P + i] or rows
a[aoff + i*lda + k]; B rows b[boff + k*ldb + j]; `kc` counts k.
- "f16c" (F16C): each B row vector and A scalar widened (`vcvtph2ps`), float32 `llvm.fma`.
- "fp16" (AVX512-FP16): `fp16_chunk` products accumulated in float16 lanes (`vfmadd231ph`, 32
  columns a vector), the partial sums then widened and added to the float32 accumulators; kc a
  multiple of fp16_chunk. Half the instructions of "f16c" per product, with a float16 rounding
  error on each chunk (see the error bound in tests/test_lowp_kernels.py).

C rows are c[coff + i*ldc + j] (float32); `mask` (i64) has bit j set for valid columns: C loads and
stores are masked, A and B are read in full (pad B's columns to nr with zeros when packing).
`loadc` bit 0 accumulates onto C, bit 1 runs the epilogue (spec.bias: bias[biasoff + i] added to
row i; spec.act: "" | "Relu" | "Clip"), as in UKSpec.

Signature (as UKSpec's, pointers untyped):
    i32 name(ptr a, i64 aoff, i64 lda, ptr b, i64 boff, i64 ldb,
             ptr c, i64 coff, i64 ldc, i64 kc, i64 mask, i64 loadc, ptr bias, i64 biasoff)

Rounding: products of two bf16 (8-bit significands) or two float16 (11 bits) are exact in float32;
every accumulation step rounds once (vdpbf16ps: twice per pair, one per product, as Intel
specifies it), so a k loop of K products has |error| <= gamma(K) * sum_k |A(i,k) B(k,j)| with
gamma(n) = n u / (1 - n u), u = 2^-24. vdpbf16ps and AMX treat subnormal inputs and results as zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .lowp import (CvtSpec, PairCopySpec, best_method, PairCvtSpec, StridedPairCopySpec, strided_pair_copy_ir, bf16_to_f32, column_masks, cvt_ir, f16_to_f32, f32_to_bf16, f32_to_f16,
                   pair_cvt_ir, typed_declaration)
from backends.targets import has_feature
from .ukernel import float_ir
from .ukernel import (ARG_TYPES, LOADC_ACCUMULATE, LOADC_EPILOGUE, MAX_ACC, Declared, DwRowSpec, IRBuilder,
                      close_k_loop, dwrow_ir, dwrow_phase_ir, dwrow_plane_ir, dwrow_split_ir, function_module, ir_mul, lanes_for, open_k_loop, row_epilogue)
from .ukernel_amx import amx_ir


METHODS = {"bf16": ("dpbf16", "widen", "amx"), "f16": ("f16c", "fp16")}
FEATURES = {"dpbf16": "avx512bf16", "widen": "", "amx": "amx-bf16", "f16c": "f16c", "fp16": "avx512fp16"}


@dataclass(frozen=True)
class LowpUKSpec(Declared):
    mr: int                 # rows of the tile
    nr: int                 # columns (multiple of the vector lanes, <= 64; "fp16": of 32; "amx": 16 or 32)
    dtype: str = "bf16"     # "bf16" | "f16": the format of A and B
    method: str = "widen"   # see METHODS / the module docstring; FEATURES says what the target needs
    a_packed: int = 1       # 1: packed panel of P = a_panel rows; 0: rows with stride lda
    a_panel: int = 0
    taps: tuple = ()        # () rows of B; else compile-time tap offsets (pixels) of a conv, the k loop over channels
    bias: int = 0           # as UKSpec: with the epilogue bit, row i gets bias[biasoff + i] (float32)
    act: str = ""           # "" | "Relu" | "Clip" (act_lo, act_hi)
    act_lo: float = 0.0
    act_hi: float = 0.0
    fp16_chunk: int = 4     # "fp16": products summed in float16 before they join the float32 sums
    store: str = "m"        # as UKSpec: "m" masked positional C, "x" compressed (a conv's valid lanes)
    kind: str = "lowp"
    _ARGS: ClassVar[str] = "".join("p" if n in ("a", "b", "c", "bias") else "i" for n in ARG_TYPES)

    def __post_init__(self):
        assert self.method in METHODS[self.dtype], (self.dtype, self.method)
        assert self.a_packed == 0 or self.a_panel >= self.mr, "a packed panel holds at least mr rows"
        assert self.method != "amx" or (self.mr in (16, 32) and self.nr in (16, 32) and not self.a_packed)
        assert not self.taps or (self.a_packed and self.method not in ("amx", "fp16")), "taps: packed A, not amx/fp16"

    def _stem(self) -> str:
        return f"cuvil_uk{self.dtype}_{self.method}_{self.mr}x{self.nr}"

    def declaration(self, var: str) -> str:
        """A and B as uint16 pointers, C and bias as float32 ones."""
        return typed_declaration(self, var, {ARG_TYPES.index("a"): "uint16", ARG_TYPES.index("b"): "uint16"})

    @property
    def k_pairs(self) -> bool:
        """Whether kc counts k pairs (bf16) or single k (f16)."""
        return self.dtype == "bf16"


@dataclass(frozen=True)
class LowpStreamedSpec(LowpUKSpec):
    """A LowpUKSpec (rows of B, no taps) whose operand streams from the L3 or memory, prefetched
    far ahead of the k loop as UKSpec's prefetch_b does for float32:
    - `prefetch_b` rows (bf16: pair rows) of packed B: a large model's weights (gemm.weights_stream);
    - `prefetch_a` k pairs of packed A panels, read once (bf16 Winograd's U of a 7 x 7 stage, 8.4 MB
      a conv), into the next calls' panels (they follow in memory).
    A subclass, so the other 16-bit micro-kernels keep their names and bytes."""
    prefetch_b: int = 0
    prefetch_a: int = 0
    kind: str = "lowpstream"

    def _stem(self) -> str:
        return f"cuvil_uk{self.dtype}_{self.method}_{self.mr}x{self.nr}_stream{'a' if self.prefetch_a else ''}"


@dataclass(frozen=True)
class LowpCalledSpec(LowpUKSpec):
    """LowpUKSpec's kernel, called rather than inlined into the conv's loop (emit.emit_object: the
    `inline` flag). With many taps in one k step (convtappairs.py: 74 for a ResNet stem) and the
    call's operands loop-invariant in the conv's tile or panel loop, the inlined copy had its
    weight broadcasts or B loads hoisted out of the loop and spilled (621 stack accesses, a
    ResNet stem's conv 0.69 ms; called: none, 0.59 ms)."""
    kind: str = "lowpcall"
    inline: ClassVar[bool] = False

    def _stem(self) -> str:
        return f"cuvil_uk{self.dtype}_{self.method}_{self.mr}x{self.nr}_call"


@dataclass(frozen=True)
class LowpOut16Spec(LowpUKSpec):
    """LowpUKSpec's tile (taps or rows, A packed) written straight to a 16-bit C: one call runs the
    whole k loop from zero (loadc is ignored: no partial sums in memory), then per row

        C16[i, j] = round16( act( (acc[i, j] + bias[i]) + R16[i, j] ) )      (bias, R16 optional)

    in registers: store "x" compresses the valid lanes first (the epilogue is elementwise), so the
    residual R16 (`residual`: a 16-bit tensor laid out as C: r[roff + i*ldc + j'] for the j'-th
    stored lane) is read densely like the stores; R16 is widened exactly, the sum rounded once
    (RNE; `cvt` as CvtSpec's float32 -> 16-bit method). The same float32 operations in the same
    order as the tile written in float32, then the bias / residual / activation loop and the
    conversion kernel (convgemm's 16-bit output loop before): bit-identical, without the float32
    tile's round trip through memory.

    Signature: LowpUKSpec's with c a 16-bit pointer, then (ptr r, i64 roff)."""
    residual: int = 0       # 1: add r (16-bit, C's layout) before the activation
    cvt: str = "exact"      # the rounding to 16 bits: "exact" | "hw" (lowp.CvtSpec)
    b_planar: int = 0       # bf16, no taps: B's pair rows are two plain rows, B(2kp + h, j) at
                            # b[boff + kp*ldb + h*ldb/2 + j] (a 1x1 conv reading its 16-bit X in place:
                            # channel planes 2kp, 2kp + 1), interleaved in registers; B loads masked
                            # by `mask` (nothing read past the valid columns)
    c_transposed: int = 0   # 1: C(i, j) at c[coff + j*ldc + i] and R(i, j) at r[roff + j*ldc + i], bias per
                            # column (bias[biasoff + j]); `mask` selects valid columns, every row is stored
                            # (a small-plane 1x1 conv with its pixels as rows: Y's channel planes are columns)
    kind: str = "lowp16"
    _ARGS: ClassVar[str] = LowpUKSpec._ARGS + "pi"

    def __post_init__(self):
        super().__post_init__()
        assert not self.b_planar or (self.dtype == "bf16" and self.taps in ((), (0,))), "planar B: bf16, no taps"
        assert not self.c_transposed or (self.store == "m" and not self.b_planar), "transposed C: masked columns"
        assert self.cvt != CVT_EXACT_NOT_NAN or (
            self.dtype == "bf16" and rounding_after(self.act, self.act_lo, self.act_hi, "exact") == self.cvt), \
            "the NaN-free rounding needs bf16 and an activation without NaN results"

    def _stem(self) -> str:
        return f"cuvil_uk{self.dtype}_{self.method}_{self.mr}x{self.nr}_out16"

    def declaration(self, var: str) -> str:
        """A, B, C and r as uint16 pointers, bias as a float32 one (uint16 without a bias: the call
        passes any of its 16-bit buffers, unread)."""
        sixteen = {ARG_TYPES.index(n): "uint16" for n in ("a", "b", "c") + (() if self.bias else ("bias",))}
        return typed_declaration(self, var, {**sixteen, len(ARG_TYPES): "uint16"})


@dataclass(frozen=True)
class LowpOut16CalledSpec(LowpOut16Spec):
    """LowpOut16Spec's kernel, called rather than inlined, for LowpCalledSpec's reason: a ResNet
    stem's 74 tap pairs in one k step (convtappairs.py), its 16-bit Y written from the registers.

    The k count reaches the loop through a volatile stack slot (one store and one load a call):
    the kernel is internal and every call passes one constant count (a stem: 1 pair), so LLVM's
    interprocedural constant propagation removed the loop, and the 74 taps' 1776 `vdpbf16ps`, one
    straight block from zeroed accumulators, came out with 210 zmm spills (ResNet-18's stem conv
    0.64 ms, the float32-tile path 0.59); with the loop kept, 4 spills (0.54-0.55 ms)."""
    kind: str = "lowp16call"
    inline: ClassVar[bool] = False

    def _stem(self) -> str:
        return f"cuvil_uk{self.dtype}_{self.method}_{self.mr}x{self.nr}_out16_call"


@dataclass(frozen=True)
class LowpOut16TapsSpec(LowpOut16Spec):
    """LowpOut16Spec's transposed tile (c_transposed: rows are pixels, columns output channels) of a
    conv with taps (conv1x1t.py on a small output plane): A is the bf16 phase image read in place
    (a_packed, a_panel = the pair row's length in pixels), and tap t reads it `a_taps[t]` pixels
    further on; B holds, per channel pair kp and tap t, a row block of 2 nr bf16 at
    b[boff + kp*ldb + 2 taps[t] + 2j + h] = W(channel j, 2kp + h, tap t) (conv1x1t packs
    taps[t] = t nr, ldb = T 2 nr):

        acc(i, j) += sum_{kp, t, h} A(pixel i + a_taps[t], 2kp + h) W(j, 2kp + h, t)

    in the order (kp, t, h), as convgemm's tiles sum a conv with taps. Own kind, so the fields of
    LowpOut16Spec's kernels (and their names) stay as they were."""
    a_taps: tuple = ()
    kind: str = "lowp16t"

    def __post_init__(self):
        super().__post_init__()
        assert self.c_transposed and self.dtype == "bf16" and len(self.a_taps) == len(self.taps) > 0, self

    def _stem(self) -> str:
        return f"cuvil_uk{self.dtype}_{self.method}_{self.mr}x{self.nr}_out16t"


def _out16_epilogue(ir: IRBuilder, spec: LowpOut16Spec, final: dict, masks: dict, offsets: dict, dense: dict,
                    crow: dict, L: int) -> None:
    """LowpOut16Spec's stores: compress (store "x"), bias, residual, activation, round, store."""
    vt, vh = f"<{L} x float>", f"<{L} x i16>"
    rows = sorted({i for i, _ in final})
    bias = {}
    for i in rows:
        if spec.bias:
            idx = ir.tmp("bi")
            ir(f"{idx} = add i64 %biasoff, {i}")
            p = ir.tmp("bp")
            ir(f"{p} = getelementptr float, ptr %bias, i64 {idx}")
            bias[i] = _splat(ir, p, "float", L)
    rrow = {i: _element_ptr(ir, "i16", "%r", "%roff", i, "%ldc") for i in rows} if spec.residual else {}
    for (i, v), val in final.items():
        if spec.store == "x":
            packed = ir.tmp("cv")
            ir(f"{packed} = call {vt} @llvm.experimental.vector.compress.v{L}f32({vt} {val}, <{L} x i1> {masks[v]}, "
               f"{vt} poison)")
            val = packed
        if spec.bias:
            y = ir.tmp("eb")
            ir(f"{y} = fadd {vt} {val}, {bias[i]}")
            val = y
        if spec.residual:
            p = ir.tmp("rp")
            ir(f"{p} = getelementptr i16, ptr {rrow[i]}, i64 {offsets[v]}")
            bits = ir.tmp("rb")
            ir(f"{bits} = call {vh} @llvm.masked.load.v{L}i16.p0(ptr align 2 {p}, <{L} x i1> {dense[v]}, "
               f"{vh} zeroinitializer)")
            val = _plus_16(ir, spec, val, bits, L)
        out = _rounded_16(ir, spec, val, L)
        p = ir.tmp("cp")
        ir(f"{p} = getelementptr i16, ptr {crow[i]}, i64 {offsets[v]}")
        ir(f"call void @llvm.masked.store.v{L}i16.p0({vh} {out}, ptr align 2 {p}, <{L} x i1> {dense[v]})")


def _plus_16(ir: IRBuilder, spec, val: str, bits: str, L: int) -> str:
    """val + the 16-bit residual lanes `bits` widened to float32 (exact)."""
    vt, vi = f"<{L} x float>", f"<{L} x i32>"
    wide = bf16_to_f32(ir, bits, L) if spec.dtype == "bf16" else f16_to_f32(ir, bits, L, spec.cvt)
    res = ir.tmp("rf")
    ir(f"{res} = bitcast {vi} {wide} to {vt}")
    y = ir.tmp("er")
    ir(f"{y} = fadd {vt} {val}, {res}")
    return y


def _rounded_16(ir: IRBuilder, spec, val: str, L: int) -> str:
    """The activation of val, rounded once to the spec's 16-bit format: the lanes to store."""
    vt, vi = f"<{L} x float>", f"<{L} x i32>"
    val = _activation(ir, spec, val, vt, L)
    bits = ir.tmp("yb")
    ir(f"{bits} = bitcast {vt} {val} to {vi}")
    if spec.cvt == CVT_EXACT_NOT_NAN:
        return _bf16_rne_not_nan(ir, bits, L)
    to16 = f32_to_bf16 if spec.dtype == "bf16" else f32_to_f16
    return to16(ir, bits, L, spec.cvt)


# LowpOut16Spec.cvt (bf16) after an activation that never yields NaN: Relu (llvm.maxnum(NaN, 0) is
# 0) or a Clip with a finite bound. lowp.f32_to_bf16's "exact" rounding without its NaN lanes (4 of
# its 10 vector instructions): the same bits for every value it can get. 1x1 convs over 64 channels
# spend 10-15 % of a tile's time in the exact rounding (micro-kernel alone: 8 x 48, bias + residual
# + Relu, K = 64: 63 % of the vdpbf16ps peak; 74 % with `vcvtneps2bf16`, which flushes subnormals).
CVT_EXACT_NOT_NAN = "exact-not-nan"


def rounding_after(act: str, act_lo: float, act_hi: float, cvt: str) -> str:
    """The LowpOut16Spec.cvt for a bf16 tile rounded `cvt` after the activation: CVT_EXACT_NOT_NAN
    where that is "exact" and the activation leaves no NaN, else `cvt`."""
    finite = lambda x: abs(x) != float("inf")
    no_nan = act == "Relu" or (act == "Clip" and (finite(act_lo) or finite(act_hi)))
    return CVT_EXACT_NOT_NAN if cvt == "exact" and no_nan else cvt


def _bf16_rne_not_nan(ir: IRBuilder, bits: str, L: int) -> str:
    """<L x i16> bf16 bits of the float32 bits `bits` (not NaN): round to nearest even,
    (bits + 0x7FFF + bit 16 of bits) >> 16, as f32_to_bf16's "exact" for every non-NaN value
    (subnormals included; a carry into the exponent is the rounding up to the next binade or inf)."""
    vi = f"<{L} x i32>"
    splat = lambda value: "<" + ", ".join([f"i32 {value}"] * L) + ">"
    high = ir.tmp("rh")
    ir(f"{high} = lshr {vi} {bits}, {splat(16)}")
    lsb = ir.tmp("rl")
    ir(f"{lsb} = and {vi} {high}, {splat(1)}")
    biased = ir.tmp("rs")
    ir(f"{biased} = add {vi} {bits}, {splat(0x7FFF)}")
    rounded = ir.tmp("rr")
    ir(f"{rounded} = add {vi} {biased}, {lsb}")
    result = ir.tmp("rt")
    ir(f"{result} = lshr {vi} {rounded}, {splat(16)}")
    out = ir.tmp("rw")
    ir(f"{out} = trunc {vi} {result} to <{L} x i16>")
    return out


def _transpose_labels() -> list:
    """The two-input shuffles that turn 8 vectors P_i of 16 lanes (lane c: column c of row i) into
    Q_k (lanes 0-7: column 2k of rows 0-7, lanes 8-15: column 2k + 1): three levels of 8 shuffles,
    each output made of the two inputs that hold its lanes. Returns per level a list of
    (input a, input b, lane indices into a ++ b); inputs and outputs are indices of that level."""
    level = [[(i, c) for c in range(16)] for i in range(8)]
    plan = []
    for size in (2, 4, 8):   # rows per group, then columns per output: 8, 4, 2
        cols = 16 // size
        out, steps = [], []
        for g in range(8 // size):
            rows = range(g * size, (g + 1) * size)
            for t in range(16 // cols):
                want = ([(i, c) for c in range(t * cols, (t + 1) * cols) for i in rows] if size < 8 else
                        [(i, 2 * t) for i in rows] + [(i, 2 * t + 1) for i in rows])
                src = [k for k, vec in enumerate(level) if set(want) & set(vec)]
                assert len(src) == 2, (size, g, t, src)
                both = level[src[0]] + level[src[1]]
                steps.append((src[0], src[1], [both.index(x) for x in want]))
                out.append(want)
        plan.append(steps)
        level = out
    return plan


_TRANSPOSE_8x16 = _transpose_labels()


def _out16_transposed_blocks(ir: IRBuilder, spec: LowpOut16Spec, final: dict, masks: dict, L: int) -> None:
    """LowpOut16Spec.c_transposed's stores with 16 lanes and at most 8 rows: per column vector v,
    the mr row vectors (bias added) are transposed in registers (_TRANSPOSE_8x16: 24 two-input
    shuffles) into 8 vectors of two columns x 8 rows; each half is one C column's mr consecutive
    elements, so the residual is two masked loads and the result two masked stores per vector
    (`vmovdqu16` with a mask): 16 of each per 16 columns, where gathers and scatters of 16-bit
    lanes are 16 element moves each. The same operations per element in the same order as
    _out16_transposed: bit-identical."""
    vt, vh, v8 = f"<{L} x float>", f"<{L} x i16>", "<8 x i16>"
    cbase = ir.tmp("cb")
    ir(f"{cbase} = getelementptr i16, ptr %c, i64 %coff")
    rbase = ir.tmp("rbase")
    ir(f"{rbase} = getelementptr i16, ptr %r, i64 %roff")
    rows_mask = "<" + ", ".join(f"i1 {int(j < spec.mr)}" for j in range(8)) + ">"
    for v in sorted({v for _, v in final}):
        if spec.bias:
            off = ir.tmp("bo")
            ir(f"{off} = add i64 %biasoff, {v * L}")
            p = ir.tmp("bp")
            ir(f"{p} = getelementptr float, ptr %bias, i64 {off}")
            bias = ir.tmp("bv")
            ir(f"{bias} = call {vt} @llvm.masked.load.v{L}f32.p0(ptr align 4 {p}, <{L} x i1> {masks[v]}, "
               f"{vt} zeroinitializer)")
        level = []
        for i in range(8):
            if i >= spec.mr:
                level.append("zeroinitializer")
                continue
            val = final[i, v]
            if spec.bias:
                y = ir.tmp("eb")
                ir(f"{y} = fadd {vt} {val}, {bias}")
                val = y
            level.append(val)
        for steps in _TRANSPOSE_8x16:
            nxt = []
            for a, b, lanes in steps:
                out = ir.tmp("tq")
                ir(f"{out} = shufflevector {vt} {level[a]}, {vt} {level[b]}, <{L} x i32> "
                   f"<{', '.join(f'i32 {x}' for x in lanes)}>")
                nxt.append(out)
            level = nxt
        for k, val in enumerate(level):
            halves = []
            for h in (0, 1):
                col = v * L + 2 * k + h
                bit = ir.tmp("cbit")
                ir(f"{bit} = extractelement <{L} x i1> {masks[v]}, i64 {2 * k + h}")
                m = ir.tmp("cm")
                ir(f"{m} = select i1 {bit}, <8 x i1> {rows_mask}, <8 x i1> zeroinitializer")
                at = ir.tmp("co")
                ir(f"{at} = mul i64 %ldc, {col}")
                halves.append((m, at))
            if spec.residual:
                parts = []
                for m, at in halves:
                    rp = ir.tmp("rp")
                    ir(f"{rp} = getelementptr i16, ptr {rbase}, i64 {at}")
                    x = ir.tmp("rh")
                    ir(f"{x} = call {v8} @llvm.masked.load.v8i16.p0(ptr align 2 {rp}, <8 x i1> {m}, {v8} zeroinitializer)")
                    parts.append(x)
                bits = ir.tmp("rb")
                ir(f"{bits} = shufflevector {v8} {parts[0]}, {v8} {parts[1]}, <{L} x i32> "
                   f"<{', '.join(f'i32 {j}' for j in range(L))}>")
                val = _plus_16(ir, spec, val, bits, L)
            out = _rounded_16(ir, spec, val, L)
            for h, (m, at) in enumerate(halves):
                half = ir.tmp("yh")
                ir(f"{half} = shufflevector {vh} {out}, {vh} poison, <8 x i32> "
                   f"<{', '.join(f'i32 {8 * h + j}' for j in range(8))}>")
                cp = ir.tmp("cp")
                ir(f"{cp} = getelementptr i16, ptr {cbase}, i64 {at}")
                ir(f"call void @llvm.masked.store.v8i16.p0({v8} {half}, ptr align 2 {cp}, <8 x i1> {m})")


def _out16_transposed(ir: IRBuilder, spec: LowpOut16Spec, final: dict, masks: dict, L: int) -> None:
    """LowpOut16Spec.c_transposed's stores: accumulator (i, v) holds C(i, vL..vL+L-1); the bias is a
    vector of L columns, the residual gathered and the result scattered at stride ldc (16-bit
    lanes: LLVM writes them one by one)."""
    if L == 16 and spec.mr <= 8:
        return _out16_transposed_blocks(ir, spec, final, masks, L)
    vt, vh = f"<{L} x float>", f"<{L} x i16>"
    lanes = "<" + ", ".join(f"i64 {j}" for j in range(L)) + ">"
    ldc = ir.tmp("ldcv")
    ir(f"{ldc}0 = insertelement <{L} x i64> poison, i64 %ldc, i64 0")
    ir(f"{ldc} = shufflevector <{L} x i64> {ldc}0, <{L} x i64> poison, <{L} x i32> zeroinitializer")
    cbase = ir.tmp("cb")
    ir(f"{cbase} = getelementptr i16, ptr %c, i64 %coff")
    rbase = ir.tmp("rbase")
    ir(f"{rbase} = getelementptr i16, ptr %r, i64 %roff")
    column = {}   # v -> <L x i64> (vL + lane) * ldc
    bias = {}
    for v in sorted({v for _, v in final}):
        idx = ir.tmp("cj")
        ir(f"{idx} = add <{L} x i64> {lanes}, <{', '.join([f'i64 {v * L}'] * L)}>")
        column[v] = ir.tmp("cjl")
        ir(f"{column[v]} = mul <{L} x i64> {idx}, {ldc}")
        if spec.bias:
            off = ir.tmp("bo")
            ir(f"{off} = add i64 %biasoff, {v * L}")
            p = ir.tmp("bp")
            ir(f"{p} = getelementptr float, ptr %bias, i64 {off}")
            bias[v] = ir.tmp("bv")
            ir(f"{bias[v]} = call {vt} @llvm.masked.load.v{L}f32.p0(ptr align 4 {p}, <{L} x i1> {masks[v]}, "
               f"{vt} zeroinitializer)")
    for (i, v), val in final.items():
        if spec.bias:
            y = ir.tmp("eb")
            ir(f"{y} = fadd {vt} {val}, {bias[v]}")
            val = y
        if spec.residual:
            rp = ir.tmp("rp")
            ir(f"{rp} = getelementptr i16, ptr {rbase}, i64 {i}")
            ptrs = ir.tmp("rps")
            ir(f"{ptrs} = getelementptr i16, ptr {rp}, <{L} x i64> {column[v]}")
            bits = ir.tmp("rb")
            ir(f"{bits} = call {vh} @llvm.masked.gather.v{L}i16.v{L}p0(<{L} x ptr> {ptrs}, i32 2, <{L} x i1> {masks[v]}, "
               f"{vh} zeroinitializer)")
            val = _plus_16(ir, spec, val, bits, L)
        out = _rounded_16(ir, spec, val, L)
        cp = ir.tmp("cp")
        ir(f"{cp} = getelementptr i16, ptr {cbase}, i64 {i}")
        ptrs = ir.tmp("cps")
        ir(f"{ptrs} = getelementptr i16, ptr {cp}, <{L} x i64> {column[v]}")
        ir(f"call void @llvm.masked.scatter.v{L}i16.v{L}p0({vh} {out}, <{L} x ptr> {ptrs}, i32 2, <{L} x i1> {masks[v]})")


def _activation(ir: IRBuilder, spec: LowpUKSpec, x: str, vt: str, L: int) -> str:
    """act(x) for spec.act "" | "Relu" | "Clip" (as row_epilogue's, without its epilogue-bit select)."""
    def splat(value: float) -> str:
        return f"<{', '.join([f'float {float_ir(value)}'] * L)}>"
    bounds = {"": (), "Relu": (("maxnum", 0.0),),
              "Clip": (("maxnum", spec.act_lo), ("minnum", spec.act_hi))}[spec.act]
    for op, bound in bounds:
        if abs(bound) == float("inf"):
            continue
        y = ir.tmp("ea")
        ir(f"{y} = call {vt} @llvm.{op}.v{L}f32({vt} {x}, {vt} {splat(bound)})")
        x = y
    return x


def lowp_ukernel_ir(spec: LowpUKSpec, vector_bits: int) -> str:
    """The LLVM IR (a module of one function named spec.name) for the target's vector width."""
    if spec.method == "amx":
        return amx_ir(spec)
    L = 16 if spec.method in ("dpbf16", "fp16") else min(lanes_for(vector_bits), 16)
    assert spec.nr % L == 0 and spec.nr <= 64, (spec.nr, L)
    V = spec.nr // L
    vt = f"<{L} x float>"
    out16 = isinstance(spec, LowpOut16Spec)
    ir = IRBuilder()
    ir.label("entry")
    if spec.method == "fp16":   # the k loop counts chunks of fp16_chunk k
        ir(f"%kc = sdiv i64 %k_total, {spec.fp16_chunk}")
    ir(f"%accw = and i64 %loadc, {LOADC_ACCUMULATE}")
    ir("%acc = icmp ne i64 %accw, 0")
    ir(f"%epiw = and i64 %loadc, {LOADC_EPILOGUE}")
    ir("%epi = icmp ne i64 %epiw, 0")
    opaque_k = out16 and not getattr(spec, "inline", True)
    if opaque_k:   # see LowpOut16CalledSpec: the k count through a volatile slot, unknown to LLVM
        ir("%kc.slot = alloca i64")
        ir("store volatile i64 %kc.arg, ptr %kc.slot")
        ir("%kc = load volatile i64, ptr %kc.slot")
    masks = column_masks(ir, V, L)
    offsets, dense = _compressed_offsets(ir, V, L) if spec.store == "x" else ({v: str(v * L) for v in range(V)}, masks)
    crow = {i: _element_ptr(ir, "i16" if out16 else "float", "%c", "%coff", i, "%ldc") for i in range(spec.mr)}
    abase = _element_ptr(ir, "i16", "%a", "%aoff", 0, "%lda")
    arow = {i: _element_ptr(ir, "i16", "%a", "%aoff", i, "%lda") for i in range(spec.mr)} if not spec.a_packed else {}
    ir("%bbase = getelementptr i16, ptr %b, i64 %boff")
    a_taps = getattr(spec, "a_taps", ())
    a_tap_base = {}
    for t, pixels in enumerate(a_taps):
        a_tap_base[t] = ir.tmp("atap")
        ir(f"{a_tap_base[t]} = getelementptr i16, ptr {abase}, i64 {2 * pixels}")
    if out16 and spec.b_planar:
        ir("%ldb_half = sdiv i64 %ldb, 2")
        for v in range(V):   # the column masks again, under the names the planar B loads use
            ir(f"%bmask{v} = or <{L} x i1> {masks[v]}, zeroinitializer")
    step = _STEPS[spec.method]
    budget = MAX_ACC[L] - (4 if spec.method == "widen" else 0)   # B pairs widened to two vectors take registers
    per_chunk = max(1, min(V, budget // spec.mr))
    if spec.method == "fp16":   # whole 32-column float16 vectors per chunk; their partial sums take registers too
        assert spec.nr % 32 == 0, spec.nr
        per_chunk = max(2, min(V, (2 * MAX_ACC[L] // 3) // spec.mr) // 2 * 2)
    chunks = [list(range(v0, min(V, v0 + per_chunk))) for v0 in range(0, V, per_chunk)]
    rename = {}
    ir("br label %chunk0")
    for ci, vecs in enumerate(chunks):
        ir.label(f"chunk{ci}")
        if out16:   # from zero, whatever loadc says
            ir(f"br label %pre{ci}")
            ir.label(f"pre{ci}")
            init = {(i, v): "zeroinitializer" for i in range(spec.mr) for v in vecs}
        else:
            init = _load_c_tile(ir, spec, ci, vecs, crow, offsets, masks, vt, L)
        ir(f"br label %loop{ci}")
        kv, accs = open_k_loop(ir, ci, init, vt, f"%loop{ci}")
        cur = dict(accs)
        brow = _b_row(ir, kv) if spec.method != "fp16" else None
        per_k = 2 if spec.k_pairs else 1
        if brow is not None and getattr(spec, "prefetch_b", 0):
            _prefetch_b_row(ir, brow, spec.prefetch_b, spec.nr * per_k)
        if getattr(spec, "prefetch_a", 0) and ci == 0:
            ahead = ir.tmp("pfa")
            ir(f"{ahead} = add i64 {kv}, {spec.prefetch_a}")
            ir(f"call void @llvm.prefetch.p0(ptr {_a_address(ir, spec, ahead, 0, abase, arow)}, i32 0, i32 3, i32 1)")
        for t, off in enumerate(spec.taps or (0,)):
            ka = kv
            if a_taps:   # LowpOut16TapsSpec: A (pixel rows) shifted by the tap, B's row block (kv, t)
                step(ir, spec, ka, brow, per_k * off, vecs, L, a_tap_base[t], arow, cur)
                continue
            if spec.taps:   # A's k index: channel (pair) kv, tap t
                ka = ir.tmp("ka")
                ir(f"{ka} = add i64 {ir_mul(ir, kv, len(spec.taps))}, {t}")
            step(ir, spec, ka, brow, per_k * off, vecs, L, abase, arow, cur)
        final = close_k_loop(ir, ci, kv, accs, cur, rename)
        if out16:
            if spec.c_transposed:
                _out16_transposed(ir, spec, final, masks, L)
            else:
                _out16_epilogue(ir, spec, final, masks, offsets, dense, crow, L)
            ir(f"br label %{f'chunk{ci + 1}' if ci + 1 < len(chunks) else 'done'}")
            continue
        if spec.bias or spec.act:
            final = row_epilogue(ir, spec, final, vt, L)
        for (i, v), val in final.items():
            p = ir.tmp("cp")
            ir(f"{p} = getelementptr float, ptr {crow[i]}, i64 {offsets[v]}")
            if spec.store == "x":   # compressed in a register (see ukernel.py: a compress store is microcoded on Zen 4)
                packed = ir.tmp("cv")
                ir(f"{packed} = call {vt} @llvm.experimental.vector.compress.v{L}f32({vt} {val}, <{L} x i1> {masks[v]}, "
                   f"{vt} poison)")
                val = packed
            ir(f"call void @llvm.masked.store.v{L}f32.p0({vt} {val}, ptr align 4 {p}, <{L} x i1> {dense[v]})")
        ir(f"br label %{f'chunk{ci + 1}' if ci + 1 < len(chunks) else 'done'}")
    ir.label("done")
    ir("ret i32 0")
    args = ", ".join(f"ptr {'' if n == 'c' else 'noalias '}%{n}" if n in ("a", "b", "c", "bias") else f"i64 %{n}"
                     for n in ARG_TYPES)
    if out16:
        args += ", ptr noalias %r, i64 %roff"
    if spec.method == "fp16":
        args = args.replace("i64 %kc,", "i64 %k_total,")
    if opaque_k:
        args = args.replace("i64 %kc,", "i64 %kc.arg,")
    head = f"define i32 @{spec.name}({args}) #0 {{"
    decls = [f"declare {vt} @llvm.fma.v{L}f32({vt}, {vt}, {vt})",
             f"declare {vt} @llvm.masked.load.v{L}f32.p0(ptr, <{L} x i1>, {vt})",
             f"declare void @llvm.masked.store.v{L}f32.p0({vt}, ptr, <{L} x i1>)",
             f"declare {vt} @llvm.maxnum.v{L}f32({vt}, {vt})",
             f"declare {vt} @llvm.masked.expandload.v{L}f32(ptr, <{L} x i1>, {vt})",
             f"declare {vt} @llvm.experimental.vector.compress.v{L}f32({vt}, <{L} x i1>, {vt})",
             "declare i64 @llvm.ctpop.i64(i64)",
             f"declare {vt} @llvm.minnum.v{L}f32({vt}, {vt})",
             "declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)",
             "declare <32 x half> @llvm.fma.v32f16(<32 x half>, <32 x half>, <32 x half>)"]
    if getattr(spec, "prefetch_b", 0) or getattr(spec, "prefetch_a", 0):
        decls.append("declare void @llvm.prefetch.p0(ptr, i32, i32, i32)")
    if out16:
        decls += [f"declare <{L} x i16> @llvm.masked.load.v{L}i16.p0(ptr, <{L} x i1>, <{L} x i16>)",
                  f"declare void @llvm.masked.store.v{L}i16.p0(<{L} x i16>, ptr, <{L} x i1>)"]
    if out16 and spec.c_transposed and L == 16 and spec.mr <= 8:
        decls += ["declare <8 x i16> @llvm.masked.load.v8i16.p0(ptr, <8 x i1>, <8 x i16>)",
                  "declare void @llvm.masked.store.v8i16.p0(<8 x i16>, ptr, <8 x i1>)"]
    elif out16 and spec.c_transposed:
        decls += [f"declare <{L} x i16> @llvm.masked.gather.v{L}i16.v{L}p0(<{L} x ptr>, i32, <{L} x i1>, <{L} x i16>)",
                  f"declare void @llvm.masked.scatter.v{L}i16.v{L}p0(<{L} x i16>, <{L} x ptr>, i32, <{L} x i1>)"]
    return function_module(head, ir, rename, decls)


def _load_c_tile(ir: IRBuilder, spec: LowpUKSpec, ci: int, vecs, crow: dict, offsets: dict, masks: dict, vt: str,
                 L: int) -> dict:
    """Block ld<ci> loading the float32 C tile (loadc's accumulate bit) and block pre<ci> choosing
    it or zero: the accumulators' initial values."""
    ir(f"br i1 %acc, label %ld{ci}, label %pre{ci}")
    ir.label(f"ld{ci}")
    loaded = {}
    for i in range(spec.mr):
        for v in vecs:
            p = ir.tmp("cp")
            ir(f"{p} = getelementptr float, ptr {crow[i]}, i64 {offsets[v]}")
            x = ir.tmp("c")
            if spec.store == "x":
                ir(f"{x} = call {vt} @llvm.masked.expandload.v{L}f32(ptr {p}, <{L} x i1> {masks[v]}, "
                   f"{vt} zeroinitializer)")
            else:
                ir(f"{x} = call {vt} @llvm.masked.load.v{L}f32.p0(ptr align 4 {p}, <{L} x i1> {masks[v]}, "
                   f"{vt} zeroinitializer)")
            loaded[i, v] = x
    ir(f"br label %pre{ci}")
    ir.label(f"pre{ci}")
    init = {}
    for key, x in loaded.items():
        init[key] = ir.tmp("i")
        ir(f"{init[key]} = phi {vt} [ {x}, %ld{ci} ], [ zeroinitializer, %chunk{ci} ]")
    return init


def _compressed_offsets(ir: IRBuilder, V: int, L: int) -> tuple[dict, dict]:
    """store "x": where each vector's valid lanes go (the popcounts of the masks before it) and the
    masks of its first popcount lanes, as ukernel.py's compressed stores."""
    offsets, dense, running = {}, {}, "0"
    for v in range(V):
        offsets[v] = running
        seg, cnt = ir.tmp("seg"), ir.tmp("cnt")
        ir(f"{seg} = lshr i64 %mask, {v * L}")
        ir(f"{seg}m = and i64 {seg}, {(1 << L) - 1}")
        ir(f"{cnt} = call i64 @llvm.ctpop.i64(i64 {seg}m)")
        running = ir.tmp("off")
        ir(f"{running} = add i64 {offsets[v]}, {cnt}")
        low = ir.tmp("low")
        ir(f"{low} = shl i64 1, {cnt}")
        ir(f"{low}s = sub i64 {low}, 1")
        ir(f"{low}t = trunc i64 {low}s to i{L}")
        dense[v] = ir.tmp("dm")
        ir(f"{dense[v]} = bitcast i{L} {low}t to <{L} x i1>")
    return offsets, dense


def _element_ptr(ir: IRBuilder, elem: str, base: str, offset: str, row: int, stride: str) -> str:
    """&base[offset + row * stride] for elements of type `elem`."""
    idx = ir.tmp("ri")
    ir(f"{idx} = mul i64 {stride}, {row}")
    idx2 = ir.tmp("ri")
    ir(f"{idx2} = add i64 {offset}, {idx}")
    ptr = ir.tmp("row")
    ir(f"{ptr} = getelementptr {elem}, ptr {base}, i64 {idx2}")
    return ptr


def _a_address(ir: IRBuilder, spec: LowpUKSpec, kv: str, i: int, abase: str, arow: dict) -> str:
    """The address of A(i, k) (f16) or of the pair word A(i, 2kp..2kp+1) (bf16) for loop index kv."""
    per_k = 2 if spec.k_pairs else 1
    idx = ir.tmp("ai")
    if spec.a_packed:
        ir(f"{idx} = mul i64 {kv}, {per_k * spec.a_panel}")
        idx2 = ir.tmp("ai")
        ir(f"{idx2} = add i64 {idx}, {per_k * i}")
        p = ir.tmp("ap")
        ir(f"{p} = getelementptr i16, ptr {abase}, i64 {idx2}")
        return p
    ir(f"{idx} = mul i64 {kv}, {per_k}")
    p = ir.tmp("ap")
    ir(f"{p} = getelementptr i16, ptr {arow[i]}, i64 {idx}")
    return p


def _b_row(ir: IRBuilder, kv: str) -> str:
    idx = ir.tmp("bk")
    ir(f"{idx} = mul i64 {kv}, %ldb")
    p = ir.tmp("brow")
    ir(f"{p} = getelementptr i16, ptr %bbase, i64 {idx}")
    return p


def _prefetch_b_row(ir: IRBuilder, brow: str, rows: int, elements: int) -> None:
    """Prefetch the B row (`elements` 16-bit values) `rows` rows of ldb past brow into L1."""
    ahead = ir.tmp("pfb")
    ir(f"{ahead} = mul i64 %ldb, {rows}")
    p = ir.tmp("pfp")
    ir(f"{p} = getelementptr i16, ptr {brow}, i64 {ahead}")
    for j in range(-(-elements * 2 // 64)):
        q = ir.tmp("pfq")
        ir(f"{q} = getelementptr i8, ptr {p}, i64 {64 * j}")
        ir(f"call void @llvm.prefetch.p0(ptr {q}, i32 0, i32 3, i32 1)")


def _load(ir: IRBuilder, ptr: str, offset: int, vtype: str) -> str:
    p = ir.tmp("bp")
    ir(f"{p} = getelementptr i16, ptr {ptr}, i64 {offset}")
    x = ir.tmp("b")
    ir(f"{x} = load {vtype}, ptr {p}, align 2")
    return x


def _splat(ir: IRBuilder, ptr: str, elem: str, lanes: int) -> str:
    """<lanes x elem> with every lane the scalar at ptr (an A value, or an A pair as an i32 word)."""
    s = ir.tmp("as")
    ir(f"{s} = load {elem}, ptr {ptr}, align 2")
    ins = ir.tmp("ins")
    ir(f"{ins} = insertelement <{lanes} x {elem}> poison, {elem} {s}, i64 0")
    out = ir.tmp("asp")
    ir(f"{out} = shufflevector <{lanes} x {elem}> {ins}, <{lanes} x {elem}> poison, <{lanes} x i32> zeroinitializer")
    return out


def _fma(ir: IRBuilder, L: int, a: str, b: str, acc: str) -> str:
    out = ir.tmp("f")
    ir(f"{out} = call <{L} x float> @llvm.fma.v{L}f32(<{L} x float> {a}, <{L} x float> {b}, <{L} x float> {acc})")
    return out


def _step_dpbf16(ir: IRBuilder, spec: LowpUKSpec, ka: str, brow: str, tap: int, vecs, L: int, abase: str, arow: dict,
                 cur: dict) -> None:
    """One k pair (one tap): vdpbf16ps of each row's broadcast pair word with each B vector."""
    if getattr(spec, "b_planar", 0):
        bvec = {v: _planar_pairs(ir, brow, v, L, "bfloat") for v in vecs}
    else:
        bvec = {v: _load(ir, brow, tap + 2 * v * L, "<32 x bfloat>") for v in vecs}
    for i in range(spec.mr):
        word = _splat(ir, _a_address(ir, spec, ka, i, abase, arow), "i32", 16)
        pair = ir.tmp("ab")
        ir(f"{pair} = bitcast <16 x i32> {word} to <32 x bfloat>")
        for v in vecs:
            out = ir.tmp("d")
            ir(f"{out} = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> {cur[i, v]}, "
               f"<32 x bfloat> {pair}, <32 x bfloat> {bvec[v]})")
            cur[i, v] = out


def _planar_rows(ir: IRBuilder, brow: str, v: int, L: int) -> tuple[str, str]:
    """LowpOut16Spec.b_planar: columns v*L.. of B's two rows of pair kp (<L x i16> each, masked by
    the tile's column mask: no read past the valid columns)."""
    rows = []
    for h in (0, 1):
        p = ir.tmp("bp")
        ir(f"{p} = getelementptr i16, ptr {brow}, i64 {v * L}")
        if h:
            q = ir.tmp("bp")
            ir(f"{q} = getelementptr i16, ptr {p}, i64 %ldb_half")
            p = q
        x = ir.tmp("b")
        ir(f"{x} = call <{L} x i16> @llvm.masked.load.v{L}i16.p0(ptr align 2 {p}, <{L} x i1> %bmask{v}, "
           f"<{L} x i16> zeroinitializer)")
        rows.append(x)
    return rows[0], rows[1]


def _planar_pairs(ir: IRBuilder, brow: str, v: int, L: int, elem: str) -> str:
    """<2L x elem>: the two planar rows interleaved into pair words (the layout vdpbf16ps reads)."""
    even, odd = _planar_rows(ir, brow, v, L)
    interleave = "<" + ", ".join(f"i32 {j // 2 + (j % 2) * L}" for j in range(2 * L)) + ">"
    pairs = ir.tmp("bi")
    ir(f"{pairs} = shufflevector <{L} x i16> {even}, <{L} x i16> {odd}, <{2 * L} x i32> {interleave}")
    out = ir.tmp("bv")
    ir(f"{out} = bitcast <{2 * L} x i16> {pairs} to <{2 * L} x {elem}>")
    return out


def _planar_split(ir: IRBuilder, brow: str, v: int, L: int) -> tuple[str, str]:
    """The float32 vectors of the two planar rows ("widen": bf16 -> f32 is a 16-bit shift)."""
    out = []
    for row in _planar_rows(ir, brow, v, L):
        bits = bf16_to_f32(ir, row, L)
        f = ir.tmp("wf")
        ir(f"{f} = bitcast <{L} x i32> {bits} to <{L} x float>")
        out.append(f)
    return out[0], out[1]


def _split_pairs(ir: IRBuilder, words: str, L: int) -> tuple[str, str]:
    """The float32 vectors of the even and odd bf16 of <L x i32> pair words."""
    vi = f"<{L} x i32>"
    even = ir.tmp("ev")
    ir(f"{even} = shl {vi} {words}, <{', '.join(['i32 16'] * L)}>")
    odd = ir.tmp("od")
    ir(f"{odd} = and {vi} {words}, <{', '.join(['i32 -65536'] * L)}>")
    out = []
    for x in (even, odd):
        f = ir.tmp("wf")
        ir(f"{f} = bitcast {vi} {x} to <{L} x float>")
        out.append(f)
    return out[0], out[1]


def _step_widen(ir: IRBuilder, spec: LowpUKSpec, ka: str, brow: str, tap: int, vecs, L: int, abase: str, arow: dict,
                cur: dict) -> None:
    """One k pair (one tap): B's pairs and each row's A pair split into float32 (shifts), two FMAs."""
    if getattr(spec, "b_planar", 0):
        bpair = {v: _planar_split(ir, brow, v, L) for v in vecs}
    else:
        bpair = {v: _split_pairs(ir, _load(ir, brow, tap + 2 * v * L, f"<{L} x i32>"), L) for v in vecs}
    for i in range(spec.mr):
        a_even, a_odd = _split_pairs(ir, _splat(ir, _a_address(ir, spec, ka, i, abase, arow), "i32", L), L)
        for v in vecs:
            cur[i, v] = _fma(ir, L, a_odd, bpair[v][1], _fma(ir, L, a_even, bpair[v][0], cur[i, v]))


def _step_f16c(ir: IRBuilder, spec: LowpUKSpec, ka: str, brow: str, tap: int, vecs, L: int, abase: str, arow: dict,
               cur: dict) -> None:
    """One k (one tap): B's row widened by vcvtph2ps, each row's A widened and broadcast, FMAs."""
    bvec = {}
    for v in vecs:
        h = _load(ir, brow, tap + v * L, f"<{L} x half>")
        bvec[v] = ir.tmp("bw")
        ir(f"{bvec[v]} = fpext <{L} x half> {h} to <{L} x float>")
    for i in range(spec.mr):
        # broadcast, then widen: vpbroadcastw + vcvtph2ps (a scalar widening then vbroadcastss is one more)
        halves = _splat(ir, _a_address(ir, spec, ka, i, abase, arow), "half", L)
        splat = ir.tmp("af")
        ir(f"{splat} = fpext <{L} x half> {halves} to <{L} x float>")
        for v in vecs:
            cur[i, v] = _fma(ir, L, splat, bvec[v], cur[i, v])


def _step_fp16(ir: IRBuilder, spec: LowpUKSpec, ka: str, brow: str, tap: int, vecs, L: int, abase: str, arow: dict,
               cur: dict) -> None:
    """fp16_chunk k (the loop index ka counts chunks; no taps, brow unused): float16 FMAs on 32 columns
    a vector, then the partial sums widened to float32 and added. vecs index 16-column float32
    accumulators."""
    halves = sorted({v // 2 for v in vecs})
    partial = {(i, h): "zeroinitializer" for i in range(spec.mr) for h in halves}
    for step in range(spec.fp16_chunk):
        k = ir.tmp("k")
        ir(f"{k} = mul i64 {ka}, {spec.fp16_chunk}")
        kk = ir.tmp("k")
        ir(f"{kk} = add i64 {k}, {step}")
        brow = _b_row(ir, kk)
        bvec = {h: _load(ir, brow, 32 * h, "<32 x half>") for h in halves}
        for i in range(spec.mr):
            splat = _splat(ir, _a_address(ir, spec, kk, i, abase, arow), "half", 32)
            for h in halves:
                out = ir.tmp("hf")
                ir(f"{out} = call <32 x half> @llvm.fma.v32f16(<32 x half> {splat}, <32 x half> {bvec[h]}, "
                   f"<32 x half> {partial[i, h]})")
                partial[i, h] = out
    for (i, h), sums in partial.items():
        for part in (0, 1):
            v = 2 * h + part
            if v not in vecs:
                continue
            lanes = ", ".join(f"i32 {16 * part + j}" for j in range(16))
            piece = ir.tmp("hp")
            ir(f"{piece} = shufflevector <32 x half> {sums}, <32 x half> poison, <16 x i32> <{lanes}>")
            wide = ir.tmp("hw")
            ir(f"{wide} = fpext <16 x half> {piece} to <16 x float>")
            out = ir.tmp("s")
            ir(f"{out} = fadd <16 x float> {cur[i, v]}, {wide}")
            cur[i, v] = out


_STEPS = {"dpbf16": _step_dpbf16, "widen": _step_widen, "f16c": _step_f16c, "fp16": _step_fp16}


def method_for(dtype: str, target) -> str | None:
    """The default method of a CpuTarget (backends.targets.has_feature decides): bf16 "dpbf16" with
    AVX512-BF16, else "widen"; float16 "f16c" with F16C, else None (widen the operands to float32
    and use UKSpec). "amx" and "fp16" are never chosen by default: neither has run on hardware yet."""
    if dtype == "bf16":
        return "dpbf16" if has_feature(target, FEATURES["dpbf16"]) and target.vector_bits >= 512 else "widen"
    return "f16c" if has_feature(target, FEATURES["f16c"]) else None


def store_rounding(fmt: str, target) -> str:
    """How a tile computed for a 16-bit product is rounded on its store (`method` of CvtSpec's
    float32 -> 16 bits): the conv tiles (LowpOut16Spec.cvt) and the depthwise block's u pairs
    (DwRowPairSpec). "hw" for bf16 where the product reading the value is `vdpbf16ps` (AVX512-BF16:
    `vcvtneps2bf16`, one instruction for 16 values where the exact RNE takes six to ten integer
    ops; 1x1 tiles of 64 channels 67-72 -> 74-77 % of the peak). It rounds to nearest even as the
    exact method does but flushes a float32 subnormal to zero, so |error| <= u |y| + 2^-126 per
    value instead of u |y| (a `vdpbf16ps` reading it treats a subnormal bf16 operand as zero
    anyway). Elsewhere lowp.best_method's ("exact" bf16, F16C's fp16)."""
    if fmt == "bf16" and target is not None and method_for("bf16", target) == "dpbf16":
        return "hw"
    return best_method("f32", fmt, target)


@dataclass(frozen=True)
class DwRow16Spec(DwRowSpec):
    """DwRowSpec's depthwise row over activations stored in 16 bits: x rows (`x_fmt`) and y rows
    (`y_fmt`) are "bf16", "f16" or "f32" (not both "f32": that is DwRowSpec). A 16-bit input is
    widened on load (exact), the taps, bias and activation run in float32 as in DwRowSpec, and a
    16-bit output is rounded once, on the store (RNE; `method` as CvtSpec's float32 -> 16 bits).
    Signature as DwRowSpec's, x and y as uint16 pointers where they hold 16 bits."""
    x_fmt: str = "f32"
    y_fmt: str = "f32"
    method: str = "exact"
    kind: str = "dwrow16"

    def __post_init__(self):
        assert {self.x_fmt, self.y_fmt} <= {"f32", "bf16", "f16"} and (self.x_fmt, self.y_fmt) != ("f32", "f32")
        assert self.method in ("exact", "hw"), self.method

    def _stem(self) -> str:
        return f"cuvil_dwrow16_{self.x_fmt}_{self.y_fmt}"

    def declaration(self, var: str) -> str:
        sixteen = lambda fmt: "uint16" if fmt != "f32" else "float32"
        return typed_declaration(self, var, {0: sixteen(self.x_fmt), 5: sixteen(self.y_fmt)})


def dwrow16_ir(spec: DwRow16Spec, vector_bits: int, store=None) -> str:
    """See DwRow16Spec: ukernel.dwrow_ir with lowp.py's conversions on the loads and the stores
    (`store`: ukernel.dwrow_ir's, for DwRowPairSpec)."""
    def widen(ir, bits, lanes):
        wide = bf16_to_f32(ir, bits, lanes) if spec.x_fmt == "bf16" else f16_to_f32(ir, bits, lanes, spec.method)
        value = ir.tmp("xf")
        ir(f"{value} = bitcast <{lanes} x i32> {wide} to <{lanes} x float>")
        return value

    def narrow(ir, value, lanes):
        bits = ir.tmp("yb")
        ir(f"{bits} = bitcast <{lanes} x float> {value} to <{lanes} x i32>")
        to16 = f32_to_bf16 if spec.y_fmt == "bf16" else f32_to_f16
        return to16(ir, bits, lanes, spec.method)
    if spec.x_fmt == "bf16" and spec.stride == 1 and spec.OW > min(lanes_for(vector_bits), 16):
        # bf16 widens by a shift: even / odd columns, 2L outputs a chunk (rows of at most L outputs
        # keep one vector of L: a chunk of 2L would double their FMAs)
        return dwrow_split_ir(spec, vector_bits, narrow if spec.y_fmt != "f32" else None, store=store)
    return dwrow_ir(spec, vector_bits, widen if spec.x_fmt != "f32" else None,
                    narrow if spec.y_fmt != "f32" else None, store=store)


@dataclass(frozen=True)
class DwRowPairSpec(DwRow16Spec):
    """DwRow16Spec's row with y written as one half of a row of bf16 channel pairs, the VNNI pair
    layout a `vdpbf16ps` GEMM reads as its B (channels its k: lowp_pack.pack_b_pairs' rows):

        y[yoff + 2 ow] = bf16(act(bias + sum_{kh, kw} w * x))      (i16 elements; y_fmt "bf16")

    so a call with yoff = (pair row) + h writes the h-th channel of the pair (h in {0, 1}) and
    leaves the other's elements as they were. Each vector's L rounded values are spread to the even
    lanes of 2L 16-bit lanes and stored under a mask of those lanes (`vmovdqu16` with a mask on
    AVX-512 BW). x as DwRow16Spec's ("f32" or "bf16"). Signature as DwRow16Spec's (y uint16)."""
    kind: str = "dwrowpairs"

    def __post_init__(self):
        super().__post_init__()
        assert self.y_fmt == "bf16" and self.x_fmt in ("f32", "bf16"), (self.x_fmt, self.y_fmt)

    def _stem(self) -> str:
        return f"cuvil_dwrowpairs_{self.x_fmt}"


def _pair_store(ir: IRBuilder, value: str, narrow, offset: int, lanes: int, L: int) -> None:
    """ukernel._dw_store for DwRowPairSpec: the first `lanes` of float vector `value`, rounded by
    `narrow`, at y row position `offset`, i.e. at 16-bit elements 2 (offset + j) from %yb."""
    bits = narrow(ir, value, L)
    spread = ir.tmp("yp")
    pick = ", ".join(f"i32 {j // 2}" if j % 2 == 0 else "i32 poison" for j in range(2 * L))
    ir(f"{spread} = shufflevector <{L} x i16> {bits}, <{L} x i16> poison, <{2 * L} x i32> <{pick}>")
    at = ir.tmp("yp")
    ir(f"{at} = getelementptr i16, ptr %yb, i64 {2 * offset}")
    mask = "<" + ", ".join(f"i1 {int(j % 2 == 0 and j // 2 < lanes)}" for j in range(2 * L)) + ">"
    ir(f"call void @llvm.masked.store.v{2 * L}i16.p0(<{2 * L} x i16> {spread}, ptr align 2 {at}, <{2 * L} x i1> {mask})")


def dwrowpairs_ir(spec: DwRowPairSpec, vector_bits: int) -> str:
    """See DwRowPairSpec: dwrow16_ir's row with _pair_store for the stores."""
    L = min(lanes_for(vector_bits), 16)
    decl = f"declare void @llvm.masked.store.v{2 * L}i16.p0(<{2 * L} x i16>, ptr, <{2 * L} x i1>)"
    text = dwrow16_ir(spec, vector_bits, store=_pair_store)
    if decl not in text:
        text = text.replace("\n\nattributes #0", f"\n{decl}\n\nattributes #0", 1)
    return text


@dataclass(frozen=True)
class DwRowPhaseSpec(DwRowPairSpec):
    """DwRowPairSpec's stride-2 row over phase-split float32 rows of t (backends/numba_cpu/dwphase.py:
    each input row's even columns, then its odd ones), `rows` 1 or 2 output rows a call:

        y[yoff + 2 (q OW + ow)] = bf16(act(bias + sum_{kh, kw} w[kh, kw] t(r0 + 2q + kh, 2 ow + kw - p_l)))

    every tap one load (ukernel.dwrow_phase_ir). Signature as DwRowSpec's (y uint16)."""
    kind: str = "dwrowphase"

    def __post_init__(self):
        super().__post_init__()
        assert self.stride == 2 and self.x_fmt == "f32" and self.rows in (1, 2), self

    def _stem(self) -> str:
        return "cuvil_dwrowphase"


def dwrowphase_ir(spec: DwRowPhaseSpec, vector_bits: int) -> str:
    """See DwRowPhaseSpec: ukernel.dwrow_phase_ir with DwRowPairSpec's rounding and pair stores."""
    return _pair_rows_ir(spec, vector_bits, dwrow_phase_ir)


def _pair_rows_ir(spec, vector_bits: int, rows_ir) -> str:
    """`rows_ir` (a ukernel depthwise row generator over float32 t) writing y as one half of bf16
    channel pairs: each output rounded by spec.method and stored every other 16-bit element."""
    def narrow(ir, value, lanes):
        bits = ir.tmp("yb")
        ir(f"{bits} = bitcast <{lanes} x float> {value} to <{lanes} x i32>")
        return f32_to_bf16(ir, bits, lanes, spec.method)
    L = min(lanes_for(vector_bits), 16)
    decl = f"declare void @llvm.masked.store.v{2 * L}i16.p0(<{2 * L} x i16>, ptr, <{2 * L} x i1>)"
    text = rows_ir(spec, vector_bits, narrow, _pair_store)
    if decl not in text:
        text = text.replace("\n\nattributes #0", f"\n{decl}\n\nattributes #0", 1)
    return text


@dataclass(frozen=True)
class DwPlanePairSpec(DwRowPairSpec):
    """DwRowPairSpec's stride-1 rows of a whole small plane in one call, outputs flat (the plane's
    rows contiguous, W == OW: ukernel.dwrow_plane_ir), y one half of bf16 channel pairs:

        y[yoff + 2 j] = bf16(act(bias + sum_{kh, kw} w[kh, kw] t(j // W + kh - p_t, j % W + kw - p_l)))

    for j < H W. Signature as DwRowSpec's (r0 ignored, y uint16)."""
    p_t: int = 0
    kind: str = "dwplanepairs"

    def __post_init__(self):
        super().__post_init__()
        assert self.stride == 1 and self.x_fmt == "f32" and self.OW == self.W, self

    def _stem(self) -> str:
        return "cuvil_dwplanepairs"


def dwplanepairs_ir(spec: DwPlanePairSpec, vector_bits: int) -> str:
    """See DwPlanePairSpec: ukernel.dwrow_plane_ir with DwRowPairSpec's rounding and pair stores."""
    return _pair_rows_ir(spec, vector_bits, dwrow_plane_ir)


def kinds() -> dict:
    """The spec constructors by `kind`, for ukernel.specs_in to read these kernels' comment lines
    (ukernel_lowp_ir dispatches their IR)."""
    from .winoin_lanes import WinoInSpec
    from .winoout_plane import WinoOutPlaneSpec
    from .winoout_rows import WinoOutRowSpec
    return {"lowp": lambda d: LowpUKSpec(**{**d, "taps": tuple(d.get("taps", ()))}), "cvt": lambda d: CvtSpec(**d),
            "cvtpairs": lambda d: PairCvtSpec(**d), "copypairs": lambda d: PairCopySpec(**d),
            "dwrow16": lambda d: DwRow16Spec(**d), "dwrowpairs": lambda d: DwRowPairSpec(**d),
            "lowp16": lambda d: LowpOut16Spec(**{**d, "taps": tuple(d.get("taps", ()))}),
            "lowpcall": lambda d: LowpCalledSpec(**{**d, "taps": tuple(d.get("taps", ()))}),
            "lowpstream": lambda d: LowpStreamedSpec(**{**d, "taps": tuple(d.get("taps", ()))}),
            "lowp16call": lambda d: LowpOut16CalledSpec(**{**d, "taps": tuple(d.get("taps", ()))}),
            "copypairs_strided": lambda d: StridedPairCopySpec(**d), "winoin16": WinoInSpec.from_dict,
            "winoout_plane": WinoOutPlaneSpec.from_dict, "winoout_rows": WinoOutRowSpec.from_dict,
            "lowp16t": lambda d: LowpOut16TapsSpec(**{**d, "taps": tuple(d["taps"]), "a_taps": tuple(d["a_taps"])}),
            "dwrowphase": lambda d: DwRowPhaseSpec(**d), "dwplanepairs": lambda d: DwPlanePairSpec(**d)}


def ukernel_lowp_ir(spec, vector_bits: int) -> str:
    """The IR of a LowpUKSpec, LowpOut16Spec, CvtSpec, PairCvtSpec, PairCopySpec, DwRow16Spec,
    DwRowPairSpec, DwRowPhaseSpec, DwPlanePairSpec, WinoInSpec, WinoOutPlaneSpec or WinoOutRowSpec
    (what ukernel.ukernel_ir would call for these kinds)."""
    from .winoin_lanes import winoin_ir
    from .winoout_plane import winoout_plane_ir
    from .winoout_rows import winoout_rows_ir
    generate = {"cvt": cvt_ir, "cvtpairs": pair_cvt_ir, "copypairs": pair_cvt_ir, "copypairs_strided": strided_pair_copy_ir,
                "dwrow16": dwrow16_ir, "dwrowpairs": dwrowpairs_ir, "winoin16": winoin_ir,
                "winoout_plane": winoout_plane_ir, "winoout_rows": winoout_rows_ir, "dwrowphase": dwrowphase_ir,
                "dwplanepairs": dwplanepairs_ir}.get(spec.kind, lowp_ukernel_ir)
    return generate(spec, vector_bits)
