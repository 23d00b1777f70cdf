"""Tensor-core products and 16-bit conversions for generated GPU source, with simulator twins.

The device functions a reduced-precision kernel may call (namespace() puts them in every
kernel's globals; their names are FUNCTIONS):

    mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
    mma_f16(...)                                     the same with float16 operands
        one warp-wide D = A B + C, A 16 x 16, B 16 x 8, C and D 16 x 8 float32:
        mma.sync.aligned.m16n8k16.row.col.f32.{bf16.bf16|f16.f16}.f32 (sm_80 and newer)
    pack_bf16x2(lo, hi) / pack_f16x2(lo, hi) -> uint32
        two float32 rounded to nearest even into one 32-bit register, `lo` in bits 0..15:
        cvt.rn.{bf16x2|f16x2}.f32 (sm_80)
    bf16_lo(w), bf16_hi(w), f16_lo(w), f16_hi(w) -> float32
        one half of a packed register widened back to float32 (exact)

Each register of a fragment holds two 16-bit elements, the one of lower index in bits 0..15
(what a little-endian 32-bit load of two consecutive 16-bit values gives). Which lane holds
which element is fixed by the PTX ISA (PTX ISA 9.0, "Warp Level Matrix Multiply-Accumulate
Instructions", section "Matrix Fragments for mma.m16n8k16 with floating point type"):

    groupID = laneid >> 2, threadID_in_group = laneid % 4
    A (.row, 4 registers a0..a3 = elements a0..a7, element i in register i // 2):
        row = groupID       for i in {0, 1, 4, 5}, groupID + 8 otherwise
        col = threadID_in_group * 2 + (i & 1), + 8 for i >= 4
    B (.col, 2 registers b0, b1 = elements b0..b3):
        row (k) = threadID_in_group * 2 + (i & 1), + 8 for i >= 2
        col (n) = groupID
    C and D (4 float32 c0..c3):
        row = groupID for i < 2, groupID + 8 otherwise
        col = threadID_in_group * 2 + (i & 1)

`a_element`, `b_element` and `c_element` below are those formulas. The simulator twin indexes
through them, rebuilding the whole 16 x 16 A and 16 x 8 B of a warp from its 32 lanes' registers,
so a kernel that puts an element in the wrong register computes a wrong product in the simulator
as it would on a GPU; the kernel generators' own register tables (gemm_tc.py A_REGS, B_REGS,
C_ELEMS) are checked against them for every lane (tests/test_cuda_lowp.py).

On a GPU the functions are Numba intrinsics emitting PTX through `llvmlite.ir.InlineAsm`
(numba-cuda 0.30.4 has no mma or 16-bit pack helpers of its own; its cache_hints.py uses the
same InlineAsm route) and LLVM bit operations. In Numba's CUDA simulator, which cannot run PTX,
they are Python functions: the mma twin exchanges the fragments of all lanes of a warp
through shared memory (every thread of the block calls it in step, as the generated kernels
do: no thread leaves the k loop early), computes the 16 x 8 product in float64 from the exact
16-bit operands and rounds it to float32 once, and hands each lane its four elements of D.
"""
from __future__ import annotations

import numpy as np

FUNCTIONS = ("mma_bf16", "mma_f16", "pack_bf16x2", "pack_f16x2", "bf16_lo", "bf16_hi", "f16_lo", "f16_hi")
FORMATS = {"bf16": "bf16", "fp16": "f16"}     # a node's `precision` -> the PTX type name
SIM_THREADS = 1024                              # the largest block the simulator twin serves


# -- the fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type") --

