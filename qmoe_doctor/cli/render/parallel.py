"""Rendering of parallel reports (``qmoe-doctor parallel``, ``scan --parallel``, ``repro
--parallel``): the modes table, the ranks table, diagnoses, the verdict, the per-rank scripts."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import print_table
from qmoe_doctor.cli.render.scan import STYLE, diagnosis_panel
from qmoe_doctor.core.modes import MODE_OF
from qmoe_doctor.core.records import Status
from qmoe_doctor.core.reports import ParallelReport
from qmoe_doctor.reports.parallel_script import PARALLEL_SCRIPT_CAUSES, WrittenScript
from qmoe_doctor.workflows.parallel import describe_outcome


def _label(status: Status, kind: object) -> Text:
    label = str(kind) if status is Status.ERROR and kind else str(status)
    return Text(label, style=STYLE.get(label, "bold red"))


def _g(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_parallel(console: Console, report: ParallelReport) -> None:
    console.print(
        Text.assemble(
            ("kernel ", "dim"),
            (report.kernel, "bold"),
            ("   tier ", "dim"),
            report.tier,
            ("   preset ", "dim"),
            report.preset,
            ("   tokens/step ", "dim"),
            f"{report.tokens:,}",
            ("   ", "dim"),
            f"{report.dtype} {report.backend}",
            ("   wall ", "dim"),
            f"{report.wall_s:.1f} s",
        )
    )
    if report.gpu_of_ordinal:
        mapping = ", ".join(f"cuda:{o} = GPU {g}" for o, g in sorted(report.gpu_of_ordinal.items()))
        console.print(Text(f"  ranks saw {mapping}", style="dim"))
    modes = Table(
        title="Modes: every rank against a single-device run of the same weights and inputs",
        title_justify="left",
    )
    for col in (
        "mode",
        "ranks",
        "result",
        "max rel. err",
        "tolerance",
        "step ms",
        "tokens/s",
        "vs 1 GPU",
        "efficiency",
    ):
        modes.add_column(col, justify="right" if col not in ("mode", "result") else "left")
    for m in report.modes:
        modes.add_row(
            m.mode.value,
            str(m.world_size),
            Text(
                str(m.status) + (" (timeout)" if m.timed_out else ""),
                style=STYLE.get(str(m.status), "bold red"),
            ),
            _g(m.max_rel_error, ".2g"),
            _g(m.tolerance, "g"),
            _g(m.step_ms, ".1f"),
            _g(m.tokens_per_s, ",.0f"),
            "-" if m.speedup is None else f"{m.speedup:.2f}x",
            "-" if m.efficiency is None else f"{100 * m.efficiency:.0f}%",
        )
    print_table(console, modes)
    ranks = Table(title="Ranks", title_justify="left")
    for col in ("rank", "mode", "device", "result", "detail"):
        ranks.add_column(col)
    for o in report.outcomes:
        mode = MODE_OF.get(o.spec.condition)
        detail = describe_outcome(o)
        if o.status is Status.ERROR:
            detail += f"  [at {o.facts.get('parallel.at', o.phase)}]"
        ranks.add_row(
            o.spec.placement.group,
            mode.value if mode else o.spec.condition.value.removeprefix("parallel-"),
            str(o.facts.get("parallel.device", "-" if o.spec.device is None else f"cuda:{o.spec.device}")),
            _label(o.status, o.error_kind),
            detail,
        )
    print_table(console, ranks)
    for d in report.diagnoses:
        console.print(diagnosis_panel(d))
    for note in report.explanations:
        console.print(Text.assemble(("note: ", "yellow"), note))
    if report.unexplained:
        console.print(
            Text("Failing ranks no rule accounts for (a fault, cause not named):", style="bold red")
        )
        for e in report.unexplained:
            console.print(Text.assemble("  ", (e.probe_id, "cyan"), " ", (e.label, "red"), ": ", e.detail))
    for note in report.skipped:
        console.print(Text.assemble(("skipped: ", "dim"), note))
    if report.healthy:
        console.print(Text("healthy: every rank matched one device; no cause diagnosed", style="bold green"))
    else:
        n = len(report.diagnoses)
        console.print(
            Text(
                f"{n} cause{'s' if n != 1 else ''} diagnosed"
                + (f", {len(report.unexplained)} unexplained failing rank(s)" if report.unexplained else ""),
                style="bold red",
            )
        )
    if report.log_dir:  # "" when a healthy run's logs were removed
        console.print(Text(f"logs: {report.log_dir}", style="dim"))


def render_scripts(console: Console, report: ParallelReport, written: Sequence[WrittenScript]) -> None:
    """``repro --parallel``: the per-rank scripts written, how to run them, and the causes that
    have none."""
    for w in written:
        console.print(Text.assemble(("script ", "dim"), (w.path, "bold"), f"   ({w.cause})"), soft_wrap=True)
        console.print(Text.assemble(("  run: ", "dim"), w.command), soft_wrap=True)
        if w.command != w.gpu_command:
            console.print(Text.assemble(("  on GPUs: ", "dim"), w.gpu_command), soft_wrap=True)
        elif w.cpu_command:
            console.print(Text.assemble(("  on CPU ranks: ", "dim"), w.cpu_command), soft_wrap=True)
    if written:
        console.print(
            Text(
                "  each rank prints PASS or FAIL; exit 1 = reproduced (torchrun names the rank), 0 = passed, "
                "2 = cannot run here",
                style="dim",
            ),
            soft_wrap=True,
        )
    for cause in sorted({d.cause for d in report.diagnoses} - set(PARALLEL_SCRIPT_CAUSES)):
        console.print(
            Text.assemble(
                ("script ", "dim"),
                f"none for {cause}: per-rank scripts cover {' and '.join(PARALLEL_SCRIPT_CAUSES)}; "
                "the diagnosis' repro line reruns it",
            ),
            soft_wrap=True,
        )
    if report.unexplained and not report.diagnoses:
        console.print(
            Text.assemble(("script ", "dim"), "none: no cause named for the failing rank(s)"), soft_wrap=True
        )
