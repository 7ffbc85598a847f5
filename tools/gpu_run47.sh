#!/usr/bin/env bash
# Run 47 (one H200): the overlapped dw kernel with its items balanced by cost (contiguous runs;
# items of experts past the resident chunks cut along K): the GPU dw tests (skewed routing with
# the hot expert first, middle and last), the check uniform / 5% on one expert / 8192 tokens,
# then the dw sweep at the 16 preset points merged into the packaged table.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
dw_tests
CHK=64x128x128-w8-s2-tma-ov3,32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov6,32x128x128-w4-s5-p2-tma
dw_check check "$CHK"
dw_check check-hot "$CHK" --hot 0.05
dw_check check-hot20 "$CHK" --hot 0.2
dw_check check-8192 "$CHK" --tokens 8192
OV=32x128x128-w8-s2-tma-ov5,32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov6,64x128x128-w8-s2-tma-ov3,32x128x128-w8-s2-tma-ov2,16x128x128-w8-s2-tma-ov2,16x128x128-w8-s2-tma-ov4,32x128x128-w8-s4-tma-ov4
KEPT=32x128x128-w4-s5-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x64-w4-s3-p2-tma-r2,32x128x128-w8-s3-tma-rx6,32x128x128-w8-s3-tma-rx5
t tune-dw 220 python3 benchmarks/tune_kernels.py --ops dw --configs "$OV,$KEPT" --merge kernels/configs_sm90.json --out "$R/tune-dw"
grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
