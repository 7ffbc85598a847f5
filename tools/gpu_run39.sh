#!/usr/bin/env bash
# Run 39 (one H200): the overlapped dw kernel (Gluon, -ovN): a quick check at 30b gate_up with
# 2048 tokens (path taken, agreement with torch._grouped_mm, TFLOP/s against the resident
# Triton kernel); if it passes, its GPU tests and a dw sweep at four preset points.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
OV=64x128x128-w8-s2-tma-ov3,64x128x128-w8-s3-tma-ov2,64x128x64-w8-s3-tma-ov3,64x128x64-w8-s4-tma-ov3,64x128x64-w8-s2-tma-ov4,32x128x128-w8-s2-tma-ov5
t check 150 python3 tools/dw_overlap_check.py --configs "$OV,64x128x128-w8-s3-tma-r3"
cat "$R/check.log" | grep -v Warning | tail -12 | tee -a "$S"
if [ "$(grep -c ' ok$' "$R/check.log")" -ge 1 ]; then
  t pytest-dw 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -k "hopper_dw or overlap" -q -p no:cacheprovider -rfE -x
  tail -4 "$R/pytest-dw.log" | tee -a "$S"
  t tune-dw 180 python3 benchmarks/tune_kernels.py --ops dw \
    --shapes 30b-gate_up:2048,30b-down:2048,235b-gate_up:2048,30b-gate_up:8192 \
    --configs "$OV,64x128x128-w8-s3-tma-r3,64x128x128-w8-s3-tma-rx3,32x128x128-w4-s4-p2-tma" --out "$R/tune-dw"
  grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
fi
pack
echo "==== SUMMARY"; cat "$S"
