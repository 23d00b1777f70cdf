"""bf16 Winograd's input transform as a vector micro-kernel (LLVM IR): a run of n consecutive
tiles of one channel pair, L tiles a vector (16 at 512 bits), their V rounded to bf16 pairs.

For tile q < n, with d_h[k][l] = channel h's patch value (k, l) of tile q (h = 0, 1: the pair):

    V_h = B^T d_h B                                  (float32; B^T's coefficients are 0, +-1 for F2)
    dst[doff + xi * xs + q] = bf16(V_0[xi]) | bf16(V_1[xi]) << 16        xi = a * i + j < a * a

    d_h[k][l] = the low (h = 0) or high half of src[soff + offsets[a * k + l] + q], widened    (x16)
              = src[soff + h * ldb + offsets[a * k + l] + q]                         (float32 phases)

winograd_bf16._in_kernel's transform, run a vector of tiles at a time. Why a micro-kernel: the
rounding. Numba's loop rounds with the exact integer RNE (~8 i32 operations a value) that LLVM
vectorises only 8 lanes wide; a loop of LLVM's `fptrunc float to bfloat` (`vcvtneps2bf16`) it
vectorised 4 lanes wide with scalar extracts (WinoIn of ResNet-18 0.575 -> 0.755 ms). Here
every operation is written 16 lanes wide, and the rounding is `method`:

- "hw": `vcvtneps2bf16` (AVX512-BF16; the Winograd GEMM is then `vdpbf16ps`): round to nearest
  even as "exact", but a float32 subnormal becomes zero. V feeds only `vdpbf16ps`, which reads a
  subnormal bf16 as zero anyway: a product differs only where the exact rounding carries a
  subnormal up to 2^-126, |change| <= 2^-126 |U| per product.
- "exact": lowp.f32_to_bf16's integer RNE (NaN kept quiet), bit for bit bf16_pair_rne's.

Loads and stores of the last n mod L tiles are masked (nothing read or written past tile n - 1).
Signature: i32 name(ptr src, i64 soff, ptr dst, i64 doff, i64 n).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .lowp import f32_to_bf16, ir_op, kernel_module, load_lanes, masked_decls, splat, store_lanes, \
    strip_loop, typed_declaration
from .ukernel import Declared, IRBuilder, float_ir, lanes_for


@dataclass(frozen=True)
class WinoInSpec(Declared):
    """See the module docstring. `bt`: B^T's rows as ((column, coefficient), ...), nonzero terms only
    (winograd.Transform.BT); `offsets`: the a * a patch offsets (elements of src); `xs`: words
    between V's positions; `x16`: src holds bf16 pair words (else float32 planes `ldb` apart)."""
    bt: tuple
    offsets: tuple
    xs: int
    x16: int
    ldb: int = 0
    method: str = "exact"   # "exact" | "hw" (see the module docstring)
    tw: int = 0             # > 0: a plane of n <= 16 tiles in rows of tw, `pw` words apart (winoin_plane_ir)
    pw: int = 0
    kind: str = "winoin16"
    _ARGS: ClassVar[str] = "pipii"

    def __post_init__(self):
        assert self.method in ("exact", "hw"), self.method
        assert len(self.offsets) == len(self.bt) ** 2, (self.offsets, self.bt)

    def _stem(self) -> str:
        return f"cuvil_winoin16_{self.method}"

    def declaration(self, var: str) -> str:
        return typed_declaration(self, var, {0: "uint32" if self.x16 else "float32", 2: "uint32"})

    @staticmethod
    def from_dict(d: dict) -> "WinoInSpec":
        """The spec from its comment line's JSON (lists back to tuples)."""
        bt = tuple(tuple((int(i), float(c)) for i, c in row) for row in d["bt"])
        return WinoInSpec(**{**d, "bt": bt, "offsets": tuple(d["offsets"])})


