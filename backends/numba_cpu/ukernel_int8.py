"""The int8 GEMM micro-kernel: u8 x s8 -> s32 products with AVX512-VNNI `vpdpbusd`, as LLVM IR.

    acc(i, j) = sum_k  A(i, k) * B(k, j)               i < mr, j < nr (nr a multiple of 16, <= 64)

A is unsigned bytes, read in place by rows: the 4 bytes A(i, 4q .. 4q+3) at a[aoff + i*lda + 4q]
are one 32-bit word, broadcast to the 16 lanes. With `a_signed` A is signed bytes and each word is
XORed with 0x80808080 first, which adds 128 to every byte (the "+128 shift" of onnxruntime's and
oneDNN's s8s8 kernels): the product then counts 128 * colsum(B) too, which the compensation below
takes back. B is signed bytes packed at build time (`pack_b_quads`): for each group q of 4 k,
nr columns of 4 bytes, b[boff + (q*nr + j)*4 + h] = B(4q + h, j), so one 64-byte vector holds
the 4 k of 16 columns, the operand order `vpdpbusd` reads (oneDNN and MLAS pack B the same way:
k in groups of 4 innermost). `kc` counts groups of 4 k; K is padded with zero rows of B.

Products of a u8 and an s8 summed 4 at a time into int32 lanes are exact (no saturation with
`vpdpbusd`; |sum| < 2^31 for K < 2^16), so the accumulators are the exact integer sums.

Epilogue (once, after the whole k loop), for columns j (column index n = noff + j):

    acc += zeff * comp[n]                       the zero point compensation: the caller passes
                                                comp = -colsum(B) and zeff = a's zero point (+128
                                                when a_signed), or a build-time comp with zeff = 1
    out "i32":  c = acc
    out "f32":  c = act(float(acc) * (mult[n] * ascale) + bias[n])      (ascale, bias: spec flags)
    out "u8" | "s8":  c = saturate(rint(act(float(acc) * mult[n])) + zy)  (onnxruntime's requantisation:
                                                the multiplier in float32, rounding half to even)

Each step rounds as onnxruntime's unfused graph does (MatMulInteger -> Cast -> Mul(Mul(s_a, s_b))
-> Add(bias)): no fused multiply-add. C rows are c[coff + i*ldc + j] in the output's element type;
`mask` (i64) has bit j set for the valid columns (masked stores; B is read in full).

Signature:
    i32 name(ptr a, i64 aoff, i64 lda, ptr b, i64 boff, ptr c, i64 coff, i64 ldc, i64 kc, i64 mask,
             ptr comp, ptr mult, ptr bias, i64 noff, i64 zeff, ptr ascale)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .lowp import column_masks, typed_declaration
from .ukernel import Declared, IRBuilder, close_k_loop, float_ir, function_module, open_k_loop

ARG_NAMES = ("a", "aoff", "lda", "b", "boff", "c", "coff", "ldc", "kc", "mask", "comp", "mult", "bias", "noff",
             "zeff", "ascale")
_POINTERS = {"a", "b", "c", "comp", "mult", "bias", "ascale"}
OUTPUTS = {"i32": "int32", "f32": "float32", "u8": "uint8", "s8": "int8"}
_RANGE = {"u8": (0, 255), "s8": (-128, 127)}
MAX_ACC = 24    # int32 accumulator vectors (of 32 zmm: B vectors, the A broadcast and the 0x80 constant)
FEATURE = "avx512vnni"
# AArch64's dot-product extension (ARMv8.2-A, FEAT_DotProd: Cortex-A78 / Jetson Orin, Neoverse N1+):
# SDOT Vd.4S, Vn.16B, Vm.16B adds to each int32 lane the 4 products of the signed bytes in that lane.
# The kernel keeps its 16-column vectors (the packing of pack_b_quads); each is 4 NEON registers and
# gets 4 SDOTs, lane j of quarter q reading column 4q + j's 4 k. A is signed: uint8 activations are
# XORed with 0x80 (A - 128) and the caller's compensation takes back -128 * colsum(B), as the +128
# of the VNNI path; the sums are the same exact integers (|sum| < 2^31 for K < 2^16).
SDOT_FEATURE = "dotprod"
DOT_METHODS = ("vnni", "sdot")
# 16-lane accumulators per chunk with sdot: 24 of the 32 NEON registers, 4 each
MAX_ACC_SDOT = 6


def dot_shift(a_signed: bool, dot: str) -> int:
    """What the micro-kernel adds to every A byte (the XOR with 0x80): +128 (int8 A, vnni), -128
    (uint8 A, sdot) or 0; the caller's compensation subtracts shift * colsum(B)."""
    if dot == "sdot":
        return 0 if a_signed else -128
    return 128 if a_signed else 0


@dataclass(frozen=True)
class Int8UKSpec(Declared):
    mr: int
    nr: int
    out: str = "i32"        # "i32" | "f32" | "u8" | "s8" (see the module docstring)
    a_signed: int = 0       # A is int8: XOR 0x80 (+128 a byte); the caller adds 128 to zeff
    ascale: int = 0         # "f32": the multiplier is mult[n] * (*ascale), a run-time activation scale
    bias: int = 0           # "f32": bias[n] added after the multiply
    act: str = ""           # "" | "Relu" | "Clip" (act_lo, act_hi), on the float value
    act_lo: float = 0.0
    act_hi: float = 0.0
    zy: int = 0             # "u8" | "s8": the output zero point
    kind: str = "int8"
    dot: str = "vnni"       # "vnni": AVX512-VNNI vpdpbusd (u8 x s8); "sdot": AArch64 SDOT (s8 x s8, see SDOT)
    _ARGS: ClassVar[str] = "".join("p" if n in _POINTERS else "i" for n in ARG_NAMES)

    def __post_init__(self):
        assert self.nr % 16 == 0 and 16 <= self.nr <= 64, self.nr
        assert self.dot in DOT_METHODS, self.dot
        assert self.out in OUTPUTS, self.out
        assert self.act in ("", "Relu", "Clip"), self.act

    def _stem(self) -> str:
        return f"cuvil_uki8_{self.mr}x{self.nr}_{self.out}" + ("_sdot" if self.dot == "sdot" else "")

    @property
    def flip(self) -> bool:
        """Whether each A byte is XORed with 0x80 (+-128) to give the dot product's operand type:
        vpdpbusd wants unsigned A (flip int8), sdot signed A (flip uint8)."""
        return bool(self.a_signed) != (self.dot == "sdot")

    def declaration(self, var: str, a_dtype: str = "uint8") -> str:
        types = {"a": a_dtype, "b": "int8", "c": OUTPUTS[self.out], "comp": "int32", "mult": "float32",
                 "bias": "float32", "ascale": "float32"}
        return typed_declaration(self, var, {i: types[n] for i, n in enumerate(ARG_NAMES) if n in types})


