"""Single-core bf16 peak of this machine next to the float32 one (benchmarks/peak.py): an LLVM IR
loop of independent `vdpbf16ps` (AVX512-BF16; 16 float32 lanes, each adding two bf16 products:
64 FLOP an instruction), 24 accumulators, no memory traffic, JIT-compiled by llvmlite for the
host CPU, timed as peak.py times its FMA loop (best of several ~0.3 s runs). Every instruction
reads the same two bf16 vectors: with a constant per accumulator the constants took the registers
and the loop reloaded them (a "peak" of 150-180 GFLOP/s on Zen 4 against 231).

    python benchmarks/peak_lowp.py       # prints both peaks in GFLOP/s, and the int8 one in GOP/s
                                         # (CPU time of this process: time.process_time)

The int8 peak is the same loop of AVX512-VNNI `vpdpbusd` (16 int32 lanes, each adding 4 u8 x s8
products: 128 OP an instruction), measured over a range of independent accumulators: with a
latency of L cycles and P instructions a cycle, fewer than L * P accumulators leave the loop
latency-bound, which tells L and P apart (a tile needs at least that many accumulators).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import peak  # noqa: E402

ACCUMULATORS = 24
FLOPS_PER_DPBF16 = 16 * 2 * 2   # lanes x products a lane x (multiply, add)


def _loop_module(accs: int, cpu: str, features: str, vt: str, dot, decl: str, add: str) -> str:
    """`i64 @peak(i64 n, ptr out)`: n iterations of `accs` independent accumulators (vt), each
    acc = dot(acc name) a step; the sum (`add`) stored at the end, so nothing is dead."""
    lines = ["define i64 @peak(i64 %n, ptr %out) #0 {", "entry:", "  br label %loop", "loop:",
             "  %i = phi i64 [ 0, %entry ], [ %i.next, %loop ]"]
    lines += [f"  %a{a} = phi {vt} [ zeroinitializer, %entry ], [ %b{a}, %loop ]" for a in range(accs)]
    lines += [f"  %b{a} = {dot(f'%a{a}')}" for a in range(accs)]
    lines += ["  %i.next = add i64 %i, 1", "  %c = icmp slt i64 %i.next, %n", "  br i1 %c, label %loop, label %done",
              "done:"]
    acc = "%b0"
    for a in range(1, accs):
        lines.append(f"  %s{a} = {add} {vt} {acc}, %b{a}")
        acc = f"%s{a}"
    lines += [f"  store {vt} {acc}, ptr %out, align 4", "  ret i64 0", "}", decl,
              f'attributes #0 = {{ "target-cpu"="{cpu}" "target-features"="{features}" "prefer-vector-width"="512" }}']
    return "\n".join(lines) + "\n"


def _module(accs: int, cpu: str, features: str) -> str:
    vt, bt = "<16 x float>", "<32 x bfloat>"
    splat = lambda bits: "<" + ", ".join([f"bfloat 0xR{bits:04X}"] * 32) + ">"
    name = "@llvm.x86.avx512bf16.dpbf16ps.512"
    return _loop_module(accs, cpu, features, vt,
                        lambda acc: f"call {vt} {name}({vt} {acc}, {bt} {splat(0x3F80)}, {bt} {splat(0x3580)})",
                        f"declare {vt} {name}({vt}, {bt}, {bt})", "fadd")


OPS_PER_VPDPBUSD = 16 * 4 * 2   # lanes x products a lane x (multiply, add)


def _int8_module(accs: int, cpu: str, features: str) -> str:
    vi = "<16 x i32>"
    splat = lambda word: "<" + ", ".join([f"i32 {word}"] * 16) + ">"
    name = "@llvm.x86.avx512.vpdpbusd.512"
    return _loop_module(accs, cpu, features, vi,
                        lambda acc: f"call {vi} {name}({vi} {acc}, {vi} {splat(0x01020304)}, {vi} {splat(0x01FF01FF)})",
                        f"declare {vi} {name}({vi}, {vi}, {vi})", "add")


def measure_int8(accumulators=(2, 4, 6, 8, 12, 16, 24), seconds: float = 0.3, repeats: int = 5) -> dict | None:
    """{accumulators: GOP/s of the vpdpbusd loop, by CPU time}; None where the CPU has no AVX512-VNNI."""
    cpu, features = peak.host_cpu()
    if "+avx512vnni" not in features.split(","):
        return None
    return {accs: peak.time_loop(_int8_module(accs, cpu, features), OPS_PER_VPDPBUSD * accs, cpu, features, seconds,
                                 repeats, time.process_time) for accs in accumulators}


def measure(seconds: float = 0.3, repeats: int = 5, timer=time.perf_counter) -> dict:
    """{"gflops": bf16 peak, "cpu": ...}; None where the CPU has no AVX512-BF16."""
    cpu, features = peak.host_cpu()
    if "+avx512bf16" not in features.split(","):
        return None
    ir = _module(ACCUMULATORS, cpu, features)
    return {"gflops": peak.time_loop(ir, FLOPS_PER_DPBF16 * ACCUMULATORS, cpu, features, seconds, repeats, timer),
            "cpu": cpu}


if __name__ == "__main__":
    # by CPU time: on cores shared with other work the wall clock also counts the waits for one
    f32 = peak.measure(timer=time.process_time)
    bf16 = measure(timer=time.process_time)
    print(f"single-core FP32 FMA peak:       {f32['gflops']:.1f} GFLOP/s ({f32['lanes']}-lane FMA, LLVM cpu {f32['cpu']})")
    if bf16 is None:
        print("single-core BF16 vdpbf16ps peak: (no AVX512-BF16 on this CPU)")
    else:
        print(f"single-core BF16 vdpbf16ps peak: {bf16['gflops']:.1f} GFLOP/s ({bf16['gflops'] / f32['gflops']:.2f}x FP32)")
    int8 = measure_int8()
    if int8 is None:
        print("single-core INT8 vpdpbusd peak:  (no AVX512-VNNI on this CPU)")
    else:
        for accs, gops in int8.items():
            print(f"single-core INT8 vpdpbusd, {accs:2d} accumulators: {gops:6.1f} GOP/s "
                  f"({gops / f32['gflops']:.2f}x FP32)")