def combine_ir(ir: IRBuilder, row, values, L: int) -> str:
    """sum over the row's (index, coefficient) of coefficient * values[index], left to right,
    <L x float> (zeroinitializer for a row without terms); the transforms of winoout_plane.py and
    winoout_rows.py too."""
    vf = f"<{L} x float>"
    out = None
    for index, c in row:
        v = values[index]
        if abs(c) != 1:
            v = ir_op(ir, f"fmul {vf} {v}, {splat(L, float_ir(abs(c)), 'float')}", "f")
        if out is None:
            out = v if c > 0 else ir_op(ir, f"fneg {vf} {v}", "f")
        else:
            out = ir_op(ir, f"{'fadd' if c > 0 else 'fsub'} {vf} {out}, {v}", "f")
    return out if out is not None else "zeroinitializer"


def winoin_ir(spec: WinoInSpec, vector_bits: int) -> str:
    """The micro-kernel's module (see WinoInSpec and the module docstring)."""
    if spec.tw:
        return winoin_plane_ir(spec)
    L = min(lanes_for(vector_bits), 16)
    a = len(spec.bt)
    vi, vf = f"<{L} x i32>", f"<{L} x float>"
    src_elem = "i32"   # pair words, or float32 bits
    ir = IRBuilder()
    ir.label("entry")
    ir("%s0 = getelementptr i32, ptr %src, i64 %soff")
    if not spec.x16:
        ir(f"%s1 = getelementptr i32, ptr %s0, i64 {spec.ldb}")
    ir("%d0 = getelementptr i32, ptr %dst, i64 %doff")

    def step(ir, i, mask):
        d = [[None] * (a * a), [None] * (a * a)]
        for p, off in enumerate(spec.offsets):
            at = ir_op(ir, f"add i64 {i}, {off}", "o")
            if spec.x16:
                w = load_lanes(ir, "%s0", at, src_elem, L, mask)
                lo = ir_op(ir, f"shl {vi} {w}, {splat(L, 16)}")
                hi = ir_op(ir, f"and {vi} {w}, {splat(L, -65536)}")
                d[0][p] = ir_op(ir, f"bitcast {vi} {lo} to {vf}", "f")
                d[1][p] = ir_op(ir, f"bitcast {vi} {hi} to {vf}", "f")
            else:
                for h, row in enumerate(("%s0", "%s1")):
                    d[h][p] = ir_op(ir, f"bitcast {vi} {load_lanes(ir, row, at, src_elem, L, mask)} to {vf}", "f")
        halves = []
        for h in (0, 1):
            e = [[combine_ir(ir, rowk, [d[h][a * k + l] for k in range(a)], L) for l in range(a)]
                 for rowk in spec.bt]                                          # e[i][l]: along the patch's columns
            halves.append([combine_ir(ir, rowl, e[i], L) for i in range(a) for rowl in spec.bt])   # xi = a i + j
        for xi in range(a * a):
            words = []
            for h in (0, 1):
                bits = ir_op(ir, f"bitcast {vf} {halves[h][xi]} to {vi}")
                half = f32_to_bf16(ir, bits, L, spec.method)
                words.append(ir_op(ir, f"zext <{L} x i16> {half} to {vi}"))
            high = ir_op(ir, f"shl {vi} {words[1]}, {splat(L, 16)}")
            word = ir_op(ir, f"or {vi} {words[0]}, {high}")
            at = ir_op(ir, f"add i64 {i}, {xi * spec.xs}", "o")
            store_lanes(ir, word, "%d0", at, "i32", L, mask)
    strip_loop(ir, L, step)
    head = f"define i32 @{spec.name}(ptr noalias %src, i64 %soff, ptr noalias %dst, i64 %doff, i64 %n) #0 {{"
    return kernel_module(head, ir, masked_decls(("i32", L)))


