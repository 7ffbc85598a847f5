#!/usr/bin/env bash
# Run 42 (one H200): after the Gluon dw's shared-memory layouts and capability check were cached
# on the host: host time per call of the three ops, and the benchmark with the packaged table
# (run 40's dw) for docs/performance.md.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
t host 120 python3 tools/host_overhead.py --tokens 128 --calls 100
grep -E "us/call" "$R/host.log" | tee -a "$S"
bench_table
pack
echo "==== SUMMARY"; cat "$S"
