#!/usr/bin/env bash
# Run 41 (one H200), with run 40's table packaged: where the MoEBlock step's time goes now
# (run 40's block rows: ours behind "MoEBlock + torch._grouped_mm" although both run the same
# backward), host time per call of the three ops (the Gluon dw's launch path included), and the
# overlapped kernel's GPU tests.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
t block-profile 150 python3 tools/block_profile.py --tokens 2048
grep -E "==|ms  x" "$R/block-profile.log" | head -40 | tee -a "$S"
t host 120 python3 tools/host_overhead.py --tokens 128 --calls 100
grep -E "us/call" "$R/host.log" | tee -a "$S"
t pytest-ov 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -k "hopper_dw or overlap" -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-ov.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
