#!/usr/bin/env bash
# Validation run 20, one call on nvidia-h200-x4 (budget ~7 minutes):
#  1. repro --parallel for both rank specimens on the four GPUs, each written script under torchrun
#     with four processes (every rank's line must be printed: run 19 lost one);
#  2. the ep mode at larger global batches (65,536 and 131,072 tokens/step, 30B preset) on GPUs 0,1
#     and on all four, each against one GPU on the same batch;
#  3. the GPU test suite (gpu and multigpu marks) with four GPUs visible, if time is left.
# Logs under $OUT/r, packed into $OUT/run.tar.gz; the summary in $OUT/summary.txt and stdout.
source "$(dirname "$0")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG  $(python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,"nccl",".".join(map(str,torch.cuda.nccl.version())))')"

# 1. repro --parallel, both specimens, every GPU
for item in specimen:rank_no_set_device/dp specimen:global_expert_ids/ep; do
  k=${item%/*}; m=${item#*/}; n=$(echo "$k" | tr ':' '-')
  t repro-$n 120 qmoe-doctor repro --parallel "$m" --kernel "$k" --gpus "$ALL" --out "$R/repro-$n"
  grep -E "cause diagnosed|^script" "$R/repro-$n.log" | head -3 >> "$S"
  for f in "$R/repro-$n"/*.py; do
    [ -f "$f" ] || continue
    timeout -k 10 90 torchrun --standalone --nproc-per-node "$NG" "$f" > "$f.log" 2>&1; rc=$?
    say "  script $(basename "$f"): rc=$rc"; grep -E "^rank [0-9]+: (PASS|FAIL|SKIP)" "$f.log" | sort >> "$S"
  done
done

# 2. ep at larger batches, 2 and all GPUs
for tok in 65536 131072; do
  for g in 0,1 "$ALL"; do
    n=$(echo "$g" | tr ',' '\n' | wc -l)
    t ep-$tok-${n}gpu 150 qmoe-doctor parallel --modes ep --gpus "$g" --preset qwen3-30b-a3b --tokens "$tok" \
      --steps 10 --warmup 2 --timeout 120 --save "$R/ep-$tok-${n}gpu.json" --log-dir "$R/ep-$tok-${n}gpu"
    modes_table "$R/ep-$tok-${n}gpu.json"
  done
done

# 3. the GPU tests with every GPU visible
if (( $(left) > 200 )); then
  t pytest-gpu $(( $(left) - 15 )) python3 -m pytest tests/gpu -m "gpu or multigpu" -q -p no:cacheprovider -rfE
  tail -3 "$R/pytest-gpu.log" >> "$S"
else
  say "GPU tests skipped: $(left) s left"
fi
pack
echo "==== SUMMARY"; cat "$S"
