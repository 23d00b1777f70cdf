"""3x3 stride-1 convolutions by Winograd's minimal filtering, F(4x4, 3x3) or F(2x2, 3x3).

An m x m block of outputs (a *tile*) of output channel oc comes from the a x a input
patches d_c under it (a = m + 2):

    Y_tile = A^T ( sum_c  U[oc, c] * (B^T d_c B) ) A,     U[oc, c] = G W[oc, c] G^T

(`*` elementwise over the a x a positions xi). The sum over the channels is, for each
position, a GEMM: M[xi] (OC x tiles) = U[xi] (OC x C) @ V[xi] (C x tiles). Per output and
channel pair that is a*a/m^2 multiply-adds instead of the direct conv's 9: 2.25 for F(4x4, 3x3)
(4x fewer), 4 for F(2x2, 3x3) (2.25x fewer). The transforms cost a few adds per value.
F(4x4, 3x3) is taken when the output has at least MIN_TILES 4x4 tiles, else F(2x2, 3x3) (the
shape rules of `choose`); with `select: measure` (cuvil/select.py) the build times the
`candidates` on its machine instead and the node attribute `select` names the one to take.

A run-once call (KernelCall.once), when the first session of the loaded library is created:
`WinoPrep` computes U from W, packed into micro-kernel panels, into a block all its sessions
share (the library stores W, not U, which is a*a/9 times larger). Then four kernel calls per conv and run:

1. `ConvPad` (convgemm.py) lays the input out zero-padded as m * m phase images per
   channel (rows and columns by their index mod m): the patches are the taps of an a x a
   conv with stride m over the tile grid, so each patch value is a contiguous run along a
   row of tiles;
2. `WinoIn` computes V[n, xi, c, tile] = (B^T d B)[xi] for every tile of channel c;
3. `WinoGemm`: the a*a GEMMs per image on the micro-kernels (gemm.uk_gemm_kernel, batched
   over (image, xi)), A = U;
4. `WinoOut` computes A^T M A per tile, adds the bias and residual, applies the
   activation and writes the NCHW output.

Tiles past the output's last row or column are computed from zero padding and not stored
(`WinoOut` runs the partial tiles of the last row and column through one guarded body).

Numerics: F(2x2, 3x3)'s constants are 0, +-1 and 1/2; F(4x4, 3x3)'s (points 0, +-1, +-2)
lose a little more: one conv of 256 channels in float32, 7e-6 of the largest output
(float64 reference). Tests compare with onnxruntime at the usual 1e-4. Results do not
depend on the thread count (no split cuts a sum over channels).

Cost: the loaded library holds U, a*a/9 of W's floats (4x for F(4x4, 3x3)), made by its first
session; each session's arena holds V and M, a*a/m^2 times the conv's input and output, while a
conv runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .emit import NOALIAS_MARK
from cuvil.ir import Value

from . import convgemm
from .epilogue import Epilogue
from .gemm import Operand, choose_tile, uk_eligible, uk_gemm_kernel, uk_k_pass
from .kernel import Kernel, KernelCall, Source, kernel_header, literal, with_strided_form
from .narrow import with_bf16_lanes

@dataclass(frozen=True)
class Transform:
    """F(m x m, 3 x 3): an m x m tile of outputs from an a x a input patch (a = m + 2), rows of
    B^T (a x a), A^T (m x a) and G (a x 3). B^T and A^T rows are (index, coefficient) terms."""
    m: int
    BT: tuple
    AT: tuple
    G: tuple

    @property
    def a(self) -> int:
        return self.m + 2


def _terms(matrix) -> tuple:
    return tuple(tuple((j, c) for j, c in enumerate(row) if c) for row in matrix)


# Interpolation points 0, 1, -1 (and infinity).
F2 = Transform(2, _terms([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]),
               _terms([[1, 1, 1, 0], [0, 1, -1, -1]]),
               ((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1)))
# Points 0, 1, -1, 2, -2 (and infinity).
F4 = Transform(4, _terms([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                          [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]]),
               _terms([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]),
               ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
                (1 / 24, -1 / 12, 1 / 6), (0, 0, 1)))

MIN_CHANNELS = 8    # fewer input or output channels: the transforms cost more than the GEMMs save
MIN_TILES = 16      # fewer output tiles per image: the GEMMs are too narrow for the micro-kernel
FLAT_MIN_TW = 14    # rows of this many tiles (or more) take the grid layout whatever it adds (<= 7 %)
XI_SKEW = 16        # floats between the end of one position's matrix and the start of the next (see below)


def tiles(OH, OW, m) -> int:
    return -(-OH // m) * -(-OW // m)


# The kernels a float32 conv the winograd pass marked can run on, by the names measured selection
# (cuvil/select.py) gives them in the node attribute `select`: None is the kernels without Winograd
# (implicit GEMM or direct, conv.py's other rules).
KERNELS = {"winograd_f4": F4, "winograd_f2": F2, "direct": None}


def kernel_name(t: Transform | None) -> str:
    """The name in KERNELS of a transform `choose` returned (None: "direct")."""
    return next(name for name, kernel in KERNELS.items() if kernel is t)


def _fits(t: Transform, X, W, Y) -> bool:
    """Whether the transform's GEMMs fit the micro-kernel (wide enough rows of tiles)."""
    C, OC = int(X.shape[1]), int(W.shape[0])
    T = tiles(*(int(v) for v in Y.shape[2:]), t.m)
    return uk_eligible(np.float32, OC, T, C, Operand((0, 0), C, 1), Operand((0, 0), T, 1))


