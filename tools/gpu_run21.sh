#!/usr/bin/env bash
# Validation run 21, one call on nvidia-h200-x2 (~4 minutes): tools/ep_profile.py (one micro-batch,
# 30B preset, 32,768 tokens/step) under three environments, each twice, interleaved (machine drift
# shows as a difference between the two rounds): the defaults; the caching allocator's expandable
# segments (run 19 measured it 0.9 ms faster once); c10d's flight recorder off
# (TORCH_NCCL_TRACE_BUFFER_SIZE=0: host time per collective). Logs under $OUT/r, packed into
# $OUT/run.tar.gz; a table in $OUT/summary.txt and stdout.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
R=$OUT/r; mkdir -p "$R"; S=$OUT/summary.txt; : > "$S"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || echo "install failed" >> "$S"
echo "date: $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l)" >> "$S"
for round in 1 2; do
  for v in default expandable notrace; do
    case $v in
      default) envs=() ;;
      expandable) envs=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
      notrace) envs=(TORCH_NCCL_TRACE_BUFFER_SIZE=0) ;;
    esac
    timeout -k 10 90 env "${envs[@]}" torchrun --standalone --nproc-per-node 2 tools/ep_profile.py \
      --variants micro=1 --out "$R/$v-$round" > "$R/$v-$round.log" 2>&1 || echo "$v-$round rc=$?" >> "$S"
  done
done
python3 - "$R" <<'PY' | tee -a "$S"
import json, sys
from pathlib import Path
R = Path(sys.argv[1])
print(f"{'env':11}{'round':>6}{'1 GPU ms':>10}{'EP ms':>8}{'speedup':>9}{'cpu fwd':>9}{'busy':>7}{'nccl':>7}{'idle':>7}")
for v in ("default", "expandable", "notrace"):
    for rnd in (1, 2):
        try:
            r = json.loads((R / f"{v}-{rnd}" / "ep_profile_rank0.json").read_text())
        except Exception as exc:
            print(v, rnd, "no result", exc); continue
        m = r["variants"]["micro=1"]
        print(f"{v:11}{rnd:>6}{r['single_step_ms']:>10.2f}{m['step_ms']:>8.2f}{m['ep_speedup']:>9.3f}"
              f"{m['cpu_forward_ms']:>9.2f}{m.get('gpu_busy_ms_per_step', 0):>7.2f}{m.get('nccl_ms_per_step', 0):>7.2f}"
              f"{m.get('gpu_idle_ms_per_step', 0):>7.2f}")
PY
rm -f "$R"/*/ep_trace_rank0_0.json
tar czf "$OUT/run.tar.gz" -C "$OUT" r
cat "$S"
