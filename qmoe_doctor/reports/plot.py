"""Plots of a bench report (PNG): TFLOP/s against tokens, one panel per op.

Needs matplotlib, an optional dependency (``pip install 'qmoe-doctor[plot]'``): everything here
imports it inside the function that draws, so the CLI imports this module freely and says plainly
when it is missing (``plot_available``). It draws with the object-oriented API on an Agg canvas
(no pyplot, no global backend switch). With several token counts each panel is a line per
implementation; a report of one token count (the run-3 script's) is drawn as bars.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qmoe_doctor.core.bench import (
    BLOCK_GROUPED_MM,
    BLOCK_GROUPED_MM_GRAPH,
    BLOCK_LOOP,
    BLOCK_QMOE,
    BLOCK_QMOE_GRAPH,
    DENSE,
    GROUPED_MM,
    LOOP,
    QMOE,
    BenchReport,
    Op,
)

MISSING_MATPLOTLIB = "matplotlib is not installed: no plot was drawn (pip install 'qmoe-doctor[plot]' or pip install matplotlib)"

OP_TITLE: dict[str, str] = {
    "forward": "forward  y = x @ w[e].T",
    "dx": "dx  dy @ w[e]",
    "dw": "dw  dy_e.T @ x_e",
    "block-forward": "MoE block, forward",
    "block-forward-backward": "MoE block, forward + backward",
}
#: (colour, line style, marker, line width) per implementation; ours stands out.
STYLE: dict[str, tuple[str, str, str, float]] = {
    QMOE: ("#d62728", "-", "o", 2.4),
    BLOCK_QMOE: ("#d62728", "-", "o", 2.4),
    GROUPED_MM: ("#1f77b4", "-", "s", 1.6),
    BLOCK_GROUPED_MM: ("#1f77b4", "-", "s", 1.6),
    BLOCK_QMOE_GRAPH: ("#d62728", ":", "o", 1.6),
    BLOCK_GROUPED_MM_GRAPH: ("#1f77b4", ":", "s", 1.2),
    LOOP: ("#7f7f7f", "-", "^", 1.2),
    BLOCK_LOOP: ("#7f7f7f", "-", "^", 1.2),
    DENSE: ("#2ca02c", "--", "", 1.4),
}
_DEFAULT_STYLE = ("#9467bd", "-", "x", 1.2)
DPI = 130


def plot_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def title_of(report: BenchReport) -> str:
    s = report.shape
    return (
        f"{report.device}, {report.dtype}, {report.preset}: E={s.e} N={s.n} K={s.k} top_k={s.top_k}  "
        f"(torch {report.torch}, triton {report.triton})"
    )


def write_plot(
    report: BenchReport,
    path: str | os.PathLike[str],
    *,
    targets: Mapping[str, float] | None = None,
    target_m: int | None = None,
) -> Path:
    """Draw ``report`` to a PNG at ``path``; ``targets`` (op -> TFLOP/s, at ``target_m`` rows
    when given) are drawn dotted: a line on bars, a star at ``target_m`` (else a line) on
    curves. Every panel shares one TFLOP/s scale, so the block and the GEMMs compare at a glance.
    Raises RuntimeError for an untimed report (a --tiny run has no numbers to draw) and
    ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not report.timed:
        raise RuntimeError("the report is an untimed smoke run (--tiny): there is nothing to plot")
    ops = report.ops()
    single = len(report.tokens) == 1
    panels = len(ops) + (1 if report.placement else 0)
    cols = 3 if panels > 4 else 2 if panels > 1 else 1
    rows = -(-panels // cols)
    fig = Figure(figsize=(5.2 * cols, 3.9 * rows + 0.6), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    values = [r.tflops for r in report.rows if r.tflops is not None]
    values += [t for op, t in (targets or {}).items() if op in ops]
    top = max(values, default=1.0)
    for ax, op in zip(axes, ops, strict=False):
        if single:
            _bars(ax, report, op, top)
        else:
            _lines(ax, report, op, top)
        target = (targets or {}).get(op)
        if target:
            _target(ax, target, single=single, at_m=target_m)
    if report.placement:
        _placement(axes[len(ops)], report)
    for ax in axes[panels:]:
        ax.set_axis_off()
    if panels < len(axes):
        axes[panels].text(0.02, 0.98, _key(report, targets), va="top", ha="left", fontsize=8, wrap=True)
    note = "" if single else "; dense (same FLOPs): one cuBLAS GEMM of the same FLOPs, the ceiling"
    fig.suptitle(f"{title_of(report)}\nTFLOP/s, higher is better{note}", fontsize=10)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _target(ax: Any, target: float, *, single: bool, at_m: int | None) -> None:
    colour, label = "#d62728", f" target {target:.0f}"
    if single:
        ax.axvline(target, color=colour, linestyle=":", linewidth=1.2)
        ax.text(target, ax.get_ylim()[1], label, color=colour, fontsize=7, va="top")
    elif at_m is not None:
        ax.plot([at_m], [target], marker="*", markersize=10, color=colour, linestyle="none")
        ax.text(at_m, target, label, color=colour, fontsize=7, va="bottom")
    else:
        ax.axhline(target, color=colour, linestyle=":", linewidth=1.2)
        ax.text(ax.get_xlim()[0], target, label, color=colour, fontsize=7, va="bottom")


def _key(report: BenchReport, targets: Mapping[str, float] | None) -> str:
    lines = [
        f"{QMOE}: ours (qmoe_doctor.kernels)",
        f"{GROUPED_MM}: PyTorch's grouped GEMM",
        f"{LOOP}: one GEMM per expert (Transformers)",
        f"{DENSE}: one cuBLAS GEMM of",
        "    the same FLOPs, the ceiling",
        "",
        "FLOPs: 2*M*N*K per GEMM; block 6*M*H*I,",
        "    forward + backward 3x",
        f"timing: {report.timing.split(' (')[0]}",
    ]
    if targets:
        lines.append(f"red {'dotted line' if len(report.tokens) == 1 else 'star'}: issue-8 targets")
    if report.command:
        lines += ["", report.command]
    return "\n".join(lines)


def _style(impl: str) -> tuple[str, str, str, float]:
    return STYLE.get(impl, _DEFAULT_STYLE)


def _lines(ax: Any, report: BenchReport, op: Op, top: float) -> None:
    for impl in report.impls(op):
        points = [
            (r.m, r.tflops) for t in report.tokens if (r := report.row(op, impl, t)) and r.tflops is not None
        ]
        if not points:
            continue
        colour, line, marker, width = _style(impl)
        ax.plot(
            [m for m, _ in points],
            [v for _, v in points],
            color=colour,
            linestyle=line,
            marker=marker or None,
            linewidth=width,
            markersize=4,
            label=impl,
        )
    ax.set_xscale("log", base=2)
    ms = sorted({r.m for r in report.rows if r.op == op})
    ax.set_xticks(ms, [_rows_label(m) for m in ms], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("rows M (tokens x top_k)", fontsize=8)
    ax.set_ylabel("TFLOP/s", fontsize=8)
    ax.set_ylim(0, top * 1.08)
    ax.set_title(OP_TITLE.get(op, op), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="best")


def _bars(ax: Any, report: BenchReport, op: Op, top: float) -> None:
    (tokens,) = report.tokens
    impls = [i for i in report.impls(op) if (r := report.row(op, i, tokens)) and r.tflops is not None]
    values = [report.row(op, i, tokens).tflops or 0.0 for i in impls]  # type: ignore[union-attr]
    colours = [_style(i)[0] for i in impls]
    ypos = list(range(len(impls)))[::-1]
    ax.barh(ypos, values, color=colours, height=0.6)
    ax.set_ylim(-0.6, len(impls) - 0.2)
    ax.set_yticks(ypos, impls, fontsize=8)
    dense = next((v for i, v in zip(impls, values, strict=True) if i == DENSE), None)
    for y, v, impl in zip(ypos, values, impls, strict=True):
        frac = f"  ({v / dense:.0%} of dense)" if dense and impl != DENSE else ""
        ax.text(v + top * 0.01, y, f"{v:.1f}{frac}", va="center", fontsize=7)
    ax.set_xlim(0, top * 1.3)
    m = report.rows[0].m if report.rows else tokens * report.shape.top_k
    ax.set_title(f"{OP_TITLE.get(op, op)}  ({tokens} tokens, M={m})", fontsize=9)
    ax.set_xlabel("TFLOP/s", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, axis="x", alpha=0.3)


def _placement(ax: Any, report: BenchReport) -> None:
    by: dict[str, list[tuple[int, float]]] = {}
    for r in report.placement:
        if r.tflops is not None:
            by.setdefault(f"{r.placement} ({r.kernel})", []).append((r.m, r.tflops))
    colours = {"local": "#2ca02c", "guarded": "#d62728", "remote": "#ff7f0e"}
    for label, points in by.items():
        ax.plot(
            [m for m, _ in points],
            [v for _, v in points],
            marker="o",
            markersize=4,
            color=colours.get(label.split(" ")[0], "#9467bd"),
            label=label,
        )
    slow = [r.slowdown_scan for r in report.placement if r.placement == "remote" and r.slowdown_scan]
    worst = (
        f"\nremote {min(slow):.1f}-{max(slow):.1f}x the guarded time (scan: 'slow' from {report.slow_factor:.0f}x)"
        if slow
        else ""
    )
    ax.set_xscale("log", base=2)
    ms = sorted({r.m for r in report.placement})
    ax.set_xticks(ms, [_rows_label(m) for m in ms], fontsize=7)
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_title(f"forward per placement, operands on b{worst}", fontsize=8)
    ax.set_xlabel("rows M (tokens x top_k)", fontsize=8)
    ax.set_ylabel("TFLOP/s (host wall time)", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="best")


def _rows_label(m: int) -> str:
    return f"{m // 1024}k" if m >= 1024 and m % 1024 == 0 else str(m)
