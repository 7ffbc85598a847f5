#!/usr/bin/env bash
# Run 60 (one H200, ninth session): ablation bounds for the overlapped dw, with an
# experiment-only switch QMOE_ABLATE that was patched into kernels/dw_overlap.py for this run and
# removed after it (the script does not measure anything without that patch): 1 = no CTA barrier
# before a ring-slot refill (racy: timing only), 2 = no TMA store of the dw tiles (staged, never
# written), 3 = both. With 2 or 3 the dw is not written: the probe's "ok" then compares memory
# that the allocator handed back from an earlier, correct result; only the timings count.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
for a in 0 1 2 3 0; do
  QMOE_ABLATE=$a t "ablate-$a" 100 python3 tools/routing_probe.py --no-ceilings --forward "" \
    --dw 32x128x128-w8-s3-tma-ov5
  say "ablate=$a"; grep -E "^dw" "$R/ablate-$a.log" | tee -a "$S"
done
pack
echo "==== SUMMARY"; cat "$S"
