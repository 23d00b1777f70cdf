"""MatMulNBits at accuracy_level 4 (cuvil/nbits.py int8_activations), 4 bits, on AVX512-VNNI.

onnxruntime-genai's builder writes its int4 products with accuracy_level 4: onnxruntime then
quantises each row of A to int8 per block (amax / 127, round half to even) and sums
qa * (q - zp) in integers (MLAS's CompInt8 path). This module does the same with `vpdpbusd`
(u8 x s8 -> s32, 4 products a lane):

    Y[m, n] = sum_b (scale_a[m, b] * scale[n, b]) * (sum_{k in b} qa[m, k] q[n, k] - zp[n, b] * asum[m, b])

- A first call (`quantize_call`) writes, per row and block, the int8 codes qa (K padded to whole
  blocks with zeros), scale_a = amax / 127 (float32) and asum = sum qa (int32).
- Weights (packed at build time), per group of 64 columns (4 vectors of 16; N padded to 64), per
  block b, per octet o of 8 k, per vector v: 64 bytes, lane j = column 16 v + j, byte t of the lane
  holding q[k = 8 o + t] in its low nibble and q[k = 8 o + 4 + t] in its high one. So one 64-byte
  load, `and 0x0F` and `lshr 4, and 0x0F` give the two operands of two `vpdpbusd`s (16 columns x
  4 k each) against A's 4 bytes at k = 8 o and 8 o + 4, broadcast. Codes are unsigned (0..15): the
  zero point joins at the block's end, through asum. Scales [g][b][64] float32; zero points
  [g][b][64] uint8 (or the constant 8).
- Kernel (VnniSpec, LLVM IR): a tile of mr rows x 64 columns over the whole K; per block the
  exact integer sum, then y = fma(float(isum - zp asum), scale_a * scale, y); bias; masked stores.

Rounding: the integer sums are exact (|sum| <= 127 * 15 * block < 2^31), so the result differs from
onnxruntime's only in the float32 rounding of scale_a * scale, the conversion (exact below 2^24)
and the sum over blocks: within gamma(2 k_blocks + 2) * sum_b |scale_a scale isum_b|
(tests/test_nbits.py bounds it by Cuvil's float32 bound, which is larger).
Decode (M = 1) reads the weights once; a prefill reads a group's weights (K x 64 / 2 bytes: 16 KiB
at K = 512) from L1 for each pair of rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from backends.targets import has_feature
from cuvil import nbits as form

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, lowering_target
from .lowp import column_masks, typed_declaration
from .nbits import bias_and_masked_stores
from .scratch import scratch_value
from .ukernel import Declared, IRBuilder, function_module

LANES = 16
V = 4                   # vectors per column group (64 columns)
NC = LANES * V
MAX_ROWS = 2            # rows per tile: 2 x 4 accumulators, 2 x 4 sums of y, 8 code vectors
NIBBLES = 0x0F0F0F0F


def applies(node, weight: form.NBitsWeight, perm) -> bool:
    """accuracy_level 4 with 4-bit codes, integer (or no) zero points, no act-order, on a target
    with AVX512-VNNI and 512-bit vectors."""
    target = lowering_target()
    return (form.int8_activations(node, weight) and weight.bits == 4 and perm is None
            and target is not None and has_feature(target, "avx512vnni") and target.vector_bits >= 512)


@dataclass(frozen=True)
class VnniSpec(Declared):
    """A tile of `mr` rows x 64 columns of Y over the whole K (module docstring).

    Signature: i32 name(ptr qa, i64 qaoff, ptr sa, i64 saoff, ptr asum, i64 sumoff, ptr w, i64 woff,
                        ptr s, i64 soff, ptr z, i64 zoff, ptr bias, i64 boff, ptr out, i64 ooff, i64 mask)
    qa rows at qa[qaoff + i*K_pad + k] (int8); scale_a, asum at [off + i*k_blocks + b]; out rows at
    out[ooff + i*N + j], masked by bit j of `mask`."""
    mr: int
    K_pad: int
    N: int
    block: int
    zp: str = "const"       # "const" (zp_const) | "u8" (z codes)
    zp_const: int = 8
    bias: int = 0
    split: int = 0          # 1: separate accumulators for the low and high nibbles (one row: 8 chains)
    layout: int = 1         # the version of vnni_ir and of the packed layout it reads
    kind: str = "nbits_vnni"
    _ARGS: ClassVar[str] = "pipipipipipipipii"

    def _stem(self) -> str:
        return f"cuvil_nbits4_vnni_{self.mr}x{NC}"

    def declaration(self, var: str) -> str:
        return typed_declaration(self, var, {0: "int8", 4: "int32", 6: "uint8", 10: "uint8"})


def kinds() -> dict:
    return {"nbits_vnni": lambda d: VnniSpec(**d)}


def _splat(ir: IRBuilder, ty: str, scalar: str) -> str:
    v0, v = ir.tmp("s0"), ir.tmp("sv")
    ir(f"{v0} = insertelement <16 x {ty}> poison, {ty} {scalar}, i64 0")
    ir(f"{v} = shufflevector <16 x {ty}> {v0}, <16 x {ty}> poison, <16 x i32> zeroinitializer")
    return v


def _const(value: int) -> str:
    return "<" + ", ".join([f"i32 {value}"] * LANES) + ">"


def vnni_ir(spec: VnniSpec, vector_bits: int) -> str:
    """The micro-kernel's module (one function named spec.name); needs AVX512-VNNI."""
    vi, vf = "<16 x i32>", "<16 x float>"
    n_blocks = spec.K_pad // spec.block
    octs = spec.block // 8
    rows, vecs = range(spec.mr), range(V)
    halves = (0, 1) if spec.split else (0, 0)
    ir = IRBuilder()
    rename = {}
    ir.label("entry")
    ir("%qab = getelementptr i8, ptr %qa, i64 %qaoff")
    ir("%sab = getelementptr float, ptr %sa, i64 %saoff")
    ir("%smb = getelementptr i32, ptr %asum, i64 %sumoff")
    ir("%wb = getelementptr i8, ptr %w, i64 %woff")
    ir("%sb = getelementptr float, ptr %s, i64 %soff")
    ir("%zb = getelementptr i8, ptr %z, i64 %zoff")
    ir("%ob = getelementptr float, ptr %out, i64 %ooff")
    ir("%bb = getelementptr float, ptr %bias, i64 %boff")
    masks = column_masks(ir, V, LANES)
    ir("br label %bh")

    # -- block loop: y carried over blocks
    ir.label("bh")
    ir("%b = phi i64 [ 0, %entry ], [ %bn, %be ]")
    for i in rows:
        for v in vecs:
            ir(f"%y{i}_{v} = phi {vf} [ zeroinitializer, %entry ], [ %yn{i}_{v}, %be ]")
    ir(f"%kb = mul i64 %b, {spec.block}")
    ir(f"%wblk = mul i64 %b, {octs * V * 64}")
    ir("br label %ol")

    # -- octet loop: 8 k a step, integer accumulators
    ir.label("ol")
    ir("%o = phi i64 [ 0, %bh ], [ %on, %ol ]")
    for i in rows:
        for v in vecs:
            for h in sorted(set(halves)):
                ir(f"%a{i}_{v}_{h} = phi {vi} [ zeroinitializer, %bh ], [ %an{i}_{v}_{h}, %ol ]")
    ir("%k8 = shl i64 %o, 3")
    ir("%kk = add i64 %kb, %k8")
    xs = {}
    for i in rows:
        p = ir.tmp("xp")
        ir(f"{p} = getelementptr i8, ptr %qab, i64 {i * spec.K_pad}")
        ir(f"{p}k = getelementptr i8, ptr {p}, i64 %kk")
        for h in (0, 1):
            q, x = ir.tmp("xq"), ir.tmp("x")
            ir(f"{q} = getelementptr i8, ptr {p}k, i64 {4 * h}")
            ir(f"{x} = load i32, ptr {q}, align 1")
            xs[i, h] = _splat(ir, "i32", x)
    ir(f"%wo = mul i64 %o, {V * 64}")
    ir("%wo2 = add i64 %wblk, %wo")
    cur = {(i, v, h): f"%a{i}_{v}_{h}" for i in rows for v in vecs for h in set(halves)}
    for v in vecs:
        p, raw, lo, sh, hi = ir.tmp("wp"), ir.tmp("wr"), ir.tmp("lo"), ir.tmp("sh"), ir.tmp("hi")
        ir(f"{p} = getelementptr i8, ptr %wb, i64 %wo2")
        ir(f"{p}v = getelementptr i8, ptr {p}, i64 {v * 64}")
        ir(f"{raw} = load {vi}, ptr {p}v, align 1")
        ir(f"{lo} = and {vi} {raw}, {_const(NIBBLES)}")
        ir(f"{sh} = lshr {vi} {raw}, {_const(4)}")
        ir(f"{hi} = and {vi} {sh}, {_const(NIBBLES)}")
        for h, codes in enumerate((lo, hi)):
            for i in rows:
                key = (i, v, halves[h])
                out = ir.tmp("dp")
                ir(f"{out} = call {vi} @llvm.x86.avx512.vpdpbusd.512({vi} {cur[key]}, {vi} {codes}, {vi} {xs[i, h]})")
                cur[key] = out
    for key, value in cur.items():
        rename["%an{}_{}_{}".format(*key)] = value
    ir("%on = add i64 %o, 1")
    ir(f"%oc = icmp ult i64 %on, {octs}")
    ir("br i1 %oc, label %ol, label %be")

    # -- block end: y += float(isum - zp * asum) * (scale_a * scale)
    ir.label("be")
    ir(f"%sbo = mul i64 %b, {NC}")
    per_row = {}
    for i in rows:
        p, sa, q, sm = ir.tmp("ap"), ir.tmp("sa"), ir.tmp("mp"), ir.tmp("sm")
        ir(f"{p} = getelementptr float, ptr %sab, i64 {i * n_blocks}")
        ir(f"{p}b = getelementptr float, ptr {p}, i64 %b")
        ir(f"{sa} = load float, ptr {p}b, align 4")
        ir(f"{q} = getelementptr i32, ptr %smb, i64 {i * n_blocks}")
        ir(f"{q}b = getelementptr i32, ptr {q}, i64 %b")
        ir(f"{sm} = load i32, ptr {q}b, align 4")
        if spec.zp == "const":
            c = ir.tmp("zc")
            ir(f"{c} = mul i32 {sm}, {spec.zp_const}")
            per_row[i] = (_splat(ir, "float", sa), _splat(ir, "i32", c))
        else:
            per_row[i] = (_splat(ir, "float", sa), _splat(ir, "i32", sm))
    for v in vecs:
        p, s = ir.tmp("sp"), ir.tmp("sc")
        ir(f"{p} = getelementptr float, ptr %sb, i64 %sbo")
        ir(f"{p}v = getelementptr float, ptr {p}, i64 {v * LANES}")
        ir(f"{s} = load {vf}, ptr {p}v, align 4")
        zpv = None
        if spec.zp == "u8":
            q, raw = ir.tmp("zp"), ir.tmp("zr")
            ir(f"{q} = getelementptr i8, ptr %zb, i64 %sbo")
            ir(f"{q}v = getelementptr i8, ptr {q}, i64 {v * LANES}")
            ir(f"{raw} = load <16 x i8>, ptr {q}v, align 1")
            zpv = ir.tmp("zv")
            ir(f"{zpv} = zext <16 x i8> {raw} to {vi}")
        for i in rows:
            acc = cur[i, v, 0]
            if spec.split:
                acc = ir.tmp("ab")
                ir(f"{acc} = add {vi} {cur[i, v, 0]}, {cur[i, v, 1]}")
            sav, corr = per_row[i]
            if zpv is not None:
                prod = ir.tmp("zm")
                ir(f"{prod} = mul {vi} {zpv}, {corr}")
                corr = prod
            t, f, sc, y = ir.tmp("t"), ir.tmp("f"), ir.tmp("ss"), ir.tmp("y")
            ir(f"{t} = sub {vi} {acc}, {corr}")
            ir(f"{f} = sitofp {vi} {t} to {vf}")
            ir(f"{sc} = fmul {vf} {sav}, {s}")
            ir(f"{y} = call {vf} @llvm.fma.v16f32({vf} {f}, {vf} {sc}, {vf} %y{i}_{v})")
            rename[f"%yn{i}_{v}"] = y
    ir("%bn = add i64 %b, 1")
    ir(f"%bc = icmp ult i64 %bn, {n_blocks}")
    ir("br i1 %bc, label %bh, label %done")

    # -- bias, masked stores
    ir.label("done")
    bias_and_masked_stores(ir, vecs, rows, masks, spec.N, spec.bias)
    ir("ret i32 0")

    head = (f"define i32 @{spec.name}(ptr noalias %qa, i64 %qaoff, ptr noalias %sa, i64 %saoff, "
            "ptr noalias %asum, i64 %sumoff, ptr noalias %w, i64 %woff, ptr noalias %s, i64 %soff, "
            "ptr noalias %z, i64 %zoff, ptr noalias %bias, i64 %boff, ptr noalias %out, i64 %ooff, "
            "i64 %mask) #0 {")
    decls = [f"declare {vi} @llvm.x86.avx512.vpdpbusd.512({vi}, {vi}, {vi})",
             "declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)",
             "declare void @llvm.masked.store.v16f32.p0(<16 x float>, ptr, <16 x i1>)"]
    return function_module(head, ir, rename, decls)


