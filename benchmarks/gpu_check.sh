#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (and the CUDA 13 toolkit's ptxas/fatbinary on PATH, or in
# /usr/local/cuda/bin): build the zoo for this GPU's architecture, check every model against
# onnxruntime, time it against PyTorch on the same GPU (and onnxruntime's CUDA provider when
# onnxruntime-gpu is installed), and write the results as JSON. The product models (MLP, the
# encoders) are built again in bf16 and fp16 (tensor cores) and checked against onnxruntime's
# float32 with the derived bound (docs/cuda.md).
#
#   benchmarks/gpu_check.sh [OUT.json] [-- gpu_check.py options, e.g. --models mlp,resnet18 --lowp-models mlp]
#
# What it needs: Python with torch (CUDA), onnx, onnxruntime, numba, numba-cuda; it installs
# cuvil itself (pip install -e ".[cuda]"), or, on a machine without a package index, puts the
# wheels in $CUVIL_WHEELS (pydantic, pydantic-core, annotated-types, typing-inspection, scons)
# on the path with no install step. Finishes in a few minutes on a recent GPU host.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check.json}"
shift || true
[ "${1:-}" = "--" ] && shift
PY="${PYTHON:-python3}"
export PATH="$PATH:/usr/local/cuda/bin"
if [ -n "${CUVIL_WHEELS:-}" ]; then
    site="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$CUVIL_WHEELS"/*.whl
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
else
    "$PY" -m pip install -q -e ".[cuda]"
fi
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader || true
exec "$PY" benchmarks/gpu_check.py --out "$out" "$@"
