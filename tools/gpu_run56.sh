#!/usr/bin/env bash
# Run 56 (one H200, ninth session): the memory ceilings on the 30b gate_up weight stack again,
# with a plain streaming read kernel beside torch's sum, and the forward and dw (packaged
# table) at random and balanced routing beside them: how far the forward target of 450
# TFLOP/s sits from what the memory system delivers.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
for i in 1 2; do
  t "probe-$i" 120 python3 tools/routing_probe.py --forward table --dw table
  grep -E "^(ceiling|forward|dw|--)" "$R/probe-$i.log" | tee -a "$S"
done
pack
echo "==== SUMMARY"; cat "$S"
