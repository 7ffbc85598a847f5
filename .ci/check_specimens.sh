#!/usr/bin/env bash
# CI, CPU tier: `qmoe-doctor check` must pass on our kernels and fail on each specimen it can
# see without a GPU, naming the planted cause and no other. Called by .ci/run; about a minute.
#
#   specimen                 on a CPU                                what sees it
#   unmasked_rows            must fail: invalid-routing              probes (over-routed, -1 sentinel)
#   running_row_mask         must fail: invalid-routing              probes (over-routed: guard rows
#                                                                    after its own y)
#   autotune_inplace         must fail: autotune-inplace-rerun       probes (first vs second call) + lint
#   contiguous_only          must pass (strided cells rejected)      probes: a contract, not a fault
#   autotuned                must pass                               probes (first config; repeat-call
#                                                                    autotunes for real)
#   tma_persistent           must pass                               probes (the interpreter runs
#                                                                    device-side TMA descriptors)
#   tma_unmasked_rows        must fail: invalid-routing              probes (over-routed: TMA stores
#                                                                    past its y)
#   tma_misaligned           must fail: misaligned-operand           probes (the interpreter's descriptor
#                            (the storage-offset-1 cell alone)       check refuses the misaligned x)
#   unguarded, default_buffer, wrong_stream, int32_offsets           lint only: their probes need GPUs
#   cached_sms                                                       lint only: no probe can see it
#   routed (adapter:routed), sorted_ids, gather_scatter
#                            must pass                               probes (the routed cells)
#   sorted_padded_count, sorted_minus_one, gather_unchecked_ids, gather_past_t
#                            must fail: invalid-routing              probes (the routed cells' guards)
#   sorted_int32_token (int32-offset-overflow), gather_sms_device0 (per-device-state-cached)
#                                                                    lint only: a GPU cell / no cell
#
# Usage: .ci/check_specimens.sh   (reports under $OUT, default a temp dir)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d -t qmoe-ci-check-XXXXXX)}
mkdir -p "$OUT"
QD=(python3 -m qmoe_doctor)
# The one place that spells check's option for its JSON report file.
REPORT_OPTION=--save
FAILED=0

say() { printf '%s\n' "$*"; }
bad() { say "FAIL: $*"; FAILED=1; }

# expect NAME RC -- ARGS...: run `qmoe-doctor check ARGS` with its JSON report saved to $OUT/NAME.json,
# want exit RC
expect() {
  local name=$1 want=$2; shift 3
  "${QD[@]}" check "$@" "$REPORT_OPTION" "$OUT/$name.json" --junit "$OUT/$name.xml" --log-dir "$OUT/logs/$name" \
    > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  if [[ $rc -ne $want ]]; then
    bad "$name: exit $rc, expected $want"
    tail -n 30 "$OUT/$name.out" "$OUT/$name.err"
    return 1
  fi
  say "ok:   $name: exit $rc"
}

# causes NAME WHERE CAUSE: the JSON report names exactly CAUSE (WHERE: diagnoses | lint)
causes() {
  python3 - "$OUT/$1.json" "$2" "$3" <<'EOF_PY' || bad "$1: expected exactly the cause $3 in $2"
import json, sys
doc = json.load(open(sys.argv[1]))
where, want = sys.argv[2], sys.argv[3]
assert doc["kind"] == "check" and doc["schema_version"] >= 1, doc.get("kind")
if where == "diagnoses":
    got = {d["cause"] for k in doc["kernels"] for d in k["diagnoses"]}
else:
    got = {f["cause"] for f in doc["lint"]["findings"]}
print(f"      {where}: {sorted(got)}")
sys.exit(0 if got == {want} else 1)
EOF_PY
}

say "== qmoe-doctor check, CPU tier (reports in $OUT)"

