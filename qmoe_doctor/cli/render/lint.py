"""Rendering of lint reports: a table per file, or one line per finding (``--plain``); and the
lint section of ``check`` and ``scan`` reports (``lint_lines``)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import print_table
from qmoe_doctor.core.reports import LintResult
from qmoe_doctor.workflows.lint import LintReport

#: Widest a finding's table is printed to a pipe: its message wraps, its fix's code lines (folded
#: past the column, never cut) fit whole at this width.
PROSE_WIDTH = 140


def lint_lines(lint: LintResult, indent: str, *, head: str = "lint") -> list[Text]:
    """The lint section: counts, the files a kernel reached (each named), the findings, the
    paths that could not be linted and what the reach did not follow."""
    where = f" reached from {lint.reached_from}" if lint.reached_from else ""
    lines = [
        Text(f"{indent}{head}: {len(lint.files)} file(s){where}, {len(lint.findings)} finding(s)", style="dim")
    ]
    if lint.reached_from:
        lines += [Text(f"{indent}  linted: {path}", style="dim") for path in lint.files]
    for f in lint.findings:
        lines.append(Text.assemble(indent, "  ", (f.as_line(), "red")))
    for e in lint.errors:
        lines.append(Text.assemble(indent, "  ", (f"error: {e.as_line()}", "red")))
    lines += [Text(f"{indent}  note: {n}", style="dim") for n in lint.notes]
    return lines


def _summary(report: LintReport) -> str:
    n_files = len(report.files)
    files = f"{n_files} file{'s' if n_files != 1 else ''}"
    n_skipped = len(report.skipped)
    skipped = f"; {n_skipped} entr{'ies' if n_skipped != 1 else 'y'} skipped (not sources)" if n_skipped else ""
    n_errors = len(report.errors)  # read but not linted (unreadable, not Python): not clean either
    if n_errors:
        skipped += f"; {n_errors} file{'s' if n_errors != 1 else ''} not linted"
    if not report.findings:
        return f"No findings in {files} ({len(report.rules)} rules){skipped}."
    per_rule = ", ".join(f"{rule} {n}" for rule, n in report.counts().items())
    n = len(report.findings)
    return f"{n} finding{'s' if n != 1 else ''} in {len(report.by_file())} of {files} ({per_rule}){skipped}."


def render_plain(out: Console, report: LintReport) -> None:
    for finding in report.findings:
        out.print(Text(finding.as_line()), soft_wrap=True)
    out.print(Text(_summary(report)), soft_wrap=True)


def render_table(out: Console, report: LintReport) -> None:
    for path, findings in report.by_file().items():
        table = Table(title=Text(path, style="bold"), title_justify="left", show_lines=True, expand=False)
        table.add_column("Line", justify="right", no_wrap=True)
        table.add_column("Rule / cause", no_wrap=True)
        table.add_column("Finding and fix", overflow="fold")  # code of a fix, never cut to "…"
        for f in findings:
            rule = Text(f.rule.value, style="bold yellow")
            rule.append(f"\n{f.cause}", style="dim")
            body = Text(f.message)
            body.append("\nfix: ", style="bold green")
            body.append(f.fix, style="green")
            table.add_row(f"{f.line}:{f.col}", rule, body)
        print_table(out, table, max_width=PROSE_WIDTH)
    if report.findings:
        docs = sorted({f"docs/causes/{f.cause}.md" for f in report.findings})
        out.print(Text("More on each cause: " + ", ".join(docs), style="dim"), soft_wrap=True)
    style = "bold" if report.findings else "yellow" if report.errors else "green"
    out.print(Text(_summary(report), style=style), soft_wrap=True)