# -- build-time packing --------------------------------------------------------------------------

def pack(weight: form.NBitsWeight) -> dict:
    """The kernel's arrays (module docstring): w, s, z (or None), bias (or None)."""
    N, K, block = weight.N, weight.K, weight.block_size
    nb = weight.k_blocks
    groups = -(-N // NC)
    n_pad, k_pad = groups * NC, nb * block
    q = np.zeros((n_pad, k_pad), np.uint8)
    q[:N, :K] = weight.q
    # [g, v, j, b, o, h, t] -> byte (low nibble h = 0, high h = 1) -> [g, b, o, v, j, t]
    q = q.reshape(groups, V, LANES, nb, block // 8, 2, 4)
    w = q[..., 0, :] | (q[..., 1, :] << 4)
    w = np.ascontiguousarray(w.transpose(0, 3, 4, 1, 2, 5)).reshape(-1)

    def per_block(a, dtype):    # [N, nb] -> [g, b, 64]
        out = np.zeros((n_pad, nb), dtype)
        out[:N] = a
        return np.ascontiguousarray(out.reshape(groups, NC, nb).transpose(0, 2, 1)).reshape(-1)

    s = per_block(weight.scales.astype(np.float32), np.float32)
    z = None if weight.zero_points is None else per_block(weight.zero_points, np.uint8)
    bias = None
    if weight.bias is not None:
        bias = np.zeros(n_pad, np.float32)
        bias[:N] = weight.bias
    return {"w": w, "s": s, "z": z, "bias": bias}


def quantize_call(node, graph, M: int, K: int, block: int) -> tuple[KernelCall, tuple[str, str, str]]:
    """A's rows to int8 per block (cuvil/nbits.py int8_activations: amax / 127, 127 / amax, round
    half to even), the codes' block sums and scales into scratch: the call and the three names."""
    nb = -(-K // block)
    k_pad = nb * block
    qa = scratch_value(graph, node, (M, k_pad), np.int8, tag="a_q8")
    sa = scratch_value(graph, node, (M, nb), np.float32, tag="a_q8_scale")
    sm = scratch_value(graph, node, (M, nb), np.int32, tag="a_q8_sum")
    src = Source().line(kernel_header(4)).indent()
    src.line("for m in range(begin, end):").indent()
    src.line(f"for b in range({nb}):").indent()
    src.line(f"row = m * {K} + b * {block}").line(f"dst = m * {k_pad} + b * {block}")
    src.line(f"n = min({block}, {K} - b * {block})")
    src.line("amax = np.float32(0.0)")
    src.line("for k in range(n):").indent().line("amax = max(amax, abs(p0[row + k]))").dedent()
    src.line(f"p2[m * {nb} + b] = amax / np.float32(127.0)")
    src.line("inv = np.float32(127.0) / amax if amax != np.float32(0.0) else np.float32(0.0)")
    src.line("total = 0")
    src.line("for k in range(n):").indent()
    src.line("c = np.int32(np.rint(p0[row + k] * inv))")
    src.line("p1[dst + k] = np.int8(c)").line("total += c").dedent()
    src.line(f"for k in range(n, {block}):").indent().line("p1[dst + k] = np.int8(0)").dedent()
    src.line(f"p3[m * {nb} + b] = np.int32(total)")
    kernel = Kernel("matmulnbits_a_q8", src.text(), ("float32", "int8", "float32", "int32"))
    return KernelCall(kernel, [node.inputs[0], qa, sa, sm], M, node.name, n_outputs=3), (qa, sa, sm)


def lower(node, graph, weight: form.NBitsWeight) -> Lowered:
    a = graph.values[node.inputs[0]]
    K, N, block = weight.K, weight.N, weight.block_size
    M = int(np.prod(a.shape[:-1], dtype=np.int64)) if len(a.shape) > 1 else 1
    nb = weight.k_blocks
    k_pad = nb * block
    quant, (qa, sa, sm) = quantize_call(node, graph, M, K, block)
    arrays = pack(weight)
    groups = -(-N // NC)
    mr = min(M, MAX_ROWS)
    row_tiles, full_tiles = -(-M // mr), M // mr
    zp_kind = "const" if weight.zero_points is None else "u8"
    base = dict(K_pad=k_pad, N=N, block=block, zp=zp_kind, zp_const=form.default_zero_point(4),
                bias=int(weight.bias is not None))
    specs = {rows: (f"uk_{rows}", VnniSpec(mr=rows, split=int(rows == 1), **base))
             for rows in sorted({mr, M % mr} - {0})}
    args = [qa, sa, sm, arrays["w"], arrays["s"]]
    types = ["int8", "float32", "int32", "uint8", "float32"]
    z_arg, b_arg = "p3", "p1"   # unused pointers of the declared types when absent
    if arrays["z"] is not None:
        z_arg = f"p{len(args)}"
        args.append(arrays["z"])
        types.append("uint8")
    if arrays["bias"] is not None:
        b_arg = f"p{len(args)}"
        args.append(arrays["bias"])
        types.append("float32")
    out = f"p{len(args)}"
    args.append(node.outputs[0])
    types.append("float32")
    w_group = k_pad // 2 * NC
    last_cols = N - (groups - 1) * NC

    def as_i64(mask):
        return mask - (1 << 64) if mask >= 1 << 63 else mask

    src = Source()
    for var, spec in sorted(specs.values()):
        for line in spec.declaration(var).splitlines():
            src.line(line)
    src.line(kernel_header(len(args))).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"g = item // {row_tiles}")
    src.line(f"r = item - g * {row_tiles}")
    src.line(f"mask = np.int64({as_i64((1 << NC) - 1)}) if g < {groups - 1} else np.int64({as_i64((1 << last_cols) - 1)})")
    z_off = f"g * {nb * NC}" if arrays["z"] is not None else "0"
    b_off = f"g * {NC}" if arrays["bias"] is not None else "0"

    def call(rows):
        var = specs[rows][0]
        src.line(f"{var}(p0, r * {mr * k_pad}, p1, r * {mr * nb}, p2, r * {mr * nb}, p3, g * {w_group}, "
                 f"p4, g * {nb * NC}, {z_arg}, {z_off}, {b_arg}, {b_off}, {out}, r * {mr * N} + g * {NC}, mask)")

    if full_tiles == row_tiles:
        call(mr)
    else:
        src.line(f"if r < {full_tiles}:").indent()
        call(mr)
        src.dedent().line("else:").indent()
        call(M % mr)
        src.dedent()
    kernel = Kernel("matmulnbits_vnni", src.text(), tuple(types), self_sized=True)
    label = f"int4 weights, block {block}, int8 activations (VNNI)"
    return Lowered([quant, KernelCall(kernel, args, groups * row_tiles, node.name, precision=label)])
