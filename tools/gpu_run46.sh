#!/usr/bin/env bash
# Run 46 (one H200): run 45's block rows were host-perturbed (the per-expert loop twin, pure
# torch, ran 4.7x slower than in runs 34-42): the benchmark again for docs/performance.md, the
# host path by stage again, and the dw at the two 8192-token points measured three times with
# the kept configs, to put run-to-run spread beside the ratio to torch._grouped_mm.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "load: $(cat /proc/loadavg)"
bench_table
say "load: $(cat /proc/loadavg)"
t host 90 python3 tools/host_overhead.py --tokens 128 --calls 200
grep -E "us/call|by stage" "$R/host.log" | tee -a "$S"
for i in 1 2 3; do
  t tune-8192-$i 120 python3 benchmarks/tune_kernels.py --ops dw --shapes 30b-gate_up:8192,30b-down:8192 \
    --configs 32x128x128-w4-s5-p2-tma,32x128x128-w4-s4-p2-tma --out "$R/tune-8192-$i"
  grep -E "^dw" "$R/tune-8192-$i.log" | tee -a "$S"
done
pack
echo "==== SUMMARY"; cat "$S"