def candidates(dtype, X, W, group, kernel, strides, dilations, Y) -> list[str]:
    """The KERNELS that can compute this conv, whatever the shape rules of `choose` prefer: the
    Winograd transforms whose GEMMs fit the micro-kernel, and the direct kernels; [] for a conv no
    transform applies to (nothing to choose)."""
    if np.dtype(dtype) != np.float32 or len(X.shape) != 4 or group != 1:
        return []
    if tuple(kernel) != (3, 3) or tuple(strides) != (1, 1) or tuple(dilations) != (1, 1):
        return []
    names = [name for name, t in KERNELS.items() if t is not None and _fits(t, X, W, Y)]
    return names + ["direct"] if names else []


def choose(dtype, X, W, group, kernel, strides, dilations, Y, selected: str | None = None) -> Transform | None:
    """The Winograd transform a conv runs with, or None (the direct kernels): `selected`, a name of
    KERNELS measured selection chose among `candidates`, else the shape rules below."""
    if selected is not None:
        return KERNELS[selected]
    if not candidates(dtype, X, W, group, kernel, strides, dilations, Y):
        return None
    if min(int(X.shape[1]), int(W.shape[0])) < MIN_CHANNELS:
        return None
    for t in (F4, F2):   # the larger tile when it leaves enough tiles
        if tiles(*(int(v) for v in Y.shape[2:]), t.m) >= MIN_TILES and _fits(t, X, W, Y):
            return t
    return None


def _prep_kernel(t: Transform, OC, C, MR, kc, rows, lead) -> Kernel:
    """W (OC, C, 3, 3) -> U[xi] = G W[oc, c] G^T in micro-kernel panels, the layout
    gemm.pack_a_panels gives (a row panel of MR output channels, passes of kc channels) with
    `lead` floats per position (rows * C and an XI_SKEW: 36 store streams): run once, by the
    loaded library's first session (KernelCall.once), so the library stores W, not U. A work item is one
    row of the panels (rows past OC are zeros). Sums in float64."""
    a = t.a
    F = lambda v: literal(v, np.float64)
    src = Source()
    src.line(kernel_header(2)).indent()
    src.line("for row in range(begin, end):").indent()
    src.line(f"pi = row // {MR}").line(f"r = row - pi * {MR}")
    src.line(f"for c in range({C}):").indent()
    src.line(f"k0 = (c // {kc}) * {kc}").line(f"kcur = min({kc}, {C} - k0)")
    src.line(f"o = {rows} * k0 + pi * kcur * {MR} + (c - k0) * {MR} + r")
    src.line(f"if row < {OC}:").indent()
    src.line(f"wb = (row * {C} + c) * 9")
    for k in range(3):
        for j in range(3):
            src.line(f"g{k}{j} = np.float64(p0[wb + {3 * k + j}])")

    def dot(coefficients, names):
        terms = [f"{F(c)} * {n}" for c, n in zip(coefficients, names) if c]
        return " + ".join(terms) if terms else F(0)

    for i, gi in enumerate(t.G):           # G g: a x 3
        for j in range(3):
            src.line(f"h{i}_{j} = {dot(gi, [f'g{k}{j}' for k in range(3)])}")
    for i in range(a):                     # (G g) G^T: a x a
        for l, gl in enumerate(t.G):
            src.line(f"p1[o + {(a * i + l) * lead}] = np.float32({dot(gl, [f'h{i}_{j}' for j in range(3)])})")
    src.dedent().line("else:").indent()
    src.line(f"for xi in range({a * a}):").indent().line(f"p1[o + xi * {lead}] = np.float32(0.0)")
    return Kernel("WinoPrep", src.text(), ("float32", "float32"))


