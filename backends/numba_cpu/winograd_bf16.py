"""bf16 Winograd: a 3x3 stride-1 conv marked bf16 (passes/assign_precision.py) as F(2x2, 3x3)
whose batched GEMMs run on the bf16 micro-kernel (vdpbf16ps, ukernel_lowp.py).

The maths and the four steps are winograd.py's:

    Y_tile = A^T ( sum_c  U[oc, c] * V[c] ) A,   U = G W G^T,   V = B^T d B

with the operands of the GEMMs M[xi] = U[xi] V[xi] in bf16 and every sum in float32:

- U is computed at build time in float64 from the float32 W, rounded once to bf16 (RNE) and
  packed in the pair panels the micro-kernel reads (lowp_pack.pack_a_pairs per pass over the
  channels). The library holds U, not W: 16 bf16 per (oc, c), 32 bytes, against 36 for W in
  float32 and 18 for the direct bf16 conv's packed W (16/9 of it). Nothing runs at load.
- `ConvPad` lays X out as phase images: float32 (winograd.py's) for a float32 X; for an X stored
  in bf16 (narrowed activations), bf16 with channel pairs interleaved (convgemm's 16-bit copy;
  with rows of >= 16 words the same layout copied in 32-bit words, `ConvPad_words16`);
- `WinoIn_bf16` transforms two channels at a time in float32 (a bf16 input widened, exactly) and
  rounds each V value once (RNE) into one 32-bit word per channel pair: the VNNI pair layout
  vdpbf16ps reads (V[n, xi] is C/2 pair rows of T words). A vector micro-kernel
  (winoin_lanes.WinoInSpec) runs each row of tiles 16 tiles a vector; where the GEMM is
  vdpbf16ps it rounds by `vcvtneps2bf16` ("hw": a float32 subnormal V becomes zero, see the
  bound below), elsewhere by the exact integer RNE;
- `WinoGemm` (gemm.uk_gemm_kernel over LowpUKSpec, A in pair panels, B read in place);
- `WinoOut` as in float32 from the float32 M; a bf16 residual widened on load, a bf16 Y rounded
  once on the store (with rows of even length: one pair word per tile row, winograd.out_kernel).
  On a vdpbf16ps target, vector micro-kernels with Y rounded by `vcvtneps2bf16` (a subnormal
  flushed: 2^-126 more): a plane of at most 16 tiles (7x7) one call per output channel
  (winoout_plane.py), a bf16 Y of even rows and columns a call per row of tiles (winoout_rows.py).
The transforms widen and round in 32-bit lanes (narrow.BF16_LANES: the bits of bf16_rne, 16
lanes a vector where bf16_rne's int64 arithmetic gave 8). Kernels compile with fastmath, so LLVM
may order a float32 sum of the transforms differently at another vector width; every gamma below
holds for any order of its sum.
The last three run per band of tile rows whose V and M fit BAND_BYTES (lower_winograd_bf16): the
arena holds one band's V (bf16) and M (float32), not the whole conv's.

Error bound (u = 2^-8, bf16's unit roundoff; v = 2^-24, float32's; gamma(n) = n v / (1 - n v);
|.| elementwise, products of |.| matrices with magnitudes):

    U^ = U (1 + d1), |d1| <= u                              (U's float64 error negligible)
    V^ = V + e,  |e| <= (u + (1 + u) gamma(2)) |B^T| |d| |B|   (F2: two float32 stages of 2 terms)
         [+ 2^-126 where V is rounded by `vcvtneps2bf16`: a float32 subnormal flushed to zero;
          vdpbf16ps reads a subnormal bf16 as zero anyway, so only a subnormal that RNE carries up
          to 2^-126 multiplies differently: |M^ - M| grows by at most 2^-126 sum_c |U^|]
    M^ = sum_c U^ V^ (vdpbf16ps: each product exact, each accumulation rounds once)
    |M^ - M| <= eta S_M,   S_M = sum_c (|G| |W| |G^T|) * (|B^T| |d| |B|),
        eta = 2u + u^2 + (1 + u) gamma(2) (1 + u) + gamma(C) (1 + u)(1 + u + gamma(2))
    Y^ = A^T M^ A + b (+ R) in float32 (F2: two stages of 3 terms, then 1-2 adds: gamma(6))
    |Y^ - Y| <= eta |A^T| S_M |A| + gamma(6) ((1 + eta) |A^T| S_M |A| + |b| + |R|)

and a 1-Lipschitz activation (Relu) keeps it. tests/test_precision_winograd.py computes S_M per
tile in float64 and adds onnxruntime's own float32 error, gamma(9 C + 3) (|X| * |W| + |b| + |R|),
and the flush's 9 * 2^-126 max_xi sum_c |U^| (|A^T| has three ones a row).
The factor over the direct bf16 conv's bound (2u + u^2) |X| * |W| is |A^T| S_M |A| / (|X| * |W|):
for F(2x2, 3x3) (coefficients 0, +-1, 1/2) 5.5-15x (median 7x, random 64-256 channel convs): a
worst case where every rounding adds up; the errors measured are closer. Measured against
onnxruntime float32 on ResNet-style convs (64 ch 56x56, 128 ch 28x28, 256 ch 14x14, 512 ch 7x7,
post-Relu inputs, bias, Relu), max |Y^ - Y_ort| / max |Y_ort|: direct bf16 1.3-1.7e-3, F(2x2)
bf16 2.0-2.6e-3 (1.42-1.61x the direct conv's), F(4x4) bf16 2.6-4.0e-2 (19-23x: its points +-2
make B^T's rows sum to 10 in magnitude and A^T's to 19), float32 F(4x4) <= 1.1e-5. F(4x4) is
far past the 4x this project accepts, so a bf16 conv never takes it (`choose`;
benchmarks/bf16_winograd_error.py, docs/performance.md 2026-12-07).

Channels are paired, so the conv needs an even channel count (odd: the direct bf16 conv).
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Value

from . import convgemm
from .emit import NOALIAS_MARK
from .epilogue import Epilogue
from .gemm import Operand, bf16_k_pass, choose_tile, uk_eligible, uk_gemm_kernel
from .kernel import Kernel, KernelCall, Source, kernel_header
from .narrow import with_bf16_lanes
from .winoin_lanes import WinoInSpec
from .winograd import (F2, FLAT_MIN_TW, MIN_CHANNELS, MIN_TILES, XI_SKEW, Transform, combine, out_kernel,
                       tile_grid_loop, tiles)

BAND_BYTES = 3 << 19   # V and M of one band of tile rows at most this many bytes (see lower_winograd_bf16)


def choose(lowp, X, W, group, kernel, strides, dilations, Y) -> Transform | None:
    """The transform a conv marked bf16 runs with (F(2x2, 3x3) only: see the module docstring for
    why never F(4x4, 3x3)), or None (the direct bf16 conv)."""
    if lowp is None or lowp[0] != "bf16" or len(X.shape) != 4 or group != 1:
        return None
    if tuple(kernel) != (3, 3) or tuple(strides) != (1, 1) or tuple(dilations) != (1, 1):
        return None
    C, OC = int(X.shape[1]), int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    if C % 2 or min(C, OC) < MIN_CHANNELS:
        return None
    T = tiles(OH, OW, F2.m)
    if T < MIN_TILES or not uk_eligible(np.float32, OC, T, C, Operand((0, 0), C, 1), Operand((0, 0), T, 1)):
        return None
    return F2


def bf16_round64(x: np.ndarray) -> np.ndarray:
    """float64 -> the nearest bf16 (RNE, one rounding), as float32 values (exactly representable)."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.ldexp(np.rint(m * 256.0) / 256.0, e).astype(np.float32)


