#!/usr/bin/env bash
# Run 51 (issue 9, 8x H200): `qmoe-doctor check --require-gpus 8` (JUnit + JSON), then the four
# parallel modes with EP across 8 ranks at the 235B preset against one GPU, and the two rank
# specimens (tools/gpu_parallel.sh).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
t check 80 qmoe-doctor check --require-gpus 8 --junit "$R/check8.xml" --json "$R/check8.json"
tail -8 "$R/check.log" | tee -a "$S"
pack
OUT=$OUT/r SKIP_INSTALL=1 PRESET=qwen3-235b-a22b TOKENS=32768 STEPS=5 WARMUP=1 BUILTIN_LIMIT=330 \
  bash tools/gpu_parallel.sh > "$R/parallel.log" 2>&1
tail -20 "$R/parallel.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
