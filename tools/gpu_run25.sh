#!/usr/bin/env bash
# Validation run 25, one call on nvidia-h200-x4 (budget ~9 minutes), issue 7 with the gather
# dispatch as the ep mode's default (QMOE_EP_DISPATCH=auto: gather on up to four ranks):
#  1. tools/ep_profile.py, gather dispatch, 131,072 tokens, GPUs 0,1 (stacks dumped after 90 s: run
#     24's profile of it never printed);
#  2. tools/gpu_parallel.sh on GPUs 0,1 and on all four: dp, pp, tp, ep against one GPU, and the two
#     rank specimens;
#  3. the ep mode at 131,072 tokens (twice on 0,1, once on all four) and 262,144 tokens on 0,1.
# Logs under $OUT/r, packed into $OUT/run.tar.gz; the summary in $OUT/summary.txt and stdout.
source "$(dirname "$0")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG  $(python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,"nccl",".".join(map(str,torch.cuda.nccl.version())))')"
CUDA_VISIBLE_DEVICES=0,1 t ep-profile-gather 120 torchrun --standalone --nproc-per-node 2 tools/ep_profile.py \
  --tokens 131072 --steps 5 --variants "dispatch=gather" --dump-after 90 --out "$R/prof"
grep -E "^rank|^\{" "$R/ep-profile-gather.log" | cut -c1-600 >> "$S"
grep -A12 "Thread\|Current thread" "$R/ep-profile-gather.log" | grep -E "File .*(ep_gather|modes|ep_profile|autograd)" | sort | uniq -c | head -12 >> "$S"
rm -f "$R"/prof/ep_trace_rank1_*.json
for g in 0,1 all; do
  n=$([ "$g" = all ] && echo "$NG" || echo 2)
  OUT=$R/par$n GPUS=$g SKIP_INSTALL=1 BUILTIN_LIMIT=200 t parallel-${n}gpu 330 bash tools/gpu_parallel.sh
  tail -16 "$R/par$n/parallel/summary.txt" >> "$S" 2>/dev/null
done
ep() {  # tokens gpus name
  t "$3" 150 qmoe-doctor parallel --modes ep --gpus "$2" --preset qwen3-30b-a3b --tokens "$1" --steps 10 --warmup 2 \
    --timeout 140 --save "$R/$3.json" --log-dir "$R/$3"
  modes_table "$R/$3.json"
}
for spec in "131072 0,1 ep-131072-2gpu-a" "131072 $ALL ep-131072-${NG}gpu" "131072 0,1 ep-131072-2gpu-b" "262144 0,1 ep-262144-2gpu"; do
  (( $(left) > 90 )) || { say "skipped $spec: $(left) s left"; continue; }
  ep $spec
done
grep -rho '"ep.\(transport\|dispatch\)":"[a-z0-9]*"' "$R" 2>/dev/null | sort | uniq -c >> "$S"
pack
echo "==== SUMMARY"; cat "$S"
