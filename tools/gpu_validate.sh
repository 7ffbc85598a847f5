#!/usr/bin/env bash
# One device-machine call: install, inventory, GPU tests, scans of the built-in kernel and of
# every specimen, sanitizer evidence, a benchmark. Logs under $OUT/v (tarred at the end).
# Usage: tools/gpu_validate.sh [steps...]   steps: install env tests scan specimens sanitizer bench
set -u
OUT=${OUT:-/tmp/out}; V=$OUT/v; mkdir -p "$V"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
STEPS=${*:-install env scan specimens sweeps sanitizer tests bench}
SUMMARY=$V/summary.txt; : > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
pack() { tar czf "$OUT/validation.tar.gz" -C "$OUT" v 2>/dev/null; cp "$SUMMARY" "$OUT/summary.txt"; }
t() { local name=$1; shift; local t0=$(date +%s%N); "$@" > "$V/$name.log" 2>&1; local rc=$?; local t1=$(date +%s%N);
      say "$(printf '%-34s rc=%-3s %6d ms' "$name" "$rc" "$(( (t1 - t0) / 1000000 ))")"; pack; return $rc; }

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
  t pytest-gpu timeout 300 python3 -m pytest tests/gpu -m "gpu or multigpu" -q -p no:cacheprovider --timeout 120 -rfE
  grep -E "passed|failed|error" "$V/pytest-gpu.log" | tail -25 | tee -a "$SUMMARY"
fi
if has scan; then
  t scan-builtin qmoe-doctor scan --gpus 0,1 --save "$V/scan-builtin.json" --log-dir "$V/workers-builtin"
  t scan-torch qmoe-doctor scan --gpus 0,1 --kernel torch:grouped_mm --only guarded,peer,no-peer,single --save "$V/scan-torch.json"
fi
if has specimens; then
  for s in ${SPECIMEN_LIST:-unguarded default_buffer wrong_stream unmasked_rows autotune_inplace int32_offsets}; do
    t "scan-$s" qmoe-doctor scan --gpus 0,1 --kernel "specimen:$s" --save "$V/scan-$s.json" --log-dir "$V/workers-$s"
    python3 - "$V/scan-$s.json" <<'PY' | tee -a "$SUMMARY"
import json,sys
try: r=json.load(open(sys.argv[1]))
except Exception as e: print("   (no report:", e, ")"); sys.exit()
print("   diagnoses:", [d["cause"]+"/"+d["confidence"] for d in r["diagnoses"]], "unexplained:", [u["probe_id"] for u in r["unexplained"]], "wall %.1fs" % r["wall_s"])
PY
  done
fi
if has sweeps; then
  t sweep-int32-1gpu qmoe-doctor scan --gpus 0 --kernel specimen:int32_offsets --only single,int32-boundary --save "$V/sweep-int32-1gpu.json"
  t sweep-launch-config qmoe-doctor scan --gpus 0 --only single,launch-config --configs 128x256x64-w8-s3,128x256x128-w8-s4 --save "$V/sweep-launch-config.json"
  t sweep-offsets qmoe-doctor scan --gpus 0 --only single,offsets --save "$V/sweep-offsets.json"
  for f in sweep-int32-1gpu sweep-launch-config sweep-offsets; do python3 - "$V/$f.json" <<'PY' | tee -a "$SUMMARY"
import json,sys
r=json.load(open(sys.argv[1]))
print("  ", sys.argv[1].split("/")[-1], "diagnoses:", [(d["cause"], d["summary"][:90]) for d in r["diagnoses"]], "unexplained:", [u["probe_id"] for u in r["unexplained"]], "wall %.1fs" % r["wall_s"])
PY
  done
fi
if has check && qmoe-doctor check --help >/dev/null 2>&1; then
  t check-builtin qmoe-doctor check --kernel builtin --require-gpus 2 --junit "$V/check-builtin.xml" --json "$V/check-builtin.json"
  for s in unguarded default_buffer wrong_stream unmasked_rows autotune_inplace int32_offsets; do
    t "check-$s" qmoe-doctor check --kernel "specimen:$s" --require-gpus 2 --json "$V/check-$s.json"
  done
  t check-torch qmoe-doctor check --kernel torch:grouped_mm --require-gpus 2 --json "$V/check-torch.json"
fi
if has repro && qmoe-doctor repro --help >/dev/null 2>&1; then
  t repro-unguarded qmoe-doctor repro --gpus 0,1 --kernel specimen:unguarded --out "$V/repro" --json
  t repro-builtin qmoe-doctor repro --gpus 0,1 --kernel builtin --out "$V/repro-builtin" --json
  t repro-unmasked qmoe-doctor repro --gpus 0,1 --kernel specimen:unmasked_rows --out "$V/repro-unmasked" --json
  for f in "$V"/repro/*.py; do [ -f "$f" ] && t "repro-script-$(basename "$f" .py)" timeout 120 python3 "$f"; done
fi
if has sanitizer; then
  t sanitizer python3 tools/sanitizer_evidence.py "$V/sanitizer" ${SANITIZER_CASES:-}
fi
if has bench; then
  t bench timeout 240 python3 benchmarks/bench_kernels.py --m 16384 --e 128 --n 1536 --k 2048 --json-out "$V/bench.json"
  tail -25 "$V/bench.log" | tee -a "$SUMMARY"
fi
pack
echo "==== SUMMARY"; cat "$SUMMARY"