# Our kernels: the probes pass and every kernel source outside the specimens lints clean.
mapfile -t OURS < <(find kernels -name '*.py' -not -path '*/specimens/*' | sort)
LINT_OURS=()
for f in "${OURS[@]}"; do LINT_OURS+=(--lint "$f"); done
expect builtin 0 -- --cpu --kernel builtin "${LINT_OURS[@]}"

# Specimens the CPU tier's probes can see: exit 1 and the planted cause.
for pair in unmasked_rows:invalid-routing running_row_mask:invalid-routing \
            autotune_inplace:autotune-inplace-rerun tma_unmasked_rows:invalid-routing; do
  name=${pair%%:*} cause=${pair#*:}
  expect "specimen-$name" 1 -- --cpu --kernel "specimen:$name" && causes "specimen-$name" diagnoses "$cause"
done

# Correct specimens in the public kernels' style: healthy on the CPU tier, lint included (a kernel
# refusing strided inputs by contract is not a fault; a large autotune space is no fault either).
for name in contiguous_only autotuned tma_persistent sorted_ids gather_scatter; do
  expect "specimen-$name" 0 -- --cpu --kernel "specimen:$name"
done

# The routed protocol (kernels that take the router's ids): our routed kernel healthy, each faulty
# routed specimen named by its routed cells.
expect routed 0 -- --cpu --kernel adapter:routed
for name in sorted_padded_count sorted_minus_one gather_unchecked_ids gather_past_t; do
  expect "specimen-$name" 1 -- --cpu --kernel "specimen:$name" && causes "specimen-$name" diagnoses invalid-routing
done

# A misaligned x handed to a TMA descriptor: on a GPU `misaligned address`; under the interpreter its
# descriptor check refuses the view ("base must be 16-byte aligned", read as misaligned-address).
# The one failing cell must be storage-offset-1, and misaligned-operand must explain it.
expect specimen-tma_misaligned 1 -- --cpu --kernel specimen:tma_misaligned --only single,offsets &&
  python3 - "$OUT/specimen-tma_misaligned.json" <<'EOF_PY' || bad "specimen-tma_misaligned: expected the storage-offset-1 cell alone, named misaligned-operand"
import json, sys
(kernel,) = json.load(open(sys.argv[1]))["kernels"]
failing = sorted(c["name"] for c in kernel["cells"] if c["verdict"] not in ("pass", "skip"))
causes = {d["cause"] for d in kernel["diagnoses"]}
print(f"      failing cells: {failing}; diagnoses: {sorted(causes)}")
sys.exit(0 if failing == ["offsets:storage-offset-1"] and causes == {"misaligned-operand"} else 1)
EOF_PY

# Specimens whose fault is a placement, stream or int32-offset fault: no probe can fail on a CPU
# (no second device, no streams, and the interpreter does no bounds checking). Lint sees each one.
for pair in unguarded:missing-device-guard default_buffer:default-device-buffer \
            wrong_stream:wrong-device-stream int32_offsets:int32-offset-overflow \
            autotune_inplace:autotune-inplace-rerun cached_sms:per-device-state-cached \
            sorted_int32_token:int32-offset-overflow gather_sms_device0:per-device-state-cached; do
  name=${pair%%:*} cause=${pair#*:}
  source_file=$(find kernels -path '*/specimens/*' -name "$name.py" | head -1)
  expect "lint-$name" 1 -- --cpu --lint "${source_file:-kernels/specimens/$name.py}" && causes "lint-$name" lint "$cause"
done
say "note: specimen:unguarded, default_buffer, wrong_stream and int32_offsets cannot fail the CPU tier's"
say "      probes: they need two GPUs (placement, peer access, streams) or a >4 GiB expert stack"
say "      (int32 offsets). Lint flags them here; tools/gpu/validate_multi_gpu.sh sees them fail on GPUs."
say "      specimen:cached_sms computes right numbers everywhere (a grid sized for another GPU): lint"
say "      alone names it."

if [[ $FAILED -ne 0 ]]; then
  say "== check_specimens: FAILED (reports in $OUT)"
  exit 1
fi
say "== check_specimens: ok"
