"""bf16 Winograd F(2x2)'s output transform for a small plane (ResNet's 7 x 7: 4 x 4 tiles) as a
vector micro-kernel (LLVM IR): one output channel's whole plane per call.

    Y_tile = A^T M A (+ bias) (+ R) -> act -> Y         (winograd.out_kernel's maths, float32)

With TH x TW <= 16 tiles, M's 16 positions are one vector each (the tiles in lanes, M[xi] at
moff + xi * xs, the tiles ti * TW + tj contiguous: the band's pitch == TW); the transform gives
the 4 outputs (r, q) of every tile as 4 vectors, which one shuffle lays out as the plane
(output (y, x) = lane (2 (y % 2) + x % 2) * 16 + (y // 2) TW + x // 2 of the four; OH * OW <= 64
lanes). Bias, a residual stored as the plane (bf16 widened exactly, or float32), Relu / Clip
(`llvm.maxnum` / `minnum`, as the bf16 conv tiles') and the rounding of a bf16 Y then run on the
plane's contiguous lanes, loaded and stored with masks. Numba's loop (winograd.out_kernel) ran
these planes a tile at a time with 16-bit scalar loads and stores (rows of 7: no pair words):
0.033 ms of a 512-channel conv.

Rounding of a bf16 Y (`method`): "hw" `vcvtneps2bf16` (to nearest even, a float32 subnormal
flushed to zero: at most 2^-126 more error per value, as ukernel_lowp.store_rounding's conv tiles),
"exact" the integer RNE (lowp.f32_to_bf16).
Signature: i32 name(ptr m, i64 moff, ptr bias, i64 boff, ptr r, i64 roff, ptr y, i64 yoff)
(bias / r: any pointer when the spec has none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .lowp import f32_to_bf16, ir_op, kernel_module, load_lanes, masked_decls, splat, store_lanes, typed_declaration
from .ukernel import Declared, IRBuilder, float_ir
from .winoin_lanes import combine_ir

LANES = 16


@dataclass(frozen=True)
class WinoOutPlaneSpec(Declared):
    """See the module docstring. `at`: A^T's rows as ((column, coefficient), ...) (winograd F2's)."""
    at: tuple
    oh: int
    ow: int
    tw: int
    xs: int
    bias: int = 0
    residual: str = ""      # "" | "bf16" | "f32": R stored as the plane
    y16: int = 1            # Y bf16 (else float32)
    act: str = ""           # "" | "Relu" | "Clip"
    act_lo: float = 0.0
    act_hi: float = 0.0
    method: str = "exact"   # rounding of a bf16 Y: "exact" | "hw"
    kind: str = "winoout_plane"
    _ARGS: ClassVar[str] = "pipipipi"

    def __post_init__(self):
        assert len(self.at) == 2 and -(-self.oh // 2) * self.tw <= LANES and self.oh * self.ow <= 4 * LANES
        assert self.residual in ("", "bf16", "f32") and self.act in ("", "Relu", "Clip")

    def _stem(self) -> str:
        return f"cuvil_winoout_plane_{self.method}"

    def declaration(self, var: str) -> str:
        return typed_declaration(self, var, {4: "uint16" if self.residual == "bf16" else "float32",
                                             6: "uint16" if self.y16 else "float32"})

    @staticmethod
    def from_dict(d: dict) -> "WinoOutPlaneSpec":
        at = tuple(tuple((int(i), float(c)) for i, c in row) for row in d["at"])
        return WinoOutPlaneSpec(**{**d, "at": at})


def activation_ir(ir: IRBuilder, spec, v: str, L: int) -> str:
    """spec.act ("" | "Relu" | "Clip" with act_lo, act_hi) of <L x float> v: llvm.maxnum / minnum."""
    bounds = {"": (), "Relu": (("maxnum", 0.0),), "Clip": (("maxnum", spec.act_lo), ("minnum", spec.act_hi))}
    for op, bound in bounds[spec.act]:
        if abs(bound) != float("inf"):
            v = ir_op(ir, f"call <{L} x float> @llvm.{op}.v{L}f32(<{L} x float> {v}, <{L} x float> "
                          f"{splat(L, float_ir(bound), 'float')})", "f")
    return v


def winoout_plane_ir(spec: WinoOutPlaneSpec, vector_bits: int) -> str:
    """The micro-kernel's module (see WinoOutPlaneSpec and the module docstring). 512-bit vectors
    (taken only where the GEMM is vdpbf16ps: winograd_bf16.lower_winograd_bf16)."""
    L, a = LANES, 4
    vf, vi = f"<{L} x float>", f"<{L} x i32>"
    th = -(-spec.oh // 2)
    tiles = th * spec.tw
    P = spec.oh * spec.ow
    n_chunks = -(-P // L)
    ir = IRBuilder()
    ir.label("entry")
    ir("%m0 = getelementptr float, ptr %m, i64 %moff")
    tile_mask = None
    if tiles < L:
        tile_mask = "<" + ", ".join(f"i1 {int(j < tiles)}" for j in range(L)) + ">"
    M = []
    for xi in range(a * a):
        M.append(load_lanes(ir, "%m0", str(xi * spec.xs), "float", L, tile_mask))
    used = sorted({j for q in range(2) for j, _ in spec.at[q]})
    s = {(r, j): combine_ir(ir, spec.at[r], [M[a * i + j] for i in range(a)], L) for r in range(2) for j in used}
    outs = [combine_ir(ir, spec.at[q], {j: s[r, j] for j in used}, L) for r in range(2) for q in range(2)]   # 2r + q
    # the plane: lane p = y * ow + x of the four (r, q) vectors concatenated
    pairs = [ir_op(ir, f"shufflevector {vf} {outs[0]}, {vf} {outs[1]}, <{2 * L} x i32> "
                       f"<{', '.join(f'i32 {j}' for j in range(2 * L))}>"),
             ir_op(ir, f"shufflevector {vf} {outs[2]}, {vf} {outs[3]}, <{2 * L} x i32> "
                       f"<{', '.join(f'i32 {j}' for j in range(2 * L))}>")]
    four = ir_op(ir, f"shufflevector <{2 * L} x float> {pairs[0]}, <{2 * L} x float> {pairs[1]}, <{4 * L} x i32> "
                     f"<{', '.join(f'i32 {j}' for j in range(4 * L))}>")
    ir("%y0 = getelementptr i16, ptr %y, i64 %yoff" if spec.y16 else "%y0 = getelementptr float, ptr %y, i64 %yoff")
    if spec.residual:
        ir(f"%r0 = getelementptr {'i16' if spec.residual == 'bf16' else 'float'}, ptr %r, i64 %roff")
    if spec.bias:
        ir("%bp = getelementptr float, ptr %bias, i64 %boff")
        ir("%b = load float, ptr %bp, align 4")
        ir(f"%bv0 = insertelement {vf} poison, float %b, i64 0")
        ir(f"%bv = shufflevector {vf} %bv0, {vf} poison, <{L} x i32> zeroinitializer")
    # 16-bit rows go in and out as one <64 x i16> masked load / store (lanes < P): a 16-lane
    # masked store of one live i16 lane came out of LLVM as a 32-bit `vmovd` (two lanes written)
    wide_mask = "<" + ", ".join(f"i1 {int(j < P)}" for j in range(4 * L)) + ">"
    concat = "<" + ", ".join(f"i32 {j}" for j in range(4 * L)) + ">"
    if spec.residual == "bf16":
        r_all = load_lanes(ir, "%r0", "0", "i16", 4 * L, wide_mask)
    rounded = []
    for chunk in range(n_chunks):
        lanes = range(chunk * L, chunk * L + L)
        index = []
        for p in lanes:
            y, x = divmod(p, spec.ow) if p < P else (0, 0)
            index.append((2 * (y % 2) + x % 2) * L + (y // 2) * spec.tw + x // 2)
        v = ir_op(ir, f"shufflevector <{4 * L} x float> {four}, <{4 * L} x float> poison, <{L} x i32> "
                      f"<{', '.join(f'i32 {j}' for j in index)}>", "f")
        live = min(L, P - chunk * L)
        mask = None if live == L else "<" + ", ".join(f"i1 {int(j < live)}" for j in range(L)) + ">"
        if spec.bias:
            v = ir_op(ir, f"fadd {vf} {v}, %bv", "f")
        if spec.residual == "bf16":
            h = ir_op(ir, f"shufflevector <{4 * L} x i16> {r_all}, <{4 * L} x i16> poison, <{L} x i32> "
                          f"<{', '.join(f'i32 {j}' for j in lanes)}>")
            w = ir_op(ir, f"zext <{L} x i16> {h} to {vi}")
            w = ir_op(ir, f"shl {vi} {w}, {splat(L, 16)}")
            v = ir_op(ir, f"fadd {vf} {v}, {ir_op(ir, f'bitcast {vi} {w} to {vf}', 'f')}", "f")
        elif spec.residual == "f32":
            v = ir_op(ir, f"fadd {vf} {v}, {load_lanes(ir, '%r0', str(chunk * L), 'float', L, mask)}", "f")
        v = activation_ir(ir, spec, v, L)
        if spec.y16:
            rounded.append(f32_to_bf16(ir, ir_op(ir, f"bitcast {vf} {v} to {vi}"), L, spec.method))
        else:
            store_lanes(ir, v, "%y0", str(chunk * L), "float", L, mask)
    if spec.y16:
        rounded += ["zeroinitializer"] * (4 - n_chunks)
        halves = [ir_op(ir, f"shufflevector <{L} x i16> {rounded[h]}, <{L} x i16> {rounded[h + 1]}, <{2 * L} x i32> "
                            f"<{', '.join(f'i32 {j}' for j in range(2 * L))}>") for h in (0, 2)]
        y_all = ir_op(ir, f"shufflevector <{2 * L} x i16> {halves[0]}, <{2 * L} x i16> {halves[1]}, <{4 * L} x i32> {concat}")
        store_lanes(ir, y_all, "%y0", "0", "i16", 4 * L, wide_mask)
    ir("ret i32 0")
    head = (f"define i32 @{spec.name}(ptr noalias %m, i64 %moff, ptr noalias %bias, i64 %boff, ptr noalias %r, "
            f"i64 %roff, ptr noalias %y, i64 %yoff) #0 {{")
    decls = masked_decls(("float", L), ("i16", 4 * L)) + [f"declare {vf} @llvm.{op}.v{L}f32({vf}, {vf})"
                                                      for op in ("maxnum", "minnum")]
    return kernel_module(head, ir, decls)
