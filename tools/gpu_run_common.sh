# Sourced by tools/gpu_run19.sh and tools/gpu_run20.sh (one device-machine call each): the
# environment (NVLink multicast off), $R for logs, $S the summary, and the helpers
#   say TEXT          print and append to the summary
#   pack              tar $R into $OUT/run.tar.gz ($OUT returns at most 8 files)
#   left              seconds left of $BUDGET (default 560)
#   t NAME LIMIT CMD  run CMD with a hard limit, log to $R/NAME.log, one summary line
#   modes_table FILE  one line per mode of a `qmoe-doctor parallel --save` report
#   profile_table     the tools/ep_profile.py results under $R/prof-*
#   dw_tests          the GPU dw tests (overlapped and Hopper paths)
#   dw_check N C ARGS tools/dw_overlap_check.py with configs C, as $R/N.log and to the summary
#   bench_table       the benchmark at 128-8192 tokens, its main rows to the summary
#   header            the date, GPU and driver, and the torch / triton / CUDA / Python versions,
#                     to the summary
#   bench_report FILE the GEMM rows and the block rows of a `qmoe-doctor bench` report, to the
#                     summary
#   dw_round CFGS REGS  one H200: the dw sweep of CFGS at the 16 preset points merged into the
#                     packaged table, registers of REGS, the benchmark and the GPU kernel tests
#                     with the merged table (runs 32, 34)
# then installs the tree and sets NG (GPUs) and ALL (0,1,...).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
R=$OUT/r; mkdir -p "$R"; S=$OUT/summary.txt; : > "$S"
T0=$(date +%s)
say() { echo "$*" | tee -a "$S"; }
pack() { tar czf "$OUT/run.tar.gz" -C "$OUT" r 2>/dev/null; }
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
t() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
      timeout -s TERM -k 10 "$limit" "$@" > "$R/$name.log" 2>&1; local rc=$?
      say "$(printf '%-30s rc=%-3s %4d s  (%d s left)' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(left)")"; pack; return $rc; }
modes_table() {  # one line per mode of a `qmoe-doctor parallel --save` report, to the summary
  python3 - "$1" <<'PY' | tee -a "$S"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print("  no report", exc); sys.exit()
for m in r["modes"]:
    sp = "-" if m["speedup"] is None else f"{m['speedup']:.2f}x"
    print(f"  {r['tokens']:>7} tokens  {m['mode']:6} ranks {m['world_size']}  {m['status']:6} err {m['max_rel_error']}"
          f"  step {m['step_ms'] and round(m['step_ms'], 1)} ms  {sp}")
PY
}
profile_table() {  # every variant of the tools/ep_profile.py results under $R/prof-*, to the summary
  python3 - "$R" <<'PY' | tee -a "$S"
import json, sys
from pathlib import Path
R = Path(sys.argv[1])
for f in sorted(R.glob("prof-*/ep_profile_rank*.json")):
    r = json.loads(f.read_text())
    print(f.parent.name, f.name, "single", r.get("single_step_ms"))
    for name, m in r["variants"].items():
        print("  ", name, {k: v for k, v in m.items() if not isinstance(v, (list, dict))})
PY
}
dw_tests() {  # the GPU dw tests of the overlapped and Hopper dw paths
  t pytest-dw 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -m "gpu or multigpu" -q -p no:cacheprovider -rfE \
    -k "overlap or hopper_dw"
  tail -3 "$R/pytest-dw.log" | tee -a "$S"
}
dw_check() {  # dw_check NAME CONFIGS [ARGS...]: tools/dw_overlap_check.py, its table to the summary
  local name=$1 configs=$2; shift 2
  t "$name" 100 python3 tools/dw_overlap_check.py --configs "$configs" "$@"
  grep -v Warning "$R/$name.log" | tail -6 | tee -a "$S"
}
bench_table() {  # the benchmark at 128-8192 tokens (table, plot), its main rows to the summary
  t bench 200 python3 benchmarks/bench_kernels.py --tokens 128,512,2048,8192 --json-out "$R/bench.json" --plot "$R/bench.png"
  python3 - "$R/bench.json" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
keep = ("qmoe", "torch._grouped_mm", "qmoe MoEBlock", "MoEBlock + torch._grouped_mm", "per-expert loop twin")
for r in d["rows"]:
    if r["impl"] in keep:
        print(f"{r['op']:24} {r['impl']:30} {r['tokens']:>5} {r['ms'] or 0:8.4f} ms {r['tflops'] or 0:7.1f} {r.get('config') or ''}")
PY
}
header() {
  say "date: $(date -u +%FT%TZ)  gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  say "versions: $(python3 -c 'import torch,triton,sys;print("torch",torch.__version__,"triton",triton.__version__,"cuda",torch.version.cuda,"python",sys.version.split()[0])')"
}
bench_report() {  # bench_report FILE: ours and torch's GEMM rows, and every block row
  python3 - "$1" <<'PY' | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    if r["op"].startswith("block") or r["impl"] in ("qmoe", "torch._grouped_mm"):
        print(f"{r['op']:24} {r['impl']:44} {r['tokens']:>5} {r['ms'] or 0:8.4f} ms {r['tflops'] or 0:7.1f}"
              f" {r.get('config') or r.get('note') or ''}")
PY
}
dw_round() {
  t tune-dw 200 python3 benchmarks/tune_kernels.py --ops dw --configs "$1" --merge kernels/configs_sm90.json --out "$R/tune-dw"
  grep -E "^dw|^op" "$R/tune-dw.log" | tee -a "$S"
  t regs 60 python3 tools/kernel_regs.py --op dw --configs "$2"
  grep resident "$R/regs.log" | tee -a "$S"
  QMOE_CONFIG_TABLE=$R/tune-dw/configs.json bench_table
  QMOE_CONFIG_TABLE=$R/tune-dw/configs.json t pytest-kernels 200 python3 -m pytest tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_bench_gpu.py -m "gpu or multigpu" -q -p no:cacheprovider -rfE
  tail -3 "$R/pytest-kernels.log" | tee -a "$S"
}
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || say "install failed"
NG=$(nvidia-smi -L | wc -l); ALL=$(seq -s, 0 $((NG - 1)))
