"""MatMulNBits (domain com.microsoft): the IR form of a weight-only quantised matrix product.

onnxruntime's `MatMulNBitsQuantizer` (onnxruntime.quantization.matmul_nbits_quantizer) and
onnxruntime-genai's model builder write it; Cuvil's own `precision: int4` (passes/quantize_weights.py)
writes the same node, so one lowering (backends/numba_cpu/nbits.py) serves both.

    Y[..., n] = sum_k A[..., k] * W[k, n]  (+ bias[n])
    W[k, n]   = (q[n, k] - zp[n, b]) * scale[n, b]        b = k // block_size

Inputs (onnxruntime's contrib op spec, docs/ContribOperators.md):
- A: float32 [..., K] (the activations; the only run-time input).
- B: uint8 [N, k_blocks, blob_size], k_blocks = ceil(K / block_size), blob_size = block_size * bits / 8:
  the codes of column n, block b, packed low bits first along k (4 bits: k even in the low
  nibble, k odd in the high one). A last partial block is padded.
- scales: float32 [N, k_blocks] (or flat, N * k_blocks).
- zero_points (optional): uint8 packed like B along the blocks ([N, ceil(k_blocks * bits / 8)]),
  or float32 [N, k_blocks]; absent: 2^(bits - 1) (8 for 4 bits, 128 for 8 bits).
- g_idx (optional, deprecated in onnxruntime): int32 [K], the group of each k (act-order, GPTQ):
  W[k, n] = (q[n, k] - zp[n, g_idx[k]]) * scale[n, g_idx[k]]. Accepted when every group has
  block_size members (the last one the rest), as act-order quantisers write it: the lowering then
  permutes k so that groups are blocks again (and A's columns alike, at run time).
- bias (optional): float32 [N].
Attributes: K, N, bits (4 or 8 here), block_size (a power of two >= 16), accuracy_level (how
onnxruntime may compute: 0/1 dequantise to float32; 4 quantises A to int8, see int8_activations).

accuracy_level 4 (what onnxruntime-genai's builder writes for -p int4 -e cpu): onnxruntime's MLAS
"CompInt8" path (qnbitgemm / QuantizeARow_CompInt8) first quantises each row of A per block of
block_size k, symmetric, to int8:
    amax = max |a_k|,  scale_a = amax / 127,  inv = 127 / amax (0 when amax = 0),
    qa_k = round_half_even(a_k * inv)  (in [-127, 127])
and sums qa_k (q_k - zp) in integers, times scale_a * scale. So its product is the float product
of fake-quantised activations a'_k = qa_k * scale_a with the same weights, up to float32 rounding
(measured against onnxruntime 1.32: bits 4 and 8, default or uint8 zero points, 1 to 40 rows;
float zero points keep the float32 path there). Cuvil computes it that way (int8_activations).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import UnsupportedOpError

DOMAIN = "com.microsoft"
OP = "MatMulNBits"
BITS = (4, 8)
INPUTS = ("A", "B", "scales", "zero_points", "g_idx", "bias")


def default_zero_point(bits: int) -> int:
    return 1 << (bits - 1)


@dataclass
class NBitsWeight:
    """A MatMulNBits weight decoded: codes q [N, K] (uint8, unpacked), scales [N, k_blocks] float32,
    zero points [N, k_blocks] (uint8 codes, or float32; None: the default), bias [N] or None."""
    K: int
    N: int
    bits: int
    block_size: int
    q: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bias: np.ndarray | None
    g_idx: np.ndarray | None = None     # [K] int: the group of each k; None: k // block_size

    def groups(self) -> np.ndarray:
        """The group of each k."""
        return np.arange(self.K) // self.block_size if self.g_idx is None else self.g_idx.astype(np.int64)

    @property
    def k_blocks(self) -> int:
        return -(-self.K // self.block_size)

    def zero_point_values(self) -> np.ndarray:
        """[N, k_blocks] float64 zero points (the default filled in)."""
        if self.zero_points is None:
            return np.full((self.N, self.k_blocks), float(default_zero_point(self.bits)))
        return self.zero_points.astype(np.float64)

    def dequantize(self) -> np.ndarray:
        """W [K, N] in float64: (q - zp) * scale exactly (products of a small integer and a float32
        rounded once to float64 at most, for the test oracles and the accuracy reports)."""
        blocks = self.groups()
        zp = self.zero_point_values()[:, blocks]
        return ((self.q.astype(np.float64) - zp) * self.scales.astype(np.float64)[:, blocks]).T


def _fail(node, why, hint=None):
    raise UnsupportedOpError(f"node '{node.name}' ({DOMAIN}::{OP}): {why}", hint=hint)


def _attr_int(node, key, default=None):
    value = node.attrs.get(key, default)
    if value is None:
        _fail(node, f"attribute '{key}' is missing", hint="onnxruntime's quantizer always writes K, N, bits and block_size")
    return int(value)


def check(node, values: dict) -> tuple[tuple[int, ...], np.dtype]:
    """The output's shape and dtype, after checking everything the lowering relies on; an
    UnsupportedOpError naming the node for what Cuvil does not compile. `values`: name -> cuvil.ir.Value."""
    K, N = _attr_int(node, "K"), _attr_int(node, "N")
    bits, block = _attr_int(node, "bits", 4), _attr_int(node, "block_size")
    if bits not in BITS:
        _fail(node, f"bits={bits} is not supported", hint="supported: bits 4 and 8")
    if block < 16 or block & (block - 1):
        _fail(node, f"block_size={block} is not a power of two >= 16", hint="onnxruntime's own kernels need the same")
    if K <= 0 or N <= 0:
        _fail(node, f"K={K}, N={N} must be positive")
    inputs = list(node.inputs) + [""] * (len(INPUTS) - len(node.inputs))
    if len(node.inputs) > len(INPUTS) or len(node.inputs) < 3:
        _fail(node, f"takes 3 to {len(INPUTS)} inputs ({', '.join(INPUTS)}), got {len(node.inputs)}")
    a = values[inputs[0]]
    if np.dtype(a.dtype) != np.float32:
        _fail(node, f"input A is {np.dtype(a.dtype).name}", hint="Cuvil compiles MatMulNBits with float32 activations")
    if not a.shape or a.shape[-1] != K:
        _fail(node, f"input A has shape {list(a.shape)}, whose last dim is not K={K}")
    for pos in range(1, len(INPUTS)):
        if inputs[pos] and not values[inputs[pos]].is_const:
            _fail(node, f"input {INPUTS[pos]} ('{inputs[pos]}') is computed at run time",
                  hint="the quantised weight, scales, zero points, g_idx and bias must be initializers")
    k_blocks = -(-K // block)
    b = values[inputs[1]]
    blob = block * bits // 8
    if np.dtype(b.dtype) != np.uint8 or b.size != N * k_blocks * blob:
        _fail(node, f"B is {np.dtype(b.dtype).name} {list(b.shape)}; expected uint8 [N={N}, k_blocks={k_blocks}, "
                    f"blob_size={blob}]")
    s = values[inputs[2]]
    if np.dtype(s.dtype) != np.float32 or s.size != N * k_blocks:
        _fail(node, f"scales are {np.dtype(s.dtype).name} {list(s.shape)}; expected float32 with N * k_blocks = "
                    f"{N * k_blocks} values")
    if inputs[3]:
        z = values[inputs[3]]
        packed = N * (-(-k_blocks * bits // 8))
        if np.dtype(z.dtype) == np.uint8:
            if z.size != packed:
                _fail(node, f"uint8 zero_points have {z.size} values; expected N * ceil(k_blocks * bits / 8) = {packed}")
        elif np.dtype(z.dtype) == np.float32:
            if bits != 4 or z.size != N * k_blocks:
                _fail(node, f"float zero_points with bits={bits} and {z.size} values are not supported",
                      hint="float zero points: 4 bits and N * k_blocks values (onnxruntime has no 8-bit form either)")
        else:
            _fail(node, f"zero_points are {np.dtype(z.dtype).name}", hint="uint8 (packed) or float32 zero points")
    if inputs[4]:
        g = np.asarray(values[inputs[4]].data).reshape(-1)
        want = np.bincount(np.arange(K) // block, minlength=k_blocks)
        if g.size != K or np.dtype(g.dtype).kind not in "iu" or g.min() < 0 or g.max() >= k_blocks \
                or not np.array_equal(np.bincount(g.astype(np.int64), minlength=k_blocks), want):
            _fail(node, "g_idx does not give every group block_size members (the last one the rest)",
                  hint="act-order g_idx (a permutation of k // block_size) is supported; other groupings are "
                       "not (onnxruntime deprecates g_idx)")
    if inputs[5]:
        bias = values[inputs[5]]
        if np.dtype(bias.dtype) != np.float32 or bias.size != N:
            _fail(node, f"bias is {np.dtype(bias.dtype).name} {list(bias.shape)}; expected float32 [N={N}]")
    return tuple(a.shape[:-1]) + (N,), np.dtype(np.float32)


def int8_activations(node, weight: NBitsWeight) -> bool:
    """Whether onnxruntime computes this node with A quantised to int8 per block (module docstring):
    accuracy_level 4 and integer zero points (or none). An act-order g_idx keeps float32 here."""
    return (int(node.attrs.get("accuracy_level", 0) or 0) == 4 and weight.g_idx is None
            and (weight.zero_points is None or weight.zero_points.dtype == np.uint8))


def quantize_activations(a: np.ndarray, block: int) -> np.ndarray:
    """a' = qa * scale_a per row and block of k, in float32, as onnxruntime's CompInt8 path
    quantises A (module docstring): the reference for the kernel and the tests."""
    a = np.asarray(a, np.float32)
    out = np.empty_like(a)
    for k0 in range(0, a.shape[-1], block):
        part = a[..., k0:k0 + block]
        amax = np.abs(part).max(axis=-1, keepdims=True)
        scale = amax / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        out[..., k0:k0 + block] = np.rint(part * inv) * scale
    return out


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """[rows, bytes] uint8 -> [rows, count] codes, low bits first."""
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    packed = np.asarray(packed, np.uint8)
    # one strided store per code position into one uint8 array (no stacked temporaries: a 1.1B int4
    # model's codes are 1 GB, and the stack and its cast cost 40 s of a 150 s build)
    codes = np.empty((packed.shape[0], packed.shape[1] * per), np.uint8)
    for j in range(per):
        np.bitwise_and(packed >> np.uint8(bits * j), mask, out=codes[:, j::per])
    return codes if count == codes.shape[1] else codes[:, :count]


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """[rows, count] codes -> [rows, ceil(count * bits / 8)] uint8, low bits first (zero padded)."""
    per = 8 // bits
    rows, count = codes.shape
    padded = np.zeros((rows, -(-count // per) * per), np.uint8)
    padded[:, :count] = codes
    padded = padded.reshape(rows, -1, per)
    out = np.zeros(padded.shape[:2], np.uint8)
    for j in range(per):
        out |= (padded[..., j] << (bits * j)).astype(np.uint8)
    return out


def decode(node, values: dict) -> NBitsWeight:
    """The weight of a checked MatMulNBits node (see check)."""
    inputs = list(node.inputs) + [""] * (len(INPUTS) - len(node.inputs))
    K, N = int(node.attrs["K"]), int(node.attrs["N"])
    bits, block = int(node.attrs.get("bits", 4)), int(node.attrs["block_size"])
    k_blocks = -(-K // block)
    b = np.asarray(values[inputs[1]].data).reshape(N, -1)
    q = _unpack(b, bits, k_blocks * block)[:, :K]
    scales = np.asarray(values[inputs[2]].data, np.float32).reshape(N, k_blocks)
    zp = None
    if inputs[3]:
        z = np.asarray(values[inputs[3]].data)
        zp = (_unpack(z.reshape(N, -1), bits, k_blocks) if z.dtype == np.uint8
              else z.astype(np.float32).reshape(N, k_blocks))
    bias = np.asarray(values[inputs[5]].data, np.float32).reshape(N) if inputs[5] else None
    g_idx = None
    if inputs[4]:
        g = np.asarray(values[inputs[4]].data).reshape(-1).astype(np.int64)
        g_idx = None if np.array_equal(g, np.arange(K) // block) else g
    return NBitsWeight(K, N, bits, block, q, scales, zp, bias, g_idx)


def in_block_order(weight: NBitsWeight) -> tuple[NBitsWeight, np.ndarray | None]:
    """An act-order weight with k permuted so that each group's k are one block, and the permutation
    (A's column j of the result is A's column perm[j]); a weight without g_idx as it is, None."""
    if weight.g_idx is None:
        return weight, None
    perm = np.argsort(weight.g_idx, kind="stable")
    return NBitsWeight(weight.K, weight.N, weight.bits, weight.block_size, weight.q[:, perm], weight.scales,
                       weight.zero_points, weight.bias), perm


def encode(weight: NBitsWeight) -> dict:
    """The initializers of a MatMulNBits node for a weight: B, scales and (when given) the
    zero points, in onnxruntime's layout (the inverse of decode)."""
    N, K, block, bits = weight.N, weight.K, weight.block_size, weight.bits
    k_blocks = weight.k_blocks
    codes = np.zeros((N, k_blocks * block), np.uint8)
    codes[:, :K] = weight.q
    out = {"B": _pack(codes, bits).reshape(N, k_blocks, block * bits // 8), "scales": weight.scales.astype(np.float32)}
    if weight.zero_points is not None:
        out["zero_points"] = _pack(weight.zero_points.astype(np.uint8), bits)
    return out


def quantize(w: np.ndarray, bits: int, block_size: int, symmetric: bool, scale_dtype=np.float32) -> NBitsWeight:
    """Round-to-nearest block quantisation of W [K, N] along K (onnxruntime's default algorithm:
    symmetric: scale = max|w| / -(2^(bits-1)) read as the code -2^(bits-1) for the largest
    magnitude, zero point 2^(bits-1); asymmetric: scale = (max - min) / (2^bits - 1) over a range
    that includes 0, zero point = round(-min / scale)). With `scale_dtype` float16 the scales are
    rounded to float16 first (the library then stores them in 2 bytes) and the codes chosen for
    those scales."""
    K, N = w.shape
    k_blocks = -(-K // block_size)
    padded = np.zeros((k_blocks * block_size, N), np.float32)
    padded[:K] = w
    blocks = padded.reshape(k_blocks, block_size, N).transpose(2, 0, 1).astype(np.float64)  # [N, kb, bs]
    qmax = (1 << bits) - 1
    if symmetric:
        # the signed extreme: the value of largest magnitude maps to -2^(bits-1)
        idx = np.abs(blocks).argmax(axis=-1)
        extreme = np.take_along_axis(blocks, idx[..., None], axis=-1)[..., 0]
        scale = extreme / -float(1 << (bits - 1))
        zp = np.full(scale.shape, float(1 << (bits - 1)))
    else:
        lo = np.minimum(blocks.min(axis=-1), 0.0)
        hi = np.maximum(blocks.max(axis=-1), 0.0)
        scale = (hi - lo) / qmax
        zp = None
    scale = scale.astype(scale_dtype).astype(np.float32).astype(np.float64)
    safe = np.where(scale == 0, 1.0, scale)
    if zp is None:
        zp = np.clip(np.round(-lo / safe), 0, qmax)
    q = np.clip(np.round(blocks / safe[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    q = q.reshape(N, -1)[:, :K]
    return NBitsWeight(K, N, bits, block_size, q, scale.astype(np.float32),
                       None if symmetric else zp.astype(np.uint8), None)
