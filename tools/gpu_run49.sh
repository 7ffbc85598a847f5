#!/usr/bin/env bash
# Run 49 (one H200): the packaged table with run 48's dw sweep: the GPU kernel and benchmark
# tests, the benchmark for docs/performance.md (table and plot), the host path by stage, and
# the dw check with the table's own pick (no --configs) uniform and with 5% / 20% of the rows
# on one expert.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
t pytest-kernels 220 python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py -m "gpu or multigpu" \
  -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-kernels.log" | tee -a "$S"
say "load: $(cat /proc/loadavg)"
bench_table
t host 90 python3 tools/host_overhead.py --tokens 128 --calls 200
grep -E "us/call|by stage" "$R/host.log" | tee -a "$S"
for hot in 0 0.05 0.2; do
  dw_check "check-table-$hot" table --hot "$hot"
done
pack
echo "==== SUMMARY"; cat "$S"
