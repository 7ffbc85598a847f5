#!/usr/bin/env bash
# Validate the product on one GPU: the GPU tests, then qmoe-doctor against its own calibration
# (the built-in kernel must get no diagnosis, each specimen that one GPU can show must get its
# own cause and no other), the one-GPU sweeps, and the CI check. One device call on
# `nvidia-h100-x1` or `nvidia-h200` (about 6-8 minutes with every step; pass fewer steps to fit).
#
#   bash tools/gpu/validate_one_gpu.sh [STEPS...]
#
# Steps (default: all of them):
#   env        qmoe-doctor env (inventory, as text and JSON)
#   tests      pytest tests/gpu -m "gpu or multigpu" (the multigpu ones skip on one GPU)
#   scan       qmoe-doctor scan --gpus 0 of the built-in kernel (want: no diagnosis) and of the
#              torch:grouped_mm control
#   specimens  qmoe-doctor scan --gpus 0 of every specimen whose fault one GPU can show (from
#              `qmoe-doctor specimens`); each must name its own cause and nothing else. The
#              placement specimens need a GPU pair: tools/gpu/validate_multi_gpu.sh
#   sweeps     the int32 boundary (specimen:int32_offsets), an over-limit launch config, the
#              offset/stride cells of the built-in kernel
#   check      qmoe-doctor check --require-gpus 1 on the built-in kernel (exit 0) and on each
#              one-GPU specimen (exit 1; a correct specimen 0)
#   autotune   the default scan of specimen:autotuned (1,000 configs) from a cold Triton cache,
#              then warm: wall seconds of each (target: 60 s or less cold)
#   run        qmoe-doctor run on examples/qwen3_moe_device_map.py: our kernel (no finding),
#              specimen:unmasked_rows over-routed by a million rows (CUDA error, --blocking names
#              the kernel) and by 64 rows (--sanitize places the invalid addresses in recorded
#              tensors), specimen:int32_offsets at the 480B stack
#              (int32-offset-overflow from lint + size, live)
#   overhead   benchmarks/monitor_overhead.py: the MoE block training step with and without the
#              launch monitor (2048 and 128 tokens), with a profile of each child's host time
#   compare    (not a default step; about 7 minutes) qmoe-doctor run --compare on the example:
#              --race side-stream against blocking (want: wrong-device-stream at a
#              _grouped_gemm_kernel launch, "before" it), our kernel against blocking and repeat
#              (want: no divergence, no launch nondeterministic in the kernel), --race producer
#              against blocking (want: no divergence), the atomic split-K GPU test (marked
#              nondeterministic, not a fault), and the cost: the example's median step in a plain
#              run and in a compare pass
# Knobs: BUDGET (seconds for the whole call, default 560), TEST_TIMEOUT (default 300), SHARDS
# (tests: that many pytest processes share the GPU tests, pytest --shard; default 1).
# Results: $OUT/summary.txt (one line per step, verdicts), logs and JSON reports in
# $OUT/logs.tar.gz. Record the run in docs/validation/ (gpu-tests.md, scan-specimens.md).
DEFAULT_STEPS="env tests scan specimens sweeps check autotune run overhead"
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
header

if has env; then
  t env-json 60 qmoe-doctor env --json
  t env 60 qmoe-doctor env
fi
if has tests; then
  if (( ${SHARDS:-1} > 1 )); then
    # SHARDS processes share the selection (pytest --shard I/N): compiling, on the CPU, is the
    # slow part of a cold-cache run, and one card holds them all
    limit=$(cap "${TEST_TIMEOUT:-300}")
    for ((i = 0; i < SHARDS; i++)); do
      t "pytest-gpu-$i" "$limit" python3 -m pytest tests/gpu -m "gpu or multigpu" -q -p no:cacheprovider -rfE \
        --durations=10 "--shard=$i/$SHARDS" &
    done
    wait
    for ((i = 0; i < SHARDS; i++)); do say "   shard $i/$SHARDS: $(tail -1 "$R/pytest-gpu-$i.log")"; done
  else
    t pytest-gpu "$(cap "${TEST_TIMEOUT:-300}")" python3 -m pytest tests/gpu -m "gpu or multigpu" -q -p no:cacheprovider -rfE
    tail -3 "$R/pytest-gpu.log" | tee -a "$S"
  fi
fi
if has scan; then
  t scan-builtin "$(cap 120)" qmoe-doctor scan --gpus 0 --save "$R/scan-builtin.json" --log-dir "$R/workers-builtin"
  expect_verdict "$R/scan-builtin.json" -
  t scan-torch "$(cap 120)" qmoe-doctor scan --gpus 0 --kernel torch:grouped_mm --save "$R/scan-torch.json"
  expect_verdict "$R/scan-torch.json" -
fi
if has specimens; then
  while read -r name cause _; do
    t "scan-$name" "$(cap 150)" qmoe-doctor scan --gpus 0 --kernel "specimen:$name" --save "$R/scan-$name.json" \
      --log-dir "$R/workers-$name"
    expect_verdict "$R/scan-$name.json" "$cause"
  done < <(specimens_for one)
fi
if has sweeps; then
  t sweep-int32 "$(cap 120)" qmoe-doctor scan --gpus 0 --kernel specimen:int32_offsets --only single,int32-boundary \
    --save "$R/sweep-int32.json"
  expect_verdict "$R/sweep-int32.json" int32-offset-overflow
  # 128x256x128 with 4 stages asks for ~384 KiB of shared memory: more than any Hopper block has
  t sweep-launch-config "$(cap 120)" qmoe-doctor scan --gpus 0 --only single,launch-config \
    --configs 128x256x64-w8-s3,128x256x128-w8-s4 --save "$R/sweep-launch-config.json"
  expect_verdict "$R/sweep-launch-config.json" launch-config-fault
  t sweep-offsets "$(cap 120)" qmoe-doctor scan --gpus 0 --only single,offsets --save "$R/sweep-offsets.json"
  expect_verdict "$R/sweep-offsets.json" -
