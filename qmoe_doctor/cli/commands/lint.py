"""`qmoe-doctor lint PATH...`: static checks for the multi-GPU faults of fused MoE kernels.

A skin over :func:`qmoe_doctor.lint.rules.lint_paths`: validate, call, render, exit. Sources are read
with ``ast``, never imported.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import emit_json, stderr_console, stdout_console
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.lint.rules import RULES, LintReport, lint_paths, parse_rules

_RULE_HELP = ", ".join(r.value for r in RULES)


def lint_command(
    paths: list[Path] = typer.Argument(
        ...,
        help="Python files or directories (walked for *.py). Read with ast, never imported.",
        show_default=False,
    ),
    select: str | None = typer.Option(
        None, "--select", help=f"Comma-separated rules to run (default: all). Rules: {_RULE_HELP}."
    ),
    ignore: str | None = typer.Option(None, "--ignore", help="Comma-separated rules to skip."),
    json_out: bool = typer.Option(False, "--json", help="Write the report as one JSON document."),
    plain: bool = typer.Option(
        False, "--plain", help="One line per finding (path:line:col: rule \\[cause] message), no table."
    ),
) -> None:
    """Lint kernel sources for launches without a device guard, int32 offsets, per-device state
    cached from one GPU, streams and buffers of the current device, and autotuned in-place kernels.

    Exit status: 0 clean, 1 findings, 2 a path that does not exist or a file that does not parse.
    Silence one finding with a `# qmoe-doctor: ignore[RULE]` comment on its line.
    """
    err = stderr_console()
    try:
        report = lint_paths(
            paths,
            select=parse_rules(select.split(",")) if select else None,
            ignore=parse_rules(ignore.split(",")) if ignore else None,
        )
    except ValueError as exc:
        err.print(Text(f"error: {exc}", style="red"), soft_wrap=True)
        raise typer.Exit(ExitCode.USAGE) from None
    if not report.rules:
        err.print(Text("error: --select/--ignore leave no rule to run", style="red"))
        raise typer.Exit(ExitCode.USAGE)

    if json_out:
        emit_json("lint", report)
    elif plain:
        _render_plain(report)
    else:
        _render_table(report)
    for error in report.errors:
        err.print(Text(f"error: {error.as_line()}", style="red"), soft_wrap=True)
        if error.source:
            err.print(Text(f"    {error.source}", style="dim"), soft_wrap=True)

    if report.errors:
        raise typer.Exit(ExitCode.USAGE)
    raise typer.Exit(ExitCode.FAULT if report.findings else ExitCode.HEALTHY)


def _summary(report: LintReport) -> str:
    n_files = len(report.files)
    files = f"{n_files} file{'s' if n_files != 1 else ''}"
    if not report.findings:
        return f"No findings in {files} ({len(report.rules)} rules)."
    per_rule = ", ".join(f"{rule} {n}" for rule, n in report.counts().items())
    n = len(report.findings)
    return f"{n} finding{'s' if n != 1 else ''} in {len(report.by_file())} of {files} ({per_rule})."


def _render_plain(report: LintReport) -> None:
    out = stdout_console()
    for finding in report.findings:
        out.print(Text(finding.as_line()), soft_wrap=True)
    out.print(Text(_summary(report)), soft_wrap=True)


def _render_table(report: LintReport) -> None:
    out = stdout_console()
    for path, findings in report.by_file().items():
        table = Table(title=Text(path, style="bold"), title_justify="left", show_lines=True, expand=False)
        table.add_column("Line", justify="right", no_wrap=True)
        table.add_column("Rule / cause", no_wrap=True)
        table.add_column("Finding and fix")
        for f in findings:
            rule = Text(f.rule.value, style="bold yellow")
            rule.append(f"\n{f.cause}", style="dim")
            body = Text(f.message)
            body.append("\nfix: ", style="bold green")
            body.append(f.fix, style="green")
            table.add_row(f"{f.line}:{f.col}", rule, body)
        out.print(table)
    if report.findings:
        docs = sorted({f"docs/causes/{f.cause}.md" for f in report.findings})
        out.print(Text("More on each cause: " + ", ".join(docs), style="dim"), soft_wrap=True)
    out.print(Text(_summary(report), style="bold" if report.findings else "green"), soft_wrap=True)
