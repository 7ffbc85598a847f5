#!/usr/bin/env bash
# Run 55 (one H200, ninth session): the overlapped dw kernel with more TMA stores in flight
# (-b3/-b4 staging tiles) and with 256-wide dw tiles (x chunks reused over twice the columns,
# 64-wide K tiles so that two accumulators still fit), at the issue's point, random and
# balanced routing, and with 5% of the rows on one expert.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
DW=32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov5-b3,32x128x64-w8-s4-tma-ov5,32x128x64-w8-s4-tma-ov5-b4
DW=$DW,32x256x64-w8-s3-tma-ov5,32x256x64-w8-s2-tma-ov5-b3,32x256x64-w8-s4-tma-ov4,16x128x128-w8-s2-tma-ov10-b3
t probe 200 python3 tools/routing_probe.py --no-ceilings --forward "" --dw "$DW"
grep -E "^(dw|--)" "$R/probe.log" | tee -a "$S"
for shape in 30b-down 235b-gate_up; do
  t "probe-$shape" 120 python3 tools/routing_probe.py --no-ceilings --forward "" --routings random --shape "$shape" \
    --dw 32x128x128-w8-s3-tma-ov5,64x128x128-w8-s2-tma-ov3,32x256x64-w8-s3-tma-ov5,32x256x64-w8-s2-tma-ov5-b3,32x128x128-w8-s2-tma-ov5-b3
  grep -E "^(dw|--)" "$R/probe-$shape.log" | tee -a "$S"
done
dw_check check-hot-0.05 32x128x128-w8-s3-tma-ov5,32x256x64-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov5-b3 --hot 0.05
pack
echo "==== SUMMARY"; cat "$S"
