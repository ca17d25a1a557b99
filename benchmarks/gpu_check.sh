#!/usr/bin/env bash
# GPU checks for a machine with CUDA, in about 8 minutes:
#   1. the tests marked gpu (CUDA staging, pinned slots, overlap consistency,
#      restore to CUDA through pinned memory);
#   2. the GPU stall benchmark, bf16: a 1 GiB model and 4096 small tensors,
#      blocking and overlap staging next to a raw pinned device-to-host copy of
#      the same tensors (overlap: the time added per checkpoint shows the wait),
#      and the 95 %-frozen model in incremental mode;
#   3. restore of a 1 GiB checkpoint into a CUDA model, against torch.load +
#      load_state_dict and a raw readinto.
# Targets (H200): overlap stall < 1 ms; blocking stall <= 1.1x the raw pinned
# copy; incremental stall <= 0.1x a full copy.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
python -c "import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name() if ok else 'no CUDA'); sys.exit(0 if ok else 1)"
timeout 150 python -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu_tests.txt"
timeout 200 python benchmarks/stall.py --device cuda --dtype bfloat16 --models 1G small frozen \
    --methods snapsvc-block snapsvc-overlap snapsvc-incremental --reps 10 --steps 20 --every 5 \
    --writer-model none --json "$out/gpu_stall.json" 2>&1 | tee "$out/gpu_stall.txt"
timeout 120 python benchmarks/codec.py --sections restore --device cuda --mib 1024 \
    --restore-repeat 5 2>&1 | tee "$out/gpu_restore.txt"
