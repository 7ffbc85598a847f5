#!/usr/bin/env bash
# Run 42 (one H200): after the Gluon dw's shared-memory layouts and capability check were cached
# on the host: host time per call of the three ops, and the benchmark with the packaged table
# (run 40's dw) for docs/performance.md.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
t host 120 python3 tools/host_overhead.py --tokens 128 --calls 100
grep -E "us/call" "$R/host.log" | tee -a "$S"
t bench 200 python3 benchmarks/bench_kernels.py --tokens 128,512,2048,8192 --json-out "$R/bench.json" --plot "$R/bench.png"
python3 - "$R/bench.json" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    if r["impl"] in ("qmoe", "torch._grouped_mm", "qmoe MoEBlock", "MoEBlock + torch._grouped_mm"):
        print(f"{r['op']:24} {r['impl']:30} {r['tokens']:>5} {r['ms'] or 0:8.4f} ms {r['tflops'] or 0:7.1f} {r.get('config') or ''}")
PY
pack
echo "==== SUMMARY"; cat "$S"
