"""The matrix products of LSTM, GRU and RNN on vector micro-kernels, for float32
nodes whose weights are constants (rnn.py falls back to its dot-product loops
otherwise).

A recurrent step is a matrix-vector product h . R^T over the G*H gate rows of R
(for LSTM with H=128: 256 KB of R per step, streamed from L2). Rather than dot
products of h with rows of R (reduced across lanes), the broadcast form reads
R^T, with no horizontal sums:

    pre[g0:g0+64] += sum_k h[k] * RT[k, g0:g0+64]

with four 16-float accumulators per batch row held in registers across the
k loop (`gemv<mr>` below, up to 6 batch rows sharing each load of R). R is
packed at build time into panels of 64 gate rows, each panel k-major and
contiguous ([panel, k, 64]: what `pack_b_panels` gives for R^T), so a step
reads R as one sequential stream. The input projection x . W^T + b of every
step is a small GEMM on ukernel.py's micro-kernel (6 input rows per tile),
with W^T packed the same way.

Measured (LSTM 64->128, 2 layers, 32 steps, batch 1, one core): a step's
h . R^T runs at ~1.5 us, close to the time L2 takes to deliver 256 KB
(~1.36 us at the ~190 GB/s one core reads from L2), so the recurrences
(~95 us of the model's ~135 us) are bound by R's bytes, not by arithmetic.
"""
from __future__ import annotations

import numpy as np

from .kernel import Source

NR = 64        # gate rows per panel (4 zmm vectors on AVX-512)
MR = 6         # input rows / batch rows per micro-tile (6 x 64: 24 accumulators)
KC = 256       # k values per micro-kernel call of the projection (the W micro-panel stays in L1/L2)


def panels(matrix: np.ndarray) -> np.ndarray:
    """[rows, K] (gate rows of W or R) -> flat [ceil(rows/NR), K, NR] panels of its transpose,
    zero padded: the layout the micro-kernel reads B in."""
    from .gemm import pack_b_panels
    return pack_b_panels(np.ascontiguousarray(np.asarray(matrix, np.float32).T), NR).reshape(-1)


