#!/usr/bin/env bash
# Run 53 (one H200, ninth session): where the forward and dw lose time at the issue's point.
# The memory ceilings on the weight stack; forward and dw under random and balanced routing
# (balanced: no partial row tile); dw with stores from registers (-ds, no staging tiles, so
# more ring stages fit) and with the resident walk trimmed to each expert's own row chunks
# (QMOE_DW_TRIM=0 is the eighth session's kernel); then the GPU dw tests.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
DW=32x128x128-w8-s3-tma-ov5,32x128x128-w8-s3-tma-ov5-ds,32x128x128-w8-s4-tma-ov5-ds,32x128x128-w8-s3-tma-ov6-ds,32x128x128-w8-s2-tma-ov6-ds
FW=table,64x256x64-w4-s4-tma-flat,128x128x64-w8-s4-tma-flat
probe() {  # probe NAME ARGS...: tools/routing_probe.py, its lines to the summary
  local name=$1; shift
  t "$name" 150 python3 tools/routing_probe.py "$@"
  grep -E "^(ceiling|forward|dw|--)" "$R/$name.log" | tee -a "$S"
}
probe probe-trim --forward "$FW" --dw "$DW"
QMOE_DW_TRIM=0 probe probe-notrim --no-ceilings --forward "" --dw 32x128x128-w8-s3-tma-ov5,32x128x128-w8-s3-tma-ov5-ds
dw_check check-hot-0.05 32x128x128-w8-s3-tma-ov5,32x128x128-w8-s4-tma-ov5-ds --hot 0.05
dw_check check-8192 32x128x128-w8-s3-tma-ov5,32x128x128-w8-s4-tma-ov5-ds --tokens 8192
dw_tests
pack
echo "==== SUMMARY"; cat "$S"
