"""MatMulNBits (com.microsoft; cuvil/nbits.py): weight-only 4-bit / 8-bit products with float32 activations.

    Y[m, n] = sum_b scale[n, b] * sum_{k in block b} A[m, k] * (q[n, k] - zp[n, b])   (+ bias[n])

At batch 1 a decoder's products are memory-bound: the point is to read 4 bits per weight. The codes
stay packed in the library (repacked at build time, not widened) and a micro-kernel written as
LLVM vector IR (NBitsSpec) unpacks them in registers:

- Layout (built here, per group of NC = 16 V output columns, the last group only as wide as its
  16-column vectors; K padded to whole blocks):
  4 bits: w[g][kp][j] = q[g NC + j, 2kp] | q[g NC + j, 2kp + 1] << 4, one byte per column per k pair,
  so 16 bytes are the two k of a pair for 16 columns (llama.cpp's Q4 puts 32 k of one column in
  16 bytes, which needs a horizontal sum per block; here the lanes are columns, as in MLAS's
  SQNBitGemm column panels, and nothing is reduced across lanes). 8 bits: w[g][k][j] = q[., k].
  scales s[g][b][j] (float32, or float16 when every scale is exactly a float16: 2 bytes instead of
  4); zero points z[g][b][j] (uint8 codes, two a byte for 4 bits: byte j of each 16 columns holds
  columns j and j + 8; or float32), or a compile-time constant when absent.
- Kernel: per block, 16 bytes -> zext to 16 x i32 -> codes -> floats -> `llvm.fma` with A(m, k)
  broadcast, into block accumulators (two per vector at one row, for even and odd k, so two FMA
  chains run at once); at the block's end y = fma(scale, acc, y). The bias joins at the end;
  columns past N are masked off the stores. An act-order g_idx (cuvil/nbits.py) permutes k at
  build time so that groups are blocks, and a first call gathers A's columns in that order into a
  scratch value. Codes to floats:
  - 4 bits on AVX-512 (`lut`): `vpermps` from a 16-entry table of q - 8 reads the low nibble's
    index as it is (it uses the low 4 bits) and the high one after `lshr 4`: 6 instructions per 32
    weights instead of 9 (1.33x the weights per second, measured: 72 against 54 G/s on one Zen 4
    core for 512 x 1408). Zero points of their own correct each block's sum:
    sum_k a_k (q_k - 8) - (zp - 8) sum_k a_k (1.25x: 67 G/s).
  - otherwise: `and 15` / `lshr 4`, minus the zero point in integers, `sitofp` (8 bits: no
    unpacking); float zero points are subtracted after the conversion.

Rounding (the oracle's tolerance, tests/test_nbits.py): (q - zp) is exact; each block sum of
products rounds once per term, then once for the scale and once joining y. onnxruntime's float32
path (accuracy_level 0/1) instead dequantises w = fl((q - zp) * scale) and accumulates K FMAs, so
both are within gamma(K + K/block + 4) * sum_k |A(m, k)| |W(k, n)| of the exact value
(gamma(n) = n u / (1 - n u), u = 2^-24), the difference within the sum of the two. With the table
and zero points of their own the terms are |A(m, k)| (|q - 8| + |zp - 8|) scale instead.

accuracy_level 4 (cuvil/nbits.py int8_activations): a first call (int8_activation_call) writes A's
rows quantised to int8 per block, as floats qa * scale_a, into scratch, and the kernel (or
nbits_gemm.py's panels) reads those: onnxruntime's CompInt8 result up to float32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from backends.targets import has_feature
from cuvil import nbits as form
from cuvil.errors import UnsupportedOpError

from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, lowering_target, one_weight_layout
from .lowp import column_masks, typed_declaration
from .scratch import scratch_value
from .ukernel import Declared, IRBuilder, function_module

LANES = 16                 # columns per vector (the IR is written in 16 lanes; LLVM splits it on AVX2)
MAX_ROWS = 4               # rows of A per tile


@dataclass(frozen=True)
class NBitsSpec(Declared):
    """A tile of `mr` rows x 16 V columns of Y over the whole K (see the module docstring).

    Signature: i32 name(ptr x, i64 xoff, ptr w, i64 woff, ptr s, i64 soff, ptr z, i64 zoff,
                        ptr bias, i64 boff, ptr out, i64 ooff, i64 mask)
    x rows at x[xoff + i*K + k]; out rows at out[ooff + i*N + j], masked by bit j of `mask`."""
    mr: int
    V: int
    K: int
    N: int
    bits: int
    block: int
    zp: str = "const"       # "const" (zp_const) | "u8" (z codes) | "f32" (z floats)
    zp_const: int = 8
    scale: str = "f32"      # "f32" | "f16"
    bias: int = 0
    split: int = 0          # 1: separate accumulators for even and odd k
    lut: int = 0            # 1 (4 bits, AVX-512): codes to floats by `vpermps` from a 16-entry table
    # The version of nbits_ir and of the packed layout it reads: the compiled object is cached by
    # the spec, so a change of either must change this.
    layout: int = 2
    kind: str = "nbits"
    _ARGS: ClassVar[str] = "pipipipipipii"

    def _stem(self) -> str:
        return f"cuvil_nbits{self.bits}_{self.mr}x{16 * self.V}"

    def declaration(self, var: str) -> str:
        return typed_declaration(self, var, {2: "uint8", 4: "uint16" if self.scale == "f16" else "float32",
                                             6: "uint8" if self.zp == "u8" else "float32"})


def kinds() -> dict:
    return {"nbits": lambda d: NBitsSpec(**d)}


def _splat_f(ir: IRBuilder, scalar: str) -> str:
    v0, v = ir.tmp("xi"), ir.tmp("xs")
    ir(f"{v0} = insertelement <16 x float> poison, float {scalar}, i64 0")
    ir(f"{v} = shufflevector <16 x float> {v0}, <16 x float> poison, <16 x i32> zeroinitializer")
    return v


def _splat_i(value: int) -> str:
    return "<" + ", ".join([f"i32 {value}"] * LANES) + ">"


def bias_and_masked_stores(ir, vecs, rows, masks, n: int, bias: bool):
    """A tile's epilogue (this module's and nbits_vnni.py's): accumulator `%yn{i}_{v}` of row i and
    vector v, plus the bias vector read at `%bb` when `bias`, stored masked at `%ob` + i * n + v * LANES."""
    vt = f"<{LANES} x float>"
    for v in vecs:
        bias_vec = None
        if bias:
            p, bias_vec = ir.tmp("bp"), ir.tmp("bv")
            ir(f"{p} = getelementptr float, ptr %bb, i64 {v * LANES}")
            ir(f"{bias_vec} = load {vt}, ptr {p}, align 4")
        for i in rows:
            y = f"%yn{i}_{v}"
            if bias_vec:
                t = ir.tmp("yb")
                ir(f"{t} = fadd {vt} {y}, {bias_vec}")
                y = t
            p = ir.tmp("op")
            ir(f"{p} = getelementptr float, ptr %ob, i64 {i * n + v * LANES}")
            ir(f"call void @llvm.masked.store.v16f32.p0({vt} {y}, ptr align 4 {p}, <16 x i1> {masks[v]})")


def nbits_ir(spec: NBitsSpec, vector_bits: int) -> str:
    """The micro-kernel's module (one function named spec.name)."""
    vt, it = "<16 x float>", "<16 x i32>"
    NC = LANES * spec.V
    pair_bytes = NC * spec.bits // 4          # bytes of one k pair of one column group
    n_blocks = -(-spec.K // spec.block)
    full_pairs, tail_pairs = spec.block // 2, (spec.K % spec.block) // 2
    halves = (0, 1) if spec.split else (0, 0)
    rows, vecs = range(spec.mr), range(spec.V)
    zero = "zeroinitializer"
    ir = IRBuilder()
    rename = {}
    ir.label("entry")
    ir("%xb = getelementptr float, ptr %x, i64 %xoff")
    ir("%wb = getelementptr i8, ptr %w, i64 %woff")
    ir(f"%sb = getelementptr {'i16' if spec.scale == 'f16' else 'float'}, ptr %s, i64 %soff")
    ir(f"%zb = getelementptr {'float' if spec.zp == 'f32' else 'i8'}, ptr %z, i64 %zoff")
    ir("%ob = getelementptr float, ptr %out, i64 %ooff")
    ir("%bb = getelementptr float, ptr %bias, i64 %boff")
    masks = column_masks(ir, spec.V, LANES)
    ir("br label %bh")

    # -- block loop header: y accumulators carried over blocks
    ir.label("bh")
    ir(f"%b = phi i64 [ 0, %entry ], [ %bn, %be ]")
    for i in rows:
        for v in vecs:
            ir(f"%y{i}_{v} = phi {vt} [ {zero}, %entry ], [ %yn{i}_{v}, %be ]")
    zpv = {}
    for v in vecs:
        if spec.zp == "const":
            zpv[v] = _splat_i(spec.zp_const)
            continue
        off = ir.tmp("zo")
        ir(f"{off} = mul i64 %b, {NC}")
        p = ir.tmp("zp")
        if spec.zp == "u8" and spec.bits == 4:   # 8 bytes: columns j (low nibble) and j + 8 (high)
            half = ir.tmp("zh")
            ir(f"{half} = lshr i64 {off}, 1")
            ir(f"{p} = getelementptr i8, ptr %zb, i64 {half}")
            ir(f"{p}v = getelementptr i8, ptr {p}, i64 {v * LANES // 2}")
            raw, wide, lo, hi = ir.tmp("zr"), ir.tmp("zw"), ir.tmp("zl"), ir.tmp("zu")
            ir(f"{raw} = load <8 x i8>, ptr {p}v, align 1")
            ir(f"{wide} = zext <8 x i8> {raw} to <8 x i32>")
            ir(f"{lo} = and <8 x i32> {wide}, <{', '.join(['i32 15'] * 8)}>")
            ir(f"{hi} = lshr <8 x i32> {wide}, <{', '.join(['i32 4'] * 8)}>")
            zpv[v] = ir.tmp("zv")
            ir(f"{zpv[v]} = shufflevector <8 x i32> {lo}, <8 x i32> {hi}, "
               f"<16 x i32> <{', '.join(f'i32 {j}' for j in range(16))}>")
        elif spec.zp == "u8":
            ir(f"{p} = getelementptr i8, ptr %zb, i64 {off}")
            ir(f"{p}v = getelementptr i8, ptr {p}, i64 {v * LANES}")
            raw = ir.tmp("zr")
            ir(f"{raw} = load <16 x i8>, ptr {p}v, align 1")
            zpv[v] = ir.tmp("zv")
            ir(f"{zpv[v]} = zext <16 x i8> {raw} to {it}")
        if spec.zp == "u8" and spec.lut:   # the table gives q - 8: the block's sum is corrected by (zp - 8) sum(x)
            zc, zf = ir.tmp("zc"), ir.tmp("zf")
            ir(f"{zc} = sub {it} {zpv[v]}, {_splat_i(spec.zp_const)}")
            ir(f"{zf} = sitofp {it} {zc} to {vt}")
            zpv[v] = zf
        elif spec.zp == "f32":
            ir(f"{p} = getelementptr float, ptr %zb, i64 {off}")
            ir(f"{p}v = getelementptr float, ptr {p}, i64 {v * LANES}")
            zpv[v] = ir.tmp("zv")
            ir(f"{zpv[v]} = load {vt}, ptr {p}v, align 4")
    if tail_pairs:
        ir(f"%last = icmp eq i64 %b, {n_blocks - 1}")
        ir(f"%np = select i1 %last, i64 {tail_pairs}, i64 {full_pairs}")
    else:
        ir(f"%np = add i64 0, {full_pairs}")
    ir(f"%kbase = mul i64 %b, {full_pairs}")
    ir("br label %kl")

    # -- k-pair loop: block accumulators
    ir.label("kl")
    ir("%j = phi i64 [ 0, %bh ], [ %jn, %kl ]")
    for i in rows:
        for v in vecs:
            for h in sorted(set(halves)):
                ir(f"%a{i}_{v}_{h} = phi {vt} [ {zero}, %bh ], [ %an{i}_{v}_{h}, %kl ]")
    x_sums = spec.lut and spec.zp == "u8"
    if x_sums:
        for i in rows:
            ir(f"%xsum{i} = phi float [ 0.0, %bh ], [ %xsumn{i}, %kl ]")
    ir("%kp = add i64 %kbase, %j")
    ir(f"%wo = mul i64 %kp, {pair_bytes}")
    ir("%k0 = shl i64 %kp, 1")
    xs = {}
    for i in rows:
        for h in (0, 1):
            p, x = ir.tmp("xp"), ir.tmp("x")
            ir(f"{p} = getelementptr float, ptr %xb, i64 {i * spec.K + h}")
            ir(f"{p}k = getelementptr float, ptr {p}, i64 %k0")
            ir(f"{x} = load float, ptr {p}k, align 4")
            xs[i, h] = _splat_f(ir, x)
            if x_sums:
                total = ir.tmp("xt")
                ir(f"{total} = fadd float {f'%xsum{i}' if h == 0 else prev}, {x}")
                prev = total
                if h == 1:
                    rename[f"%xsumn{i}"] = total
    cur = {(i, v, h): f"%a{i}_{v}_{h}" for i in rows for v in vecs for h in set(halves)}
    # lut: code -> q - 8 (the default zero point; zero points of their own correct the block's sum)
    table = "<" + ", ".join(f"float {float(q - spec.zp_const)}" for q in range(16)) + ">"
    for v in vecs:
        codes = []
        loads = [(v * LANES, None)] if spec.bits == 4 else [(v * LANES, 0), (NC + v * LANES, 1)]
        for off, _ in loads:
            p, raw, wide = ir.tmp("wp"), ir.tmp("wr"), ir.tmp("ww")
            ir(f"{p} = getelementptr i8, ptr %wb, i64 %wo")
            ir(f"{p}v = getelementptr i8, ptr {p}, i64 {off}")
            ir(f"{raw} = load <16 x i8>, ptr {p}v, align 1")
            ir(f"{wide} = zext <16 x i8> {raw} to {it}")
            if spec.lut:       # vpermps reads the low 4 bits of each index: no mask for the low nibble
                hi = ir.tmp("hi")
                ir(f"{hi} = lshr {it} {wide}, {_splat_i(4)}")
                codes += [wide, hi]
            elif spec.bits == 4:
                lo, hi = ir.tmp("lo"), ir.tmp("hi")
                ir(f"{lo} = and {it} {wide}, {_splat_i(15)}")
                ir(f"{hi} = lshr {it} {wide}, {_splat_i(4)}")
                codes += [lo, hi]
            else:
                codes.append(wide)
        for h, code in enumerate(codes):
            f = ir.tmp("wf")
            if spec.lut:
                ir(f"{f} = call {vt} @llvm.x86.avx512.permvar.sf.512({vt} {table}, {it} {code})")
            elif spec.zp == "f32":
                u = ir.tmp("wu")
                ir(f"{u} = sitofp {it} {code} to {vt}")
                ir(f"{f} = fsub {vt} {u}, {zpv[v]}")
            else:
                d = ir.tmp("wd")
                ir(f"{d} = sub {it} {code}, {zpv[v]}")
                ir(f"{f} = sitofp {it} {d} to {vt}")
            for i in rows:
                key = (i, v, halves[h])
                out = ir.tmp("fm")
                ir(f"{out} = call {vt} @llvm.fma.v16f32({vt} {xs[i, h]}, {vt} {f}, {vt} {cur[key]})")
                cur[key] = out
    for key, value in cur.items():
        rename["%an{}_{}_{}".format(*key)] = value
    ir("%jn = add i64 %j, 1")
    ir("%jc = icmp ult i64 %jn, %np")
    ir("br i1 %jc, label %kl, label %be")

    # -- block end: y += scale * block sum
    ir.label("be")
    for v in vecs:
        off = ir.tmp("so")
        ir(f"{off} = mul i64 %b, {NC}")
        p = ir.tmp("sp")
        s = ir.tmp("sv")
        if spec.scale == "f16":
            ir(f"{p} = getelementptr i16, ptr %sb, i64 {off}")
            ir(f"{p}v = getelementptr i16, ptr {p}, i64 {v * LANES}")
            h = ir.tmp("sh")
            ir(f"{h} = load <16 x half>, ptr {p}v, align 2")
            ir(f"{s} = fpext <16 x half> {h} to {vt}")
        else:
            ir(f"{p} = getelementptr float, ptr %sb, i64 {off}")
            ir(f"{p}v = getelementptr float, ptr {p}, i64 {v * LANES}")
            ir(f"{s} = load {vt}, ptr {p}v, align 4")
        for i in rows:
            acc = cur[i, v, 0]
            if spec.split:
                acc = ir.tmp("ab")
                ir(f"{acc} = fadd {vt} {cur[i, v, 0]}, {cur[i, v, 1]}")
            if x_sums:     # sum x (q - 8) - (zp - 8) sum x
                neg, t = ir.tmp("zn"), ir.tmp("ac")
                ir(f"{neg} = fneg {vt} {zpv[v]}")
                ir(f"{t} = call {vt} @llvm.fma.v16f32({vt} {neg}, {vt} {_splat_f(ir, f'%xsumn{i}')}, {vt} {acc})")
                acc = t
            y = ir.tmp("y")
            ir(f"{y} = call {vt} @llvm.fma.v16f32({vt} {s}, {vt} {acc}, {vt} %y{i}_{v})")
            rename[f"%yn{i}_{v}"] = y
    ir("%bn = add i64 %b, 1")
    ir(f"%bc = icmp ult i64 %bn, {n_blocks}")
    ir("br i1 %bc, label %bh, label %done")

    # -- bias, masked stores
    ir.label("done")
    bias_and_masked_stores(ir, vecs, rows, masks, spec.N, spec.bias)
    ir("ret i32 0")

    head = (f"define i32 @{spec.name}(ptr noalias %x, i64 %xoff, ptr noalias %w, i64 %woff, ptr noalias %s, "
            "i64 %soff, ptr noalias %z, i64 %zoff, ptr noalias %bias, i64 %boff, ptr noalias %out, i64 %ooff, "
            "i64 %mask) #0 {")
    decls = ["declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)",
             "declare void @llvm.masked.store.v16f32.p0(<16 x float>, ptr, <16 x i1>)"]
    if spec.lut:
        decls.append("declare <16 x float> @llvm.x86.avx512.permvar.sf.512(<16 x float>, <16 x i32>)")
    return function_module(head, ir, rename, decls)   # the loop-carried names resolved


# -- build-time packing --------------------------------------------------------------------------

def f16_exact(scales: np.ndarray) -> bool:
    """Whether every scale is a float16 value (the library may then keep them in 2 bytes)."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(scales.astype(np.float16).astype(np.float32), scales))


def group_widths(N: int, V: int) -> list[int]:
    """Columns of each column group: 16 V, the last one only as wide as the 16-column vectors it needs."""
    NC = LANES * V
    full, rest = divmod(N, NC)
    return [NC] * full + ([-(-rest // LANES) * LANES] if rest else [])


def pack(weight: form.NBitsWeight, V: int, f16_scales: bool) -> dict:
    """The kernel's arrays for a weight, group after group (group_widths): w, s, z (or None),
    bias (or None). Columns past N (to a multiple of 16) have zero codes and scales."""
    N, K, block = weight.N, weight.K, weight.block_size
    widths = group_widths(N, V)
    n_pad, k_pad = sum(widths), weight.k_blocks * block
    zp = weight.zero_points
    q = np.zeros((n_pad, k_pad), np.uint8)
    q[:N, :K] = weight.q
    starts = np.cumsum([0] + widths[:-1])

    def by_group(a, dtype):   # [n_pad, rows] -> the groups' [rows, width] blocks, one after the other
        return np.concatenate([a[s:s + w].T.reshape(-1) for s, w in zip(starts, widths)]).astype(dtype, copy=False)

    if weight.bits == 4:
        w = by_group(q[:, 0::2] | (q[:, 1::2] << 4), np.uint8)      # [g][kp][j]
    else:
        w = by_group(q, np.uint8)                                   # [g][k][j]

    def per_block(a, dtype):
        out = np.zeros((n_pad, weight.k_blocks), dtype)
        out[:N] = a
        return by_group(out, dtype)

    scales = per_block(weight.scales, np.float32)
    s = scales.astype(np.float16).view(np.uint16) if f16_scales else scales
    z = None if zp is None else per_block(zp, zp.dtype)
    if z is not None and zp.dtype == np.uint8 and weight.bits == 4:
        # two codes a byte: in each 16 columns of a block, byte j holds columns j and j + 8
        vectors = z.reshape(-1, LANES)
        z = (vectors[:, :LANES // 2] | (vectors[:, LANES // 2:] << 4)).reshape(-1).astype(np.uint8)
    bias = None
    if weight.bias is not None:
        bias = np.zeros(n_pad, np.float32)
        bias[:N] = weight.bias
    return {"w": w, "s": s, "z": z, "bias": bias}


def tile_shape(M: int) -> tuple[int, int]:
    """(rows, 16-column vectors) of the tile: one row, 64 columns with split accumulators for a
    GEMV; up to 4 rows x 32 columns otherwise (accumulators and y: 2 * 4 * 2 = 16 vectors)."""
    if M > 1 and one_weight_layout():
        # entries of several row counts share one packed copy (a generation library): the GEMV's
        # 64-column groups, 2 rows a tile (accumulators and y: 2 * 4 * 2 = 16 vectors)
        return min(M, 2), 4
    return (1, 4) if M == 1 else (min(M, MAX_ROWS), 2)


def int8_activation_call(node, graph, a_name: str, M: int, K: int, block: int) -> tuple[KernelCall, str]:
    """accuracy_level 4 (cuvil/nbits.py int8_activations): A's rows quantised to int8 per block as
    onnxruntime's CompInt8 path does, written back as floats a' = qa * scale_a into a scratch value
    (the call, and the scratch value's name). The products then run on a' with the float32 kernels:
    qa * scale_a is what onnxruntime multiplies its integer sums by, so only the order of the float32
    roundings differs from it (the int8 rounding of A, 1/254 of a block's largest |a|, is the same)."""
    name = scratch_value(graph, node, (M, K), np.float32, tag="a_int8")
    src = Source().line(kernel_header(2)).indent()
    src.line("for m in range(begin, end):").indent()
    src.line(f"for k0 in range(0, {K}, {block}):").indent()
    src.line(f"row = m * {K} + k0").line(f"n = min({block}, {K} - k0)")
    src.line("amax = np.float32(0.0)")
    src.line("for k in range(n):").indent().line("amax = max(amax, abs(p0[row + k]))").dedent()
    src.line("scale = amax / np.float32(127.0)")
    src.line("inv = np.float32(127.0) / amax if amax != np.float32(0.0) else np.float32(0.0)")
    src.line("for k in range(n):").indent()
    src.line("p1[row + k] = np.float32(np.rint(p0[row + k] * inv)) * scale")
    kernel = Kernel("matmulnbits_a_int8", src.text(), ("float32", "float32"))
    return KernelCall(kernel, [a_name, name], M, node.name), name


def lower_matmul_nbits(node, graph, decoded=None) -> Lowered:
    """`decoded`: the (weight, permutation) of form.in_block_order when the caller has them (nbits_gemm
    checked and decoded the node already: decoding a large weight again doubled its build time)."""
    if decoded is None:
        form.check(node, graph.values)
        decoded = form.in_block_order(form.decode(node, graph.values))
    weight, perm = decoded
    a = graph.values[node.inputs[0]]
    K, N = weight.K, weight.N
    if K % 2:
        raise UnsupportedOpError(f"node '{node.name}' ({form.DOMAIN}::{form.OP}): K={K} is odd",
                                 hint="the kernel reads k in pairs; pad K to an even size")
    M = int(np.prod(a.shape[:-1], dtype=np.int64)) if len(a.shape) > 1 else 1
    mr, V = tile_shape(M)
    NC = LANES * V
    target = lowering_target()
    f16 = f16_exact(weight.scales) and (target is None or has_feature(target, "f16c"))
    arrays = pack(weight, V, f16)
    zp_kind = "const" if weight.zero_points is None else ("u8" if weight.zero_points.dtype == np.uint8 else "f32")
    lut = int(weight.bits == 4 and zp_kind != "f32" and target is not None and has_feature(target, "avx512f") and target.vector_bits >= 512)
    base = dict(K=K, N=N, bits=weight.bits, lut=lut, block=weight.block_size, zp=zp_kind,
                zp_const=form.default_zero_point(weight.bits), scale="f16" if f16 else "f32",
                bias=int(weight.bias is not None))
    widths = group_widths(N, V)
    groups = len(widths)
    row_tiles, full_tiles = -(-M // mr), M // mr
    k_pad = weight.k_blocks * weight.block_size
    w_per_col = k_pad * weight.bits // 8            # bytes of codes per column
    s_per_col = weight.k_blocks                     # scales (and zero points) per column
    # (kernel variable, columns, rows) -> spec: full groups and the last, full row tiles and the tail
    specs = {}
    for cols in sorted(set(widths)):
        for rows in sorted({mr, M % mr} - {0}):
            specs[cols, rows] = (f"uk_{cols}_{rows}", NBitsSpec(mr=rows, V=cols // LANES, split=int(rows == 1), **base))
    last_cols = N - (groups - 1) * NC

    def as_i64(mask):
        return mask - (1 << 64) if mask >= 1 << 63 else mask

    calls, a_name = [], node.inputs[0]
    if form.int8_activations(node, weight):
        call, a_name = int8_activation_call(node, graph, a_name, M, K, weight.block_size)
        calls.append(call)
    if perm is not None:   # act-order: A's columns in the permuted k order, into a scratch value
        a_name = scratch_value(graph, node, (M, K), np.float32, tag="a_perm")
        gather = Source().line(kernel_header(3)).indent()
        gather.line("for m in range(begin, end):").indent()
        gather.line(f"for j in range({K}):").indent()
        gather.line(f"p2[m * {K} + j] = p0[m * {K} + p1[j]]")
        calls.append(KernelCall(Kernel("matmulnbits_perm", gather.text(), ("float32", "int32", "float32")),
                                [node.inputs[0], perm.astype(np.int32), a_name], M, node.name))
    args = [a_name, arrays["w"], arrays["s"]]
    types = ["float32", "uint8", "uint16" if f16 else "float32"]
    z_arg = b_arg = "p0"
    if arrays["z"] is not None:
        z_arg = f"p{len(args)}"
        args.append(arrays["z"])
        types.append(arrays["z"].dtype.name)
    if arrays["bias"] is not None:
        b_arg = f"p{len(args)}"
        args.append(arrays["bias"])
        types.append("float32")
    out = f"p{len(args)}"
    args.append(node.outputs[0])
    types.append("float32")

    src = Source()
    for var, spec in sorted(specs.values()):
        for line in spec.declaration(var).splitlines():
            src.line(line)
    src.line(kernel_header(len(args))).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"g = item // {row_tiles}")
    src.line(f"r = item - g * {row_tiles}")
    # group g starts at column g * NC (the last group too: every earlier one is full)
    z_group = s_per_col * NC // (2 if zp_kind == "u8" and weight.bits == 4 else 1)   # nibbles: 2 a byte
    z_off = f"g * {z_group}" if arrays["z"] is not None else "0"
    b_off = f"g * {NC}" if arrays["bias"] is not None else "0"

    def call(cols, rows, mask):
        var = specs[cols, rows][0]
        src.line(f"{var}(p0, r * {mr * K}, p1, g * {w_per_col * NC}, p2, g * {s_per_col * NC}, {z_arg}, {z_off}, "
                 f"{b_arg}, {b_off}, {out}, r * {mr * N} + g * {NC}, np.int64({as_i64(mask)}))")

    def rows_split(cols, mask):
        if full_tiles == row_tiles:
            call(cols, mr, mask)
        elif full_tiles == 0:
            call(cols, M % mr, mask)
        else:
            src.line(f"if r < {full_tiles}:").indent()
            call(cols, mr, mask)
            src.dedent().line("else:").indent()
            call(cols, M % mr, mask)
            src.dedent()

    if groups > 1:
        src.line(f"if g < {groups - 1}:").indent()
        rows_split(NC, (1 << NC) - 1)
        src.dedent().line("else:").indent()
        rows_split(widths[-1], (1 << last_cols) - 1)
        src.dedent()
    else:
        rows_split(widths[-1], (1 << last_cols) - 1)
    kernel = Kernel("matmulnbits", src.text(), tuple(types), self_sized=True)
    label = f"int{weight.bits} weights, block {weight.block_size}" + (", f16 scales" if f16 else "")
    return Lowered(calls + [KernelCall(kernel, args, groups * row_tiles, node.name, precision=label)])
