#!/usr/bin/env bash
# The parallel modes on the GPUs of one host: dp, pp, tp and ep with the built-in kernel, each
# rank against a single-device run of the same weights and inputs, plus the one-GPU baseline
# (step time, tokens/s, speedup); then the two rank-level specimens, each of which must be
# diagnosed on every rank but rank 0; then `repro --parallel` and its torchrun scripts.
# One device call on `nvidia-h100-x2` / `nvidia-h200-x2` or larger (about 3-5 minutes).
#
#   bash tools/gpu/parallel.sh [STEPS...]
#
# Steps (default: all):
#   modes      qmoe-doctor parallel --modes dp,pp,tp,ep at PRESET, TOKENS per step
#   specimens  specimen:rank_no_set_device under dp (want device-never-set) and
#              specimen:global_expert_ids under ep (want invalid-routing), tiny preset, untimed
#   repro      qmoe-doctor repro --parallel for both specimens and the built-in kernel; each
#              written script run under torchrun (want: rank 0 PASS, the others FAIL, exit 1)
#   ep-batch   the ep mode alone at 65,536 and 131,072 tokens per step (where its speedup shows)
# Knobs: GPUS (default: all), PRESET (qwen3-30b-a3b), TOKENS (32768), TIMED_STEPS (10),
# WARMUP (2), BUDGET (560).
# Results: $OUT/summary.txt (a table per mode, verdicts) and $OUT/logs.tar.gz (JSON reports,
# every rank's log). Record the run in docs/validation/parallel.md.
DEFAULT_STEPS="modes specimens repro"
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
header
PRESET=${PRESET:-qwen3-30b-a3b}; TOKENS=${TOKENS:-32768}; TIMED_STEPS=${TIMED_STEPS:-10}; WARMUP=${WARMUP:-2}
GPU_ARGS=(); RANKS=$NG
if [[ -n "${GPUS:-}" && "${GPUS:-}" != all ]]; then
  GPU_ARGS=(--gpus "$GPUS"); RANKS=$(tr ',' '\n' <<< "$GPUS" | wc -l)
fi

if has modes; then
  t modes "$(cap 200)" qmoe-doctor parallel --modes dp,pp,tp,ep "${GPU_ARGS[@]}" --preset "$PRESET" \
    --tokens "$TOKENS" --steps "$TIMED_STEPS" --warmup "$WARMUP" --timeout 150 \
    --save "$R/modes.json" --log-dir "$R/modes"
  modes_table "$R/modes.json"
  expect_verdict "$R/modes.json" -
fi
if has specimens; then
  for item in rank_no_set_device:dp:device-never-set global_expert_ids:ep:invalid-routing; do
    IFS=: read -r name mode cause <<< "$item"
    t "specimen-$name" "$(cap 60)" qmoe-doctor parallel --modes "$mode" "${GPU_ARGS[@]}" \
      --kernel "specimen:$name" --preset tiny --tokens 1024 --steps 0 --warmup 0 --no-baseline \
      --timeout 45 --save "$R/specimen-$name.json" --log-dir "$R/specimen-$name"
    expect_verdict "$R/specimen-$name.json" "$cause"  # on every rank but 0 (the line lists where)
  done
fi
if has repro; then
  for item in specimen:rank_no_set_device/dp specimen:global_expert_ids/ep builtin/dp,tp,ep; do
    kernel=${item%/*}; modes=${item#*/}; name=${kernel//:/-}
    t "repro-$name" "$(cap 200)" qmoe-doctor repro --parallel "$modes" --kernel "$kernel" "${GPU_ARGS[@]}" \
      --out "$R/repro-$name"
    grep -iE "cause diagnosed|^script" "$R/repro-$name.log" | head -4 | tee -a "$S"
    for f in "$R/repro-$name"/*.py; do
      [ -f "$f" ] || continue
      t "script-$(basename "$f" .py)" "$(cap 120)" torchrun --standalone --nproc-per-node "$RANKS" "$f"
      grep -E "^rank [0-9]+: (PASS|FAIL|SKIP)" "$R/script-$(basename "$f" .py).log" | sort | tee -a "$S"
    done
  done
fi
if has ep-batch; then
  for tokens in 65536 131072; do
    t "ep-$tokens" "$(cap 200)" qmoe-doctor parallel --modes ep "${GPU_ARGS[@]}" --preset "$PRESET" --tokens "$tokens" \
      --steps "$TIMED_STEPS" --warmup "$WARMUP" --timeout 150 --save "$R/ep-$tokens.json" --log-dir "$R/ep-$tokens"
    modes_table "$R/ep-$tokens.json"
  done
fi
finish
