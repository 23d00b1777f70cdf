"""Build-time packing of bf16 / float16 operands for the reduced-precision micro-kernels
(ukernel_lowp.py), in numpy. Values are rounded as lowp.py's "exact" conversions round them
(RNE; NaNs quiet), and held as uint16 bits.

    bf16_bits(x)               float32 -> bf16 bits
    f16_bits(x)                float32 -> float16 bits
    pack_a_pairs(a, P)         A (M, K) bits -> panels (ceil(M/P), ceil(K/2), 2P): [p, kp, 2i + h] = A(pP + i, 2kp + h)
    pack_b_pairs(b, nr)        B (K, N) bits -> panels (ceil(N/nr), ceil(K/2), 2nr): [q, kp, 2j + h] = B(2kp + h, q nr + j)
    pack_a_panel(a, P)         A (M, K) bits -> panels (ceil(M/P), K, P): [p, k, i] = A(pP + i, k)  (float16)

Rows, columns and k past the matrix are zeros (a zero pair adds nothing).
"""
from __future__ import annotations

import numpy as np


def bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def f16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        out = bits.view(np.float32).astype(np.float16).view(np.uint16)
    nan = (((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)).astype(np.uint16)
    return np.where((bits & 0x7FFFFFFF) > 0x7F800000, nan, out)


def _padded(m: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.zeros((rows, cols), np.uint16)
    out[:m.shape[0], :m.shape[1]] = m
    return out


def pack_a_pairs(a: np.ndarray, panel: int) -> np.ndarray:
    M, K = a.shape
    P, K2 = -(-M // panel), -(-K // 2)
    x = _padded(a, P * panel, 2 * K2).reshape(P, panel, K2, 2)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(P, K2, 2 * panel))


def pack_b_pairs(b: np.ndarray, nr: int) -> np.ndarray:
    K, N = b.shape
    Q, K2 = -(-N // nr), -(-K // 2)
    x = _padded(b, 2 * K2, Q * nr).reshape(K2, 2, Q, nr)
    return np.ascontiguousarray(x.transpose(2, 0, 3, 1).reshape(Q, K2, 2 * nr))


def pack_a_panel(a: np.ndarray, panel: int) -> np.ndarray:
    M, K = a.shape
    P = -(-M // panel)
    x = _padded(a, P * panel, K).reshape(P, panel, K)
    return np.ascontiguousarray(x.transpose(0, 2, 1))
