"""A bf16 1x1 conv on a small plane as the transposed GEMM: pixels are the micro-tile's rows,
output channels its vector columns.

    Y^T[p, oc] = sum_c X^T[p, c] W^T[c, oc]        p < OH*OW, oc < OC, c < C

convgemm.py puts output channels on the rows and the flat pixel grid on the vector lanes. A
ResNet's last stage has 7 x 7 = 49 pixels: 4 vectors of 16 for 49 valid lanes, 77 % of the
`vdpbf16ps` work useful, however the tile is chosen. Here the tile is mr pixels x 48 channels
(mr = 7: 49 = 7 x 7, every lane valid), the way oneDNN's 1x1 kernels block spatial points x
channel blocks of 16:

- A = X^T, read in place from the conv's bf16 phase image (convgemm's pair-interleaved copy of X:
  pair row kp holds (x[2kp, p], x[2kp + 1, p]) per pixel p): A(p, kp) is the 32-bit word at
  2 (kp ldb + p), a packed panel of P = ldb rows (ukernel_lowp's a_packed layout);
- B = W^T packed at build time in VNNI pair panels of 48 channels (lowp_pack.pack_b_pairs);
- the tile is written by ukernel_lowp.LowpOut16Spec with c_transposed: bias (a vector of 48
  channels), then the 7 pixel vectors of each 16 channels transposed in registers, so that each
  channel's 7 pixels are one masked 16-bit load of the residual and one masked store into Y's
  channel plane; Relu / Clip and RNE to 16 bits (after Relu without the NaN lanes:
  ukernel_lowp.rounding_after). The sums are the same float32 sums over the same products (each k
  pair by `vdpbf16ps` in the same order), so the output is bit-identical to convgemm's
  (tests/test_precision_direct16.py compares the two bit for bit). The residual was gathered and
  the tile scattered, 16-bit lane by lane, until 2026-12-07: ResNet-50's 512 -> 2048 7x7 conv with
  its residual took 0.30 ms of micro-kernel time, 0.22 ms now (see docs/performance.md).

Work items: (image, panel of 48 channels), each running its pixel tiles over all of K; the panel's
weights (K x 48 bf16) stay in L2 across the tiles.
"""
from __future__ import annotations

import numpy as np

from .kernel import Kernel, KernelCall, Source, kernel_header
from .narrow import pointer_type

# Planes of at most SMALL_PLANE pixels take this kernel, and planes up to MID_PLANE with at least
# MID_PLANE_K input channels: the scatter / gather of the tile costs per output, the products per
# output and input channel. Measured on ResNet-50 at 14 x 14 (196 pixels, 1 thread, against
# convgemm's 12 x 32 tiles at 87.5 % of the lanes): 1024 -> 256 0.267 -> 0.253 ms, 1024 -> 512
# 0.557 -> 0.461; 512 -> 1024 (stride 2) 0.549 -> 0.596; 256 -> 1024 + residual 0.28 -> 0.38.
# With the tile transposed in registers (2026-12-07), 256 -> 1024 at 14 x 14 with and without its
# residual this way or convgemm's timed the same (a bottleneck-like block of both, CPU time under
# load ~10: 0.544 / 0.542 ms and 0.545 / 0.548): MID_PLANE_K stays.
SMALL_PLANE = 64
MID_PLANE = 196
MID_PLANE_K = 1024
NR = 48             # output channels per tile (3 vectors: mr x 3 accumulators)
MAX_MR = 8          # pixel rows per tile (24 accumulators)


def eligible(pairs: bool, group: int, taps: int, OH: int, OW: int, PW: int, channels: int) -> bool:
    """bf16 pairs, one group, a 1x1 kernel, the pixel grid without garbage columns, a small plane
    (or a mid-sized one with many input channels: see SMALL_PLANE)."""
    if not (pairs and group == 1 and taps == 1 and PW == OW):
        return False
    return OH * OW <= SMALL_PLANE or (OH * OW <= MID_PLANE and channels >= MID_PLANE_K)


