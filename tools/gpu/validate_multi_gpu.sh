#!/usr/bin/env bash
# Validate the product on two or more GPUs: the full scan of the built-in kernel, the control
# and every scan specimen on a GPU pair (each must get its own cause and no other), the CI
# check, repro and its written script, time to a verdict from a cold and a warm Triton cache,
# and the whole GPU test suite. One device call on `nvidia-h100-x2` / `nvidia-h200-x2` (or
# larger: GPUS picks the pair; ALL_PAIRS=1 scans the built-in kernel on every GPU).
#
#   bash tools/gpu/validate_multi_gpu.sh [STEPS...]
#
# Steps (default: env scan specimens check repro run ranks tests):
#   env        qmoe-doctor env
#   scan       qmoe-doctor scan of the built-in kernel (want: no diagnosis) and of the
#              torch:grouped_mm control on GPUS (every GPU with ALL_PAIRS=1: ~12 s per ordered
#              pair on H200s, so 8 GPUs need more than one call)
#   specimens  qmoe-doctor scan --gpus GPUS of every specimen the scan can show (one GPU or a
#              pair; from `qmoe-doctor specimens`): its own cause and nothing else
#   check      qmoe-doctor check --require-gpus 2: built-in and control exit 0, each faulty
#              specimen exit 1 naming its own cause only (the lint's, where no cell can see it), a
#              correct specimen exit 0 (expect_check)
#   repro      qmoe-doctor repro --gpus GPUS on specimen:unguarded (a verdict and a script that
#              fails alone) and on the built-in kernel (exit 0, no script)
#   run        qmoe-doctor run on examples/qwen3_moe_device_map.py split with device_map over GPUS:
#              our kernel (no finding), specimen:unguarded (missing-device-guard named live, with
#              its call site), the same with --strict (stops at that launch),
#              specimen:default_buffer (default-device-buffer only), specimen:wrong_stream with
#              a side stream current (wrong-device-stream) and our kernel with one (no finding);
#              then the two-GPU step with and without the monitor (median step ms of 20 steps)
#   ranks      qmoe-doctor run on examples/moe_ranks.py under torchrun, two ranks: our kernel (no
#              finding), specimen:rank_no_set_device (device-never-set on rank 1 only)
#   verdict    time to a verdict: scan and repro of specimen:unguarded from an empty Triton
#              cache, then again warm
#   tests      pytest tests/gpu -m "gpu or multigpu"
#   compare    (not a default step; about 5 minutes) qmoe-doctor run --compare on the example
#              over GPUS: --race side-stream against blocking (want: wrong-device-stream),
#              specimen:unguarded --race producer over the pair against the same on one GPU
#              (want: missing-device-guard at its first launch from the second GPU's layers), our
#              kernel the same way (want: no divergence)
#   evidence   tools/evidence/record_sanitizer_logs.py: real compute-sanitizer logs and
#              tracebacks of probe runs (what tests/fixtures/ hold), under $R/evidence
# Knobs: GPUS (default 0,1), ALL_PAIRS, BUDGET (default 560), TEST_TIMEOUT (default 300),
# SANITIZER_CASES (names of record_sanitizer_logs.py's cases; default all).
# Results: $OUT/summary.txt and $OUT/logs.tar.gz. Record the run in docs/validation/.
DEFAULT_STEPS="env scan specimens check repro run ranks tests"
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
header
GPUS=${GPUS:-0,1}
SCAN_GPUS=$GPUS; [[ "${ALL_PAIRS:-0}" == 1 ]] && SCAN_GPUS=$ALL

if has env; then
  t env 60 qmoe-doctor env
fi
if has scan; then
  t scan-builtin "$(cap 560)" qmoe-doctor scan --gpus "$SCAN_GPUS" --save "$R/scan-builtin.json" --log-dir "$R/workers-builtin"
  expect_verdict "$R/scan-builtin.json" -
  t scan-torch "$(cap 120)" qmoe-doctor scan --gpus "$GPUS" --kernel torch:grouped_mm --only guarded,peer,no-peer,single \
    --save "$R/scan-torch.json"
  expect_verdict "$R/scan-torch.json" -
