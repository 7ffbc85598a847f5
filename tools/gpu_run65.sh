#!/usr/bin/env bash
# Run 65 (one H200, tenth session): resident experts' items most row chunks first against
# expert order (run 64's kernel), through a QMOE_DW_EXPERT_ORDER switch patched into
# kernels/dw_overlap.py for this run only and removed after it: the routing probe and the
# table's dw check at 2048 tokens (two random routings, and skewed), alternating the switch,
# then the GPU dw tests with the sorted order.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
BUDGET=580
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
for order in 0 1 0 1; do
  QMOE_DW_EXPERT_ORDER=$order t "probe-$order" 100 python3 tools/routing_probe.py --no-ceilings --forward "" --dw table
  say "QMOE_DW_EXPERT_ORDER=$order"; grep -E "^dw" "$R/probe-$order.log" | grep -v torch | tee -a "$S"
  for hot in 0 0.05; do
    QMOE_DW_EXPERT_ORDER=$order dw_check "check-$order-$hot" table --hot "$hot"
  done
done
for shape in 235b-gate_up 30b-down; do
  for order in 0 1; do
    QMOE_DW_EXPERT_ORDER=$order t "probe-$shape-$order" 100 python3 tools/routing_probe.py --no-ceilings --forward "" --dw table --shape $shape --routings random
    say "$shape QMOE_DW_EXPERT_ORDER=$order"; grep -E "^dw" "$R/probe-$shape-$order.log" | tee -a "$S"
  done
done
dw_tests
pack
echo "==== SUMMARY"; cat "$S"