def transformed_weights(t: Transform, W: np.ndarray) -> np.ndarray:
    """U[xi, oc, c] = (G W[oc, c] G^T)[xi] in float64, xi = a * i + j."""
    G = np.asarray(t.G, dtype=np.float64)
    U = np.einsum("ik,ockl,jl->ijoc", G, np.asarray(W, dtype=np.float64), G)
    return U.reshape(t.a * t.a, *U.shape[2:])


def pack_u(t: Transform, W: np.ndarray, MR: int, lead: int) -> np.ndarray:
    """U rounded once to bf16, per position xi the pair panels of gemm.uk_gemm_kernel's A (passes of
    bf16_k_pass(C) channels one after the other, each pack_a_pairs' panels of MR output channels),
    `lead` 16-bit elements apart."""
    from .lowp_pack import bf16_bits, pack_a_pairs
    U = bf16_bits(bf16_round64(transformed_weights(t, W)))
    P, OC, C = U.shape
    kc = bf16_k_pass(C)
    out = np.zeros((P, lead), dtype=np.uint16)
    for xi in range(P):
        parts = [pack_a_pairs(U[xi][:, k0:k0 + kc], MR).ravel() for k0 in range(0, C, kc)]
        flat = np.concatenate(parts)
        out[xi, :flat.size] = flat
    return out.ravel()