fi
if has specimens; then
  while read -r name cause _; do
    t "scan-$name" "$(cap 150)" qmoe-doctor scan --gpus "$GPUS" --kernel "specimen:$name" --save "$R/scan-$name.json" \
      --log-dir "$R/workers-$name"
    expect_verdict "$R/scan-$name.json" "$cause"
  done < <(specimens_for pair; specimens_for one)
fi
if has check; then
  t check-builtin "$(cap 120)" qmoe-doctor check --kernel builtin --require-gpus 2 --gpus "$GPUS" --junit "$R/check-builtin.xml"
  expect_check "$R/check-builtin.xml" -
  while read -r name _ own; do
    t "check-$name" "$(cap 120)" qmoe-doctor check --kernel "specimen:$name" --require-gpus 2 --gpus "$GPUS" \
      --junit "$R/check-$name.xml"
    expect_check "$R/check-$name.xml" "$own"
  done < <(specimens_for pair; specimens_for one)
  t check-torch "$(cap 120)" qmoe-doctor check --kernel torch:grouped_mm --require-gpus 2 --gpus "$GPUS" --junit "$R/check-torch.xml"
  expect_check "$R/check-torch.xml" -
fi
if has repro; then
  t repro-unguarded "$(cap 120)" qmoe-doctor repro --gpus "$GPUS" --kernel specimen:unguarded --out "$R/repro-unguarded"
  grep -iE "verdict|cause|script" "$R/repro-unguarded.log" | head -6 | tee -a "$S"
  for f in "$R"/repro-unguarded/*.py; do
    [ -f "$f" ] && t "repro-script-$(basename "$f" .py)" "$(cap 120)" python3 "$f"  # want: FAIL, exit 1
  done
  t repro-builtin "$(cap 120)" qmoe-doctor repro --gpus "$GPUS" --kernel builtin --out "$R/repro-builtin"
  say "   want exit 0, no script: $(ls "$R/repro-builtin" 2>/dev/null | wc -l) files"
fi
if has run; then
  E=examples/qwen3_moe_device_map.py
  t run-ours "$(cap 150)" qmoe-doctor run --save "$R/run-ours.json" -- python3 $E --gpus "$GPUS"
  tail -2 "$R/run-ours.log" | tee -a "$S"
  for name in unguarded default_buffer; do
    t "run-$name" "$(cap 150)" qmoe-doctor run --save "$R/run-$name.json" -- python3 $E --gpus "$GPUS" \
      --kernel "specimen:$name" --steps 2
    grep -E "^qmoe-doctor:|step 1/" "$R/run-$name.log" | head -4 | tee -a "$S"
  done
  t run-unguarded-strict "$(cap 150)" qmoe-doctor run --strict --save "$R/run-unguarded-strict.json" -- \
    python3 $E --gpus "$GPUS" --kernel specimen:unguarded --steps 2
  grep -E "CrossDeviceLaunchError|step 1/" "$R/run-unguarded-strict.log" | head -3 | tee -a "$S"
  t run-wrong_stream "$(cap 150)" qmoe-doctor run --save "$R/run-wrong_stream.json" -- python3 $E --gpus "$GPUS" \
    --kernel specimen:wrong_stream --side-stream --steps 2
  grep -E "^qmoe-doctor:|^wrong-device-stream|diagnos" "$R/run-wrong_stream.log" | head -4 | tee -a "$S"
  t run-ours-side-stream "$(cap 150)" qmoe-doctor run --save "$R/run-ours-side-stream.json" -- python3 $E \
    --gpus "$GPUS" --side-stream --steps 2
  tail -2 "$R/run-ours-side-stream.log" | tee -a "$S"
  t step-plain "$(cap 150)" python3 $E --gpus "$GPUS" --steps 20
  t step-monitored "$(cap 150)" qmoe-doctor run -- python3 $E --gpus "$GPUS" --steps 20
  grep -h "median step" "$R/step-plain.log" "$R/step-monitored.log" | tee -a "$S"
fi
if has ranks; then
  # torchrun as a module of this python3 (a bare `torchrun` may belong to another Python)
  TR=(python3 -m torch.distributed.run --nproc-per-node 2 examples/moe_ranks.py --steps 2)
  t ranks-ours "$(cap 150)" qmoe-doctor run --save "$R/ranks-ours.json" -- "${TR[@]}"
  tail -2 "$R/ranks-ours.log" | tee -a "$S"
  t ranks-no-set-device "$(cap 150)" qmoe-doctor run --save "$R/ranks-no-set-device.json" -- "${TR[@]}" \
    --kernel specimen:rank_no_set_device
  grep -E "^qmoe-doctor|^device-never-set|diagnos" "$R/ranks-no-set-device.log" | head -5 | tee -a "$S"
fi
if has verdict; then
  rm -rf "$TRITON_CACHE_DIR"
  t scan-cold "$(cap 120)" qmoe-doctor scan --gpus "$GPUS" --kernel specimen:unguarded --save "$R/scan-cold.json"
  expect_verdict "$R/scan-cold.json" missing-device-guard
  t scan-warm "$(cap 120)" qmoe-doctor scan --gpus "$GPUS" --kernel specimen:unguarded --save "$R/scan-warm.json"
  expect_verdict "$R/scan-warm.json" missing-device-guard
  rm -rf "$TRITON_CACHE_DIR"
  t repro-cold "$(cap 120)" qmoe-doctor repro --gpus "$GPUS" --kernel specimen:unguarded --out "$R/repro-cold"
  t repro-warm "$(cap 120)" qmoe-doctor repro --gpus "$GPUS" --kernel specimen:unguarded --out "$R/repro-warm"
  grep -h -iE "verdict" "$R/repro-cold.log" "$R/repro-warm.log" | head -4 | tee -a "$S"
fi
if has tests; then
  t pytest-gpu "$(cap "${TEST_TIMEOUT:-300}")" python3 -m pytest tests/gpu -m "gpu or multigpu" -q -p no:cacheprovider -rfE
  tail -3 "$R/pytest-gpu.log" | tee -a "$S"
fi
if has evidence; then
  # shellcheck disable=SC2086  # SANITIZER_CASES is a list of case names
  t evidence "$(cap 400)" python3 tools/evidence/record_sanitizer_logs.py "$R/evidence" ${SANITIZER_CASES:-}
  tail -20 "$R/evidence.log" | tee -a "$S"
fi
if has compare; then
  E=examples/qwen3_moe_device_map.py
  FIRST=${GPUS%%,*}
  verdict() {  # one line from a saved run --compare report
    python3 - "$1" <<'PY' | tee -a "$S"
import json, sys
try:
    c = json.load(open(sys.argv[1]))["compare"]
except Exception as exc:
    print(f"   no report ({exc})"); sys.exit()
d = c["divergence"]
at = f"{d['launch']['kernel']} #{d['launch']['ordinal']} {d['where']} on {d['launch']['device']}" if d else "-"
print(f"   verdict: {c['verdict'][:160]} | cause {c['cause']} | divergent {at}")
PY
  }
  t compare-race-pair "$(cap 150)" qmoe-doctor run --compare blocking --repeat 1 --save "$R/compare-race-pair.json" -- \
    python3 $E --gpus "$GPUS" --race side-stream --steps 2
  verdict "$R/compare-race-pair.json"
  common="--layers 4 --steps 1 --race producer"
  t compare-placement-unguarded "$(cap 150)" qmoe-doctor run --repeat 1 --save "$R/compare-placement-unguarded.json" \
    --compare "python3 $E --gpus $FIRST $common --kernel specimen:unguarded" -- \
    python3 $E --gpus "$GPUS" $common --kernel specimen:unguarded
  verdict "$R/compare-placement-unguarded.json"
  t compare-placement-ours "$(cap 150)" qmoe-doctor run --repeat 1 --save "$R/compare-placement-ours.json" \
    --compare "python3 $E --gpus $FIRST $common" -- python3 $E --gpus "$GPUS" $common
  verdict "$R/compare-placement-ours.json"
fi
finish
