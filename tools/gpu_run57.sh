#!/usr/bin/env bash
# Run 57 (one H200, ninth session): `qmoe-doctor bench --routing balanced` (new) beside the
# default random routing, same machine: the GEMM rows without partial row tiles, from the
# product's own command.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
for routing in random balanced; do
  t "bench-$routing" 200 qmoe-doctor bench --gpus 0 --tokens 512,2048,8192 --no-block --no-plot --routing "$routing" \
    --out "$R/bench-$routing"
  python3 - "$R/bench-$routing/bench.json" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
print("routing", d["routing"], "|", d["command"])
for r in d["rows"]:
    if r["impl"] in ("qmoe", "torch._grouped_mm"):
        print(f"  {r['op']:8} {r['impl']:20} {r['tokens']:>5} {r['tflops'] or 0:7.1f} TFLOP/s  {r.get('config') or ''}")
PY
done
pack
echo "==== SUMMARY"; cat "$S"
