"""`qmoe-doctor explain FILE`: say what a saved compute-sanitizer log or traceback shows.

A skin over :func:`qmoe_doctor.workflows.explain.explain_input` (which reads the input through
the bounded reader and explains it): call, render, exit. Every string in the explanation came
from the user's text, so it is rendered as ``Text``, never as markup.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.text import Text

from qmoe_doctor.cli.output import emit_json, error, stdout_console
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.inputs import MAX_INPUT_BYTES, InputError
from qmoe_doctor.workflows.explain import Explanation, explain_input


def explain_command(
    file: Path = typer.Argument(
        ...,
        help="A saved compute-sanitizer log (text), a Python traceback, or a file with both; gzip is read "
        f"too. '-' reads stdin. At most {MAX_INPUT_BYTES // 2**20} MiB (a gzip's, decompressed).",
        show_default=False,
    ),
    json_out: bool = typer.Option(False, "--json", help="Write the explanation as one JSON document."),
) -> None:
    """Explain a compute-sanitizer log or a traceback from your run: the kernel, the access, the
    nearest allocation, your frames, the CUDA error, which causes fit it and why, and the
    qmoe-doctor command that would settle it. A log alone rarely proves a cause.

    Exit status: 0 the text shows a clean run (ERROR SUMMARY: 0 errors) or no error in the part
    present, 1 it shows an error, fault or hazard, 2 the input is unreadable, empty, too big, not a
    regular file (a FIFO, a device), a corrupt gzip, or neither a compute-sanitizer log nor a
    traceback.
    """
    try:
        explanation = explain_input(file)
    except InputError as exc:  # unreadable, special, too big, or neither a log nor a traceback
        error(str(exc))
        raise typer.Exit(ExitCode.USAGE) from None

    if json_out:
        emit_json("explanation", explanation)
    else:
        _render(explanation)
    raise typer.Exit(ExitCode.FAULT if explanation.findings else ExitCode.HEALTHY)


def _render(e: Explanation) -> None:
    out = stdout_console()
    kinds = {"sanitizer-log": "compute-sanitizer log", "traceback": "traceback", "both": "log and traceback"}
    title = Text(f"{e.source} ", style="bold")
    title.append(f"({kinds[e.input_kind]})", style="dim")
    out.print(title, soft_wrap=True)
    out.print(Text(e.headline, style="bold red" if e.findings else "bold green"))
    if e.error_kind is not None:
        out.print(Text(f"error kind: {e.error_kind}", style="dim"))

    def section(name: str, lines: tuple[str, ...], style: str = "") -> None:
        if not lines:
            return
        out.print(Text(f"\n{name}", style="bold"))
        for line in lines:
            out.print(Text(f"  - {line}", style=style), soft_wrap=True)

    section("What it shows", e.facts)
    section("Your frames", e.user_frames)
    if e.fits:
        out.print(Text("\nCauses that fit (not proven)", style="bold"))
        for fit in e.fits:
            line = Text("  - ")
            line.append(fit.cause, style="bold yellow")
            line.append(f": {fit.why}")
            out.print(line, soft_wrap=True)
            out.print(Text(f"      docs/causes/{fit.cause}.md", style="dim"), soft_wrap=True)
    section("To settle it", e.next_steps, style="cyan")
    section("Caveats", e.caveats, style="dim")
