#!/usr/bin/env bash
# Run 29 (one H200): Nsight Compute on our forward / dw and torch._grouped_mm's at the issue's
# point (where the time goes: DRAM, L2, tensor pipes, stalls), then dw configs that fit two
# programs per SM, and the resident kernel with the store after the next tile's MMAs.
# Kept as run: the QMOE_DW_PINGPONG switch was removed from kernels/backward.py after this run
# (slower), so a re-run's "pingpong" steps measure the plain resident kernel again.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
NCU="ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
prof() { local name=$1; shift; t "ncu-$name" 90 $NCU python3 tools/ncu_target.py "$@"
         grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Block Limit|Warp Cycles Per Issued|Stall|One or More|No Eligible" "$R/ncu-$name.log" | head -24 | sed 's/^/    /' | tee -a "$S"; }
prof dw-torch --op dw --impl torch
prof dw-kept --op dw --config 32x128x128-w4-s4-p2-tma
prof dw-r3 --op dw --config 64x128x128-w8-s3-tma-r3
prof fwd-ours --op forward
prof fwd-torch --op forward --impl torch
DW_CFGS=64x128x128-w8-s3-tma-r3,128x128x64-w8-s3-tma-r2,64x128x128-w8-s4-tma-r2,64x128x64-w8-s3-p2-tma-r2,64x128x64-w8-s2-p2-tma-r3,32x128x64-w8-s3-p2-tma-r4,64x128x64-w4-s3-p2-tma-r2,32x128x64-w4-s3-p2-tma-r4,64x128x64-w8-s4-tma-r3,32x128x128-w8-s4-tma-r2,32x128x256-w8-s3-tma-r1
SHAPES=30b-gate_up:2048,30b-down:2048,235b-gate_up:2048,480b-gate_up:2048,30b-gate_up:512,30b-gate_up:8192
t tune-dw 150 python3 benchmarks/tune_kernels.py --ops dw --shapes "$SHAPES" --configs "$DW_CFGS" --out "$R/tune-dw"
grep -E "TFLOP/s|^dw" "$R/tune-dw.log" | tail -70 | tee -a "$S"
QMOE_DW_PINGPONG=1 t tune-dw-pingpong 150 python3 benchmarks/tune_kernels.py --ops dw --shapes "$SHAPES" --configs "$DW_CFGS" --out "$R/tune-dw-pp"
grep -E "^dw" "$R/tune-dw-pingpong.log" | tee -a "$S"
QMOE_DW_PINGPONG=1 t regs-pp 60 python3 tools/kernel_regs.py --op dw --configs "$DW_CFGS"
grep resident "$R/regs-pp.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
