#!/usr/bin/env bash
# Run 64 (one H200, tenth session): the final paired-item kernel (experts past the resident
# chunks: one-tile items after the resident ones, pieces sized to the round-robin's last
# round) with the packaged table from run 63's sweep: the routing probe, skewed checks, the
# benchmark (qmoe-doctor bench, with its plot), and every GPU kernel and bench test.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
BUDGET=580
header
t probe 150 python3 tools/routing_probe.py --no-ceilings --forward table --dw "table,32x128x128-w8-s3-tma-ov5"
grep -E "^(forward|dw|--)" "$R/probe.log" | tee -a "$S"
for hot in 0.05 0.2; do
  dw_check "check-hot-$hot" "table,32x128x128-w8-s3-tma-ov5" --hot "$hot"
done
t bench 200 qmoe-doctor bench --gpus 0 --tokens 128,512,2048,8192 --out "$R/bench"
bench_report "$R/bench/bench.json"
t pytest-gpu $(( $(left) - 10 )) python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py -m "gpu or multigpu" \
  -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-gpu.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
