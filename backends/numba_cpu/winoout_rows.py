"""bf16 Winograd F(2x2)'s output transform for a row of tiles into a bf16 Y of even rows, as a
vector micro-kernel (LLVM IR): 16 tiles a vector.

winograd.out_kernel's "pair words" form (a tile row's two outputs are one 32-bit word of Y, a
bf16 residual read the same way), the tiles of one row of tiles in lanes:

    for tile t < n, output row r in {0, 1}:
        v_q = (A^T M_t A)[r, q] (+ bias) (+ R pair word's half q) -> act     q in {0, 1}
        y[yoff + r * yrow + t] = bf16(v_0) | bf16(v_1) << 16
    M_t[xi] = m[moff + xi * xs + t];  R pair word: r[roff + r * rrow + t]

float32 as out_kernel (A^T's terms left to right, then the bias, then the residual; Relu / Clip as
`llvm.maxnum` / `minnum`, as the bf16 conv tiles'). The reason for it is the rounding: Numba's loop
rounds the 4 outputs of a tile by the exact integer RNE; here `method` "hw" (`vcvtneps2bf16`: a
float32 subnormal flushed to zero, at most 2^-126 more per value, ukernel_lowp.store_rounding's
argument) or "exact" (lowp.f32_to_bf16). Loads and stores of the last n mod 16 tiles are masked.
Signature: i32 name(ptr m, i64 moff, ptr bias, i64 boff, ptr r, i64 roff, i64 rrow, ptr y, i64 yoff,
i64 yrow, i64 n) (bias / r: any pointer when the spec has none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .lowp import f32_to_bf16, ir_op, kernel_module, load_lanes, masked_decls, splat, store_lanes, strip_loop, \
    typed_declaration
from .ukernel import Declared, IRBuilder
from .winoin_lanes import combine_ir
from .winoout_plane import activation_ir

LANES = 16


@dataclass(frozen=True)
class WinoOutRowSpec(Declared):
    """See the module docstring. `at`: A^T's rows as ((column, coefficient), ...) (F2's)."""
    at: tuple
    xs: int
    bias: int = 0
    residual: int = 0       # 1: a bf16 residual in pair words
    act: str = ""           # "" | "Relu" | "Clip"
    act_lo: float = 0.0
    act_hi: float = 0.0
    method: str = "exact"   # "exact" | "hw"
    kind: str = "winoout_rows"
    _ARGS: ClassVar[str] = "pipipiipiii"

    def _stem(self) -> str:
        return f"cuvil_winoout_rows_{self.method}"

    def declaration(self, var: str) -> str:
        return typed_declaration(self, var, {4: "uint32" if self.residual else "float32", 7: "uint32"})

    @staticmethod
    def from_dict(d: dict) -> "WinoOutRowSpec":
        at = tuple(tuple((int(i), float(c)) for i, c in row) for row in d["at"])
        return WinoOutRowSpec(**{**d, "at": at})


def winoout_rows_ir(spec: WinoOutRowSpec, vector_bits: int) -> str:
    """The micro-kernel's module (see WinoOutRowSpec and the module docstring)."""
    L, a = LANES, 4
    vf, vi = f"<{L} x float>", f"<{L} x i32>"
    ir = IRBuilder()
    ir.label("entry")
    ir("%m0 = getelementptr float, ptr %mp, i64 %moff")
    ir("%y0 = getelementptr i32, ptr %y, i64 %yoff")
    ir("%y1 = getelementptr i32, ptr %y0, i64 %yrow")
    if spec.residual:
        ir("%r0 = getelementptr i32, ptr %r, i64 %roff")
        ir("%r1 = getelementptr i32, ptr %r0, i64 %rrow")
    if spec.bias:
        ir("%bp = getelementptr float, ptr %bias, i64 %boff")
        ir("%b = load float, ptr %bp, align 4")
        ir(f"%bv0 = insertelement {vf} poison, float %b, i64 0")
        ir(f"%bv = shufflevector {vf} %bv0, {vf} poison, <{L} x i32> zeroinitializer")
    used = sorted({j for q in range(2) for j, _ in spec.at[q]})

    def step(ir, i, mask):
        M = {}
        for xi in range(a * a):
            if xi % a in used:
                M[xi] = load_lanes(ir, "%m0", ir_op(ir, f"add i64 {i}, {xi * spec.xs}", "o"), "float", L, mask)
        for r in range(2):
            s = {j: combine_ir(ir, spec.at[r], [M[a * k + j] for k in range(a)], L) for j in used}
            if spec.residual:
                w = load_lanes(ir, f"%r{r}", i, "i32", L, mask)
                res = [ir_op(ir, f"bitcast {vi} {ir_op(ir, f'shl {vi} {w}, {splat(L, 16)}')} to {vf}", "f"),
                       ir_op(ir, f"bitcast {vi} {ir_op(ir, f'and {vi} {w}, {splat(L, -65536)}')} to {vf}", "f")]
            halves = []
            for q in range(2):
                v = combine_ir(ir, spec.at[q], s, L)
                if spec.bias:
                    v = ir_op(ir, f"fadd {vf} {v}, %bv", "f")
                if spec.residual:
                    v = ir_op(ir, f"fadd {vf} {v}, {res[q]}", "f")
                v = activation_ir(ir, spec, v, L)
                bits = f32_to_bf16(ir, ir_op(ir, f"bitcast {vf} {v} to {vi}"), L, spec.method)
                halves.append(ir_op(ir, f"zext <{L} x i16> {bits} to {vi}"))
            word = ir_op(ir, f"or {vi} {halves[0]}, {ir_op(ir, f'shl {vi} {halves[1]}, {splat(L, 16)}')}")
            store_lanes(ir, word, f"%y{r}", i, "i32", L, mask)
    strip_loop(ir, L, step)
    head = (f"define i32 @{spec.name}(ptr noalias %mp, i64 %moff, ptr noalias %bias, i64 %boff, ptr noalias %r, "
            f"i64 %roff, i64 %rrow, ptr noalias %y, i64 %yoff, i64 %yrow, i64 %n) #0 {{")
    decls = masked_decls(("float", L), ("i32", L)) + [f"declare {vf} @llvm.{op}.v{L}f32({vf}, {vf})"
                                                      for op in ("maxnum", "minnum")]
    return kernel_module(head, ir, decls)

