"""Integer matrix products on the AVX512-VNNI or AArch64 SDOT micro-kernel (ukernel_int8.py): MatMulInteger,
QLinearMatMul and FusedMatMulInteger (passes/fold_qdq.py) with a constant weight matrix.

    acc(m, n) = sum_k (A(m, k) - a_zero) * (B(k, n) - b_zero[n])        exact, int32

B - b_zero is packed once at build time as signed bytes (it must fit: int8 weights with any
zero point whose difference stays in [-128, 127], uint8 weights with zero point 128...); A is
read in place as bytes. The zero point term is the compensation of the micro-kernel:

    sum_k (A - a_zero) B' = sum_k A_u B' - (a_zero + shift) * colsum(B'),    colsum(B') = sum_k B'(k, n)

with A_u = A + shift (ukernel_int8.dot_shift): VNNI multiplies unsigned A, so shift = 128 for int8
activations (the micro-kernel flips their sign bits) and 0 for uint8; SDOT multiplies signed A, so
shift = -128 for uint8 and 0 for int8. A constant a_zero folds into a build-time table (with an int32 bias, if any);
a run-time one (DynamicQuantizeLinear's) is read by the kernel.

What does not fit (neither AVX512-VNNI nor the AArch64 dot product on the target, K not a multiple of 4, weights computed at run
time, B - b_zero outside int8, a batched B) returns None and keeps quant.py's exact scalar loops.
"""
from __future__ import annotations

import numpy as np

from backends.targets import has_feature

from .kernel import Kernel, KernelCall, Source, kernel_header, lowering_target, work_items
from .ukernel_int8 import FEATURE, OUTPUTS, SDOT_FEATURE, Int8UKSpec, dot_shift, pack_b_quads

MR = 6                        # rows of a micro-tile (6 x 4 int32 vectors: 24 accumulators)
NR = 64                       # columns of a micro-tile
MIN_SPLIT_OPS = 1 << 21       # smaller products are one work item


def vnni_target() -> bool:
    """Whether the target being lowered for has AVX512-VNNI with 512-bit vectors."""
    target = lowering_target()
    return target is not None and has_feature(target, FEATURE) and target.vector_bits >= 512


def dot_method() -> str | None:
    """The int8 dot product of the target being lowered for: "vnni" (AVX512-VNNI, 512-bit vectors),
    "sdot" (AArch64 with the dot-product extension: aarch64-neon-fp16-dotprod) or None (the exact
    scalar loops of quant.py)."""
    if vnni_target():
        return "vnni"
    target = lowering_target()
    if target is not None and target.arch == "aarch64" and has_feature(target, SDOT_FEATURE):
        return "sdot"
    return None


def signed_weights(b: np.ndarray, b_zero) -> np.ndarray | None:
    """B - b_zero (per tensor, or per column n) as int8 [K, N], or None where it does not fit."""
    data = np.asarray(b).astype(np.int32)
    if b_zero is not None:
        z = np.asarray(b_zero).astype(np.int32).reshape(-1)
        data = data - (z.reshape(1, -1) if z.size > 1 else z[0])
    if data.size and (data.min() < -128 or data.max() > 127):
        return None
    return data.astype(np.int8)


def _padded(values, N: int, width: int, dtype) -> np.ndarray:
    """A per-column vector (a scalar broadcast to N columns), zero padded to `width`."""
    out = np.zeros(width, dtype)
    out[:N] = np.broadcast_to(np.asarray(values, dtype).reshape(-1), (N,))
    return out


