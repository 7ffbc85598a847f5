#!/usr/bin/env bash
# Run 40 (one H200): the overlapped dw kernel with its streamed path pipelined (experts past the
# resident chunks): the check at 30b gate_up / 2048 tokens, uniform and with 5% of the rows on
# one expert; then the dw sweep of the -ov configs and the earlier winners at the 16 preset
# points merged into the packaged table, the benchmark and the GPU kernel tests with it.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
CHK=32x128x128-w8-s2-tma-ov5,32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov6,64x128x128-w8-s3-tma-r3,32x128x128-w4-s4-p2-tma
t check 120 python3 tools/dw_overlap_check.py --configs "$CHK"
grep -v Warning "$R/check.log" | tail -7 | tee -a "$S"
t check-hot 120 python3 tools/dw_overlap_check.py --configs "$CHK" --hot 0.05
grep -v Warning "$R/check-hot.log" | tail -7 | tee -a "$S"
OV=32x128x128-w8-s2-tma-ov5,32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov6,64x128x128-w8-s2-tma-ov3,32x128x64-w8-s4-tma-ov5,32x128x128-w8-s2-tma-ov2,16x128x128-w8-s2-tma-ov2,16x128x128-w8-s2-tma-ov4
KEPT=32x128x128-w4-s4-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x64-w4-s3-p2-tma-r2,32x128x64-w8-s3-p2-tma-r4,64x128x128-w8-s3-tma-rx3,32x128x128-w8-s3-tma-rx6,32x128x128-w8-s3-tma-rx5
dw_round "$OV,$KEPT" 32x128x128-w8-s3-tma-r6
pack
echo "==== SUMMARY"; cat "$S"
