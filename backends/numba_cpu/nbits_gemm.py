"""MatMulNBits with many rows (a prefill): dequantise a panel, then the float32 GEMM micro-kernel.

nbits.py's kernel unpacks the codes in registers for every tile of at most 4 rows, which is right
for a decode step (M = 1: the weights are read once) but unpacks them M / 4 times for a prompt of
M tokens. Here, from M >= MIN_ROWS on, the weights are dequantised once per panel for all rows:

    for each column group g (64 columns, nbits.py's layout for M = 1: the same packed bytes)
        for each pass of kc values of k (whole blocks)
            panel[k][j] = (q[n, k] - zp[n, b]) * scale[n, b]      (scratch, kc x 64 floats: in L1/L2)
            C[rows, g] (+)= A[rows, k pass] @ panel               (micro-kernel UKSpec 6 x 64, all rows)

Each weight is rounded once, fl((q - zp) * scale), as onnxruntime's float path dequantises, and the
products accumulate in float32 as a float32 MatMul does (tests/test_nbits.py's bound holds: the
terms are the same, the order of the sums differs). Work items are runs of column groups, each
with its own scratch panel. Not for: bias, act-order (g_idx), float16 scales (nbits.py then).
"""
from __future__ import annotations

import numpy as np

from .gemm import UK_MR, UK_NR, ceil_div
from backends.targets import has_feature
from cuvil import nbits as form

from . import nbits, nbits_vnni
from .emit import NOALIAS_MARK
from .kernel import Kernel, KernelCall, Lowered, Source, kernel_header, literal, lowering_target, work_items
from .nbits import LANES, f16_exact, group_widths, pack
from .scratch import scratch_value
from .ukernel import UKSpec

MIN_ROWS = 16          # fewer rows: nbits.py's kernel (it reads the codes once per 4 rows)
KC_TARGET = 256        # k values per pass (as the float32 GEMM's)
V = UK_NR // LANES     # 16-column vectors per group: nbits.py's M = 1 layout has 4


def lower_matmul_nbits(node, graph) -> Lowered:
    """MatMulNBits: this module's form from MIN_ROWS rows on (when it applies), else nbits.py's."""
    form.check(node, graph.values)
    weight, perm = form.in_block_order(form.decode(node, graph.values))
    a = graph.values[node.inputs[0]]
    M = int(np.prod(a.shape[:-1], dtype=np.int64)) if len(a.shape) > 1 else 1
    target = lowering_target()
    f16 = f16_exact(weight.scales) and (target is None or has_feature(target, "f16c"))
    if nbits_vnni.applies(node, weight, perm):   # accuracy_level 4, 4 bits, AVX512-VNNI: any M
        return nbits_vnni.lower(node, graph, weight)
    if M >= MIN_ROWS and weight.bias is None and perm is None and not f16 and weight.K % 2 == 0:
        calls, a_name = [], node.inputs[0]
        if form.int8_activations(node, weight):   # accuracy_level 4: A quantised to int8 first (nbits.py)
            call, a_name = nbits.int8_activation_call(node, graph, a_name, M, weight.K, weight.block_size)
            calls.append(call)
        return Lowered(calls + [_panel_call(node, graph, weight, M, a_name)])
    return nbits.lower_matmul_nbits(node, graph, decoded=(weight, perm))


