#!/usr/bin/env bash
# Run 61 (one H200, ninth session): the overlapped dw with its tiles stored from registers after a
# layout conversion to 16-byte rows (plain global stores, no TMA store), through a QMOE_DS switch
# patched into kernels/dw_overlap.py for this run and removed after it (it lost): timings
# against the TMA-store kernel, and the GPU overlap tests with the switch on.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
for ds in 0 1 0 1; do
  QMOE_DS=$ds t "ds-$ds" 100 python3 tools/routing_probe.py --no-ceilings --forward "" \
    --dw 32x128x128-w8-s3-tma-ov5,16x128x128-w8-s3-tma-ov10
  say "QMOE_DS=$ds"; grep -E "^dw" "$R/ds-$ds.log" | tee -a "$S"
done
QMOE_DS=1 t pytest-ds 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -m gpu -q -p no:cacheprovider -rfE -k "overlap"
tail -3 "$R/pytest-ds.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
