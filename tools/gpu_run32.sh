#!/usr/bin/env bash
# Run 32 (one H200): every dw config that won a point in runs 28-30 plus the x-resident kernel
# (-rx) and a two-programs-per-SM dy-resident one, at the 16 preset points, merged into the
# packaged table's forward/dx entries; registers of the new ones; the benchmark with the merged
# table (docs/performance.md); the GPU kernel tests with it.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
DW_CFGS=32x128x128-w4-s4-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x64-w4-s3-p2-tma-r2,32x128x64-w8-s3-p2-tma-r4,32x128x128-w8-s4-tma-r2,64x128x64-w4-s2-p2-tma-r3,64x128x128-w8-s3-tma-rx3,64x128x128-w8-s4-tma-rx2,64x128x64-w4-s3-p2-tma-rx2,64x128x64-w4-s2-p2-tma-rx3
dw_round "$DW_CFGS" 64x128x64-w4-s2-p2-tma-r3,64x128x128-w8-s3-tma-rx3,64x128x128-w8-s4-tma-rx2,64x128x64-w4-s3-p2-tma-rx2,64x128x64-w4-s2-p2-tma-rx3
pack
echo "==== SUMMARY"; cat "$S"