def a_element(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of A element a_i (i in 0..7) held by `lane`: register i // 2, half i % 2."""
    group, tig = lane >> 2, lane % 4
    row = group if i in (0, 1, 4, 5) else group + 8
    col = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def b_element(lane: int, i: int) -> tuple[int, int]:
    """(k, n) of B element b_i (i in 0..3) held by `lane`: register i // 2, half i % 2."""
    group, tig = lane >> 2, lane % 4
    return tig * 2 + (i & 1) + (8 if i >= 2 else 0), group


def c_element(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of C / D element c_i (i in 0..3) held by `lane`."""
    group, tig = lane >> 2, lane % 4
    return (group if i < 2 else group + 8), tig * 2 + (i & 1)


def _tables():
    lanes = np.arange(32)
    a = np.array([[a_element(lane, i) for i in range(8)] for lane in lanes])   # (32, 8, 2)
    b = np.array([[b_element(lane, i) for i in range(4)] for lane in lanes])   # (32, 4, 2)
    c = np.array([[c_element(lane, i) for i in range(4)] for lane in lanes])   # (32, 4, 2)
    return a, b, c


A_AT, B_AT, C_AT = _tables()


# -- 16-bit values as numpy sees them (the simulator twins, the weight packing, the tests) --

def round16(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 -> the nearest bf16 / float16 (ties to even), returned as float32 (exact)."""
    import ml_dtypes
    dtype = ml_dtypes.bfloat16 if fmt == "bf16" else np.float16
    return np.asarray(x, dtype=np.float32).astype(dtype).astype(np.float32)


def bits16(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 -> the uint16 bits of its nearest bf16 / float16 (ties to even)."""
    import ml_dtypes
    dtype = ml_dtypes.bfloat16 if fmt == "bf16" else np.float16
    return np.asarray(x, dtype=np.float32).astype(dtype).view(np.uint16)


def widen16(bits: np.ndarray, fmt: str) -> np.ndarray:
    """uint16 bits of bf16 / float16 -> float32 (exact)."""
    import ml_dtypes
    dtype = ml_dtypes.bfloat16 if fmt == "bf16" else np.float16
    return np.asarray(bits, dtype=np.uint16).view(dtype).astype(np.float32)


def pack_pairs(data: np.ndarray, fmt: str) -> np.ndarray:
    """[K, ...] float -> [ceil(K / 2), ...] uint32: rows 2j and 2j+1 rounded to 16 bits and packed
    into one word, row 2j in the low half (a zero row pads an odd K): the register layout of an
    A or B fragment, whose registers hold two consecutive k."""
    data = np.asarray(data, dtype=np.float32)
    if data.shape[0] % 2:
        data = np.concatenate([data, np.zeros((1,) + data.shape[1:], np.float32)])
    bits = bits16(data, fmt).astype(np.uint32)
    return np.ascontiguousarray(bits[0::2] | (bits[1::2] << 16))


# -- the simulator twins --------------------------------------------------------------------

def _halves(words: np.ndarray, fmt: str) -> np.ndarray:
    """uint32 words -> their two 16-bit values as float32, shape (..., 2): low half first."""
    words = np.asarray(words, dtype=np.uint32)
    return widen16(np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16), fmt)


def warp_product(a_regs: np.ndarray, b_regs: np.ndarray, c: np.ndarray, fmt: str) -> np.ndarray:
    """One mma.m16n8k16 of a warp from its lanes' registers: a_regs (32, 4) uint32, b_regs (32, 2)
    uint32, c (32, 4) float32 -> d (32, 4) float32, each lane's elements as the layout places them.
    The products of two 16-bit values are exact in float64, and so is their sum of 16 (and C):
    one rounding to float32 at the end."""
    a_vals = _halves(a_regs, fmt).reshape(32, 8)        # a_i of each lane
    b_vals = _halves(b_regs, fmt).reshape(32, 4)
    A = np.zeros((16, 16), np.float64)
    B = np.zeros((16, 8), np.float64)
    A[A_AT[..., 0], A_AT[..., 1]] = a_vals
    B[B_AT[..., 0], B_AT[..., 1]] = b_vals
    C = np.zeros((16, 8), np.float64)
    C[C_AT[..., 0], C_AT[..., 1]] = c
    D = (A @ B + C).astype(np.float32)
    return D[C_AT[..., 0], C_AT[..., 1]]


def _sim_mma(ns: dict, fmt: str, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """The simulator's mma: every lane writes its registers to the block's exchange arrays, the
    block waits, each lane computes its warp's product (warp_product) and keeps its four
    elements, and the block waits again before the arrays are reused."""
    cuda = ns["cuda"]              # the simulator's per-launch module (swapped into the kernel's globals)
    regs = cuda.shared.array((SIM_THREADS, 6), np.uint32)
    accs = cuda.shared.array((SIM_THREADS, 4), np.float32)
    t = cuda.threadIdx.x
    regs[t] = (a0, a1, a2, a3, b0, b1)
    accs[t] = (c0, c1, c2, c3)
    cuda.syncthreads()
    w = t - t % 32
    d = warp_product(regs[w:w + 32, :4], regs[w:w + 32, 4:], accs[w:w + 32], fmt)[t % 32]
    cuda.syncthreads()
    return np.float32(d[0]), np.float32(d[1]), np.float32(d[2]), np.float32(d[3])


def _sim_pack(fmt: str, lo, hi):
    bits = bits16(np.array([lo, hi], np.float32), fmt).astype(np.uint32)
    return np.uint32(bits[0] | (bits[1] << 16))


def _sim_half(fmt: str, which: int, w):
    return np.float32(_halves(np.uint32(w), fmt)[which])


def simulated(ns: dict) -> dict:
    """The twins, bound to the kernel namespace `ns` (whose `cuda` the simulator swaps per launch)."""
    out = {}
    for fmt in FORMATS.values():
        out[f"mma_{fmt}"] = lambda *args, fmt=fmt: _sim_mma(ns, fmt, *args)
        out[f"pack_{fmt}x2"] = lambda lo, hi, fmt=fmt: _sim_pack(fmt, lo, hi)
        out[f"{fmt}_lo"] = lambda w, fmt=fmt: _sim_half(fmt, 0, w)
        out[f"{fmt}_hi"] = lambda w, fmt=fmt: _sim_half(fmt, 1, w)
    return out


# -- the GPU intrinsics -----------------------------------------------------------------------

def intrinsics() -> dict:
    """The Numba CUDA intrinsics (built on first use: numba.cuda must be the real target)."""
    global _INTRINSICS
    if _INTRINSICS is None:
        _INTRINSICS = _build_intrinsics()
    return _INTRINSICS


_INTRINSICS = None


def _build_intrinsics() -> dict:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    f32, i32 = ir.FloatType(), ir.IntType(32)

    def mma(ptx_type):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
        out = ir.LiteralStructType([f32] * 4)

        @intrinsic
        def mma_intrinsic(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6), *([types.float32] * 4))

            def codegen(context, builder, signature, args):
                asm = ir.InlineAsm(ir.FunctionType(out, [i32] * 6 + [f32] * 4), text,
                                   "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
                # convergent: every lane of the warp executes it together (.sync.aligned), so LLVM
                # must not move it into a branch (clang marks CUDA inline asm so too)
                result = builder.call(asm, list(args), attrs=("convergent",))
                values = [builder.extract_value(result, i) for i in range(4)]
                return context.make_tuple(builder, signature.return_type, values)
            return sig, codegen
        return mma_intrinsic

    def pack(ptx_type):
        @intrinsic
        def pack_intrinsic(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, signature, args):
                # cvt packs its first source into the upper half: (hi, lo)
                asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]), f"cvt.rn.{ptx_type}x2.f32 $0, $1, $2;", "=r,f,f")
                return builder.call(asm, [args[1], args[0]])
            return sig, codegen
        return pack_intrinsic

    def half(fmt, which):
        @intrinsic
        def half_intrinsic(typingctx, w):
            sig = types.float32(types.uint32)

            def codegen(context, builder, signature, args):
                (word,) = args
                if fmt == "bf16":    # a bf16 is the upper 16 bits of the float32 of the same value
                    bits = builder.shl(word, i32(16)) if which == 0 else builder.and_(word, i32(0xFFFF0000))
                    return builder.bitcast(bits, f32)
                # cvt.f32.f16 without .ftz: LLVM's fpext under the kernels' fastmath flushes fp16
                # subnormals (below 2^-14) to zero, which the error bound does not allow
                half_reg = "lo" if which == 0 else "hi"
                asm = ir.InlineAsm(ir.FunctionType(f32, [i32]), "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
                                   f"cvt.f32.f16 $0, {half_reg}; }}", "=f,r")
                return builder.call(asm, [word])
            return sig, codegen
        return half_intrinsic

    out = {}
    for fmt in FORMATS.values():
        out[f"mma_{fmt}"] = mma(fmt)
        out[f"pack_{fmt}x2"] = pack(fmt)
        out[f"{fmt}_lo"] = half(fmt, 0)
        out[f"{fmt}_hi"] = half(fmt, 1)
    return out


def namespace_entries(ns: dict, simulator: bool) -> dict:
    """What kernel.namespace adds to a kernel's globals: the twins in the simulator, else the intrinsics."""
    return simulated(ns) if simulator else intrinsics()
