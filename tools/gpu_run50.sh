#!/usr/bin/env bash
# Run 50 (issue 9, 8x H200, `nvidia-h200-x8`): the inventory and topology of eight GPUs, the
# full default `qmoe-doctor scan` of the built-in kernel over all 56 ordered pairs (report and
# per-condition times). `qmoe-doctor check` and the parallel modes at the 235B preset are the
# next call (tools/gpu_run51.sh).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG  $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"nccl",".".join(map(str,torch.cuda.nccl.version())),"python",sys.version.split()[0])')"
nvidia-smi topo -m > "$R/topo8.txt" 2>&1
t env 60 qmoe-doctor env
t scan 560 qmoe-doctor scan --save "$R/scan8-builtin.json" --log-dir "$R/scan-logs"
tail -25 "$R/scan.log" | tee -a "$S"
python3 - "$R/scan8-builtin.json" <<'PY' | tee -a "$S"
import json, sys, collections
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:
    print("no scan report:", exc); sys.exit()
w = collections.defaultdict(float); n = collections.Counter(); st = collections.Counter()
for o in d["outcomes"]:
    c = o["spec"]["condition"]; w[c] += o.get("wall_s") or 0; n[c] += 1; st[o["status"]] += 1
print(f"scan: healthy={d['healthy']} probes={len(d['outcomes'])} sessions={len(d['sessions'])} wall={d['wall_s']:.1f} s statuses={dict(st)}")
print("diagnoses:", [x.get("cause") for x in d["diagnoses"]], "unexplained:", [u.get("probe_id") for u in d["unexplained"]])
for c in sorted(w, key=lambda c: -w[c]):
    print(f"  {c:16} {n[c]:4} probes {w[c]:7.1f} s")
PY
# check runs in the next call (tools/gpu_run51.sh), before the parallel modes

pack
echo "==== SUMMARY"; cat "$S"