def _panel_call(node, graph, weight, M: int, a_name: str) -> KernelCall:
    K, N, bits, block = weight.K, weight.N, weight.bits, weight.block_size
    arrays = pack(weight, V, False)
    widths = group_widths(N, V)
    groups = len(widths)
    kb = weight.k_blocks
    kc = max(block, KC_TARGET // block * block)
    per_code = 2 if bits == 4 else 1                 # k values per byte
    w_group = kb * block // per_code * UK_NR         # bytes of codes of a full group
    items = min(groups, work_items())
    slot = kc * UK_NR
    scratch = scratch_value(graph, node, (items * slot,), np.float32, tag="nbits_panel")
    zp_kind = "const" if weight.zero_points is None else ("u8" if weight.zero_points.dtype == np.uint8 else "f32")
    nibbles = zp_kind == "u8" and bits == 4
    args = [a_name, arrays["w"], arrays["s"]]
    types = ["float32", "uint8", "float32"]
    if arrays["z"] is not None:
        args.append(arrays["z"])
        types.append(arrays["z"].dtype.name)
    pz = "p3" if arrays["z"] is not None else None
    outs = [scratch] + ([scratch_value(graph, node, (items * UK_NR,), np.float32, tag="nbits_zp")] if nibbles else [])
    pw = f"p{len(args)}"
    pr = f"p{len(args) + 1}" if nibbles else None
    po = f"p{len(args) + len(outs)}"
    args += outs + [node.outputs[0]]
    types += ["float32"] * (len(outs) + 1)
    specs = {mr: (f"uk{mr}", UKSpec(mr=mr, nr=UK_NR, a_packed=0, a_panel=0, prefetch_b=0))
             for mr in sorted({UK_MR, M % UK_MR} - {0})}
    F = lambda v: literal(v, np.float32)  # noqa: E731

    src = Source().line(NOALIAS_MARK)   # A, codes, scales, the scratch panels and Y are distinct buffers
    for var, spec in sorted(specs.values()):
        for line in spec.declaration(var).splitlines():
            src.line(line)
    src.line(kernel_header(len(args))).indent()
    src.line("for item in range(begin, end):").indent()
    src.line(f"g_lo = item * {groups} // {items}").line(f"g_hi = (item + 1) * {groups} // {items}")
    src.line(f"panel = item * {slot}")
    if nibbles:
        src.line(f"zrow = item * {UK_NR}")
    src.line("for g in range(g_lo, g_hi):").indent()
    last_w = widths[-1]
    src.line(f"wg = {UK_NR} if g < {groups - 1} else {last_w}")
    src.line(f"nv = {UK_NR} if g < {groups - 1} else {N - (groups - 1) * UK_NR}")
    src.line(f"mask = np.int64(-1) if nv >= {UK_NR} else (np.int64(1) << nv) - np.int64(1)")
    src.line(f"wbase = g * {w_group}").line(f"sbase = g * {kb * UK_NR}")
    src.line(f"for k0 in range(0, {K}, {kc}):").indent()
    src.line(f"kcur = min({kc}, {K} - k0)")
    # dequantise k0 .. k0 + kcur into the panel, a block at a time
    src.line(f"for bk in range(k0, k0 + kcur, {block}):").indent()
    src.line(f"b = bk // {block}").line("srow = sbase + b * wg")
    if zp_kind == "const":
        zero = F(1 << (bits - 1))
    elif zp_kind == "f32":
        zero = f"{pz}[srow + j]"
    elif nibbles:   # in each 16 entries of the group's [b][j], byte e holds e and e + 8
        src.line("for j in range(wg):").indent()
        src.line("e = srow + j").line(f"byte = {pz}[(e // 16) * 8 + (e % 8)]")
        src.line(f"{pr}[zrow + j] = np.float32((byte >> 4) if (e % 16) >= 8 else (byte & 15))").dedent()
        zero = f"{pr}[zrow + j]"
    else:
        zero = f"np.float32({pz}[srow + j])"
    src.line(f"kend = min(bk + {block}, k0 + kcur)")
    if bits == 4:
        src.line("for k in range(bk, kend, 2):").indent()
        src.line("wrow = wbase + (k >> 1) * wg").line(f"dst = panel + (k - k0) * {UK_NR}")
        src.line("for j in range(wg):").indent()
        src.line("code = p1[wrow + j]").line("sc = p2[srow + j]").line(f"z = {zero}")
        src.line(f"{pw}[dst + j] = (np.float32(code & 15) - z) * sc")
        src.line(f"{pw}[dst + {UK_NR} + j] = (np.float32(code >> 4) - z) * sc")
        src.dedent().dedent()
    else:
        src.line("for k in range(bk, kend):").indent()
        src.line("wrow = wbase + k * wg").line(f"dst = panel + (k - k0) * {UK_NR}")
        src.line("for j in range(wg):").indent()
        src.line(f"{pw}[dst + j] = (np.float32(p1[wrow + j]) - {zero}) * p2[srow + j]")
        src.dedent().dedent()
    src.dedent()
    # every row through the panel
    src.line("lc = min(k0, 1)").line(f"n0 = g * {UK_NR}")
    full = M - M % UK_MR
    src.line(f"for m in range(0, {full}, {UK_MR}):").indent()
    src.line(f"{specs[UK_MR][0]}(p0, m * {K} + k0, {K}, {pw}, panel, {UK_NR}, {po}, m * {N} + n0, {N}, kcur, mask, "
             f"lc, p0, 0)")
    src.dedent()
    if M % UK_MR:
        src.line(f"{specs[M % UK_MR][0]}(p0, {full * K} + k0, {K}, {pw}, panel, {UK_NR}, {po}, {full * N} + n0, {N}, "
                 f"kcur, mask, lc, p0, 0)")
    kernel = Kernel("matmulnbits_panel", src.text(), tuple(types), self_sized=True)
    label = f"int{bits} weights, block {block}, dequantised panels"
    return KernelCall(kernel, args, items, node.name, n_outputs=len(outs) + 1, precision=label)
