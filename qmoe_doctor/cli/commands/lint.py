"""`qmoe-doctor lint PATH...`: static checks for the multi-GPU faults of fused MoE kernels.

A skin over :func:`qmoe_doctor.workflows.lint.run_lint`: validate, call, render, exit. Sources are
read with ``ast``, never imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.cli.output import check_outputs, deliver, save_text, stderr_console
from qmoe_doctor.cli.render.lint import render_plain, render_table
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.inputs import shown_path
from qmoe_doctor.reports.json import dumps, json_document
from qmoe_doctor.reports.sarif import lint_sarif
from qmoe_doctor.workflows.check import lint_result
from qmoe_doctor.workflows.lint import RULE_NAMES, run_lint


def lint_command(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Python files or directories (walked for *.py), or - for standard input. Read with ast, never imported.",
            show_default=False,
        ),
    ],
    select: Annotated[
        str | None,
        typer.Option(
            "--select", help=f"Comma-separated rules to run (default: all). Rules: {', '.join(RULE_NAMES)}."
        ),
    ] = None,
    ignore: Annotated[str | None, typer.Option("--ignore", help="Comma-separated rules to skip.")] = None,
    json_out: opt.JsonOpt = False,
    save: opt.SaveOpt = None,
    sarif: opt.SarifOpt = None,
    plain: Annotated[
        bool,
        typer.Option(
            "--plain", help="One line per finding (path:line:col: rule \\[cause] message), no table."
        ),
    ] = False,
) -> None:
    """Lint kernel sources for launches without a device guard, int32 offsets, per-device state
    cached from one GPU or read from the current device for a launch, streams and buffers of the
    current device, and autotuned in-place kernels.

    Exit status: 0 clean, 1 findings, 2 a path that does not exist, a file that does not parse,
    or nothing to lint (a folder with no Python source: what was skipped is said). `-` reads one
    source from standard input. Silence one finding with a `# qmoe-doctor: ignore[RULE]` comment
    on its line.
    """
    check_outputs(files={"--save": save, "--sarif": sarif})
    report = run_lint(paths, select=select, ignore=ignore)  # an unknown rule: ValueError, exit 2
    if not report.rules:
        raise CliError("--select/--ignore leave no rule to run")
    err = stderr_console()
    for skip in report.skipped:
        err.print(Text(f"note: {skip.as_line()}", style="yellow"), soft_wrap=True)
    if not report.files and not report.errors:
        # a check that checked nothing does not pass: an empty folder, only FIFOs or devices
        raise CliError(
            f"nothing was linted: {', '.join(shown_path(p) for p in paths[:5])} held no Python source"
            + (f" ({len(report.skipped)} entries skipped)" if report.skipped else "")
        )
    code = ExitCode.USAGE if report.errors else ExitCode.FAULT if report.findings else ExitCode.HEALTHY
    if sarif is not None:
        save_text(sarif, dumps(lint_sarif(lint_result(report), exit_code=code)), what="the SARIF log")
    deliver(
        json_document("lint", report),
        lambda out: (render_plain if plain else render_table)(out, report),
        json_out=json_out,
        save=save,
    )
    for error in report.errors:
        err.print(Text(f"error: {error.as_line()}", style="red"), soft_wrap=True)
        if error.source:
            err.print(Text(f"    {error.source}", style="dim"), soft_wrap=True)
    raise typer.Exit(code)
