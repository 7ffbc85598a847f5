#!/usr/bin/env bash
# Run 63 (one H200, tenth session): paired items now only where the expert stays resident
# (items of an expert past the resident chunks are one tile wide), and the streamed ring spans
# every chunk buffer (CHUNKS x min(HALVES, STAGES) deep, its own barriers; was STAGES): the
# routing probe, skewed and 8192-token checks, the GPU dw tests, the dw sweep at the 16
# preset points merged into a copy of the packaged table, and the benchmark with that table.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
BUDGET=580
header
PAIRED=32x256x128-w8-s2-tma-ov5,32x256x128-w8-s3-tma-ov4,16x256x128-w8-s2-tma-ov8,16x256x128-w8-s2-tma-ov10,64x256x128-w8-s2-tma-ov2
TABLE=32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov2,16x128x128-w8-s3-tma-ov10,64x128x128-w8-s2-tma-ov3,32x128x128-w4-s5-p2-tma,16x128x128-w8-s2-tma-ov4,32x128x128-w8-s4-tma-ov4,32x128x128-w8-s2-tma-ov6
t probe 150 python3 tools/routing_probe.py --no-ceilings --forward "" --dw "32x128x128-w8-s3-tma-ov5,$PAIRED"
grep -E "^(dw|--)" "$R/probe.log" | tee -a "$S"
for hot in 0.05 0.2; do
  dw_check "check-hot-$hot" "32x128x128-w8-s3-tma-ov5,32x256x128-w8-s2-tma-ov5,16x256x128-w8-s2-tma-ov10" --hot "$hot"
done
dw_check check-8192 "32x128x128-w4-s5-p2-tma,32x128x128-w8-s3-tma-ov5,32x256x128-w8-s2-tma-ov5,32x256x128-w8-s3-tma-ov4" --tokens 8192
dw_tests
t tune-dw 150 python3 benchmarks/tune_kernels.py --ops dw --configs "$PAIRED,$TABLE" \
  --merge kernels/configs_sm90.json --out "$R/tune-dw"
grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
export QMOE_CONFIG_TABLE=$R/tune-dw/configs.json
[ -f "$QMOE_CONFIG_TABLE" ] || unset QMOE_CONFIG_TABLE
[ "$(left)" -gt 210 ] && bench_table
pack
echo "==== SUMMARY"; cat "$S"
