"""A bf16 conv with taps (3x3, any stride) onto a small plane as the transposed GEMM: output
pixels are the micro-tile's rows, output channels its vector columns (conv1x1t.py's tile, with taps).

    Y^T[p, oc] = sum_{c, t} P[c][q(p) + off[t]] W[oc, c, t]        p = (oh, ow), q(p) = oh*PW + ow

convgemm.py puts output channels on the rows and the flat grid of the phase images (convgemm's
module docstring: P, PW, the tap offsets off[t]) on the vector lanes. ResNet-50's last stage
starts with a 3x3 stride-2 conv onto 7 x 7: its grid rows are PW = 8 wide, 55 grid positions
for 49 outputs, two 32-lane tiles: 77 % of the `vdpbf16ps` work useful. Here a tile is one output
row (OW <= 8 pixels, every row valid) x 48 channels:

- A = the conv's bf16 phase image read in place (channel pairs interleaved: pair row kp holds
  (P[2kp][q], P[2kp + 1][q]) per grid position q, ldb positions a row); tap t reads it off[t]
  positions further on (ukernel_lowp.LowpOut16TapsSpec.a_taps), the tile's row oh at q = oh*PW;
- B = W^T packed at build time per 48-channel panel, channel pair and tap: [panel][kp][t][48][2];
- the tile is written as conv1x1t's (bias, 16-bit residual, Relu / Clip, one rounding, the pixel
  vectors transposed in registers, each channel's OW pixels one masked store).

The sums run over (channel pair, tap, pair half) in the order convgemm's tiles use, so the output
is bit-identical to convgemm's (tests/test_precision_direct16.py). Work items: (image, panel of
48 channels), each running its OH rows over all of K = channels x taps.
"""
from __future__ import annotations

import numpy as np

from .conv1x1t import MAX_MR, NR, item_prologue, kernel_call, pointer_args
from .kernel import KernelCall, Source

MAX_PLANE = 64   # output planes of at most this many pixels (a ResNet's 7 x 7)


def eligible(pairs: bool, group: int, taps: int, OH: int, OW: int) -> bool:
    """bf16 pairs, one group, a kernel with taps, a small output plane whose rows fit a tile."""
    return pairs and group == 1 and taps > 1 and OW <= MAX_MR and OH * OW <= MAX_PLANE


def pack_weights(W: np.ndarray, icg_p: int) -> np.ndarray:
    """W (OC, C, KH, KW) -> bf16 bits in panels [ceil(OC/NR)][icg_p/2][T][NR][2] (zero padded)."""
    from .lowp_pack import bf16_bits
    OC, C = W.shape[:2]
    T = int(np.prod(W.shape[2:]))
    panels = -(-OC // NR)
    w = np.zeros((panels * NR, icg_p, T), np.float32)
    w[:OC, :C] = np.asarray(W, dtype=np.float32).reshape(OC, C, T)
    w = w.reshape(panels, NR, icg_p // 2, 2, T).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(bf16_bits(np.ascontiguousarray(w))).reshape(-1)


def conv_call(node, lowp, cvt: str, epilogue, phases: str, packed: np.ndarray, B, residual_arg, res_n: int,
              r_dtype, Y, N: int, OC: int, icg_p: int, ldb: int, PW: int, OH: int, OW: int,
              offsets: tuple) -> KernelCall:
    """The conv call (see the module docstring). `phases`: the bf16 phase image (N x icg_p/2 pair
    rows of ldb grid positions); `packed`: pack_weights' panels; `offsets`: the taps' grid offsets."""
    from .epilogue import register_activation
    from .ukernel import LOADC_EPILOGUE
    from .ukernel_lowp import LowpOut16TapsSpec, rounding_after
    T = len(offsets)
    OHW = OH * OW
    K2 = icg_p // 2
    has_bias, has_res = B is not None, residual_arg is not None
    n_ptrs, pb, pr, py = pointer_args(has_bias, has_res)
    act = register_activation(epilogue)
    spec = LowpOut16TapsSpec(mr=OW, nr=NR, dtype=lowp[0], method=lowp[1], a_packed=1, a_panel=ldb,
                             taps=tuple(t * NR for t in range(T)), a_taps=tuple(offsets), bias=int(has_bias),
                             residual=int(has_res), cvt=rounding_after(act["act"], act["act_lo"], act["act_hi"], cvt),
                             c_transposed=1, **act)
    src = Source()
    for line in spec.declaration("uk0").splitlines():
        src.line(line)
    bias = item_prologue(src, n_ptrs, OC, OHW, icg_p * ldb, K2 * T * 2 * NR, res_n if has_res else None, pb)
    src.line(f"for oh in range({OH}):").indent()
    src.line(f"uk0(p0, a0 + oh * {2 * PW}, 0, p1, b0, {T * 2 * NR}, {py}, y0 + oh * {OW}, {OHW}, {K2}, mask, "
             f"{LOADC_EPILOGUE}, {bias[0]}, {bias[1]}, {pr or py}, r0 + oh * {OW})")
    return kernel_call(src, node, lowp, phases, packed, B, residual_arg, r_dtype, Y, N * -(-OC // NR))
