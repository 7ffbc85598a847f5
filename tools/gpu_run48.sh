#!/usr/bin/env bash
# Run 48 (one H200): run 47 measured contiguous runs of items slower (L2 locality lost): the items
# round-robin again, with only the items of experts past the resident chunks cut along K: the GPU dw tests (skewed routing with
# the hot expert first, middle and last), the check uniform / 5% on one expert / 8192 tokens,
# then the dw sweep at the 16 preset points merged into the packaged table.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
t pytest-dw 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -m "gpu or multigpu" -q -p no:cacheprovider -rfE \
  -k "overlap or hopper_dw"
tail -3 "$R/pytest-dw.log" | tee -a "$S"
CHK=64x128x128-w8-s2-tma-ov3,32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov6,32x128x128-w4-s5-p2-tma
t check 100 python3 tools/dw_overlap_check.py --configs "$CHK"
grep -v Warning "$R/check.log" | tail -5 | tee -a "$S"
t check-hot 100 python3 tools/dw_overlap_check.py --configs "$CHK" --hot 0.05
grep -v Warning "$R/check-hot.log" | tail -5 | tee -a "$S"
t check-hot20 100 python3 tools/dw_overlap_check.py --configs "$CHK" --hot 0.2
grep -v Warning "$R/check-hot20.log" | tail -5 | tee -a "$S"
t check-8192 100 python3 tools/dw_overlap_check.py --configs "$CHK" --tokens 8192
grep -v Warning "$R/check-8192.log" | tail -5 | tee -a "$S"
OV=32x128x128-w8-s2-tma-ov5,32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov6,64x128x128-w8-s2-tma-ov3,32x128x128-w8-s2-tma-ov2,16x128x128-w8-s2-tma-ov2,16x128x128-w8-s2-tma-ov4,32x128x128-w8-s4-tma-ov4
KEPT=32x128x128-w4-s5-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x64-w4-s3-p2-tma-r2,32x128x128-w8-s3-tma-rx6,32x128x128-w8-s3-tma-rx5
t tune-dw 220 python3 benchmarks/tune_kernels.py --ops dw --configs "$OV,$KEPT" --merge kernels/configs_sm90.json --out "$R/tune-dw"
grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
