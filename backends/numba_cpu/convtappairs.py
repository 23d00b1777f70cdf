"""bf16 convs over an odd, small number of input channels (a network's RGB stem): the pairs that
`vdpbf16ps` sums are pairs of (channel, tap) products, not channel pairs.

convgemm's bf16 implicit GEMM reads its phase images with channel pairs interleaved, so 3 channels
become 2 pairs and a third of the stem's products multiply the zero weights of a padding channel
(ResNet's 7x7 / 2 stem: 2 x 49 = 98 pairs per output for 147 products). Here each kernel row's
(channel, tap) products are paired among themselves; per pair a *pair plane* holds the two float32
phase-image runs it reads, interleaved and rounded to bf16:

    Z_p[q] = (bf16(F[s1_p + q]), bf16(F[s2_p + q]))     q < PH * PW     (F: one image's phase images)

and a tap pair t reads Z_{p(t)} at the compile-time offset off[t] = p(t) * PH * PW + dy * PW + m,
exactly as the taps micro-kernel reads one channel pair's phase image (ukernel_lowp: the conv
becomes one "channel pair" with T' taps). An element (c, tap) of phase ph at row shift dy and
column shift dx is F[c * ldb + ph * PH * PW + dy * PW + dx + q]; within a kernel row (one dy):

1. a channel's taps in one phase at column shifts dx, dx + 1 (stride 2: kw and kw + 2) read one
   plane (s1, s2) = (c * ldb + ph * PH * PW, s1 + 1) at m = dx: one plane per (channel, phase);
2. the rest at the same (phase, dx) pair across channels: s2 - s1 = (c2 - c1) * ldb;
3. the rest pairwise, each plane starting at its elements' offset from m = min(dx1, dx2);
4. a last one reads a plane starting at its own run (the second weight zero).

ResNet's stem: per kernel row 3 x 3 pairs of rule 1 + 1 of rule 2 + 1 of rule 4 = 11 pairs for
21 products (77 per output, 22 % fewer multiply-adds than 98), from 2 x 7 planes.

Rounding: every product is bf16(x) * bf16(w), exact in float32, as the channel-pair form; the
sums are float32 in another order and group, so the error bound of a K-product conv
(tests/test_precision_conv.py: 2u + u^2 + 2 gamma(K + 3) times the magnitudes) holds with K the
products summed, padding zeros included (2 T' here).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernel import Kernel, Source, kernel_header

MIN_SAVING = 0.9   # taken when the pairs per output drop to this fraction of the channel-pair form's or fewer
MIN_TAPS = 25      # ... and the kernel has this many taps: MobileNetV2's 3x3 stem (18 -> 14 pairs) ran no faster
                   # (its node 0.128 -> 0.127 ms: the pair planes' conversion took what the conv saved)


@dataclass(frozen=True)
class TapPairs:
    """The pair planes (float32 start offsets s1, s2 within an image's phase images), each tap
    pair's offset in pair words and its two (channel, tap) elements ((c, t) or None: a zero weight)."""
    planes: tuple
    offsets: tuple
    elements: tuple
    plane: int   # pair words per plane (PH * PW)

    @property
    def ldb(self) -> int:
        """Pair words of one image's pair planes."""
        return len(self.planes) * self.plane

    def weights(self, W: np.ndarray) -> np.ndarray:
        """W (OC, C, KH, KW) -> (OC, 2, T'): the weight of each tap pair's two elements (0: none)."""
        OC, C = W.shape[:2]
        flat = np.asarray(W, dtype=np.float32).reshape(OC, C, -1)
        out = np.zeros((OC, 2, len(self.elements)), dtype=np.float32)
        for t, pair in enumerate(self.elements):
            for h, element in enumerate(pair):
                if element is not None:
                    out[:, h, t] = flat[:, element[0], element[1]]
        return out


def plan(icg: int, group: int, offsets, ldb: int, PH: int, PW: int) -> TapPairs | None:
    """The tap-pair form of a bf16 conv (module docstring), or None where it does not save at
    least 1 - MIN_SAVING of the channel-pair form's pairs (even channel counts pair perfectly) or
    has fewer than MIN_TAPS taps."""
    if group != 1 or icg % 2 == 0 or len(offsets) < MIN_TAPS:
        return None
    plane = PH * PW
    rows: dict[int, list] = {}   # dy -> [(c, ph, dx, tap)]
    for c in range(icg):
        for t, off in enumerate(offsets):
            ph, rem = divmod(off, plane)
            rows.setdefault(rem // PW, []).append((c, ph, rem % PW, t))
    planes: dict[tuple, int] = {}
    taps, elements = [], []

    def add(dy, s1, s2, m, e1, e2):
        p = planes.setdefault((s1, s2), len(planes))
        taps.append(p * plane + dy * PW + m)
        elements.append((e1, e2))

    def base(c, ph):
        return c * ldb + ph * plane

    for dy in sorted(rows):
        singles = []
        by_run: dict[tuple, list] = {}
        for c, ph, dx, t in rows[dy]:
            by_run.setdefault((c, ph), []).append((dx, t))
        for (c, ph), run in sorted(by_run.items()):   # 1. neighbours in one channel's phase
            run.sort()
            i = 0
            while i < len(run):
                dx, t = run[i]
                if i + 1 < len(run) and run[i + 1][0] == dx + 1:
                    add(dy, base(c, ph), base(c, ph) + 1, dx, (c, t), (c, run[i + 1][1]))
                    i += 2
                else:
                    singles.append((c, ph, dx, t))
                    i += 1
        by_column: dict[tuple, list] = {}
        for c, ph, dx, t in singles:
            by_column.setdefault((ph, dx), []).append((c, t))
        rest = []
        for (ph, dx), run in sorted(by_column.items()):   # 2. one column across channels
            for (c1, t1), (c2, t2) in zip(run[0::2], run[1::2]):
                add(dy, base(c1, ph), base(c2, ph), dx, (c1, t1), (c2, t2))
            if len(run) % 2:
                rest.append((ph, dx) + run[-1])
        for (ph1, dx1, c1, t1), (ph2, dx2, c2, t2) in zip(rest[0::2], rest[1::2]):   # 3. any two
            m = min(dx1, dx2)
            add(dy, base(c1, ph1) + dx1 - m, base(c2, ph2) + dx2 - m, m, (c1, t1), (c2, t2))
        if len(rest) % 2:   # 4. alone: a plane starting at its run, the second weight zero
            ph, dx, c, t = rest[-1]
            own = next((key for key in planes if key[0] == base(c, ph)), (base(c, ph), base(c, ph)))
            add(dy, own[0], own[1], dx, (c, t), None)
    old_pairs = (icg + 1) // 2 * len(offsets)
    if len(taps) > MIN_SAVING * old_pairs:
        return None
    ordered = sorted(planes, key=planes.get)
    return TapPairs(tuple(ordered), tuple(taps), tuple(elements), plane)


def pair_planes_kernel(pairs: TapPairs, N: int, C: int, ldb: int) -> tuple[Kernel, int]:
    """The float32 phase images (N images of C * ldb floats) -> each image's pair planes in bf16
    (RNE, lowp.PairCvtSpec), one work item per (image, plane)."""
    from .lowp import PairCvtSpec
    src = Source()
    for line in PairCvtSpec().declaration("cvt").splitlines():
        src.line(line)
    n_planes = len(pairs.planes)
    src.line(kernel_header(2)).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"n = item // {n_planes}").line(f"p = item % {n_planes}")
    src.line(f"o = item * {2 * pairs.plane}")
    for p, (s1, s2) in enumerate(pairs.planes):
        src.line(f"{'if' if p == 0 else 'elif'} p == {p}:").indent()
        src.line(f"cvt(p0, n * {C * ldb} + {s1}, {s2 - s1}, p1, o, {pairs.plane})").dedent()
    return Kernel("Cvt_tappairs_bf16", src.text(), ("float32", "uint16")), N * n_planes
