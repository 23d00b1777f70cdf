"""winoout_plane.WinoOutPlaneSpec (bf16 Winograd F(2x2)'s output transform of a plane of <= 16
tiles) against numpy, bit for bit: the kernel adds A^T's three terms left to right, then the bias,
then the residual, as the reference does in float32; Relu / Clip as maxnum / minnum; a bf16 Y
rounded as ml_dtypes (RNE) except that "hw" (`vcvtneps2bf16`) flushes a float32 subnormal to a
zero of its sign. Whole convs through it: tests/test_precision_winograd.py (7x7 planes)."""
import ml_dtypes
import numpy as np
import pytest

from backends.numba_cpu.winograd import F2
from backends.numba_cpu.winoout_plane import WinoOutPlaneSpec
from tests.test_lowp_kernels import BF16, kernel

AT = tuple(tuple((int(i), float(c)) for i, c in row) for row in F2.AT)


def _bf16_bits(v, hw):
    bits = v.astype(ml_dtypes.bfloat16).view(np.uint16)
    if hw:
        sub = (np.abs(v) < np.float32(2.0 ** -126)) & (v != 0)
        bits = np.where(sub, (v.view(np.uint32) >> 16).astype(np.uint16) & 0x8000, bits)
    return bits


def _combine(row, values):
    out = None
    for i, c in row:
        v = values[i] if c > 0 else -values[i]
        out = v if out is None else (out + values[i] if c > 0 else out - values[i])
    return out


