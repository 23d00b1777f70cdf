"""Single-core FP32 FMA peak of this machine: an LLVM IR loop of independent
vector FMAs (24 accumulators, no memory traffic), JIT-compiled by llvmlite
for the host CPU, timed over ~0.3 s, best of several runs.

    python benchmarks/peak.py            # prints GFLOP/s and the vector width used
"""
from __future__ import annotations

import ctypes
import time

import llvmlite.binding as llvm


def _module(lanes: int, accs: int) -> str:
    vt = f"<{lanes} x float>"
    lines = ["define i64 @peak(i64 %n, ptr %out) #0 {", "entry:", "  br label %loop", "loop:",
             "  %i = phi i64 [ 0, %entry ], [ %i.next, %loop ]"]
    for a in range(accs):
        lines.append(f"  %a{a} = phi {vt} [ <{', '.join(f'float {1.0 + a * 0.0078125!r}' for _ in range(lanes))}>, %entry ], "
                     f"[ %b{a}, %loop ]")
    for a in range(accs):
        lines.append(f"  %b{a} = call {vt} @llvm.fma.v{lanes}f32({vt} %a{a}, {vt} <{', '.join(['float 0x3FEFFFFFE0000000'] * lanes)}>, "
                     f"{vt} <{', '.join(['float 0x3E80000000000000'] * lanes)}>)")
    lines += ["  %i.next = add i64 %i, 1", "  %c = icmp slt i64 %i.next, %n", "  br i1 %c, label %loop, label %done", "done:"]
    acc = "%b0"
    for a in range(1, accs):
        lines.append(f"  %s{a} = fadd {vt} {acc}, %b{a}")
        acc = f"%s{a}"
    lines += [f"  store {vt} {acc}, ptr %out, align 4", "  ret i64 0", "}",
              f"declare {vt} @llvm.fma.v{lanes}f32({vt}, {vt}, {vt})"]
    return "\n".join(lines) + "\n"


def time_loop(ir: str, flops_per_iteration: int, cpu: str, features: str, seconds: float = 0.3,
              repeats: int = 5, timer=time.perf_counter) -> float:
    """GFLOP/s of `i64 @peak(i64 n, ptr out)` (n iterations of flops_per_iteration), JIT-compiled for
    cpu/features: n doubled until one call takes seconds/4, then the best of `repeats` calls.
    `timer`: time.process_time counts only the time this process ran (on cores shared with other
    work the wall clock also counts the time it waited for one)."""
    mod = llvm.parse_assembly(ir)
    tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=features, opt=2)
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)(engine.get_function_address("peak"))
    out = (ctypes.c_float * 16)()
    n = 1 << 16
    while True:
        t = timer()
        fn(n, out)
        if timer() - t > seconds / 4:
            break
        n *= 2
    best = 0.0
    for _ in range(repeats):
        t = timer()
        fn(n, out)
        dt = timer() - t
        best = max(best, flops_per_iteration * n / dt / 1e9)
    return best


def host_cpu() -> tuple[str, str]:
    """LLVM's name and feature string of this machine's CPU."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def measure(seconds: float = 0.3, repeats: int = 5, timer=time.perf_counter) -> dict:
    cpu, features = host_cpu()
    lanes = 16 if "+avx512f" in features.split(",") else 8 if "+avx2" in features.split(",") else 4
    accs = 24 if lanes == 16 else 12
    ir = _module(lanes, accs) + (f'attributes #0 = {{ "target-cpu"="{cpu}" "target-features"="{features}" '
                                 f'"prefer-vector-width"="{lanes * 32}" }}\n')
    best = time_loop(ir, 2 * lanes * accs, cpu, features, seconds, repeats, timer)
    return {"gflops": best, "lanes": lanes, "cpu": cpu}


if __name__ == "__main__":
    r = measure()
    print(f"single-core FP32 FMA peak: {r['gflops']:.1f} GFLOP/s ({r['lanes']}-lane FMA, LLVM cpu {r['cpu']})")
