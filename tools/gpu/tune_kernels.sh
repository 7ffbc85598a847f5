#!/usr/bin/env bash
# Tune our kernels' launch configs on this GPU, then measure and test the table the sweep
# picked: benchmarks/tune_kernels.py over the presets' 16 GEMM points (forward, dx, dw; every
# candidate checked against torch._grouped_mm before it is timed), the benchmark with the new
# table, the GPU kernel and bench tests with it. One device call on one GPU (about 5-8 minutes;
# `--ops dw` alone about 2).
#
#   bash tools/gpu/tune_kernels.sh [STEPS...]
#   TUNE_ARGS="--ops dw --configs A,B --merge kernels/configs-nvidia-h200-sm90-132sm.json" bash tools/gpu/tune_kernels.sh
#
# Steps (default: tune bench tests):
#   tune     python3 benchmarks/tune_kernels.py --out $R/tune $TUNE_ARGS; the table it writes
#            ($R/tune/configs.json) is used by every later step (QMOE_CONFIG_TABLE)
#   bench    benchmarks/bench_kernels.py at BENCH_TOKENS with that table (table and plot)
#   tests    the GPU kernel and bench tests with that table
#   probe    tools/profile/routing_probe.py: the table's forward and dw under random and balanced
#            routing, beside the memory ceilings of the weight stack
#   dw       tools/profile/dw_overlap_check.py with the table's dw pick: uniform, 5% and 20% of
#            the rows on one expert, and 8192 tokens
#   regs     tools/profile/kernel_regs.py: registers and spills of REGS_CONFIGS (op dw)
# To package the result, commit $R/tune/configs-<device key>.json as kernels/configs-<device key>.json
# (TUNE_ARGS=--package writes it there) and record the sweep in docs/validation/kernels.md. The
# per-card run against the targets, tune and side-by-side in one call: tools/gpu/perf_card.sh.
# Knobs: TUNE_ARGS, BENCH_TOKENS (default 128,512,2048,8192), REGS_CONFIGS, BUDGET (560).
DEFAULT_STEPS="tune bench tests"
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
header
say "gpu clocks: $(nvidia-smi --query-gpu=clocks.max.sm --format=csv,noheader | head -1)"

if has tune; then
  # shellcheck disable=SC2086  # TUNE_ARGS is a list of arguments
  t tune "$(cap 330)" python3 benchmarks/tune_kernels.py --out "$R/tune" ${TUNE_ARGS:-}
  grep -E "^(op|forward|dx|dw)" "$R/tune.log" | tee -a "$S"
fi
if [[ -f "$R/tune/configs.json" ]]; then
  export QMOE_CONFIG_TABLE=$R/tune/configs.json
  say "QMOE_CONFIG_TABLE=$QMOE_CONFIG_TABLE"
fi
if has bench; then
  t bench "$(cap 200)" python3 benchmarks/bench_kernels.py --tokens "${BENCH_TOKENS:-128,512,2048,8192}" \
    --json-out "$R/bench.json" --plot "$R/bench.png"
  tail -25 "$R/bench.log" | tee -a "$S"
fi
if has tests; then
  t pytest-kernels "$(cap 220)" python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py \
    -m "gpu or multigpu" -q -p no:cacheprovider -rfE
  tail -3 "$R/pytest-kernels.log" | tee -a "$S"
fi
if has probe; then
  t probe "$(cap 150)" python3 tools/profile/routing_probe.py --forward table --dw table
  grep -E "^(ceiling|forward|dw|--)" "$R/probe.log" | tee -a "$S"
fi
if has dw; then
  for hot in 0 0.05 0.2; do
    t "dw-hot-$hot" "$(cap 100)" python3 tools/profile/dw_overlap_check.py --configs table --hot "$hot"
    grep -v Warning "$R/dw-hot-$hot.log" | tail -3 | tee -a "$S"
  done
  t dw-8192 "$(cap 100)" python3 tools/profile/dw_overlap_check.py --configs table --tokens 8192
  grep -v Warning "$R/dw-8192.log" | tail -3 | tee -a "$S"
fi
if has regs; then
  t regs "$(cap 60)" python3 tools/profile/kernel_regs.py --op dw --configs "${REGS_CONFIGS:-32x256x128-w8-s2-tma-ov5}"
  tail -10 "$R/regs.log" | tee -a "$S"
fi
finish
