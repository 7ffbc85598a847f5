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
        [sys.executable, "-m", "benchmarks.monitor_overhead", "--tiny"],
        capture_output=True, text=True, cwd=ROOT, timeout=280, env={**os.environ, "TRITON_INTERPRET": "1"},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    header, row = out.stdout.strip().splitlines()[-2:]
    assert header.split() == [
        "tokens", "plain", "ms", "no", "lean", "ms", "monitored", "ms", "vs", "plain", "vs", "no", "lean",
        "launches/step", "lean/step", "flush", "ms",
    ]
    tokens, plain, no_lean, monitored, vs_plain, vs_no_lean, per_step, lean, flush = row.split()
    assert tokens == "8" and float(per_step) > 0  # the monitored child saw the launches
    assert vs_plain.endswith("%") and vs_no_lean.endswith("%")
    assert float(lean) == 0  # the interpreter: no plan takes the lean path