def _pad_words_kernel(C, H, W, p_t, p_l, PH, PW, ldb, N) -> tuple[Kernel, int]:
    """A bf16 X (N, C, H, W), W even -> F(2x2)'s four phase images in channel-pair words, the
    layout (and values) of convgemm.padded_narrow_input_kernel's, in 32-bit lanes: X's rows are
    read as words of two columns, so phase column j (input column 2j + pc - p_l) is the low or the
    high half of one word of each channel of the pair, and the pair word one pair_join of two
    contiguous loads (16 a vector; the 16-bit copy interleaves single columns). A work item is an
    (image, channel pair); pointers: X as uint32 words, the phases as uint32 words. Taken for rows
    of PW >= 16 words (planes from 30x30 on): with shorter rows LLVM unrolls the row and vectorises
    the loop over the rows instead, with gathers and scatters (ResNet-18's 28x28 stage: 0.015 ms
    a conv with the 16-bit copy, 0.038 with this one; its 56x56 stage: 0.030 -> 0.010)."""
    src = Source()
    src.line(NOALIAS_MARK).line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {C // 2}").line(f"xb = (n * {C} + (item - n * {C // 2}) * 2) * {H * W // 2}")
    src.line(f"sb = item * {ldb}")
    plane = PH * PW
    for index, (ph, pc) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        delta = pc - p_l                      # input column of phase column j: 2j + delta
        shift, high = delta // 2, delta % 2   # its word: j + shift, its half
        j_lo = max(0, -(delta // 2) if delta < 0 else 0)
        while 2 * j_lo + delta < 0:
            j_lo += 1
        j_hi = min(PW, (W - delta + 1) // 2)
        src.line(f"for i in range({PH}):").indent()
        src.line(f"o = sb + {index * plane} + i * {PW}").line(f"r = 2 * i + {ph - p_t}")
        src.line(f"if r < 0 or r >= {H}:").indent()
        src.line(f"for j in range({PW}):").indent().line("p1[o + j] = np.uint32(0)").dedent().dedent()
        src.line("else:").indent()
        src.line(f"x = xb + r * {W // 2} + {shift}")
        if j_lo:
            src.line(f"for j in range({j_lo}):").indent().line("p1[o + j] = np.uint32(0)").dedent()
        src.line(f"for j in range({j_lo}, {j_hi}):").indent()
        src.line(f"p1[o + j] = pair_join(p0[x + j], p0[x + {H * W // 2} + j], {high})").dedent()
        if j_hi < PW:
            src.line(f"for j in range({j_hi}, {PW}):").indent().line("p1[o + j] = np.uint32(0)").dedent()
        src.dedent().dedent()
    return Kernel("ConvPad_words16", with_bf16_lanes(src.text()), ("uint32", "uint32")), N * C // 2


def _in_kernel(t: Transform, C, T, TH, TW, PW, pitch, ldb, offsets, xs, x16: bool, row0: int = 0,
               ldv: int = 0) -> Kernel:
    """Phase images -> V[n, xi] in bf16 pairs: word V[n, xi, cp, ti * pitch + tj] holds channels 2cp
    (low half) and 2cp + 1 of (B^T d B)[xi], each rounded once. A work item is one (image, channel
    pair). `x16`: the phases are bf16 with the pair interleaved (one 32-bit word per position,
    ldb words per pair), else float32 planes (ldb floats per channel). As winograd._in_kernel
    otherwise (pitch == PW: one loop over the grid). A band: TH tile rows (T columns) from tile row
    `row0` on, in pair rows `ldv` words apart (default T). The grid (pitch == PW) or rows of 16 tiles
    or more: winoin_lanes' micro-kernel, a call per run of tiles; a plane of <= 16 tiles with its
    rows laid out without the extra column (a 7x7 output) from bf16 phases on a vdpbf16ps target:
    its plane form, a call per channel pair; otherwise Numba's loop below, the exact rounding."""
    a = t.a
    src = Source()
    # a plane of <= 16 tiles (7x7) whose rows are laid out without the extra column: the plane form
    # (one load of the phases' span, constant shuffles), bf16 phases on a vdpbf16ps target
    plane = pitch != PW and TW < 16 and x16 and TH * TW == T <= 16 and rounding()
    lanes = pitch == PW or TW >= 16 or plane
    if lanes:
        spec = WinoInSpec(tuple(tuple((int(i), float(c)) for i, c in row) for row in t.BT), tuple(int(o) for o in offsets), xs,
                          int(x16), 0 if x16 else ldb, "hw" if rounding() else "exact",
                          TW if plane else 0, PW if plane else 0)
        for line in spec.declaration("winoin").splitlines():
            src.line(line)
    src.line(NOALIAS_MARK).line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {C // 2}").line(f"cp = item - n * {C // 2}")
    src.line(f"sb = item * {ldb if x16 else 2 * ldb} + {row0 * PW}").line(f"vb = n * {a * a * xs} + cp * {ldv or T}")
    if lanes:
        # the tiles of the grid (pitch == PW: one run of T) or of each row of tiles, a vector at a
        # time (winoin_lanes.py)
        if pitch == PW or plane:
            src.line(f"winoin(p0, sb, p1, vb, {T})")
        else:
            src.line(f"for ti in range({TH}):").indent()
            src.line(f"winoin(p0, sb + ti * {PW}, p1, vb + ti * {pitch}, {TW})").dedent()
        return Kernel("WinoIn_bf16", src.text(), ("uint32" if x16 else "float32", "uint32"))
    if pitch != PW and TW < 16:
        # rows of fewer than 16 tiles (a 7x7 output: 4): one loop over the band's tiles, V written
        # contiguously, the phases read at ti * PW + tj (LLVM gathers them): a loop per row of
        # tiles would be too short to vectorise.
        src.line(f"for q in range({T}):").indent()
        src.line(f"ti = q // {TW}").line(f"r = sb + ti * {PW - TW}").line("o = vb")
    else:
        tile_grid_loop(src, T, TH, TW, PW, pitch)
    for k in range(a):
        for l in range(a):
            at = f"r + q + {offsets[a * k + l]}"
            if x16:
                src.line(f"w{k}_{l} = p0[{at}]")
                src.line(f"d{k}_{l}_0 = pair_lo_f32(w{k}_{l})").line(f"d{k}_{l}_1 = pair_hi_f32(w{k}_{l})")
            else:
                src.line(f"d{k}_{l}_0 = p0[{at}]").line(f"d{k}_{l}_1 = p0[{at} + {ldb}]")
    for h in (0, 1):
        for i, row in enumerate(t.BT):          # along the columns of the patch
            for l in range(a):
                src.line(f"e{i}_{l}_{h} = {combine(row, lambda k: f'd{k}_{l}_{h}')}")
    for i in range(a):
        for j, row in enumerate(t.BT):          # along its rows
            lo, hi = (combine(row, lambda l: f'e{i}_{l}_{h}') for h in (0, 1))
            src.line(f"p1[o + q + {(a * i + j) * xs}] = bf16_pair_rne({lo}, {hi})")
    return Kernel("WinoIn_bf16", with_bf16_lanes(src.text()), ("uint32" if x16 else "float32", "uint32"))


def rounding() -> bool:
    """Whether WinoIn rounds V by `vcvtneps2bf16` (winoin_lanes.py's "hw": where the GEMM is
    `vdpbf16ps`, ukernel_lowp.store_rounding's "hw") rather than by the exact RNE."""
    from .kernel import lowering_target
    from .ukernel_lowp import store_rounding
    return store_rounding("bf16", lowering_target()) == "hw"


def _plane_out_kernel(t: Transform, OC, T, TH, TW, pitch, OH, OW, xs, has_bias, residual_arg, res_strides,
                      epilogue: Epilogue, r16: bool, y16: bool) -> Kernel | None:
    """WinoOut for a plane of at most 16 tiles (a 7x7 output) by winoout_plane's micro-kernel, a call
    per (image, output channel); None where it does not apply (a larger plane, tile rows laid out
    with the extra column, a residual not stored as the plane, another activation, or a target
    whose GEMM is not vdpbf16ps: its 512-bit vectors)."""
    from .winoout_plane import LANES, WinoOutPlaneSpec
    plane_residual = residual_arg is None or (isinstance(residual_arg, str) and res_strides[3] == 1
                                              and res_strides[2] == OW)
    if not (rounding() and pitch == TW and TH * TW <= LANES and OH * OW <= 4 * LANES and plane_residual
            and epilogue.activation in ("", "Relu", "Clip") and T == TH * TW):
        return None
    lo, hi = epilogue.params if epilogue.activation == "Clip" else (0.0, 0.0)
    spec = WinoOutPlaneSpec(tuple(tuple((int(i), float(c)) for i, c in row) for row in t.AT), OH, OW, TW, xs,
                            int(has_bias), "" if residual_arg is None else "bf16" if r16 else "f32", int(y16),
                            epilogue.activation, float(lo), float(hi), "hw")
    src, n_ptrs, pb, pr = _out_items(spec, "plane", OC, has_bias, residual_arg is not None)
    roff = f"n * {res_strides[0]} + oc * {res_strides[1]}" if residual_arg is not None else "0"
    src.line(f"plane(p0, n * {t.a * t.a * xs} + oc * {T}, {pb}, oc, {pr}, {roff}, p{n_ptrs - 1}, item * {OH * OW})")
    types = ["float32"] + (["float32"] if has_bias else []) \
        + ([("uint16" if r16 else "float32")] if residual_arg is not None else []) + ["uint16" if y16 else "float32"]
    return Kernel("WinoOut_bf16", src.text(), tuple(types))


def _out_items(spec, name: str, OC: int, has_bias: bool, has_res: bool) -> tuple[Source, int, str, str]:
    """The start of a WinoOut micro-kernel's kernel (_plane_out_kernel, _rows_out_kernel): `spec`
    declared as `name`, the header, and the loop over work items (image n, output channel oc).
    Pointers: p0 M, then the bias and the residual where there are, Y last. Returns the source,
    the pointer count and the bias's and residual's pointers (p0 where absent: not read)."""
    n_ptrs = 2 + has_bias + has_res
    pb = "p1" if has_bias else "p0"
    pr = f"p{1 + has_bias}" if has_res else "p0"
    src = Source()
    for line in spec.declaration(name).splitlines():
        src.line(line)
    src.line(kernel_header(n_ptrs)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {OC}").line(f"oc = item - n * {OC}")
    return src, n_ptrs, pb, pr


def _rows_out_kernel(t: Transform, OC, T, pitch, OH, OW, xs, has_bias, residual_arg, res_strides,
                     epilogue: Epilogue, r16: bool, y16: bool, row0: int, plane: int) -> Kernel | None:
    """WinoOut of a band into a bf16 Y of even rows and columns (winograd.out_kernel's pair words)
    by winoout_rows' micro-kernel, a call per row of tiles of an (image, output channel); None where
    it does not apply (odd rows or columns, a float32 Y, a residual not in pair words, another
    activation, a target whose GEMM is not vdpbf16ps)."""
    from .winoout_rows import WinoOutRowSpec
    words = y16 and OH % 2 == 0 and OW % 2 == 0 and plane % 2 == 0
    r_words = residual_arg is None or (isinstance(residual_arg, str) and r16 and res_strides[3] == 1
                                       and all(v % 2 == 0 for v in res_strides[:3]))
    if not (rounding() and words and r_words and epilogue.activation in ("", "Relu", "Clip")):
        return None
    lo, hi = epilogue.params if epilogue.activation == "Clip" else (0.0, 0.0)
    spec = WinoOutRowSpec(tuple(tuple((int(i), float(c)) for i, c in row) for row in t.AT), xs, int(has_bias),
                          int(residual_arg is not None), epilogue.activation, float(lo), float(hi), "hw")
    src, n_ptrs, pb, pr = _out_items(spec, "rows", OC, has_bias, residual_arg is not None)
    src.line(f"mb = n * {t.a * t.a * xs} + oc * {T}")
    src.line(f"yw = item * {plane // 2} + {row0 * 2 * OW // 2}")
    if residual_arg is not None:
        sn, sc, sh, _ = res_strides
        src.line(f"rw = n * {sn // 2} + oc * {sc // 2} + {row0 * 2 * sh // 2}")
    rrow = res_strides[2] // 2 if residual_arg is not None else 0
    src.line(f"for ti in range({OH // 2}):").indent()
    src.line(f"rows(p0, mb + ti * {pitch}, {pb}, oc, {pr}, {'rw + ti * ' + str(2 * rrow) if residual_arg is not None else '0'}, "
             f"{rrow}, p{n_ptrs - 1}, yw + ti * {OW}, {OW // 2}, {OW // 2})")
    types = ["float32"] + (["float32"] if has_bias else []) + (["uint32"] if residual_arg is not None else []) \
        + ["uint32"]
    return Kernel("WinoOut_bf16", src.text(), tuple(types))


def lower_winograd_bf16(node, graph, t: Transform, lowp, X, W, B, Y, pads, residual_arg=None, res_strides=None,
                        epilogue: Epilogue | None = None) -> list:
    """The kernel calls of a bf16 Winograd conv (see `choose` and the module docstring). X, Y and a
    residual may be float32 or bf16 activations.

    V and M are a*a/m^2 = 4 times X and Y (M in float32: 8 times a bf16 Y), more than the whole rest
    of a bf16 network's arena at its largest images. So the tile rows go in bands whose V and M
    take at most BAND_BYTES, the buffers reused band after band: ConvPad once, then WinoIn, WinoGemm
    and WinoOut per band (ResNet-18 at 224x224: 4 bands at 56x56, 2 at 28x28, 1 at 14x14 and 7x7). A band's
    GEMM is about as efficient as the whole one (its last column panel is only as wide as it needs)."""
    epilogue = epilogue or Epilogue()
    x16 = np.dtype(X.dtype).name == "bfloat16"
    y16 = np.dtype(Y.dtype).name == "bfloat16"
    r16 = isinstance(residual_arg, str) and np.dtype(graph.values[residual_arg].dtype).name == "bfloat16"
    a, P = t.a, t.a * t.a
    N, C, H, Wd = (int(v) for v in X.shape)
    OC = int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    p_t, p_l = pads[:2]
    TH, TW = -(-OH // t.m), -(-OW // t.m)
    phases, PH, PW, ldb, offsets, left = convgemm.phase_geometry((a, a), (t.m, t.m), (1, 1), p_l, Wd, TH, TW)
    pitch = PW if (-(-TH * PW // 16) == -(-TH * TW // 16) or TW >= FLAT_MIN_TW) else TW
    per_row = N * P * pitch * (2 * C + 4 * OC)    # bytes of V and M per tile row
    rows = -(-TH // -(-TH * per_row // BAND_BYTES))
    bands = -(-TH // rows)
    T = rows * pitch
    MR, NR = choose_tile(OC, T)
    # V in 32-bit words (a channel pair each), M in floats; each position's matrix one cache line
    # further than a plain layout (winograd.py's XI_SKEW). V's buffer ends with 2 NR bf16 of slack:
    # the GEMM reads B's last column panel in full.
    xs_in, xs_out = (C // 2) * T + XI_SKEW, OC * T + XI_SKEW
    label = f"bf16 winograd F{t.m}"
    names = {}
    pad_dtype = np.dtype(np.uint16) if x16 else np.dtype(np.float32)
    for tag, dtype, size in (("winopad", pad_dtype, N * C * ldb + 2 * XI_SKEW),
                             ("winov", np.dtype(np.uint16), 2 * N * P * xs_in + 2 * NR),
                             ("winom", np.dtype(np.float32), N * P * xs_out)):
        names[tag] = graph.unique_name(f"{Y.name}__{tag}")
        graph.values[names[tag]] = Value(names[tag], dtype, (size,))
    if x16 and Wd % 2 == 0 and PW >= 16 and phases == [(0, 0), (0, 1), (1, 0), (1, 1)] and ldb == 4 * PH * PW:
        pad_kernel, pad_work = _pad_words_kernel(C, H, Wd, p_t, left, PH, PW, ldb, N)
    elif x16:
        pad_kernel, pad_work = convgemm.padded_narrow_input_kernel(True, C, C, H, Wd, t.m, t.m, p_t, left, phases,
                                                                   PH, PW, N)
    else:
        pad_kernel, pad_work = convgemm.padded_input_kernel(C, H, Wd, t.m, t.m, p_t, left, phases, PH, PW, N)
    calls = [KernelCall(pad_kernel, [X.name, names["winopad"]], pad_work, node.name,
                        precision=f"{label} ({'X bf16' if x16 else 'X float32'})")]

    lead = -(-OC // MR) * MR * C + 2 * XI_SKEW
    u = pack_u(t, np.asarray(W.data), MR, lead)
    a_op = Operand((0, lead), C, 1)
    b_op = Operand((2 * P * xs_in, 2 * xs_in), 2 * T, 1)
    m_op = Operand((P * xs_out, xs_out), T, 1)
    out_args = [names["winom"]] + ([B.name] if B is not None else []) \
        + ([residual_arg] if residual_arg is not None else []) + [Y.name]
    for band in range(bands):
        row0 = band * rows
        th = min(rows, TH - row0)
        t_b = th * pitch
        # (every band's GEMM takes the whole band's tile: U is packed in its row panels)
        gemm, gemm_work = uk_gemm_kernel("WinoGemm", OC, t_b, C, (N, P), a_op, b_op, None, m_op, a_panels=True,
                                         self_sized=False, lowp=lowp, tile=(MR, NR))
        out = _plane_out_kernel(t, OC, T, TH, TW, pitch, OH, OW, xs_out, B is not None, residual_arg, res_strides,
                                epilogue, r16, y16) if bands == 1 else None
        out = out or _rows_out_kernel(t, OC, T, pitch, min(OH - row0 * t.m, th * t.m), OW, xs_out, B is not None,
                                      residual_arg, res_strides, epilogue, r16, y16, row0, OH * OW)
        out = out or out_kernel(t, OC, T, th, pitch, min(OH - row0 * t.m, th * t.m), OW, xs_out, B is not None,
                                res_strides, epilogue, np.dtype(np.float32), r16=r16, y16=y16, row0=row0, plane=OH * OW)
        calls += [KernelCall(_in_kernel(t, C, t_b, th, TW, PW, pitch, ldb, offsets, xs_in, x16, row0, T),
                             [names["winopad"], names["winov"]], N * C // 2, node.name,
                             precision=f"{label} (V rounded)"),
                  KernelCall(gemm, [u, names["winov"], names["winom"]], gemm_work, node.name,
                             precision=f"{label} ({lowp[1]})"),
                  KernelCall(out, out_args, N * OC, node.name, precision=f"{label} (float32 out)")]
    return calls
