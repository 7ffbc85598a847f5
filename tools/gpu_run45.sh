#!/usr/bin/env bash
# Run 45 (one H200): after row_bounds became one Triton launch and the packaged table took run
# 44's dw winners at 8192 tokens: the dw and forward host paths by stage, the GPU kernel and
# benchmark tests with the packaged table, the benchmark for docs/performance.md, and the dw
# check at 2048 / 8192 tokens.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
t host 90 python3 tools/host_overhead.py --tokens 128 --calls 100
grep -E "us/call|by stage" "$R/host.log" | tee -a "$S"
t pytest-kernels 220 python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py -m "gpu or multigpu" \
  -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-kernels.log" | tee -a "$S"
bench_table
CHK=32x128x128-w8-s3-tma-ov5,32x128x128-w4-s5-p2-tma
[ "$(left)" -gt 40 ] && t check-8192 40 python3 tools/dw_overlap_check.py --configs "$CHK" --tokens 8192 && \
  grep -v Warning "$R/check-8192.log" | tail -3 | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
