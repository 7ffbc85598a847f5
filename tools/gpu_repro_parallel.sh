#!/usr/bin/env bash
set -u
# One device-machine call (validation run 17): repro --parallel on two GPUs (both rank specimens and the built-in
# kernel), each written script run under torchrun, then the dw config sweep on GPU 0.
# Knobs: GPUS=0,1 (the ranks' GPUs; the scripts run with that many processes), TUNE=1 (0: no sweep)
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
V=$OUT/m; mkdir -p $V; S=$OUT/summary.txt; : > $S
GPUS=${GPUS:-0,1}; NP=$(echo "$GPUS" | tr ',' '\n' | wc -l)
python3 -m pip install -q --no-deps --no-build-isolation -e . > $V/install.log 2>&1
for item in specimen:rank_no_set_device/dp specimen:global_expert_ids/ep builtin/dp,tp,ep; do
  k=${item%/*}; m=${item#*/}; n=$(echo "$k" | tr ':' '-')
  t0=$(date +%s)
  timeout -k 10 200 qmoe-doctor repro --parallel $m --kernel $k --gpus $GPUS --out $V/repro-$n > $V/repro-$n.log 2>&1
  echo "repro --parallel $m --kernel $k: rc=$? $(( $(date +%s) - t0 )) s" >> $S
  grep -iE "diagnos|cause|rank [0-9]|script|torchrun|healthy|error" $V/repro-$n.log | head -12 >> $S
  for f in $V/repro-$n/*.py; do
    [ -f "$f" ] || continue
    timeout -k 10 120 torchrun --standalone --nproc-per-node $NP "$f" > "$f.log" 2>&1; rc=$?
    echo "  script $(basename "$f"): rc=$rc" >> $S; grep -E "^rank|PASS|FAIL" "$f.log" | head -6 >> $S
  done
done
[ "${TUNE:-1}" = 1 ] && ( CUDA_VISIBLE_DEVICES=0 timeout -k 10 200 python3 benchmarks/tune_kernels.py --ops dw --out $V/tune > $V/tune.log 2>&1; echo "tune dw rc=$?" ) >> $S
[ "${TUNE:-1}" = 1 ] && grep -v "^  " $V/tune.log | tail -20 >> $S
tar czf $OUT/multi.tar.gz -C $OUT m; mv $V /tmp/m_keep2
cat $S
