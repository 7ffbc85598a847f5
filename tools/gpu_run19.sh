#!/usr/bin/env bash
# Validation run 19, one call on nvidia-h200-x4 (budget ~7 minutes):
#  1. tools/gpu_parallel.sh on all four GPUs: dp, pp, tp, ep against one GPU (30B preset, 32,768
#     tokens/step), then the two rank specimens (each must be diagnosed on rank 1);
#  2. tools/ep_profile.py (one micro-batch) on 4 and on 2 GPUs, and on 2 GPUs again with the
#     caching allocator's expandable segments: step, GPU busy, NCCL, GPU idle gaps and the host op
#     that ended each, allocator calls in the timed steps;
#  3. tools/a2a_bench.py: the bare all-to-all on 2 GPUs (default NCCL, NCCL_P2P_NVL_CHUNKSIZE=2M,
#     NCCL_MIN_P2P_NCHANNELS=32) and on 4;
#  4. if time is left: tools/gpu_repro_parallel.sh on the four GPUs (no dw sweep).
# Logs under $OUT/r, packed into $OUT/run.tar.gz; the summary in $OUT/summary.txt and stdout.
source "$(dirname "$0")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG"
nvidia-smi topo -m > "$R/topo.txt" 2>&1

# 1. the four modes and the specimens on every GPU
t parallel-all 300 env OUT="$R" SKIP_INSTALL=1 BUILTIN_LIMIT=200 bash tools/gpu_parallel.sh
sed -n '/^versions/p;/built-in kernel/,$p' "$R/parallel/summary.txt" >> "$S"

# 2. where an EP step's time goes
t ep-profile-$NG 120 torchrun --standalone --nproc-per-node "$NG" tools/ep_profile.py --variants micro=1 --out "$R/ep$NG"
t ep-profile-2 90 env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 tools/ep_profile.py --variants micro=1 --out "$R/ep2"
t ep-profile-2-expandable 90 env CUDA_VISIBLE_DEVICES=0,1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  torchrun --standalone --nproc-per-node 2 tools/ep_profile.py --variants micro=1 --out "$R/ep2x"
python3 - "$R" "$NG" <<'PY' | tee -a "$S"
import json, sys
from pathlib import Path
R = Path(sys.argv[1])
for d in (f"ep{sys.argv[2]}", "ep2", "ep2x"):
    try:
        r = json.loads((R / d / "ep_profile_rank0.json").read_text())
    except Exception as exc:
        print(d, "no result", exc); continue
    print(f"\n{d}: world {r['world']}, single {r.get('single_step_ms')} ms, a2a {r['all_to_all_ms']} ms "
          f"({r['all_to_all_GBps_per_rank']} GB/s/rank); single idle {r.get('single', {}).get('gpu_idle_ms_per_step')} ms/step")
    for g in r.get("single", {}).get("gpu_idle_gaps", [])[:4]:
        print("   single gap", g)
    for name, v in r["variants"].items():
        keys = ("step_ms", "forward_ms", "cpu_forward_ms", "backward_ms", "ep_speedup", "gpu_busy_ms_per_step",
                "nccl_ms_per_step", "gpu_idle_ms_per_step", "host_syncs_per_step", "allocator_in_timed_steps")
        print(" ", name, {k: v.get(k) for k in keys})
        for g in v.get("gpu_idle_gaps", []):
            print("   gap", g)
PY

# 3. the bare all-to-all under NCCL settings
t a2a-2 40 env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 tools/a2a_bench.py --label default
t a2a-2-chunk 40 env CUDA_VISIBLE_DEVICES=0,1 NCCL_P2P_NVL_CHUNKSIZE=2097152 torchrun --standalone --nproc-per-node 2 tools/a2a_bench.py --label chunk2M
t a2a-2-chan 40 env CUDA_VISIBLE_DEVICES=0,1 NCCL_MIN_P2P_NCHANNELS=32 torchrun --standalone --nproc-per-node 2 tools/a2a_bench.py --label minp2p32
t a2a-$NG 40 torchrun --standalone --nproc-per-node "$NG" tools/a2a_bench.py --label default
grep -h '^{"label"' "$R"/a2a-*.log >> "$S"

# 4. repro --parallel on every GPU
if (( $(left) > 170 )); then
  GPUS=$(seq -s, 0 $((NG - 1)))
  t repro-parallel-all $(( $(left) - 20 )) env OUT="$R/rp" GPUS="$GPUS" TUNE=0 bash tools/gpu_repro_parallel.sh
  cat "$R/rp/summary.txt" >> "$S" 2>/dev/null
  cp -r /tmp/m_keep2 "$R/rp/m" 2>/dev/null
else
  say "repro --parallel skipped: $(left) s left"
fi
pack
echo "==== SUMMARY"; cat "$S"
