#!/usr/bin/env bash
set -u
# One multi-GPU device-machine call (validation runs 14-16): tools/gpu_multi.sh's steps
# (MULTI_STEPS, default "ep parallel"; EP_ARGS picks tools/ep_profile.py's variants), then
# optionally the ep mode alone with QMOE_EP_MICRO_BATCHES=$EXTRA_EP_MICRO and a config sweep
# (TUNE_ARGS, GPU 0); everything packed into $OUT/multi.tar.gz, the summary in $OUT/summary.txt.
#   MULTI_STEPS="ep parallel tests" EP_ARGS="--variants micro=1;micro=2" bash tools/gpu_ep_variants.sh
export OUT=${OUT:-/tmp/out}
export EP_ARGS=${EP_ARGS:---variants micro=1;micro=2}
export EP_TIMEOUT=240 TEST_TIMEOUT=220
STEPS_=${MULTI_STEPS:-ep parallel}; unset STEPS
bash tools/gpu_multi.sh $STEPS_ > /tmp/multi.log 2>&1
V=$OUT/m
if [[ -n "${EXTRA_EP_MICRO:-}" ]]; then
  ( QMOE_EP_MICRO_BATCHES=$EXTRA_EP_MICRO timeout -k 10 120 qmoe-doctor parallel --modes ep --preset qwen3-30b-a3b \
      --tokens 32768 --steps 10 --warmup 2 --save $V/parallel-ep-micro$EXTRA_EP_MICRO.json > $V/parallel-ep-micro.log 2>&1
    echo "parallel ep micro=$EXTRA_EP_MICRO rc=$?"; grep -E "^(single|ep) " $V/parallel-ep-micro.log ) >> $OUT/summary.txt
fi
if [[ -n "${TUNE_ARGS:-}" ]]; then
  ( CUDA_VISIBLE_DEVICES=0 timeout -k 10 200 python3 benchmarks/tune_kernels.py $TUNE_ARGS --out $V/tune > $V/tune.log 2>&1; echo "tune rc=$?" ) >> $OUT/summary.txt
  grep -v "^  " $V/tune.log | tail -45 >> $OUT/summary.txt
fi
tar czf $OUT/multi.tar.gz -C $OUT m; mv $OUT/m /tmp/m_keep
cat $OUT/summary.txt
