"""`qmoe-doctor run [OPTIONS] -- COMMAND [ARGS...]`: the user's own program under the launch monitor.

A skin over :func:`qmoe_doctor.workflows.run.run_program`: validate, call, render, exit. The
``--`` is required: everything after it is the command, untouched; everything before it is
ours. The command's output passes through to the terminal; the report follows it.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text
from typer.core import TyperCommand

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.cli.output import (
    check_outputs,
    emit_document,
    save_document,
    save_text,
    stderr_console,
    stdout_console,
)
from qmoe_doctor.cli.render.run import render_run
from qmoe_doctor.core import knobs
from qmoe_doctor.core.fingerprints import DEFAULT_PRINTED_LAUNCHES
from qmoe_doctor.core.reports import RunPassLabel, RunReport
from qmoe_doctor.reports.json import json_document
from qmoe_doctor.reports.run_junit import run_junit_text
from qmoe_doctor.workflows.run import RunOptions, run_program

#: Where the command line after ``--`` is kept between parsing and the command (ctx.meta).
_COMMAND_KEY = "qmoe_doctor.run.command"
USAGE = "qmoe-doctor run [OPTIONS] -- COMMAND [ARGS...]"


class RunCommand(TyperCommand):
    """Splits the arguments at the first ``--``: click sees only what is before it (our
    options), and the command after it is kept whole, whatever options it has."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's vendored click.Context
        if "--" in args:
            cut = args.index("--")
            ctx.meta[_COMMAND_KEY] = args[cut + 1 :]
            args = args[:cut]
        else:
            ctx.meta[_COMMAND_KEY] = None
        return super().parse_args(ctx, args)


#: How app.py registers it: ``app.command("run", **REGISTRATION)``. Positional words before
#: ``--`` land in ctx.args, for a clear refusal instead of click's "unexpected extra argument".
REGISTRATION: dict[str, Any] = {
    "cls": RunCommand,
    "context_settings": {"allow_extra_args": True, "allow_interspersed_args": False},
    "options_metavar": "[OPTIONS] -- COMMAND [ARGS]...",
}

RingOpt = Annotated[
    int,
    typer.Option("--ring", min=1, max=1_000_000, help="Launches each process keeps and reports (the last ones)."),
]
StrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Raise inside the command at the first cross-device launch instead of warning (for CI); "
        "implies --fail-on-finding.",
    ),
]
BlockingOpt = Annotated[
    bool,
    typer.Option(
        "--blocking",
        help="After a CUDA error, run the command again with CUDA_LAUNCH_BLOCKING=1: the launch that "
        "raises is the faulting kernel.",
    ),
]
SanitizeOpt = Annotated[
    bool,
    typer.Option(
        "--sanitize",
        help="Run the command again under compute-sanitizer memcheck (caching allocator off), restricted "
        "to the faulting kernel, and place each invalid address against the recorded tensors.",
    ),
]
CompareOpt = Annotated[
    str | None,
    typer.Option(
        "--compare",
        metavar="REFERENCE",
        help="Run the command as a subject and again as a reference, with every Triton launch's tensors "
        "fingerprinted before and after it (sums, non-finite count, sampled values), and name the first "
        "launch whose results differ, in the kernel or before it. REFERENCE: 'blocking' (the command with "
        "CUDA_LAUNCH_BLOCKING=1: an ordering fault), 'repeat' (the command again: nondeterminism), or "
        "another command in quotes, e.g. \"python train.py --gpus 0\" (a placement fault).",
    ),
]
RepeatOpt = Annotated[
    int | None,
    typer.Option(
        "--repeat",
        metavar="N",
        show_default=False,
        help="With --compare: runs of the reference (default 2). A launch whose prints differ between them "
        "is nondeterministic and compared within their spread.",
    ),
]
CompareLaunchesOpt = Annotated[
    int,
    typer.Option(
        "--compare-launches",
        metavar="N",
        min=1,
        max=1_000_000,
        help="With --compare: launches of each kernel fingerprinted per process (the first N).",
    ),
]
FailOpt = Annotated[
    bool,
    typer.Option(
        "--fail-on-finding", help="Exit 1 when the command exits 0 but a diagnosis or CUDA error was found."
    ),
]
JunitOpt = Annotated[
    Path | None, typer.Option("--junit", metavar="FILE", help="Write a JUnit XML report to FILE.")
]
RUN_JSON_HELP = (
    "Write the versioned JSON document to stdout instead of the report (after the command's own "
    "output; --save FILE keeps them apart)."
)
RunJsonOpt = Annotated[bool, typer.Option("--json", help=RUN_JSON_HELP)]


