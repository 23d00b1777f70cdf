"""2-D convolution as an implicit GEMM on the micro-kernels (backends/numba_cpu/ukernel.py).

    Y[n, oc, oh, ow] = sum_{c, kh, kw} W[oc, c, kh, kw] * Xpad[n, c, oh*s + kh*d, ow*s + kw*d]

Two kernels per Conv:

1. `ConvPad` lays the input out once as zero-padded *phase images*: for stride s,
   phase (a, b) of channel c is  P[c, a, b][i, j] = Xpad[c, i*s + a, j*s + b],
   each PH x PW. Only the phases some tap reads are stored. Every tap then
   reads its phase image at a constant offset from the output position:
   tap (kh, kw) at output (oh, ow) is  P[c, kh*d % s, kw*d % s][oh + kh*d // s, ow + kw*d // s].
2. `Conv` computes, per image (and group), the GEMM  M = output channels,
   N = output positions on the flat grid q = oh*PW + ow, K = channels x taps:
   the micro-kernel reads B(k, q..q+63) as one contiguous run of the phase
   image (offset by the tap), A from the weights packed at build time into
   panels [group][pass over the channels][panel][c][tap][MR]. Grid columns ow >= OW are garbage: the
   tile stores only its valid lanes, packed contiguously (AVX-512 compress
   stores), which is exactly the NCHW output order. Each tile's column mask,
   first output index and count come from a table packed at build time.

The epilogue (bias, residual, activation) runs on each tile after its last
pass over the channels, while the tile is in L1.

A bf16 / fp16 conv whose output is stored in 16 bits (passes/assign_precision.py) sums each tile in
float32 slots first (_narrow_output_body), except a 1x1 conv whose epilogue the micro-kernel can
compute: one pass over all the channels, and the tile goes from the registers to Y rounded once
(ukernel_lowp.LowpOut16Spec, _direct16_body). Such a conv at stride 1 without padding, reading a
bf16 X with an even channel count, has no ConvPad at all: the micro-kernel reads X's channel planes
in place and pairs them in registers (b_planar). On small planes (conv1x1t.py) it runs as the
transposed GEMM, pixels on the tile's rows.

A bf16 stem (a few odd channels read from float32 at a stride, 25+ taps) pairs (channel, tap)
products instead of channels (convtappairs.py): its B is one "channel pair" of pair planes with
T' taps, all summed in one pass, so a 16-bit Y is written from the registers as a 1x1 conv's is.
A strided bf16 conv reading a bf16 X copies the phase-image columns with a vector micro-kernel
(lowp.StridedPairCopySpec), as the Winograd input's stride-2 phases do.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Value

from .ukernel import LOADC_EPILOGUE
from .ukernel_lowp import store_rounding

from . import conv1d, conv1x1t, convprologue, convtappairs, convtaps_t
from .epilogue import EPILOGUE_ACTIVATIONS, Epilogue, register_activation, register_epilogue
from .narrow import is_narrow, load, pointer_type, with_helpers
from .scratch import scratch_value
from .gemm import PRECISION_OF, UK_NR_STEP, ceil_div, choose_tile, lowp_label, lowp_product, split_work
from .kernel import Kernel, KernelCall, Source, kernel_header, literal, session_threads, work_items

K_PER_PASS = 256   # channels x taps per pass over the channels (the B footprint stays in L1)
DEPTHWISE_MAX_PLANE = 14 * 14  # strided depthwise convs with outputs up to this size take this path
FEW_PLANES = 16    # ConvPad: with fewer (image, channel) planes than this, work items are blocks of rows
ROW_BLOCKS = 8     # ... this many per plane
A_L1_BYTES = 28 << 10  # weights of one pass over the channels for a group of panels (see lower_conv_gemm)
STORED_FORMAT = {"bfloat16": "bf16", "float16": "f16"}   # a 16-bit activation's dtype -> the kernels' format


def eligible(dtype, X, W, group, kernel, strides, dilations, Y) -> bool:
    if np.dtype(dtype) != np.float32 or len(X.shape) != 4:
        return False
    icg, ocg = X.shape[1] // group, W.shape[0] // group
    taps = int(np.prod(kernel))
    OH, OW = Y.shape[2:]
    if icg == 1 and ocg == 1 and taps >= 8 and max(strides) > 1:
        # Depthwise with a stride on small planes: the direct kernel's strided loads over rows of
        # 7 or 14 outputs do not vectorise; the phase images make them contiguous (MobileNetV2's
        # 28x28 -> 14x14: 0.073 -> 0.048 ms; at 56x56 -> 28x28 the direct kernel is faster).
        return 16 <= OH * OW <= DEPTHWISE_MAX_PLANE
    if icg * taps < 8 or ocg < 4:
        return False  # depthwise and tiny convs: the direct kernel
    return OH * OW >= 16


def lower_conv_gemm(node, graph, X, W, B, Y, group, kernel, strides, dilations, pads,
                    residual_arg=None, res_strides=None, epilogue: Epilogue | None = None,
                    accumulate: bool = False, scratch: str | None = None, lowp: tuple[str, str] | None = None) -> list:
    """The ConvPad and Conv kernel calls of a 2-D conv (see the module docstring). With
    `accumulate`, the conv adds onto its output (which holds the residual: see kernel.InPlace);
    `scratch` is then the input the conv call of the first form reads, and only the conv call is
    new. With `lowp` = (format, method) (see lowp_conv), a `Cvt` call between them converts the
    phase images to 16 bits (bf16: channel pairs interleaved) and the conv multiplies them with
    weights packed in that format by ukernel_lowp's taps kernels; sums and epilogue stay float32."""
    from .ukernel import UKSpec
    from .ukernel_lowp import LowpCalledSpec, LowpOut16CalledSpec, LowpOut16Spec, LowpUKSpec, rounding_after
    epilogue = epilogue or Epilogue()
    dtype = np.dtype(np.float32)
    N, C, H, Wd = (int(v) for v in X.shape)
    OC = int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    s_h, s_w = strides
    p_t, p_l = pads[:2]
    icg, ocg = C // group, OC // group

    # Phases read by the taps, the phase-image extents and each tap's offset in a channel's phases.
    phases, PH, PW, ldb, offsets, left = phase_geometry(kernel, strides, dilations, p_l, Wd, OH, OW)
    T = len(offsets)
    tail = ldb - len(phases) * PH * PW   # zeros after the last row (stride 1: the last row's right padding)
    q_valid = (OH - 1) * PW + OW
    MR, NR = choose_tile(ocg, q_valid, "taps")
    scratch_floats = N * C * ldb + NR + 2 * PW + 16  # garbage lanes of the last tiles read past the end
    pairs = bool(lowp) and lowp[0] == "bf16"
    # bf16 reads channels in pairs: an odd channel count (group 1 only, see lowp_conv) gets a zero
    # weight channel, and its activation pair repeats the last channel (times zero weights).
    icg_p = icg + icg % 2 if pairs else icg
    C_p = icg_p * group
    calls = []
    w_data = W.data
    x_narrow, y_narrow = is_narrow(X.dtype), is_narrow(Y.dtype)
    r_dtype = graph.values[residual_arg].dtype if isinstance(residual_arg, str) else np.dtype(np.float32)
    assert not (x_narrow or y_narrow) or (lowp and not accumulate), "16-bit activations need the lowp form"
    # A 1x1 conv's 16-bit Y whose epilogue the micro-kernel can compute (bias, a residual stored
    # like Y, Relu or Clip) is written by it directly (ukernel_lowp.LowpOut16Spec): one pass over
    # the channels. (Convs with taps keep _narrow_output_body's passes: in one pass ResNet-50's
    # 3x3 stride-2 512-channel conv ran 0.715 -> 0.85 ms and the 7x7 stem 0.84 -> 0.93 ms, before
    # its tap-pair form; that form sums everything in one pass anyway and takes this path: below.)
    # A few odd input channels (an RGB stem) read from float32 at a stride: pairs of (channel, tap)
    # products instead of channel pairs (convtappairs.py), one "channel pair" with T' taps below.
    tap_pairs = convtappairs.plan(icg, group, offsets, ldb, PH, PW) \
        if pairs and scratch is None and not x_narrow and not accumulate and s_w > 1 else None
    # The tap-pair form sums all its products in one pass too (one "channel pair"): its 16-bit Y from the
    # registers as well, by a called kernel (LowpOut16CalledSpec; ResNet-18's stem conv 0.59-0.61 ->
    # 0.54-0.55 ms, docs/performance.md, fifth session).
    direct16 = y_narrow and lowp is not None and (T == 1 or tap_pairs is not None) \
        and _direct16_ok(epilogue, residual_arg, res_strides, r_dtype, Y.dtype, OH, OW)
    # ... and when it reads a 16-bit X as it is stored (stride 1, no padding: the phase image would
    # be X with its channel pairs interleaved), no copy at all: the micro-kernel pairs the channel
    # planes in registers (LowpOut16Spec.b_planar: bf16 with an even channel count; its loads are
    # masked, so nothing is read past X, which has no zero tail as the phase images have).
    # A small plane (a ResNet's 7 x 7) takes the transposed GEMM (conv1x1t.py), which reads the phase
    # image's pair words as its A: the copy stays.
    transposed = direct16 and conv1x1t.eligible(pairs, group, T, OH, OW, PW, icg)
    # A conv with taps onto a small plane (ResNet-50's 3x3 stride 2 onto 7 x 7) as the transposed
    # GEMM too (convtaps_t.py): an output row per tile, every lane valid, 16-bit Y from registers.
    taps_transposed = y_narrow and lowp is not None and T > 1 and not accumulate and tap_pairs is None \
        and convtaps_t.eligible(pairs, group, T, OH, OW) \
        and _direct16_ok(epilogue, residual_arg, res_strides, r_dtype, Y.dtype, OH, OW)
    in_place_x = direct16 and x_narrow and scratch is None and tuple(strides) == (1, 1) and not any(pads) \
        and ldb == H * Wd and pairs and icg % 2 == 0 and not transposed
    if in_place_x:
        scratch = X.name
    if scratch is None and x_narrow:
        # X is stored in the conv's own 16-bit format (passes/assign_precision.py): the phase
        # images are copies of its values, at any stride (no conversion).
        assert STORED_FORMAT[np.dtype(X.dtype).name] == lowp[0], (X.dtype, lowp)
        scratch = graph.unique_name(f"{Y.name}__phases_{lowp[0]}")
        graph.values[scratch] = Value(scratch, np.dtype(np.uint16), (N * C_p * ldb + 2 * (NR + 2 * PW + 16),))
        pad_kernel, pad_work = padded_narrow_input_kernel(pairs, C, C_p, H, Wd, s_h, s_w, p_t, left, phases, PH,
                                                          PW, N, tail)
        calls.append(KernelCall(pad_kernel, [X.name, scratch], pad_work, node.name,
                                precision=f"{PRECISION_OF[lowp[0]]} (B stored)"))
    if scratch is None and lowp and s_w == 1:
        # The phase images in 16 bits straight from X: padding and conversion in one pass over the
        # input (no float32 phase images written and read back).
        scratch = graph.unique_name(f"{Y.name}__phases_{lowp[0]}")
        graph.values[scratch] = Value(scratch, np.dtype(np.uint16), (N * C_p * ldb + 2 * (NR + 2 * PW + 16),))
        pad_kernel, pad_work = padded_lowp_input_kernel(lowp[0], C, C_p, H, Wd, s_h, p_t, left, phases, PH, PW, N,
                                                        tail)
        calls.append(KernelCall(pad_kernel, [X.name, scratch], pad_work, node.name,
                                precision=f"{PRECISION_OF[lowp[0]]} (B converted)"))
    if scratch is None:   # (given: another form of the same conv, reading the same scratch)
        phases_name = graph.unique_name(f"{Y.name}__phases")
        graph.values[phases_name] = Value(phases_name, np.dtype(np.float32), (scratch_floats,))
        # A PrologueConv's elementwise program, applied to each value copied (convprologue.py).
        prologue = convprologue.take(X.name, whole_planes=N * C >= FEW_PLANES) if not lowp else None
        norm = prologue.norm if prologue is not None else None
        pad_kernel, pad_work = padded_input_kernel(C, H, Wd, s_h, s_w, p_t, left, phases, PH, PW, N, tail,
                                                   prologue.lines if prologue is not None else None,
                                                   norm.epsilon if norm is not None else None)
        calls.append(KernelCall(pad_kernel, [X.name] + ([norm.scale, norm.bias] if norm is not None else [])
                                + [phases_name], pad_work, node.name))
        scratch = phases_name
        if tap_pairs:
            scratch = graph.unique_name(f"{Y.name}__tappairs_{lowp[0]}")
            graph.values[scratch] = Value(scratch, np.dtype(np.uint16), (N * 2 * tap_pairs.ldb + 2 * (NR + 2 * PW + 16),))
            cvt_kernel, cvt_work = convtappairs.pair_planes_kernel(tap_pairs, N, C, ldb)
            calls.append(KernelCall(cvt_kernel, [phases_name, scratch], cvt_work, node.name,
                                    precision=f"{PRECISION_OF[lowp[0]]} (B converted)"))
            w_data = tap_pairs.weights(W.data)
            icg = icg_p = C = C_p = 2
            offsets, ldb, T = tap_pairs.offsets, tap_pairs.ldb, len(tap_pairs.offsets)
        elif lowp:
            scratch = graph.unique_name(f"{Y.name}__phases_{lowp[0]}")
            graph.values[scratch] = Value(scratch, np.dtype(np.uint16), (N * C_p * ldb + 2 * (NR + 2 * PW + 16),))
            cvt_kernel, cvt_work = _phase_cvt_kernel(lowp[0], N, C, C_p, ldb)
            calls.append(KernelCall(cvt_kernel, [phases_name, scratch], cvt_work, node.name,
                                    precision=f"{PRECISION_OF[lowp[0]]} (B converted)"))

    if taps_transposed:
        from .kernel import lowering_target
        fmt = STORED_FORMAT[np.dtype(Y.dtype).name]
        return calls + [convtaps_t.conv_call(node, lowp, store_rounding(fmt, lowering_target()), epilogue, scratch,
                                             convtaps_t.pack_weights(W.data, icg_p), B, residual_arg,
                                             res_strides[0] if residual_arg is not None else 0, r_dtype, Y, N, OC,
                                             icg_p, ldb, PW, OH, OW, offsets)]
    if transposed:
        from .kernel import lowering_target
        fmt = STORED_FORMAT[np.dtype(Y.dtype).name]
        return calls + [conv1x1t.conv_call(node, lowp, store_rounding(fmt, lowering_target()), epilogue, scratch,
                                           conv1x1t.pack_weights(W.data, icg_p), B, residual_arg,
                                           res_strides[0] if residual_arg is not None else 0, r_dtype, Y, N, OC, icg_p,
                                           ldb, OH * OW)]

    # Channels per pass over the channels (balanced; bf16: whole pairs).
    kc_max = max(1, min(icg_p, K_PER_PASS // T)) if not direct16 else icg_p
    passes = ceil_div(icg_p, kc_max)
    kc_max = ceil_div(icg_p, passes)
    kc_max += kc_max % 2 if pairs else 0
    # Weights: [group][pass][panel][c in pass][tap][MR], zero padded: the micro-kernel calls of one
    # pass read one contiguous run of weights, panel after panel (a stream prefetchers follow).
    # bf16: [group][pass][panel][channel pair][tap][MR][2] (ukernel_lowp's packed A with taps).
    n_panels = ceil_div(ocg, MR)
    w = np.zeros((group, n_panels * MR, icg_p, T), dtype=np.float32)
    w[:, :ocg, :icg] = np.asarray(w_data, dtype=np.float32).reshape(group, ocg, icg, T)
    w = w.reshape(group, n_panels, MR, icg_p, T)
    if pairs:
        runs = [w[:, :, :, c0:c0 + kc_max].reshape(group, n_panels, MR, -1, 2, T).transpose(0, 1, 3, 5, 2, 4)
                for c0 in range(0, icg_p, kc_max)]
    else:
        runs = [w[:, :, :, c0:c0 + kc_max].transpose(0, 1, 3, 4, 2) for c0 in range(0, icg_p, kc_max)]
    packed = np.ascontiguousarray(np.concatenate([r.reshape(group, -1) for r in runs], axis=1))
    if lowp:
        from .lowp_pack import bf16_bits, f16_bits
        packed = bf16_bits(packed) if pairs else f16_bits(packed)

    # Tiles of the flat grid: (mask, first output index, count). The last tile is computed by a
    # micro-kernel only as wide as its lanes need (whole vectors), as gemm.py's last column panel:
    # a TCN's 400 positions on 8 x 48 tiles leave 16 lanes in the ninth, which a 48-wide kernel
    # computed in full (7 % of the conv's multiply-adds on garbage lanes).
    n_tiles = ceil_div(q_valid, NR)
    edge_nr = min(NR, ceil_div(q_valid - (n_tiles - 1) * NR, UK_NR_STEP) * UK_NR_STEP) if not y_narrow else NR
    table = np.zeros((n_tiles, 3), dtype=np.int64)
    for t in range(n_tiles):
        q = np.arange(t * NR, t * NR + NR)
        valid = (q % PW < OW) & (q < OH * PW)
        bits = 0
        for j in np.nonzero(valid)[0]:
            bits |= 1 << int(j)
        if bits == (1 << (edge_nr if t == n_tiles - 1 else NR)) - 1:
            bits = -1   # every lane of the tile's kernel valid: its unmasked loads and stores
        table[t, 0] = bits - 2 ** 64 if bits >= 2 ** 63 else bits
        first = int(q[valid][0]) if valid.any() else 0
        table[t, 1] = (first // PW) * OW + first % PW
        table[t, 2] = int(valid.sum())
    store = "x" if PW != OW else "m"

    # Work items: (image, group, tile block, channel block).
    n_blocks, tpb, m_blocks, mpb = split_work(work_items(), n_tiles, n_panels, 4 * ocg * icg * T, 4 * icg * ldb)
    # One output row (a 1-D conv), float32: each thread its own rows (conv1d.thread_split).
    rows_split = conv1d.thread_split(session_threads(), N * group, [NR] * (n_tiles - 1) + [edge_nr], n_panels,
                                     (n_blocks, tpb, m_blocks, mpb)) if OH == 1 and not lowp and not y_narrow else None
    if rows_split is not None:
        n_blocks, tpb, m_blocks, mpb = rows_split
    work = N * group * n_blocks * m_blocks

    # Output channels per group of panels: one pass's weights for a group stay in L1 while the
    # item's tiles read them; each tile's B is read again (from L2) per group. A ResNet stem
    # (3 -> 64, 7x7 / 2, 37.6 KB of weights in one pass: two groups) runs 5 % faster; a 3x3
    # conv 64 -> 64 at 56x56 (50 KB per pass) is unchanged with two groups, 3 % slower with four.
    panel_bytes = (2 if lowp else 4) * MR * kc_max * T
    group_rows = MR * max(1, A_L1_BYTES // panel_bytes)

    has_bias = B is not None
    ctile = y_narrow and not direct16   # the float32 tile slots of _narrow_output_body
    n_ptrs = 4 + has_bias + (residual_arg is not None) + ctile
    # Pointers: S (phases), W (packed), [bias], table, [residual], [C tiles: a 16-bit Y], Y.
    pb = "p2" if has_bias else None
    pt = f"p{2 + has_bias}"
    pr = f"p{3 + has_bias}" if residual_arg is not None else None
    pc = f"p{n_ptrs - 2}" if ctile else None
    py = f"p{n_ptrs - 1}"
    OHW = OH * OW
    specs = {}

    # Bias, Relu or Clip run in the micro-kernel's registers on the last pass (no loop reads the
    # tile back); a residual read or another activation keep the loop below.
    uk_epilogue = register_epilogue(has_bias, epilogue, residual_arg is not None)
    in_registers = uk_epilogue is not None
    uk_epilogue = uk_epilogue or {}

    def spec(mr, nr=NR):
        if direct16 and (mr, nr) not in specs:
            from .kernel import lowering_target
            fmt = STORED_FORMAT[np.dtype(Y.dtype).name]
            act = register_activation(epilogue)
            cvt = store_rounding(fmt, lowering_target())
            if in_place_x:   # (ukernel_lowp.rounding_after: the exact rounding without NaN lanes after Relu)
                cvt = rounding_after(act["act"], act["act_lo"], act["act_hi"], cvt)
            specs[mr, nr] = (f"uk{len(specs)}",
                             (LowpOut16CalledSpec if tap_pairs else LowpOut16Spec)(
                                 mr=mr, nr=nr, dtype=lowp[0], method=lowp[1], a_packed=1, a_panel=MR,
                                 taps=offsets, store=store, bias=int(has_bias), residual=int(residual_arg is not None),
                                 cvt=cvt, b_planar=int(in_place_x), **act))
        if (mr, nr) not in specs:
            specs[mr, nr] = (f"uk{len(specs)}",
                             (LowpCalledSpec if tap_pairs else LowpUKSpec)(
                                 mr=mr, nr=nr, dtype=lowp[0], method=lowp[1], a_packed=1, a_panel=MR, taps=offsets,
                                 store=store, **uk_epilogue) if lowp else
                             UKSpec(mr=mr, nr=nr, a_packed=1, a_panel=MR, taps=offsets, store=store,
                                    prefetch_c=int(accumulate), **uk_epilogue))
        return specs[mr, nr][0]

    body = _item_loop(m_blocks, n_blocks, group, mpb, MR, ocg, tpb, n_tiles, rows_outer=rows_split is not None)
    body.line(f"for c0 in range(0, {icg_p}, {kc_max}):").indent()
    body.line(f"kc = min({kc_max}, {icg_p} - c0)").line("lc = 1" if accumulate else "lc = min(c0, 1)").line(f"last = 1 if c0 + {kc_max} >= {icg_p} else 0")
    body.line(f"for mg in range(m_lo, m_hi, {group_rows}):").indent()
    body.line(f"mg_hi = min(mg + {group_rows}, m_hi)")
    body.line("for tt in range(t_lo, t_hi):").indent()
    body.line(f"mask = {pt}[tt * 3]").line(f"y0 = {pt}[tt * 3 + 1]").line(f"cnt = {pt}[tt * 3 + 2]")
    # bf16: offsets in 16-bit elements, a channel pair's phases are 2 ldb of them, kc counts pairs
    ldb_b, k_arg = (2 * ldb, "kc >> 1") if pairs else (ldb, "kc")
    body.line(f"boff = (n * {C_p // (1 + pairs)} + (g * {icg_p} + c0) // {1 + pairs}) * {ldb_b} + tt * {NR * (1 + pairs)}")
    has_epi = (has_bias or residual_arg is not None or epilogue.active) and not in_registers

    def call(mr, nr):
        name = spec(mr, nr)
        body.line(f"{name}(p1, (g * {icg_p} + c0) * {n_panels * T * MR} + (m // {MR}) * kc * {T * MR}, 0, p0, boff, {ldb_b}, "
                  f"{py}, (n * {OC} + g * {ocg} + m) * {OHW} + y0, {OHW}, {k_arg}, mask, "
                  + (f"lc + {LOADC_EPILOGUE} * last, " + (f"{pb}, g * {ocg} + m)" if has_bias else f"{py}, 0)")
                     if in_registers else f"lc, {py}, 0)"))   # no bias: any float32 pointer
        if has_epi:
            body.line("if last:").indent()
            body.line(f"for r in range(m, m + {mr}):").indent()
            body.line(f"oc = g * {ocg} + r")
            body.line(f"ob = (n * {OC} + oc) * {OHW}")
            terms = [f"{py}[ob + j]"]
            if has_bias:
                body.line(f"bias = {pb}[oc]")
                terms.append("bias")
            if residual_arg is not None:
                sn, sc, sh, sw = res_strides
                flat = 0 if (sh == 0 and sw == 0) else sw
                body.line(f"rb = n * {sn} + oc * {sc}")
                terms.append(load(pr, f"rb + j * {flat}" if flat != 1 else "rb + j", r_dtype))
            body.line("for j in range(y0, y0 + cnt):").indent()
            body.line(f"v = {' + '.join(terms)}")
            body.line(f"{py}[ob + j] = {epilogue.expr('v', dtype) if epilogue.active else 'v'}")
            body.dedent().dedent().dedent()

    def panels(nr):
        body.line("m = mg")
        body.line(f"while m + {MR} <= mg_hi:").indent()
        call(MR, nr)
        body.line(f"m += {MR}")
        body.dedent()
        if ocg % MR:
            body.line("if m < mg_hi:").indent()
            call(ocg % MR, nr)
            body.dedent()

    if edge_nr < NR:
        body.line(f"if tt < {n_tiles - 1}:").indent()
        panels(NR)
        body.dedent().line("else:").indent()
        panels(edge_nr)
        body.dedent()
    else:
        panels(NR)
    if direct16:
        body = _direct16_body(spec, MR, ocg, OC, OHW, icg_p, n_panels, T, C_p, ldb, NR, pairs, m_blocks, n_blocks, mpb,
                              tpb, n_tiles, group, pb, pt, pr, py, res_strides[0] if residual_arg is not None else 0,
                              in_place_x, tiles_outer=tap_pairs is not None)
    elif y_narrow:
        from .lowp import CvtSpec, best_method
        from .kernel import lowering_target
        fmt = STORED_FORMAT[np.dtype(Y.dtype).name]
        specs["f32-to-16"] = ("cvt", CvtSpec("f32", fmt, best_method("f32", fmt, lowering_target())))
        tile = ctile_value(graph, node, work, MR, NR)
        body = _narrow_output_body(spec, MR, NR, ocg, OC, OHW, icg_p, kc_max, n_panels, T, C_p, ldb, pairs, m_blocks,
                                   n_blocks, mpb, tpb, n_tiles, group, in_registers, has_bias, epilogue,
                                   (pr, res_strides, r_dtype) if residual_arg is not None else None,
                                   pb, pt, pc, py, Y.dtype, tiles_outer=tap_pairs is not None)

    head = Source()
    for name, uk in sorted(specs.values()):
        for line in uk.declaration(name).splitlines():
            head.line(line)
    head.line(kernel_header(n_ptrs))
    types = ["uint16" if lowp else "float32"] * 2 + (["float32"] if has_bias else []) + ["int64"] \
        + ([pointer_type(r_dtype)] if residual_arg is not None else []) + (["float32"] if ctile else []) \
        + [pointer_type(Y.dtype)]
    conv_kernel = Kernel("Conv", with_helpers(head.text() + body.text()), tuple(types), self_sized=True)
    args = [scratch, packed] + ([B.name] if has_bias else []) + [table] \
        + ([residual_arg] if residual_arg is not None else []) + ([tile] if ctile else []) + [Y.name]
    return calls + [KernelCall(conv_kernel, args, work, node.name, precision=lowp_label(lowp), n_outputs=1 + ctile)]


def _direct16_ok(epilogue: Epilogue, residual_arg, res_strides, r_dtype, y_dtype, OH: int, OW: int) -> bool:
    """Whether LowpOut16Spec computes this 16-bit conv's epilogue: an activation it has in registers,
    and a residual (if any) stored in Y's format and laid out as Y (channel planes of OH x OW)."""
    if epilogue.activation not in EPILOGUE_ACTIVATIONS:
        return False
    if residual_arg is None:
        return True
    return np.dtype(r_dtype) == np.dtype(y_dtype) and tuple(res_strides[1:]) == (OH * OW, OW, 1)


def _direct16_body(spec, MR, ocg, OC, OHW, icg_p, n_panels, T, C_p, ldb, NR, pairs, m_blocks, n_blocks, mpb, tpb,
                   n_tiles, group, pb, pt, pr, py, res_n: int = 0, planar: bool = False,
                   tiles_outer: bool = False) -> Source:
    """The conv's loop when the micro-kernel writes the 16-bit Y itself (LowpOut16Spec): per work
    item, panel after panel (its weights, MR x K packed contiguously, stay in L1/L2 across the
    item's tiles), one call per tile over all the channels, bias / residual / activation and the
    rounding in registers. No float32 tile in memory. `tiles_outer`: tile after tile, every panel
    of each (as _narrow_output_body's: the tap-pair form's B is spread over many planes, its A in L1)."""
    body = _item_loop(m_blocks, n_blocks, group, mpb, MR, ocg, tpb, n_tiles)
    ldb_b, k_arg = (2 * ldb, icg_p // 2) if pairs else (ldb, icg_p)
    bias = (pb, "g * {ocg} + m".format(ocg=ocg)) if pb else ("p1", "0")   # no bias: any pointer (unread)
    res = pr or py   # no residual: any 16-bit pointer (unread)

    def tile_start():
        col = NR if planar else NR * (1 + pairs)   # planar: X's channel planes, 2 per pair row
        body.line(f"boff = (n * {C_p // (1 + pairs)} + g * {icg_p // (1 + pairs)}) * {ldb_b} + tt * {col}")
        body.line(f"y0 = {pt}[tt * 3 + 1]")

    def panel(mr):
        name = spec(mr)
        body.line(f"a0 = g * {icg_p * n_panels * T * MR} + (m // {MR}) * {icg_p * T * MR}")
        body.line(f"yb = (n * {OC} + g * {ocg} + m) * {OHW}")
        if pr:
            body.line(f"rb = n * {res_n} + (g * {ocg} + m) * {OHW}")
        if not tiles_outer:
            body.line("for tt in range(t_lo, t_hi):").indent()
            tile_start()
        body.line(f"{name}(p1, a0, 0, p0, boff, {ldb_b}, {py}, yb + y0, {OHW}, {k_arg}, {pt}[tt * 3], "
                  f"{LOADC_EPILOGUE}, {bias[0]}, {bias[1]}, {res}, " + ("rb + y0)" if pr else "0)"))
        if not tiles_outer:
            body.dedent()

    if tiles_outer:
        body.line("for tt in range(t_lo, t_hi):").indent()
        tile_start()
    _row_tiles(body, MR, ocg, panel)
    return body


def _item_loop(m_blocks, n_blocks, group, mpb, MR, ocg, tpb, n_tiles, rows_outer: bool = False) -> Source:
    """A conv GEMM body's loop over its work items (m block, tile block, group, image), decoded into
    the rows m_lo..m_hi and the column tiles t_lo..t_hi of one group of one image. `rows_outer`:
    (tile block, m block, ...) instead, consecutive items one row block's column blocks
    (conv1d.thread_split)."""
    body = Source().indent()
    body.line("for item in range(begin, end):").indent()
    if rows_outer:
        body.line(f"nb = item % {n_blocks}").line(f"rest = item // {n_blocks}")
        body.line(f"mb = rest % {m_blocks}").line(f"rest = rest // {m_blocks}")
    else:
        body.line(f"mb = item % {m_blocks}").line(f"rest = item // {m_blocks}")
        body.line(f"nb = rest % {n_blocks}").line(f"rest = rest // {n_blocks}")
    body.line(f"g = rest % {group}").line(f"n = rest // {group}")
    body.line(f"m_lo = mb * {mpb * MR}").line(f"m_hi = min(m_lo + {mpb * MR}, {ocg})")
    body.line(f"t_lo = nb * {tpb}").line(f"t_hi = min(t_lo + {tpb}, {n_tiles})")
    return body


def _row_tiles(body: Source, MR: int, ocg: int, panel) -> None:
    """The item's rows m_lo..m_hi in tiles of MR rows (`panel(mr)` emits one), then the remainder."""
    body.line("m = m_lo")
    body.line(f"while m + {MR} <= m_hi:").indent()
    panel(MR)
    body.line(f"m += {MR}")
    body.dedent()
    if ocg % MR:
        body.line("if m < m_hi:").indent()
        panel(ocg % MR)
        body.dedent()


def ctile_value(graph, node, work: int, MR: int, NR: int) -> str:
    """A conv writing a 16-bit Y sums each tile in float32 here first: one MR x NR slot per work item."""
    return scratch_value(graph, node, (work * MR * NR,), np.float32, tag="ctile")


def _narrow_output_body(spec, MR, NR, ocg, OC, OHW, icg_p, kc_max, n_panels, T, C_p, ldb, pairs, m_blocks, n_blocks,
                        mpb, tpb, n_tiles, group, in_registers, has_bias, epilogue, residual, pb, pt, pc, py,
                        y_dtype, tiles_outer: bool = False) -> Source:
    """The conv's loop when Y is stored in 16 bits (bf16 / fp16 activations, passes/assign_precision.py).
    Partial sums cannot be kept in 16 bits, so a tile runs all its passes over the channels at once
    into a float32 slot of the item (the micro-kernel compress-stores its valid lanes there, as it
    does into Y), and is then written out once, with the bias, residual and activation the
    micro-kernel did not apply, rounded to 16 bits (RNE). Loop order: panel, tile, pass: a panel's
    weights (MR x K) stay in L2 across the item's tiles; `tiles_outer`: tile, panel, pass, each
    tile's B read from L1 by every panel (convtappairs.py: B spread over many planes, all of A in L1)."""
    body = _item_loop(m_blocks, n_blocks, group, mpb, MR, ocg, tpb, n_tiles)
    body.line(f"cb = item * {MR * NR}")
    ldb_b, k_arg = (2 * ldb, "kc >> 1") if pairs else (ldb, "kc")

    def panel(mr):
        name = spec(mr)
        if not tiles_outer:
            body.line("for tt in range(t_lo, t_hi):").indent()
        body.line(f"mask = {pt}[tt * 3]").line(f"y0 = {pt}[tt * 3 + 1]").line(f"cnt = {pt}[tt * 3 + 2]")
        body.line(f"for c0 in range(0, {icg_p}, {kc_max}):").indent()
        body.line(f"kc = min({kc_max}, {icg_p} - c0)").line("lc = min(c0, 1)")
        body.line(f"last = 1 if c0 + {kc_max} >= {icg_p} else 0")
        body.line(f"boff = (n * {C_p // (1 + pairs)} + (g * {icg_p} + c0) // {1 + pairs}) * {ldb_b} + tt * {NR * (1 + pairs)}")
        body.line(f"{name}(p1, (g * {icg_p} + c0) * {n_panels * T * MR} + (m // {MR}) * kc * {T * MR}, 0, p0, boff, "
                  f"{ldb_b}, {pc}, cb, {NR}, {k_arg}, mask, "
                  + (f"lc + {LOADC_EPILOGUE} * last, " + (f"{pb}, g * {ocg} + m)" if has_bias else f"{pc}, 0)")
                     if in_registers else f"lc, {pc}, 0)"))
        body.dedent()
        body.line(f"for r in range({mr}):").indent()
        body.line(f"oc = g * {ocg} + m + r")
        body.line(f"ob = (n * {OC} + oc) * {OHW} + y0")
        body.line(f"cr = cb + r * {NR}")
        terms = [f"{pc}[cr + j]"]
        if has_bias and not in_registers:
            body.line(f"bias = {pb}[oc]")
            terms.append("bias")
        if residual is not None:
            pr, (sn, sc, sh, sw), r_dtype = residual
            flat = 0 if (sh == 0 and sw == 0) else sw
            body.line(f"rb = n * {sn} + oc * {sc} + y0 * {flat}")
            terms.append(load(pr, f"rb + j * {flat}" if flat != 1 else "rb + j", r_dtype))
        if len(terms) > 1 or (epilogue.active and not in_registers):
            # what the micro-kernel did not apply, in place on the float32 tile row
            body.line("for j in range(cnt):").indent()
            body.line(f"v = {' + '.join(terms)}")
            value = epilogue.expr("v", np.float32) if epilogue.active and not in_registers else "v"
            body.line(f"{pc}[cr + j] = {value}").dedent()
        body.line(f"cvt({pc}, cr, {py}, ob, cnt)")   # rounded to 16 bits by the vector conversion kernel
        body.dedent()
        if not tiles_outer:
            body.dedent()

    if tiles_outer:
        body.line("for tt in range(t_lo, t_hi):").indent()
    _row_tiles(body, MR, ocg, panel)
    return body


def _phase_rows(src, pairs, C, C_p, H, W, s_h, s_w, p_t, p_l, phases, PH, PW, N, fill, tail: int = 0) -> int:
    """The work-item loop of the 16-bit phase-image kernels (padded_narrow_input_kernel,
    padded_lowp_input_kernel): a work item is an (image, channel pair) for bf16 (`pairs`: xs is the
    second channel's distance, 0 for a last unpaired one) or an (image, channel), in blocks of rows
    when there are few. Each phase row is zero where it reads outside the input; `fill(src, b,
    j_lo, j_hi)` writes its columns j_lo..j_hi of phase column b from input row r (xb: the plane;
    o: the row's first element); `tail` zero columns follow the last row (see phase_geometry).
    Returns the number of work items."""
    ldb = len(phases) * PH * PW + tail
    planes = N * C_p // 2 if pairs else N * C
    blocks = min(PH, ROW_BLOCKS) if planes < FEW_PLANES else 1
    rows = ceil_div(PH, blocks)
    blocks = ceil_div(PH, rows)
    width = 2 if pairs else 1   # 16-bit elements per phase-image column
    src.line("for item in range(begin, end):").indent()
    if blocks > 1:
        src.line(f"plane = item % {planes}").line(f"i_lo = (item // {planes}) * {rows}")
        src.line(f"i_hi = min(i_lo + {rows}, {PH})")
    else:
        src.line("plane = item").line("i_lo = 0").line(f"i_hi = {PH}")
    if pairs:
        P = C_p // 2
        src.line(f"n = plane // {P}").line(f"c = (plane % {P}) * 2")
        src.line(f"xb = (n * {C} + c) * {H * W}")
        stride = f"0 if c + 1 >= {C} else {H * W}" if C_p != C else str(H * W)
        src.line(f"xs = {stride}")
    else:
        src.line(f"xb = plane * {H * W}")
    src.line(f"sb = plane * {width * ldb}")
    for k, (a, b) in enumerate(phases):
        j_lo = max(0, ceil_div(p_l - b, s_w))
        j_hi = min(PW, max(j_lo, (W - 1 + p_l - b) // s_w + 1))
        src.line("for i in range(i_lo, i_hi):").indent()
        src.line(f"o = sb + {width * k * PH * PW} + i * {width * PW}")
        src.line(f"r = i * {s_h} + {a - p_t}" if s_h > 1 else f"r = i + {a - p_t}")
        src.line(f"if r < 0 or r >= {H}:").indent()
        src.line(f"for j in range({width * PW}):").indent().line("p1[o + j] = 0").dedent()
        src.dedent().line("else:").indent()
        if j_lo > 0:
            src.line(f"for j in range({width * j_lo}):").indent().line("p1[o + j] = 0").dedent()
        if j_hi > j_lo:
            fill(src, b, j_lo, j_hi)
        if j_hi < PW:
            src.line(f"for j in range({width * j_hi}, {width * PW}):").indent().line("p1[o + j] = 0").dedent()
        src.dedent().dedent()
    if tail:
        src.line(f"if i_hi == {PH}:").indent()
        src.line(f"for j in range({width * tail}):").indent().line(f"p1[sb + {width * (ldb - tail)} + j] = 0")
        src.dedent().dedent()
    return planes * blocks


def padded_narrow_input_kernel(pairs, C, C_p, H, W, s_h, s_w, p_t, p_l, phases, PH, PW, N,
                               tail: int = 0) -> tuple[Kernel, int]:
    """X (N, C, H, W) already in 16 bits (uint16 bits of bf16 / fp16) -> the 16-bit phase images
    the conv reads, at any stride: what padded_input_kernel then the conversion write, without
    rounding (the values are 16-bit already). bf16: a work item is an (image, channel pair), the
    two channels' values interleaved (a last unpaired channel with itself: its pair's weights are
    zero); fp16: an (image, channel). With few items, blocks of rows. bf16 rows read at column
    stride 1 (every 1x1 and 3x3 stride-1 conv) are interleaved by a vector micro-kernel
    (lowp.PairCopySpec), at a column stride s_w > 1 by one keeping every s_w-th element
    (lowp.StridedPairCopySpec): Numba's loop of two scalar stores per column does not vectorise."""
    from .lowp import PairCopySpec, StridedPairCopySpec
    vector_pairs = pairs and s_w == 1
    strided_pairs = pairs and s_w > 1   # every s_w-th column: lowp.StridedPairCopySpec

    def copy(src, b, j_lo, j_hi):
        col = f"j * {s_w}" if s_w > 1 else "j"
        src.line(f"x = xb + r * {W} + {b - p_l}")
        if vector_pairs or strided_pairs:
            src.line(f"copy_pairs(p0, x + {j_lo * s_w}, xs, p1, o + {2 * j_lo}, {j_hi - j_lo})")
            return
        src.line(f"for j in range({j_lo}, {j_hi}):").indent()
        if pairs:
            src.line(f"p1[o + 2 * j] = p0[x + {col}]").line(f"p1[o + 2 * j + 1] = p0[x + xs + {col}]")
        else:
            src.line(f"p1[o + j] = p0[x + {col}]")
        src.dedent()

    src = Source()
    if vector_pairs or strided_pairs:
        spec = PairCopySpec() if vector_pairs else StridedPairCopySpec(s_w)
        for line in spec.declaration("copy_pairs").splitlines():
            src.line(line)
    src.line(kernel_header(2)).indent()
    items = _phase_rows(src, pairs, C, C_p, H, W, s_h, s_w, p_t, p_l, phases, PH, PW, N, copy, tail)
    return Kernel(f"ConvPad_{'pairs' if pairs else 'copy'}16", src.text(), ("uint16", "uint16")), items


def lowp_conv(node, group: int, icg: int) -> tuple[str, str] | None:
    """(format, method) when this conv's mark (passes/assign_precision.py) is honoured here, else
    None: bf16 pairs channels within a group, so a grouped conv with an odd channel count per
    group stays float32 (group 1 pads one zero channel)."""
    lowp = lowp_product(node)
    if lowp and lowp[0] == "bf16" and icg % 2 and group > 1:
        return None
    return lowp


def _phase_cvt_kernel(fmt: str, N: int, C: int, C_p: int, ldb: int) -> tuple[Kernel, int]:
    """The phase images (N*C planes of ldb float32) in 16 bits, rounded to nearest even, one work
    item per (image, channel) plane; bf16 per (image, channel pair): the two planes interleaved
    (lowp.PairCvtSpec), a last unpaired channel with itself (its pair's weights are zero)."""
    from .lowp import CvtSpec, PairCvtSpec
    src = Source()
    spec = PairCvtSpec() if fmt == "bf16" else CvtSpec("f32", fmt)
    for line in spec.declaration("cvt").splitlines():
        src.line(line)
    src.line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    if fmt == "bf16":
        P = C_p // 2
        src.line(f"n = item // {P}").line(f"c = (item % {P}) * 2")
        stride = f"0 if c + 1 >= {C} else {ldb}" if C_p != C else str(ldb)
        src.line(f"cvt(p0, (n * {C} + c) * {ldb}, {stride}, p1, item * {2 * ldb}, {ldb})")
        return Kernel(f"Cvt_{fmt}", src.text(), ("float32", "uint16")), N * P
    src.line(f"cvt(p0, item * {ldb}, p1, item * {ldb}, {ldb})")
    return Kernel(f"Cvt_{fmt}", src.text(), ("float32", "uint16")), N * C


def padded_lowp_input_kernel(fmt, C, C_p, H, W, s_h, p_t, p_l, phases, PH, PW, N, tail: int = 0) -> tuple[Kernel, int]:
    """X (N, C, H, W) float32 -> the 16-bit phase images the conv reads (stride 1 along the rows:
    each phase row is a contiguous run of an input row), in one pass: what padded_input_kernel
    and _phase_cvt_kernel write one after the other, bit for bit, without the float32 images
    between them. bf16: a work item is an (image, channel pair), the pair's two rows converted and
    interleaved by lowp.PairCvtSpec (a last unpaired channel with itself: its pair's weights are
    zero); fp16: an (image, channel). With few items, blocks of rows (as padded_input_kernel)."""
    from .lowp import CvtSpec, PairCvtSpec
    pairs = fmt == "bf16"
    width = 2 if pairs else 1   # 16-bit elements per phase-image column

    def convert(src, b, j_lo, j_hi):
        x = f"xb + r * {W} + {b - p_l + j_lo}"
        if pairs:
            src.line(f"cvt(p0, {x}, xs, p1, o + {width * j_lo}, {j_hi - j_lo})")
        else:
            src.line(f"cvt(p0, {x}, p1, o + {j_lo}, {j_hi - j_lo})")

    src = Source()
    spec = PairCvtSpec() if pairs else CvtSpec("f32", fmt)
    for line in spec.declaration("cvt").splitlines():
        src.line(line)
    src.line(kernel_header(2)).indent()
    items = _phase_rows(src, pairs, C, C_p, H, W, s_h, 1, p_t, p_l, phases, PH, PW, N, convert, tail)
    return Kernel(f"ConvPad_{fmt}", src.text(), ("float32", "uint16")), items


def phase_geometry(kernel, strides, dilations, p_l, W, OH, OW):
    """The phases the taps read, the phase-image extents, the floats per channel, each tap's offset,
    and the left padding the phase images are laid out with.

    With stride 1 along the rows the image has one phase, and a row's zero columns serve as the
    right padding of the row before it too: g = max(left pad, right pad) zeros then the W inputs,
    so a row is W + g wide instead of W + left + right (fewer garbage columns on the grid). The
    right padding of the last row is g zeros after it: a channel's image is PH * PW + g floats
    (the writers' `tail`). It was a whole zero row, which for a 1-D conv (one row) doubled the
    floats ConvPad wrote: a TCN's 128 x 400 input took 128 x 802 of them at dilation 1."""
    KH, KW = kernel
    s_h, s_w = strides
    d_h, d_w = dilations
    if s_h == 1 and s_w == 1:
        p_r = OW + (KW - 1) * d_w - p_l - W
        g = max(p_l, p_r, 0)
        PW = max(OW, W + g)
        PH = OH + (KH - 1) * d_h
        offsets = tuple(kh * d_h * PW + kw * d_w + g - p_l for kh in range(KH) for kw in range(KW))
        return [(0, 0)], PH, PW, PH * PW + g, offsets, g
    taps = [(kh, kw) for kh in range(KH) for kw in range(KW)]
    phases = sorted({((kh * d_h) % s_h, (kw * d_w) % s_w) for kh, kw in taps})
    ph_index = {p: i for i, p in enumerate(phases)}
    max_dh = max((kh * d_h) // s_h for kh, _ in taps)
    max_dw = max((kw * d_w) // s_w for _, kw in taps)
    PH, PW = OH + max_dh, OW + max_dw
    plane = PH * PW
    offsets = tuple(ph_index[((kh * d_h) % s_h, (kw * d_w) % s_w)] * plane + ((kh * d_h) // s_h) * PW
                    + (kw * d_w) // s_w for kh, kw in taps)
    return phases, PH, PW, len(phases) * plane, offsets, p_l


def flat_residual(res_strides, out_spatial) -> bool:
    """Whether the residual reads linearly (or not at all) over the flat output plane."""
    sh, sw = res_strides[2:]
    return (sh == 0 and sw == 0) or sh == sw * out_spatial[1]


def padded_input_kernel(C, H, W, s_h, s_w, p_t, p_l, phases, PH, PW, N, tail: int = 0,
                        prologue: list[str] | None = None, norm_eps: float | None = None) -> tuple[Kernel, int]:
    """X (N, C, H, W) -> phase images, and the work size. A work item is one channel's plane or,
    with few planes (a network's first conv: 3 channels), a block of rows of one, so that
    threads share the work evenly; blocks run top rows first, like the conv's output tiles.
    `tail`: zeros after a plane's last row (phase_geometry's ldb minus its rows). `prologue`:
    lines computing `v` from `a_in`, applied to every value copied from X, not to the padding
    (convprologue.py); strided columns are gathered first and transformed in place, in L1.
    `norm_eps`: an InstanceNormalization before the prologue, per (image, channel) plane (whole
    planes only): the kernel reads X, scale, bias and writes the phases (p3); `a_in` is then
    x * sc + sh with the plane's moments computed first, as norm.py computes them."""
    zero = literal(0, np.float32)
    ldb = len(phases) * PH * PW + tail
    blocks = min(PH, ROW_BLOCKS) if N * C < FEW_PLANES else 1
    assert norm_eps is None or blocks == 1, "an InstanceNormalization prologue needs whole planes"
    out = "p3" if norm_eps is not None else "p1"
    rows = ceil_div(PH, blocks)
    blocks = ceil_div(PH, rows)
    src = Source()
    if s_w > 1:   # the strided column copies: wide loads and a lane shuffle (see GatherSpec)
        from .ukernel import GatherSpec
        for line in GatherSpec(s_w).declaration("gather").splitlines():
            src.line(line)
    src.line(kernel_header(4 if norm_eps is not None else 2)).indent()
    src.line("for item in range(begin, end):").indent()
    if blocks > 1:
        src.line(f"plane = item % {N * C}").line(f"i_lo = (item // {N * C}) * {rows}")
        src.line(f"i_hi = min(i_lo + {rows}, {PH})")
    else:
        src.line("plane = item").line("i_lo = 0").line(f"i_hi = {PH}")
    src.line(f"xb = plane * {H * W}").line(f"sb = plane * {ldb}")
    norm_term = ""
    if norm_eps is not None:   # the plane's moments (norm.py's two passes), then x * sc + sh
        from .norm import moments
        moments(src, np.dtype(np.float32), H * W, "p0", "xb")
        src.line(f"sc = p1[plane % {C}] / math.sqrt(var + {literal(norm_eps, np.float32)})")
        src.line(f"sh = p2[plane % {C}] - mean * sc")
        norm_term = " * sc + sh"
    for k, (a, b) in enumerate(phases):
        # Columns j with 0 <= j*s_w + b - p_l < W: [j_lo, j_hi).
        j_lo = max(0, ceil_div(p_l - b, s_w))
        j_hi = min(PW, max(j_lo, (W - 1 + p_l - b) // s_w + 1))
        src.line("for i in range(i_lo, i_hi):").indent()
        src.line(f"o = sb + {k * PH * PW} + i * {PW}")
        src.line(f"r = i * {s_h} + {a - p_t}" if s_h > 1 else f"r = i + {a - p_t}")
        src.line(f"if r < 0 or r >= {H}:").indent()
        src.line(f"for j in range({PW}):").indent().line(f"{out}[o + j] = {zero}").dedent()
        src.dedent().line("else:").indent()
        src.line(f"x = xb + r * {W} + {b - p_l}")
        if j_lo > 0:
            src.line(f"for j in range({j_lo}):").indent().line(f"{out}[o + j] = {zero}").dedent()
        if j_hi > j_lo and s_w > 1:
            src.line(f"gather(p0, x + {j_lo * s_w}, {out}, o + {j_lo}, {j_hi - j_lo})")
            if prologue:
                src.line(f"for j in range({j_lo}, {j_hi}):").indent().line(f"a_in = {out}[o + j]" + norm_term)
                for line in prologue:
                    src.line(line)
                src.line(f"{out}[o + j] = v").dedent()
        elif j_hi > j_lo and prologue:
            src.line(f"for j in range({j_lo}, {j_hi}):").indent().line("a_in = p0[x + j]" + norm_term)
            for line in prologue:
                src.line(line)
            src.line(f"{out}[o + j] = v").dedent()
        elif j_hi > j_lo:
            src.line(f"for j in range({j_lo}, {j_hi}):").indent().line("p1[o + j] = p0[x + j]").dedent()
        if j_hi < PW:
            src.line(f"for j in range({j_hi}, {PW}):").indent().line(f"{out}[o + j] = {zero}").dedent()
        src.dedent().dedent()
    if tail:
        src.line(f"if i_hi == {PH}:").indent()
        src.line(f"for j in range({tail}):").indent().line(f"{out}[sb + {ldb - tail} + j] = {zero}")
    return Kernel("ConvPad", src.text(), ("float32",) * (4 if norm_eps is not None else 2)), N * C * blocks
