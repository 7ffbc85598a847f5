"""Rendering of check reports for the terminal: per kernel, its tiers, diagnoses, lint, the verdict."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from qmoe_doctor.cli.render.lint import lint_lines
from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.reports import CheckReport, KernelCheck

_STATUS = {
    ExitCode.HEALTHY: ("healthy", "bold green"),
    ExitCode.FAULT: ("FAULT", "bold red"),
    ExitCode.USAGE: ("USAGE ERROR", "bold red"),
    ExitCode.CHECK_BROKEN: ("COULD NOT CHECK", "bold yellow"),
}


def _render_kernel(k: KernelCheck) -> list[Text]:
    word, style = _STATUS.get(ExitCode(k.exit_code), ("?", "bold"))
    head = Text.assemble((k.kernel, "bold"), "  ", (word, style), (f"  ({k.wall_s:.1f} s)", "dim"))
    lines = [head]
    for t in k.tiers:
        c = t.counts
        where = "CPU tier" if t.tier == "cpu" else "GPU subset (GPUs " + ", ".join(map(str, t.gpus)) + ")"
        lines.append(
            Text(
                f"  {where}: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped"
                + (f", {c['error']} could not run" if c["error"] else "")
                + f"  ({t.wall_s:.1f} s"
                + (f"; logs {t.log_dir})" if t.log_dir else ")"),
                style="dim",
            )
        )
    if k.problem:
        lines.append(Text(f"  {k.problem}", style="red"))
    for note in k.notes:
        lines.append(Text(f"  {note}", style="dim"))
    for d in (*k.diagnoses, *k.hardening):
        docs = CAUSES[d.cause].docs if d.cause in CAUSES else ""
        if d.severity == "hardening":  # reported, not a fault (exit 0)
            head = Text.assemble(
                ("  note: hardening ", "yellow"), ("(reported, exit 0): ", "dim"), (d.cause, "bold yellow")
            )
        else:
            head = Text.assemble("  ", (d.cause, "bold red"))
        lines.append(Text.assemble(head, f": {d.summary}", (f"  [{d.confidence}]", "dim")))
        if d.where:
            lines.append(Text(f"    where: {', '.join(d.where)}", style="dim"))
        if d.repro:
            lines.append(Text.assemble(("    repro: ", "dim"), (d.repro, "bold")))
        if docs:
            lines.append(Text(f"    docs: {docs}", style="dim"))
    for e in k.unexplained:
        lines.append(
            Text.assemble("  ", ("unexplained ", "bold red"), (e.probe_id, "cyan"), f" {e.label}: {e.detail}")
        )
    for note in k.explanations:
        if not any(h.summary in note for h in k.hardening):  # drawn above
            lines.append(Text.assemble(("  note: ", "yellow"), note))
    for cell in k.cells:
        if cell.label in ("rejected", "unchecked"):  # not failures, but the verdict does not cover them
            lines.append(Text.assemble(f"  {cell.label} ", (cell.probe_id, "cyan"), f": {cell.detail}"))
    cov = k.coverage
    if cov is not None and not cov.complete:
        gpu = any(t.tier == "gpu" for t in k.tiers)
        if gpu:
            what = ("lint, " if k.lint is not None else "") + "the CPU tier and the GPU subset"
        else:
            what = ("lint and " if k.lint is not None else "") + "the CPU tier only"
        lines.append(Text(f"  covers: {what}; {cov.sentence()}", style="yellow"))
    if k.lint is not None:
        lines += lint_lines(k.lint, "  ")
    reasons = sorted({c.detail for c in k.cells if c.verdict == "skip" and c.label != "unchecked"})
    for r in reasons:
        lines.append(Text(f"  skipped: {r}", style="dim"))
    for t in k.tiers:
        for s in t.skipped:
            lines.append(Text(f"  not run: {s}", style="dim"))
    return lines


def render_check(out: Console, report: CheckReport) -> None:
    for k in report.kernels:
        for line in _render_kernel(k):
            out.print(line, soft_wrap=True)
    if report.lint is not None:
        for line in lint_lines(report.lint, ""):
            out.print(line, soft_wrap=True)
    for note in report.notes:
        out.print(Text(f"note: {note}", style="yellow"), soft_wrap=True)
    code = ExitCode(report.exit_code)
    word, style = _STATUS.get(code, ("?", "bold"))
    out.print(Text.assemble(("check: ", "bold"), (word, style), f" (exit {int(code)})"), soft_wrap=True)
