#!/usr/bin/env bash
# What users install, checked as they use it: the sdist and wheel built with `python -m build`
# (an isolated build, as a package index's is), `twine check --strict`, the wheel installed in a
# fresh venv (never editable, never seeing the checkout), and every command run from a folder
# outside the checkout. Then the way pipx installs tools: the doctor in one venv, the user's program
# run by another venv's Python that cannot import qmoe_doctor, the launch monitor attaching there.
#
# torch is installed in each venv at the version this machine's Python has (on CI the CPU build
# from the local wheel store; see .ci/run), so no multi-GB CUDA build is fetched.
# Usage: .ci/wheel_smoke.sh   (exit 0: every step passed; else the first failing step is named)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/qmoe-wheel-smoke.XXXXXX")
trap 'rm -rf "$work"' EXIT
fixtures="$repo/tests/fixtures"
torch_spec="torch==$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"

say() { echo "---- wheel_smoke: $*"; }
# pip_in PYTHON ARGS...: pip install into PYTHON's venv, its chatter in a log shown on failure
pip_in() {
  local py=$1; shift
  "$py" -m pip install -q --disable-pip-version-check "$@" >"$work/pip.log" 2>&1 \
    || { cat "$work/pip.log" >&2; fail "pip install $*"; }
}
fail() { echo "---- wheel_smoke: FAILED: $*" >&2; exit 1; }
# expect CODE CMD...: run CMD (output to the log), fail unless it exits with CODE
expect() {
  local want=$1; shift
  local got=0
  "$@" >"$work/out" 2>"$work/err" || got=$?
  if [[ $got != "$want" ]]; then
    cat "$work/out" "$work/err" >&2
    fail "$* exited $got, want $want"
  fi
}

say "build the sdist and the wheel"
python3 -m build --sdist --wheel --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log" >&2; fail "python -m build"; }
python3 -m twine check --strict "$work/dist"/* || fail "twine check"
wheel=$(ls "$work/dist"/qmoe_doctor-*.whl)
version=$(basename "$wheel" | cut -d- -f2)

say "install the wheel in a fresh venv ($torch_spec)"
python3 -m venv "$work/doctor"
doctor="$work/doctor/bin"
pip_in "$doctor/python" "$torch_spec"
pip_in "$doctor/python" "$wheel"
qd="$doctor/qmoe-doctor"

mkdir "$work/user"
cd "$work/user"  # outside the checkout: nothing of it is on sys.path
where=$("$doctor/python" -c 'import qmoe_doctor, os; print(os.path.dirname(qmoe_doctor.__file__))')
[[ $where == "$work/doctor/"* ]] || fail "qmoe_doctor imports from $where, not from the venv"

say "--version and every command's --help"
expect 0 "$qd" --version
grep -qx "qmoe-doctor $version" "$work/out" || fail "--version says $(cat "$work/out"), want $version"
expect 0 "$qd" --help
for cmd in scan check repro parallel env specimens audit lint explain bench run; do
  expect 0 "$qd" "$cmd" --help
done

say "lint, specimens, explain, audit, env"
cp "$fixtures/lint/public_grouped_gemm.py" kernel.py
expect 1 "$qd" lint kernel.py --sarif lint.sarif
grep -q "unguarded-launch" "$work/out" || fail "lint found no unguarded launch in kernel.py"
"$doctor/python" -c 'import json,sys; d=json.load(open("lint.sarif")); assert d["runs"][0]["results"]' \
  || fail "lint --sarif wrote no result"
expect 0 "$qd" specimens
expect 1 "$qd" explain "$fixtures/sanitizer/2026-11-22-2xh200-7ada31c/memcheck-unmasked-overrouted-nocache.log"
grep -q "invalid-routing" "$work/out" || fail "explain did not name invalid-routing"
expect 0 "$qd" audit --config "$fixtures/configs/qwen3-30b-a3b.json"
expect 0 "$qd" env

say "scan and check on the CPU tier (the Triton interpreter)"
expect 0 "$qd" scan --cpu --only single --no-sweeps
expect 0 "$qd" check --cpu --sarif check.sarif --junit check.xml
[[ -s check.sarif && -s check.xml ]] || fail "check wrote no SARIF or JUnit report"

cat >tiny.py <<'EOF'
import torch
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


x = torch.zeros(100)
add_one[(2,)](x, 100, BLOCK=64)
assert float(x.sum()) == 100.0
EOF
# launches seen by the monitor, from `run --json` on stdout (the command's own output goes to stderr)
launches() { "$doctor/python" -c 'import json,sys; d=json.load(sys.stdin); print(sum(p["launches"] for x in d["passes"] for p in x["processes"]))' <"$work/out"; }

say "run -- python tiny.py (the doctor's own Python)"
expect 0 env TRITON_INTERPRET=1 "$qd" run --json -- "$doctor/python" tiny.py
[[ $(launches) == 1 ]] || fail "run saw $(launches) launches of tiny.py, want 1"

say "run -- another venv's python (the doctor installed apart, as pipx does)"
python3 -m venv "$work/user-venv"
user="$work/user-venv/bin"
pip_in "$user/python" "$torch_spec" triton numpy
if "$user/python" -c 'import qmoe_doctor' 2>/dev/null; then fail "the user's venv can import qmoe_doctor"; fi
expect 0 env TRITON_INTERPRET=1 "$qd" run --json -- "$user/python" tiny.py
[[ $(launches) == 1 ]] || fail "run saw $(launches) launches in the other venv's python, want 1"

say "ok: $(basename "$wheel") and $(basename "$(ls "$work/dist"/*.tar.gz)")"
