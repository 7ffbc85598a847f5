#!/usr/bin/env bash
# Run 64 (one H200, tenth session): the final paired-item kernel (experts past the resident
# chunks: one-tile items after the resident ones, pieces sized to the round-robin's last
# round) with the packaged table from run 63's sweep: the routing probe, skewed checks, the
# benchmark (qmoe-doctor bench, with its plot), and every GPU kernel and bench test.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
BUDGET=580
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
t probe 150 python3 tools/routing_probe.py --no-ceilings --forward table --dw "table,32x128x128-w8-s3-tma-ov5"
grep -E "^(forward|dw|--)" "$R/probe.log" | tee -a "$S"
for hot in 0.05 0.2; do
  dw_check "check-hot-$hot" "table,32x128x128-w8-s3-tma-ov5" --hot "$hot"
done
t bench 200 qmoe-doctor bench --gpus 0 --tokens 128,512,2048,8192 --out "$R/bench"
python3 - "$R/bench/bench.json" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    if r["impl"] in ("qmoe", "torch._grouped_mm") or "graph" in r["impl"]:
        print(f"{r['op']:24} {r['impl']:44} {r['tokens']:>5} {r['ms'] or 0:8.4f} ms {r['tflops'] or 0:7.1f} {r.get('config') or ''}")
PY
t pytest-gpu $(( $(left) - 10 )) python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py -m "gpu or multigpu" \
  -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-gpu.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
