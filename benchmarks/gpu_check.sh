#!/usr/bin/env bash
# GPU checks for a machine with CUDA, in under 5 minutes:
#   1. the tests marked gpu (CUDA staging, pinned slots, overlap consistency);
#   2. the GPU stall benchmark: a 1 GiB bf16 model, blocking and overlap staging,
#      next to a raw pinned device-to-host copy of the same tensors.
# Targets (H200): overlap stall < 1 ms; blocking stall <= 1.2x the raw pinned copy.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
python -c "import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name() if ok else 'no CUDA'); sys.exit(0 if ok else 1)"
timeout 150 python -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu_tests.txt"
timeout 150 python benchmarks/stall.py --device cuda --dtype bfloat16 --models 1G small \
    --methods snapsvc-block snapsvc-overlap --reps 10 --steps 20 --every 5 \
    --json "$out/gpu_stall.json" 2>&1 | tee "$out/gpu_stall.txt"
