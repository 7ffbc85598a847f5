#!/usr/bin/env bash
# Run 44 (one H200): the overlapped dw kernel's streamed path rebuilt (whole chunks from shared
# memory, MMAs left in flight while the ring refills) and a CTA barrier before every slot
# refill: the GPU dw tests; the check at 2048 tokens (resident path: did the barriers cost?),
# at 8192 tokens (every expert streamed) and with 5% of the rows on one expert; the dw host
# path by stage; then a dw sweep at the two 8192-token points where dw lost to torch (larger
# tiles of the Triton TMA kernel, the -ov configs), merged into the packaged table.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
dw_tests
CHK=64x128x128-w8-s2-tma-ov3,32x128x128-w8-s3-tma-ov5,64x128x128-w8-s3-tma-r3,32x128x128-w4-s4-p2-tma
dw_check check "$CHK"
dw_check check-8192 "$CHK,64x128x128-w8-s3-tma-ov3" --tokens 8192
dw_check check-hot "$CHK" --hot 0.05
t host 90 python3 tools/host_overhead.py --tokens 128 --calls 100
grep -E "us/call|by stage" "$R/host.log" | tee -a "$S"
PLAIN=32x128x128-w4-s4-p2-tma,32x128x128-w4-s5-p2-tma,32x128x128-w8-s4-p2-tma,64x128x128-w4-s2-p2-tma,64x128x64-w4-s4-p2-tma
PLAIN=$PLAIN,32x128x64-w4-s6-p2-tma,64x128x128-w8-s4-tma,64x256x128-w8-s3-tma,64x128x256-w8-s3-tma,32x256x128-w8-s4-tma
PLAIN=$PLAIN,32x128x256-w8-s4-tma,128x128x128-w8-s2-tma,64x256x64-w8-s4-tma,64x64x128-w4-s4-p3-tma
OV=64x128x128-w8-s2-tma-ov3,64x128x128-w8-s3-tma-ov3,32x128x128-w8-s3-tma-ov5,32x128x128-w8-s4-tma-ov4
t tune-dw 240 python3 benchmarks/tune_kernels.py --ops dw --shapes 30b-gate_up:8192,30b-down:8192 \
  --configs "$PLAIN,$OV" --merge kernels/configs_sm90.json --out "$R/tune-dw"
grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
python3 - "$R/tune-dw/tune.json" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(f"  {r['point']:12} {r['tokens']:5} {r['impl'][:8]:8} {r['config']:28} {r['path']:14} {r['tflops'] or 0:7.1f} {r['note'][:40]}")
PY
pack
echo "==== SUMMARY"; cat "$S"
