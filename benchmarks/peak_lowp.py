"""Single-core bf16 peak of this machine next to the float32 one (benchmarks/peak.py): an LLVM IR
loop of independent `vdpbf16ps` (AVX512-BF16; 16 float32 lanes, each adding two bf16 products:
64 FLOP an instruction), 24 accumulators, no memory traffic, JIT-compiled by llvmlite for the
host CPU, timed as peak.py times its FMA loop (best of several ~0.3 s runs). Every instruction
reads the same two bf16 vectors: with a constant per accumulator the constants took the registers
and the loop reloaded them (a "peak" of 150-180 GFLOP/s on Zen 4 against 231).

    python benchmarks/peak_lowp.py       # prints both peaks in GFLOP/s
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import peak  # noqa: E402

ACCUMULATORS = 24
FLOPS_PER_DPBF16 = 16 * 2 * 2   # lanes x products a lane x (multiply, add)


def _module(accs: int, cpu: str, features: str) -> str:
    vt, bt = "<16 x float>", "<32 x bfloat>"
    splat = lambda bits: "<" + ", ".join([f"bfloat 0xR{bits:04X}"] * 32) + ">"
    lines = ["define i64 @peak(i64 %n, ptr %out) #0 {", "entry:", "  br label %loop", "loop:",
             "  %i = phi i64 [ 0, %entry ], [ %i.next, %loop ]"]
    lines += [f"  %a{a} = phi {vt} [ zeroinitializer, %entry ], [ %b{a}, %loop ]" for a in range(accs)]
    lines += [f"  %b{a} = call {vt} @llvm.x86.avx512bf16.dpbf16ps.512({vt} %a{a}, {bt} {splat(0x3F80)}, "
              f"{bt} {splat(0x3580)})" for a in range(accs)]
    lines += ["  %i.next = add i64 %i, 1", "  %c = icmp slt i64 %i.next, %n", "  br i1 %c, label %loop, label %done",
              "done:"]
    acc = "%b0"
    for a in range(1, accs):
        lines.append(f"  %s{a} = fadd {vt} {acc}, %b{a}")
        acc = f"%s{a}"
    lines += [f"  store {vt} {acc}, ptr %out, align 4", "  ret i64 0", "}",
              f"declare {vt} @llvm.x86.avx512bf16.dpbf16ps.512({vt}, {bt}, {bt})",
              f'attributes #0 = {{ "target-cpu"="{cpu}" "target-features"="{features}" "prefer-vector-width"="512" }}']
    return "\n".join(lines) + "\n"


def measure(seconds: float = 0.3, repeats: int = 5) -> dict:
    """{"gflops": bf16 peak, "cpu": ...}; None where the CPU has no AVX512-BF16."""
    cpu, features = peak.host_cpu()
    if "+avx512bf16" not in features.split(","):
        return None
    ir = _module(ACCUMULATORS, cpu, features)
    return {"gflops": peak.time_loop(ir, FLOPS_PER_DPBF16 * ACCUMULATORS, cpu, features, seconds, repeats), "cpu": cpu}


if __name__ == "__main__":
    f32 = peak.measure()
    bf16 = measure()
    print(f"single-core FP32 FMA peak:       {f32['gflops']:.1f} GFLOP/s ({f32['lanes']}-lane FMA, LLVM cpu {f32['cpu']})")
    if bf16 is None:
        print("single-core BF16 vdpbf16ps peak: (no AVX512-BF16 on this CPU)")
    else:
        print(f"single-core BF16 vdpbf16ps peak: {bf16['gflops']:.1f} GFLOP/s ({bf16['gflops'] / f32['gflops']:.2f}x FP32)")
