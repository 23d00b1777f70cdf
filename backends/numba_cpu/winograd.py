"""3x3 stride-1 convolutions by Winograd's minimal filtering F(2x2, 3x3).

A 2x2 block of outputs (a *tile*) of output channel oc comes from the 4x4 input
patches d_c under it:

    Y_tile = A^T ( sum_c  U[oc, c] * (B^T d_c B) ) A,     U[oc, c] = G W[oc, c] G^T

(`*` elementwise over the 4x4 positions xi). The sum over the channels is, for each
of the 16 positions, a GEMM: M[xi] (OC x tiles) = U[xi] (OC x C) @ V[xi] (C x tiles),
16 * C multiply-adds per tile and output channel instead of the direct conv's 36:
2.25x fewer FLOPs. The transforms cost a few adds per input and output value.

Four kernel calls per conv:

1. `ConvPad` (convgemm.py) lays the input out zero-padded as four phase images per
   channel (even/odd rows x even/odd columns), so that each of the 16 values of the
   tiles' patches is a contiguous run along a row of tiles;
2. `WinoIn` computes V[n, xi, c, t] = (B^T d B)[xi] for every tile t of channel c;
3. `WinoGemm`: the 16 GEMMs per image on the micro-kernels (gemm.uk_gemm_kernel,
   batched over (image, xi)), U transformed and packed into panels at build time;
4. `WinoOut` computes A^T M A per tile, adds the bias and residual, applies the
   activation and writes the NCHW output.

Tiles run row-major over ceil(OH/2) x ceil(OW/2); with an odd output size the last
tile row or column computes one extra row or column (from zero padding) that is not stored.

Numerics: the transforms' constants are 0, +-1 and 1/2; a ResNet-50 end to end stays within
1.4e-6 of onnxruntime (relative to the largest output), and tests compare at the usual 1e-4.
Results do not depend on the thread count (no split cuts a sum over channels).

Cost: U holds 16/9 of W's floats, so the library grows by 7/9 of these convs' weights.
"""
from __future__ import annotations

import numpy as np

from cuvil.ir import Value

from . import convgemm
from .epilogue import Epilogue
from .gemm import Operand, choose_tile, pack_a_panels, uk_eligible, uk_gemm_kernel
from .kernel import Kernel, KernelCall, Source, kernel_header

# Input transform B^T d B: rows of B^T as (index, sign) terms.
_BT = (((0, 1), (2, -1)), ((1, 1), (2, 1)), ((2, 1), (1, -1)), ((1, 1), (3, -1)))
# Output transform A^T m A: rows of A^T.
_AT = (((0, 1), (1, 1), (2, 1)), ((1, 1), (2, -1), (3, -1)))
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])

MIN_CHANNELS = 8    # fewer input or output channels: the transforms cost more than the GEMMs save
MIN_TILES = 16      # fewer 2x2 tiles per image: the GEMMs are too narrow for the micro-kernel
XI_SKEW = 16        # floats between the end of one position's matrix and the start of the next (see below)


