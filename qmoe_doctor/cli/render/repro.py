"""Rendering of repro reports: the pipeline, the shrink, the verdict and its confirmation."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from qmoe_doctor.cli.render.scan import diagnosis_panel
from qmoe_doctor.core.reports import ReproReport
from qmoe_doctor.workflows.repro import shrink_cells


def render_repro(console: Console, report: ReproReport) -> None:
    """The result, for a terminal: the pipeline, the shrink, the verdict, its confirmation."""
    console.print(
        Text.assemble(
            ("kernel ", "dim"),
            (report.kernel, "bold"),
            ("   GPUs ", "dim"),
            ", ".join(str(g) for g in report.gpus),
            ("   shrink pair ", "dim"),
            f"GPU {report.pair[0]} -> GPU {report.pair[1]}",
        )
    )
    if report.pipeline is not None:
        style = "bold red" if report.pipeline.failed else "green"
        word = "FAILED" if report.pipeline.failed else "passed"
        console.print(Text.assemble(("pipeline ", "dim"), (word, style), ": ", report.pipeline.describe()))
    cells = shrink_cells(report)
    if cells:
        console.print(Text.assemble(("shrink ", "dim"), ", ".join(f"{pid} {label}" for pid, label in cells)))
    for d in report.diagnoses:
        console.print(diagnosis_panel(d))
    for note in report.explanations:
        console.print(Text.assemble(("note: ", "yellow"), note))
    for e in report.unexplained:
        console.print(Text.assemble(("unexplained: ", "red"), e.probe_id, " ", e.label, ": ", e.detail))
    for note in report.notes:
        console.print(Text.assemble(("note: ", "yellow"), note))
    if report.minimal:
        console.print(Text.assemble(("minimal failing probe ", "dim"), (report.minimal[0], "bold cyan")))
    s = report.sanitizer
    console.print(Text.assemble(("sanitizer ", "dim"), (s.status, "bold"), ": ", s.reason))
    if s.first_error:
        console.print(Text.assemble(("  first error ", "dim"), s.first_error))
    if s.touched:
        console.print(Text.assemble(("  bad access: ", "dim"), (s.touched, "bold")))
    for what, n in s.tensors_hit.items():
        console.print(Text(f"  {n} address(es) nearest {what}", style="dim"))
    if s.xid is not None and s.xid.xids:
        for line in s.xid_evidence:
            console.print(Text(f"  {line}", style="dim"))
    if s.log_path:
        console.print(Text(f"  log: {s.log_path}", style="dim"))
    if report.script:
        console.print(Text.assemble(("script ", "dim"), (report.script, "bold"), "   ", report.script_note))
    elif report.faulty:
        console.print(Text.assemble(("script ", "dim"), report.script_note))
    if not report.faulty:
        tried = ", ".join(report.tried)
        console.print(
            Text(
                f"nothing failed: tried {tried}. `qmoe-doctor scan --kernel {report.kernel}` runs every "
                "condition on every GPU pair.",
                style="bold green",
            )
        )
    verdict = report.verdict or ("no cause named" if report.faulty else "healthy")
    console.print(
        Text.assemble(
            ("verdict ", "dim"),
            (verdict, "bold red" if report.faulty else "bold green"),
            ("   time to verdict ", "dim"),
            f"{report.time_to_verdict_s:.1f} s",
            ("   total ", "dim"),
            f"{report.wall_s:.1f} s",
        )
    )
    if report.log_dir:  # "" when a healthy run's logs were removed
        console.print(Text(f"logs: {report.log_dir}", style="dim"))