def int8_gemm(node_name: str, A, M: int, K: int, N: int, weights: np.ndarray, out, mode: str, *,
              a_zero=None, mult=None, ascale=None, bias=None, ibias=None, zy: int = 0,
              act: tuple = ("", 0.0, 0.0)) -> list | None:
    """The calls computing out[M, N] (mode "i32" | "f32" | "u8" | "s8", see ukernel_int8.py) from
    A[M, K] (a uint8/int8 value, rows contiguous) and `weights` = B - b_zero (int8 [K, N]).

    a_zero: None, a constant array or a run-time Value (one element); mult: the per-column (or
    scalar) float32 multiplier; ascale: a run-time Value multiplied into it ("f32"); bias: float32
    per column ("f32"); ibias: int32 per column added to the sums ("u8"/"s8"; only with a constant
    a_zero). None when the path does not apply."""
    dot = dot_method()
    if dot is None or K % 4 or weights is None or M < 1 or N < 1:
        return None
    a_name = np.dtype(A.dtype).name
    if a_name not in ("uint8", "int8"):
        return None
    runtime_zero = a_zero is not None and not isinstance(a_zero, np.ndarray)
    if runtime_zero and ibias is not None:
        return None
    nr = NR if N >= NR else -(-N // 16) * 16
    panels = -(-N // nr)
    width = panels * nr
    shift = dot_shift(a_name == "int8", dot)
    colsum = weights.astype(np.int64).sum(axis=0)
    if runtime_zero:
        comp = _padded(-colsum, N, width, np.int64)
    else:
        z = int(np.asarray(a_zero).reshape(-1)[0]) if a_zero is not None else 0
        comp = _padded(-(z + shift) * colsum, N, width, np.int64)
        if ibias is not None:
            comp[:N] += np.asarray(ibias, np.int64).reshape(-1)
    if np.abs(comp).max(initial=0) >= 2**31:
        return None
    kq = K // 4
    args: list = [A.name, pack_b_quads(weights, nr), comp.astype(np.int32)]
    args.append(_padded(mult if mult is not None else 0, N, width, np.float32))
    args.append(_padded(bias if bias is not None else 0, N, width, np.float32))
    args.append(ascale.name if ascale is not None else np.ones(1, np.float32))
    args.append(a_zero.name if runtime_zero else np.zeros(1, np.uint8))
    args.append(out.name)
    za_dtype = np.dtype(a_zero.dtype).name if runtime_zero else "uint8"
    flags = dict(out=mode, a_signed=int(a_name == "int8"), dot=dot, ascale=int(ascale is not None and mode == "f32"),
                 bias=int(bias is not None and mode == "f32"), act=act[0], act_lo=float(act[1]),
                 act_hi=float(act[2]), zy=int(zy))

    specs = {}

    def call(mr, row):
        if mr not in specs:
            specs[mr] = (f"uk{len(specs)}", Int8UKSpec(mr=mr, nr=nr, **flags))
        body.line(f"{specs[mr][0]}(p0, {row}*{K}, {K}, p1, boff, p7, {row}*{N} + n0, {N}, {kq}, mask, "
                  f"p2, p3, p4, n0, zeff, p5)")

    m_tiles = -(-M // MR)
    want = work_items() if 2 * M * N * K >= MIN_SPLIT_OPS else 1
    n_blocks = min(panels, want)
    m_blocks = min(m_tiles, -(-want // n_blocks))
    ppb, tpb = -(-panels // n_blocks), -(-m_tiles // m_blocks)
    n_blocks, m_blocks = -(-panels // ppb), -(-m_tiles // tpb)
    body = Source().indent()
    body.line("for item in range(begin, end):").indent()
    body.line(f"mb = item % {m_blocks}").line(f"nb = item // {m_blocks}")
    body.line(f"m_lo = mb * {tpb * MR}").line(f"m_hi = min(m_lo + {tpb * MR}, {M})")
    body.line(f"zeff = np.int64(p6[0]) + {shift}" if runtime_zero else "zeff = np.int64(1)")
    body.line(f"for pn in range(nb * {ppb}, min(nb * {ppb} + {ppb}, {panels})):").indent()
    body.line(f"n0 = pn * {nr}").line(f"nv = min({nr}, {N} - n0)")
    body.line(f"mask = np.int64(-1) if nv >= 64 else (np.int64(1) << nv) - np.int64(1)")
    body.line(f"boff = pn * {kq * nr * 4}")
    body.line("m = m_lo")
    body.line(f"while m + {MR} <= m_hi:").indent()
    call(MR, "m")
    body.line(f"m += {MR}").dedent()
    if M % MR:
        body.line("if m < m_hi:").indent()
        call(M % MR, "m")
        body.dedent()
    head = Source()
    for name, spec in sorted(specs.values()):
        for line in spec.declaration(name, a_name).splitlines():
            head.line(line)
    head.line(kernel_header(8))
    types = (a_name, "int8", "int32", "float32", "float32", "float32", za_dtype, OUTPUTS[mode])
    kernel = Kernel(f"QGemm_{mode}", head.text() + body.text(), types, self_sized=True)
    return [KernelCall(kernel, args, n_blocks * m_blocks, node_name, precision=f"int8 ({dot}, {mode} out)")]
