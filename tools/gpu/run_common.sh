#!/usr/bin/env bash
# The shared header of every GPU recipe in tools/gpu/: source it first, never run it alone.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh" "$@"
#
# What it sets up for one call on a GPU machine:
#   - NVLink multicast off in this shell and in every child it starts (NCCL_NVLS_ENABLE=0,
#     TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): a program that uses multicast
#     can put a shared host's GPUs out of service. qmoe-doctor sets them in its own ranks too;
#     a recipe that starts a program with its own environment (env -i, torchrun) keeps them.
#   - $OUT (default /tmp/out): everything that must come back. Logs go to $R=$OUT/logs, one file
#     per step, and are tarred into $OUT/logs.tar.gz after every step, so a call stopped at its
#     time limit still returns what ran (the device machine returns only a few files from $OUT).
#     $S=$OUT/summary.txt holds one line per step plus the lines each recipe picks.
#   - the working tree installed editable with no dependencies (the machine's torch and triton
#     stay), a Triton cache under $TRITON_CACHE_DIR, NG (GPU count) and ALL (0,1,...,NG-1).
#   - STEPS: the recipe's arguments, or $DEFAULT_STEPS when there are none (set it before sourcing).
#   - CARD=TEXT (optional): run only where the first GPU's name contains TEXT (any case), else
#     one summary line and exit 3 before any work: a call for one kind of machine may be lent
#     another (an H100 for an H200), and a tune must not be recorded for the wrong card.
#
# Helpers:
#   say TEXT              print and append to the summary
#   has STEP              whether STEP was asked for
#   t NAME LIMIT CMD...   run CMD with a hard limit of LIMIT seconds, output to $R/NAME.log, one
#                         summary line (exit status, seconds, seconds left); returns CMD's status
#   left                  seconds left of $BUDGET (default 560: a device call may run 600 s)
#   pack                  tar $R into $OUT/logs.tar.gz
#   header                date, commit ($COMMIT, else git's), GPUs, driver, torch / triton /
#                         CUDA / NCCL / Python versions, compute-sanitizer; nvidia-smi topo -m
#   cap SECONDS           SECONDS, or fewer when less than that (+ 10 s) is left of $BUDGET
#   specimens_for WHERE   "NAME CAUSE OWN" of each specimen whose planted fault shows WHERE: one (a
#                         single GPU), pair (an ordered GPU pair) or parallel (ranks), read from
#                         `qmoe-doctor specimens --json`; CAUSE, what its scan must name: "-" for
#                         a specimen whose scan must come out healthy (a correct kernel, or a
#                         fault only the lint sees); OWN, its own cause ("-": a correct kernel),
#                         which `qmoe-doctor check` (scan and lint) must name
#   expect_check XML OWN  does a `qmoe-doctor check --junit` report exit 1 naming exactly OWN
#                         (exit 0, no failure, for "-")? One "ok" / "NOT AS EXPECTED" line
#   expect_verdict FILE CAUSE   does a saved scan or parallel report name exactly CAUSE ("-":
#                         none) and leave nothing unexplained? One "ok" / "NOT AS EXPECTED" line
#   modes_table FILE      one line per mode of a `qmoe-doctor parallel --save` report
#   bench_report FILE     ours and torch's GEMM rows and every block row of a `qmoe-doctor bench`
#                         report
#   finish                pack, then print the summary (the last thing every recipe does)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
R=$OUT/logs; mkdir -p "$R"; S=$OUT/summary.txt; : > "$S"
T0=$(date +%s)
STEPS=" ${*:-${DEFAULT_STEPS:-}} "

