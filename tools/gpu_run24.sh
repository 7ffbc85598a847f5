#!/usr/bin/env bash
# Validation run 24, one call on nvidia-h200-x2 (budget ~8 minutes), issue 7: the gather dispatch
# (probes/parallel/ep_gather.py: static exchange by copy-engine pushes, own tokens first, weight
# gradients while the input gradients travel) against the all-to-all dispatch.
#  1. tools/ep_profile.py at 131,072 tokens: gather/symm (profiled), all-to-all, gather/collective;
#  2. qmoe-doctor parallel --modes ep with QMOE_EP_DISPATCH=gather at 32,768 / 65,536 / 131,072
#     tokens on GPUs 0,1, each checked and timed against one GPU.
# Logs under $OUT/r, packed into $OUT/run.tar.gz; the summary in $OUT/summary.txt and stdout.
source "$(dirname "$0")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG  $(python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,"nccl",".".join(map(str,torch.cuda.nccl.version())))')"
t ep-profile-131072 240 torchrun --standalone --nproc-per-node 2 tools/ep_profile.py --tokens 131072 \
  --steps 5 --variants "dispatch=gather;micro=1;dispatch=gather,transport=collective" --out "$R/prof-131072"
profile_table
rm -f "$R"/prof-*/ep_trace_rank1_*.json
pack
for tok in 32768 65536 131072; do
  (( $(left) > 100 )) || { say "ep-$tok skipped: $(left) s left"; continue; }
  QMOE_EP_DISPATCH=gather t ep-gather-$tok 150 qmoe-doctor parallel --modes ep --gpus 0,1 --preset qwen3-30b-a3b \
    --tokens "$tok" --steps 10 --warmup 2 --timeout 120 --save "$R/ep-gather-$tok.json" --log-dir "$R/ep-gather-$tok"
  modes_table "$R/ep-gather-$tok.json"
  grep -ho '"ep.transport": "[a-z]*"' "$R"/ep-gather-$tok/ep/rank-*.crumbs 2>/dev/null | sort | uniq -c >> "$S"
done
pack
echo "==== SUMMARY"; cat "$S"
