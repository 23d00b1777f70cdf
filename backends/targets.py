"""The CPU targets a variant can be built for.

LLVM is told the CPU and features explicitly (never "whatever this machine
is", except for `native`), and AVX-512 targets ask for 512-bit vectors: LLVM's
default on AVX-512 CPUs is to prefer 256-bit ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from cuvil.errors import CuvilError


# L1 data cache ways of Haswell, Skylake and AMD Zen 4 (Ice Lake and later Intel cores have 12): the
# named targets' value, and native's when the machine does not say.
DEFAULT_L1D_WAYS = 8


@dataclass(frozen=True)
class CpuTarget:
    name: str
    triple: str
    cpu: str
    features: str
    vector_bits: int  # preferred vector width handed to LLVM
    gcc_flags: tuple[str, ...]  # for the C driver
    l1d_ways: int = DEFAULT_L1D_WAYS  # associativity of the L1 data cache (kernels avoid reading more aliasing rows)

    def as_key(self) -> dict:
        return {"name": self.name, "triple": self.triple, "cpu": self.cpu, "features": self.features,
                "vector_bits": self.vector_bits, "gcc_flags": list(self.gcc_flags), "l1d_ways": self.l1d_ways}

    @classmethod
    def from_key(cls, key: dict) -> CpuTarget:
        return cls(**{**key, "gcc_flags": tuple(key["gcc_flags"])})


_TRIPLE = "x86_64-unknown-linux-gnu"

TARGETS = {
    "generic": CpuTarget("generic", _TRIPLE, "x86-64", "", 128, ("-march=x86-64",)),
    "x86_64-avx2": CpuTarget("x86_64-avx2", _TRIPLE, "haswell", "", 256, ("-march=haswell",)),
    "x86_64-avx512": CpuTarget("x86_64-avx512", _TRIPLE, "skylake-avx512", "", 512, ("-march=skylake-avx512",)),
}


def _native() -> CpuTarget:
    import llvmlite.binding as llvm
    init_llvm()
    cpu = llvm.get_host_cpu_name()
    features = llvm.get_host_cpu_features().flatten()
    bits = 512 if "+avx512f" in features.split(",") else 256 if "+avx2" in features.split(",") else 128
    return CpuTarget("native", _TRIPLE, cpu, features, bits, ("-march=native",), _host_l1d_ways())


def _host_l1d_ways(default: int = DEFAULT_L1D_WAYS) -> int:
    """The ways of this machine's L1 data cache (Linux sysfs), or `default` when it does not say."""
    from pathlib import Path
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "1" and (index / "type").read_text().strip() == "Data":
                ways = int((index / "ways_of_associativity").read_text())
                return ways if ways > 0 else default
        except (OSError, ValueError):
            continue
    return default


_llvm_ready = False


def init_llvm():
    global _llvm_ready
    if not _llvm_ready:
        import llvmlite.binding as llvm
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        _llvm_ready = True


def resolve_target(name: str) -> CpuTarget:
    """The CpuTarget for a target name from cuvil.yaml or the API."""
    if name == "native":
        return _native()
    if name in TARGETS:
        return TARGETS[name]
    if name.startswith("cuda-"):
        raise CuvilError(f"target '{name}': CUDA targets are not supported yet",
                         hint=f"use one of: native, {', '.join(TARGETS)}")
    raise CuvilError(f"unknown target '{name}'", hint=f"use one of: native, {', '.join(TARGETS)}")
