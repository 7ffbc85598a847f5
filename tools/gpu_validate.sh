#!/usr/bin/env bash
# One device-machine call: install, inventory, GPU tests, scans of the built-in kernel and of
# every specimen, sanitizer evidence, a benchmark. Logs under $OUT/v (tarred at the end).
# Usage: tools/gpu_validate.sh [steps...]   steps: install env tests scan specimens sanitizer bench
set -u
OUT=${OUT:-/tmp/out}; V=$OUT/v; mkdir -p "$V"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
STEPS=${*:-install env tests scan specimens sanitizer bench}
SUMMARY=$V/summary.txt; : > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
t() { local name=$1; shift; local t0=$(date +%s%N); "$@" > "$V/$name.log" 2>&1; local rc=$?; local t1=$(date +%s%N);
      say "$(printf '%-34s rc=%-3s %6d ms' "$name" "$rc" "$(( (t1 - t0) / 1000000 ))")"; return $rc; }

if has install; then
  t install python3 -m pip install --no-deps --no-build-isolation -e . || { cat "$V/install.log"; }
  say "date: $(date -u +%FT%TZ)"
  say "gpus: $(nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv,noheader | tr '\n' ';')"
  say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
  say "compute-sanitizer: $(compute-sanitizer --version 2>/dev/null | tail -1)"
  nvidia-smi topo -m > "$V/topo.txt" 2>&1
fi
if has env; then
  t env-json qmoe-doctor env --json; cp "$V/env-json.log" "$V/env.json"
  t env qmoe-doctor env
fi
if has tests; then
  t pytest-gpu timeout 400 python3 -m pytest tests/gpu -m "gpu or multigpu" -q -x -p no:cacheprovider --timeout 300
  tail -3 "$V/pytest-gpu.log" | tee -a "$SUMMARY"
fi
if has scan; then
  t scan-builtin qmoe-doctor scan --gpus 0,1 --save "$V/scan-builtin.json" --log-dir "$V/workers-builtin"
  t scan-torch qmoe-doctor scan --gpus 0,1 --kernel torch:grouped_mm --only guarded,peer,no-peer,single --save "$V/scan-torch.json"
fi
if has specimens; then
  for s in unguarded default_buffer wrong_stream unmasked_rows autotune_inplace int32_offsets; do
    t "scan-$s" qmoe-doctor scan --gpus 0,1 --kernel "specimen:$s" --save "$V/scan-$s.json" --log-dir "$V/workers-$s"
    python3 - "$V/scan-$s.json" <<'PY' | tee -a "$SUMMARY"
import json,sys
try: r=json.load(open(sys.argv[1]))
except Exception as e: print("   (no report:", e, ")"); sys.exit()
print("   diagnoses:", [d["cause"]+"/"+d["confidence"] for d in r["diagnoses"]], "unexplained:", [u["probe_id"] for u in r["unexplained"]], "wall %.1fs" % r["wall_s"])
PY
  done
fi
if has sanitizer; then
  t sanitizer python3 tools/sanitizer_evidence.py "$V/sanitizer"
fi
if has bench; then
  t bench timeout 300 python3 benchmarks/bench_kernels.py --json-out "$V/bench.json"
  tail -25 "$V/bench.log" | tee -a "$SUMMARY"
fi
tar czf "$OUT/validation.tar.gz" -C "$OUT" v 2>/dev/null
cp "$SUMMARY" "$OUT/summary.txt"
echo "==== SUMMARY"; cat "$SUMMARY"
