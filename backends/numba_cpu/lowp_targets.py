"""Which reduced-precision instructions a CPU target has, and the targets that have them.

The named targets of targets.py say a CPU, not its features; reduced-precision kernels pick
their path by feature (AVX512-BF16 `vdpbf16ps`, F16C `vcvtps2ph`, AVX512-FP16, AMX), so this
table says which features each CPU name implies. A target's explicit `+feature`s (`native`
lists the host's) count as well.
"""
from __future__ import annotations

from backends.targets import TARGETS, CpuTarget

_TRIPLE = TARGETS["generic"].triple

_F16C_CPUS = {"haswell", "broadwell", "skylake", "skylake-avx512", "cascadelake", "icelake-server",
              "icelake-client", "tigerlake", "rocketlake", "alderlake", "x86-64-v3", "x86-64-v4",
              "znver1", "znver2", "znver3"}
_BF16_CPUS = {"cooperlake", "znver4", "znver5"}
_AMX_CPUS = {"sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d"}

_IMPLIED = {cpu: {"f16c"} for cpu in _F16C_CPUS}
_IMPLIED.update({cpu: {"f16c", "avx512bf16", "avx512vnni"} for cpu in _BF16_CPUS})
_IMPLIED.update({cpu: {"f16c", "avx512bf16", "avx512vnni", "avx512fp16", "amx-tile", "amx-bf16", "amx-int8"}
                 for cpu in _AMX_CPUS})


def has_feature(target: CpuTarget, feature: str) -> bool:
    """Whether code for `target` may use `feature` (LLVM's name: "avx512bf16", "f16c", "avx512fp16",
    "amx-bf16", ...)."""
    explicit = {f[1:]: f[0] == "+" for f in target.features.split(",") if f[:1] in "+-" and f[1:]}
    if feature in explicit:
        return explicit[feature]
    return feature in _IMPLIED.get(target.cpu, set())


# Targets for the reduced-precision paths: AMD Zen 4 (AVX512-BF16, no AMX or AVX512-FP16) and Intel
# Sapphire Rapids (AMX, AVX512-FP16). Both ask for 512-bit vectors.
LOWP_TARGETS = {
    "x86_64-znver4": CpuTarget("x86_64-znver4", _TRIPLE, "znver4", "", 512, ("-march=znver4",)),
    "x86_64-sapphirerapids": CpuTarget("x86_64-sapphirerapids", _TRIPLE, "sapphirerapids", "", 512,
                                       ("-march=sapphirerapids",)),
}