fi
if has check; then
  t check-builtin "$(cap 120)" qmoe-doctor check --kernel builtin --require-gpus 1 --gpus 0 --junit "$R/check-builtin.xml"
  expect_check "$R/check-builtin.xml" -
  while read -r name _ own; do
    t "check-$name" "$(cap 120)" qmoe-doctor check --kernel "specimen:$name" --require-gpus 1 --gpus 0 \
      --junit "$R/check-$name.xml"
    expect_check "$R/check-$name.xml" "$own"
  done < <(specimens_for one)
fi
if has autotune; then
  cold=$(mktemp -d)
  TRITON_CACHE_DIR=$cold t autotune-cold "$(cap 200)" qmoe-doctor scan --gpus 0 --kernel specimen:autotuned \
    --save "$R/scan-autotuned-cold.json"
  expect_verdict "$R/scan-autotuned-cold.json" -
  TRITON_CACHE_DIR=$cold t autotune-warm "$(cap 120)" qmoe-doctor scan --gpus 0 --kernel specimen:autotuned \
    --save "$R/scan-autotuned-warm.json"
  expect_verdict "$R/scan-autotuned-warm.json" -
fi
if has run; then
  E=examples/qwen3_moe_device_map.py
  t run-ours "$(cap 150)" qmoe-doctor run --save "$R/run-ours.json" -- python3 $E --gpus 0
  tail -3 "$R/run-ours.log" | tee -a "$S"
  # a million rows past y: a CUDA error in the plain run, named by the blocking rerun; the
  # sanitize pass below takes 64 rows (its log stays short)
  t run-unmasked "$(cap 150)" qmoe-doctor run --blocking --log-dir "$R/run-unmasked-logs" \
    --save "$R/run-unmasked.json" -- python3 $E --gpus 0 --kernel specimen:unmasked_rows --over-route 1000000 --steps 1
  grep -iE "faulting kernel|cuda error" "$R/run-unmasked.log" | head -6 | tee -a "$S"
  t run-sanitize "$(cap 150)" qmoe-doctor run --sanitize --log-dir "$R/run-sanitize-logs" \
    --save "$R/run-sanitize.json" -- python3 $E --gpus 0 --kernel specimen:unmasked_rows --over-route 64 --steps 1
  grep -iE "compute-sanitizer|placed|past|after|invalid-routing|together:|prove it:|your line:" "$R/run-sanitize.log" | head -12 | tee -a "$S"
  t run-int32 "$(cap 150)" qmoe-doctor run --save "$R/run-int32.json" -- python3 $E --gpus 0 \
    --kernel specimen:int32_offsets --preset qwen3-coder-480b-a35b --layers 1 --tokens 256 --steps 1
  grep -E "int32-offset-overflow" "$R/run-int32.log" | head -3 | tee -a "$S"
fi
if has overhead; then
  t overhead "$(cap 240)" python3 -m benchmarks.monitor_overhead --profile 25
  tail -4 "$R/overhead.log" | tee -a "$S"
fi
if has compare; then
  E=examples/qwen3_moe_device_map.py
  verdict() {  # one line from a saved run --compare report
    python3 - "$1" <<'PY' | tee -a "$S"
import json, sys
try:
    c = json.load(open(sys.argv[1]))["compare"]
except Exception as exc:
    print(f"   no report ({exc})"); sys.exit()
d = c["divergence"]
at = f"{d['launch']['kernel']} #{d['launch']['ordinal']} {d['where']}" if d else "-"
inner = sum(p["nondeterministic_in_kernel"] for p in c["processes"])
print(f"   verdict: {c['verdict'][:160]} | cause {c['cause']} | divergent {at} | in-kernel nondeterministic {inner}")
PY
  }
  t compare-race "$(cap 150)" qmoe-doctor run --compare blocking --repeat 1 --save "$R/compare-race.json" -- \
    python3 $E --gpus 0 --race side-stream --steps 2
  verdict "$R/compare-race.json"
  t compare-plain "$(cap 90)" qmoe-doctor run -- python3 $E --gpus 0 --steps 6
  grep -E "median step" "$R/compare-plain.log" | tee -a "$S"
  t compare-ours-blocking "$(cap 150)" qmoe-doctor run --compare blocking --repeat 1 --save "$R/compare-ours-blocking.json" -- \
    python3 $E --gpus 0 --steps 6
  grep -E "median step" "$R/compare-ours-blocking.log" | tee -a "$S"
  verdict "$R/compare-ours-blocking.json"
  t compare-ours-repeat "$(cap 150)" qmoe-doctor run --compare repeat --save "$R/compare-ours-repeat.json" -- \
    python3 $E --gpus 0 --steps 2
  verdict "$R/compare-ours-repeat.json"
  t compare-producer "$(cap 150)" qmoe-doctor run --compare blocking --repeat 1 --save "$R/compare-producer.json" -- \
    python3 $E --gpus 0 --race producer --steps 2
  verdict "$R/compare-producer.json"
  t compare-splitk "$(cap 150)" python3 -m pytest tests/gpu/test_run_compare_gpu.py -m "gpu and not multigpu" -k atomic -q \
    -p no:cacheprovider -rfE
  tail -1 "$R/compare-splitk.log" | tee -a "$S"
fi
finish
