#!/usr/bin/env bash
# Run 36 (one H200): after the resident dw kernel's chunks became tuples (one loop for both
# resident operands): its GPU tests, its registers, and its speed at two points against run 34.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
CFGS=32x128x128-w4-s4-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s3-tma-rx3,64x128x64-w4-s3-p2-tma-r2,32x128x128-w8-s3-tma-r6
t pytest-dw 150 python3 -m pytest tests/gpu/test_kernels_gpu.py -k "hopper_dw or dw_bf16 or block or large_shape" -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-dw.log" | tee -a "$S"
t regs 60 python3 tools/kernel_regs.py --op dw --configs "$CFGS"
grep resident "$R/regs.log" | tee -a "$S"
t tune-dw 120 python3 benchmarks/tune_kernels.py --ops dw --shapes 30b-gate_up:2048,30b-down:2048,30b-gate_up:512 --configs "$CFGS" --out "$R/tune-dw"
grep -E "T=|TFLOP/s" "$R/tune-dw.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
