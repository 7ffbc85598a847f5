#!/usr/bin/env bash
# Run 58 (one H200, ninth session): the benchmark's block forward replayed from a CUDA graph
# (new rows): the GPU bench test, then the benchmark at 128-8192 tokens with its plot.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
t pytest-bench 200 python3 -m pytest tests/gpu/test_bench_gpu.py -m gpu -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-bench.log" | tee -a "$S"
t bench 240 qmoe-doctor bench --gpus 0 --tokens 128,512,2048,8192 --out "$R/bench"
bench_report "$R/bench/bench.json"
pack
echo "==== SUMMARY"; cat "$S"
