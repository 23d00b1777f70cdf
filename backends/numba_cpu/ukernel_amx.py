"""The AMX-BF16 micro-kernel of LowpUKSpec (method "amx"; Intel Sapphire Rapids and later).

NEVER RUN ON HARDWARE: the machines this was written on have no AMX; the tests only check that the
IR assembles for `sapphirerapids` and that the object holds `ldtilecfg`, `tileloadd` and
`tdpbf16ps`.

    C[i, j] (+)= sum_k A(i, k) B(k, j)     i < mr (16 or 32), j < nr (16 or 32), kc % 16 == 0

A tile is 16 rows of 64 bytes. With A in rows (a_packed=0: a[aoff + i*lda + k], bf16) a tile
of A is 16 rows x 32 k, read with stride lda; with B in the VNNI pair layout of ukernel_lowp.py
(b[boff + kp*ldb + 2j + h]) a tile of B is 16 k pairs x 16 columns, read with stride ldb; a C tile
is 16 x 16 floats. (mr/16) x (nr/16) C tiles stay in tile registers across the k loop (phis of
x86_amx), each step loading mr/16 A tiles and nr/16 B tiles (8 tiles at most). C passes through a
scratch tile on the stack: loaded from C (masked) when accumulating, stored there after the loop,
then read back by vectors for the epilogue and the masked stores, as the other methods store.

LLVM's AMX passes write the tile configuration (`ldtilecfg`) from the shapes of the `.internal`
intrinsics. Linux gives a process AMX state only after
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` (request_amx_permission below); without it
the first tile instruction raises SIGILL. A library's driver must make that call once before a
kernel runs.
"""
from __future__ import annotations

import ctypes

from .lowp import column_masks
from .ukernel import ARG_TYPES, LOADC_ACCUMULATE, LOADC_EPILOGUE, IRBuilder, row_epilogue

