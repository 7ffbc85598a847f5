#!/usr/bin/env bash
# Run 54 (one H200, ninth session): the overlapped dw kernel trimmed to each expert's own row
# chunks (run 53: +5-7%), now also with 16-row chunks (ov9-ov12: less of the last chunk
# wasted): routing probe, the dw sweep at the 16 preset points merged into the packaged table,
# then with the merged table the benchmark, the dw checks (uniform, skewed, 8192 tokens) and
# the GPU kernel tests.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
SIXTEEN=16x128x128-w8-s3-tma-ov10,16x128x128-w8-s2-tma-ov12,16x128x128-w8-s3-tma-ov9,16x128x128-w8-s2-tma-ov10
t probe 150 python3 tools/routing_probe.py --no-ceilings \
  --forward table,64x256x64-w4-s2-p2-tma-flat,128x256x128-w8-s2-tma-flat \
  --dw "32x128x128-w8-s3-tma-ov5,$SIXTEEN"
grep -E "^(forward|dw|--)" "$R/probe.log" | tee -a "$S"
OV=32x128x128-w8-s2-tma-ov5,32x128x128-w8-s3-tma-ov5,32x128x128-w8-s2-tma-ov6,64x128x128-w8-s2-tma-ov3,32x128x128-w8-s2-tma-ov2,16x128x128-w8-s2-tma-ov2,16x128x128-w8-s2-tma-ov4,32x128x128-w8-s4-tma-ov4
KEPT=32x128x128-w4-s5-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x64-w4-s3-p2-tma-r2,32x128x128-w8-s3-tma-rx6,32x128x128-w8-s3-tma-rx5
t tune-dw 240 python3 benchmarks/tune_kernels.py --ops dw --configs "$OV,$SIXTEEN,$KEPT" --merge kernels/configs_sm90.json --out "$R/tune-dw"
grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
export QMOE_CONFIG_TABLE=$R/tune-dw/configs.json
[ -f "$QMOE_CONFIG_TABLE" ] || unset QMOE_CONFIG_TABLE
bench_table
for hot in 0 0.05 0.2; do
  dw_check "check-table-$hot" table --hot "$hot"
done
dw_check check-table-8192 table --tokens 8192
t pytest-kernels 220 python3 -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_bench_gpu.py -m "gpu or multigpu" \
  -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-kernels.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