def eligible(dtype, X, W, group, kernel, strides, dilations, Y) -> bool:
    if np.dtype(dtype) != np.float32 or len(X.shape) != 4 or group != 1:
        return False
    if tuple(kernel) != (3, 3) or tuple(strides) != (1, 1) or tuple(dilations) != (1, 1):
        return False
    C, OC = int(X.shape[1]), int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    T = -(-OH // 2) * -(-OW // 2)
    return min(C, OC) >= MIN_CHANNELS and T >= MIN_TILES \
        and uk_eligible(np.float32, OC, T, C, Operand((0, 0), C, 1), Operand((0, 0), T, 1))


def transform_weights(W: np.ndarray) -> np.ndarray:
    """W (OC, C, 3, 3) -> U (16, OC, C): U[xi] = (G W[oc, c] G^T) at position xi = 4a + b."""
    w = np.asarray(W, dtype=np.float64)
    u = np.einsum("ai,ocij,bj->aboc", _G, w, _G)
    return np.ascontiguousarray(u.reshape(16, *w.shape[:2]), dtype=np.float32)


def _combine(rows, values: dict, key) -> str:
    """sum of sign * values[key(index)] over one row of a transform matrix, as source."""
    text = ""
    for index, sign in rows:
        v = values[key(index)]
        text += (v if not text else f" + {v}") if sign > 0 else f" - {v}" if text else f"-{v}"
    return text


def _in_kernel(N, C, T, TH, TW, PW, ldb, offsets, xs) -> Kernel:
    """Phase images (ConvPad) -> V[n, xi, c, t]; a work item is one (image, channel) plane. Patch
    value d[k][l] of tile (ti, tj) is at offsets[4k + l] + ti * PW + tj of the channel's phases:
    every load runs contiguously along the tile row."""
    src = Source()
    src.line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {C}").line(f"c = item - n * {C}")
    src.line(f"sb = item * {ldb}").line(f"vb = n * {16 * xs} + c * {T}")
    src.line(f"for ti in range({TH}):").indent()
    src.line(f"r = sb + ti * {PW}").line(f"o = vb + ti * {TW}")
    src.line(f"for tj in range({TW}):").indent()
    d = {}
    for k in range(4):
        for l in range(4):
            d[k, l] = f"d{k}{l}"
            src.line(f"d{k}{l} = p0[r + tj + {offsets[4 * k + l]}]")
    e = {}
    for a, rows in enumerate(_BT):          # along the columns of the patch
        for l in range(4):
            e[a, l] = f"e{a}{l}"
            src.line(f"e{a}{l} = {_combine(rows, d, lambda k: (k, l))}")
    for a in range(4):
        for b, rows in enumerate(_BT):      # along its rows
            src.line(f"p1[o + tj + {(4 * a + b) * xs}] = {_combine(rows, e, lambda l: (a, l))}")
    return Kernel("WinoIn", src.text(), ("float32", "float32"))


def _out_kernel(N, OC, T, TH, TW, OH, OW, xs, has_bias, res_strides, epilogue: Epilogue, dtype) -> Kernel:
    """M[n, xi, oc, t] -> Y (+ bias, + residual, activation); a work item is one (image, channel) plane."""
    n_ptrs = 2 + has_bias + (res_strides is not None)
    pb = "p1" if has_bias else None
    pr = f"p{1 + has_bias}" if res_strides is not None else None
    py = f"p{n_ptrs - 1}"
    src = Source()
    src.line(kernel_header(n_ptrs)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {OC}").line(f"oc = item - n * {OC}")
    src.line(f"mb = n * {16 * xs} + oc * {T}").line(f"yb = item * {OH * OW}")
    if has_bias:
        src.line(f"bias = {pb}[oc]")
    if pr is not None:
        sn, sc, sh, sw = res_strides
        src.line(f"rb = n * {sn} + oc * {sc}")

    def tile(rows: int, cols: int, tj: str):
        m = {}
        for a in range(4):
            for b in range(4 if cols == 2 else 3):
                m[a, b] = f"m{a}{b}"
                src.line(f"m{a}{b} = p0[o + {tj} + {(4 * a + b) * xs}]")
        s = {}
        for i in range(rows):
            for b in range(4 if cols == 2 else 3):
                s[i, b] = f"s{i}{b}"
                src.line(f"s{i}{b} = {_combine(_AT[i], m, lambda a: (a, b))}")
        for i in range(rows):
            for j in range(cols):
                terms = [_combine(_AT[j], s, lambda b: (i, b))]
                if has_bias:
                    terms.append("bias")
                if pr is not None:
                    terms.append(f"{pr}[rb + (2 * ti + {i}) * {sh} + (2 * {tj} + {j}) * {sw}]")
                src.line(f"v = {' + '.join(f'({t})' if k == 0 and len(terms) > 1 else t for k, t in enumerate(terms))}")
                src.line(f"{py}[yb + (2 * ti + {i}) * {OW} + 2 * {tj} + {j}] = {epilogue.expr('v', dtype)}")

    for rows, lo, hi in ((2, 0, OH // 2), (1, OH // 2, TH)):
        if hi <= lo:
            continue
        src.line(f"for ti in range({lo}, {hi}):").indent()
        src.line(f"o = mb + ti * {TW}")
        if OW // 2:
            src.line(f"for tj in range({OW // 2}):").indent()
            tile(rows, 2, "tj")
            src.dedent()
        if OW % 2:
            tile(rows, 1, str(OW // 2))
        src.dedent()
    types = ["float32"] + (["float32"] if has_bias else []) + (["float32"] if res_strides is not None else []) \
        + ["float32"]
    return Kernel("WinoOut", src.text(), tuple(types))


def lower_winograd(node, graph, X, W, B, Y, pads, residual_arg=None, res_strides=None,
                   epilogue: Epilogue | None = None) -> list:
    """The kernel calls of a Winograd conv (see the module docstring)."""
    epilogue = epilogue or Epilogue()
    dtype = np.dtype(np.float32)
    N, C, H, Wd = (int(v) for v in X.shape)
    OC = int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    p_t, p_l = pads[:2]
    TH, TW = -(-OH // 2), -(-OW // 2)
    T = TH * TW

    # The 4x4 patches of the tiles are the taps of a 4x4 conv with stride 2 over the tile grid:
    # its four phase images (even/odd rows x even/odd columns, zero padded) make every patch
    # value a contiguous run along a tile row.
    phases, PH, PW, ldb, offsets, left = convgemm._phase_geometry((4, 4), (2, 2), (1, 1), p_l, Wd, TH, TW)
    # V[n, xi] and M[n, xi] are C x T and OC x T matrices; each xi's starts one cache line further
    # than a plain layout would put it, so that the transforms' 16 streams (one per xi) do not
    # fall in one L1 set when C * T is a multiple of 1024 floats (a 64-channel 56x56 input:
    # WinoIn 0.45 -> 0.10 ms, WinoOut 0.20 -> 0.09).
    xs_in, xs_out = C * T + XI_SKEW, OC * T + XI_SKEW
    names = {}
    for tag, size in (("winopad", N * C * ldb), ("winov", N * 16 * xs_in), ("winom", N * 16 * xs_out)):
        names[tag] = graph.unique_name(f"{Y.name}__{tag}")
        graph.values[names[tag]] = Value(names[tag], dtype, (size,))
    pad_kernel, pad_work = convgemm._pad_kernel(C, H, Wd, 2, 2, p_t, left, phases, PH, PW, N)

    U = transform_weights(W.data)
    packed = pack_a_panels(U, choose_tile(OC, T)[0])
    a = Operand((0, packed[0].size), C, 1)
    b = Operand((16 * xs_in, xs_in), T, 1)
    m = Operand((16 * xs_out, xs_out), T, 1)
    assert uk_eligible(dtype, OC, T, C, a, b)
    gemm, gemm_work = uk_gemm_kernel("WinoGemm", OC, T, C, (N, 16), a, b, None, m, a_panels=True)

    out = _out_kernel(N, OC, T, TH, TW, OH, OW, xs_out, B is not None, res_strides, epilogue, dtype)
    out_args = [names["winom"]] + ([B.name] if B is not None else []) \
        + ([residual_arg] if residual_arg is not None else []) + [Y.name]
    return [KernelCall(pad_kernel, [X.name, names["winopad"]], pad_work, node.name),
            KernelCall(_in_kernel(N, C, T, TH, TW, PW, ldb, offsets, xs_in), [names["winopad"], names["winov"]],
                       N * C, node.name),
            KernelCall(gemm, [packed, names["winov"], names["winom"]], gemm_work, node.name),
            KernelCall(out, out_args, N * OC, node.name)]
