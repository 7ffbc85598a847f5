#!/usr/bin/env bash
# Run 62 (one H200, tenth session): the overlapped dw kernel with paired items (block_n 256:
# two 128-wide dw tiles per x load, dy^T from shared memory, stores alternating with the two
# halves' MMAs): the routing probe at 30b gate_up / 2048 tokens against the single-tile kernel,
# the GPU dw tests (new configs included), then the dw sweep at the 16 preset points with the
# paired configs beside the table's current picks, merged into a copy of the packaged table.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
BUDGET=575
header
PAIRED=32x256x128-w8-s2-tma-ov5,32x256x128-w8-s3-tma-ov4,16x256x128-w8-s2-tma-ov8,16x256x128-w8-s2-tma-ov10,64x256x128-w8-s2-tma-ov2,32x256x128-w8-s2-tma-ov2
TABLE=32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov2,16x128x128-w8-s3-tma-ov10,64x128x128-w8-s2-tma-ov3,32x128x128-w4-s5-p2-tma,16x128x128-w8-s2-tma-ov4,32x128x128-w8-s4-tma-ov4,32x128x128-w8-s2-tma-ov6
t probe 150 python3 tools/routing_probe.py --no-ceilings --forward "" --dw "32x128x128-w8-s3-tma-ov5,$PAIRED"
grep -E "^(dw|--)" "$R/probe.log" | tee -a "$S"
dw_tests
t tune-dw $(( $(left) - 15 )) python3 benchmarks/tune_kernels.py --ops dw --configs "$PAIRED,$TABLE" \
  --merge kernels/configs_sm90.json --out "$R/tune-dw"
grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
