"""benchmarks/monitor_overhead.py --tiny: the overhead benchmark's plain and monitored children run
on the CPU (the Triton interpreter) and the table comes out. A smoke run: no timing is judged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_the_overhead_benchmark_runs_both_children_and_prints_its_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.monitor_overhead", "--tiny", "--profile", "4"],
        capture_output=True, text=True, cwd=ROOT, timeout=280, env={**os.environ, "TRITON_INTERPRET": "1"},
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    header, row = lines[-2:]
    assert header.split() == [
        "tokens", "plain", "ms", "no", "lean", "ms", "monitored", "ms", "vs", "plain", "vs", "no", "lean",
        "host", "plain", "host", "monitored", "plain", "lean", "launches/step", "lean/step", "flush", "ms",
    ]
    tokens, plain, no_lean, monitored, vs_plain, vs_no_lean, host_p, host_m, lean_p, per_step, lean, flush = row.split()
    assert tokens == "8" and float(per_step) > 0  # the monitored child saw the launches
    assert vs_plain.endswith("%") and vs_no_lean.endswith("%")
    assert 0 < float(host_p) <= float(plain) * 1.5 and 0 < float(host_m)
    assert float(lean) == 0 == float(lean_p)  # the interpreter: no plan takes the lean path
    # the profiles of the first round's plain and monitored children, side by side, 4 rows each
    start = next(i for i, line in enumerate(lines) if line.startswith("profile, 8 tokens"))
    rows = lines[start + 1 : start + 5]
    assert len(rows) == 4 and all(" | " in r and "(" in r for r in rows), rows
