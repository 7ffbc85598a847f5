#!/usr/bin/env bash
# Run 46 (one H200): run 45's block rows were host-perturbed (the per-expert loop twin, pure
# torch, ran 4.7x slower than in runs 34-42): the benchmark again for docs/performance.md, the
# host path by stage again, and the dw at the two 8192-token points measured three times with
# the kept configs, to put run-to-run spread beside the ratio to torch._grouped_mm.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "load: $(cat /proc/loadavg)"
t bench 200 python3 benchmarks/bench_kernels.py --tokens 128,512,2048,8192 --json-out "$R/bench.json" --plot "$R/bench.png"
python3 - "$R/bench.json" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    if r["impl"] in ("qmoe", "torch._grouped_mm", "qmoe MoEBlock", "MoEBlock + torch._grouped_mm", "per-expert loop twin"):
        print(f"{r['op']:24} {r['impl']:30} {r['tokens']:>5} {r['ms'] or 0:8.4f} ms {r['tflops'] or 0:7.1f} {r.get('config') or ''}")
PY
say "load: $(cat /proc/loadavg)"
t host 90 python3 tools/host_overhead.py --tokens 128 --calls 200
grep -E "us/call|by stage" "$R/host.log" | tee -a "$S"
for i in 1 2 3; do
  t tune-8192-$i 120 python3 benchmarks/tune_kernels.py --ops dw --shapes 30b-gate_up:8192,30b-down:8192 \
    --configs 32x128x128-w4-s5-p2-tma,32x128x128-w4-s4-p2-tma --out "$R/tune-8192-$i"
  grep -E "^dw" "$R/tune-8192-$i.log" | tee -a "$S"
done
pack
echo "==== SUMMARY"; cat "$S"