def _reference(M, xs, tiles, oh, ow, tw, bias, res, act, lo, hi):
    """M: float32 (16 * xs,), the tiles at xi * xs + t -> the plane (oh * ow,) float32."""
    m = [M[xi * xs:xi * xs + tiles] for xi in range(16)]
    s = {(r, j): _combine(AT[r], [m[4 * i + j] for i in range(4)]) for r in range(2) for j in range(4)}
    y = np.zeros((oh, ow), np.float32)
    for r in range(2):
        for q in range(2):
            v = _combine(AT[q], [s[r, j] for j in range(4)])
            for t in range(tiles):
                yy, xx = 2 * (t // tw) + r, 2 * (t % tw) + q
                if yy < oh and xx < ow:
                    y[yy, xx] = v[t]
    y = y.ravel()
    if bias is not None:
        y = y + bias
    if res is not None:
        y = y + res
    if act in ("Relu", "Clip"):
        y = np.maximum(y, np.float32(lo))
    if act == "Clip":
        y = np.minimum(y, np.float32(hi))
    return y.astype(np.float32)


CASES = [   # oh, ow, bias, residual, y16, act
    (7, 7, 1, "bf16", 1, "Relu"),
    (7, 7, 1, "", 1, "Relu"),
    (7, 7, 0, "f32", 0, ""),
    (8, 8, 1, "bf16", 0, "Clip"),
    (5, 6, 0, "", 1, "Clip"),
    (3, 5, 1, "f32", 1, ""),
]


@pytest.mark.parametrize("method", ["hw", "exact"])
@pytest.mark.parametrize("case", CASES)
def test_the_plane_output_transform_is_numpys_bit_for_bit(case, method):
    oh, ow, bias, residual, y16, act = case
    th, tw = -(-oh // 2), -(-ow // 2)
    tiles, P = th * tw, oh * ow
    lo, hi = (0.0, 0.0) if act != "Clip" else (-0.5, 6.0)
    rng = np.random.default_rng(oh * 100 + ow)
    xs = tiles + 5
    M = rng.standard_normal(3 + 16 * xs).astype(np.float32)
    M[3:3 + 16 * xs:13] *= np.float32(2.0 ** -130)             # some outputs float32 subnormals
    b = rng.standard_normal(4).astype(np.float32)
    r = rng.standard_normal(P + 4).astype(np.float32)
    if residual == "bf16":
        r16 = _bf16_bits(r, False)
        r_ptr, r_val = r16, (r16.astype(np.uint32) << 16).view(np.float32)
    else:
        r_ptr, r_val = r, r
    guard = 0xABCD
    y = np.full(P + 4, guard, np.uint16) if y16 else np.full(P + 4, np.float32(7.5))
    spec = WinoOutPlaneSpec(AT, oh, ow, tw, xs, bias, residual, y16, act, lo, hi, method)
    fn = kernel(spec, BF16)
    fn(M.ctypes.data, 3, b.ctypes.data, 2, r_ptr.ctypes.data, 1, y.ctypes.data, 2, )
    want = _reference(M[3:], xs, tiles, oh, ow, tw, b[2] if bias else None, r_val[1:1 + P] if residual else None,
                      act, lo, hi)
    if y16:
        np.testing.assert_array_equal(y[2:2 + P], _bf16_bits(want, method == "hw"))
        assert (y[:2] == guard).all() and (y[2 + P:] == guard).all()
    else:
        np.testing.assert_array_equal(y[2:2 + P].view(np.uint32), want.view(np.uint32))
        assert (y[:2] == 7.5).all() and (y[2 + P:] == 7.5).all()


ROWS = [   # n tiles, bias, residual, act
    (28, 1, 1, "Relu"),
    (16, 0, 1, ""),
    (7, 1, 0, "Clip"),
    (33, 0, 0, "Relu"),
]


@pytest.mark.parametrize("method", ["hw", "exact"])
@pytest.mark.parametrize("case", ROWS)
def test_the_row_output_transform_is_numpys_bit_for_bit_and_stays_in_its_words(case, method):
    """winoout_rows.WinoOutRowSpec: a row of n tiles into two rows of Y pair words (the tile's two
    columns), a bf16 residual read as pair words; as the plane kernel's reference otherwise."""
    from backends.numba_cpu.winoout_rows import WinoOutRowSpec
    n, bias, residual, act = case
    lo, hi = (0.0, 0.0) if act != "Clip" else (-0.5, 6.0)
    rng = np.random.default_rng(n)
    xs = n + 3
    M = rng.standard_normal(3 + 16 * xs).astype(np.float32)
    M[3::11] *= np.float32(2.0 ** -130)
    b = rng.standard_normal(4).astype(np.float32)
    rrow, yrow = n + 5, n + 2
    r = _bf16_bits(rng.standard_normal(1 + 2 * rrow).astype(np.float32), False).astype(np.uint32)
    r = r[:1 + rrow] | (r[rrow:] << 16)                         # pair words
    r = np.concatenate([r, r[::-1]])
    guard = np.uint32(0xABCDABCD)
    y = np.full(2 + 2 * yrow, guard, np.uint32)
    fn = kernel(WinoOutRowSpec(AT, xs, bias, residual, act, lo, hi, method), BF16)
    fn(M.ctypes.data, 3, b.ctypes.data, 1, r.ctypes.data, 1, rrow, y.ctypes.data, 2, yrow, n)
    m = [M[3 + xi * xs:3 + xi * xs + n] for xi in range(16)]
    for row in range(2):
        s = [_combine(AT[row], [m[4 * i + j] for i in range(4)]) for j in range(4)]
        words = r[1 + row * rrow:1 + row * rrow + n]
        halves = []
        for q in range(2):
            v = _combine(AT[q], s)
            if bias:
                v = v + b[1]
            if residual:
                v = v + ((words << 16) if q == 0 else (words & 0xFFFF0000)).view(np.float32)
            if act:
                v = np.maximum(v, np.float32(lo))
            if act == "Clip":
                v = np.minimum(v, np.float32(hi))
            halves.append(_bf16_bits(v.astype(np.float32), method == "hw").astype(np.uint32))
        got = y[2 + row * yrow:2 + row * yrow + n]
        np.testing.assert_array_equal(got, halves[0] | (halves[1] << 16))
        assert (y[2 + row * yrow + n:2 + (row + 1) * yrow] == guard).all()
    assert (y[:2] == guard).all()