def combine(row, name) -> str:
    """sum of coefficient * name(index) over one row of a transform matrix, as source."""
    text = ""
    for index, c in row:
        v = name(index)
        if abs(c) != 1:
            v = f"{literal(abs(c), np.float32)} * {v}"
        text += (f" + {v}" if text else v) if c > 0 else (f" - {v}" if text else f"-{v}")
    return text


def tile_grid_loop(src: Source, T, TH, TW, PW, pitch) -> None:
    """The loop of an input transform over the tile grid, `r` the patch's offset in the phases
    (from `sb`) and `o` the tile's in V (from `vb`), `q` the tile in its row: one loop over the
    whole grid when pitch == PW, else a loop per row of tiles (see _in_kernel)."""
    if pitch == PW:
        src.line("r = sb").line("o = vb").line(f"for q in range({T}):").indent()
    else:
        src.line(f"for ti in range({TH}):").indent()
        src.line(f"r = sb + ti * {PW}").line(f"o = vb + ti * {pitch}")
        src.line(f"for q in range({TW}):").indent()


def _in_kernel(t: Transform, C, T, TH, TW, PW, pitch, ldb, offsets, xs) -> Kernel:
    """Phase images (ConvPad) -> V[n, xi, c, ti * pitch + tj]; a work item is one (image, channel)
    plane. Patch value d[k][l] of tile (ti, tj) is at offsets[a*k + l] + ti * PW + tj of the
    channel's phases. With pitch == PW (= TW + 1) one loop runs over the whole grid, every load
    and store contiguous along it (position TW of a row is no tile: its values are computed, then
    never stored as outputs); with pitch == TW, a loop per row of tiles."""
    a = t.a
    src = Source()
    src.line(NOALIAS_MARK).line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {C}").line(f"c = item - n * {C}")
    src.line(f"sb = item * {ldb}").line(f"vb = n * {a * a * xs} + c * {T}")
    tile_grid_loop(src, T, TH, TW, PW, pitch)
    for k in range(a):
        for l in range(a):
            src.line(f"d{k}_{l} = p0[r + q + {offsets[a * k + l]}]")
    for i, row in enumerate(t.BT):          # along the columns of the patch
        for l in range(a):
            src.line(f"e{i}_{l} = {combine(row, lambda k: f'd{k}_{l}')}")
    for i in range(a):
        for j, row in enumerate(t.BT):      # along its rows
            src.line(f"p1[o + q + {(a * i + j) * xs}] = {combine(row, lambda l: f'e{i}_{l}')}")
    return Kernel("WinoIn", src.text(), ("float32", "float32"))


