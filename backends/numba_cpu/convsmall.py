"""Convolutions on small planes (7x7, 14x14): output channels in the vector lanes.

The implicit GEMM of convgemm.py puts output positions in the vector lanes. On
a 7x7 plane that wastes a quarter of every vector: 49 outputs (55 grid
positions with the padding columns) fill two vectors of 32. Here the roles
swap: a TSpec micro-kernel (backends/numba_cpu/ukernel.py) keeps a tile of MR
output positions of one row (their inputs broadcast from the phase images,
which ConvPad lays out as for convgemm) by NR output channels (the weights,
packed at build time as NR-float vectors), so no lane is wasted when the row
width is a multiple of MR and the channels of NR.

Per work item (image, group, panel of NR output channels, block of rows), for
each pass over the input channels (a pass's weights, at most 32 KiB, stay in
L1 across the item's tiles) and each tile: the partial sums go to a per-tile
scratch slot (contiguous vectors); the last pass adds bias and activation and
scatters the tile into the NCHW output (one scatter per accumulator per tile,
not per pass; a tile of a whole one-row plane, the STFT's 7 frames, is one
contiguous run of the output, stored as vectors shuffled in registers). The
last panel of output channels is only as wide as its columns need.

The weights are laid out panel by panel, pass after pass, and each tile
prefetches its share of the next contiguous run (the next pass, or the next
panel's first), so a layer's weights stream from memory while the tiles
compute. Without it the first tile of every pass waited for its weights: in
a ResNet-18 the 7x7 convs (9.4 MB of weights each, not in cache inside the
model) ran no faster than convgemm's, 1.65 ms, though 15 % faster one-node;
with it, 1.20 ms.

1x1 convolutions take the same kernel with one tap, reading X in place.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .ukernel import LOADC_ACCUMULATE, LOADC_EPILOGUE, TSTORE_OUTPUT, TSpec

from . import convprologue
from .convgemm import padded_input_kernel, phase_geometry
from .epilogue import Epilogue, register_epilogue
from .gemm import UK_MIN_SPLIT_FLOPS, UK_NR_STEP, ceil_div, choose_tile
from .kernel import Kernel, KernelCall, Source, kernel_header, work_items
from .scratch import scratch_value

# (MR, NR) tiles and their relative speed, measured on whole convs (accumulators: 6x4 = 24 zmm,
# 7x3 = 21, 7x2 = 14): over 9 taps 7x32 is the fastest (512 -> 512 at 7x7: 1.02 ms against
# 1.06 with 7x48; 256 -> 256 at 14x14: 1.06 against 1.17), with one tap (1x1) it is 7x48
# (2048 -> 512 at 7x7: 0.56 ms against 0.61 with 7x32).
TILES = {"taps": {(7, 32): 1.0, (8, 32): 0.98, (6, 32): 0.95, (7, 48): 0.9, (6, 64): 0.85, (4, 64): 0.75},
         "rows": {(6, 64): 1.0, (7, 48): 0.97, (8, 48): 0.99, (4, 64): 0.9}}
PASS_BYTES = 32 << 10   # weights of one pass over the input channels (stay in L1 across the tiles)
SLOT_BYTES = 32 << 10   # a panel's partial tiles, read and written every pass: at most this (L1). Over
                        # it, 128 -> 128 3x3 at 28x28 (100 KB of tiles) took 1.51 ms against convgemm's 1.23
GAIN = 1.02             # take this path when its lanes do this much more useful work (times SPEED)
SPEED = {"taps": 1.0, "rows": 0.92}   # against the position-in-lanes kernels at equal useful lanes, measured


def _tile(OW: int, ocg: int, taps: int):
    """The tile with the most useful lanes (row tiles never cross a row), weighted by speed."""
    def useful(tile):
        mr, nr = tile
        return OW / (ceil_div(OW, mr) * mr) * ocg / (ceil_div(ocg, nr) * nr)
    table = TILES["taps" if taps > 1 else "rows"]
    best = max(sorted(table), key=lambda t: useful(t) * table[t])
    return best, useful(best) * table[best] / max(table.values())


def _lanes_useful(OH: int, OW: int, PW: int, ocg: int, pointwise: bool) -> float:
    """The useful fraction of the lanes and rows the position-in-lanes kernels compute: for a
    1x1 conv the GEMM (column edge in 16-float steps), else convgemm's flat grid (columns past
    each row's end, whole tiles of NR)."""
    if pointwise:
        N = OH * OW
        mr, _ = choose_tile(ocg, N)
        cols = N / (ceil_div(N, UK_NR_STEP) * UK_NR_STEP)
    else:
        q_valid = (OH - 1) * PW + OW
        mr, nr = choose_tile(ocg, q_valid, "taps")
        cols = OH * OW / (ceil_div(q_valid, nr) * nr)
    return cols * ocg / (ceil_div(ocg, mr) * mr)


