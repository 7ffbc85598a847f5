#!/usr/bin/env bash
# Validation run 26, one call on nvidia-h200-x2 (budget ~4 minutes), issue 7, after the fix of run
# 25's hang (every exchange's buffers made in one place, where the ranks are in step):
#  1. tools/ep_profile.py, gather dispatch, 131,072 tokens (stacks dumped after 80 s if it hangs);
#  2. the ep mode (default dispatch: gather) at 131,072 tokens twice and at 65,536 once, each
#     against one GPU.
# Logs under $OUT/r, packed into $OUT/run.tar.gz; the summary in $OUT/summary.txt and stdout.
BUDGET=${BUDGET:-280}
source "$(dirname "$0")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG  $(python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,"nccl",".".join(map(str,torch.cuda.nccl.version())))')"
t ep-profile-gather 100 torchrun --standalone --nproc-per-node 2 tools/ep_profile.py \
  --tokens 131072 --steps 5 --variants "dispatch=gather" --dump-after 80 --out "$R/prof"
grep -E "^\{" "$R/ep-profile-gather.log" | cut -c1-1500 >> "$S"
grep -E "File .*(ep_gather|modes)" "$R/ep-profile-gather.log" | sort | uniq -c | head >> "$S"
rm -f "$R"/prof/ep_trace_rank1_*.json
pack
for spec in "131072 a" "131072 b" "65536 a"; do
  set -- $spec
  (( $(left) > 45 )) || { say "skipped $spec: $(left) s left"; continue; }
  t ep-$1-$2 60 qmoe-doctor parallel --modes ep --gpus 0,1 --preset qwen3-30b-a3b --tokens "$1" --steps 10 \
    --warmup 2 --timeout 55 --save "$R/ep-$1-$2.json" --log-dir "$R/ep-$1-$2"
  modes_table "$R/ep-$1-$2.json"
done
grep -rho '"ep.\(transport\|dispatch\)":"[a-z0-9]*"' "$R" 2>/dev/null | sort | uniq -c >> "$S"
pack
echo "==== SUMMARY"; cat "$S"
