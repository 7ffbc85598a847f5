#!/usr/bin/env bash
# Run 34 (one H200): the dw configs that won a point in runs 28-32 and the resident kernels with
# 32-row chunks (up to 6: -r5, -r6, -rx5, -rx6) at the 16 preset points, merged into the
# packaged table's forward/dx entries; registers of the new ones; the benchmark with the merged
# table (docs/performance.md); the GPU kernel tests with it.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
DW_CFGS=32x128x128-w4-s4-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x64-w4-s3-p2-tma-r2,32x128x64-w8-s3-p2-tma-r4,32x128x128-w8-s4-tma-r2,64x128x128-w8-s3-tma-rx3,64x128x128-w8-s4-tma-rx2,32x128x128-w8-s3-tma-r6,32x128x128-w8-s3-tma-r5,32x128x128-w8-s3-tma-rx6,32x128x128-w8-s3-tma-rx5,32x128x64-w4-s2-p2-tma-r6
dw_round "$DW_CFGS" 32x128x128-w8-s3-tma-r6,32x128x128-w8-s3-tma-r5,32x128x128-w8-s3-tma-rx6,32x128x64-w4-s2-p2-tma-r6
pack
echo "==== SUMMARY"; cat "$S"
