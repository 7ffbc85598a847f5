"""Rendering of bench reports: the header, the TFLOP/s table per op and implementation, the
per-placement table, the notes.

Readable wherever it goes: on a terminal the tables fit the window and a number that does not
fit folds onto a second line (never "…"); to a pipe or a CI log, where rich assumes 80 columns
and shrank every number column to "…", each table prints at its natural width."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import print_table
from qmoe_doctor.core.bench import BLOCK_OPS, DENSE, OP_LABEL, OURS, BenchReport, BenchRow


def _fmt_tflops(r: BenchRow | None, timed: bool) -> Text:
    if r is None:
        return Text("-", style="dim")
    if r.note and r.ms is None:
        return Text("failed", style="red")
    if not timed or r.tflops is None:
        return Text("ran", style="green")
    text = Text(f"{r.tflops:.1f}", style="bold" if r.impl in OURS else "")
    if r.frac_dense is not None and r.impl != DENSE:
        text.append(f" {r.frac_dense:.0%}", style="dim")
    return text


def _max_err(rows: Sequence[BenchRow]) -> str:
    errs = [r.rel_err for r in rows if r.rel_err is not None and not math.isnan(r.rel_err)]
    return f"{max(errs):.1e}" if errs else "-"


def header_lines(report: BenchReport) -> list[str]:
    s = report.shape
    gpus = f" (GPU {', '.join(str(i) for i in report.gpus)})" if report.gpus else ""
    lines = [
        f"{report.device}{gpus} | torch {report.torch} | triton {report.triton} | {report.dtype} | "
        f"preset {report.preset}: E={s.e} N={s.n} K={s.k} top_k={s.top_k} (block H={s.hidden} I={s.intermediate})"
    ]
    table = config_table_line(report)
    if table:
        lines.append(table)
    if report.routing != "random":
        lines.append(
            f"GEMM rows routed {report.routing}: every expert M/E rows (the block rows use the block's router)"
        )
    if report.timed:
        lines.append(
            f"TFLOP/s ({report.timing}); the dim % is the fraction of one dense GEMM of the same FLOPs"
        )
    else:
        lines.append(
            "CPU smoke run (Triton interpreter): nothing timed, no speed claims ('ran': it ran, and was compared where there is a reference)"
        )
    return lines


def config_table_line(report: BenchReport) -> str:
    """Which launch-config table our kernels used ("" for reports that do not say)."""
    text = str(getattr(report, "config_table", "") or "")  # recorded since the per-device tables
    return f"our launch configs: {text}" if text else ""


def _number_column(table: Table, header: str) -> None:
    """A right-aligned number column: rich narrows the wrappable text columns first, and a
    number that still does not fit folds onto a second line rather than turning into "…"."""
    table.add_column(header, justify="right", no_wrap=True, overflow="fold")


def gemm_table(report: BenchReport) -> Table:
    has_block = any(op in BLOCK_OPS for op in report.ops())
    table = Table(title="Grouped GEMMs" + (" and the MoE block" if has_block else ""), title_justify="left")
    table.add_column("op", no_wrap=True)
    table.add_column("implementation", overflow="fold", min_width=14)  # the column that wraps first
    for t in report.tokens:
        m = next((r.m for r in report.rows if r.tokens == t), t * report.shape.top_k)
        _number_column(table, f"{t} tok\nM={m}")
    _number_column(table, "max rel err")
    for op in report.ops():
        for i, impl in enumerate(report.impls(op)):
            cells = [_fmt_tflops(report.row(op, impl, t), report.timed) for t in report.tokens]
            rows = [r for r in report.rows if r.op == op and r.impl == impl]
            table.add_row(
                OP_LABEL[op] if i == 0 else "",
                impl,
                *cells,
                _max_err(rows),
                end_section=i == len(report.impls(op)) - 1,
            )
    return table


def placement_table(report: BenchReport) -> Table:
    a, b = "a = cuda:0", "b = cuda:1"
    if len(report.gpus) >= 2:
        a, b = f"{a} (GPU {report.gpus[0]})", f"{b} (GPU {report.gpus[1]})"
    table = Table(title=f"Forward per placement: {a}, {b}; operands on b", title_justify="left")
    for name in ("tokens", "placement", "kernel", "current", "peer a->b"):
        table.add_column(name, justify="right" if name in ("tokens", "current") else "left", no_wrap=True)
    for name in ("ms", "TFLOP/s", "x guarded", "x guarded (scan)", "rel err"):
        _number_column(table, name)
    for r in report.placement:
        slow = Text("-", style="dim")
        if r.slowdown_scan is not None:
            flagged = r.slowdown_scan >= report.slow_factor
            slow = Text(f"{r.slowdown_scan:.1f}x", style="yellow" if flagged else "green")
        table.add_row(
            str(r.tokens),
            r.placement,
            r.kernel,
            f"cuda:{r.current}",
            "on" if r.peer_enabled else "off",
            f"{r.ms:.3f}"
            if r.ms is not None
            else Text("failed" if r.note else "-", style="red" if r.note else "dim"),
            f"{r.tflops:.1f}" if r.tflops is not None else "-",
            f"{r.slowdown:.1f}x" if r.slowdown is not None else "-",
            slow,
            f"{r.rel_err:.1e}" if r.rel_err is not None else "-",
        )
    return table


def render_report(console: Console, report: BenchReport) -> None:
    for line in header_lines(report):
        console.print(line, style="dim" if line.startswith(("TFLOP", "CPU")) else "bold", soft_wrap=True)
    print_table(console, gemm_table(report))
    if report.placement:
        print_table(console, placement_table(report))
        console.print(
            f"scan labels a correct cell 'slow' at {report.slow_factor:.1f}x its guarded baseline "
            "(the 'x guarded (scan)' column is the same measure).",
            style="dim",
        )
    for r in report.rows:
        if r.note:
            console.print(f"note: {r.op} {r.impl} at {r.tokens} tokens: {r.note}", style="yellow")
    for p in report.placement:
        if p.note:
            console.print(
                f"note: placement {p.placement} ({p.kernel}) at {p.tokens} tokens: {p.note}", style="yellow"
            )
    for note in report.notes:
        console.print(f"note: {note}", style="dim")
