#!/usr/bin/env bash
# Validation run 23, one call on nvidia-h200-x2 (budget ~5 minutes), issue 7:
#  1. tools/ce_bench.py at 131,072 and 32,768 tokens: the dispatch payload pushed through
#     symmetric memory by the copy engines against NCCL's all_to_all, alone and beside a grouped
#     GEMM of the rank's EP expert shape (does the exchange hide behind it?);
#  2. tools/ep_profile.py at 131,072 tokens (one micro-batch): where the large-batch EP step goes.
# Logs under $OUT/r, packed into $OUT/run.tar.gz; the summary in $OUT/summary.txt and stdout.
source "$(dirname "$0")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG  $(python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,"nccl",".".join(map(str,torch.cuda.nccl.version())))')"
for tok in 131072 32768; do
  t ce-$tok 120 torchrun --standalone --nproc-per-node 2 tools/ce_bench.py --tokens "$tok" --out "$R/ce-$tok"
  grep -h '^{' "$R/ce-$tok.log" >> "$S"
done
t ep-profile-131072 200 torchrun --standalone --nproc-per-node 2 tools/ep_profile.py --tokens 131072 \
  --steps 5 --variants "micro=1" --out "$R/prof-131072"
profile_table
rm -f "$R"/prof-*/ep_trace_rank1_*.json
pack
cat "$S"
