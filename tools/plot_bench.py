"""Render a bench report as a PNG (the figures of docs/performance.md).

    python tools/plot_bench.py                          # run 3 -> docs/performance-h200.png
    python tools/plot_bench.py qmoe-bench/bench.json docs/performance-h200-tokens.png

Reads a ``qmoe-doctor bench`` JSON report (kind "bench") or the single-shape report of the
earlier ``benchmarks/bench_kernels.py`` (kind "qmoe-bench-kernels", validation run 3). Needs
matplotlib (``pip install 'qmoe-doctor[plot]'``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qmoe_doctor.reports.plot import MISSING_MATPLOTLIB, plot_available, write_plot
from qmoe_doctor.workflows.bench import BenchReport, load_report

REPO = Path(__file__).resolve().parents[1]
RUN3 = REPO / "tests" / "fixtures" / "recorded" / "h200x2-run3" / "bench.json"
RUN3_PNG = REPO / "docs" / "performance-h200.png"
#: Issue 8's targets on one H200, bf16, M=16384, E=128, N=1536, K=2048 (TFLOP/s): drawn when
#: the report is of that device, dtype and shape.
ISSUE8_TARGETS = {"forward": 450.0, "dx": 350.0, "dw": 350.0}
ISSUE8_M = 16384


def issue8_applies(report: BenchReport) -> bool:
    s = report.shape
    return (
        "H200" in report.device
        and report.dtype == "bfloat16"
        and (s.e, s.n, s.k) == (128, 1536, 2048)
        and any(r.m == ISSUE8_M for r in report.rows)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="plot_bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "report", nargs="?", type=Path, default=RUN3, help=f"bench JSON (default: {RUN3.relative_to(REPO)})"
    )
    p.add_argument(
        "png",
        nargs="?",
        type=Path,
        default=RUN3_PNG,
        help=f"PNG to write (default: {RUN3_PNG.relative_to(REPO)})",
    )
    p.add_argument("--no-targets", action="store_true", help="leave out issue 8's targets")
    args = p.parse_args(argv)
    if not plot_available():
        print(MISSING_MATPLOTLIB, file=sys.stderr)
        return 1
    report = load_report(args.report)
    targets = ISSUE8_TARGETS if issue8_applies(report) and not args.no_targets else None
    out = write_plot(report, args.png, targets=targets, target_m=ISSUE8_M)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