TILE_ROWS = 16          # rows of a tile
TILE_BYTES = 64         # bytes of a tile row
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158    # x86-64


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile state for this process; False where the CPU or kernel has none."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def amx_ir(spec) -> str:
    """The module of one function named spec.name (see the module docstring)."""
    mr, nr = spec.mr, spec.nr
    row_tiles, col_tiles = mr // TILE_ROWS, nr // 16
    V = nr // 16
    vt, mt = "<16 x float>", "<16 x i1>"
    ir = IRBuilder()
    ir.label("entry")
    ir(f"%scratch = alloca [{mr * nr} x float], align 64")
    ir(f"%accw = and i64 %loadc, {LOADC_ACCUMULATE}")
    ir("%acc = icmp ne i64 %accw, 0")
    ir(f"%epiw = and i64 %loadc, {LOADC_EPILOGUE}")
    ir("%epi = icmp ne i64 %epiw, 0")
    masks = column_masks(ir, V, 16)
    ir("%cbase = getelementptr float, ptr %c, i64 %coff")
    ir("%abase = getelementptr i16, ptr %a, i64 %aoff")
    ir("%bbase = getelementptr i16, ptr %b, i64 %boff")
    ir("%astride = mul i64 %lda, 2")
    ir("%bstride = mul i64 %ldb, 2")
    ir(f"%blocks = sdiv i64 %kc, {TILE_ROWS}")

    def c_vector(i, v):
        p = ir.tmp("cp")
        ir(f"{p} = getelementptr float, ptr %cbase, i64 {v * 16}")
        q = ir.tmp("cp")
        row = ir.tmp("cr")
        ir(f"{row} = mul i64 %ldc, {i}")
        ir(f"{q} = getelementptr float, ptr {p}, i64 {row}")
        return q

    def scratch_vector(i, v):
        p = ir.tmp("sp")
        ir(f"{p} = getelementptr float, ptr %scratch, i64 {i * nr + v * 16}")
        return p

    ir("br i1 %acc, label %load_c, label %zero_c")
    ir.label("load_c")
    for i in range(mr):
        for v in range(V):
            x = ir.tmp("c")
            ir(f"{x} = call {vt} @llvm.masked.load.v16f32.p0(ptr align 4 {c_vector(i, v)}, {mt} {masks[v]}, "
               f"{vt} zeroinitializer)")
            ir(f"store {vt} {x}, ptr {scratch_vector(i, v)}, align 64")
    ir("br label %tiles")
    ir.label("zero_c")
    ir(f"call void @llvm.memset.p0.i64(ptr align 64 %scratch, i8 0, i64 {4 * mr * nr}, i1 false)")
    ir("br label %tiles")
    ir.label("tiles")
    init = {}
    for r in range(row_tiles):
        for q in range(col_tiles):
            p = scratch_vector(r * TILE_ROWS, q)
            init[r, q] = ir.tmp("t")
            ir(f"{init[r, q]} = call x86_amx @llvm.x86.tileloadd64.internal(i16 {TILE_ROWS}, i16 {TILE_BYTES}, "
               f"ptr {p}, i64 {4 * nr})")
    ir("%any = icmp sgt i64 %blocks, 0")
    ir("br i1 %any, label %loop, label %after")
    ir.label("loop")
    ir("%kb = phi i64 [ 0, %tiles ], [ %kbn, %loop ]")
    for key in init:
        ir(f"%acc_{key[0]}_{key[1]} = phi x86_amx [ {init[key]}, %tiles ], [ %accn_{key[0]}_{key[1]}, %loop ]")
    def load_tile(base: str, row_step: str, row: str, column: str, stride: str) -> str:
        """The tile of 16 rows from element row * row_step + column of base (i16 elements)."""
        start = ir.tmp("tr")
        ir(f"{start} = mul i64 {row_step}, {row}")
        idx = ir.tmp("ti")
        ir(f"{idx} = add i64 {start}, {column}")
        p = ir.tmp("tp")
        ir(f"{p} = getelementptr i16, ptr {base}, i64 {idx}")
        tile = ir.tmp("tile")
        ir(f"{tile} = call x86_amx @llvm.x86.tileloadd64.internal(i16 {TILE_ROWS}, i16 {TILE_BYTES}, ptr {p}, "
           f"i64 {stride})")
        return tile

    ir(f"%kfirst = mul i64 %kb, {2 * TILE_ROWS}")   # A: k from kb*32
    ir(f"%pfirst = mul i64 %kb, {TILE_ROWS}")       # B: k pairs from kb*16
    a_tiles = {r: load_tile("%abase", "%lda", str(r * TILE_ROWS), "%kfirst", "%astride") for r in range(row_tiles)}
    b_tiles = {q: load_tile("%bbase", "%ldb", "%pfirst", str(2 * 16 * q), "%bstride") for q in range(col_tiles)}
    for (r, q) in init:
        ir(f"%accn_{r}_{q} = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 {TILE_ROWS}, i16 {TILE_BYTES}, "
           f"i16 {TILE_BYTES}, x86_amx %acc_{r}_{q}, x86_amx {a_tiles[r]}, x86_amx {b_tiles[q]})")
    ir("%kbn = add i64 %kb, 1")
    ir("%more = icmp slt i64 %kbn, %blocks")
    ir("br i1 %more, label %loop, label %after")
    ir.label("after")
    for (r, q) in init:
        ir(f"%final_{r}_{q} = phi x86_amx [ {init[r, q]}, %tiles ], [ %accn_{r}_{q}, %loop ]")
    for (r, q) in init:
        p = scratch_vector(r * TILE_ROWS, q)
        ir(f"call void @llvm.x86.tilestored64.internal(i16 {TILE_ROWS}, i16 {TILE_BYTES}, ptr {p}, i64 {4 * nr}, "
           f"x86_amx %final_{r}_{q})")
    vectors = {}
    for i in range(mr):
        for v in range(V):
            vectors[i, v] = ir.tmp("s")
            ir(f"{vectors[i, v]} = load {vt}, ptr {scratch_vector(i, v)}, align 64")
    if spec.bias or spec.act:
        vectors = row_epilogue(ir, spec, vectors, vt, 16)
    for (i, v), x in vectors.items():
        ir(f"call void @llvm.masked.store.v16f32.p0({vt} {x}, ptr align 4 {c_vector(i, v)}, {mt} {masks[v]})")
    ir("ret i32 0")
    args = ", ".join(f"ptr {'' if n == 'c' else 'noalias '}%{n}" if n in ("a", "b", "c", "bias") else f"i64 %{n}"
                     for n in ARG_TYPES)
    decls = ["declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)",
             "declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)",
             "declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)",
             "declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)",
             f"declare {vt} @llvm.masked.load.v16f32.p0(ptr, {mt}, {vt})",
             f"declare void @llvm.masked.store.v16f32.p0({vt}, ptr, {mt})",
             f"declare {vt} @llvm.maxnum.v16f32({vt}, {vt})",
             f"declare {vt} @llvm.minnum.v16f32({vt}, {vt})"]
    return (f"define i32 @{spec.name}({args}) #0 {{\n" + "\n".join(ir.lines) + "\n}\n\n" + "\n".join(decls)
            + "\n\nattributes #0 = { nounwind }\n")
