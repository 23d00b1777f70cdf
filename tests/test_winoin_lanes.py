"""winoin_lanes.WinoInSpec (bf16 Winograd F(2x2)'s input transform as a vector micro-kernel)
against numpy, bit for bit: F2's B^T rows have two terms each, so each float32 stage is one
rounded add or subtract whatever the order, and the reference computes exactly what the kernel
must. "exact" rounds as ml_dtypes (RNE); "hw" (`vcvtneps2bf16`) the same except that a float32
subnormal V becomes a zero of its sign. Whole convs through it: tests/test_precision_winograd.py."""
import ml_dtypes
import numpy as np
import pytest

from backends.numba_cpu.winograd import F2
from backends.numba_cpu.winoin_lanes import WinoInSpec
from tests.test_lowp_kernels import BF16, kernel

BT = tuple(tuple((int(i), float(c)) for i, c in row) for row in F2.BT)
PW = 37                                                  # a phase row: patch (k, l) at k * PW + l
OFFSETS = tuple(k * PW + l for k in range(4) for l in range(4))


def _bf16_bits(v: np.ndarray, hw: bool) -> np.ndarray:
    bits = v.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    if hw:   # a float32 subnormal flushed to a zero of its sign
        sub = (np.abs(v) < np.float32(2.0 ** -126)) & (v != 0)
        bits = np.where(sub, (v.view(np.uint32) >> 16) & 0x8000, bits)
    return bits


def _reference(planes, n, hw):
    """planes: (2, length) float32 of the pair's two channels -> (16, n) V words."""
    d = np.stack([np.stack([planes[h, o:o + n] for o in OFFSETS]) for h in (0, 1)])   # (2, 16, n)
    words = []
    bt = F2.BT
    for i in range(4):
        for j in range(4):
            v = []
            for h in (0, 1):
                e = []
                for l in range(4):
                    (k1, c1), (k2, c2) = bt[i]
                    e.append(np.float32(c1) * d[h, 4 * k1 + l] + np.float32(c2) * d[h, 4 * k2 + l])
                (l1, c1), (l2, c2) = bt[j]
                v.append(np.float32(c1) * e[l1] + np.float32(c2) * e[l2])
            words.append(_bf16_bits(v[0], hw) | (_bf16_bits(v[1], hw) << 16))
    return np.stack(words)


def _planes(length, seed):
    """Random float32 values, some tiny (V then subnormal), ties and zeros among them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, length)).astype(np.float32)
    x[:, ::7] *= np.float32(2.0 ** -125)
    x[:, ::11] = 0
    x[:, 3::13] = np.float32(1.0 + 2.0 ** -8)   # differences of equal values: exact zeros
    x[:, :3 * PW + 8] *= np.float32(2.0 ** -128)   # the first tiles' patches float32 subnormals: so is V
    return x


@pytest.mark.parametrize("cpu,method", [(BF16, "hw"), (BF16, "exact"), ("haswell", "exact")])
@pytest.mark.parametrize("x16", [0, 1])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40])
def test_the_input_transform_is_numpys_bit_for_bit_and_stays_in_its_tiles(cpu, method, x16, n):
    length = OFFSETS[-1] + n + 5
    x = _planes(length, n)
    if x16:   # bf16 phases: pair words of the two channels' bf16 values (the kernel widens them exactly)
        words = _bf16_bits(x[0], False) | (_bf16_bits(x[1], False) << 16)
        src = np.concatenate([np.zeros(3, np.uint32), words.astype(np.uint32)])
        planes = np.stack([(words << 16).view(np.float32), (words & 0xFFFF0000).view(np.float32)])
        ldb = 0
    else:
        ldb = length + 9
        src = np.zeros(3 + 2 * ldb, np.float32)
        src[3:3 + length], src[3 + ldb:3 + ldb + length] = x[0], x[1]
        planes = x
    xs = n + 6
    guard = np.uint32(0xABCDABCD)
    dst = np.full(2 + 16 * xs, guard, np.uint32)
    fn = kernel(WinoInSpec(BT, OFFSETS, xs, x16, ldb, method), cpu)
    fn(src.ctypes.data, 3, dst.ctypes.data, 2, n)
    got = dst[2:].reshape(16, xs)
    want = _reference(planes, n, method == "hw")
    np.testing.assert_array_equal(got[:, :n], want)
    assert (got[:, n:] == guard).all() and (dst[:2] == guard).all(), "wrote outside the n tiles"
    if method == "hw":   # the flush really happened (the first tiles' V are subnormal)
        assert (want != _reference(planes, n, False)).any()


@pytest.mark.parametrize("method", ["hw", "exact"])
@pytest.mark.parametrize("n,tw,pw", [(16, 4, 5), (12, 4, 5), (9, 3, 4), (4, 2, 3)])
def test_the_plane_form_shuffles_its_tiles_from_one_load(n, tw, pw, method):
    """WinoInSpec with tw > 0 (a 7x7 output's 4 x 4 tiles, rows pw words apart in the phases):
    tile q reads the phases at q + (q // tw)(pw - tw) + offsets; as the run form otherwise, bit for
    bit, nothing stored past tile n - 1 and nothing read past the last tile's last patch word."""
    offsets = tuple(((k % 2) * 2 + l % 2) * pw * pw + (k // 2) * pw + l // 2 for k in range(4) for l in range(4))
    place = np.array([q + (q // tw) * (pw - tw) for q in range(n)])
    span = max(offsets) + place[-1] + 1
    x = _planes(span, n)
    words = (_bf16_bits(x[0], False) | (_bf16_bits(x[1], False) << 16)).astype(np.uint32)
    src = np.concatenate([np.zeros(3, np.uint32), words])   # ends at the span (the loads are masked there)
    planes = np.stack([(words << 16).view(np.float32), (words & 0xFFFF0000).view(np.float32)])
    xs = n + 6
    guard = np.uint32(0xABCDABCD)
    dst = np.full(2 + 16 * xs, guard, np.uint32)
    fn = kernel(WinoInSpec(BT, offsets, xs, 1, 0, method, tw, pw), BF16)
    fn(src.ctypes.data, 3, dst.ctypes.data, 2, n)
    got = dst[2:].reshape(16, xs)
    # the run form's reference on the phases gathered into runs: d[kl][q] = phases[offsets[kl] + place[q]]
    d = np.stack([np.stack([planes[h, np.array(offsets)[:, None] + place[None, :]][i] for i in range(16)])
                  for h in (0, 1)])
    want = []
    bt = F2.BT
    for i in range(4):
        for j in range(4):
            v = []
            for h in (0, 1):
                e = [np.float32(bt[i][0][1]) * d[h, 4 * bt[i][0][0] + l] + np.float32(bt[i][1][1]) * d[h, 4 * bt[i][1][0] + l]
                     for l in range(4)]
                v.append(np.float32(bt[j][0][1]) * e[bt[j][0][0]] + np.float32(bt[j][1][1]) * e[bt[j][1][0]])
            want.append(_bf16_bits(v[0], method == "hw") | (_bf16_bits(v[1], method == "hw") << 16))
    np.testing.assert_array_equal(got[:, :n], np.stack(want))
    assert (got[:, n:] == guard).all() and (dst[:2] == guard).all()
