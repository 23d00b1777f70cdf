"""Gemm and MatMul: one matrix-multiply kernel generator for both (and for 1x1 convs).

    out[b, m, n] = alpha * sum_k A[b, m, k] * B[b, k, n]  (+ beta * C[b, m, n])

Every operand is read through element strides (batch dims, rows, cols), so
transposes, 1-D operands, batch broadcasting and group offsets are only
strides; nothing is copied at run time. Two loop shapes:

- axpy (the default): a block of RB output rows is accumulated in place,
  KB values of k at a time: `out[m, n] += a[m, k0]*B[k0, n] + ... + a[m, k0+KB-1]*B[k0+KB-1, n]`
  with the inner loop unit-stride over n, so LLVM vectorises it and each
  output element is loaded and stored once per KB products. A constant B is
  packed at build time as row-major [K, N] with alpha folded in.
- dot: when B is contiguous along k but not along n (B^T stored, or N == 1)
  and A is contiguous along k, each output is a dot product over k, four
  columns at a time, reduced in vector registers.

The work range runs over (batch, n-block, row-block) items: with M == 1
(GEMV) the N dimension is split in blocks so threads have something to share.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuvil.errors import UnsupportedOpError

from .kernel import (Kernel, KernelCall, Lowered, Source, broadcast_strides, dims_strides, kernel_header,
                     literal)

ROW_BLOCK = 4      # output rows accumulated together (share each B load)
K_BLOCK = 4        # k values fused in one pass over an output row (RB * KB scalars of A live in registers)
K_BLOCK_GEMV = 8   # with a single row, fuse more k per pass: fewer loads/stores of the output
N_BLOCK_GEMV = 256  # with a single row, the work range splits N in blocks of this size
N_TILE = 1024      # wider rows are split in tiles that keep the output block and B panel in cache
DOT_COLS = 4       # output columns reduced together in the dot form


@dataclass(frozen=True)
class Operand:
    """How a kernel reads a matrix: element strides along the batch dims, rows and cols."""
    batch: tuple
    rows: int
    cols: int


def _term(var, stride):
    if stride == 0 or var == "0":
        return None
    return var if stride == 1 else f"{var}*{stride}"


def _sum(*terms) -> str:
    """`a + b + ...` skipping None/zero terms; '0' when empty."""
    kept = [str(t) for t in terms if t is not None and t != 0 and t != "0"]
    return " + ".join(kept) if kept else "0"


def _ceil_div(a, b):
    return -(-a // b)


def _decode_batch(src: Source, var: str, batch_shape, operands: dict[str, tuple]) -> dict[str, str]:
    """Emit `<name>_off` = the batch offset of each operand for flat batch index `var`."""
    offs = {name: [] for name in operands}
    rest = var
    dims = list(batch_shape)
    for d in range(len(dims) - 1, -1, -1):
        size = dims[d]
        if size == 1:
            continue
        index = f"bi{d}"
        outer = all(dims[e] == 1 for e in range(d))
        if outer:
            src.line(f"{index} = {rest}")
        else:
            src.line(f"{index} = {rest} % {size}")
            src.line(f"bq{d} = {rest} // {size}")
            rest = f"bq{d}"
        for name, strides in operands.items():
            offs[name].append(_term(index, strides[d]))
    names = {}
    for name in operands:
        expr = _sum(*offs[name])
        src.line(f"{name}_off = {expr}")
        names[name] = f"{name}_off"
    return names


def gemm_kernel(family: str, dtype, M: int, N: int, K: int, batch_shape, a: Operand, b: Operand,
                c: Operand | None, out: Operand, alpha: float = 1.0, beta: float = 1.0) -> tuple[Kernel, int]:
    """A kernel `kernel(A, B, [C,] out, begin, end)` computing out = alpha*A@B (+ beta*C), batched.

    `out.cols` must be 1 (each output row is contiguous). Returns the kernel and its work size."""
    assert out.cols == 1
    dtype = np.dtype(dtype)
    batch_shape = tuple(int(d) for d in batch_shape)
    n_batch = int(np.prod(batch_shape, dtype=np.int64)) if batch_shape else 1
    dot = a.cols == 1 and b.rows == 1 and (b.cols != 1 or N == 1) and K > 1
    src = Source().line(kernel_header(4 if c is not None else 3)).indent()
    pa, pb, pc, po = "p0", "p1", "p2", ("p3" if c is not None else "p2")
    if dot:
        rb, n_block = 1, (min(N, N_BLOCK_GEMV) if M == 1 else N)
    else:
        rb = ROW_BLOCK if M >= ROW_BLOCK else M
        if M == 1:
            n_block = min(N, N_BLOCK_GEMV)
        else:
            tiles = _ceil_div(N, N_TILE)
            n_block = N if tiles == 1 else _ceil_div(_ceil_div(N, tiles), 16) * 16
    row_blocks = _ceil_div(M, rb)
    n_blocks = _ceil_div(N, n_block)
    work = n_batch * n_blocks * row_blocks

    # Decode the item: ((batch * n_blocks) + nb) * row_blocks + blk.
    src.line("for item in range(begin, end):").indent()
    rest = "item"
    if row_blocks > 1:
        src.line(f"blk = item % {row_blocks}")
        if n_blocks * n_batch > 1:
            src.line(f"rest = item // {row_blocks}")
        rest = "rest"
    else:
        src.line("blk = 0")
    if n_blocks > 1:
        src.line(f"nb = {rest} % {n_blocks}" if n_batch > 1 else f"nb = {rest}")
        if n_batch > 1:
            src.line(f"rest = {rest} // {n_blocks}")
            rest = "rest"
        src.line(f"n_lo = nb * {n_block}")
        src.line(f"n_hi = min(n_lo + {n_block}, {N})")
    else:
        src.line("n_lo = 0")
        src.line(f"n_hi = {N}")
    if n_batch > 1:
        operands = {"a": a.batch, "b": b.batch, "o": out.batch}
        if c is not None:
            operands["c"] = c.batch
        off = _decode_batch(src, rest, batch_shape, operands)
    else:
        off = {"a": "0", "b": "0", "o": "0", "c": "0"}

    F = lambda v: literal(v, dtype)
    scale_a = "" if alpha == 1.0 else f" * {F(alpha)}"
    scale_c = "" if beta == 1.0 else f" * {F(beta)}"

    def c_value(row_var, col_var):
        return f"{pc}[{_sum(off['c'], _term(row_var, c.rows), _term(col_var, c.cols))}]{scale_c}"

    if dot:
        _dot_body(src, pa, pb, po, K, a, b, c, out, off, F, alpha, c_value)
    else:
        full = M // rb
        if full == row_blocks:
            _axpy_body(src, rb, K, pa, pb, po, a, b, c, out, off, scale_a, c_value, M)
        else:
            src.line(f"if blk < {full}:").indent()
            _axpy_body(src, rb, K, pa, pb, po, a, b, c, out, off, scale_a, c_value, M)
            src.dedent().line("else:").indent()
            _axpy_body(src, M % rb, K, pa, pb, po, a, b, c, out, off, scale_a, c_value, M)
            src.dedent()
    types = [dtype.name] * (4 if c is not None else 3)
    return Kernel(family, src.text(), tuple(types)), work


def _axpy_body(src, rows, K, pa, pb, po, a, b, c, out, off, scale_a, c_value, M):
    """Rows m0..m0+rows-1 of the output (m0 = blk*ROW_BLOCK), columns [n_lo, n_hi)."""
    kb = K_BLOCK_GEMV if M == 1 else K_BLOCK
    kb = min(kb, K)
    src.line(f"m0 = blk * {ROW_BLOCK}" if M > rows or M >= ROW_BLOCK else "m0 = 0")
    for r in range(rows):
        src.line(f"o{r} = {_sum(off['o'], _term(f'(m0 + {r})' if r else 'm0', out.rows))}")
    # Initialise with C (or zero).
    src.line("for n in range(n_lo, n_hi):").indent()
    for r in range(rows):
        value = c_value(f"(m0 + {r})" if r else "m0", "n") if c is not None else "0"
        src.line(f"{po}[o{r} + n] = {value}")
    src.dedent()

    def block(k0_expr, nk):
        for r in range(rows):
            row = f"(m0 + {r})" if r else "m0"
            for j in range(nk):
                k = f"({k0_expr} + {j})" if j else k0_expr
                src.line(f"a{r}_{j} = {pa}[{_sum(off['a'], _term(row, a.rows), _term(k, a.cols))}]{scale_a}")
        src.line(f"bb = {_sum(off['b'], _term(k0_expr, b.rows))}")
        src.line("for n in range(n_lo, n_hi):").indent()
        for j in range(nk):
            src.line(f"b{j} = {pb}[{_sum('bb', j * b.rows, _term('n', b.cols))}]")
        for r in range(rows):
            terms = " + ".join(f"a{r}_{j} * b{j}" for j in range(nk))
            src.line(f"{po}[o{r} + n] += {terms}")
        src.dedent()

    full = K // kb
    if full == 1:
        block("0", kb)
    elif full > 1:
        src.line(f"for kb in range({full}):").indent()
        src.line(f"k0 = kb * {kb}")
        block("k0", kb)
        src.dedent()
    if K % kb:
        block(str(full * kb), K % kb)


def _dot_body(src, pa, pb, po, K, a, b, c, out, off, F, alpha, c_value):
    """One output row (m = blk) x columns [n_lo, n_hi): dot products over k, DOT_COLS columns at a time."""
    src.line(f"arow = {_sum(off['a'], _term('blk', a.rows))}")
    src.line(f"orow = {_sum(off['o'], _term('blk', out.rows))}")
    scale = "" if alpha == 1.0 else f" * {F(alpha)}"

    def finish(col, acc):
        value = f"{acc}{scale}"
        if c is not None:
            value = f"{value} + {c_value('blk', col)}"
        src.line(f"{po}[orow + {col}] = {value}")

    src.line("n = n_lo")
    src.line(f"while n + {DOT_COLS} <= n_hi:").indent()
    for j in range(DOT_COLS):
        src.line(f"bcol{j} = {_sum(off['b'], _term(f'(n + {j})' if j else 'n', b.cols))}")
        src.line(f"acc{j} = {F(0)}")
    src.line(f"for k in range({K}):").indent()
    src.line(f"av = {pa}[arow + k]")
    for j in range(DOT_COLS):
        src.line(f"acc{j} += av * {pb}[bcol{j} + k]")
    src.dedent()
    for j in range(DOT_COLS):
        finish(f"(n + {j})" if j else "n", f"acc{j}")
    src.line(f"n += {DOT_COLS}")
    src.dedent()
    src.line("while n < n_hi:").indent()
    src.line(f"bcol = {_sum(off['b'], _term('n', b.cols))}")
    src.line(f"acc = {F(0)}")
    src.line(f"for k in range({K}):").indent()
    src.line(f"acc += {pa}[arow + k] * {pb}[bcol + k]")
    src.dedent()
    finish("n", "acc")
    src.line("n += 1")
    src.dedent()


def _unsupported(node, why):
    return UnsupportedOpError(f"node '{node.name}' ({node.op}): {why}")


def _float_dtype(node, value):
    dtype = np.dtype(value.dtype)
    if dtype.kind != "f":
        raise _unsupported(node, f"{dtype.name} inputs are not supported (float only)")
    return dtype


def lower_gemm(node, graph) -> Lowered:
    """Y = alpha * A' @ B' + beta * C, A' = A^T if transA, B' = B^T if transB; C broadcasts to (M, N)."""
    A = graph.values[node.inputs[0]]
    B = graph.values[node.inputs[1]]
    C = graph.values[node.inputs[2]] if len(node.inputs) > 2 and node.inputs[2] else None
    Y = graph.values[node.outputs[0]]
    dtype = _float_dtype(node, Y)
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    trans_a, trans_b = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    M, N = Y.shape
    K = A.shape[0] if trans_a else A.shape[1]
    a = Operand((), 1, M) if trans_a else Operand((), K, 1)
    args: list = [A.name]
    if B.is_const:
        packed = np.asarray(B.data.T if trans_b else B.data, dtype=np.float64) * alpha
        args.append(np.ascontiguousarray(packed.astype(dtype)))
        b, alpha_left = Operand((), N, 1), 1.0
    else:
        args.append(B.name)
        b, alpha_left = (Operand((), 1, K) if trans_b else Operand((), N, 1)), alpha
    c_op = None
    if C is not None and beta != 0.0 and C.size:
        if C.is_const:
            # Pre-scaled by beta; the kernel reads it through broadcast strides, so it keeps its own shape.
            c_data = np.asarray(C.data, dtype=np.float64) * beta
            args.append(np.ascontiguousarray(c_data.astype(dtype)))
            strides = broadcast_strides(c_data.shape, (M, N))
            c_op, beta_left = Operand((), strides[0], strides[1]), 1.0
        else:
            args.append(C.name)
            strides = broadcast_strides(C.shape, (M, N))
            c_op, beta_left = Operand((), strides[0], strides[1]), beta
    else:
        beta_left = 1.0
    args.append(Y.name)
    kernel, work = gemm_kernel("Gemm", dtype, M, N, K, (), a, b, c_op, Operand((), N, 1), alpha_left, beta_left)
    return Lowered([KernelCall(kernel, args, work, node.name)])


def lower_matmul(node, graph) -> Lowered:
    """numpy matmul: 1-D operands are promoted (and the added dim dropped), leading dims broadcast."""
    A = graph.values[node.inputs[0]]
    B = graph.values[node.inputs[1]]
    Y = graph.values[node.outputs[0]]
    dtype = _float_dtype(node, Y)
    a_shape = (1,) + tuple(A.shape) if len(A.shape) == 1 else tuple(A.shape)
    b_shape = tuple(B.shape) + (1,) if len(B.shape) == 1 else tuple(B.shape)
    M, K = a_shape[-2:]
    N = b_shape[-1]
    batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    if batch and all(d == 1 for d in b_shape[:-2]) and tuple(a_shape[:-2]) == batch:
        # B is shared by every batch and A is contiguous: one GEMM with the batch dims folded into M.
        M, batch = M * int(np.prod(batch)), ()
    a_batch = tuple(broadcast_strides(a_shape[:-2], batch)) if batch else ()
    b_batch = tuple(broadcast_strides(b_shape[:-2], batch)) if batch else ()
    a_batch = tuple(s * M * K for s in a_batch)
    b_batch = tuple(s * K * N for s in b_batch)
    o_batch = tuple(s * M * N for s in dims_strides(batch)) if batch else ()
    kernel, work = gemm_kernel("MatMul", dtype, M, N, K, batch, Operand(a_batch, K, 1), Operand(b_batch, N, 1),
                               None, Operand(o_batch, N, 1))
    return Lowered([KernelCall(kernel, [A.name, B.name, Y.name], work, node.name)])
