"""Throughput of the 16-bit-output bf16 conv micro-kernels alone (ukernel_lowp.LowpOut16Spec), JIT
compiled for this CPU and called from a loop in LLVM IR (no driver, no Numba), timed by the
thread's CPU time (a shared machine's waits left out):

    planar MR,NR,K,PIXELS,PANELS   a 1x1 conv reading bf16 X in place (b_planar): PANELS row tiles
                                   of MR channels per NR-pixel tile, K input channels, PIXELS a plane
    transposed PIXELS,K,PANELS     conv1x1t.py's tile: rows of 7 pixels x 48 channels over K, PANELS
                                   48-channel panels, PIXELS a plane (a multiple of 7)

Both with bias + a bf16 residual + Relu; `--cvt` picks the rounding (exact, exact-not-nan, hw).

    python benchmarks/lowp16_tiles.py planar 8,48,64,3136,8 planar 8,48,256,3136,8 --cvt exact
    python benchmarks/lowp16_tiles.py transposed 49,512,43 --cvt exact-not-nan
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK = 550.0   # GFLOP/s of one core's vdpbf16ps on the Zen 5 machine (docs/performance.md)

LOOP = """
define void @bench(ptr %a, ptr %b, ptr %c, ptr %r, ptr %bias, i64 %tiles, i64 %reps, i64 %k2, i64 %ldb, i64 %ldc,
                   i64 %bstep, i64 %astep, i64 %cstep, i64 %ctile, i64 %panels) {{
entry:
  br label %rep
rep:
  %i = phi i64 [0, %entry], [%i1, %repend]
  br label %tile
tile:
  %t = phi i64 [0, %rep], [%t1, %tileend]
  %boff = mul i64 %t, %bstep
  %ct = mul i64 %t, %ctile
  br label %pan
pan:
  %p = phi i64 [0, %tile], [%p1, %pan]
  %aoff = mul i64 %p, %astep
  %cp = mul i64 %p, %cstep
  %co = add i64 %cp, %ct
  %x = call i32 @{name}(ptr %a, i64 %aoff, i64 0, ptr %b, i64 %boff, i64 %ldb, ptr %c, i64 %co, i64 %ldc, i64 %k2,
                        i64 -1, i64 2, ptr %bias, i64 0, ptr %r, i64 %co)
  %p1 = add i64 %p, 1
  %pd = icmp slt i64 %p1, %panels
  br i1 %pd, label %pan, label %tileend
tileend:
  %t1 = add i64 %t, 1
  %td = icmp slt i64 %t1, %tiles
  br i1 %td, label %tile, label %repend
repend:
  %i1 = add i64 %i, 1
  %d = icmp slt i64 %i1, %reps
  br i1 %d, label %rep, label %out
out:
  ret void
}}
"""


def compiled(spec):
    import llvmlite.binding as llvm
    from backends.numba_cpu.ukernel_lowp import lowp_ukernel_ir
    from backends.targets import init_llvm
    init_llvm()
    cpu = llvm.get_host_cpu_name()
    ir = lowp_ukernel_ir(spec, 512).replace("attributes #0 = {", f'attributes #0 = {{ "target-cpu"="{cpu}" '
                                                                '"prefer-vector-width"="512" ', 1)
    module = llvm.parse_assembly(ir + LOOP.format(name=spec.name))
    machine = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, opt=3)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    P, I = ctypes.c_void_p, ctypes.c_int64
    return ctypes.CFUNCTYPE(None, P, P, P, P, P, *[I] * 10)(engine.get_function_address("bench")), engine


def measure(mode: str, shape: str, cvt: str, batches: int = 30) -> str:
    from backends.numba_cpu.ukernel_lowp import LowpOut16Spec
    rng = np.random.default_rng(0)
    bits = lambda n: rng.integers(0x3C00, 0x3F80, size=n).astype(np.uint16)   # bf16 in [2^-7, 1)
    common = dict(dtype="bf16", method="dpbf16", a_packed=1, bias=1, residual=1, cvt=cvt, act="Relu")
    if mode == "planar":
        mr, nr, K, pixels, panels = map(int, shape.split(","))
        spec = LowpOut16Spec(mr=mr, nr=nr, a_panel=mr, taps=(0,), b_planar=1, **common)
        tiles, K2 = pixels // nr, K // 2
        a, b = bits(panels * K2 * 2 * mr + 64), bits(K2 * 2 * pixels + 4 * nr)
        c = np.zeros(panels * mr * pixels + 64, np.uint16)
        args = (tiles, K2, 2 * pixels, pixels, nr, K2 * 2 * mr, mr * pixels, nr, panels)
        flops = 2 * mr * nr * K * tiles * panels
    else:
        pixels, K, panels = map(int, shape.split(","))
        spec = LowpOut16Spec(mr=7, nr=48, a_panel=pixels, c_transposed=1, **common)
        K2 = K // 2
        a, b = bits(K2 * 2 * pixels + 64), bits(panels * K2 * 96 + 64)
        c = np.zeros(panels * 48 * pixels + 64, np.uint16)
        # "tiles" are the 48-channel panels (B and C move), "panels" the 7-pixel rows (A and C move)
        args = (panels, K2, 96, pixels, K2 * 96, 14, 7, 48 * pixels, pixels // 7)
        flops = 2 * pixels * 48 * K * panels
    fn, engine = compiled(spec)
    r, bias = np.zeros_like(c), np.zeros(64, np.float32)
    ptrs = [x.ctypes.data for x in (a, b, c, r, bias)]
    fn(*ptrs, args[0], 1, *args[1:])
    best = float("inf")
    for _ in range(batches):
        start = time.thread_time()
        fn(*ptrs, args[0], 5, *args[1:])
        best = min(best, (time.thread_time() - start) / 5)
    return f"{mode} {shape} cvt={cvt}: {best * 1e3:.3f} ms, {flops / best / 1e9:.0f} GFLOP/s, " \
           f"{flops / best / 1e9 / PEAK * 100:.0f} % of {PEAK:.0f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="pairs: planar|transposed SHAPE")
    parser.add_argument("--cvt", default="exact", choices=("exact", "exact-not-nan", "hw"))
    args = parser.parse_args(argv)
    for mode, shape in zip(args.cases[::2], args.cases[1::2]):
        print(measure(mode, shape, args.cvt), flush=True)


if __name__ == "__main__":
    main()
