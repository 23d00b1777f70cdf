"""GEMM micro-kernels written directly as LLVM vector IR.

Numba's vectoriser does not keep a 6x64 tile of accumulators in registers (it
picks 256-bit vectors and spills), so the inner kernel of every GEMM and
convolution is generated here, as text IR, with explicit vector accumulators
carried around the K loop in phi nodes and `llvm.fma` on them:

    C[i, j] (+)= sum_k  A(i, k) * B(k, j)      i < mr, j < nr (nr <= 64)

- A(i, k) is a scalar broadcast: packed panels `a[aoff + k*P + i]` (weights packed
  at build time) or strided rows `a[aoff + i*lda + k]` (activations read in place).
- B(k, :) is `nr` contiguous floats: rows `b[boff + k*ldb + j]`, or, for convolutions
  over a padded input, taps: k = c*T + t reads `b[boff + c*ldb + off[t] + j]`
  with compile-time tap offsets `off` (the K loop runs over channels c).
- C rows are `c[coff + i*ldc + j]`; `mask` (i64) has bit j set for valid columns.
  `store` "m": masked positional stores; "x": compressed stores (the valid lanes are
  packed contiguously: a convolution's output over a padded grid whose
  columns beyond the output width are garbage). `loadc` != 0 accumulates onto
  C (masked / expanding loads), else C is overwritten.

The kernel source (Numba) calls a micro-kernel by name through an external
function declaration and carries its spec in a comment line
`# cuvil-ukernel <name> <json>`; `emit.py` generates the IR for the target
(vector width 16/8/4 floats; the tile is split in column chunks so the
accumulators fit the register file) and links it in.

Signature (every micro-kernel):
    i32 name(ptr a, i64 aoff, i64 lda, ptr b, i64 boff, i64 ldb,
             ptr c, i64 coff, i64 ldc, i64 kc, i64 mask, i64 loadc, ptr bias, i64 biasoff)
`loadc` bit 0: accumulate onto C; bit 1: the epilogue (spec.bias, spec.act) runs on the
accumulators before they are stored, so a conv's last pass writes its final values once.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import asdict, dataclass
from typing import ClassVar

from cuvil.ops import REGISTER_ACTIVATIONS

MAX_ACC = {16: 24, 8: 12, 4: 12}   # accumulator registers per chunk, by lanes (zmm: 32 regs, ymm/xmm: 16)
# AArch64 has 32 128-bit registers (v0-v31) where SSE and AVX2 have 16: 24 accumulators of 4 floats,
# with the B row's vectors of a chunk (4) and the A panel's rows (read 4 at a time, each used by
# lane: `fmla v.4s, v.4s, v.s[i]`) in the 8 left.
MAX_ACC_BY_ARCH = {"aarch64": {4: 24}}


def accumulator_budget(lanes: int, arch: str = "x86_64") -> int:
    """How many accumulator vectors of `lanes` floats a micro-kernel chunk keeps in registers on `arch`."""
    return MAX_ACC_BY_ARCH.get(arch, {}).get(lanes, MAX_ACC[lanes])

ARG_TYPES = ("a", "aoff", "lda", "b", "boff", "ldb", "c", "coff", "ldc", "kc", "mask", "loadc", "bias", "biasoff")
_PTR_ARGS = {"a", "b", "c", "bias"}
LOADC_ACCUMULATE = 1   # loadc bit: the tile starts from C (else from zero)
LOADC_EPILOGUE = 2     # loadc bit: add the bias and apply the activation before storing (the last pass)


class Declared:
    """Name, spec comment and Numba declaration of a micro-kernel spec (a frozen dataclass): the name
    is `_stem()` plus a hash of the fields; `_ARGS` is the signature after the i32 result, "p" a
    float pointer and "i" an i64."""
    _ARGS = ""

    def _stem(self) -> str:
        raise NotImplementedError

    @property
    def name(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True)
        return f"{self._stem()}_{hashlib.sha256(blob.encode()).hexdigest()[:12]}"

    def comment(self) -> str:
        return f"# cuvil-ukernel {self.name} {json.dumps(asdict(self), sort_keys=True)}"

    def declaration(self, var: str) -> str:
        p, i = "_uk_types.CPointer(_uk_types.float32)", "_uk_types.int64"
        sig = ", ".join(p if c == "p" else i for c in self._ARGS)
        return (f"{self.comment()}\nfrom numba import types as _uk_types\n"
                f"{var} = _uk_types.ExternalFunction({self.name!r}, _uk_types.int32({sig}))\n")


@dataclass(frozen=True)
class UKSpec(Declared):
    mr: int                 # rows of the tile
    nr: int                 # columns of the tile (floats, multiple of 16, <= 64)
    a_packed: int           # 1: a[aoff + k*P + i] with P = a_panel; 0: a[aoff + i*lda + k]
    a_panel: int = 0
    taps: tuple = ()        # () rows mode; else the compile-time tap offsets (K loop over channels)
    store: str = "m"        # "m" masked positional, "x" compress
    b_masked: int = 0       # 1: B loads are masked with `mask` (B rows may end at the last valid column)
    prefetch_b: int = 1     # 0: no software prefetch of B rows (B streams from L2, which the hardware follows);
                            # 1: PREFETCH_B_ROWS rows ahead; n > 1: n rows ahead (packed weights that stream
                            # from memory: gemm.STREAM_PREFETCH_B_ROWS)
    prefetch_c: int = 0     # 1: prefetch the C tile mr rows below (the next call's, when it accumulates onto
                            # C in memory: a residual the conv adds onto, not in cache)
    bias: int = 0           # 1: with the epilogue bit, row i gets bias[biasoff + i] added (bias must then be a
                            # valid pointer on every call)
    act: str = ""           # with the epilogue bit: "" | "Relu" | "Clip" (bounds act_lo, act_hi; inf: no bound)
    act_lo: float = 0.0
    act_hi: float = 0.0

    _ARGS: ClassVar[str] = "".join("p" if n in _PTR_ARGS else "i" for n in ARG_TYPES)

    def _stem(self) -> str:
        return f"cuvil_uk_{self.mr}x{self.nr}"


@dataclass(frozen=True)
class GatherSpec(Declared):
    """A strided row copy, dst[doff + j] = src[soff + j * stride] for j < n (the phase images of
    a strided conv). Numba's loop for it stays scalar (LLVM does not vectorise the strided
    loads); here each group of lanes is one wide load and a lane shuffle.

    Signature: i32 name(ptr src, i64 soff, ptr dst, i64 doff, i64 n)."""
    stride: int
    kind: str = "gather"
    _ARGS: ClassVar[str] = "pipii"

    def _stem(self) -> str:
        return f"cuvil_gather{self.stride}"


@dataclass(frozen=True)
class TBlockSpec(Declared):
    """A 16 x 16 block transpose, dst[doff + j*ldd + i] = src[soff + i*lds + j] for i, j < 16
    (a plane's NCHW <-> NHWC transpose, attention's K^T pack). Numba's loop for it is one
    scalar load and store per float (strided on one side); here the block is 16 row loads, a
    network of two-input lane shuffles (log2 L stages of L shuffles for L x L sub-blocks) and
    16 row stores. Rows and columns past a matrix's last whole block are the caller's.

    Signature: i32 name(ptr src, i64 soff, i64 lds, ptr dst, i64 doff, i64 ldd)."""
    kind: str = "tblock"
    _ARGS: ClassVar[str] = "piipii"

    def _stem(self) -> str:
        return "cuvil_tblock16"


TBLOCK = 16   # TBlockSpec's block side


@dataclass(frozen=True)
class DwLanesSpec(Declared):
    """One output row of a depthwise conv, 16 channels in the lanes (dwlanes.py: the kernel and this IR):

        y[yoff + ow*16 + c] = w[woff + T*16 + c] + sum_{kh, kw} w[woff + (kh*KW + kw)*16 + c]
                                                              * x[xoff + (kh*W + ow + kw - p_l)*16 + c]

    for ow < OW, c < 16, T = KH*KW taps, columns ow0 + ow + kw - p_l outside [0, W) left out
    (x and y point at the row's column ow0).

    Signature: i32 name(ptr x, i64 xoff, ptr w, i64 woff, ptr y, i64 yoff)."""
    W: int
    OW: int
    KH: int
    KW: int
    p_l: int
    ow0: int = 0            # the call's first output column (dwlanes.py splits a wide row in pieces)
    kind: str = "dwlanes"
    _ARGS: ClassVar[str] = "pipipi"

    def _stem(self) -> str:
        return "cuvil_dwlanes"


DWLANES = 16   # DwLanesSpec's channels per call


@dataclass(frozen=True)
class DwRowSpec(Declared):
    """One output row of one channel of a depthwise conv with the same stride s (1 or 2) along both axes:

        y[yoff + ow] = act(bias + sum_{kh, kw} w[woff + kh*KW + kw] * x[xoff + (r0 + kh)*W + s*ow + kw - p_l])

    (bias = w[woff + KH*KW]); input rows outside [0, H) and columns outside [0, W) count as zeros.
    Stride 2: each group of L outputs loads S = ceil(KW / 2) runs of 2L inputs and takes the taps'
    lanes by a shuffle (tap kw: lanes kw % 2, kw % 2 + 2, ... of run kw // 2): no phase images.
    Stride 1: one load of L inputs per tap; with `rows` = 2 the call also computes the next output
    row (input rows from r0 + 1, output at yoff + OW), and each input row loaded feeds both (KH + 1
    rows of loads for two output rows instead of 2 KH). Column masks are compile-time constants
    (the row width is), rows are checked at run time.

    Signature: i32 name(ptr x, i64 xoff, i64 r0, ptr w, i64 woff, ptr y, i64 yoff)."""
    H: int
    W: int
    OW: int
    KH: int
    KW: int
    p_l: int
    act: str = ""
    act_lo: float = 0.0
    act_hi: float = 0.0
    stride: int = 2
    rows: int = 1           # output rows per call (stride 1: 2 rows read KH + 1 input rows, not 2 KH)
    kind: str = "dwrow"
    _ARGS: ClassVar[str] = "piipipi"

    def _stem(self) -> str:
        return "cuvil_dwrow"


@dataclass(frozen=True)
class TSpec(Declared):
    """A transposed micro-kernel: output channels in the vector lanes, output positions broadcast,
    for convolutions whose planes are too small to fill vectors of positions (7x7):

        C[i, j] (+)= sum_{c < kc, t}  A[aoff + c*a_ks + taps[t] + i*a_is] * B[boff + (c*T + t)*nr + j]

    i < mr positions of one output row (their inputs broadcast; a_is > 1: the frames of a 1-D conv
    read in place, convim2col.py), j < nr output channels (weights
    packed at build time, nr floats per k, zero padded). Between passes over the input channels
    the tile lives in a scratch slot s[soff + i*nr + j] (plain vector loads and stores); the
    last pass scatters it into the NCHW output, C[i, j] at c[coff + i + j*c_cs], rows i < `rows`
    and columns j < `cols` only. A tile of the whole plane (c_cs = mr, rows = mr) is one contiguous
    run of C: it is stored as vectors, its lanes shuffled in registers (_dense_store).

    `flags` bit 0: start from the slot (else zero); bit 1: bias[biasoff + j] and the activation
    before the output store; bit 2: store to the output (else to the slot). Each k also
    prefetches `pf_lines` cache lines of B from b[boff + pfoff] on: the caller spreads the next
    pass's weights over the tiles of this one, so they stream from memory while the tiles compute.

    Signature: i32 name(ptr a, i64 aoff, ptr b, i64 boff, ptr s, i64 soff, ptr c, i64 coff,
                        i64 kc, i64 rows, i64 cols, i64 flags, ptr bias, i64 biasoff, i64 pfoff)."""
    mr: int
    nr: int
    taps: tuple
    a_ks: int
    c_cs: int
    pf_lines: int = 0
    bias: int = 0
    act: str = ""
    act_lo: float = 0.0
    act_hi: float = 0.0
    a_is: int = 1
    kind: str = "t"
    _ARGS: ClassVar[str] = "pipipipiiiiipii"

    def _stem(self) -> str:
        return f"cuvil_ukt_{self.mr}x{self.nr}"


@dataclass(frozen=True)
class SyncSpec(Declared):
    """An atomic operation on a 32-bit counter, for kernels whose work items cooperate (the halves
    of a recurrent step, see rnn.py): the counter is word `off` of a float32 buffer.

        op "claim": if counter == arg, set it to arg + 1 and return 1, else return 0 (compare-and-swap)
        op "add":   counter += arg, return 0
        op "wait":  return once counter >= arg (spin with `pause`, yielding the core after a while)
        op "adopt": wait up to arg time-stamp-counter ticks for the counter to leave 0, then claim it
                    as "claim" from 0 does (a flag another thread is about to set gets its chance)

    All sequentially consistent: stores before an "add" are visible to a thread whose "wait" it
    ends. Signature: i32 name(ptr p, i64 off, i64 arg)."""
    op: str
    kind: str = "sync"
    _ARGS: ClassVar[str] = "pii"

    def _stem(self) -> str:
        return f"cuvil_sync_{self.op}"


TSTORE_OUTPUT = 4   # TSpec flags bit: the tile goes to the output (else to its scratch slot)


_COMMENT = re.compile(r"^# cuvil-ukernel (\S+) (\{.*\})$", re.M)
_KINDS = {"gather": lambda d: GatherSpec(**d), "dwrow": lambda d: DwRowSpec(**d),
          "tblock": lambda d: TBlockSpec(**d), "dwlanes": lambda d: DwLanesSpec(**d),
          "t": lambda d: TSpec(**{**d, "taps": tuple(d["taps"])}), "sync": lambda d: SyncSpec(**d)}


def specs_in(source: str, kinds: dict | None = None) -> dict:
    """The micro-kernels (UKSpec, TSpec, GatherSpec, DwRowSpec, SyncSpec, and the spec constructors
    `kinds` adds by kind) a kernel's source declares, by name."""
    table = {**_KINDS, **(kinds or {})}
    found = {}
    for name, blob in _COMMENT.findall(source):
        data = json.loads(blob)
        if data.get("kind") in table:
            spec = table[data["kind"]](data)
        else:
            data["taps"] = tuple(data.get("taps", ()))
            spec = UKSpec(**data)
        assert spec.name == name, (spec.name, name)
        found[name] = spec
    return found


def lanes_for(vector_bits: int) -> int:
    return max(4, vector_bits // 32)


class IRBuilder:
    def __init__(self):
        self.lines, self.n = [], 0

    def tmp(self, base="t"):
        self.n += 1
        return f"%{base}{self.n}"

    def __call__(self, text):
        self.lines.append("  " + text)

    def label(self, name):
        self.lines.append(f"{name}:")


def open_k_loop(ir: IRBuilder, ci: int, init: dict, vt: str, latch: str) -> tuple[str, dict]:
    """The K loop's header block of column chunk ci: k and the accumulators as phis (from `init`
    on entry, from the loop's last block `latch` on the back edge)."""
    ir.label(f"loop{ci}")
    kv = f"%k{ci}"
    accs = {key: f"%acc{ci}_{key[0]}_{key[1]}" for key in init}
    ir(f"{kv} = phi i64 [ 0, %pre{ci} ], [ %kn{ci}, {latch} ]")
    for key, acc in accs.items():
        ir(f"{acc} = phi {vt} [ {init[key]}, %pre{ci} ], [ %accn{ci}_{key[0]}_{key[1]}, {latch} ]")
    return kv, accs


def _fma_broadcast(ir: IRBuilder, ptr: str, vt: str, L: int, row: int, vecs, bvec: dict, cur: dict) -> None:
    """cur[row, v] += (the float at ptr, broadcast) * bvec[v] for every v in vecs."""
    s = ir.tmp("a")
    ir(f"{s} = load float, ptr {ptr}, align 4")
    splat = _broadcast(ir, s, vt, L)
    for v in vecs:
        out = ir.tmp("f")
        ir(f"{out} = call {vt} @llvm.fma.v{L}f32({vt} {splat}, {vt} {bvec[v]}, {vt} {cur[row, v]})")
        cur[row, v] = out


def close_k_loop(ir: IRBuilder, ci: int, kv: str, accs: dict, cur: dict, rename: dict) -> dict:
    """The back edge of chunk ci's K loop; returns the accumulators' names after the loop (block st<ci>)."""
    for key in accs:
        rename[f"%accn{ci}_{key[0]}_{key[1]}"] = cur[key]
    ir(f"%kn{ci} = add i64 {kv}, 1")
    ir(f"%kc{ci} = icmp slt i64 %kn{ci}, %kc")
    ir(f"br i1 %kc{ci}, label %loop{ci}, label %st{ci}")
    ir.label(f"st{ci}")
    return {key: f"%accn{ci}_{key[0]}_{key[1]}" for key in accs}


def function_module(head: str, ir: IRBuilder, rename: dict, decls: list) -> str:
    """The function (its body with the loop-carried names resolved) and its declarations."""
    body = "\n".join(ir.lines)
    for old, new in sorted(rename.items(), key=lambda kv: -len(kv[0])):
        body = re.sub(re.escape(old) + r"\b", new, body)
    return f"{head}\n{body}\n}}\n\n" + "\n".join(decls) + "\n\nattributes #0 = { nounwind }\n"


def ukernel_ir(spec, vector_bits: int, arch: str = "x86_64") -> str:
    """The LLVM IR (a module of one function named spec.name) for the target's vector width; only
    the synchronisation kernels depend on the ISA `arch` (the others are portable vector IR, which
    LLVM lowers to SSE/AVX on x86-64 and to NEON, `fmla`, on AArch64)."""
    if isinstance(spec, GatherSpec):
        return gather_ir(spec, vector_bits)
    if isinstance(spec, TBlockSpec):
        return tblock_ir(spec, vector_bits)
    if isinstance(spec, DwRowSpec):
        return dwrow_ir(spec, vector_bits)
    if isinstance(spec, TSpec):
        return tkernel_ir(spec, vector_bits)
    if isinstance(spec, SyncSpec):
        return sync_ir(spec, arch)
    L = min(lanes_for(vector_bits), 16)
    assert spec.nr % L == 0 and spec.nr <= 64
    V = spec.nr // L
    vt = f"<{L} x float>"
    mt = f"<{L} x i1>"
    # Column chunks: vectors per chunk so that mr * chunk <= the accumulator budget.
    per_chunk = max(1, min(V, accumulator_budget(L, arch) // max(1, spec.mr)))
    chunks = [list(range(v0, min(V, v0 + per_chunk))) for v0 in range(0, V, per_chunk)]
    ir = IRBuilder()
    T = len(spec.taps)
    P = spec.a_panel
    need_mask = True

    ir.label("entry")
    # Per-vector lane masks from the i64 column mask.
    masks = {}
    full = ir.tmp("full")
    ir(f"{full} = icmp eq i64 %mask, -1")
    if need_mask:
        for v in range(V):
            shifted = ir.tmp("ms")
            ir(f"{shifted} = lshr i64 %mask, {v * L}")
            bits = ir.tmp("mb")
            ir(f"{bits} = trunc i64 {shifted} to i{L}")
            m = ir.tmp("m")
            ir(f"{m} = bitcast i{L} {bits} to {mt}")
            masks[v] = m
    # Compress stores advance by the popcount of each vector's mask: prefix offsets.
    offsets, dense = {}, {}
    if spec.store == "x":
        running = "0"
        for v in range(V):
            offsets[v] = running
            seg = ir.tmp("seg")
            ir(f"{seg} = lshr i64 %mask, {v * L}")
            segm = ir.tmp("segm")
            ir(f"{segm} = and i64 {seg}, {(1 << L) - 1}")
            cnt = ir.tmp("cnt")
            ir(f"{cnt} = call i64 @llvm.ctpop.i64(i64 {segm})")
            nxt = ir.tmp("off")
            ir(f"{nxt} = add i64 {running}, {cnt}")
            running = nxt
            # The first cnt lanes: where the compressed vector is stored.
            low = ir.tmp("low")
            ir(f"{low} = shl i64 1, {cnt}")
            lowm = ir.tmp("low")
            ir(f"{lowm} = sub i64 {low}, 1")
            lowt = ir.tmp("low")
            ir(f"{lowt} = trunc i64 {lowm} to i{L}")
            dense[v] = ir.tmp("dm")
            ir(f"{dense[v]} = bitcast i{L} {lowt} to {mt}")
    loadc = ir.tmp("loadc")
    ir(f"{loadc}w = and i64 %loadc, {LOADC_ACCUMULATE}")
    ir(f"{loadc} = icmp ne i64 {loadc}w, 0")
    epilogue = bool(spec.bias or spec.act)
    if epilogue:
        ir("%epiw = and i64 %loadc, " + str(LOADC_EPILOGUE))
        ir("%epi = icmp ne i64 %epiw, 0")
    # Row base pointers of C.
    crow = {}
    for i in range(spec.mr):
        idx = ir.tmp("ci")
        ir(f"{idx} = mul i64 %ldc, {i}")
        idx2 = ir.tmp("ci")
        ir(f"{idx2} = add i64 %coff, {idx}")
        ptr = ir.tmp("crow")
        ir(f"{ptr} = getelementptr float, ptr %c, i64 {idx2}")
        crow[i] = ptr
    # Row base pointers of A (strided mode) or the panel base (packed mode).
    arow = {}
    if spec.a_packed:
        ptr = ir.tmp("apanel")
        ir(f"{ptr} = getelementptr float, ptr %a, i64 %aoff")
        arow[0] = ptr
    else:
        for i in range(spec.mr):
            idx = ir.tmp("ai")
            ir(f"{idx} = mul i64 %lda, {i}")
            idx2 = ir.tmp("ai")
            ir(f"{idx2} = add i64 %aoff, {idx}")
            ptr = ir.tmp("arow")
            ir(f"{ptr} = getelementptr float, ptr %a, i64 {idx2}")
            arow[i] = ptr
    bbase = ir.tmp("bbase")
    ir(f"{bbase} = getelementptr float, ptr %b, i64 %boff")
    if spec.prefetch_c:
        below = ir.tmp("cb")
        ir(f"{below} = mul i64 %ldc, {spec.mr}")
        for i in range(spec.mr):
            p = ir.tmp("pc")
            ir(f"{p} = getelementptr float, ptr {crow[i]}, i64 {below}")
            for j in range(-(-spec.nr * 4 // 64)):
                q = ir.tmp("pcq")
                ir(f"{q} = getelementptr i8, ptr {p}, i64 {64 * j}")
                ir(f"call void @llvm.prefetch.p0(ptr {q}, i32 0, i32 3, i32 1)")

    def c_addr(i, v):
        if spec.store == "x":
            p = ir.tmp("cp")
            ir(f"{p} = getelementptr float, ptr {crow[i]}, i64 {offsets[v]}")
        else:
            p = ir.tmp("cp")
            ir(f"{p} = getelementptr float, ptr {crow[i]}, i64 {v * L}")
        return p

    rename = {}
    ir("br label %chunk0")
    for ci, vecs in enumerate(chunks):
        ir.label(f"chunk{ci}")
        # Initial accumulators: C (when accumulating) or zero.
        ir(f"br i1 {loadc}, label %ldsel{ci}, label %zero{ci}")
        ir.label(f"ldsel{ci}")
        ir(f"br i1 {full}, label %ldf{ci}, label %ldm{ci}")
        loaded = {}
        for kind in ("f", "m"):
            ir.label(f"ld{kind}{ci}")
            for i in range(spec.mr):
                for v in vecs:
                    x = ir.tmp("c")
                    if kind == "f":
                        p = ir.tmp("cp")
                        ir(f"{p} = getelementptr float, ptr {crow[i]}, i64 {v * L}")
                        ir(f"{x} = load {vt}, ptr {p}, align 4")
                    elif spec.store == "x":
                        p = c_addr(i, v)
                        ir(f"{x} = call {vt} @llvm.masked.expandload.v{L}f32(ptr {p}, {mt} {masks[v]}, {vt} zeroinitializer)")
                    else:
                        p = c_addr(i, v)
                        ir(f"{x} = call {vt} @llvm.masked.load.v{L}f32.p0(ptr align 4 {p}, {mt} {masks[v]}, {vt} zeroinitializer)")
                    loaded.setdefault((i, v), []).append((x, f"%ld{kind}{ci}"))
            ir(f"br label %pre{ci}")
        ir.label(f"zero{ci}")
        ir(f"br label %pre{ci}")
        ir.label(f"pre{ci}")
        init = {}
        for key, xs in loaded.items():
            ph = ir.tmp("i")
            incoming = ", ".join(f"[ {x}, {blk} ]" for x, blk in xs)
            ir(f"{ph} = phi {vt} {incoming}, [ zeroinitializer, %zero{ci} ]")
            init[key] = ph
        ir(f"br label %loop{ci}")
        # The K loop (over k, or over channels with T taps each).
        kv, accs = open_k_loop(ir, ci, init, vt, f"%loop{ci}")
        cur = dict(accs)
        steps = [(t, spec.taps[t]) for t in range(T)] if T else [(0, None)]
        # B row base for this k (or channel).
        brow_idx = ir.tmp("bk")
        ir(f"{brow_idx} = mul i64 {kv}, %ldb")
        brow = ir.tmp("brow")
        ir(f"{brow} = getelementptr float, ptr {bbase}, i64 {brow_idx}")
        if ci == 0:
            _prefetches(ir, spec, kv, arow, brow, T, P)
        for t, off in steps:
            bvec = {}
            for v in vecs:
                p = ir.tmp("bp")
                ir(f"{p} = getelementptr float, ptr {brow}, i64 {(off or 0) + v * L}")
                x = ir.tmp("b")
                if spec.b_masked:
                    ir(f"{x} = call {vt} @llvm.masked.load.v{L}f32.p0(ptr align 4 {p}, {mt} {masks[v]}, {vt} zeroinitializer)")
                else:
                    ir(f"{x} = load {vt}, ptr {p}, align 4")
                bvec[v] = x
            kk = kv
            if T:
                kk = ir.tmp("kk")
                ir(f"{kk} = add i64 {ir_mul(ir, kv, T)}, {t}")
            for i in range(spec.mr):
                if spec.a_packed:
                    idx = ir.tmp("aidx")
                    ir(f"{idx} = add i64 {ir_mul(ir, kk, P)}, {i}")
                    p = ir.tmp("ap")
                    ir(f"{p} = getelementptr float, ptr {arow[0]}, i64 {idx}")
                else:
                    p = ir.tmp("ap")
                    ir(f"{p} = getelementptr float, ptr {arow[i]}, i64 {kk}")
                _fma_broadcast(ir, p, vt, L, i, vecs, bvec, cur)
        final = close_k_loop(ir, ci, kv, accs, cur, rename)
        if epilogue:
            final = row_epilogue(ir, spec, final, vt, L)
        ir(f"br i1 {full}, label %stf{ci}, label %stm{ci}")
        nxt = f"chunk{ci + 1}" if ci + 1 < len(chunks) else "done"
        for kind in ("f", "m"):
            ir.label(f"st{kind}{ci}")
            for (i, v) in accs:
                val = final[i, v]
                if kind == "f":
                    p = ir.tmp("cp")
                    ir(f"{p} = getelementptr float, ptr {crow[i]}, i64 {v * L}")
                    ir(f"store {vt} {val}, ptr {p}, align 4")
                elif spec.store == "x":
                    # Compressed in a register, then a masked store of its first lanes: a compress
                    # store to memory is microcoded on AMD Zen 4 (~80 cycles against ~4).
                    p = c_addr(i, v)
                    packed = ir.tmp("cv")
                    ir(f"{packed} = call {vt} @llvm.experimental.vector.compress.v{L}f32({vt} {val}, {mt} {masks[v]}, {vt} poison)")
                    ir(f"call void @llvm.masked.store.v{L}f32.p0({vt} {packed}, ptr align 4 {p}, {mt} {dense[v]})")
                else:
                    p = c_addr(i, v)
                    ir(f"call void @llvm.masked.store.v{L}f32.p0({vt} {val}, ptr align 4 {p}, {mt} {masks[v]})")
            ir(f"br label %{nxt}")
    ir.label("done")
    ir("ret i32 0")
    args = ", ".join(f"ptr noalias %{n}" if n in _PTR_ARGS and n != "c" else
                     (f"ptr %{n}" if n in _PTR_ARGS else f"i64 %{n}") for n in ARG_TYPES)
    head = f"define i32 @{spec.name}({args}) #0 {{"
    decls = [
        f"declare {vt} @llvm.fma.v{L}f32({vt}, {vt}, {vt})",
        f"declare {vt} @llvm.masked.load.v{L}f32.p0(ptr, {mt}, {vt})",
        f"declare void @llvm.masked.store.v{L}f32.p0({vt}, ptr, {mt})",
        f"declare {vt} @llvm.masked.expandload.v{L}f32(ptr, {mt}, {vt})",
        f"declare {vt} @llvm.experimental.vector.compress.v{L}f32({vt}, {mt}, {vt})",
        "declare i64 @llvm.ctpop.i64(i64)",
        "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
        f"declare {vt} @llvm.maxnum.v{L}f32({vt}, {vt})",
        f"declare {vt} @llvm.minnum.v{L}f32({vt}, {vt})",
    ]
    return function_module(head, ir, rename, decls)


def gather_ir(spec: GatherSpec, vector_bits: int) -> str:
    """dst[j] = src[j * S] in groups of L lanes: a load of S * L floats and a shuffle. Whole groups
    while one more output follows (the load's last S - 1 floats are then inside the source); the
    rest, 1..L outputs, with masked loads and stores."""
    L, S = min(lanes_for(vector_bits), 16), spec.stride
    W = S * L
    vt, wt = f"<{L} x float>", f"<{W} x float>"
    pick = ", ".join(f"i32 {S * i}" for i in range(L))
    lanes = lambda n: "<" + ", ".join(f"i32 {i}" for i in range(n)) + ">"
    return f"""define i32 @{spec.name}(ptr noalias %src, i64 %soff, ptr noalias %dst, i64 %doff, i64 %n) #0 {{
entry:
  %s0 = getelementptr float, ptr %src, i64 %soff
  %d0 = getelementptr float, ptr %dst, i64 %doff
  br label %head
head:
  %j = phi i64 [ 0, %entry ], [ %jn, %body ]
  %jn = add i64 %j, {L}
  %more = icmp slt i64 %jn, %n
  br i1 %more, label %body, label %tail
body:
  %si = mul i64 %j, {S}
  %sp = getelementptr float, ptr %s0, i64 %si
  %w = load {wt}, ptr %sp, align 4
  %v = shufflevector {wt} %w, {wt} poison, <{L} x i32> <{pick}>
  %dp = getelementptr float, ptr %d0, i64 %j
  store {vt} %v, ptr %dp, align 4
  br label %head
tail:
  %rem = sub i64 %n, %j
  %some = icmp sgt i64 %rem, 0
  br i1 %some, label %last, label %done
last:
  %need = mul i64 %rem, {S}
  %need1 = sub i64 %need, {S - 1}
  %needw = trunc i64 %need1 to i32
  %needi = insertelement <{W} x i32> poison, i32 %needw, i64 0
  %needs = shufflevector <{W} x i32> %needi, <{W} x i32> poison, <{W} x i32> zeroinitializer
  %lm = icmp ult <{W} x i32> {lanes(W)}, %needs
  %lsi = mul i64 %j, {S}
  %lsp = getelementptr float, ptr %s0, i64 %lsi
  %lw = call {wt} @llvm.masked.load.v{W}f32.p0(ptr align 4 %lsp, <{W} x i1> %lm, {wt} zeroinitializer)
  %lv = shufflevector {wt} %lw, {wt} poison, <{L} x i32> <{pick}>
  %remw = trunc i64 %rem to i32
  %remi = insertelement <{L} x i32> poison, i32 %remw, i64 0
  %rems = shufflevector <{L} x i32> %remi, <{L} x i32> poison, <{L} x i32> zeroinitializer
  %sm = icmp ult <{L} x i32> {lanes(L)}, %rems
  %ldp = getelementptr float, ptr %d0, i64 %j
  call void @llvm.masked.store.v{L}f32.p0({vt} %lv, ptr align 4 %ldp, <{L} x i1> %sm)
  br label %done
done:
  ret i32 0
}}

declare {wt} @llvm.masked.load.v{W}f32.p0(ptr, <{W} x i1>, {wt})
declare void @llvm.masked.store.v{L}f32.p0({vt}, ptr, <{L} x i1>)

attributes #0 = {{ nounwind }}
"""


def tblock_ir(spec: TBlockSpec, vector_bits: int) -> str:
    """The 16 x 16 block as (16 / L)^2 sub-blocks of L x L. An L x L transpose swaps bit b of the
    row index with bit b of the column index for every b < log2 L; stage b does it for one bit,
    each pair of rows (i, i + b), i & b == 0, becoming two shuffles of the pair:
        new[i][j]     = row[i][j]         if j & b == 0 else row[i + b][j - b]
        new[i + b][j] = row[i][j + b]     if j & b == 0 else row[i + b][j]"""
    L = min(lanes_for(vector_bits), TBLOCK)
    vt = f"<{L} x float>"
    ir = IRBuilder()
    ir.label("entry")
    for bi in range(TBLOCK // L):
        for bj in range(TBLOCK // L):
            rows = []
            for i in range(L):
                off, ptr, row = ir.tmp("o"), ir.tmp("p"), ir.tmp("r")
                ir(f"{off} = mul i64 %lds, {bi * L + i}")
                ir(f"{ptr} = getelementptr float, ptr %s0, i64 {off}")
                ir(f"{ptr}c = getelementptr float, ptr {ptr}, i64 {bj * L}")
                ir(f"{row} = load {vt}, ptr {ptr}c, align 4")
                rows.append(row)
            b = L // 2
            while b:
                for i in range(L):
                    if i & b:
                        continue
                    lo = ", ".join(f"i32 {j if not j & b else L + j - b}" for j in range(L))
                    hi = ", ".join(f"i32 {j + b if not j & b else L + j}" for j in range(L))
                    new_lo, new_hi = ir.tmp("s"), ir.tmp("s")
                    ir(f"{new_lo} = shufflevector {vt} {rows[i]}, {vt} {rows[i + b]}, <{L} x i32> <{lo}>")
                    ir(f"{new_hi} = shufflevector {vt} {rows[i]}, {vt} {rows[i + b]}, <{L} x i32> <{hi}>")
                    rows[i], rows[i + b] = new_lo, new_hi
                b //= 2
            for j in range(L):
                off, ptr = ir.tmp("o"), ir.tmp("p")
                ir(f"{off} = mul i64 %ldd, {bj * L + j}")
                ir(f"{ptr} = getelementptr float, ptr %d0, i64 {off}")
                ir(f"{ptr}c = getelementptr float, ptr {ptr}, i64 {bi * L}")
                ir(f"store {vt} {rows[j]}, ptr {ptr}c, align 4")
    ir("ret i32 0")
    head = (f"define i32 @{spec.name}(ptr noalias %src, i64 %soff, i64 %lds, ptr noalias %dst, i64 %doff, "
            f"i64 %ldd) #0 {{")
    body = "\n".join(["entry:", "  %s0 = getelementptr float, ptr %src, i64 %soff",
                      "  %d0 = getelementptr float, ptr %dst, i64 %doff"] + ir.lines[1:])
    return f"{head}\n{body}\n}}\n\nattributes #0 = {{ nounwind }}\n"


SYNC_YIELD_SPINS = 1000   # "wait" spins this many times (tens of microseconds), then yields the core between
                          # checks: a partner thread on the same core (a new pool, before the OS moves it) runs


# The ISA-specific pieces of the synchronisation kernels: the spin-wait hint and the time stamp of
# "adopt", whose timeout (its argument) is in x86 time-stamp counter ticks (~3 GHz). AArch64: YIELD
# (hint #1) and the virtual counter CNTVCT_EL0, read with MRS (LLVM's readcyclecounter reads
# PMCCNTR_EL0 there, which Linux does not let a user program read, and its readsteadycounter
# folded to 0, so the timeout never came); the timeout is converted with the counter's frequency
# CNTFRQ_EL0 (1 GHz on ARMv8.6 cores, 31.25 MHz on a Jetson Orin) to the same ~3 us.
SPIN_HINT = {"x86_64": ("call void @llvm.x86.sse2.pause()", "declare void @llvm.x86.sse2.pause()"),
             "aarch64": ("call void @llvm.aarch64.hint(i32 1)", "declare void @llvm.aarch64.hint(i32)")}
TSC_HZ = 3_000_000_000
_AARCH64_COUNTER = "call i64 @llvm.read_volatile_register.i64(metadata !0)"
_AARCH64_TIMEOUT = f"""  %frq = call i64 @llvm.read_volatile_register.i64(metadata !1)
  %arg_f = mul i64 %arg, %frq
  %limit = udiv i64 %arg_f, {TSC_HZ}
"""
# clang's __builtin_arm_rsr64: the registers by name (no inline assembly, which llvmlite's
# AArch64 object writer cannot parse)
_AARCH64_REGISTERS = """
declare i64 @llvm.read_volatile_register.i64(metadata)
!0 = !{!"cntvct_el0"}
!1 = !{!"cntfrq_el0"}
"""


def sync_ir(spec: SyncSpec, arch: str = "x86_64") -> str:
    text = _sync_ir(spec)
    if arch == "x86_64":
        return text
    pause, declare_pause = SPIN_HINT[arch]
    text = (text.replace("call void @llvm.x86.sse2.pause()", pause)
            .replace("declare void @llvm.x86.sse2.pause()", declare_pause)
            .replace("call i64 @llvm.readcyclecounter()", _AARCH64_COUNTER)
            .replace("declare i64 @llvm.readcyclecounter()\n", ""))
    if spec.op == "adopt":
        text = text.replace("  br label %check\ncheck:", _AARCH64_TIMEOUT + "  br label %check\ncheck:", 1)
        text = text.replace("icmp ugt i64 %dt, %arg", "icmp ugt i64 %dt, %limit")
    return text + (_AARCH64_REGISTERS if "read_volatile_register" in text else "")


def _sync_ir(spec: SyncSpec) -> str:
    head = f"define i32 @{spec.name}(ptr %p, i64 %off, i64 %arg) #0 {{\nentry:\n" \
           "  %q = getelementptr i32, ptr %p, i64 %off\n  %a = trunc i64 %arg to i32\n"
    if spec.op == "claim":
        body = """  %n = add i32 %a, 1
  %r = cmpxchg ptr %q, i32 %a, i32 %n seq_cst seq_cst
  %ok = extractvalue { i32, i1 } %r, 1
  %z = zext i1 %ok to i32
  ret i32 %z
}
"""
    elif spec.op == "adopt":
        body = """  %t0 = call i64 @llvm.readcyclecounter()
  br label %check
check:
  %v = load atomic i32, ptr %q seq_cst, align 4
  %set = icmp ne i32 %v, 0
  br i1 %set, label %taken, label %time
time:
  %t = call i64 @llvm.readcyclecounter()
  %dt = sub i64 %t, %t0
  %late = icmp ugt i64 %dt, %arg
  br i1 %late, label %claim, label %spin
spin:
  call void @llvm.x86.sse2.pause()
  br label %check
claim:
  %r = cmpxchg ptr %q, i32 0, i32 1 seq_cst seq_cst
  %ok = extractvalue { i32, i1 } %r, 1
  %z = zext i1 %ok to i32
  ret i32 %z
taken:
  ret i32 0
}

declare i64 @llvm.readcyclecounter()
declare void @llvm.x86.sse2.pause()
"""
    elif spec.op == "add":
        body = """  %old = atomicrmw add ptr %q, i32 %a seq_cst
  ret i32 0
}
"""
    elif spec.op == "wait":
        body = f"""  br label %check
check:
  %i = phi i64 [ 0, %entry ], [ %i1, %spin ], [ %i1, %yield ]
  %v = load atomic i32, ptr %q seq_cst, align 4
  %ready = icmp sge i32 %v, %a
  br i1 %ready, label %out, label %spin
spin:
  call void @llvm.x86.sse2.pause()
  %i1 = add i64 %i, 1
  %long = icmp ugt i64 %i1, {SYNC_YIELD_SPINS}
  br i1 %long, label %yield, label %check
yield:
  %y = call i32 @sched_yield()
  br label %check
out:
  ret i32 0
}}

declare void @llvm.x86.sse2.pause()
declare i32 @sched_yield()
"""
    else:
        raise ValueError(f"unknown sync op {spec.op!r}")
    return head + body + "\nattributes #0 = { nounwind }\n"


def tkernel_ir(spec: TSpec, vector_bits: int) -> str:
    """See TSpec. The columns are split in chunks so that the accumulators fit the register
    file (each chunk runs the K loop once)."""
    L = min(lanes_for(vector_bits), 16)
    assert spec.nr % L == 0 and spec.nr <= 64
    V = spec.nr // L
    vt, mt, pt = f"<{L} x float>", f"<{L} x i1>", f"<{L} x ptr>"
    per_chunk = max(1, min(V, MAX_ACC[L] // max(1, spec.mr)))
    chunks = [list(range(v0, min(V, v0 + per_chunk))) for v0 in range(0, V, per_chunk)]
    taps = spec.taps or (0,)
    T = len(taps)
    ir = IRBuilder()
    ir.label("entry")
    for bit, name in ((LOADC_ACCUMULATE, "acc"), (LOADC_EPILOGUE, "epi"), (TSTORE_OUTPUT, "out")):
        ir(f"%{name}w = and i64 %flags, {bit}")
        ir(f"%{name} = icmp ne i64 %{name}w, 0")
    ir("%abase = getelementptr float, ptr %a, i64 %aoff")
    ir("%bbase = getelementptr float, ptr %b, i64 %boff")
    ir("%pfbase = getelementptr float, ptr %bbase, i64 %pfoff")
    ir("%sbase = getelementptr float, ptr %s, i64 %soff")
    ir("%cbase = getelementptr float, ptr %c, i64 %coff")
    ir(f"%colsi = insertelement <{L} x i64> poison, i64 %cols, i64 0")
    ir(f"%colss = shufflevector <{L} x i64> %colsi, <{L} x i64> poison, <{L} x i32> zeroinitializer")
    # A tile of the whole output plane (c_cs = mr positions, all `rows` of them): its columns'
    # outputs are one contiguous run of C, stored as vectors (_dense_store), not scattered.
    dense = spec.c_cs == spec.mr
    if dense:
        ir(f"%whole = icmp eq i64 %rows, {spec.mr}")
    lanes = lambda base: "<" + ", ".join(f"i64 {base + j}" for j in range(L)) + ">"
    colmask, slot = {}, {}
    for v in range(V):
        m = ir.tmp("cm")
        ir(f"{m} = icmp slt <{L} x i64> {lanes(v * L)}, %colss")
        colmask[v] = m
    for i in range(spec.mr):
        for v in range(V):
            p = ir.tmp("sp")
            ir(f"{p} = getelementptr float, ptr %sbase, i64 {i * spec.nr + v * L}")
            slot[i, v] = p
    rename = {}
    ir("br label %chunk0")
    for ci, vecs in enumerate(chunks):
        ir.label(f"chunk{ci}")
        ir(f"br i1 %acc, label %ld{ci}, label %pre{ci}")
        ir.label(f"ld{ci}")
        loaded = {}
        for i in range(spec.mr):
            for v in vecs:
                x = ir.tmp("l")
                ir(f"{x} = load {vt}, ptr {slot[i, v]}, align 4")
                loaded[i, v] = x
        ir(f"br label %pre{ci}")
        ir.label(f"pre{ci}")
        init = {}
        for key, x in loaded.items():
            ph = ir.tmp("i")
            ir(f"{ph} = phi {vt} [ {x}, %ld{ci} ], [ zeroinitializer, %chunk{ci} ]")
            init[key] = ph
        ir(f"br label %loop{ci}")
        kv, accs = open_k_loop(ir, ci, init, vt, f"%loop{ci}")
        cur = dict(accs)
        arow = ir.tmp("ak")
        ir(f"{arow} = mul i64 {kv}, {spec.a_ks}")
        ap = ir.tmp("arow")
        ir(f"{ap} = getelementptr float, ptr %abase, i64 {arow}")
        brow = ir.tmp("bk")
        ir(f"{brow} = mul i64 {kv}, {T * spec.nr}")
        bp = ir.tmp("brow")
        ir(f"{bp} = getelementptr float, ptr %bbase, i64 {brow}")
        if ci == 0 and spec.pf_lines:
            line = ir.tmp("pl")
            ir(f"{line} = mul i64 {kv}, {64 * spec.pf_lines}")
            for j in range(spec.pf_lines):
                q = ir.tmp("pq")
                ir(f"{q} = getelementptr i8, ptr %pfbase, i64 {line}")
                q2 = ir.tmp("pq")
                ir(f"{q2} = getelementptr i8, ptr {q}, i64 {64 * j}")
                ir(f"call void @llvm.prefetch.p0(ptr {q2}, i32 0, i32 3, i32 1)")
        for t, off in enumerate(taps):
            bvec = {}
            for v in vecs:
                p = ir.tmp("bp")
                ir(f"{p} = getelementptr float, ptr {bp}, i64 {t * spec.nr + v * L}")
                x = ir.tmp("b")
                ir(f"{x} = load {vt}, ptr {p}, align 4")
                bvec[v] = x
            for i in range(spec.mr):
                p = ir.tmp("ap")
                ir(f"{p} = getelementptr float, ptr {ap}, i64 {off + i * spec.a_is}")
                _fma_broadcast(ir, p, vt, L, i, vecs, bvec, cur)
        final = close_k_loop(ir, ci, kv, accs, cur, rename)
        nxt = f"chunk{ci + 1}" if ci + 1 < len(chunks) else "done"
        ir(f"br i1 %out, label %so{ci}, label %ss{ci}")
        ir.label(f"ss{ci}")
        for (i, v), val in final.items():
            ir(f"store {vt} {val}, ptr {slot[i, v]}, align 4")
        ir(f"br label %{nxt}")
        ir.label(f"so{ci}")
        if spec.bias or spec.act:
            final = _column_epilogue(ir, spec, final, vecs, colmask, vt, L)
        if dense:
            ir(f"br i1 %whole, label %sd{ci}, label %sc{ci}")
            ir.label(f"sd{ci}")
            _dense_store(ir, spec, final, vecs, vt, L)
            ir(f"br label %{nxt}")
            ir.label(f"sc{ci}")
        for (i, v), val in final.items():
            ok = ir.tmp("rok")
            ir(f"{ok} = icmp slt i64 {i}, %rows")
            m = ir.tmp("mk")
            ir(f"{m} = select i1 {ok}, {mt} {colmask[v]}, {mt} zeroinitializer")
            idx = "<" + ", ".join(f"i64 {i + (v * L + j) * spec.c_cs}" for j in range(L)) + ">"
            p = ir.tmp("cps")
            ir(f"{p} = getelementptr float, ptr %cbase, <{L} x i64> {idx}")
            ir(f"call void @llvm.masked.scatter.v{L}f32.v{L}p0({vt} {val}, {pt} align 4 {p}, {mt} {m})")
        ir(f"br label %{nxt}")
    ir.label("done")
    ir("ret i32 0")
    head = (f"define i32 @{spec.name}(ptr noalias %a, i64 %aoff, ptr noalias %b, i64 %boff, ptr noalias %s, "
            f"i64 %soff, ptr noalias %c, i64 %coff, i64 %kc, i64 %rows, i64 %cols, i64 %flags, ptr noalias %bias, "
            f"i64 %biasoff, i64 %pfoff) #0 {{")
    decls = [f"declare {vt} @llvm.fma.v{L}f32({vt}, {vt}, {vt})",
             f"declare void @llvm.masked.scatter.v{L}f32.v{L}p0({vt}, {pt}, {mt})",
             f"declare void @llvm.masked.store.v{L}f32.p0({vt}, ptr, {mt})",
             f"declare {vt} @llvm.masked.load.v{L}f32.p0(ptr, {mt}, {vt})",
             f"declare {vt} @llvm.maxnum.v{L}f32({vt}, {vt})",
             f"declare {vt} @llvm.minnum.v{L}f32({vt}, {vt})",
             "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)"]
    return function_module(head, ir, rename, decls)


def _dense_store(ir: IRBuilder, spec: TSpec, accs: dict, vecs: list, vt: str, L: int) -> None:
    """The tile's columns `vecs` stored when it holds the whole output plane (c_cs = mr): column
    vector v's outputs C[i + j*mr] (i < mr, j in v's L columns) are the mr vectors from
    cbase + v*L*mr on, each lane drawn from the row accumulator i = its offset mod mr (mr - 1
    two-vector shuffles a vector, against a scatter of L lanes per accumulator: on this Zen 5 the
    STFT's 7 x 48 tiles spent 12 % of the conv in their 21 scatters). Columns >= cols are not stored."""
    mr = spec.mr
    mask_ir = lambda values: "<" + ", ".join(f"i32 {m}" for m in values) + ">"
    for v in vecs:
        for r in range(mr):
            flat = [r * L + lane for lane in range(L)]       # offsets in column vector v's run
            rows = [f % mr for f in flat]
            built = None
            for i in sorted(set(rows), key=rows.index):
                out = ir.tmp("dp")
                if built is None:
                    picks = [f // mr if row == i else 0 for f, row in zip(flat, rows)]
                    ir(f"{out} = shufflevector {vt} {accs[i, v]}, {vt} poison, <{L} x i32> {mask_ir(picks)}")
                else:
                    picks = [L + f // mr if row == i else lane for lane, (f, row) in enumerate(zip(flat, rows))]
                    ir(f"{out} = shufflevector {vt} {built}, {vt} {accs[i, v]}, <{L} x i32> {mask_ir(picks)}")
                built = out
            columns = "<" + ", ".join(f"i64 {v * L + f // mr}" for f in flat) + ">"
            m = ir.tmp("dm")
            ir(f"{m} = icmp slt <{L} x i64> {columns}, %colss")
            p = ir.tmp("dq")
            ir(f"{p} = getelementptr float, ptr %cbase, i64 {v * L * mr + r * L}")
            ir(f"call void @llvm.masked.store.v{L}f32.p0({vt} {built}, ptr align 4 {p}, <{L} x i1> {m})")


def _column_epilogue(ir: IRBuilder, spec: TSpec, accs: dict, vecs: list, colmask: dict, vt: str, L: int) -> dict:
    """act(acc + bias[column]) for a TSpec tile, selected by the epilogue bit (%epi)."""
    bias = {}
    if spec.bias:
        for v in vecs:
            idx = ir.tmp("bi")
            ir(f"{idx} = add i64 %biasoff, {v * L}")
            p = ir.tmp("bp")
            ir(f"{p} = getelementptr float, ptr %bias, i64 {idx}")
            x = ir.tmp("bv")
            ir(f"{x} = call {vt} @llvm.masked.load.v{L}f32.p0(ptr align 4 {p}, <{L} x i1> {colmask[v]}, {vt} zeroinitializer)")
            bias[v] = x
    out = {}
    for (i, v), acc in accs.items():
        x = acc
        if spec.bias:
            y = ir.tmp("eb")
            ir(f"{y} = fadd {vt} {x}, {bias[v]}")
            x = y
        x = _activation(ir, spec, x, vt, L)
        sel = ir.tmp("e")
        ir(f"{sel} = select i1 %epi, {vt} {x}, {vt} {acc}")
        out[i, v] = sel
    return out


def _activation(ir: IRBuilder, spec, x: str, vt: str, L: int) -> str:
    """spec.act ("" | Relu | Clip within act_lo, act_hi) applied to vector x."""
    if spec.act == "Relu":
        y = ir.tmp("er")
        ir(f"{y} = call {vt} @llvm.maxnum.v{L}f32({vt} {x}, {vt} zeroinitializer)")
        return y
    if spec.act == "Clip":
        for bound, fn in ((spec.act_lo, "maxnum"), (spec.act_hi, "minnum")):
            if abs(bound) != float("inf"):
                y = ir.tmp("ec")
                splat = "<" + ", ".join([f"float {float_ir(bound)}"] * L) + ">"
                ir(f"{y} = call {vt} @llvm.{fn}.v{L}f32({vt} {x}, {vt} {splat})")
                x = y
        return x
    assert spec.act == "", spec.act
    return x


def _const_mask(bits) -> str:
    return "<" + ", ".join(f"i1 {int(b)}" for b in bits) + ">"


def _dw_prologue(ir: IRBuilder, spec, x_elem: str, y_elem: str, vt: str, L: int):
    """A depthwise row kernel's entry: the row bases, the KH*KW taps and the bias broadcast to
    vectors, and for each input row the call reads (r0 + kh) whether it is inside [0, H) and its
    start. Returns (tap vectors, bias vector, [(ok, row pointer)])."""
    ir.label("entry")
    ir(f"%xb = getelementptr {x_elem}, ptr %x, i64 %xoff")
    ir("%wb = getelementptr float, ptr %w, i64 %woff")
    ir(f"%yb = getelementptr {y_elem}, ptr %y, i64 %yoff")
    wv = []
    for t in range(spec.KH * spec.KW + 1):
        p = ir.tmp("wp")
        ir(f"{p} = getelementptr float, ptr %wb, i64 {t}")
        sc = ir.tmp("ws")
        ir(f"{sc} = load float, ptr {p}, align 4")
        wv.append(_broadcast(ir, sc, vt, L))
    bias = wv.pop()
    valid = []
    for kh in range(spec.KH + spec.rows - 1):
        r = ir.tmp("r")
        ir(f"{r} = add i64 %r0, {kh}")
        lo = ir.tmp("rlo")
        ir(f"{lo} = icmp sge i64 {r}, 0")
        hi = ir.tmp("rhi")
        ir(f"{hi} = icmp slt i64 {r}, {spec.H}")
        ok = ir.tmp("rok")
        ir(f"{ok} = and i1 {lo}, {hi}")
        off = ir.tmp("ro")
        ir(f"{off} = mul i64 {r}, {spec.W}")
        row = ir.tmp("row")
        ir(f"{row} = getelementptr {x_elem}, ptr %xb, i64 {off}")
        valid.append((ok, row))
    return wv, bias, valid


def _dw_join(ir: IRBuilder, here: str, skip: str, join: str, cur: dict, accs: dict, keys, vt: str):
    """Close an input row's block (`here`, taken when the row is inside the image; `skip` when
    not): each accumulator (of `keys`) the block changed becomes a phi of its new and old value."""
    ir(f"br label %{join}")
    ir.label(skip)
    ir(f"br label %{join}")
    ir.label(join)
    for key in keys:
        if cur[key] is not accs[key]:
            merged = ir.tmp("m")
            ir(f"{merged} = phi {vt} [ {cur[key]}, %{here} ], [ {accs[key]}, %{skip} ]")
            accs[key] = merged


def _dw_store(ir: IRBuilder, value: str, narrow, offset: int, lanes: int, L: int):
    """Store the first `lanes` of float vector `value` at y row position `offset` (16-bit, rounded
    by `narrow`, when given), masked when fewer than L."""
    y_elem, y_ir, y_align = ("i16", "i16", 2) if narrow else ("float", "f32", 4)
    if narrow:
        value = narrow(ir, value, L)
    at, yt = ir.tmp("yp"), f"<{L} x {y_elem}>"
    ir(f"{at} = getelementptr {y_elem}, ptr %yb, i64 {offset}")
    if lanes == L:
        ir(f"store {yt} {value}, ptr {at}, align {y_align}")
    else:
        ir(f"call void @llvm.masked.store.v{L}{y_ir}.p0({yt} {value}, ptr align {y_align} {at}, "
           f"<{L} x i1> {_const_mask([j < lanes for j in range(L)])})")


def dwrow_ir(spec: DwRowSpec, vector_bits: int, widen=None, narrow=None, store=None) -> str:
    """See DwRowSpec. x and y are float32 rows unless `widen` / `narrow` are given: then x (or y)
    holds 16-bit values (i16 bits), `widen(ir, bits, lanes)` makes an <lanes x float> of an
    <lanes x i16>, `narrow(ir, value, lanes)` the <lanes x i16> stored for a float vector (rounded
    once). The taps, bias and activation are float32 either way. `store` replaces _dw_store (same
    arguments): another layout of y (ukernel_lowp.DwRowPairSpec's channel pairs)."""
    store = store or _dw_store
    L = min(lanes_for(vector_bits), 16)
    W2 = 2 * L
    vt, wt = f"<{L} x float>", f"<{W2} x float>"
    x_elem, y_elem = ("i16" if widen else "float"), ("i16" if narrow else "float")
    x_ir = "i16" if widen else "f32"
    x_align = 2 if widen else 4
    runs = (spec.KW + 1) // 2
    ir = IRBuilder()
    wv, bias, valid = _dw_prologue(ir, spec, x_elem, y_elem, vt, L)
    rows = spec.rows
    for c in range(-(-spec.OW // L)):
        ow0, n = c * L, min(L, spec.OW - c * L)
        accs = [bias] * rows
        # Input row i (of r0 + i) feeds output row q through kernel row i - q.
        for i in range(spec.KH + rows - 1):
            ok, row = valid[i]
            here, skip, join = f"c{c}r{i}", f"c{c}s{i}", f"c{c}j{i}"
            ir(f"br i1 {ok}, label %{here}, label %{skip}")
            ir.label(here)
            cur = list(accs)

            def fma(v, kw):
                for q in range(rows):
                    if 0 <= i - q < spec.KH:
                        nxt = ir.tmp("acc")
                        ir(f"{nxt} = call {vt} @llvm.fma.v{L}f32({vt} {v}, {vt} {wv[(i - q) * spec.KW + kw]}, "
                           f"{vt} {cur[q]})")
                        cur[q] = nxt
            def load(start, lanes, need):
                """`lanes` elements of the row (floats, or 16-bit bits) from column `start` (the
                first `need` lanes that fall inside the row; zeros elsewhere)."""
                bits = [k < need and 0 <= start + k < spec.W for k in range(lanes)]
                return _masked_row_load(ir, row, start, bits, x_elem, x_align, name="seg")

            def as_float(v, lanes):
                return widen(ir, v, lanes) if widen else v
            if spec.stride == 1 and widen and spec.KW <= L + 1:
                # 16-bit x: the row's 2L values from the first tap's column widened once, each tap
                # then a lane shift of them (instead of KW loads widened one by one)
                wide = as_float(load(ow0 - spec.p_l, W2, n + spec.KW - 1), W2)
                for kw in range(spec.KW):
                    pick = ", ".join(f"i32 {kw + k}" for k in range(L))
                    v = ir.tmp("tap")
                    ir(f"{v} = shufflevector {wt} {wide}, {wt} poison, <{L} x i32> <{pick}>")
                    fma(v, kw)
            elif spec.stride == 1:
                for kw in range(spec.KW):
                    fma(as_float(load(ow0 - spec.p_l + kw, L, n), L), kw)
            for j in range(runs if spec.stride == 2 else 0):
                # the taps of this run read lanes [0, 2n) (16-bit ones are picked, then widened)
                seg = load(2 * ow0 - spec.p_l + 2 * j, W2, 2 * n)
                for kw in (2 * j, 2 * j + 1):
                    if kw >= spec.KW:
                        continue
                    pick = ", ".join(f"i32 {kw % 2 + 2 * k}" for k in range(L))
                    v = ir.tmp("tap")
                    ir(f"{v} = shufflevector <{W2} x {x_elem}> {seg}, <{W2} x {x_elem}> poison, <{L} x i32> <{pick}>")
                    fma(as_float(v, L), kw)
            _dw_join(ir, here, skip, join, cur, accs, range(rows), vt)
        for q in range(rows):
            store(ir, _activation(ir, spec, accs[q], vt, L), narrow, q * spec.OW + ow0, n, L)
    ir("ret i32 0")
    head = (f"define i32 @{spec.name}(ptr noalias %x, i64 %xoff, i64 %r0, ptr noalias %w, i64 %woff, "
            f"ptr noalias %y, i64 %yoff) #0 {{")
    xw, xl = f"<{W2} x {x_elem}>", f"<{L} x {x_elem}>"
    decls = [f"declare {vt} @llvm.fma.v{L}f32({vt}, {vt}, {vt})",
             f"declare {xw} @llvm.masked.load.v{W2}{x_ir}.p0(ptr, <{W2} x i1>, {xw})",
             f"declare {xl} @llvm.masked.load.v{L}{x_ir}.p0(ptr, <{L} x i1>, {xl})",
             f"declare void @llvm.masked.store.v{L}{'i16' if narrow else 'f32'}.p0(<{L} x {y_elem}>, ptr, "
             f"<{L} x i1>)",
             f"declare {vt} @llvm.maxnum.v{L}f32({vt}, {vt})",
             f"declare {vt} @llvm.minnum.v{L}f32({vt}, {vt})"]
    return head + "\n" + "\n".join(ir.lines) + "\n}\n\n" + "\n".join(decls) + "\n\nattributes #0 = { nounwind }\n"


def _masked_row_load(ir: IRBuilder, base: str, index, bits, elem: str = "float", align: int = 4,
                     name: str = "tap") -> str:
    """<len(bits) x elem> from base[index ...] under the compile-time lane mask `bits` (zeros in
    the lanes it leaves out; a plain load when it keeps them all): the depthwise rows' tap and
    segment loads (dwrow_ir's float32 or 16-bit rows, dwrow_phase_ir, dwrow_plane_ir). `name`
    names the loaded temporary."""
    lanes, t = len(bits), f"<{len(bits)} x {elem}>"
    p, v = ir.tmp("sp"), ir.tmp(name)
    ir(f"{p} = getelementptr {elem}, ptr {base}, i64 {index}")
    if all(bits):
        ir(f"{v} = load {t}, ptr {p}, align {align}")
    else:
        suffix = "f32" if elem == "float" else elem
        ir(f"{v} = call {t} @llvm.masked.load.v{lanes}{suffix}.p0(ptr align {align} {p}, "
           f"<{lanes} x i1> {_const_mask(bits)}, {t} zeroinitializer)")
    return v


def _dw_pairs_module(name: str, ir: IRBuilder, vt: str, L: int) -> str:
    """The module of a depthwise row micro-kernel over float32 t writing 16-bit y (dwrow_phase_ir,
    dwrow_plane_ir): dwrow_ir's signature, the body in `ir`."""
    head = ("define i32 @{}(ptr noalias %x, i64 %xoff, i64 %r0, ptr noalias %w, i64 %woff, ptr noalias %y, "
            "i64 %yoff) #0 {{").format(name)
    decls = [f"declare {vt} @llvm.fma.v{L}f32({vt}, {vt}, {vt})",
             f"declare {vt} @llvm.masked.load.v{L}f32.p0(ptr, <{L} x i1>, {vt})",
             f"declare void @llvm.masked.store.v{L}i16.p0(<{L} x i16>, ptr, <{L} x i1>)",
             f"declare {vt} @llvm.maxnum.v{L}f32({vt}, {vt})",
             f"declare {vt} @llvm.minnum.v{L}f32({vt}, {vt})"]
    return head + "\n" + "\n".join(ir.lines) + "\n}\n\n" + "\n".join(decls) + "\n\nattributes #0 = { nounwind }\n"


def dwrow_phase_ir(spec, vector_bits: int, narrow, store) -> str:
    """Stride-2 depthwise rows over phase-split float32 input rows (backends/numba_cpu/dwphase.py:
    each row's even columns, then its odd ones): every tap one load of L floats, no shuffles;
    `spec.rows` (1 or 2) output rows a call, two reading KH + 2 input rows. `narrow` / `store` as
    dwrow_ir's (y 16-bit, rounded by `narrow`, stored by `store`). The taps are summed in
    dwrow_ir's order (input row, then kw): the same bits as its stride-2 rows."""
    L = min(lanes_for(vector_bits), 16)
    vt = f"<{L} x float>"
    We, Wo = (spec.W + 1) // 2, spec.W // 2
    rows = spec.rows
    n_in = spec.KH + 2 * (rows - 1)   # input rows the call reads
    ir = IRBuilder()
    # (_dw_prologue reads KH + rows - 1 input rows: n_in of them here)
    wv, bias, valid = _dw_prologue(ir, _Rows(KH=spec.KH, KW=spec.KW, rows=n_in - spec.KH + 1, H=spec.H,
                                                       W=spec.W), "float", "i16", vt, L)


    for c in range(-(-spec.OW // L)):
        ow0, n = c * L, min(L, spec.OW - c * L)
        accs = [bias] * rows
        for i in range(n_in):
            ok, row = valid[i]
            here, skip, join = f"c{c}r{i}", f"c{c}s{i}", f"c{c}j{i}"
            ir(f"br i1 {ok}, label %{here}, label %{skip}")
            ir.label(here)
            cur = list(accs)
            for kw in range(spec.KW):
                d = kw - spec.p_l
                base, start, limit = (0, ow0 + d // 2, We) if d % 2 == 0 else (We, ow0 + (d - 1) // 2, Wo)
                bits = [k < n and 0 <= start + k < limit for k in range(L)]
                if not any(bits):
                    continue
                v = _masked_row_load(ir, row, base + start, bits)
                for q in range(rows):
                    kh = i - 2 * q
                    if 0 <= kh < spec.KH:
                        nxt = ir.tmp("acc")
                        ir(f"{nxt} = call {vt} @llvm.fma.v{L}f32({vt} {v}, {vt} {wv[kh * spec.KW + kw]}, {vt} {cur[q]})")
                        cur[q] = nxt
            _dw_join(ir, here, skip, join, cur, accs, range(rows), vt)
        for q in range(rows):
            store(ir, _activation(ir, spec, accs[q], vt, L), narrow, q * spec.OW + ow0, n, L)
    ir("ret i32 0")
    return _dw_pairs_module(spec.name, ir, vt, L)


def dwrow_plane_ir(spec, vector_bits: int, narrow, store) -> str:
    """Stride-1 depthwise convolution of a whole small plane in one call (H x W input, output the
    same size: p_l + p_r = KW - 1, p_t + p_b = KH - 1), its outputs flat: vector v holds outputs
    j = v L .. v L + L - 1 (row j // W, column j % W), and tap (kh, kw) reads input j + (kh - p_t) W
    + (kw - p_l) under a compile-time mask of the lanes whose row and column fall inside the plane
    (MobileNetV2's 7 x 7 planes: 4 vectors for 49 outputs, where a vector a row takes 7). r0 is
    ignored (the plane starts at x[xoff]); y as `store` writes output j (dwrow_ir's arguments).
    The taps summed in dwrow_ir's order (kh, then kw): the same bits as its rows."""
    L = min(lanes_for(vector_bits), 16)
    vt = f"<{L} x float>"
    HW = spec.H * spec.W
    ir = IRBuilder()
    wv, bias, _ = _dw_prologue(ir, _Rows(KH=spec.KH, KW=spec.KW, rows=1 - spec.KH + 1, H=spec.H, W=spec.W),
                               "float", "i16" if narrow else "float", vt, L)
    for v in range(-(-HW // L)):
        acc = bias
        for kh in range(spec.KH):
            for kw in range(spec.KW):
                dr, dc = kh - spec.p_t, kw - spec.p_l
                bits = [j < HW and 0 <= j // spec.W + dr < spec.H and 0 <= j % spec.W + dc < spec.W
                        for j in range(v * L, v * L + L)]
                if not any(bits):
                    continue
                x = _masked_row_load(ir, "%xb", v * L + dr * spec.W + dc, bits)
                nxt = ir.tmp("acc")
                ir(f"{nxt} = call {vt} @llvm.fma.v{L}f32({vt} {x}, {vt} {wv[kh * spec.KW + kw]}, {vt} {acc})")
                acc = nxt
        store(ir, _activation(ir, spec, acc, vt, L), narrow, v * L, min(L, HW - v * L), L)
    ir("ret i32 0")
    return _dw_pairs_module(spec.name, ir, vt, L)


@dataclass(frozen=True)
class _Rows:
    """The fields _dw_prologue reads (dwrow_phase_ir: its input rows)."""
    KH: int
    KW: int
    rows: int
    H: int
    W: int


def dwrow_split_ir(spec: DwRowSpec, vector_bits: int, narrow=None, store=None) -> str:
    """DwRowSpec's stride-1 rows over bf16 input rows (y float32, or 16-bit with `narrow` as in
    dwrow_ir), 2L outputs a chunk. A load of 2L bf16 values seen as L 32-bit words gives the even
    columns as floats by a shift (`shl 16`) and the odd ones by a mask (`and 0xffff0000`): one op
    each, where widening lane by lane takes a zero-extension and a shift per L values, and each
    tap a lane shift. The outputs are summed as an even and an odd vector: output 2i reads column
    2i + kw (even column i + kw/2 for even kw, odd column i + (kw - 1)/2 for odd kw), output 2i + 1
    column 2i + 1 + kw (odd column i + kw/2, or even column i + (kw + 1)/2), each a lane shift of
    the two loads' columns; the pair is interleaved before the store. `store`: as dwrow_ir's."""
    assert spec.stride == 1 and spec.KW <= 7
    store = store or _dw_store
    L = min(lanes_for(vector_bits), 16)
    vt, it, ht = f"<{L} x float>", f"<{L} x i32>", f"<{2 * L} x i16>"
    y_elem, y_ir = ("i16", "i16") if narrow else ("float", "f32")
    splat = lambda v: "<" + ", ".join([f"i32 {v}"] * L) + ">"
    ir = IRBuilder()
    wv, bias, valid = _dw_prologue(ir, spec, "i16", y_elem, vt, L)
    rows = spec.rows
    for c in range(-(-spec.OW // (2 * L))):
        ow0, n = c * 2 * L, min(2 * L, spec.OW - c * 2 * L)
        base, need = ow0 - spec.p_l, n + spec.KW - 1   # the chunk reads columns base .. base + need - 1
        accs = {(q, par): bias for q in range(rows) for par in (0, 1)}
        for i in range(spec.KH + rows - 1):
            ok, row = valid[i]
            here, skip, join = f"c{c}r{i}", f"c{c}s{i}", f"c{c}j{i}"
            ir(f"br i1 {ok}, label %{here}, label %{skip}")
            ir.label(here)
            cur = dict(accs)
            halves = {}
            for part in (0, 1):   # columns base + 2L*part + k, k < 2L
                first = base + 2 * L * part
                bits = [first + k - base < need and 0 <= first + k < spec.W for k in range(2 * L)]
                if not any(bits):
                    halves[part] = ("zeroinitializer", "zeroinitializer")
                    continue
                p, v, words = ir.tmp("sp"), ir.tmp("seg"), ir.tmp("wd")
                ir(f"{p} = getelementptr i16, ptr {row}, i64 {first}")
                if all(bits):
                    ir(f"{v} = load {ht}, ptr {p}, align 2")
                else:
                    ir(f"{v} = call {ht} @llvm.masked.load.v{2 * L}i16.p0(ptr align 2 {p}, <{2 * L} x i1> "
                       f"{_const_mask(bits)}, {ht} zeroinitializer)")
                ir(f"{words} = bitcast {ht} {v} to {it}")
                even_bits, odd_bits, even, odd = ir.tmp("eb"), ir.tmp("ob"), ir.tmp("ev"), ir.tmp("od")
                ir(f"{even_bits} = shl {it} {words}, {splat(16)}")
                ir(f"{odd_bits} = and {it} {words}, {splat(-65536)}")
                ir(f"{even} = bitcast {it} {even_bits} to {vt}")
                ir(f"{odd} = bitcast {it} {odd_bits} to {vt}")
                halves[part] = (even, odd)

            def columns(parity, shift):
                """Lanes shift .. shift + L - 1 of the even (0) or odd (1) columns of both loads."""
                a, b = halves[0][parity], halves[1][parity]
                if shift == 0:
                    return a
                v = ir.tmp("tap")
                pick = ", ".join(f"i32 {shift + k}" for k in range(L))
                ir(f"{v} = shufflevector {vt} {a}, {vt} {b}, <{L} x i32> <{pick}>")
                return v
            taps = {}
            for kw in range(spec.KW):
                # even outputs: column 2i + kw; odd outputs: column 2i + 1 + kw
                taps[(0, kw)] = columns(kw % 2, kw // 2)
                taps[(1, kw)] = columns(1 - kw % 2, (kw + 1) // 2)
            for q in range(rows):
                if not 0 <= i - q < spec.KH:
                    continue
                for kw in range(spec.KW):
                    for par in (0, 1):
                        nxt = ir.tmp("acc")
                        ir(f"{nxt} = call {vt} @llvm.fma.v{L}f32({vt} {taps[(par, kw)]}, "
                           f"{vt} {wv[(i - q) * spec.KW + kw]}, {vt} {cur[(q, par)]})")
                        cur[(q, par)] = nxt
            _dw_join(ir, here, skip, join, cur, accs, sorted(accs), vt)
        for q in range(rows):
            even, odd = (_activation(ir, spec, accs[(q, par)], vt, L) for par in (0, 1))
            for part in range(-(-n // L)):   # outputs ow0 + L*part + j, j < L
                lanes = min(L, n - L * part)
                out = ir.tmp("il")
                pick = ", ".join(f"i32 {(L * part + j) // 2 + ((L * part + j) % 2) * L}" for j in range(L))
                ir(f"{out} = shufflevector {vt} {even}, {vt} {odd}, <{L} x i32> <{pick}>")
                store(ir, out, narrow, q * spec.OW + ow0 + L * part, lanes, L)
    ir("ret i32 0")
    head = (f"define i32 @{spec.name}(ptr noalias %x, i64 %xoff, i64 %r0, ptr noalias %w, i64 %woff, "
            f"ptr noalias %y, i64 %yoff) #0 {{")
    decls = [f"declare {vt} @llvm.fma.v{L}f32({vt}, {vt}, {vt})",
             f"declare {ht} @llvm.masked.load.v{2 * L}i16.p0(ptr, <{2 * L} x i1>, {ht})",
             f"declare void @llvm.masked.store.v{L}{y_ir}.p0(<{L} x {y_elem}>, ptr, <{L} x i1>)",
             f"declare {vt} @llvm.maxnum.v{L}f32({vt}, {vt})",
             f"declare {vt} @llvm.minnum.v{L}f32({vt}, {vt})"]
    return head + "\n" + "\n".join(ir.lines) + "\n}\n\n" + "\n".join(decls) + "\n\nattributes #0 = { nounwind }\n"


def _broadcast(ir: IRBuilder, scalar: str, vt: str, L: int) -> str:
    """A vector with every lane the float `scalar`."""
    ins = ir.tmp("ins")
    ir(f"{ins} = insertelement {vt} poison, float {scalar}, i64 0")
    splat = ir.tmp("bc")
    ir(f"{splat} = shufflevector {vt} {ins}, {vt} poison, <{L} x i32> zeroinitializer")
    return splat


def row_epilogue(ir: IRBuilder, spec: UKSpec, accs: dict, vt: str, L: int) -> dict:
    """act(acc + bias[row]) for every accumulator, selected by the epilogue bit (%epi)."""
    out = {}
    bias = {}
    for i in sorted({i for i, _ in accs}):
        if spec.bias:
            idx = ir.tmp("bi")
            ir(f"{idx} = add i64 %biasoff, {i}")
            p = ir.tmp("bp")
            ir(f"{p} = getelementptr float, ptr %bias, i64 {idx}")
            sc = ir.tmp("bv")
            ir(f"{sc} = load float, ptr {p}, align 4")
            bias[i] = _broadcast(ir, sc, vt, L)

    def splat(value: float) -> str:
        return f"<{', '.join([f'float {float_ir(value)}'] * L)}>"
    for (i, v), acc in accs.items():
        x = acc
        if spec.bias:
            y = ir.tmp("eb")
            ir(f"{y} = fadd {vt} {x}, {bias[i]}")
            x = y
        if spec.act == "Relu":
            y = ir.tmp("er")
            ir(f"{y} = call {vt} @llvm.maxnum.v{L}f32({vt} {x}, {vt} zeroinitializer)")
            x = y
        elif spec.act == "Clip":
            if spec.act_lo != float("-inf"):
                y = ir.tmp("elo")
                ir(f"{y} = call {vt} @llvm.maxnum.v{L}f32({vt} {x}, {vt} {splat(spec.act_lo)})")
                x = y
            if spec.act_hi != float("inf"):
                y = ir.tmp("ehi")
                ir(f"{y} = call {vt} @llvm.minnum.v{L}f32({vt} {x}, {vt} {splat(spec.act_hi)})")
                x = y
        else:
            assert spec.act == "", spec.act
        sel = ir.tmp("e")
        ir(f"{sel} = select i1 %epi, {vt} {x}, {vt} {acc}")
        out[i, v] = sel
    return out


def float_ir(value: float) -> str:
    """A float32 constant as LLVM IR writes it: the double with the same value, in hex."""
    as_f32 = struct.unpack("f", struct.pack("f", value))[0]
    return "0x" + struct.pack(">d", as_f32).hex().upper()


EPILOGUE_ACTIVATIONS = ("",) + REGISTER_ACTIVATIONS   # what the micro-kernel's epilogue computes in registers


PREFETCH_A_BYTES = 2048   # packed A (weights, streamed from L3/DRAM): this far ahead
PREFETCH_B_ROWS = 8       # B rows (rows mode): this many k ahead, unless the spec's prefetch_b names a distance


def _prefetches(ir: IRBuilder, spec: UKSpec, kv: str, arow: dict, brow: str, T: int, P: int) -> None:
    """Software prefetches in the K loop (first column chunk only): hardware prefetchers stop at
    4 KiB pages, and weights in a library's read-only data live in 4 KiB pages. B rows are
    prefetched `spec.prefetch_b` rows ahead when that is more than 1 (a distance that covers a
    memory access, for packed weights that stream from DRAM), else PREFETCH_B_ROWS."""
    if spec.a_packed:
        per_k = (T or 1) * P                  # floats of A one iteration reads
        base = ir.tmp("pfa")
        ir(f"{base} = mul i64 {kv}, {per_k}")
        for j in range(max(1, -(-per_k * 4 // 64))):
            p = ir.tmp("pfp")
            ir(f"{p} = getelementptr float, ptr {arow[0]}, i64 {base}")
            q = ir.tmp("pfq")
            ir(f"{q} = getelementptr i8, ptr {p}, i64 {PREFETCH_A_BYTES + 64 * j}")
            ir(f"call void @llvm.prefetch.p0(ptr {q}, i32 0, i32 3, i32 1)")
    if not T and spec.prefetch_b:
        ahead = ir.tmp("pfb")
        ir(f"{ahead} = mul i64 %ldb, {spec.prefetch_b if spec.prefetch_b > 1 else PREFETCH_B_ROWS}")
        p = ir.tmp("pfp")
        ir(f"{p} = getelementptr float, ptr {brow}, i64 {ahead}")
        for j in range(-(-spec.nr * 4 // 64)):
            q = ir.tmp("pfq")
            ir(f"{q} = getelementptr i8, ptr {p}, i64 {64 * j}")
            ir(f"call void @llvm.prefetch.p0(ptr {q}, i32 0, i32 3, i32 1)")


def ir_mul(ir: IRBuilder, var: str, factor: int) -> str:
    if factor == 1:
        return var
    t = ir.tmp("mul")
    ir(f"{t} = mul i64 {var}, {factor}")
    return t