say() { echo "$*" | tee -a "$S"; }
has() { [[ "$STEPS" == *" $1 "* ]]; }
pack() { tar czf "$OUT/logs.tar.gz" -C "$OUT" logs 2>/dev/null; }
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
t() {
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout -s TERM -k 10 "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  say "$(printf '%-32s rc=%-3s %4d s  (%d s left)' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(left)")"
  pack
  return $rc
}
header() {
  # A copied tree (a device machine's) may carry no .git, or a stale one: pass COMMIT=<sha> from
  # the checkout the copy was made from; git's answer is marked when the tree differs from it.
  say "date: $(date -u +%FT%TZ)  commit: ${COMMIT:-$(git describe --always --dirty=+uncommitted 2>/dev/null || echo unknown)}"
  say "gpus: $(nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv,noheader | tr '\n' ';')"
  say "versions: $(python3 - 2>&1 <<'PY' | tail -1
import sys, torch, triton
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception:  # a build without NCCL
    nccl = "-"
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, "nccl", nccl,
      "python", sys.version.split()[0])
PY
)"
  say "compute-sanitizer: $(compute-sanitizer --version 2>/dev/null | tail -1)"
  nvidia-smi topo -m > "$R/topo.txt" 2>&1
}
cap() { local l=$(( $(left) - 10 )); (( l < 1 )) && l=1; echo $(( $1 < l ? $1 : l )); }
specimens_for() {
  qmoe-doctor specimens --json | python3 -c '
import json, sys
PAIR = {"guarded", "untouched", "no-peer", "peer", "producer-race", "sizes-race"}
for s in json.load(sys.stdin)["specimens"]:
    conds = set(s["misbehaves_under"])
    # no condition: a correct kernel, or a fault only the lint sees (identical GPUs hide it):
    # its scan must come out healthy anywhere ("-")
    where = ("one" if not conds else "parallel" if any(c.startswith("parallel-") for c in conds)
             else "pair" if conds <= PAIR else "one")
    if where == sys.argv[1]:
        print(s["name"], s["cause"] if conds and s["cause"] else "-", s["cause"] or "-")
' "$1"
}
expect_check() {
  python3 - "$1" "$2" <<'PY' | tee -a "$S"
import sys
import xml.etree.ElementTree as ET
path, want = sys.argv[1], sys.argv[2]
try:
    root = ET.parse(path).getroot()
except Exception as exc:  # the check did not finish: its log says why
    print(f"   NOT AS EXPECTED: no report ({exc})"); sys.exit()
code = {p.get("name"): p.get("value") for p in root.iter("property")}.get("exit_code")
got = sorted({f.get("type") or f.tag for f in (*root.iter("failure"), *root.iter("error"))})  # an untyped one by its tag
ok = (code, got) == (("0", []) if want == "-" else ("1", [want]))
print(f"   {'ok' if ok else 'NOT AS EXPECTED'}: exit {code}, failures named {got} (want {'exit 0' if want == '-' else 'exit 1, ' + want})")
PY
}
expect_verdict() {
  python3 - "$1" "$2" <<'PY' | tee -a "$S"
import json, sys
path, want = sys.argv[1], sys.argv[2]
try:
    r = json.load(open(path))
except Exception as exc:  # the run did not finish: its log says why
    print(f"   NOT AS EXPECTED: no report ({exc})"); sys.exit()
got = sorted({d["cause"] for d in r["diagnoses"]})
unexplained = [u["probe_id"] for u in r["unexplained"]]
ok = got == ([] if want == "-" else [want]) and not unexplained
where = sorted({w for d in r["diagnoses"] for w in d.get("where", [])})
print(f"   {'ok' if ok else 'NOT AS EXPECTED'}: diagnoses {got} (want {want}) {where[:4]}, "
      f"unexplained {unexplained}, {len(r['outcomes'])} probes, wall {r['wall_s']:.1f} s")
PY
}
modes_table() {
  python3 - "$1" <<'PY' | tee -a "$S"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print("   no report:", exc); sys.exit()
for m in r["modes"]:
    sp = "-" if m["speedup"] is None else f"{m['speedup']:.2f}x"
    print(f"   {r['tokens']:>7} tokens  {m['mode']:6} ranks {m['world_size']}  {m['status']:6} err {m['max_rel_error']}"
          f"  step {m['step_ms'] and round(m['step_ms'], 1)} ms  {sp}")
PY
}
bench_report() {
  python3 - "$1" <<'PY' | tee -a "$S"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:
    print("   no report:", exc); sys.exit()
print("   routing", d.get("routing"), "|", d.get("command"))
for r in d["rows"]:
    if r["op"].startswith("block") or r["impl"] in ("qmoe", "torch._grouped_mm"):
        print(f"   {r['op']:24} {r['impl']:44} {r['tokens']:>5} {r['ms'] or 0:8.4f} ms {r['tflops'] or 0:7.1f}"
              f" {r.get('config') or r.get('note') or ''}")
PY
}
finish() { pack; echo "==== SUMMARY"; cat "$S"; }

if [[ -n "${CARD:-}" ]]; then
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  if [[ -z "$GPU_NAME" || "${GPU_NAME,,}" != *"${CARD,,}"* ]]; then
    say "CARD=$CARD: this machine's GPU is ${GPU_NAME:-none (nvidia-smi found none)}; nothing run"
    finish
    exit 3
  fi
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || say "install failed: $R/install.log"
# The `qmoe-doctor` script pip writes may belong to another Python on the machine: every recipe's
# `qmoe-doctor` is this python3's module, through a wrapper first on PATH.
mkdir -p /tmp/qmoe-bin
printf '#!/bin/sh\nexec python3 -m qmoe_doctor "$@"\n' > /tmp/qmoe-bin/qmoe-doctor
chmod +x /tmp/qmoe-bin/qmoe-doctor
export PATH=/tmp/qmoe-bin:$PATH
NG=$(nvidia-smi -L 2>/dev/null | wc -l); ALL=$(seq -s, 0 $((NG - 1)))