def out_kernel(t: Transform, OC, T, TH, pitch, OH, OW, xs, has_bias, res_strides, epilogue: Epilogue,
               dtype, r16: bool = False, y16: bool = False, row0: int = 0, plane: int = 0,
               batch_stride: int | None = None) -> Kernel:
    """M[n, xi, oc, t] -> Y (+ bias, + residual, activation); a work item is one (image, channel) plane.
    `r16` / `y16`: the residual / Y are bf16 activations (uint16 bits): the residual widened on load
    (exact), Y rounded once on the store (RNE, as lowp.py's "exact" conversion; winograd_bf16.py).
    A band of tile rows (winograd_bf16.py): M holds TH tile rows from tile row `row0` on, which are
    OH output rows of planes of `plane` outputs. `batch_stride` (float32 Y): the elements between
    Y's images (default: OC planes, contiguous), for a Y written in place into a Concat."""
    a, m = t.a, t.m
    # A bf16 Y with rows of even length: a tile row's m = 2 outputs are one 32-bit word (the
    # tile's two columns, bf16_pair_rne), so its outputs go out as one word per tile and the
    # stores along a row of tiles are contiguous (16 tiles, one 512-bit store) instead of
    # interleaved 16-bit ones; a bf16 residual in the same layout is read the same way.
    words = y16 and m == 2 and OW % 2 == 0 and (plane or OH * OW) % 2 == 0
    r_words = words and r16 and res_strides is not None and res_strides[3] == 1 \
        and all(v % 2 == 0 for v in res_strides[:3])
    n_ptrs = 2 + has_bias + (res_strides is not None)
    pb = "p1" if has_bias else None
    pr = f"p{1 + has_bias}" if res_strides is not None else None
    py = f"p{n_ptrs - 1}"
    src = Source()
    src.line(NOALIAS_MARK).line(kernel_header(n_ptrs)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {OC}").line(f"oc = item - n * {OC}")
    src.line(f"mb = n * {a * a * xs} + oc * {T}")
    if words:
        src.line(f"yw = item * {(plane or OH * OW) // 2} + {row0 * m * OW // 2}")
    elif batch_stride is None:
        src.line(f"yb = item * {plane or OH * OW} + {row0 * m * OW}")
    else:
        src.line(f"yb = n * {batch_stride} + oc * {plane or OH * OW} + {row0 * m * OW}")
    if has_bias:
        src.line(f"bias = {pb}[oc]")
    if pr is not None:
        sn, sc, sh, sw = res_strides
        if r_words:
            src.line(f"rw = n * {sn // 2} + oc * {sc // 2} + {row0 * m * sh // 2}")
        else:
            src.line(f"rb = n * {sn} + oc * {sc} + {row0 * m * sh}")

    def tile(rows: int, cols: int, tj: str, guarded: bool = False, pre: str = ""):
        # Only the positions the stored outputs depend on are loaded (A^T's last columns feed the
        # last outputs alone). A guarded tile computes all m x m outputs and stores those within
        # `rl` rows and `cl` columns (an edge tile's, known at run time). Every name is assigned
        # once (`pre` tells the bodies apart): variables assigned more than once make Numba's SSA
        # pass slow on these long bodies (a 15x15 F(4x4) WinoOut: 3.8 -> 1.1 s to compile).
        used = sorted({j for i in range(cols) for j, _ in t.AT[i]})
        for i in range(a):
            for j in used:
                src.line(f"{pre}m{i}_{j} = p0[o + {tj} + {(a * i + j) * xs}]")
        for r in range(rows):
            for j in used:
                src.line(f"{pre}s{r}_{j} = {combine(t.AT[r], lambda i: f'{pre}m{i}_{j}')}")
        if words:
            for r in range(rows):
                if guarded and r:
                    src.line(f"if rl > {r}:").indent()
                pair = []
                for q in range(cols):
                    terms = [combine(t.AT[q], lambda j: f'{pre}s{r}_{j}')]
                    if has_bias:
                        terms.append("bias")
                    if pr is not None:
                        if r_words:
                            if q == 0:
                                src.line(f"{pre}w{r} = {pr}[rw + ({m} * ti + {r}) * {res_strides[2] // 2} + {tj}]")
                            terms.append(f"pair_{'hi' if q else 'lo'}_f32({pre}w{r})")
                        else:
                            res = f"{pr}[rb + ({m} * ti + {r}) * {res_strides[2]} + ({m} * {tj} + {q}) * {res_strides[3]}]"
                            terms.append(f"bf16_widen({res})" if r16 else res)
                    v = f"{pre}v{r}_{q}"
                    src.line(f"{v} = {' + '.join(f'({x})' if k == 0 and len(terms) > 1 else x for k, x in enumerate(terms))}")
                    pair.append(f"np.float32({epilogue.expr(v, dtype)})")
                src.line(f"{py}[yw + ({m} * ti + {r}) * {OW // 2} + {tj}] = bf16_pair_rne({pair[0]}, {pair[1]})")
                if guarded and r:
                    src.dedent()
            return
        for r in range(rows):
            for q in range(cols):
                guard = [g for g, need in ((f"rl > {r}", r), (f"cl > {q}", q)) if guarded and need]
                if guard:
                    src.line(f"if {' and '.join(guard)}:").indent()
                terms = [combine(t.AT[q], lambda j: f'{pre}s{r}_{j}')]
                if has_bias:
                    terms.append("bias")
                if pr is not None:
                    res = f"{pr}[rb + ({m} * ti + {r}) * {sh} + ({m} * {tj} + {q}) * {sw}]"
                    terms.append(f"bf16_widen({res})" if r16 else res)
                v = f"{pre}v{r}_{q}"
                src.line(f"{v} = {' + '.join(f'({x})' if k == 0 and len(terms) > 1 else x for k, x in enumerate(terms))}")
                value = epilogue.expr(v, dtype)
                src.line(f"{py}[yb + ({m} * ti + {r}) * {OW} + {m} * {tj} + {q}] = "
                         + (f"bf16_rne16(np.float32({value}))" if y16 else value))
                if guard:
                    src.dedent()

    # Whole tiles, then one loop over the edge tiles (the partial column of tiles on the right,
    # then the partial row at the bottom) through one guarded body: with a body per edge shape a
    # 15x15 F(4x4) output took 4.2 s to compile, 1.1 s without its edges.
    full_rows, full_cols = OH // m, OW // m
    if full_rows and full_cols:
        src.line(f"for ti in range({full_rows}):").indent()
        src.line(f"o = mb + ti * {pitch}")
        # (pair words, rows of more than 16 tiles that 16 does not divide: the first 16k tiles
        # and the rest as two loops; as one loop of 28 tiles LLVM took 4 tiles a vector, with
        # the split the 16 tiles are one zmm iteration: ResNet-18's 56x56 WinoOut 0.082 -> 0.038
        # ms a conv)
        split = 16 * (full_cols // 16) if words and full_cols % 16 and full_cols > 16 else 0
        for lo, hi, pre in ((0, split, "a"), (split, full_cols, "")) if split else ((0, full_cols, ""),):
            src.line(f"for tj in range({lo}, {hi}):" if lo else f"for tj in range({hi}):").indent()
            tile(m, m, "tj", pre=pre)
            src.dedent()
        src.dedent()
    right = full_rows if OW % m else 0
    bottom = -(-OW // m) if OH % m else 0
    if right + bottom:
        src.line(f"for e in range({right + bottom}):").indent()
        if right and bottom:
            src.line(f"if e < {right}:").indent()
        if right:
            src.line("ti = e").line(f"tj = {full_cols}").line(f"rl = {m}").line(f"cl = {OW % m}")
        if right and bottom:
            src.dedent().line("else:").indent()
        if bottom:
            src.line(f"ti = {TH - 1}").line(f"tj = e - {right}" if right else "tj = e").line(f"rl = {OH % m}")
            src.line(f"cl = {m} if tj < {full_cols} else {OW % m}" if OW % m else f"cl = {m}")
        if right and bottom:
            src.dedent()
        src.line(f"o = mb + ti * {pitch}")
        tile(m, m, "tj", guarded=True, pre="e")
        src.dedent()
    types = ["float32"] + (["float32"] if has_bias else []) \
        + ([("uint32" if r_words else "uint16" if r16 else "float32")] if res_strides is not None else []) \
        + ["uint32" if words else "uint16" if y16 else "float32"]
    if r16 or y16:
        return Kernel("WinoOut_bf16", with_bf16_lanes(src.text()), tuple(types))
    return Kernel("WinoOut", src.text(), tuple(types))


def lower_winograd(node, graph, t: Transform, X, W, B, Y, pads, residual_arg=None, res_strides=None,
                   epilogue: Epilogue | None = None) -> list:
    """The kernel calls of a Winograd conv with transform `t` (see `choose` and the module docstring)."""
    epilogue = epilogue or Epilogue()
    dtype = np.dtype(np.float32)
    a, P = t.a, t.a * t.a
    N, C, H, Wd = (int(v) for v in X.shape)
    OC = int(W.shape[0])
    OH, OW = (int(v) for v in Y.shape[2:])
    p_t, p_l = pads[:2]
    TH, TW = -(-OH // t.m), -(-OW // t.m)

    # The a x a patches of the tiles are the taps of an a x a conv with stride m over the tile
    # grid: its m * m phase images (zero padded) make every patch value a contiguous run along a
    # tile row.
    phases, PH, PW, ldb, offsets, left = convgemm.phase_geometry((a, a), (t.m, t.m), (1, 1), p_l, Wd, TH, TW)
    # GEMM columns: the tile grid with its extra column (PW = TW + 1), so that WinoIn is one long
    # loop, unless that takes more vectors of columns (a 7x7 output: 4 x 5 = 20 positions for 16
    # tiles).
    pitch = PW if (-(-TH * PW // 16) == -(-TH * TW // 16) or TW >= FLAT_MIN_TW) else TW
    T = TH * pitch
    # V[n, xi] and M[n, xi] are C x T and OC x T matrices; each xi's starts one cache line further
    # than a plain layout would put it, so that the transforms' streams (one per xi) do not fall
    # in one L1 set when C * T is a multiple of 1024 floats (F(2x2, 3x3) on a 64-channel 56x56
    # input: WinoIn 0.45 -> 0.10 ms, WinoOut 0.20 -> 0.09).
    xs_in, xs_out = C * T + XI_SKEW, OC * T + XI_SKEW
    names = {}
    # (the grid's last position reads one float past the last channel's phases: slack)
    for tag, size in (("winopad", N * C * ldb + 16), ("winov", N * P * xs_in), ("winom", N * P * xs_out)):
        names[tag] = graph.unique_name(f"{Y.name}__{tag}")
        graph.values[names[tag]] = Value(names[tag], dtype, (size,))
    pad_kernel, pad_work = convgemm.padded_input_kernel(C, H, Wd, t.m, t.m, p_t, left, phases, PH, PW, N,
                                                        ldb - len(phases) * PH * PW)

    # U, packed into panels, is computed from W by the library's first session (the library
    # holds W: U is a*a/9 times larger).
    MR = choose_tile(OC, T)[0]
    rows = -(-OC // MR) * MR
    lead = rows * C + XI_SKEW
    names["winou"] = graph.unique_name(f"{Y.name}__winou")
    graph.values[names["winou"]] = Value(names["winou"], dtype, (P * lead,))
    prep = KernelCall(_prep_kernel(t, OC, C, MR, uk_k_pass(C), rows, lead), [W.name, names["winou"]], rows, node.name,
                      once=True)
    a_op = Operand((0, lead), C, 1)
    b_op = Operand((P * xs_in, xs_in), T, 1)
    m_op = Operand((P * xs_out, xs_out), T, 1)
    # Its work is N x P planes, handed out like any other kernel's (not sized by split_work).
    gemm, gemm_work = uk_gemm_kernel("WinoGemm", OC, T, C, (N, P), a_op, b_op, None, m_op, a_panels=True,
                                     self_sized=False)

    out = out_kernel(t, OC, T, TH, pitch, OH, OW, xs_out, B is not None, res_strides, epilogue, dtype)
    out_args = [names["winom"]] + ([B.name] if B is not None else []) \
        + ([residual_arg] if residual_arg is not None else []) + [Y.name]
    out_call = KernelCall(out, out_args, N * OC, node.name)
    # before a Concat at batch > 1: the images a Concat row apart (concat.py)
    with_strided_form(out_call, Y, lambda row: (out_kernel(t, OC, T, TH, pitch, OH, OW, xs_out, B is not None,
                                                           res_strides, epilogue, dtype, batch_stride=row), N * OC))
    return [prep, KernelCall(pad_kernel, [X.name, names["winopad"]], pad_work, node.name),
            KernelCall(_in_kernel(t, C, T, TH, TW, PW, pitch, ldb, offsets, xs_in), [names["winopad"], names["winov"]],
                       N * C, node.name),
            KernelCall(gemm, [names["winou"], names["winov"], names["winom"]], gemm_work, node.name), out_call]