def eligible(X, W, B, group, kernel, strides, dilations, pads, Y, res_strides=None, pointwise: bool = False) -> bool:
    """Whether a float32 2-D conv (weights and bias constant) gains from channels in the lanes:
    its tiles waste fewer lanes, by more than the scatters cost."""
    if len(X.shape) != 4 or not W.is_const or (B is not None and not B.is_const) \
            or np.dtype(Y.dtype) != np.float32 or (res_strides is not None and len(res_strides) != 4):
        return False
    OC = int(W.shape[0])
    icg, ocg = int(X.shape[1]) // group, OC // group
    OH, OW = (int(v) for v in Y.shape[2:])
    if ocg < 32 or icg < 8:
        return False
    taps = int(np.prod(kernel))
    (mr, nr), useful = _tile(OW, ocg, taps)
    if pointwise and OW % mr:
        return False   # (a row's last tile would read past the end of X)
    if 4 * OH * OW * nr > SLOT_BYTES:
        return False   # the partial tiles of a panel would not stay in L1 between passes
    PW = OW if pointwise else phase_geometry(kernel, strides, dilations, pads[1], int(X.shape[3]), OH, OW)[2]
    return useful * SPEED["taps" if taps > 1 else "rows"] >= GAIN * _lanes_useful(OH, OW, PW, ocg, pointwise)