def _command_line(ctx: typer.Context) -> list[str]:
    command: list[str] | None = ctx.meta.get(_COMMAND_KEY)
    if command is None:
        if ctx.args:
            raise CliError(
                f"put -- before the command, so its options stay its own: "
                f"qmoe-doctor run [OPTIONS] -- {shlex.join(ctx.args)}"
            )
        raise CliError(f"no command to run: {USAGE}")
    if ctx.args:
        raise CliError(f"unexpected argument {ctx.args[0]!r} before --: {USAGE}")
    if not command:
        raise CliError(f"no command after --: {USAGE}")
    return command


def run_command(
    ctx: typer.Context,
    ring: RingOpt = knobs.DEFAULT_RUN_RING,
    strict: StrictOpt = False,
    blocking: BlockingOpt = False,
    sanitize: SanitizeOpt = False,
    fail_on_finding: FailOpt = False,
    compare: CompareOpt = None,
    repeat: RepeatOpt = None,
    compare_launches: CompareLaunchesOpt = DEFAULT_PRINTED_LAUNCHES,
    json_out: RunJsonOpt = False,
    save: opt.SaveOpt = None,
    junit: JunitOpt = None,
    log_dir: opt.LogDirOpt = None,
) -> None:
    """Run your own program (python train.py, torchrun ..., accelerate launch ...) with a monitor
    in every Python process it starts: each Triton launch is checked as it happens (tensors on
    another GPU than the launch's, mixed devices, CPU tensors, int32 offsets past 2**31 by size),
    the last launches are kept, and the report names the cause, the call site and the fix.

    With --compare REFERENCE the command runs as a subject and the reference --repeat times, each
    launch's tensors fingerprinted on their own device, and the report names the first launch
    whose results differ: blocking (CUDA_LAUNCH_BLOCKING=1: a race, a missing stream wait),
    repeat (run-to-run nondeterminism), or "python train.py --gpus 0" (another placement).

    Exit status: the command's own (128 + N after signal N); 1 with --fail-on-finding or --strict
    when it exited 0 but something was found (a divergent launch too); 2 for a bad command line, a
    command or reference that cannot be started, or a reference that launched nothing; 4 when the
    doctor itself failed.
    """
    command = _command_line(ctx)
    if compare is None and repeat is not None:
        raise CliError("--repeat counts the runs of a --compare reference: give --compare too")
    if repeat is not None and repeat < 1:
        raise CliError(f"--repeat {repeat}: the reference runs at least once (the default is 2)")
    check_outputs(files={"--save": save, "--junit": junit}, dirs={"--log-dir": log_dir})
    err = stderr_console()

    def on_pass(label: RunPassLabel, argv: Any, why: str) -> None:
        err.print(Text(f"qmoe-doctor run: {label} pass: {why}", style="bold"), soft_wrap=True)

    report = run_program(  # RunInputError (no such command): a ValueError, exit 2
        command,
        RunOptions(
            ring=ring,
            strict=strict,
            blocking=blocking,
            sanitize=sanitize,
            fail_on_finding=fail_on_finding,
            log_dir=log_dir,
            compare=compare,
            repeat=2 if repeat is None else repeat,
            compare_launches=compare_launches,
        ),
        on_pass=on_pass,
    )
    write_reports(report, save=save, junit=junit)
    if json_out:
        emit_document(json_document("run", report))
    else:
        render_run(stdout_console(), report)
    raise typer.Exit(report.exit_code)


def write_reports(report: RunReport, *, save: Path | None, junit: Path | None) -> None:
    fallback = Path(report.record_dir) if report.record_dir else None
    if junit is not None:
        save_text(junit, run_junit_text(report), what="the JUnit report", fallback_dir=fallback)
    if save is not None:
        save_document(save, json_document("run", report), fallback_dir=fallback)


__all__ = ["REGISTRATION", "USAGE", "RunCommand", "run_command", "write_reports"]
