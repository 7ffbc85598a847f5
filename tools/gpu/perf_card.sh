#!/usr/bin/env bash
# Our kernels on this card, against the issue's targets: tune this card's launch-config table,
# then measure ours side by side with torch._grouped_mm, the public design's best fixed tile and
# dense cuBLAS at every preset point, the memory roofline, the eager MoE block and the host time
# per call, and print the targets as a pass/fail table, last. One device call on one GPU (H100:
# about 5-6 minutes; set BUDGET lower to cut the tune short, never the table's completeness).
#
#   bash tools/gpu/perf_card.sh [--tiny] [STEPS...]
#
# Steps (default: tune bench tests):
#   tune    benchmarks/tune_kernels.py --set card --package: the per-card candidate set at the 16
#           preset points x forward, dx, dw, each point's incumbent (today's pick) measured with
#           them, so the new table is never slower where it measured; past TUNE_DEADLINE seconds
#           (compile included) only the incumbents, so the table stays complete. Writes
#           kernels/configs-<device key>.json in this tree (the benchmark below uses it) and a
#           copy in $OUT
#   bench   python3 -m benchmarks.side_by_side: the per-point table, the roofline, the block,
#           the host time per call, the targets; side_by_side.{json,md} in $OUT
#   tests   the GPU tests of the lean launch path and the plans (tests/gpu/test_kernels_gpu.py -k lean)
#   stages  tools/profile/host_overhead.py: where a call's host time goes, stage by stage
# --tiny: the control flow on a CPU (Triton interpreter, nothing timed, no GPU test).
# Knobs: TUNE_DEADLINE (default 180 s), JOBS (compile processes, default 12), BUDGET (560).
# Results: $OUT/summary.txt (ends with the targets), $OUT/configs-<key>.json (commit it as
# kernels/configs-<key>.json), $OUT/side_by_side.md (the tables of docs/performance.md),
# $OUT/side_by_side.json, $OUT/logs.tar.gz.
TINY=""
if [[ "${1:-}" == "--tiny" ]]; then TINY=1; shift; fi
DEFAULT_STEPS="tune bench tests"
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
header
JOBS=${JOBS:-12}

if has tune; then
  if [[ -n "$TINY" ]]; then
    t tune "$(cap 120)" python3 benchmarks/tune_kernels.py --tiny --out "$R/tune"
  else
    t tune "$(cap 280)" python3 benchmarks/tune_kernels.py --set card --deadline-s "${TUNE_DEADLINE:-180}" \
      --jobs "$JOBS" --package --out "$R/tune"
    grep -E "^(op|forward|dx|dw)" "$R/tune.log" | tee -a "$S" > /dev/null
  fi
  grep -E "^table for|past --deadline" "$R/tune.log" | tee -a "$S"
  cp "$R"/tune/configs-*.json "$OUT"/ 2>/dev/null
fi
if has bench; then
  if [[ -n "$TINY" ]]; then
    t side-by-side "$(cap 120)" python3 -m benchmarks.side_by_side --tiny --out "$R/sbs"
  else
    t side-by-side "$(cap 220)" python3 -m benchmarks.side_by_side --jobs "$JOBS" --out "$R/sbs"
  fi
  cp "$R/sbs/side_by_side.md" "$R/sbs/side_by_side.json" "$OUT"/ 2>/dev/null
  sed -n '/^==== targets/,$!p' "$R/side-by-side.log" | grep -vE "^  |^compil|^wrote|Warning" | tail -60 | tee -a "$S" > /dev/null
fi
if has tests && [[ -z "$TINY" ]]; then
  t pytest-lean "$(cap 90)" python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -k "lean or plan" -q -p no:cacheprovider -rfE
  tail -2 "$R/pytest-lean.log" | tee -a "$S"
fi
if has stages && [[ -z "$TINY" ]]; then
  t stages "$(cap 60)" python3 tools/profile/host_overhead.py --tokens 128 --calls 200
  grep -E "us/call|by stage" "$R/stages.log" | tee -a "$S"
fi
# the targets, last (tools/gpu/run_common.sh's summary ends with them)
if [[ -f "$R/side-by-side.log" ]]; then
  say "==== targets ($(grep -m1 -o 'config table.*' "$R/side-by-side.log" | head -c 200))"
  sed -n '/^==== targets/,$p' "$R/side-by-side.log" | tail -n +2 | grep -vE "^wrote" | tee -a "$S" > /dev/null
fi
finish
