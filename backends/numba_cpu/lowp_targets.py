"""Targets for the reduced-precision paths (which features a target has: backends/targets.py
`has_feature`, by which the kernels pick AVX512-BF16 `vdpbf16ps`, F16C, AVX512-FP16 or AMX)."""
from __future__ import annotations

from backends.targets import TARGETS

# The named targets of the reduced-precision paths (defined with the others in backends/targets.py).
LOWP_TARGETS = {name: TARGETS[name] for name in ("x86_64-znver4", "x86_64-sapphirerapids")}
