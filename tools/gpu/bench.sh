#!/usr/bin/env bash
# Our kernels' speed on this GPU against torch._grouped_mm, the per-expert loop and dense
# cuBLAS, the way docs/performance.md reports it: `qmoe-doctor bench` at 128-8192 tokens
# (GEMM rows and MoE block rows, eager and replayed from a CUDA graph, with its plot), then the
# same GEMMs under balanced routing, the host time per call, and the memory ceilings the GEMMs
# are measured against. One device call on one GPU (about 3-5 minutes; `placement` needs two).
#
#   bash tools/gpu/bench.sh [STEPS...]
#
# Steps (default: bench balanced host roofline):
#   bench      qmoe-doctor bench --gpus 0 --tokens $TOKENS (the device's config table, which
#              kernels/tuning.py picks, or QMOE_CONFIG_TABLE) -> the device's table in
#              docs/performance.md (the side-by-side against the peers and the targets:
#              tools/gpu/perf_card.sh)
#   balanced   the GEMM rows with every expert M/E rows (--routing balanced --no-block)
#   host       tools/profile/host_overhead.py --tokens 128: host microseconds per call, ours
#              (lean launch, and through JITFunction.run) against torch._grouped_mm, and where
#              ours go
#   roofline   tools/profile/routing_probe.py: read / write / copy rates of the 30b gate_up
#              weight stack and the forward and dw at 2048 tokens under both routings
#   block      tools/profile/block_profile.py --tokens 2048: where a block step's GPU time goes
#   placement  qmoe-doctor bench --gpus 0,1 --placement: guarded against remote execution
# Knobs: TOKENS (default 128,512,2048,8192), PRESET (qwen3-30b-a3b), BUDGET (560).
# Results: $OUT/summary.txt (the rows), $OUT/logs.tar.gz (bench.json, bench.png, logs).
DEFAULT_STEPS="bench balanced host roofline"
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
header
TOKENS=${TOKENS:-128,512,2048,8192}; PRESET=${PRESET:-qwen3-30b-a3b}

if has bench; then
  t bench "$(cap 240)" qmoe-doctor bench --gpus 0 --preset "$PRESET" --tokens "$TOKENS" --out "$R/bench"
  bench_report "$R/bench/bench.json"
fi
if has balanced; then
  t bench-balanced "$(cap 200)" qmoe-doctor bench --gpus 0 --preset "$PRESET" --tokens "$TOKENS" --routing balanced \
    --no-block --no-plot --out "$R/bench-balanced"
  bench_report "$R/bench-balanced/bench.json"
fi
if has host; then
  t host "$(cap 90)" python3 tools/profile/host_overhead.py --tokens 128 --calls 200
  grep -E "us/call|by stage" "$R/host.log" | tee -a "$S"
fi
if has roofline; then
  t roofline "$(cap 150)" python3 tools/profile/routing_probe.py --forward table --dw table
  grep -E "^(ceiling|forward|dw|--)" "$R/roofline.log" | tee -a "$S"
fi
if has block; then
  t block "$(cap 120)" python3 tools/profile/block_profile.py --preset "$PRESET" --tokens 2048
  tail -20 "$R/block.log" | tee -a "$S"
fi
if has placement; then
  t placement "$(cap 150)" qmoe-doctor bench --gpus 0,1 --placement --no-block --no-plot --tokens 512,2048,8192 \
    --out "$R/placement"
  grep -iA16 "placement" "$R/placement.log" | head -30 | tee -a "$S"
fi
finish