def pack_b_quads(b: np.ndarray, nr: int) -> np.ndarray:
    """[K, N] int8 -> [ceil(N/nr) panels, ceil(K/4) groups, nr columns, 4 k] int8, zero padded."""
    K, N = b.shape
    Kq, panels = -(-K // 4), -(-N // nr)
    padded = np.zeros((Kq * 4, panels * nr), np.int8)
    padded[:K, :N] = b
    return np.ascontiguousarray(padded.reshape(Kq, 4, panels, nr).transpose(2, 0, 3, 1))


def _splat_i32(ir: IRBuilder, scalar: str, L: int = 16) -> str:
    ins = ir.tmp("ins")
    ir(f"{ins} = insertelement <{L} x i32> poison, i32 {scalar}, i64 0")
    out = ir.tmp("sp")
    ir(f"{out} = shufflevector <{L} x i32> {ins}, <{L} x i32> poison, <{L} x i32> zeroinitializer")
    return out


def _splat_f32(ir: IRBuilder, scalar: str, L: int = 16) -> str:
    ins = ir.tmp("ins")
    ir(f"{ins} = insertelement <{L} x float> poison, float {scalar}, i64 0")
    out = ir.tmp("sp")
    ir(f"{out} = shufflevector <{L} x float> {ins}, <{L} x float> poison, <{L} x i32> zeroinitializer")
    return out


def _const_f32(value: float, L: int = 16) -> str:
    return f"<{', '.join([f'float {float_ir(value)}'] * L)}>"


def _requantise(ir: IRBuilder, y: str, zy: int, lo: int, hi: int, vf: str, vi: str, x86: bool = False) -> str:
    """A 16-lane float32 `y` (already scaled) to the output's integers as onnxruntime rounds them:
    round half to even, + zero point, clamped to [lo, hi]; returns the i32 vector.

    `x86` (AVX-512): the same integers in 4 floating-point and 3 integer instructions, not 7 and 0:
        q = max(cvt_rne(min(y, hi - zy)), lo - zy) + zy
    rint(min(y, B)) = min(rint(y), B) for an integer B, so clamping before the rounding conversion
    changes nothing; `vcvtps2dq` with {rn-sae} rounds half to even whatever MXCSR says, and gives
    INT_MIN below -2^31, which the integer max then clamps to lo - zy (the min before it leaves no
    overflow upwards). The floating-point pipes are the ones `vpdpbusd` runs on (Zen 4 and 5), so
    the epilogue's share of them is what a tile loses: 7 of them a vector of 16 outputs against
    K / 4 dot products (36 at 3x3 x 16 quads; 37 for ResNet's im2col stem)."""
    if x86:
        top = ir.tmp("r")
        ir(f"{top} = call {vf} @llvm.minnum.v16f32({vf} {y}, {vf} {_const_f32(float(hi - zy))})")
        r = ir.tmp("r")
        ir(f"{r} = call {vi} @llvm.x86.avx512.mask.cvtps2dq.512({vf} {top}, {vi} zeroinitializer, i16 -1, i32 8)")
        low = ir.tmp("r")
        ir(f"{low} = call {vi} @llvm.smax.v16i32({vi} {r}, {vi} {_const_i32(lo - zy)})")
        q = ir.tmp("q")
        ir(f"{q} = add {vi} {low}, {_const_i32(zy)}")
        return q
    r = ir.tmp("r")
    ir(f"{r} = call {vf} @llvm.roundeven.v16f32({vf} {y})")
    r2 = ir.tmp("r")
    ir(f"{r2} = fadd {vf} {r}, {_const_f32(float(zy))}")
    r3 = ir.tmp("r")
    ir(f"{r3} = call {vf} @llvm.maxnum.v16f32({vf} {r2}, {vf} {_const_f32(float(lo))})")
    r4 = ir.tmp("r")
    ir(f"{r4} = call {vf} @llvm.minnum.v16f32({vf} {r3}, {vf} {_const_f32(float(hi))})")
    q = ir.tmp("q")
    ir(f"{q} = fptosi {vf} {r4} to {vi}")
    return q


def _const_i32(value: int, L: int = 16) -> str:
    return f"<{', '.join([f'i32 {int(value)}'] * L)}>"


# what the x86 requantisation calls (_requantise), for the modules' declarations
REQUANTISE_X86_DECLS = ("declare <16 x i32> @llvm.x86.avx512.mask.cvtps2dq.512(<16 x float>, <16 x i32>, i16, i32)",
                        "declare <16 x i32> @llvm.smax.v16i32(<16 x i32>, <16 x i32>)")


def _sdot16(ir: IRBuilder, acc: str, a4: str, b: str) -> str:
    """acc (<16 x i32>) + the dot products of the A word a4 (<16 x i8>, 4 bytes repeated) with the
    16 columns of b (<16 x i32>, 4 bytes each): 4 AArch64 SDOTs on the quarters, joined again."""
    parts = []
    for q in range(4):
        lanes = ", ".join(f"i32 {4 * q + j}" for j in range(4))
        aq = ir.tmp("sa")
        ir(f"{aq} = shufflevector <16 x i32> {acc}, <16 x i32> poison, <4 x i32> <{lanes}>")
        bq = ir.tmp("sb")
        ir(f"{bq} = shufflevector <16 x i32> {b}, <16 x i32> poison, <4 x i32> <{lanes}>")
        bb = ir.tmp("sb")
        ir(f"{bb} = bitcast <4 x i32> {bq} to <16 x i8>")
        r = ir.tmp("sd")
        ir(f"{r} = call <4 x i32> @llvm.aarch64.neon.sdot.v4i32.v16i8(<4 x i32> {aq}, <16 x i8> {a4}, <16 x i8> {bb})")
        parts.append(r)
    low, high = ir.tmp("sj"), ir.tmp("sj")
    eight = ", ".join(f"i32 {j}" for j in range(8))
    ir(f"{low} = shufflevector <4 x i32> {parts[0]}, <4 x i32> {parts[1]}, <8 x i32> <{eight}>")
    ir(f"{high} = shufflevector <4 x i32> {parts[2]}, <4 x i32> {parts[3]}, <8 x i32> <{eight}>")
    out = ir.tmp("sj")
    sixteen = ", ".join(f"i32 {j}" for j in range(16))
    ir(f"{out} = shufflevector <8 x i32> {low}, <8 x i32> {high}, <16 x i32> <{sixteen}>")
    return out


def int8_ukernel_ir(spec: Int8UKSpec, vector_bits: int = 512) -> str:
    """The LLVM IR (a module of one function named spec.name); needs AVX512-VNNI (dot "vnni") or
    AArch64's dot-product extension (dot "sdot")."""
    L = 16
    V = spec.nr // L
    vi, vf = f"<{L} x i32>", f"<{L} x float>"
    sdot = spec.dot == "sdot"
    ir = IRBuilder()
    ir.label("entry")
    masks = column_masks(ir, V, L)
    per_chunk = max(1, min(V, (MAX_ACC_SDOT if sdot else MAX_ACC) // spec.mr))
    chunks = [list(range(v0, min(V, v0 + per_chunk))) for v0 in range(0, V, per_chunk)]
    arow = {}
    for i in range(spec.mr):
        off = ir.tmp("ao")
        ir(f"{off} = mul i64 %lda, {i}")
        off2 = ir.tmp("ao")
        ir(f"{off2} = add i64 %aoff, {off}")
        arow[i] = ir.tmp("arow")
        ir(f"{arow[i]} = getelementptr i8, ptr %a, i64 {off2}")
    ir("%bbase = getelementptr i8, ptr %b, i64 %boff")
    esize = {"i32": 4, "f32": 4, "u8": 1, "s8": 1}[spec.out]
    crow = {}
    for i in range(spec.mr):
        off = ir.tmp("co")
        ir(f"{off} = mul i64 %ldc, {i}")
        off2 = ir.tmp("co")
        ir(f"{off2} = add i64 %coff, {off}")
        off3 = ir.tmp("co")
        ir(f"{off3} = mul i64 {off2}, {esize}")
        crow[i] = ir.tmp("crow")
        ir(f"{crow[i]} = getelementptr i8, ptr %c, i64 {off3}")
    ir("%zeff32 = trunc i64 %zeff to i32")
    zsplat = _splat_i32(ir, "%zeff32")
    if spec.out == "f32" and spec.ascale:
        ir("%asc = load float, ptr %ascale, align 4")
        asplat = _splat_f32(ir, "%asc")
    rename = {}
    ir("br label %chunk0")
    for ci, vecs in enumerate(chunks):
        ir.label(f"chunk{ci}")
        ir(f"br label %pre{ci}")
        ir.label(f"pre{ci}")
        ir(f"br label %loop{ci}")
        init = {(i, v): "zeroinitializer" for i in range(spec.mr) for v in vecs}
        kv, accs = open_k_loop(ir, ci, init, vi, f"%loop{ci}")
        cur = dict(accs)
        brow_off = ir.tmp("bo")
        ir(f"{brow_off} = mul i64 {kv}, {spec.nr * 4}")
        brow = ir.tmp("brow")
        ir(f"{brow} = getelementptr i8, ptr %bbase, i64 {brow_off}")
        bvec = {}
        for v in vecs:
            p = ir.tmp("bp")
            ir(f"{p} = getelementptr i8, ptr {brow}, i64 {v * 64}")
            bvec[v] = ir.tmp("b")
            ir(f"{bvec[v]} = load {vi}, ptr {p}, align 1")
        ka = ir.tmp("ka")
        ir(f"{ka} = mul i64 {kv}, 4")
        for i in range(spec.mr):
            p = ir.tmp("ap")
            ir(f"{p} = getelementptr i8, ptr {arow[i]}, i64 {ka}")
            word = ir.tmp("aw")
            ir(f"{word} = load i32, ptr {p}, align 1")
            if spec.flip:
                flipped = ir.tmp("ax")
                ir(f"{flipped} = xor i32 {word}, -2139062144")   # 0x80808080
                word = flipped
            if sdot:
                splat4 = _splat_i32(ir, word, 4)
                a4 = ir.tmp("a4")
                ir(f"{a4} = bitcast <4 x i32> {splat4} to <16 x i8>")
                for v in vecs:
                    cur[i, v] = _sdot16(ir, cur[i, v], a4, bvec[v])
                continue
            splat = _splat_i32(ir, word)
            for v in vecs:
                out = ir.tmp("d")
                ir(f"{out} = call {vi} @llvm.x86.avx512.vpdpbusd.512({vi} {cur[i, v]}, {vi} {splat}, {vi} {bvec[v]})")
                cur[i, v] = out
        final = close_k_loop(ir, ci, kv, accs, cur, rename)
        # epilogue: column vectors of this chunk
        colv = {}
        for v in vecs:
            n = ir.tmp("n")
            ir(f"{n} = add i64 %noff, {v * L}")
            colv[v] = n

        def column(ptr, elem, v):
            p = ir.tmp("cp")
            ir(f"{p} = getelementptr {elem}, ptr %{ptr}, i64 {colv[v]}")
            x = ir.tmp("cv")
            ir(f"{x} = load <{L} x {elem}>, ptr {p}, align 4")
            return x
        comp = {}
        for v in vecs:
            c = column("comp", "i32", v)
            comp[v] = ir.tmp("cz")
            ir(f"{comp[v]} = mul {vi} {c}, {zsplat}")
        mult, bias = {}, {}
        if spec.out != "i32":
            for v in vecs:
                mult[v] = column("mult", "float", v)
                if spec.out == "f32" and spec.ascale:
                    m2 = ir.tmp("ms")
                    ir(f"{m2} = fmul {vf} {mult[v]}, {asplat}")
                    mult[v] = m2
                if spec.out == "f32" and spec.bias:
                    bias[v] = column("bias", "float", v)
        for (i, v), acc in final.items():
            x = ir.tmp("x")
            ir(f"{x} = add {vi} {acc}, {comp[v]}")
            p = ir.tmp("op")
            ir(f"{p} = getelementptr i8, ptr {crow[i]}, i64 {v * L * esize}")
            if spec.out == "i32":
                ir(f"call void @llvm.masked.store.v16i32.p0({vi} {x}, ptr align 1 {p}, <16 x i1> {masks[v]})")
                continue
            f = ir.tmp("f")
            ir(f"{f} = sitofp {vi} {x} to {vf}")
            y = ir.tmp("y")
            ir(f"{y} = fmul {vf} {f}, {mult[v]}")
            if spec.out == "f32" and spec.bias:
                y2 = ir.tmp("y")
                ir(f"{y2} = fadd {vf} {y}, {bias[v]}")
                y = y2
            y = _activation(ir, spec, y, vf)
            if spec.out == "f32":
                ir(f"call void @llvm.masked.store.v16f32.p0({vf} {y}, ptr align 1 {p}, <16 x i1> {masks[v]})")
                continue
            lo, hi = _RANGE[spec.out]
            q = _requantise(ir, y, spec.zy, lo, hi, vf, vi, x86=not sdot)
            q8 = ir.tmp("q")
            ir(f"{q8} = trunc {vi} {q} to <16 x i8>")
            ir(f"call void @llvm.masked.store.v16i8.p0(<16 x i8> {q8}, ptr align 1 {p}, <16 x i1> {masks[v]})")
        ir(f"br label %{f'chunk{ci + 1}' if ci + 1 < len(chunks) else 'done'}")
    ir.label("done")
    ir("ret i32 0")
    args = ", ".join(f"ptr {'' if n == 'c' else 'noalias '}%{n}" if n in _POINTERS else f"i64 %{n}"
                     for n in ARG_NAMES)
    head = f"define i32 @{spec.name}({args}) #0 {{"
    dot_decl = ("declare <4 x i32> @llvm.aarch64.neon.sdot.v4i32.v16i8(<4 x i32>, <16 x i8>, <16 x i8>)" if sdot
                else f"declare {vi} @llvm.x86.avx512.vpdpbusd.512({vi}, {vi}, {vi})")
    decls = [dot_decl,
             f"declare void @llvm.masked.store.v16i32.p0({vi}, ptr, <16 x i1>)",
             f"declare void @llvm.masked.store.v16f32.p0({vf}, ptr, <16 x i1>)",
             "declare void @llvm.masked.store.v16i8.p0(<16 x i8>, ptr, <16 x i1>)",
             f"declare {vf} @llvm.roundeven.v16f32({vf})",
             f"declare {vf} @llvm.maxnum.v16f32({vf}, {vf})",
             f"declare {vf} @llvm.minnum.v16f32({vf}, {vf})"]
    return function_module(head, ir, rename, decls + ([] if sdot else list(REQUANTISE_X86_DECLS)))


def _activation(ir: IRBuilder, spec: Int8UKSpec, y: str, vf: str) -> str:
    bounds = []
    if spec.act == "Relu":
        bounds = [("maxnum", 0.0)]
    elif spec.act == "Clip":
        if spec.act_lo != float("-inf"):
            bounds.append(("maxnum", spec.act_lo))
        if spec.act_hi != float("inf"):
            bounds.append(("minnum", spec.act_hi))
    for fn, value in bounds:
        out = ir.tmp("act")
        ir(f"{out} = call {vf} @llvm.{fn}.v16f32({vf} {y}, {vf} {_const_f32(value)})")
        y = out
    return y




# ---------------------------------------------------------------- convolutions

CONV_ARG_NAMES = ("w", "woff", "x", "xoff", "y", "yoff", "ldy", "kc", "mask", "comp", "mult", "moff")
_CONV_POINTERS = {"w", "x", "y", "comp", "mult"}


@dataclass(frozen=True)
class Int8ConvSpec(Declared):
    """A convolution tile with the roles turned: mr output channels (rows) x nr output pixels of one
    output row (columns, 16 a vector), the activations the unsigned operand of `vpdpbusd`:

        acc(i, j) = sum_{q < kc, t}  sum_h  W(i, 4q + h, t) * X(4q + h, pixel j + taps[t])

    X is the input in channel quads (qconv.py's layout): x[xoff + (q*plane + p)*4 + h] is channel
    4q + h at pixel p, so 16 pixels of a quad are one 64-byte vector; taps[t] are compile-time pixel
    offsets (a row of the tap, a phase image for strided convs). W is packed at build time:
    w[woff + ((q*T + t)*panel + i)*4 + h], one 32-bit word per row broadcast to the lanes (the
    signed operand). Epilogue per row: acc + comp[moff + i] (the zero point compensation and the
    int32 bias), then y = saturate(rint(float(acc) * mult[moff + i]) + zy), stored as bytes: the
    columns set in `mask` (the valid pixels of a tile running over whole rows of a padded grid),
    compressed, from y[yoff + i*ldy] on.

    Signature: i32 name(ptr w, i64 woff, ptr x, i64 xoff, ptr y, i64 yoff, i64 ldy, i64 kc, i64 mask,
                        ptr comp, ptr mult, i64 moff)"""
    mr: int
    nr: int
    taps: tuple
    plane: int
    panel: int
    out: str = "u8"
    zy: int = 0
    kind: str = "int8conv"
    _ARGS: ClassVar[str] = "".join("p" if n in _CONV_POINTERS else "i" for n in CONV_ARG_NAMES)

    def __post_init__(self):
        assert self.nr % 16 == 0 and 16 <= self.nr <= 64 and self.out in _RANGE and self.panel >= self.mr

    def _stem(self) -> str:
        return f"cuvil_uki8conv_{self.mr}x{self.nr}_{self.out}"

    def declaration(self, var: str) -> str:
        types = {"w": "int8", "x": "uint8", "y": OUTPUTS[self.out], "comp": "int32", "mult": "float32"}
        return typed_declaration(self, var, {i: types[n] for i, n in enumerate(CONV_ARG_NAMES) if n in types})


@dataclass(frozen=True)
class Int8ConvBlendSpec(Int8ConvSpec):
    """Int8ConvSpec whose rows are stored in place on the grid, not compressed: the lanes set in
    `mask` get the requantised value, the others the output zero point zy, and the lanes set in
    `smask` (i64, one more argument) are stored from y[yoff + i*ldy] on. A conv computing on the grid
    of the depthwise conv after it writes that conv's zero-padded planes itself: the padding columns
    are the lanes outside `mask` (qconv.py, conv_into_depthwise).

    With `quads` the output is channel quads (qconv.py's layout, the next conv's input): rows 4j ..
    4j + 3 are interleaved, 4 bytes a pixel, and stored from y[yoff + j*ldy] on (mr a multiple of 4).

    Signature: Int8ConvSpec's, then i64 smask."""
    quads: int = 0
    kind: str = "int8convb"
    _ARGS: ClassVar[str] = Int8ConvSpec._ARGS + "i"

    def __post_init__(self):
        super().__post_init__()
        assert not self.quads or self.mr % 4 == 0, self.mr

    def _stem(self) -> str:
        return f"cuvil_uki8convb_{self.mr}x{self.nr}_{self.out}"


def _store_quads(ir: IRBuilder, rows: dict, v: int, j: int, lanes: str) -> None:
    """Rows 0..3 of vector v (<16 x i8> each) interleaved, 4 bytes a pixel, stored at
    y[yoff + j*ldy + 64 v ..] where `lanes` (<16 x i1>) is set."""
    cat = "<" + ", ".join(f"i32 {k}" for k in range(32)) + ">"
    ab, cd = ir.tmp("ab"), ir.tmp("cd")
    ir(f"{ab} = shufflevector <16 x i8> {rows[0, v]}, <16 x i8> {rows[1, v]}, <32 x i32> {cat}")
    ir(f"{cd} = shufflevector <16 x i8> {rows[2, v]}, <16 x i8> {rows[3, v]}, <32 x i32> {cat}")
    quads = ir.tmp("qd")
    order = ", ".join(f"i32 {h * 16 + lane}" for lane in range(16) for h in range(4))
    ir(f"{quads} = shufflevector <32 x i8> {ab}, <32 x i8> {cd}, <64 x i32> <{order}>")
    wide = ir.tmp("sm")
    rep4 = ", ".join(f"i32 {lane}" for lane in range(16) for _ in range(4))
    ir(f"{wide} = shufflevector <16 x i1> {lanes}, <16 x i1> poison, <64 x i32> <{rep4}>")
    off = ir.tmp("yq")
    ir(f"{off} = mul i64 %ldy, {j}")
    off2 = ir.tmp("yq")
    ir(f"{off2} = add i64 %yoff, {off}")
    off3 = ir.tmp("yq")
    ir(f"{off3} = add i64 {off2}, {v * 64}")
    p = ir.tmp("yp")
    ir(f"{p} = getelementptr i8, ptr %y, i64 {off3}")
    ir(f"call void @llvm.masked.store.v64i8.p0(<64 x i8> {quads}, ptr align 1 {p}, <64 x i1> {wide})")


def _tap_dots(ir: IRBuilder, mr: int, V: int, taps: tuple, plane: int, panel: int, rename: dict,
              pixels_in_lanes: bool) -> dict:
    """The k loop of the int8 conv tiles: for each channel quad and tap, `vpdpbusd` of input quads
    (uint8, first operand) and weight quads (int8), into accumulators (i, v) of mr rows x V vectors.
    `pixels_in_lanes` (Int8ConvSpec): vectors of 16 pixels' quads from the input plane, each row i a
    broadcast weight quad (output channel i, `panel` quads per tap). Otherwise (Int8RowConvSpec):
    vectors of 16 output channels' weight quads (`panel` per tap), each row i a broadcast input quad
    (pixel i). Returns the accumulators after the loop (close_k_loop)."""
    L, vi = 16, "<16 x i32>"
    ir("%xbase = getelementptr i8, ptr %x, i64 %xoff")
    ir("%wbase = getelementptr i8, ptr %w, i64 %woff")
    ir("br label %pre0")
    ir.label("pre0")
    ir("br label %loop0")
    init = {(i, v): "zeroinitializer" for i in range(mr) for v in range(V)}
    kv, accs = open_k_loop(ir, 0, init, vi, "%loop0")
    cur = dict(accs)
    xq = ir.tmp("xq")
    ir(f"{xq} = mul i64 {kv}, {plane * 4}")
    xrow = ir.tmp("xr")
    ir(f"{xrow} = getelementptr i8, ptr %xbase, i64 {xq}")
    wq = ir.tmp("wq")
    ir(f"{wq} = mul i64 {kv}, {len(taps) * panel * 4}")
    wrow = ir.tmp("wr")
    ir(f"{wrow} = getelementptr i8, ptr %wbase, i64 {wq}")
    if pixels_in_lanes:   # (row, quad offset, pointer tag, value tag) of the vectors and of the splats
        vec = (xrow, lambda t, off, v: off + v * L, "xp", "xv")
        one = (wrow, lambda t, off, i: t * panel + i, "wp", "ww")
    else:
        vec = (wrow, lambda t, off, v: t * panel + v * L, "wp", "wv")
        one = (xrow, lambda t, off, i: off + i, "xp", "xw")
    for t, off in enumerate(taps):
        vecs = {}
        for v in range(V):
            p = ir.tmp(vec[2])
            ir(f"{p} = getelementptr i8, ptr {vec[0]}, i64 {vec[1](t, off, v) * 4}")
            vecs[v] = ir.tmp(vec[3])
            ir(f"{vecs[v]} = load {vi}, ptr {p}, align 1")
        for i in range(mr):
            p = ir.tmp(one[2])
            ir(f"{p} = getelementptr i8, ptr {one[0]}, i64 {one[1](t, off, i) * 4}")
            word = ir.tmp(one[3])
            ir(f"{word} = load i32, ptr {p}, align 1")
            splat = _splat_i32(ir, word)
            for v in range(V):
                u8, s8 = (vecs[v], splat) if pixels_in_lanes else (splat, vecs[v])
                out = ir.tmp("d")
                ir(f"{out} = call {vi} @llvm.x86.avx512.vpdpbusd.512({vi} {cur[i, v]}, {vi} {u8}, {vi} {s8})")
                cur[i, v] = out
    return close_k_loop(ir, 0, kv, accs, cur, rename)


def int8_conv_ir(spec: Int8ConvSpec, vector_bits: int = 512) -> str:
    L = 16
    V = spec.nr // L
    vi, vf = f"<{L} x i32>", f"<{L} x float>"
    ir = IRBuilder()
    ir.label("entry")
    masks = column_masks(ir, V, L)
    rename = {}
    final = _tap_dots(ir, spec.mr, V, spec.taps, spec.plane, spec.panel, rename, pixels_in_lanes=True)
    lo, hi = _RANGE[spec.out]
    blend = spec.kind == "int8convb"
    # compressed stores: the valid lanes of vector v go to prefix[v] = popcount of the mask below it
    prefix, dense, running = {}, {}, "0"
    for v in range(V if not blend else 0):
        prefix[v] = running
        seg = ir.tmp("seg")
        ir(f"{seg} = lshr i64 %mask, {v * L}")
        segm = ir.tmp("seg")
        ir(f"{segm} = and i64 {seg}, {(1 << L) - 1}")
        cnt = ir.tmp("cnt")
        ir(f"{cnt} = call i64 @llvm.ctpop.i64(i64 {segm})")
        running = ir.tmp("off")
        ir(f"{running} = add i64 {prefix[v]}, {cnt}")
        low = ir.tmp("low")
        ir(f"{low} = shl i64 1, {cnt}")
        low2 = ir.tmp("low")
        ir(f"{low2} = sub i64 {low}, 1")
        low3 = ir.tmp("low")
        ir(f"{low3} = trunc i64 {low2} to i{L}")
        dense[v] = ir.tmp("dm")
        ir(f"{dense[v]} = bitcast i{L} {low3} to <{L} x i1>")
    stores, pending = {}, {}
    for v in range(V if blend else 0):
        seg = ir.tmp("ss")
        ir(f"{seg} = lshr i64 %smask, {v * L}")
        bits = ir.tmp("ss")
        ir(f"{bits} = trunc i64 {seg} to i{L}")
        stores[v] = ir.tmp("sm")
        ir(f"{stores[v]} = bitcast i{L} {bits} to <{L} x i1>")
    for i in range(spec.mr):
        row = ir.tmp("row")
        ir(f"{row} = add i64 %moff, {i}")
        cp = ir.tmp("cp")
        ir(f"{cp} = getelementptr i32, ptr %comp, i64 {row}")
        c = ir.tmp("c")
        ir(f"{c} = load i32, ptr {cp}, align 4")
        csplat = _splat_i32(ir, c)
        mp = ir.tmp("mp")
        ir(f"{mp} = getelementptr float, ptr %mult, i64 {row}")
        m = ir.tmp("m")
        ir(f"{m} = load float, ptr {mp}, align 4")
        msplat = _splat_f32(ir, m)
        yo = ir.tmp("yo")
        ir(f"{yo} = mul i64 %ldy, {i}")
        yo2 = ir.tmp("yo")
        ir(f"{yo2} = add i64 %yoff, {yo}")
        for v in range(V):
            x = ir.tmp("x")
            ir(f"{x} = add {vi} {final[i, v]}, {csplat}")
            f = ir.tmp("f")
            ir(f"{f} = sitofp {vi} {x} to {vf}")
            y = ir.tmp("y")
            ir(f"{y} = fmul {vf} {f}, {msplat}")
            q = _requantise(ir, y, spec.zy, lo, hi, vf, vi, x86=True)
            if blend:
                qb = ir.tmp("qb")
                ir(f"{qb} = select <16 x i1> {masks[v]}, {vi} {q}, {vi} <{', '.join([f'i32 {spec.zy}'] * L)}>")
                q8 = ir.tmp("q")
                ir(f"{q8} = trunc {vi} {qb} to <16 x i8>")
                if spec.quads:
                    pending[i % 4, v] = q8
                    if i % 4 == 3:
                        _store_quads(ir, pending, v, i // 4, stores[v])
                    continue
                yi = ir.tmp("yi")
                ir(f"{yi} = add i64 {yo2}, {v * L}")
                p = ir.tmp("yp")
                ir(f"{p} = getelementptr i8, ptr %y, i64 {yi}")
                ir(f"call void @llvm.masked.store.v16i8.p0(<16 x i8> {q8}, ptr align 1 {p}, <16 x i1> {stores[v]})")
                continue
            packed = ir.tmp("qc")   # compressed in a register: a compress store to memory is microcoded on Zen 4
            ir(f"{packed} = call {vi} @llvm.experimental.vector.compress.v16i32({vi} {q}, <16 x i1> {masks[v]}, "
               f"{vi} poison)")
            q8 = ir.tmp("q")
            ir(f"{q8} = trunc {vi} {packed} to <16 x i8>")
            yi = ir.tmp("yi")
            ir(f"{yi} = add i64 {yo2}, {prefix[v]}")
            p = ir.tmp("yp")
            ir(f"{p} = getelementptr i8, ptr %y, i64 {yi}")
            ir(f"call void @llvm.masked.store.v16i8.p0(<16 x i8> {q8}, ptr align 1 {p}, <16 x i1> {dense[v]})")
    ir("ret i32 0")
    args = ", ".join(f"ptr {'' if n == 'y' else 'noalias '}%{n}" if n in _CONV_POINTERS else f"i64 %{n}"
                     for n in CONV_ARG_NAMES + (("smask",) if blend else ()))
    head = f"define i32 @{spec.name}({args}) #0 {{"
    decls = [f"declare {vi} @llvm.x86.avx512.vpdpbusd.512({vi}, {vi}, {vi})",
             "declare void @llvm.masked.store.v16i8.p0(<16 x i8>, ptr, <16 x i1>)",
             "declare void @llvm.masked.store.v64i8.p0(<64 x i8>, ptr, <64 x i1>)",
             f"declare {vf} @llvm.roundeven.v16f32({vf})",
             f"declare {vf} @llvm.maxnum.v16f32({vf}, {vf})",
             f"declare {vf} @llvm.minnum.v16f32({vf}, {vf})",
             f"declare {vi} @llvm.experimental.vector.compress.v16i32({vi}, <16 x i1>, {vi})",
             "declare i64 @llvm.ctpop.i64(i64)"]
    return function_module(head, ir, rename, decls + list(REQUANTISE_X86_DECLS))


ROWCONV_ARG_NAMES = ("w", "woff", "x", "xoff", "y", "yoff", "ldy", "kc", "comp", "mult", "moff")


@dataclass(frozen=True)
class Int8RowConvSpec(Declared):
    """A convolution tile with output channels in the lanes (as onnxruntime's and OpenVINO's NHWC
    kernels): mr output pixels of one row (rows) x nr output channels (columns, 16 a vector), for
    small planes where Int8ConvSpec's 16 pixels a vector leave lanes empty (a 7x7 output on its
    9-wide grid: 49 of 64; here 7 pixels a tile, none):

        acc(i, j) = sum_{q < kc, t}  sum_h  X(4q + h, pixel i + taps[t]) * W(j, 4q + h, t)

    X is the input in channel quads (Int8ConvSpec's layout, x[xoff + (q*plane + p)*4 + h]): the
    4 bytes of pixel i's quad q are one 32-bit word broadcast to the lanes (the unsigned operand).
    W is packed at build time, w[woff + ((q*T + t)*nr + j)*4 + h], 16 channels of a quad one
    64-byte vector (the signed operand). Epilogue per vector of channels: acc + comp[moff + j],
    then y = saturate(rint(float(acc) * mult[moff + j]) + zy) (Int8ConvSpec's steps, lane by
    lane), stored as bytes to y[yoff + j*ldy + i] (NCHW: ldy the plane size).

    Signature: i32 name(ptr w, i64 woff, ptr x, i64 xoff, ptr y, i64 yoff, i64 ldy, i64 kc,
                        ptr comp, ptr mult, i64 moff)"""
    mr: int
    nr: int
    taps: tuple
    plane: int
    out: str = "u8"
    zy: int = 0
    kind: str = "int8convr"
    _ARGS: ClassVar[str] = "".join("p" if n in _CONV_POINTERS else "i" for n in ROWCONV_ARG_NAMES)

    def __post_init__(self):
        assert self.nr % 16 == 0 and 16 <= self.nr <= 64 and self.out in _RANGE
        assert self.mr * self.nr // 16 <= MAX_ACC, (self.mr, self.nr)

    def _stem(self) -> str:
        return f"cuvil_uki8convr_{self.mr}x{self.nr}_{self.out}"

    def declaration(self, var: str) -> str:
        types = {"w": "int8", "x": "uint8", "y": OUTPUTS[self.out], "comp": "int32", "mult": "float32"}
        return typed_declaration(self, var, {i: types[n] for i, n in enumerate(ROWCONV_ARG_NAMES) if n in types})


def _store_channel_rows(ir: IRBuilder, rows: dict, mr: int, v: int, L: int) -> None:
    """The requantised bytes of one vector of channels, rows[i] (<16 x i8>: channel v*16 + c of
    pixel i), stored NCHW: channel c's mr pixels are mr consecutive bytes at y[yoff + (v*16 + c)*ldy].
    Transposed in registers (one byte shuffle: channel c's pixels to bytes [c*M, c*M + mr), M = 8
    or 16), then one masked store a channel, not mr byte stores (the 7x32 tile at 16 quads x 9
    taps: 932-956 -> 1060-1100 GOP/s, benchmarks/int8_tiles.py). A masked
    store reads and writes none of the bytes outside its mask (AVX-512 suppresses their faults),
    so the store may start before channel c's bytes."""
    M = 8 if mr <= 8 else 16
    pad = "zeroinitializer"
    parts = [rows[i] if i < mr else pad for i in range(M)]
    width = 16
    while len(parts) > 1:   # concatenate pairwise: <16 M x i8>, pixel i at bytes [16 i, 16 i + 16)
        joined = []
        for a, b in zip(parts[0::2], parts[1::2]):
            out = ir.tmp("cat")
            order = ", ".join(f"i32 {k}" for k in range(2 * width))
            ir(f"{out} = shufflevector <{width} x i8> {a}, <{width} x i8> {b}, <{2 * width} x i32> <{order}>")
            joined.append(out)
        parts, width = joined, 2 * width
    whole = parts[0]
    per = 64 // M     # channels a 64-byte vector
    for k in range(L // per):
        picks = ", ".join(f"i32 {(slot % M) * 16 + k * per + slot // M}" for slot in range(64))
        chunk = ir.tmp("tr")
        ir(f"{chunk} = shufflevector <{width} x i8> {whole}, <{width} x i8> poison, <64 x i32> <{picks}>")
        for j in range(per):
            c = k * per + j
            at = ir.tmp("yo")
            ir(f"{at} = mul i64 %ldy, {v * L + c}")
            at2 = ir.tmp("yo")
            ir(f"{at2} = add i64 %yoff, {at}")
            at3 = ir.tmp("yo")
            ir(f"{at3} = sub i64 {at2}, {j * M}")
            ptr = ir.tmp("yp")
            ir(f"{ptr} = getelementptr i8, ptr %y, i64 {at3}")
            mask = ", ".join("i1 1" if j * M <= b < j * M + mr else "i1 0" for b in range(64))
            ir(f"call void @llvm.masked.store.v64i8.p0(<64 x i8> {chunk}, ptr align 1 {ptr}, <64 x i1> <{mask}>)")


def int8_row_conv_ir(spec: Int8RowConvSpec, vector_bits: int = 512) -> str:
    L = 16
    V = spec.nr // L
    vi, vf = f"<{L} x i32>", f"<{L} x float>"
    ir = IRBuilder()
    ir.label("entry")
    rename = {}
    final = _tap_dots(ir, spec.mr, V, spec.taps, spec.plane, spec.nr, rename, pixels_in_lanes=False)
    lo, hi = _RANGE[spec.out]
    for v in range(V):
        rows = {}
        col = ir.tmp("col")
        ir(f"{col} = add i64 %moff, {v * L}")
        cp = ir.tmp("cp")
        ir(f"{cp} = getelementptr i32, ptr %comp, i64 {col}")
        cvec = ir.tmp("cv")
        ir(f"{cvec} = load {vi}, ptr {cp}, align 4")
        mp = ir.tmp("mp")
        ir(f"{mp} = getelementptr float, ptr %mult, i64 {col}")
        mvec = ir.tmp("mv")
        ir(f"{mvec} = load {vf}, ptr {mp}, align 4")
        for i in range(spec.mr):
            x = ir.tmp("x")
            ir(f"{x} = add {vi} {final[i, v]}, {cvec}")
            f = ir.tmp("f")
            ir(f"{f} = sitofp {vi} {x} to {vf}")
            y = ir.tmp("y")
            ir(f"{y} = fmul {vf} {f}, {mvec}")
            q = _requantise(ir, y, spec.zy, lo, hi, vf, vi, x86=True)
            q8 = ir.tmp("q")
            ir(f"{q8} = trunc {vi} {q} to <16 x i8>")
            rows[i] = q8
        _store_channel_rows(ir, rows, spec.mr, v, L)
    ir("ret i32 0")
    args = ", ".join(f"ptr {'' if n == 'y' else 'noalias '}%{n}" if n in _CONV_POINTERS else f"i64 %{n}"
                     for n in ROWCONV_ARG_NAMES)
    head = f"define i32 @{spec.name}({args}) #0 {{"
    decls = [f"declare {vi} @llvm.x86.avx512.vpdpbusd.512({vi}, {vi}, {vi})",
             "declare void @llvm.masked.store.v64i8.p0(<64 x i8>, ptr, <64 x i1>)",
             f"declare {vf} @llvm.roundeven.v16f32({vf})",
             f"declare {vf} @llvm.maxnum.v16f32({vf}, {vf})",
             f"declare {vf} @llvm.minnum.v16f32({vf}, {vf})"]
    return function_module(head, ir, rename, decls + list(REQUANTISE_X86_DECLS))


def kinds() -> dict:
    """The spec constructors by `kind`, for ukernel.specs_in (emit.py links the IR in)."""
    return {"int8": lambda d: Int8UKSpec(**d), "int8conv": lambda d: Int8ConvSpec(**{**d, "taps": tuple(d["taps"])}),
            "int8convb": lambda d: Int8ConvBlendSpec(**{**d, "taps": tuple(d["taps"])}),
            "int8convr": lambda d: Int8RowConvSpec(**{**d, "taps": tuple(d["taps"])}),
            "int8dw": lambda d: Int8DwSpec(**d), "int8dwq": lambda d: Int8DwQuadSpec(**d)}


def int8_ir(spec, vector_bits: int = 512) -> str:
    """The IR of either int8 micro-kernel."""
    if spec.kind == "int8dw":
        return int8_dw_ir(spec, vector_bits)
    if spec.kind == "int8dwq":
        return int8_dw_quad_ir(spec, vector_bits)
    if spec.kind == "int8convr":
        return int8_row_conv_ir(spec, vector_bits)
    return int8_conv_ir(spec, vector_bits) if spec.kind in ("int8conv", "int8convb") else int8_ukernel_ir(spec, vector_bits)


# ---------------------------------------------------------------- depthwise rows

DW_ARG_NAMES = ("x", "xoff", "w", "woff", "y", "yoff", "npos", "comp", "mult")
_DW_POINTERS = {"x", "w", "y"}


@dataclass(frozen=True)
class Int8DwSpec(Declared):
    """Depthwise convolution of one plane over `npos` positions of a flat padded grid (rows of `wp`
    pixels), a kernel of kh rows of kw <= 4 taps, stride s, dilation d:

        acc(p) = comp + sum_{r < kh} sum_{h < kw} W(r, h) * X(s*p + r*d*wp + h*d)

    Each kernel row is one `vpdpbusd`: a 64-byte load of the input, its bytes rearranged by a
    constant shuffle so that lane j holds X(s*j + h*d), h < 4 (the 4 bytes one output reads in
    that row; `vpermb` with AVX512-VBMI), times the row's 4 weights broadcast (w[woff + 4r + h],
    zero past kw). y[yoff + p] = saturate(rint(float(acc) * mult) + zy), bytes; comp and mult are
    the channel's (compensation + int32 bias, float32 multiplier). Positions are done 64 at a time
    (four accumulators), the last group masked; x must be readable 64 bytes past the last window.

    Signature: i32 name(ptr x, i64 xoff, ptr w, i64 woff, ptr y, i64 yoff, i64 npos, i64 comp, i64 mult_bits)"""
    kh: int
    kw: int
    wp: int
    s: int = 1
    d: int = 1
    out: str = "u8"
    zy: int = 0
    kind: str = "int8dw"
    _ARGS: ClassVar[str] = "".join("p" if n in _DW_POINTERS else "i" for n in DW_ARG_NAMES)

    def __post_init__(self):
        assert 1 <= self.kw <= 4 and self.s * 15 + (self.kw - 1) * self.d < 64 and self.out in _RANGE

    def _stem(self) -> str:
        return f"cuvil_uki8dw_{self.kh}x{self.kw}_s{self.s}"

    def declaration(self, var: str) -> str:
        types = {"x": "uint8", "w": "int8", "y": OUTPUTS[self.out]}
        return typed_declaration(self, var, {i: types[n] for i, n in enumerate(DW_ARG_NAMES) if n in types})


def _dw_rows(ir: IRBuilder, spec, acc: str, xo: str, offset: int, index: str, weights: list, vb: str,
             vi: str) -> str:
    """The taps of one depthwise output vector, one kernel row per `vpdpbusd`: each row's input window
    (at byte `xo` + `offset` + row * dilation * padded width from %xbase) loaded, its taps gathered
    into dword groups by `index`, and dotted with that row's weights. Returns the accumulator."""
    for r, w in enumerate(weights):
        at = ir.tmp("xo")
        ir(f"{at} = add i64 {xo}, {offset + r * spec.d * spec.wp}")
        ptr = ir.tmp("xp")
        ir(f"{ptr} = getelementptr i8, ptr %xbase, i64 {at}")
        raw = ir.tmp("xr")
        ir(f"{raw} = load {vb}, ptr {ptr}, align 1")
        win = ir.tmp("xw")
        ir(f"{win} = shufflevector {vb} {raw}, {vb} poison, <64 x i32> <{index}>")
        wi = ir.tmp("xi")
        ir(f"{wi} = bitcast {vb} {win} to {vi}")
        out = ir.tmp("d")
        ir(f"{out} = call {vi} @llvm.x86.avx512.vpdpbusd.512({vi} {acc}, {vi} {wi}, {vi} {w})")
        acc = out
    return acc


def int8_dw_ir(spec: Int8DwSpec, vector_bits: int = 512) -> str:
    vi, vf, vb = "<16 x i32>", "<16 x float>", "<64 x i8>"
    lo, hi = _RANGE[spec.out]
    G = 4   # vectors of 16 positions a group
    ir = IRBuilder()
    ir.label("entry")
    ir("%xbase = getelementptr i8, ptr %x, i64 %xoff")
    ir("%wbase = getelementptr i8, ptr %w, i64 %woff")
    ir("%ybase = getelementptr i8, ptr %y, i64 %yoff")
    ir("%c32 = trunc i64 %comp to i32")
    csplat = _splat_i32(ir, "%c32")
    ir("%m32 = trunc i64 %mult to i32")
    ir("%mf = bitcast i32 %m32 to float")
    msplat = _splat_f32(ir, "%mf")
    wrow = {}
    for r in range(spec.kh):
        p = ir.tmp("wp")
        ir(f"{p} = getelementptr i8, ptr %wbase, i64 {4 * r}")
        word = ir.tmp("ww")
        ir(f"{word} = load i32, ptr {p}, align 1")
        wrow[r] = _splat_i32(ir, word)
    index = ", ".join(f"i32 {spec.s * j + min(h, spec.kw - 1) * spec.d}" for j in range(16) for h in range(4))
    ir("br label %loop")
    ir.label("loop")
    ir("%p = phi i64 [ 0, %entry ], [ %pn, %tail ]")
    for g in range(G):
        acc = csplat
        base = ir.tmp("pb")
        ir(f"{base} = add i64 %p, {16 * g}")
        xo = ir.tmp("xo")
        ir(f"{xo} = mul i64 {base}, {spec.s}")
        acc = _dw_rows(ir, spec, acc, xo, 0, index, [wrow[r] for r in range(spec.kh)], vb, vi)
        f = ir.tmp("f")
        ir(f"{f} = sitofp {vi} {acc} to {vf}")
        y = ir.tmp("y")
        ir(f"{y} = fmul {vf} {f}, {msplat}")
        q = _requantise(ir, y, spec.zy, lo, hi, vf, vi, x86=True)
        q8 = ir.tmp("q")
        ir(f"{q8} = trunc {vi} {q} to <16 x i8>")
        # lanes left: npos - base (masked store of the first ones)
        left = ir.tmp("left")
        ir(f"{left} = sub i64 %npos, {base}")
        cl = ir.tmp("cl")
        ir(f"{cl} = call i64 @llvm.smax.i64(i64 {left}, i64 0)")
        cl2 = ir.tmp("cl")
        ir(f"{cl2} = call i64 @llvm.smin.i64(i64 {cl}, i64 16)")
        bits = ir.tmp("mb")
        ir(f"{bits} = shl i64 1, {cl2}")
        bits2 = ir.tmp("mb")
        ir(f"{bits2} = sub i64 {bits}, 1")
        bits3 = ir.tmp("mb")
        ir(f"{bits3} = trunc i64 {bits2} to i16")
        mask = ir.tmp("m")
        ir(f"{mask} = bitcast i16 {bits3} to <16 x i1>")
        yp = ir.tmp("yp")
        ir(f"{yp} = getelementptr i8, ptr %ybase, i64 {base}")
        ir(f"call void @llvm.masked.store.v16i8.p0(<16 x i8> {q8}, ptr align 1 {yp}, <16 x i1> {mask})")
    ir("br label %tail")
    ir.label("tail")
    ir(f"%pn = add i64 %p, {16 * G}")
    ir("%more = icmp slt i64 %pn, %npos")
    ir("br i1 %more, label %loop, label %done")
    ir.label("done")
    ir("ret i32 0")
    args = ", ".join(f"ptr {'' if n == 'y' else 'noalias '}%{n}" if n in _DW_POINTERS else f"i64 %{n}"
                     for n in DW_ARG_NAMES)
    head = f"define i32 @{spec.name}({args}) #0 {{"
    decls = [f"declare {vi} @llvm.x86.avx512.vpdpbusd.512({vi}, {vi}, {vi})",
             "declare void @llvm.masked.store.v16i8.p0(<16 x i8>, ptr, <16 x i1>)",
             f"declare {vf} @llvm.roundeven.v16f32({vf})",
             f"declare {vf} @llvm.maxnum.v16f32({vf}, {vf})",
             f"declare {vf} @llvm.minnum.v16f32({vf}, {vf})",
             "declare i64 @llvm.smax.i64(i64, i64)", "declare i64 @llvm.smin.i64(i64, i64)"]
    return function_module(head, ir, {}, decls + list(REQUANTISE_X86_DECLS))


# ---------------------------------------------------------------- depthwise rows, channel-quad output

DWQ_ARG_NAMES = ("x", "xoff", "w", "woff", "y", "yoff", "ngroups", "comp", "mult", "coff", "masks", "starts")
_DWQ_POINTERS = {"x", "w", "y", "comp", "mult", "masks", "starts"}


@dataclass(frozen=True)
class Int8DwQuadSpec(Declared):
    """Int8DwSpec's depthwise rows for the 4 channels of one channel quad at once, written in the
    layout the next convolution reads (qconv.py's quads: y[yoff + p*4 + h] is channel 4q + h at
    pixel p), so that neither the compaction of the padded grid nor the next conv's QuadPad copy
    runs. Channel h's plane is x[xoff + h*xplane ...], its kernel rows w[woff + (h*kh + r)*4 ...],
    its compensation and multiplier comp[coff + h], mult[coff + h] (int32, float32).

    Positions go 64 at a time (`ngroups` groups over the flat padded grid, rows of wp pixels);
    masks[g] (i64) has bit j set for the positions of group g that are outputs (column < OW, inside
    the grid), starts[g] is the output pixel of its first one. Per 16 positions the 4 channels'
    requantised bytes are compressed to the valid lanes (in a register, as Int8ConvSpec stores),
    interleaved into quads (64 bytes) and stored as one masked prefix.

    Signature: i32 name(ptr x, i64 xoff, ptr w, i64 woff, ptr y, i64 yoff, i64 ngroups, ptr comp,
                        ptr mult, i64 coff, ptr masks, ptr starts)"""
    kh: int
    kw: int
    wp: int
    xplane: int
    s: int = 1
    d: int = 1
    zy: int = 0
    kind: str = "int8dwq"
    _ARGS: ClassVar[str] = "".join("p" if n in _DWQ_POINTERS else "i" for n in DWQ_ARG_NAMES)

    def __post_init__(self):
        assert 1 <= self.kw <= 4 and self.s * 15 + (self.kw - 1) * self.d < 64

    def _stem(self) -> str:
        return f"cuvil_uki8dwq_{self.kh}x{self.kw}_s{self.s}"

    def declaration(self, var: str) -> str:
        types = {"x": "uint8", "w": "int8", "y": "uint8", "comp": "int32", "mult": "float32", "masks": "int64",
                 "starts": "int64"}
        return typed_declaration(self, var, {i: types[n] for i, n in enumerate(DWQ_ARG_NAMES) if n in types})


def int8_dw_quad_ir(spec: Int8DwQuadSpec, vector_bits: int = 512) -> str:
    vi, vf, vb = "<16 x i32>", "<16 x float>", "<64 x i8>"
    lo, hi = _RANGE["u8"]
    G = 4   # vectors of 16 positions a group
    ir = IRBuilder()
    ir.label("entry")
    ir("%xbase = getelementptr i8, ptr %x, i64 %xoff")
    ir("%wbase = getelementptr i8, ptr %w, i64 %woff")
    ir("%ybase = getelementptr i8, ptr %y, i64 %yoff")
    csplat, msplat, wrow = {}, {}, {}
    for h in range(4):
        cp = ir.tmp("cp")
        ir(f"{cp} = getelementptr i32, ptr %comp, i64 %coff")
        cp2 = ir.tmp("cp")
        ir(f"{cp2} = getelementptr i32, ptr {cp}, i64 {h}")
        c = ir.tmp("c")
        ir(f"{c} = load i32, ptr {cp2}, align 4")
        csplat[h] = _splat_i32(ir, c)
        mp = ir.tmp("mp")
        ir(f"{mp} = getelementptr float, ptr %mult, i64 %coff")
        mp2 = ir.tmp("mp")
        ir(f"{mp2} = getelementptr float, ptr {mp}, i64 {h}")
        m = ir.tmp("m")
        ir(f"{m} = load float, ptr {mp2}, align 4")
        msplat[h] = _splat_f32(ir, m)
        for r in range(spec.kh):
            p = ir.tmp("wp")
            ir(f"{p} = getelementptr i8, ptr %wbase, i64 {(h * spec.kh + r) * 4}")
            word = ir.tmp("ww")
            ir(f"{word} = load i32, ptr {p}, align 1")
            wrow[h, r] = _splat_i32(ir, word)
    index = ", ".join(f"i32 {spec.s * j + min(k, spec.kw - 1) * spec.d}" for j in range(16) for k in range(4))
    interleave = ", ".join(f"i32 {h * 16 + lane}" for lane in range(16) for h in range(4))
    ir("br label %loop")
    ir.label("loop")
    ir("%g = phi i64 [ 0, %entry ], [ %gn, %loop ]")
    ir("%mkp = getelementptr i64, ptr %masks, i64 %g")
    ir("%mk = load i64, ptr %mkp, align 8")
    ir("%stp = getelementptr i64, ptr %starts, i64 %g")
    ir("%st = load i64, ptr %stp, align 8")
    ir("%p = mul i64 %g, 64")
    ir("%xo = mul i64 %p, " + str(spec.s))
    running = "%st"
    for v in range(G):
        seg = ir.tmp("seg")
        ir(f"{seg} = lshr i64 %mk, {v * 16}")
        seg2 = ir.tmp("seg")
        ir(f"{seg2} = trunc i64 {seg} to i16")
        lanes = ir.tmp("lm")
        ir(f"{lanes} = bitcast i16 {seg2} to <16 x i1>")
        seg3 = ir.tmp("seg")
        ir(f"{seg3} = zext i16 {seg2} to i64")
        cnt = ir.tmp("cnt")
        ir(f"{cnt} = call i64 @llvm.ctpop.i64(i64 {seg3})")
        packed = {}
        for h in range(4):
            acc = csplat[h]
            acc = _dw_rows(ir, spec, acc, "%xo", h * spec.xplane + v * 16 * spec.s, index,
                           [wrow[h, r] for r in range(spec.kh)], vb, vi)
            f = ir.tmp("f")
            ir(f"{f} = sitofp {vi} {acc} to {vf}")
            y = ir.tmp("y")
            ir(f"{y} = fmul {vf} {f}, {msplat[h]}")
            q = _requantise(ir, y, spec.zy, lo, hi, vf, vi, x86=True)
            qc = ir.tmp("qc")
            ir(f"{qc} = call {vi} @llvm.experimental.vector.compress.v16i32({vi} {q}, <16 x i1> {lanes}, {vi} poison)")
            packed[h] = ir.tmp("q")
            ir(f"{packed[h]} = trunc {vi} {qc} to <16 x i8>")
        ab = ir.tmp("ab")
        ir(f"{ab} = shufflevector <16 x i8> {packed[0]}, <16 x i8> {packed[1]}, <32 x i32> "
           f"<{', '.join(f'i32 {k}' for k in range(32))}>")
        cd = ir.tmp("cd")
        ir(f"{cd} = shufflevector <16 x i8> {packed[2]}, <16 x i8> {packed[3]}, <32 x i32> "
           f"<{', '.join(f'i32 {k}' for k in range(32))}>")
        quads = ir.tmp("qd")
        ir(f"{quads} = shufflevector <32 x i8> {ab}, <32 x i8> {cd}, <64 x i32> <{interleave}>")
        # the first 4 * cnt bytes: (2^(4 cnt) - 1), all ones for cnt = 16
        sh = ir.tmp("sh")
        ir(f"{sh} = mul i64 {cnt}, 4")
        sh128 = ir.tmp("sh")
        ir(f"{sh128} = zext i64 {sh} to i128")
        one = ir.tmp("wm")
        ir(f"{one} = shl i128 1, {sh128}")
        less = ir.tmp("wm")
        ir(f"{less} = sub i128 {one}, 1")
        bits = ir.tmp("wm")
        ir(f"{bits} = trunc i128 {less} to i64")
        smask = ir.tmp("sm")
        ir(f"{smask} = bitcast i64 {bits} to <64 x i1>")
        yo = ir.tmp("yo")
        ir(f"{yo} = mul i64 {running}, 4")
        yp = ir.tmp("yp")
        ir(f"{yp} = getelementptr i8, ptr %ybase, i64 {yo}")
        ir(f"call void @llvm.masked.store.v64i8.p0({vb} {quads}, ptr align 1 {yp}, <64 x i1> {smask})")
        nxt = ir.tmp("run")
        ir(f"{nxt} = add i64 {running}, {cnt}")
        running = nxt
    ir("%gn = add i64 %g, 1")
    ir("%more = icmp slt i64 %gn, %ngroups")
    ir("br i1 %more, label %loop, label %done")
    ir.label("done")
    ir("ret i32 0")
    args = ", ".join(f"ptr {'' if n == 'y' else 'noalias '}%{n}" if n in _DWQ_POINTERS else f"i64 %{n}"
                     for n in DWQ_ARG_NAMES)
    head = f"define i32 @{spec.name}({args}) #0 {{"
    decls = [f"declare {vi} @llvm.x86.avx512.vpdpbusd.512({vi}, {vi}, {vi})",
             f"declare void @llvm.masked.store.v64i8.p0({vb}, ptr, <64 x i1>)",
             f"declare {vf} @llvm.roundeven.v16f32({vf})",
             f"declare {vf} @llvm.maxnum.v16f32({vf}, {vf})",
             f"declare {vf} @llvm.minnum.v16f32({vf}, {vf})",
             f"declare {vi} @llvm.experimental.vector.compress.v16i32({vi}, <16 x i1>, {vi})",
             "declare i64 @llvm.ctpop.i64(i64)"]
    return function_module(head, ir, {}, decls + list(REQUANTISE_X86_DECLS))
