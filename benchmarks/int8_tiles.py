"""The int8 conv micro-kernels alone: each tile (ukernel_int8.Int8ConvSpec, pixels in the lanes;
Int8RowConvSpec, channels in the lanes) called from an LLVM loop n times on data that stays in L1,
GOP/s of CPU time (`time.process_time`, best of 5), next to the `vpdpbusd` peak of
benchmarks/peak_lowp.py: what a tile shape can reach on this core before the convolution around it
(copies, grid columns that are no output, cache misses) takes its share.

    python benchmarks/int8_tiles.py [--quads 16,64,128]

A 3x3 conv's taps on a 16-wide grid, `--quads` channel quads (K = 4 x quads x 9); the 7x7 stem's
im2col tile: 37 quads, one tap.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.numba_cpu.hostjit import HostJit  # noqa: E402
from backends.numba_cpu.ukernel_int8 import Int8ConvSpec, Int8RowConvSpec, int8_ir  # noqa: E402
from backends.targets import resolve_target  # noqa: E402


def tile_gops(spec, kc: int, calls: int = 2000) -> float:
    """GOP/s of `calls` calls of the tile (kc quads), data in L1."""
    host = resolve_target("native")
    jit = HostJit(host.cpu, host.features, 512)
    rows = isinstance(spec, Int8RowConvSpec)
    mask = "" if rows else "i64 -1, "
    call = (f"call i32 @{spec.name}(ptr %w, i64 0, ptr %x, i64 0, ptr %y, i64 0, i64 64, i64 {kc}, {mask}"
            f"ptr %comp, ptr %mult, i64 0)")
    loop = f"""
define void @bench(i64 %n, ptr %w, ptr %x, ptr %y, ptr %comp, ptr %mult) #0 {{
entry:
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %in, %loop ]
  %r = {call}
  %in = add i64 %i, 1
  %c = icmp slt i64 %in, %n
  br i1 %c, label %loop, label %done
done:
  ret void
}}
"""
    jit.add(int8_ir(spec).replace("\nattributes #0", loop + "\nattributes #0", 1))
    bench = jit.function("bench", None, ctypes.c_int64, *[ctypes.c_void_p] * 5)
    taps = len(spec.taps)
    buffers = [np.ones(kc * taps * 64 * 4, np.int8), np.ones(kc * spec.plane * 4 + 4096, np.uint8),
               np.zeros(1 << 16, np.uint8), np.zeros(256, np.int32), np.full(256, 0.01, np.float32)]
    args = [b.ctypes.data for b in buffers]
    bench(calls // 10, *args)
    best = 0.0
    for _ in range(5):
        t = time.process_time()
        bench(calls, *args)
        best = max(best, 2 * spec.mr * spec.nr * kc * 4 * taps * calls / (time.process_time() - t) / 1e9)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quads", default="16,64")
    args = parser.parse_args(argv)
    grid = 16
    taps = tuple(kh * grid + kw for kh in range(3) for kw in range(3))
    for kc in (int(q) for q in args.quads.split(",")):
        for mr, nr in ((6, 64), (8, 48), (12, 32), (24, 16)):
            spec = Int8ConvSpec(mr=mr, nr=nr, taps=taps, plane=grid * grid, panel=mr)
            print(f"pixel lanes   {mr:2d}x{nr}, 3x3, {kc:3d} quads: {tile_gops(spec, kc):6.0f} GOP/s", flush=True)
        for mr, nr in ((7, 32), (12, 32), (4, 64)):
            spec = Int8RowConvSpec(mr=mr, nr=nr, taps=taps, plane=grid * grid)
            print(f"channel lanes {mr:2d}x{nr}, 3x3, {kc:3d} quads: {tile_gops(spec, kc):6.0f} GOP/s", flush=True)
    spec = Int8ConvSpec(mr=8, nr=48, taps=(0,), plane=48, panel=8)
    print(f"stem (im2col)  8x48, 1 tap,  37 quads: {tile_gops(spec, 37):6.0f} GOP/s", flush=True)


if __name__ == "__main__":
    main()
