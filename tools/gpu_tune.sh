#!/usr/bin/env bash
# One device-machine call (one GPU): install, sweep launch configs (benchmarks/tune_kernels.py),
# then measure the resulting table with the benchmark and check it with the GPU kernel tests.
# Logs and results under $OUT. Usage: tools/gpu_tune.sh [tune-args...]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
S=$OUT/summary.txt; : > "$S"
say() { echo "$*" | tee -a "$S"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || say "install failed"
say "date: $(date -u +%FT%TZ)"
say "gpu: $(nvidia-smi --query-gpu=name,pci.bus_id,driver_version,clocks.max.sm --format=csv,noheader)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
t0=$(date +%s)
timeout ${TUNE_TIMEOUT:-330} python3 benchmarks/tune_kernels.py --out "$OUT/tune" "$@" > "$OUT/tune-table.txt" 2> "$OUT/tune.log"
say "tune rc=$? $(( $(date +%s) - t0 )) s"
cat "$OUT/tune-table.txt" | tee -a "$S"
if [ -f "$OUT/tune/configs.json" ]; then
  export QMOE_CONFIG_TABLE=$OUT/tune/configs.json
  t0=$(date +%s)
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/bench_kernels.py --tokens ${BENCH_TOKENS:-512,2048,8192} --json-out "$OUT/bench.json" --plot "$OUT/bench.png" > /tmp/bench.txt 2> /tmp/bench.log
  say "bench rc=$? $(( $(date +%s) - t0 )) s"; cat /tmp/bench.txt >> "$S"; tail -5 /tmp/bench.log >> "$S"
  t0=$(date +%s)
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py -m "gpu or multigpu" -q -p no:cacheprovider -rfE -x > "$OUT/pytest.log" 2>&1
  say "pytest rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/pytest.log")"
fi
echo "==== SUMMARY"; cat "$S"
