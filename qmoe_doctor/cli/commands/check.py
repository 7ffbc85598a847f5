"""`qmoe-doctor check`: the CI health check (lint, CPU tier, fast GPU subset), with JUnit and JSON.

A skin over :func:`qmoe_doctor.workflows.check.run_check`: validate, check the GPU count, call,
render, write the reports, exit with a documented code (README: exit codes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Protocol

import typer
from rich.text import Text

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.devices import Need, select_devices
from qmoe_doctor.cli.errors import KERNEL_PARAGRAPH, CliError, interrupt_code, say_kept_logs
from qmoe_doctor.cli.output import (
    check_outputs,
    emit_document,
    error,
    note,
    save_document,
    save_text,
    stderr_console,
    stdout_console,
)
from qmoe_doctor.cli.render.check import render_check
from qmoe_doctor.cli.render.progress import probe_lines
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.options import CheckOptions
from qmoe_doctor.core.records import to_jsonable
from qmoe_doctor.core.reports import CheckReport, Tier
from qmoe_doctor.reports.json import dumps
from qmoe_doctor.reports.junit import junit_text
from qmoe_doctor.reports.sarif import check_sarif
from qmoe_doctor.workflows.check import check_json, run_check

CPU_ONLY = (
    "ran the CPU tier only; placement, peer-access and stream faults need the GPU subset (a GPU runner)"
)


class _Planned(Protocol):
    @property
    def specs(self) -> Sequence[object]: ...


def check_command(
    ctx: typer.Context,
    kernel: opt.KernelsOpt = None,
    lint: Annotated[
        list[Path] | None,
        typer.Option(
            "--lint",
            help="Python file or folder to lint (repeatable). Default: every file each kernel's "
            "function reaches through its calls and imports (a wrapper's third-party module too), "
            "found without importing it.",
        ),
    ] = None,
    require_gpus: Annotated[
        int,
        typer.Option(
            "--require-gpus",
            min=0,
            help="Fail with exit 3, before running anything, when fewer GPUs are there.",
        ),
    ] = 0,
    gpus: opt.GpusOpt = None,
    cpu: opt.CpuOpt = False,
    junit: Annotated[
        Path | None, typer.Option("--junit", metavar="FILE", help="Write a JUnit XML report to FILE.")
    ] = None,
    json_out: opt.JsonOpt = False,
    save: opt.SaveOpt = None,
    sarif: opt.SarifOpt = None,
    only: opt.OnlyOpt = None,
    preset: opt.PresetOpt = opt.DEFAULT_PRESET,
    timeout: opt.TimeoutOpt = opt.DEFAULT_TIMEOUT_S,
    log_dir: opt.LogDirOpt = None,
    autotune: opt.AutotuneOpt = opt.DEFAULT_AUTOTUNE,
) -> None:
    """CI health check: lint what the kernel reaches, run the CPU tier, and on a GPU machine a fast
    subset of the scan (the first GPU pair; under a minute on two GPUs). Without --only: every
    condition the CPU tier can run, and the fast GPU subset.

    Exit codes: 0 healthy, 1 fault diagnosed (a diagnosis, an unexplained failing cell or a lint
    finding), 2 usage error, 3 fewer GPUs than --require-gpus, 4 the check could not run, 130
    interrupted (143 by SIGTERM).
    """
    if ctx.args:  # `check --json out.json`, from when --json took a path
        hint = f": write the report to a file with --save {ctx.args[0]}" if json_out else ""
        raise CliError(
            f"unexpected argument {ctx.args[0]!r}; --json is a flag (the JSON report to stdout){hint}"
        )
    refs = [str(opt.kernel_ref(k)) for k in kernel or ([] if lint else ["builtin"])]
    missing = [str(p) for p in lint or [] if not p.exists()]
    if missing:
        raise CliError(f"--lint: no such file or folder: {', '.join(missing)}")
    conditions = opt.conditions(only) if only is not None else None
    opt.preset(preset)
    if cpu and require_gpus:
        raise CliError("--require-gpus: --cpu runs no GPU probe; drop --require-gpus or --cpu")
    check_outputs(files={"--save": save, "--junit": junit, "--sarif": sarif}, dirs={"--log-dir": log_dir})
    need = Need(count=require_gpus, code=ExitCode.TOO_FEW_GPUS, why=f"--require-gpus {require_gpus}")
    devices = select_devices(gpus, cpu=cpu, cpu_fallback=CPU_ONLY, need=need if require_gpus else None)
    err = stderr_console()

    def on_tier(ref: str, tier: Tier, plan: _Planned) -> None:
        where = "CPU tier" if tier == "cpu" else f"GPU subset on GPUs {', '.join(map(str, devices.indices))}"
        err.print(Text(f"{ref}: {where}, {len(plan.specs)} probes", style="bold"), soft_wrap=True)

    so_far: list[CheckReport] = []

    def on_progress(partial: CheckReport) -> None:  # --save holds every finished tier
        so_far[:] = [partial]
        if save is not None:
            save_document(save, check_json(partial), fallback_dir=_logs(partial))

    try:
        report = run_check(
            refs,
            gpus=devices.gpus,
            opts=CheckOptions(preset=preset, conditions=conditions, timeout_s=timeout, autotune=autotune),
            lint=[str(p) for p in lint or []] or None,
            log_dir=log_dir,
            on_tier=on_tier,
            on_event=probe_lines(),
            on_progress=on_progress,
            inventory=to_jsonable(devices.inventory) if devices.inventory and devices.gpus else None,
            notes=(devices.fallback,) if devices.fallback else (),
        )
    except KeyboardInterrupt as exc:
        if save is not None and so_far:
            done = sum(len(k.cells) for k in so_far[0].kernels)
            note(f"interrupted: the report so far ({done} probes, complete: false) is in {save}")
        else:
            note("interrupted: nothing was saved (--save keeps the report of every finished tier)")
        say_kept_logs(exc)
        raise typer.Exit(interrupt_code(exc)) from None
    for k in report.kernels:
        if k.exit_code == ExitCode.USAGE and k.problem:
            error(f"{k.kernel!r}: {k.problem}")
            note(KERNEL_PARAGRAPH, style="")
    write_reports(report, save=save, junit=junit, sarif=sarif, fallback_dir=_logs(report))
    if json_out:
        emit_document(check_json(report))
    else:
        render_check(stdout_console(), report)
    raise typer.Exit(report.exit_code)


def write_reports(
    report: CheckReport,
    *,
    save: Path | None,
    junit: Path | None,
    sarif: Path | None = None,
    fallback_dir: Path | None,
) -> None:
    if junit is not None:
        save_text(junit, junit_text(report), what="the JUnit report", fallback_dir=fallback_dir)
    if sarif is not None:
        save_text(sarif, dumps(check_sarif(report)), what="the SARIF log", fallback_dir=fallback_dir)
    if save is not None:
        save_document(save, check_json(report), fallback_dir=fallback_dir)


def _logs(report: CheckReport) -> Path | None:
    """The run's log folder (each tier logs in ROOT/<kernel>/<tier>); None once removed."""
    return Path(report.log_dir) if report.log_dir else None