def lower_conv_small(node, graph, X, W, B, Y, group, kernel, strides, dilations, pads,
                     residual_arg=None, res_strides=None, epilogue: Epilogue | None = None,
                     pointwise: bool = False, frames: tuple | None = None) -> list:
    """The kernel calls (ConvPad unless pointwise, then Conv) of a conv on a small plane. `frames`
    (image stride, hop): X is the frames of a one-channel 1-D conv without padding, read in place
    (convim2col.py), and this conv is the 1x1 conv over them: X's shape is (N, taps, 1, frames),
    its "channel" k of frame ow at X[n*image stride + k + ow*hop]."""
    epilogue = epilogue or Epilogue()
    N, C, H, Wd = (int(v) for v in X.shape)
    OC = int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    icg, ocg = C // group, OC // group
    (MR, NR), _ = _tile(OW, ocg, int(np.prod(kernel)))
    calls = []
    if pointwise:
        # The input as it is: position (oh, ow) of channel c at c*H*W + oh*W + ow (stride 1, no pad).
        offsets, ldb, PW, src_name = (0,), (1 if frames else H * Wd), Wd, X.name
    else:
        phases, PH, PW, ldb, offsets, left = phase_geometry(kernel, strides, dilations, pads[1], Wd, OH, OW)
        src_name = scratch_value(graph, node, (N * C * ldb + PW + 16,), np.float32, tag="phases")
        # (a PrologueConv's elementwise program applied to each value copied: convprologue.py)
        prologue = convprologue.take(X.name)
        pad_kernel, pad_work = padded_input_kernel(C, H, Wd, strides[0], strides[1], pads[0], left, phases, PH, PW, N,
                                                   ldb - len(phases) * PH * PW, prologue.lines if prologue else None)
        calls.append(KernelCall(pad_kernel, [X.name, src_name], pad_work, node.name))
    T = len(offsets)

    # Weights: [group][panel][c][tap][NR], zero padded: a panel's passes follow each other, one
    # contiguous run per work item.
    n_panels = ceil_div(ocg, NR)
    kc_max = max(1, min(icg, PASS_BYTES // (4 * T * NR)))
    passes = ceil_div(icg, kc_max)
    kc_max = ceil_div(icg, passes)
    # The last panel is only as wide as its columns need (whole vectors): the STFT's 258 channels
    # in 7 x 48 tiles are five panels of 48 and one of 32, not six of 48 (1/18 of the FMAs).
    last_nr = min(NR, ceil_div(ocg - (n_panels - 1) * NR, UK_NR_STEP) * UK_NR_STEP)
    w = np.zeros((group, n_panels * NR, icg, T), dtype=np.float32)
    w[:, :ocg] = np.asarray(W.data, dtype=np.float32).reshape(group, ocg, icg, T)
    whole = w[:, :(n_panels - 1) * NR].reshape(group, n_panels - 1, NR, icg, T).transpose(0, 1, 3, 4, 2)
    last = w[:, (n_panels - 1) * NR:(n_panels - 1) * NR + last_nr].transpose(0, 2, 3, 1)
    packed = np.ascontiguousarray(np.concatenate([whole.reshape(group, -1), last.reshape(group, -1)], axis=1)
                                  .reshape(-1))
    per_group = ((n_panels - 1) * NR + last_nr) * icg * T

    # Work items: (image, group, panel, block of rows); rows split only to give threads enough items.
    want = work_items()
    split = 2 * N * OC * OH * OW * icg * T >= UK_MIN_SPLIT_FLOPS
    row_blocks = min(OH, max(1, ceil_div(want, N * group * n_panels))) if split else 1
    rows_per = ceil_div(OH, row_blocks)
    row_blocks = ceil_div(OH, rows_per)
    tiles_per_row = ceil_div(OW, MR)
    slots = N * group * n_panels * row_blocks * rows_per * tiles_per_row
    partial = scratch_value(graph, node, (slots * MR * NR,), np.float32, tag="tiles")
    work = N * group * n_panels * row_blocks

    has_bias = B is not None
    uk_epilogue = register_epilogue(has_bias, epilogue, residual_arg is not None)
    in_registers = uk_epilogue is not None
    # Each tile of a pass prefetches its share of the next pass's weights (the next contiguous run:
    # the next pass, or after the last one the next panel's first), so they stream from memory
    # while this pass computes, not in a burst when the next pass starts.
    tiles = rows_per * tiles_per_row
    pass_lines = ceil_div(4 * kc_max * T * NR, 64)
    share = ceil_div(pass_lines, tiles)
    pf_lines = ceil_div(share, kc_max)
    spec = TSpec(mr=MR, nr=NR, taps=tuple(offsets), a_ks=ldb, c_cs=OH * OW, pf_lines=pf_lines,
                 a_is=frames[1] if frames else 1, **(uk_epilogue or {}))
    narrow = last_nr < NR   # the last panel's micro-kernel: uk_last, its weights last_nr floats per k
    # Pointers: A (phases or X), W (packed), [bias], [residual], partial tiles, Y.
    n_ptrs = 4 + has_bias + (residual_arg is not None)
    pb = "p2" if has_bias else None
    pr = f"p{2 + has_bias}" if residual_arg is not None else None
    pp, py = f"p{n_ptrs - 2}", f"p{n_ptrs - 1}"
    OHW = OH * OW

    src = Source()
    for line in spec.declaration("uk").splitlines():
        src.line(line)
    if narrow:
        for line in replace(spec, nr=last_nr).declaration("uk_last").splitlines():
            src.line(line)
    src.line(kernel_header(n_ptrs)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"rb = item % {row_blocks}").line(f"rest = item // {row_blocks}")
    src.line(f"pn = rest % {n_panels}").line(f"rest = rest // {n_panels}")
    src.line(f"g = rest % {group}").line(f"n = rest // {group}")
    src.line(f"oc0 = g * {ocg} + pn * {NR}").line(f"cols = min({NR}, {ocg} - pn * {NR})")
    src.line(f"r_lo = rb * {rows_per}").line(f"r_hi = min(r_lo + {rows_per}, {OH})")
    src.line(f"slot0 = item * {rows_per * tiles_per_row}")
    if narrow:
        src.line(f"nrp = {NR} if pn < {n_panels - 1} else {last_nr}")
    run_floats = f"nrp * {T}" if narrow else f"{T * NR}"   # weights of one k in this panel
    src.line(f"for c0 in range(0, {icg}, {kc_max}):").indent()
    src.line(f"kc = min({kc_max}, {icg} - c0)")
    src.line(f"flags = (0 if c0 == 0 else {LOADC_ACCUMULATE}) + "
             f"({TSTORE_OUTPUT + (LOADC_EPILOGUE if in_registers else 0)} if c0 + {kc_max} >= {icg} else 0)")
    src.line(f"boff = g * {per_group} + pn * {icg * T * NR} + c0 * {run_floats}")
    if frames:
        src.line(f"abase = n * {frames[0]} + c0")
    else:
        src.line(f"abase = (n * {C} + g * {icg} + c0) * {ldb}")
    src.line("for oh in range(r_lo, r_hi):").indent()
    src.line(f"for ow in range(0, {OW}, {MR}):").indent()
    src.line(f"slot = slot0 + (oh - r_lo) * {tiles_per_row} + ow // {MR}")
    src.line(f"pfoff = kc * {run_floats} + ((oh - r_lo) * {tiles_per_row} + ow // {MR}) * {share * 16}")
    position = f"ow * {frames[1]}" if frames else f"oh * {PW} + ow"
    args = (f"(p0, abase + {position}, p1, boff, {pp}, slot * {MR * NR}, {py}, "
            f"(n * {OC} + oc0) * {OHW} + oh * {OW} + ow, kc, min({MR}, {OW} - ow), cols, flags, "
            + (f"{pb}, oc0, pfoff)" if has_bias and in_registers else "p0, 0, pfoff)"))
    if narrow:
        src.line(f"if pn == {n_panels - 1}:").indent().line("uk_last" + args).dedent()
        src.line("else:").indent().line("uk" + args).dedent()
    else:
        src.line("uk" + args)
    src.dedent().dedent().dedent()
    if not in_registers and (has_bias or residual_arg is not None or epilogue.active):
        # Bias, residual and other activations on the item's outputs, after its last pass.
        src.line("for j in range(cols):").indent()
        src.line("oc = oc0 + j").line(f"ob = (n * {OC} + oc) * {OHW}")
        terms = [f"{py}[ob + f]"]
        if has_bias:
            src.line(f"bias = {pb}[oc]")
            terms.append("bias")
        if residual_arg is not None:
            sn, sc, sh, sw = res_strides
            src.line(f"rb0 = n * {sn} + oc * {sc}")
            terms.append(f"{pr}[rb0 + (f // {OW}) * {sh} + (f % {OW}) * {sw}]")
        src.line(f"for f in range(r_lo * {OW}, r_hi * {OW}):").indent()
        src.line(f"v = {' + '.join(terms)}")
        src.line(f"{py}[ob + f] = {epilogue.expr('v', np.dtype(np.float32)) if epilogue.active else 'v'}")
        src.dedent().dedent()
    types = ["float32", "float32"] + (["float32"] if has_bias else []) + (["float32"] if residual_arg is not None else []) \
        + ["float32", "float32"]
    kernel = Kernel("Conv", src.text(), tuple(types), self_sized=True)
    args = [src_name, packed] + ([B.name] if has_bias else []) + ([residual_arg] if residual_arg is not None else []) \
        + [partial, Y.name]
    calls.append(KernelCall(kernel, args, work, node.name, n_outputs=2))
    return calls
