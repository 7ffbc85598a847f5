#!/usr/bin/env bash
# Run 59 (one H200, ninth session): the GPU bench test as corrected after run 58 (the CUDA-graph
# block rows must reproduce the eager call's error; run 58's version wrongly held the block rows
# to the GEMM tolerance), and the GPU kernel tests once more on the session's final tree.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
t pytest-gpu 420 python3 -m pytest tests/gpu/test_bench_gpu.py tests/gpu/test_kernels_gpu.py -m gpu -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-gpu.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
