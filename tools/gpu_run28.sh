#!/usr/bin/env bash
# Run 28 (one H200): the write and copy ceilings of the device, the resident-dy dw kernel
# against the kept one and torch._grouped_mm at the 16 preset points, its registers and
# spills, its GPU tests, then a few forward configs. Results in $OUT/run.tar.gz, summary last.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run_common.sh"
say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
say "tools: $(command -v ncu nsys compute-sanitizer | tr '\n' ' ')"
t bandwidth 60 python3 - <<'PY'
import torch, triton.testing as tt
n = 128 * 1536 * 2048  # the 30B gate_up dw: 805 MB of bf16
a = torch.empty(n, dtype=torch.bfloat16, device="cuda"); b = torch.empty_like(a)
for name, fn, nbytes in (("fill (write)", lambda: a.zero_(), 2 * n), ("copy (read+write)", lambda: b.copy_(a), 4 * n)):
    ms = tt.do_bench(fn, warmup=10, rep=100)
    print(f"{name:18} {ms:.4f} ms  {nbytes / ms / 1e6:.0f} GB/s")  # run 28 divided by 1e9 here
PY
cat "$R/bandwidth.log" | tee -a "$S"
DW_CFGS=32x128x128-w4-s4-p2-tma,64x128x128-w8-s3-p2-tma,64x128x128-w8-s3-tma-r3,64x128x128-w8-s4-tma-r2,64x128x128-w8-s3-tma-r1,32x128x128-w8-s4-tma-r4,32x128x128-w8-s4-tma-r2,64x128x256-w8-s2-tma-r3,64x256x128-w8-s2-tma-r3,64x128x128-w4-s3-tma-r2,64x128x128-w8-s3-p2-tma-r2,16x128x128-w8-s4-tma-r1,32x128x128-w8-s4-tma-r1,32x128x256-w8-s3-tma-r1
t tune-dw 280 python3 benchmarks/tune_kernels.py --ops dw --configs "$DW_CFGS" --out "$R/tune-dw"
tail -25 "$R/tune-dw.log" | tee -a "$S"
t regs 60 python3 tools/kernel_regs.py --op dw --configs "$DW_CFGS"
grep -i "resident\|dw_tma" "$R/regs.log" | tee -a "$S"
t pytest-dw 90 python3 -m pytest tests/gpu/test_kernels_gpu.py -k "hopper_dw or dw_bf16" -q -p no:cacheprovider -rfE
tail -3 "$R/pytest-dw.log" | tee -a "$S"
FWD_CFGS=128x256x64-w8-s4-tma-flat,128x128x64-w8-s3-p2-tma-flat,128x128x64-w4-s3-p2-tma-flat,128x256x32-w8-s6-tma-flat,128x256x128-w8-s2-tma-flat,64x256x64-w4-s2-p2-tma-flat
[ "$(left)" -gt 60 ] && t tune-fwd $(( $(left) - 15 )) python3 benchmarks/tune_kernels.py --ops forward --shapes 30b-gate_up:2048,30b-down:2048,235b-gate_up:2048 --configs "$FWD_CFGS" --out "$R/tune-fwd"
[ -f "$R/tune-fwd.log" ] && tail -6 "$R/tune-fwd.log" | tee -a "$S"
pack
echo "==== SUMMARY"; cat "$S"