def winoin_plane_ir(spec: WinoInSpec) -> str:
    """A plane of n <= 16 tiles in rows of `tw` (tile q at q + (q // tw) (pw - tw) of the phases:
    a 7x7 output's 4 x 4 tiles, its tile rows laid out without the extra column), bf16 pair words
    only: the phases' whole span loaded once (masked, one <S x i32>), each patch position's 16
    tiles one constant shuffle of it (where Numba's loop gathered them), then as winoin_ir with
    the tiles in lanes; V's lanes past n are not stored. Signature as winoin_ir's (n <= 16)."""
    assert spec.x16, "the plane form reads bf16 pair words"
    L, a = 16, len(spec.bt)
    vi, vf = f"<{L} x i32>", f"<{L} x float>"
    place = [q + (q // spec.tw) * (spec.pw - spec.tw) for q in range(L)]
    span = max(spec.offsets) + max(place) + 1
    S = -(-span // L) * L
    ir = IRBuilder()
    ir.label("entry")
    ir("%s0 = getelementptr i32, ptr %src, i64 %soff")
    ir("%d0 = getelementptr i32, ptr %dst, i64 %doff")
    lanes = "<" + ", ".join(f"i64 {j}" for j in range(L)) + ">"
    ir(f"%nv0 = insertelement <{L} x i64> poison, i64 %n, i64 0")
    ir(f"%nv = shufflevector <{L} x i64> %nv0, <{L} x i64> poison, <{L} x i32> zeroinitializer")
    ir(f"%m = icmp slt <{L} x i64> {lanes}, %nv")           # the tiles q < n
    # the span of the phases the n tiles read: every word up to the last tile's last patch word
    ir("%last = add i64 %n, -1")
    ir(f"%rowq = udiv i64 %last, {spec.tw}")
    ir(f"%lastw = mul i64 %rowq, {spec.pw - spec.tw}")
    ir("%lastp = add i64 %last, %lastw")
    ir(f"%spanw = add i64 %lastp, {max(spec.offsets) + 1}")
    ir(f"%sv0 = insertelement <{S} x i64> poison, i64 %spanw, i64 0")
    ir(f"%sv = shufflevector <{S} x i64> %sv0, <{S} x i64> poison, <{S} x i32> zeroinitializer")
    ir(f"%sm = icmp slt <{S} x i64> <{', '.join(f'i64 {j}' for j in range(S))}>, %sv")
    words = load_lanes(ir, "%s0", "0", "i32", S, "%sm")
    d = [[None] * (a * a), [None] * (a * a)]
    for p, off in enumerate(spec.offsets):
        index = ", ".join(f"i32 {off + place[q]}" for q in range(L))
        w = ir_op(ir, f"shufflevector <{S} x i32> {words}, <{S} x i32> poison, <{L} x i32> <{index}>")
        lo = ir_op(ir, f"shl {vi} {w}, {splat(L, 16)}")
        hi = ir_op(ir, f"and {vi} {w}, {splat(L, -65536)}")
        d[0][p] = ir_op(ir, f"bitcast {vi} {lo} to {vf}", "f")
        d[1][p] = ir_op(ir, f"bitcast {vi} {hi} to {vf}", "f")
    halves = []
    for h in (0, 1):
        e = [[combine_ir(ir, rowk, [d[h][a * k + l] for k in range(a)], L) for l in range(a)] for rowk in spec.bt]
        halves.append([combine_ir(ir, rowl, e[i], L) for i in range(a) for rowl in spec.bt])
    for xi in range(a * a):
        pair = []
        for h in (0, 1):
            half = f32_to_bf16(ir, ir_op(ir, f"bitcast {vf} {halves[h][xi]} to {vi}"), L, spec.method)
            pair.append(ir_op(ir, f"zext <{L} x i16> {half} to {vi}"))
        word = ir_op(ir, f"or {vi} {pair[0]}, {ir_op(ir, f'shl {vi} {pair[1]}, {splat(L, 16)}')}")
        store_lanes(ir, word, "%d0", str(xi * spec.xs), "i32", L, "%m")
    ir("ret i32 0")
    head = f"define i32 @{spec.name}(ptr noalias %src, i64 %soff, ptr noalias %dst, i64 %doff, i64 %n) #0 {{"
    return kernel_module(head, ir, masked_decls(*sorted({("i32", L), ("i32", S)})))
