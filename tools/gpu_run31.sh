#!/usr/bin/env bash
# Run 31, one call on nvidia-h200-x2 (budget ~6 minutes):
#  1. time to verdict from a cold Triton cache, then warm: the default scan on GPUs 0,1 and
#     repro of the unguarded specimen (issue 8);
#  2. where a block forward + backward step spends its GPU time, ours against ours with
#     torch._grouped_mm as the forward kernel (tools/block_profile.py, issue 8's block rows);
#  3. tools/gpu_parallel.sh on both GPUs: issue 7's final revision (gather dispatch) through
#     all four modes and the two rank specimens;
#  4. the GPU test suite with both GPUs visible (multigpu tests included).
# Logs under $OUT/r, packed into $OUT/run.tar.gz; the summary in $OUT/summary.txt and stdout.
BUDGET=${BUDGET:-560}
export TRITON_CACHE_DIR=/tmp/triton-cache-run31  # empty: the first scan and repro are cold
source "$(dirname "$0")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpus: $NG  $(python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,"nccl",".".join(map(str,torch.cuda.nccl.version())))')"
for pass in cold warm; do
  t "scan-$pass" 90 qmoe-doctor scan --gpus 0,1 --save "$R/scan-$pass.json"
  t "repro-unguarded-$pass" 60 qmoe-doctor repro --gpus 0,1 --kernel specimen:unguarded --out "$R/repro-$pass" --json
done
python3 - "$R" <<'PY' | tee -a "$S"
import json, sys
from pathlib import Path
R = Path(sys.argv[1])
for p in ("cold", "warm"):
    try:
        s = json.loads((R / f"scan-{p}.json").read_text())
        print(f"scan {p}: wall {s['wall_s']:.1f} s, {len(s['outcomes'])} probes, diagnoses {[d['cause'] for d in s['diagnoses']]}")
    except Exception as exc:
        print(f"scan {p}: no report ({exc})")
PY
grep -h "verdict\|wall\|cause" "$R"/repro-unguarded-*.log | head -6 | tee -a "$S"
t block-profile 90 python3 tools/block_profile.py --tokens 2048
grep -A 15 "^== " "$R/block-profile.log" | tee -a "$S"
OUT=$R/par SKIP_INSTALL=1 BUILTIN_LIMIT=150 t parallel-2gpu 220 bash tools/gpu_parallel.sh
tail -16 "$R/par/parallel/summary.txt" >> "$S" 2>/dev/null
(( $(left) > 60 )) && t pytest-gpu $(( $(left) - 10 )) python3 -m pytest tests/gpu -m "gpu or multigpu" -q -p no:cacheprovider -rfE
tail -4 "$R/pytest-gpu.log" >> "$S" 2>/dev/null
pack
echo "==== SUMMARY"; cat "$S"