def pixel_rows(pixels: int) -> int:
    """Rows per tile: the fewest wasted rows (49 pixels: 7), then the most rows."""
    return max(range(1, MAX_MR + 1), key=lambda mr: (pixels / (-(-pixels // mr) * mr), mr))


def pack_weights(W: np.ndarray, icg_p: int) -> np.ndarray:
    """W (OC, C, 1, 1) -> bf16 bits of W^T in pair panels [ceil(OC/NR)][icg_p/2][2 NR] (zero padded)."""
    from .lowp_pack import bf16_bits, pack_b_pairs
    OC, C = W.shape[:2]
    wt = np.zeros((icg_p, OC), np.float32)
    wt[:C] = np.asarray(W, dtype=np.float32).reshape(OC, C).T
    return pack_b_pairs(bf16_bits(wt), NR).reshape(-1)


def conv_call(node, lowp, cvt: str, epilogue, phases: str, packed: np.ndarray, B, residual_arg, res_n: int,
              r_dtype, Y, N: int, OC: int, icg_p: int, ldb: int, OHW: int) -> KernelCall:
    """The conv call (see the module docstring). `phases`: the bf16 phase image (N x icg_p/2 pair
    rows of ldb pixels); `packed`: pack_weights' panels."""
    from .epilogue import register_activation
    from .ukernel import LOADC_EPILOGUE
    from .ukernel_lowp import LowpOut16Spec, rounding_after
    mr = pixel_rows(OHW)
    full, rem = OHW // mr * mr, OHW % mr
    K2 = icg_p // 2
    has_bias, has_res = B is not None, residual_arg is not None
    n_ptrs, pb, pr, py = pointer_args(has_bias, has_res)

    act = register_activation(epilogue)
    cvt = rounding_after(act["act"], act["act_lo"], act["act_hi"], cvt)   # (no NaN lanes after Relu)

    def spec(rows):
        return LowpOut16Spec(mr=rows, nr=NR, dtype=lowp[0], method=lowp[1], a_packed=1, a_panel=ldb, bias=int(has_bias),
                             residual=int(has_res), cvt=cvt, c_transposed=1, **act)
    specs = {mr: ("uk0", spec(mr))}
    if rem:
        specs[rem] = ("uk1", spec(rem))
    src = Source()
    for name, uk in specs.values():
        for line in uk.declaration(name).splitlines():
            src.line(line)
    bias = item_prologue(src, n_ptrs, OC, OHW, icg_p * ldb, K2 * 2 * NR, res_n if has_res else None, pb)
    res = pr or py

    def call(name, i0):
        src.line(f"{name}(p0, a0 + 2 * {i0}, 0, p1, b0, {2 * NR}, {py}, y0 + {i0}, {OHW}, {K2}, mask, "
                 f"{LOADC_EPILOGUE}, {bias[0]}, {bias[1]}, {res}, r0 + {i0})")
    if full:
        src.line(f"for i0 in range(0, {full}, {mr}):").indent()
        call("uk0", "i0")
        src.dedent()
    if rem:
        call("uk1", full)
    return kernel_call(src, node, lowp, phases, packed, B, residual_arg, r_dtype, Y, N * -(-OC // NR))


def pointer_args(has_bias: bool, has_res: bool) -> tuple[int, str | None, str | None, str]:
    """A transposed conv kernel's pointer arguments: p0 the bf16 phase image, p1 the packed panels,
    then the bias and the residual where there are, y last. Returns their count and the names of
    the bias, residual (None where absent) and y pointers."""
    n_ptrs = 3 + has_bias + has_res
    return (n_ptrs, "p2" if has_bias else None, f"p{2 + has_bias}" if has_res else None, f"p{n_ptrs - 1}")


def kernel_call(src: Source, node, lowp, phases: str, packed: np.ndarray, B, residual_arg, r_dtype, Y,
                items: int) -> KernelCall:
    """The call of a transposed conv kernel whose source is `src`, its arguments in pointer_args'
    order, `items` work items (an output panel of one image each: item_prologue)."""
    from .gemm import lowp_label
    has_bias, has_res = B is not None, residual_arg is not None
    types = ["uint16", "uint16"] + (["float32"] if has_bias else []) + ([pointer_type(r_dtype)] if has_res else []) \
        + [pointer_type(Y.dtype)]
    kernel = Kernel("Conv", src.text(), tuple(types), self_sized=True)
    args = [phases, packed] + ([B.name] if has_bias else []) + ([residual_arg] if has_res else []) + [Y.name]
    return KernelCall(kernel, args, items, node.name, precision=lowp_label(lowp))


def item_prologue(src: Source, n_ptrs: int, OC: int, OHW: int, a_image: int, b_panel: int, res_n, pb):
    """The kernel header and a transposed conv's work item (output panel pn of NR channels of image
    n): the last panel's channel mask, and the bases of A (a_image elements an image), B (b_panel a
    panel), Y and the residual (res_n elements an image; None: no residual). Returns the (pointer,
    offset) of the bias (any 16-bit pointer when there is none: it is not read)."""
    n_panels = -(-OC // NR)
    last = OC - (n_panels - 1) * NR
    src.line(kernel_header(n_ptrs)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"pn = item % {n_panels}").line(f"n = item // {n_panels}")
    src.line(f"mask = {(1 << last) - 1} if pn == {n_panels - 1} else -1" if last < NR else "mask = -1")
    src.line(f"a0 = n * {a_image}").line(f"b0 = pn * {b_panel}")
    src.line(f"y0 = n * {OC * OHW} + pn * {NR * OHW}")
    src.line(f"r0 = n * {res_n} + pn * {NR * OHW}" if res_n is not None else "r0 = 0")
    return (pb, f"pn * {NR}") if pb else ("p1", "0")
