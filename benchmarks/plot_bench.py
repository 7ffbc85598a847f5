"""Render a saved bench report as a PNG (the figure of docs/performance.md).

    python3 benchmarks/plot_bench.py qmoe-bench/bench.json docs/performance-h200.png

Reads a ``qmoe-doctor bench`` JSON report (kind "bench") or the single-shape report of
``benchmarks/bench_kernels.py --json-out`` (kind "qmoe-bench-kernels"). ``qmoe-doctor bench``
draws the same figure itself; this redraws one from a report kept earlier. Needs matplotlib
(``pip install 'qmoe-doctor[plot]'``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qmoe_doctor.core.bench import BenchReport
from qmoe_doctor.reports.plot import MISSING_MATPLOTLIB, plot_available, write_plot
from qmoe_doctor.workflows.bench import load_report

#: The kernels' targets on one H200 at 30b gate_up, 2048 tokens (bf16, M=16384, E=128, N=1536,
#: K=2048), in TFLOP/s: drawn when the report is of that device, dtype and shape.
H200_TARGETS = {"forward": 450.0, "dx": 350.0, "dw": 350.0}
TARGET_M = 16384


def targets_apply(report: BenchReport) -> bool:
    s = report.shape
    return (
        "H200" in report.device
        and report.dtype == "bfloat16"
        and (s.e, s.n, s.k) == (128, 1536, 2048)
        and any(r.m == TARGET_M for r in report.rows)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="plot_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path, help="a bench JSON report")
    p.add_argument("png", type=Path, help="the PNG to write")
    p.add_argument("--no-targets", action="store_true", help="leave out the H200 targets")
    args = p.parse_args(argv)
    if not plot_available():
        print(MISSING_MATPLOTLIB, file=sys.stderr)
        return 1
    report = load_report(args.report)
    targets = H200_TARGETS if targets_apply(report) and not args.no_targets else None
    out = write_plot(report, args.png, targets=targets, target_m=TARGET_M)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
