#!/usr/bin/env bash
# One multi-GPU device-machine call: steps chosen by name (default: all), logs packed into
# $OUT/multi.tar.gz, a short summary in $OUT/summary.txt (and stdout).
#   tune       benchmarks/tune_kernels.py on GPU 0 (TUNE_ARGS), then QMOE_CONFIG_TABLE=that table
#   bench      qmoe-doctor bench on GPU 0 (the preset's token sweep)
#   placement  qmoe-doctor bench --placement on GPUs 0,1 (guarded against remote)
#   tests      the GPU test suite (gpu and multigpu marks)
#   verdict    time-to-verdict: scan (2 GPUs) and repro --gpus 0,1 for specimen:unguarded,
#              each from a cold Triton cache and again warm
#   ep         tools/ep_profile.py under torchrun on all GPUs (EP_ARGS)
#   parallel   tools/gpu_parallel.sh (the four modes + the two rank specimens); GPUS=0,1 etc.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; V=$OUT/m; mkdir -p "$V"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
STEPS=${*:-tune bench placement tests verdict ep parallel}
S=$OUT/summary.txt; : > "$S"
say() { echo "$*" | tee -a "$S"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
pack() { tar czf "$OUT/multi.tar.gz" -C "$OUT" m 2>/dev/null; }
t() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s%N)
      timeout -s TERM -k 10 "$limit" "$@" > "$V/$name.log" 2>&1; local rc=$?
      say "$(printf '%-28s rc=%-3s %6d ms' "$name" "$rc" "$(( ($(date +%s%N) - t0) / 1000000 ))")"; pack; return $rc; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$V/install.log" 2>&1 || say "install failed"
say "date: $(date -u +%FT%TZ)"
say "gpus: $(nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv,noheader | tr '\n' ';')"
say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"nccl",".".join(map(str,torch.cuda.nccl.version())),"python",sys.version.split()[0])')"
NG=$(nvidia-smi -L | wc -l)
if has tune; then
  t tune 240 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/tune_kernels.py --out "$V/tune" ${TUNE_ARGS:-}
  cat "$V/tune.log" | grep -v "^  " | tail -60 >> "$S"
  [ -f "$V/tune/configs.json" ] && export QMOE_CONFIG_TABLE=$V/tune/configs.json && say "QMOE_CONFIG_TABLE=$QMOE_CONFIG_TABLE"
fi
if has bench; then
  t bench ${BENCH_TIMEOUT:-150} qmoe-doctor bench --gpus 0 --out "$V/bench"
  sed -n '/Grouped GEMMs/,$p' "$V/bench.log" | head -60 >> "$S"
fi
if has placement; then
  t bench-placement 120 qmoe-doctor bench --gpus 0,1 --placement --no-block --tokens 512,2048,8192 --out "$V/bench-placement"
  grep -iA16 "placement" "$V/bench-placement.log" | head -40 >> "$S"
fi
if has tests; then
  t pytest-gpu ${TEST_TIMEOUT:-200} python3 -m pytest tests/gpu -m "gpu or multigpu" -q -p no:cacheprovider -rfE
  tail -3 "$V/pytest-gpu.log" >> "$S"
fi
if has verdict; then
  rm -rf "$TRITON_CACHE_DIR"
  t scan-cold 120 qmoe-doctor scan --gpus 0,1 --kernel specimen:unguarded --save "$V/scan-cold.json"
  t scan-warm 120 qmoe-doctor scan --gpus 0,1 --kernel specimen:unguarded --save "$V/scan-warm.json"
  t scan-builtin-warm 120 qmoe-doctor scan --gpus 0,1 --save "$V/scan-builtin.json"
  rm -rf "$TRITON_CACHE_DIR"
  t repro-cold 120 qmoe-doctor repro --gpus 0,1 --kernel specimen:unguarded --out "$V/repro-cold" --json
  t repro-warm 120 qmoe-doctor repro --gpus 0,1 --kernel specimen:unguarded --out "$V/repro-warm" --json
  for f in scan-cold scan-warm scan-builtin; do python3 - "$V/$f.json" <<'PY' | tee -a "$S"
import json,sys
try: r=json.load(open(sys.argv[1]))
except Exception as e: print("  no report", e); sys.exit()
print("  ", sys.argv[1].split("/")[-1], "diagnoses:", [d["cause"]+"/"+d["confidence"] for d in r["diagnoses"]], "unexplained:", [u["probe_id"] for u in r["unexplained"]], "probes:", len(r["outcomes"]), "wall %.1fs" % r["wall_s"])
PY
  done
  grep -h -iE "verdict|cause|wall|seconds" "$V"/repro-cold.log "$V"/repro-warm.log | head -12 >> "$S"
fi
if has ep; then
  t ep-profile ${EP_TIMEOUT:-150} torchrun --standalone --nproc-per-node "$NG" tools/ep_profile.py --out "$V/ep" ${EP_ARGS:-}
  grep -h '^{' "$V/ep-profile.log" >> "$S"; head -46 "$V/ep/ep_profile_table.txt" >> "$S" 2>/dev/null
  head -36 "$V/ep/single_profile_table.txt" >> "$S" 2>/dev/null
fi
if has parallel; then
  OUT=$V SKIP_INSTALL=1 bash tools/gpu_parallel.sh > "$V/parallel.log" 2>&1; say "parallel rc=$?"
  sed -n '/built-in kernel/,$p' "$V/parallel/summary.txt" >> "$S"
fi
pack
echo "==== SUMMARY"; cat "$S"
