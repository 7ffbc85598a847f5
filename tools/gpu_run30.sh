#!/usr/bin/env bash
# Run 30 (one H200): dw configs (the kept kernel and the resident-dy kernel) at the 16 preset
# points, merged into the packaged table's forward/dx entries; the benchmark with that table
# (docs/performance.md's table and plot); the GPU kernel and benchmark tests with it.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
DW_CFGS=32x128x128-w4-s4-p2-tma,64x128x128-w8-s3-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x64-w4-s3-p2-tma-r2,64x128x64-w8-s3-p2-tma-r2,32x128x64-w8-s3-p2-tma-r4,32x128x128-w8-s4-tma-r2,32x128x128-w8-s4-tma-r1,16x128x128-w8-s4-tma-r1
t tune-dw 200 python3 benchmarks/tune_kernels.py --ops dw --configs "$DW_CFGS" --merge kernels/configs_sm90.json --out "$R/tune-dw"
grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
export QMOE_CONFIG_TABLE=$R/tune-dw/configs.json
t bench 200 python3 benchmarks/bench_kernels.py --tokens 128,512,2048,8192 --json-out "$R/bench.json" --plot "$R/bench.png"
grep -vE "^\s*$" "$R/bench.log" | tail -22 | tee -a "$S"
t pytest-kernels 150 python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py -m "gpu or multigpu" -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-kernels.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