def n_panels(rows: int) -> int:
    return -(-rows // NR)


class MicroKernels:
    """The micro-kernels a kernel calls (one per tile height), declared at module level."""

    def __init__(self):
        self.specs = {}

    def name(self, mr: int) -> str:
        from backends.native.ukernel import UKSpec
        if mr not in self.specs:
            self.specs[mr] = (f"uk{mr}", UKSpec(mr=mr, nr=NR, a_packed=0))
        return self.specs[mr][0]

    def header(self) -> Source:
        head = Source()
        for mr in sorted(self.specs):
            name, spec = self.specs[mr]
            for line in spec.declaration(name).splitlines():
                head.line(line)
        return head

    def call(self, src: Source, mr, a, aoff, lda, b, boff, c, coff, ldc, kc, mask, loadc):
        """C[mr rows, 64] (+)= A[mr rows, kc] . B[kc, 64]: a source line (mr a literal int)."""
        src.line(f"{self.name(mr)}({a}, {aoff}, {lda}, {b}, {boff}, {NR}, {c}, {coff}, {ldc}, {kc}, {mask}, {loadc})")

    def rows(self, src: Source, M: int, a, abase, lda, b, boff, c, cbase, ldc, kc, mask, loadc):
        """All M rows (a compile-time count) in tiles of MR rows, then the remainder."""
        full = M // MR
        if full:
            src.line(f"for m in range(0, {full * MR}, {MR}):").indent()
            self.call(src, MR, a, f"{abase} + m*{lda}", lda, b, boff, c, f"{cbase} + m*{ldc}", ldc, kc, mask, loadc)
            src.dedent()
        if M % MR:
            m = full * MR
            self.call(src, M % MR, a, f"{abase} + {m * lda}", lda, b, boff, c, f"{cbase} + {m * ldc}", ldc, kc,
                      mask, loadc)


# -- the recurrent product: a micro-kernel without software prefetches ------------------------------
#
# ukernel.py's micro-kernels prefetch B 8 rows ahead (weights streamed from L3/DRAM need it). A
# step's R (256 KB for H=128) comes from L2 as one sequential stream that the hardware prefetchers
# follow; there the 4 prefetches per k only compete with the 4 loads and 4 FMAs for the load ports
# (measured in a C loop of the same shape: 1.60 against 1.47 us per step of h . R^T, H=128, 4H=512). So the recurrence calls
# `gemv<mr>`: Numba intrinsics that expand, inline, to the same K loop with four 16-float
# accumulators per row carried in phi nodes, and nothing else.

def _gemv_ir(builder, mr, a, aoff, lda, b, boff, c, coff, ldc, kc, nvalid, loadc):
    """C[i, 0:64] = (loadc ? C[i, 0:64] : 0) + sum_k a[aoff + i*lda + k] * b[boff + k*64 + 0:64] for
    i < mr; the columns >= nvalid of C are neither read nor written (B is zero padded there)."""
    from llvmlite import ir
    f32, i64, i1 = ir.FloatType(), ir.IntType(64), ir.IntType(1)
    L, V = 16, NR // 16
    vt, mt = ir.VectorType(f32, L), ir.VectorType(i1, L)
    module = builder.module

    def intrinsic_fn(name, ret, args):
        fn = module.globals.get(name)
        if fn is None:
            fn = ir.Function(module, ir.FunctionType(ret, args), name=name)
        return fn
    ptr_t = c.type
    fma = intrinsic_fn("llvm.fma.v16f32", vt, [vt, vt, vt])
    mload = intrinsic_fn("llvm.masked.load.v16f32.p0", vt, [ptr_t, ir.IntType(32), mt, vt])
    mstore = intrinsic_fn("llvm.masked.store.v16f32.p0", ir.VoidType(), [vt, ptr_t, ir.IntType(32), mt])
    zero = ir.Constant(vt, [0.0] * L)
    align = ir.Constant(ir.IntType(32), 4)
    # Lane masks: column 16*v + lane < nvalid.
    splat_n = builder.insert_element(ir.Constant(ir.VectorType(i64, L), None), nvalid, ir.Constant(ir.IntType(32), 0))
    splat_n = builder.shuffle_vector(splat_n, ir.Constant(ir.VectorType(i64, L), None),
                                     ir.Constant(ir.VectorType(ir.IntType(32), L), [0] * L))
    masks = [builder.icmp_signed("<", ir.Constant(ir.VectorType(i64, L), [16 * v + j for j in range(L)]), splat_n)
             for v in range(V)]
    use_c = builder.icmp_signed("!=", loadc, ir.Constant(i64, 0))
    crows = [builder.gep(c, [builder.add(coff, builder.mul(ldc, ir.Constant(i64, i)))]) for i in range(mr)]
    arows = [builder.gep(a, [builder.add(aoff, builder.mul(lda, ir.Constant(i64, i)))]) for i in range(mr)]
    bbase = builder.gep(b, [boff])
    init = {}
    for i in range(mr):
        for v in range(V):
            p = builder.gep(crows[i], [ir.Constant(i64, 16 * v)])
            loaded = builder.call(mload, [builder.bitcast(p, ptr_t), align, masks[v], zero])
            init[i, v] = builder.select(use_c, loaded, zero)
    pre = builder.block
    loop = builder.append_basic_block("rnn_gemv_loop")
    done = builder.append_basic_block("rnn_gemv_done")
    has_k = builder.icmp_signed(">", kc, ir.Constant(i64, 0))
    builder.cbranch(has_k, loop, done)
    builder.position_at_end(loop)
    k = builder.phi(i64)
    k.add_incoming(ir.Constant(i64, 0), pre)
    accs = {}
    for key, value in init.items():
        accs[key] = builder.phi(vt)
        accs[key].add_incoming(value, pre)
    brow = builder.gep(bbase, [builder.mul(k, ir.Constant(i64, NR))])
    bvec = []
    for v in range(V):
        p = builder.bitcast(builder.gep(brow, [ir.Constant(i64, 16 * v)]), ir.PointerType(vt))
        load = builder.load(p)
        load.align = 4
        bvec.append(load)
    new = {}
    for i in range(mr):
        s = builder.load(builder.gep(arows[i], [k]))
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(vt, None), s, ir.Constant(ir.IntType(32), 0)),
                                       ir.Constant(vt, None), ir.Constant(ir.VectorType(ir.IntType(32), L), [0] * L))
        for v in range(V):
            new[i, v] = builder.call(fma, [splat, bvec[v], accs[i, v]])
    k_next = builder.add(k, ir.Constant(i64, 1))
    k.add_incoming(k_next, loop)
    for key in accs:
        accs[key].add_incoming(new[key], loop)
    builder.cbranch(builder.icmp_signed("<", k_next, kc), loop, done)
    builder.position_at_end(done)
    final = {}
    for key in init:   # the phis first: a block starts with all of them
        final[key] = builder.phi(vt)
        final[key].add_incoming(init[key], pre)
        final[key].add_incoming(new[key], loop)
    for (i, v), value in final.items():
        p = builder.gep(crows[i], [ir.Constant(i64, 16 * v)])
        builder.call(mstore, [value, builder.bitcast(p, ptr_t), align, masks[v]])


