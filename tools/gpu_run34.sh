#!/usr/bin/env bash
# Run 34 (one H200): the dw configs that won a point in runs 28-32 and the resident kernels with
# 32-row chunks (up to 6: -r5, -r6, -rx5, -rx6) at the 16 preset points, merged into the
# packaged table's forward/dx entries; registers of the new ones; the benchmark with the merged
# table (docs/performance.md); the GPU kernel tests with it.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
DW_CFGS=32x128x128-w4-s4-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x64-w4-s3-p2-tma-r2,32x128x64-w8-s3-p2-tma-r4,32x128x128-w8-s4-tma-r2,64x128x128-w8-s3-tma-rx3,64x128x128-w8-s4-tma-rx2,32x128x128-w8-s3-tma-r6,32x128x128-w8-s3-tma-r5,32x128x128-w8-s3-tma-rx6,32x128x128-w8-s3-tma-rx5,32x128x64-w4-s2-p2-tma-r6
t tune-dw 200 python3 benchmarks/tune_kernels.py --ops dw --configs "$DW_CFGS" --merge kernels/configs_sm90.json --out "$R/tune-dw"
grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
t regs 60 python3 tools/kernel_regs.py --op dw --configs 32x128x128-w8-s3-tma-r6,32x128x128-w8-s3-tma-r5,32x128x128-w8-s3-tma-rx6,32x128x64-w4-s2-p2-tma-r6
grep resident "$R/regs.log" | tee -a "$S"
export QMOE_CONFIG_TABLE=$R/tune-dw/configs.json
t bench 200 python3 benchmarks/bench_kernels.py --tokens 128,512,2048,8192 --json-out "$R/bench.json" --plot "$R/bench.png"
python3 - "$R/bench.json" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    if r["impl"] in ("qmoe", "torch._grouped_mm", "qmoe MoEBlock", "MoEBlock + torch._grouped_mm"):
        print(f"{r['op']:24} {r['impl']:30} {r['tokens']:>5} {r['ms'] or 0:8.4f} ms {r['tflops'] or 0:7.1f} {r.get('config') or ''}")
PY
t pytest-kernels 200 python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py -m "gpu or multigpu" -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-kernels.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
