#!/usr/bin/env bash
# Run 52 (issue 9, 8x H200): the ordered pairs run 50's scan did not reach (6->7 and 7->0 .. 7->6),
# as seven two-GPU scans (--gpus 6,7 and 7,X; each also re-runs X->7), with --save (the report
# written after every session since run 50).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG"
for pair in 6,7 7,0 7,1 7,2 7,3 7,4 7,5; do
  [ "$(left)" -gt 35 ] || { say "stopped before --gpus $pair (time)"; break; }
  t "scan-$pair" 60 qmoe-doctor scan --gpus "$pair" --no-sweeps --save "$R/scan-${pair/,/-}.json" --log-dir "$R/logs-${pair/,/-}"
  python3 - "$R/scan-${pair/,/-}.json" <<'PY' | tee -a "$S"
import json, sys, collections
d = json.load(open(sys.argv[1]))
st = collections.Counter(o["status"] for o in d["outcomes"])
print(f"  {[s['label'] for s in d['sessions'] if '->' in s['label']]} healthy={d['healthy']} complete={d.get('complete')} "
      f"probes={len(d['outcomes'])} {dict(st)} wall={d['wall_s']:.1f} s")
PY
done
pack
echo "==== SUMMARY"; cat "$S"
