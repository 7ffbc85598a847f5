#!/usr/bin/env bash
# Issue 7 on GPUs, in one device-machine call (budget: 4 minutes on 2 H200s; expected ~2):
#  1. the four parallel modes (dp, pp, tp, ep) with the built-in kernel on every visible GPU, at the
#     30B preset with a large batch, each rank against a single-device run of the same weights and
#     inputs, plus the one-GPU baseline: tokens/s, speedup and efficiency per mode;
#  2. the two rank-level specimens, each of which must be diagnosed on rank 1:
#     specimen:rank_no_set_device under dp -> device-never-set,
#     specimen:global_expert_ids under ep -> invalid-routing.
# Everything lands under $OUT/parallel (JSON reports, every rank's log/crumbs/result, launcher logs)
# and $OUT/parallel.tar.gz; a short table goes to stdout and $OUT/parallel/summary.txt.
# Knobs (environment): TOKENS=32768 STEPS=10 WARMUP=2 PRESET=qwen3-30b-a3b GPUS=all SKIP_INSTALL=0
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; P=$OUT/parallel; mkdir -p "$P"
# NVLink multicast stays off in every process (qmoe-doctor forces it in every rank too)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
TOKENS=${TOKENS:-32768}; STEPS=${STEPS:-10}; WARMUP=${WARMUP:-2}; PRESET=${PRESET:-qwen3-30b-a3b}
GPU_ARGS=(); [[ -n "${GPUS:-}" && "${GPUS:-}" != all ]] && GPU_ARGS=(--gpus "$GPUS")
SUMMARY=$P/summary.txt; : > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
pack() { tar czf "$OUT/parallel.tar.gz" -C "$OUT" parallel 2>/dev/null; }
# t NAME SECONDS CMD...: run with a hard wall-clock limit (SIGTERM: qmoe-doctor then kills its ranks)
t() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
      timeout -s TERM -k 10 "$limit" "$@" > "$P/$name.out" 2> "$P/$name.err"; local rc=$?
      say "$(printf '%-30s rc=%-3s %4d s' "$name" "$rc" "$(( $(date +%s) - t0 ))")"; pack; return $rc; }

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  t install 30 python3 -m pip install -q --no-deps --no-build-isolation -e . || cat "$P/install.err"
fi
say "date: $(date -u +%FT%TZ)"
say "gpus: $(nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv,noheader | tr '\n' ';')"
say "versions: $(python3 - 2>&1 <<'PY' | tail -1
import sys, torch, triton
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception:  # a CPU build
    nccl = "-"
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, "nccl", nccl,
      "python", sys.version.split()[0])
PY
)"
nvidia-smi topo -m > "$P/topo.txt" 2>&1

# 1. built-in kernel, all four modes + the one-GPU baseline (5 launches, each <= 100 s, all <= 150 s)
t builtin "${BUILTIN_LIMIT:-150}" qmoe-doctor parallel --modes dp,pp,tp,ep "${GPU_ARGS[@]}" --preset "$PRESET" \
  --tokens "$TOKENS" --steps "$STEPS" --warmup "$WARMUP" --timeout 100 \
  --save "$P/builtin.json" --log-dir "$P/builtin"

# 2. the specimens: small shapes, no timing (what matters is the rank the cause is named on)
t specimen-rank_no_set_device 28 qmoe-doctor parallel --modes dp "${GPU_ARGS[@]}" \
  --kernel specimen:rank_no_set_device --preset tiny --tokens 1024 --steps 0 --warmup 0 --no-baseline \
  --timeout 25 --save "$P/specimen-rank_no_set_device.json" --log-dir "$P/specimen-rank_no_set_device"
t specimen-global_expert_ids 28 qmoe-doctor parallel --modes ep "${GPU_ARGS[@]}" \
  --kernel specimen:global_expert_ids --preset tiny --tokens 1024 --steps 0 --warmup 0 --no-baseline \
  --timeout 25 --save "$P/specimen-global_expert_ids.json" --log-dir "$P/specimen-global_expert_ids"

python3 - "$P" <<'PY' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
P = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((P / f"{name}.json").read_text())
    except Exception as exc:  # the run did not finish: its .out/.err say why
        print(f"{name}: no report ({exc})")
        return None
def g(v, f):
    return "-" if v is None else format(v, f)
r = load("builtin")
if r:
    print(f"\nbuilt-in kernel, {r['preset']}, {r['tokens']:,} tokens/step, {r['dtype']}, {r['backend']}, GPUs {r['gpus']}")
    print(f"{'mode':7}{'ranks':>6} {'result':8}{'max err':>9}{'tol':>7}{'step ms':>9}{'tokens/s':>12}{'vs 1 GPU':>9}{'eff.':>6}")
    for m in r["modes"]:
        eff = "-" if m["efficiency"] is None else f"{100 * m['efficiency']:.0f}%"
        sp = "-" if m["speedup"] is None else f"{m['speedup']:.2f}x"
        print(f"{m['mode']:7}{m['world_size']:>6} {m['status'] + ('/timeout' if m['timed_out'] else ''):8}"
              f"{g(m['max_rel_error'], '.2g'):>9}{g(m['tolerance'], 'g'):>7}{g(m['step_ms'], '.1f'):>9}"
              f"{g(m['tokens_per_s'], ',.0f'):>12}{sp:>9}{eff:>6}")
    for o in r["outcomes"]:
        if o["status"] != "pass":
            msg = (o.get("error_message") or "").splitlines()[:1]
            print(f"  {o['probe_id']}: {o['status']} {o.get('error_kind') or ''} {msg[0][:120] if msg else ''}"
                  f" checks={[c for c in o['facts'].get('parallel.checks', []) if not c['ok']][:3]}"
                  f" single={o['facts'].get('parallel.single', {}).get('rel_error')}")
    print(f"  diagnoses: {[d['cause'] + '/' + d['confidence'] for d in r['diagnoses']]}"
          f"  unexplained: {[u['probe_id'] for u in r['unexplained']]}  wall {r['wall_s']:.0f} s")
    ep = next((m for m in r["modes"] if m["mode"] == "ep"), None)
    if ep and ep["speedup"]:
        n = ep["world_size"]
        target = " (issue 7 target on two GPUs: >= 1.8x)" if n == 2 else ""
        print(f"  EP on {n} GPUs: {ep['speedup']:.2f}x the tokens/s of one GPU{target}")
for name, expect in (("specimen-rank_no_set_device", "device-never-set"), ("specimen-global_expert_ids", "invalid-routing")):
    s = load(name)
    if not s:
        continue
    found = [(d["cause"], d["confidence"], d["where"]) for d in s["diagnoses"]]
    ok = any(c == expect and any(w.startswith("rank 1") for w in where) for c, _, where in found)
    print(f"{name}: {'OK' if ok else 'NOT AS EXPECTED'} diagnoses={found} "
          f"unexplained={[u['probe_id'] for u in s['unexplained']]} explanations={len(s['explanations'])} wall {s['wall_s']:.0f} s")
PY
pack