def _make_gemv(mr):
    from numba.core import types
    from numba.core.extending import intrinsic

    @intrinsic
    def gemv(typingctx, a, aoff, lda, b, boff, c, coff, ldc, kc, nvalid, loadc):
        if not all(isinstance(p, types.CPointer) and p.dtype == types.float32 for p in (a, b, c)):
            return None
        ints = (aoff, lda, boff, coff, ldc, kc, nvalid, loadc)
        if not all(isinstance(x, types.Integer) for x in ints):
            return None
        sig = types.void(a, aoff, lda, b, boff, c, coff, ldc, kc, nvalid, loadc)

        def codegen(context, builder, signature, args):
            from llvmlite import ir
            a_, aoff_, lda_, b_, boff_, c_, coff_, ldc_, kc_, nvalid_, loadc_ = [
                builder.sext(x, ir.IntType(64)) if isinstance(x.type, ir.IntType) and x.type.width < 64 else x
                for x in args]
            _gemv_ir(builder, mr, a_, aoff_, lda_, b_, boff_, c_, coff_, ldc_, kc_, nvalid_, loadc_)
            return context.get_dummy_value()
        return sig, codegen
    return gemv


for _mr in range(1, MR + 1):
    globals()[f"gemv{_mr}"] = _make_gemv(_mr)


def _version() -> str:
    import hashlib
    import inspect
    text = inspect.getsource(_gemv_ir) + inspect.getsource(_make_gemv)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


GEMV_VERSION = _version()


class Gemv:
    """The `gemv<mr>` intrinsics a recurrence kernel calls (imported at module level; the comment
    carries a hash of the code that expands them, so the kernel's cache key follows it)."""

    def __init__(self):
        self.used = set()

    def header(self) -> Source:
        head = Source()
        if self.used:
            head.line(f"# rnn_uk gemv {GEMV_VERSION}")
            head.line(f"from backends.numba_cpu.rnn_uk import {', '.join(f'gemv{m}' for m in sorted(self.used))}")
        return head

    def tiles(self, src: Source, count_var, a, aoff, lda, b, boff, c, coff, ldc, kc, nvalid, loadc, counts):
        counts = sorted(set(counts), reverse=True)
        for i, n in enumerate(counts):
            self.used.add(n)
            line = f"gemv{n}({a}, {aoff}, {lda}, {b}, {boff}, {c}, {coff}, {ldc}, {kc}, {nvalid}, {loadc})"
            if len(counts) == 1:
                src.line(line)
                continue
            kw = "if" if i == 0 else ("elif" if i < len(counts) - 1 else "else")
            src.line(f"{kw} {count_var} == {n}:" if kw != "else" else "else:").indent().line(line).dedent()
