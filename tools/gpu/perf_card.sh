#!/usr/bin/env bash
# Our kernels on this card, against the issue's targets: measure ours side by side with
# torch._grouped_mm, the public design's best fixed tile and dense cuBLAS at every preset point,
# the memory roofline, the eager MoE block and the host time per call, and print the targets,
# last (PASS / FAIL; UNMEASURED where a point failed or was not reached, never PASS then). A card with a packaged config table (kernels/configs-<device key>.json:
# the H200 and the H100 80GB HBM3 today) is not tuned again: one device call on one GPU of about
# 2-3 minutes (H100). A card without one is tuned first (about 3 more minutes); set BUDGET lower
# to cut the tune short, never the table's completeness.
#
#   bash tools/gpu/perf_card.sh [--tiny] [STEPS...]
#
# Steps (default: table bench tests):
#   table   the tune below, only where this tree has no kernels/configs-<device key>.json for
#           this card (the key from what the device reports); else one line naming the table
#   tune    benchmarks/tune_kernels.py --set card --package: the per-card candidate set at the 16
#           preset points x forward, dx, dw, each point's incumbent (today's pick) measured with
#           them, so the new table is never slower where it measured; past TUNE_DEADLINE seconds
#           (compile included) only the incumbents, so the table stays complete. Writes
#           kernels/configs-<device key>.json in this tree (the benchmark below uses it) and a
#           copy in $OUT. Name it to tune a card whose table is packaged again
#   bench   python3 -m benchmarks.side_by_side: the per-point table, the roofline, the block,
#           the host time per call, the targets; side_by_side.{json,md} in $OUT. A point that
#           fails (out of memory, a compile or launch error) is marked failed in the table and
#           the targets and the rest are measured; a run stopped before its end (its time limit,
#           a crash) still gives the targets, from the report it wrote after every point
#   tests   the GPU tests of the lean launch path and the plans (tests/gpu/test_kernels_gpu.py -k lean)
#   stages  tools/profile/host_overhead.py: where a call's host time goes, stage by stage
# Bench only (no tune, no tests; the table the kernels pick at run time, packaged or the user's
# cache, which the side-by-side's first line names): bash tools/gpu/perf_card.sh bench
# A few points only (about 2 minutes on an H100, compile included):
#   POINTS=30b-gate_up:2048,30b-down:2048,480b-gate_up:2048 bash tools/gpu/perf_card.sh bench
# --tiny: the control flow on a CPU (Triton interpreter, nothing timed, no GPU test).
# Knobs: TUNE_DEADLINE (default 180 s), JOBS (compile processes, default 12), BUDGET (560),
# POINTS (the side-by-side's --points, GEMM:TOKENS,...; default every preset point), CARD (run
# only where the GPU's name contains it, e.g. CARD=H200: else exit 3 before any work, as
# tools/gpu/run_common.sh says).
# Results: $OUT/summary.txt (ends with the targets), $OUT/configs-<key>.json after a tune (commit
# it as kernels/configs-<key>.json), $OUT/side_by_side.md (the tables of docs/performance.md),
# $OUT/side_by_side.json, $OUT/logs.tar.gz.
TINY=""
if [[ "${1:-}" == "--tiny" ]]; then TINY=1; shift; fi
DEFAULT_STEPS="table bench tests"
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
header
JOBS=${JOBS:-12}

TUNE=""
if has tune; then
  TUNE=1
elif has table; then
  KEY=""
  [[ -z "$TINY" ]] && KEY=$(python3 -c 'from qmoe_doctor.kernels.tuning import device_facts; print(device_facts(0).key)' 2>/dev/null | tail -1)
  if [[ -n "$KEY" && -f "kernels/configs-$KEY.json" ]]; then
    say "table: kernels/configs-$KEY.json is packaged for this card: no tune (step tune tunes it again)"
  else
    TUNE=1
  fi
fi
if [[ -n "$TUNE" ]]; then
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
SBS=$R/side-by-side.log
if has bench; then
  if [[ -n "$TINY" ]]; then
    t side-by-side "$(cap 120)" python3 -m benchmarks.side_by_side --tiny --out "$R/sbs"
  else
    t side-by-side "$(cap 300)" python3 -m benchmarks.side_by_side --jobs "$JOBS" ${POINTS:+--points "$POINTS"} \
      --out "$R/sbs"
  fi
  # stopped before its targets (killed at its limit, a crash no per-point catch holds): the
  # tables and targets from the report it wrote after every point, the rest marked not reached
  if ! grep -q "^==== targets" "$SBS" && [[ -f "$R/sbs/side_by_side.partial.json" ]]; then
    say "side-by-side stopped before its end: the targets from $R/sbs/side_by_side.partial.json"
    python3 -m benchmarks.side_by_side --render-partial "$R/sbs/side_by_side.partial.json" --out "$R/sbs" \
      >> "$SBS" 2>&1
  fi
  cp "$R/sbs/side_by_side.md" "$R/sbs/side_by_side.json" "$OUT"/ 2>/dev/null
  sed -n '/^==== targets/,$!p' "$SBS" | grep -vE "^  |^compil|^wrote|Warning" | tail -60 | tee -a "$S" > /dev/null
fi
if has tests && [[ -z "$TINY" ]]; then
  t pytest-lean "$(cap 90)" python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -k "lean or plan" -q -p no:cacheprovider -rfE
  tail -2 "$R/pytest-lean.log" | tee -a "$S"
fi
if has stages && [[ -z "$TINY" ]]; then
  t stages "$(cap 60)" python3 tools/profile/host_overhead.py --tokens 128 --calls 200
  grep -E "us/call|by stage" "$R/stages.log" | tee -a "$S"
fi
# the targets, last (tools/gpu/run_common.sh's summary ends with them), whatever happened above
if has bench; then
  say "==== targets ($(grep -m1 -o 'config table.*' "$SBS" 2>/dev/null | head -c 200))"
  if grep -q "^==== targets" "$SBS" 2>/dev/null; then
    sed -n '/^==== targets/,$p' "$SBS" | tail -n +2 | grep -vE "^wrote" | tee -a "$S" > /dev/null
  else
    say "FAIL  side-by-side measured no point (no report to take targets from); $SBS ends:"
    if [[ -s "$SBS" ]]; then tail -5 "$SBS" | cut -c1-200 | tee -a "$S" > /dev/null; else say "      (nothing)"; fi
  fi
fi
finish
