#!/usr/bin/env bash
# Where an expert-parallel step's time goes on the GPUs of one host, and what the bare
# all-to-all moves: tools/profile/ep_profile.py under torchrun (step time, GPU busy, NCCL time,
# GPU idle gaps and the host op that ended each, against one GPU on the full batch) and
# tools/profile/a2a_bench.py under NCCL settings. One device call on 2 or more GPUs (2-4 minutes).
#
#   bash tools/gpu/profile_ep.sh [STEPS...]
#
# Steps (default: profile a2a):
#   profile    ep_profile.py on every GPU, and on GPUs 0,1 when there are more; VARIANTS picks
#              its variants (default "micro=1")
#   a2a        a2a_bench.py on GPUs 0,1: NCCL defaults, NCCL_P2P_NVL_CHUNKSIZE=2M,
#              NCCL_MIN_P2P_NCHANNELS=32; and on every GPU with the defaults
# Knobs: TOKENS (default 32768), VARIANTS, BUDGET (560).
# Results: $OUT/summary.txt (one line per variant, the all-to-all GB/s) and $OUT/logs.tar.gz
# (every rank's JSON, the kernel table, the chrome trace of rank 0). Record the run in
# docs/validation/parallel.md.
DEFAULT_STEPS="profile a2a"
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
header
TOKENS=${TOKENS:-32768}; VARIANTS=${VARIANTS:-micro=1}

profile_line() {  # profile_line DIR: rank 0's figures, one line per variant
  python3 - "$1" <<'PY' | tee -a "$S"
import json, sys
from pathlib import Path
try:
    r = json.loads((Path(sys.argv[1]) / "ep_profile_rank0.json").read_text())
except Exception as exc:
    print("   no result:", exc); sys.exit()
print(f"   world {r['world']}: one GPU {r.get('single_step_ms')} ms, all-to-all {r['all_to_all_ms']} ms "
      f"({r['all_to_all_GBps_per_rank']} GB/s per rank)")
keys = ("step_ms", "ep_speedup", "cpu_forward_ms", "gpu_busy_ms_per_step", "nccl_ms_per_step",
        "gpu_idle_ms_per_step", "host_syncs_per_step")
for name, v in r["variants"].items():
    print("  ", name, {k: v.get(k) for k in keys})
PY
}

if has profile; then
  t "ep-profile-$NG" "$(cap 150)" torchrun --standalone --nproc-per-node "$NG" tools/profile/ep_profile.py \
    --tokens "$TOKENS" --variants "$VARIANTS" --out "$R/ep$NG"
  profile_line "$R/ep$NG"
  if (( NG > 2 )); then
    t ep-profile-2 "$(cap 120)" env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 \
      tools/profile/ep_profile.py --tokens "$TOKENS" --variants "$VARIANTS" --out "$R/ep2"
    profile_line "$R/ep2"
  fi
fi
if has a2a; then
  t a2a-default "$(cap 40)" env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 \
    tools/profile/a2a_bench.py --label default
  t a2a-chunk2M "$(cap 40)" env CUDA_VISIBLE_DEVICES=0,1 NCCL_P2P_NVL_CHUNKSIZE=2097152 torchrun --standalone \
    --nproc-per-node 2 tools/profile/a2a_bench.py --label chunk2M
  t a2a-minp2p32 "$(cap 40)" env CUDA_VISIBLE_DEVICES=0,1 NCCL_MIN_P2P_NCHANNELS=32 torchrun --standalone \
    --nproc-per-node 2 tools/profile/a2a_bench.py --label minp2p32
  (( NG > 2 )) && t "a2a-$NG" "$(cap 40)" torchrun --standalone --nproc-per-node "$NG" tools/profile/a2a_bench.py \
    --label "default-$NG"
  grep -h '^{"label"' "$R"/a2a-*.log | tee -a "$S"
fi
finish
