#!/usr/bin/env bash
# Run 33 (one H200): where the resident dw kernel's warps stall, per SASS instruction
# (Nsight Compute source page, warp-stall samples), at the issue's point (30b gate_up, 2048 tokens).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
for cfg in 64x128x128-w8-s3-tma-r3 32x128x128-w4-s4-p2-tma; do
  t "sass-$cfg" 150 ncu --profile-from-start off --section SourceCounters --section WarpStateStats \
    --page source --print-source sass --csv -k regex:_grouped_gemm_dw python3 tools/ncu_target.py --op dw --config "$cfg"
  python3 - "$R/sass-$cfg.log" <<'PY' | tee -a "$S"
import csv, io, sys
text = open(sys.argv[1]).read()
start = text.find('"Address"') if '"Address"' in text else text.find('"#"')
rows = list(csv.DictReader(io.StringIO(text[start:])))
key = next((k for k in (rows[0] if rows else {}) if "Warp Stall Sampling (All" in k), None)
if not key:
    print("no stall column:", list(rows[0])[:12] if rows else text[:400]); sys.exit()
def num(v):
    try: return float(str(v).replace(",", ""))
    except ValueError: return 0.0
total = sum(num(r[key]) for r in rows)
print(f"== {sys.argv[1].split('/')[-1]}: {len(rows)} SASS lines, {total:.0f} stall samples")
for r in sorted(rows, key=lambda r: -num(r[key]))[:22]:
    src = r.get("Source") or r.get("SASS") or ""
    print(f"  {100 * num(r[key]) / max(total, 1):5.1f}%  {r.get('Address', '')}  {src[:90]}")
PY
done
pack
echo "==== SUMMARY"; cat "$S"
