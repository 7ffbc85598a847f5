#!/usr/bin/env bash
# Validation run 27, one call on nvidia-h200-x4 (budget ~4 minutes), issue 7, the final gather
# dispatch (rotated slots: the peers' rows arrive as one block, no zero rows; rows, weights and
# ids sent as three parts, no packing copy):
#  1. the ep mode at 131,072 tokens on GPUs 0,1 (twice) and on all four, each against one GPU;
#  2. tools/gpu_parallel.sh on all four GPUs (dp, pp, tp, ep and the two rank specimens), if time.
# Logs under $OUT/r, packed into $OUT/run.tar.gz; the summary in $OUT/summary.txt and stdout.
BUDGET=${BUDGET:-250}
source "$(dirname "$0")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG  $(python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,"nccl",".".join(map(str,torch.cuda.nccl.version())))')"
ep() {  # tokens gpus name
  t "$3" 60 qmoe-doctor parallel --modes ep --gpus "$2" --preset qwen3-30b-a3b --tokens "$1" --steps 10 --warmup 2 \
    --timeout 55 --save "$R/$3.json" --log-dir "$R/$3"
  modes_table "$R/$3.json"
}
ep 131072 0,1 ep-131072-2gpu-a
ep 131072 "$ALL" ep-131072-${NG}gpu
ep 131072 0,1 ep-131072-2gpu-b
if (( $(left) > 110 )); then
  OUT=$R/par$NG SKIP_INSTALL=1 BUILTIN_LIMIT=90 t parallel-${NG}gpu $(( $(left) - 5 )) bash tools/gpu_parallel.sh
  tail -16 "$R/par$NG/parallel/summary.txt" >> "$S" 2>/dev/null
else
  say "parallel-${NG}gpu skipped: $(left) s left"
fi
grep -rho '"ep.\(transport\|dispatch\)":"[a-z0-9]*"' "$R" 2>/dev/null | sort | uniq -c >> "$S"
pack
echo "==== SUMMARY"; cat "$S"
