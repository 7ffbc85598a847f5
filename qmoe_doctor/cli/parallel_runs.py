"""Parallel runs from the command line, shared by ``parallel``, ``scan --parallel`` and ``repro
--parallel`` (so that no command imports another): pick the devices, plan, launch with progress
on stderr, refuse a kernel that no rank could import, write the report."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import NoReturn

import typer

from qmoe_doctor.cli.devices import select_devices
from qmoe_doctor.cli.errors import KERNEL_PARAGRAPH, CliError
from qmoe_doctor.cli.options import kernel_ref
from qmoe_doctor.cli.output import deliver
from qmoe_doctor.cli.render.parallel import render_parallel
from qmoe_doctor.cli.render.progress import parallel_lines
from qmoe_doctor.core import knobs
from qmoe_doctor.core.events import Interrupted
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.modes import Mode
from qmoe_doctor.core.options import ParallelOptions
from qmoe_doctor.core.reports import ParallelReport
from qmoe_doctor.reports.json import json_document
from qmoe_doctor.workflows.parallel import (
    ParallelPlan,
    kernel_import_failure,
    nothing_ran,
    parse_modes,
    plan_parallel,
    report_json,
    run_parallel,
)

CPU_RANKS = "running the ranks as CPU processes (gloo, Triton interpreter)"


def plan_runs(
    *, modes: str, kernel: str, gpus: str | None, cpu: bool, options: ParallelOptions
) -> ParallelPlan:
    """The launches, after every option was checked (a usage error raises before any start)."""
    ref = kernel_ref(kernel)
    chosen = parse_modes(modes)  # ParallelPlanError: exit 2
    if Mode.EP in chosen:  # the ep block's variables, read before any rank starts (ValueError: exit 2)
        knobs.ep_dispatch(), knobs.ep_transport(), knobs.ep_micro_batches()
    devices = select_devices(gpus, cpu=cpu, cpu_fallback=CPU_RANKS)
    return plan_parallel(str(ref), devices.gpus, replace(options, modes=chosen), cpu=cpu or not devices.gpus)


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """`timeout 200 qmoe-doctor ...` sends SIGTERM: end as Ctrl-C does, so that the launch in
    flight kills its ranks (each in a session of its own) instead of orphaning them on the GPUs."""
    if threading.current_thread() is not threading.main_thread():  # handlers live there only
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch_parallel(plan: ParallelPlan, *, log_dir: Path | None) -> ParallelReport:
    """Run the plan with progress on stderr; a kernel no rank could import is a usage error."""
    with _sigterm_interrupts():
        report = run_parallel(plan, log_dir=log_dir, on_event=parallel_lines())
    bad = kernel_import_failure(report)
    if bad is not None:
        raise CliError(
            f"the kernel {plan.kernel!r} could not be used: {bad.error_message}", hint=KERNEL_PARAGRAPH
        )
    return report


def exit_code(report: ParallelReport) -> ExitCode:
    if nothing_ran(report):
        return ExitCode.CHECK_BROKEN
    return ExitCode.HEALTHY if report.healthy else ExitCode.FAULT


def run_and_report(
    *,
    modes: str,
    kernel: str,
    gpus: str | None,
    cpu: bool,
    options: ParallelOptions,
    json_out: bool,
    save: Path | None,
    log_dir: Path | None,
) -> NoReturn:
    """``parallel`` and ``scan --parallel``: plan, run, save, render, exit."""
    plan = plan_runs(modes=modes, kernel=kernel, gpus=gpus, cpu=cpu, options=options)
    report = launch_parallel(plan, log_dir=log_dir)
    deliver(
        json_document("parallel", report_json(report)),
        lambda out: render_parallel(out, report),
        json_out=json_out,
        save=save,
        log_dir=report.log_dir,
    )
    raise typer.Exit(exit_code(report))


__all__ = ["CPU_RANKS", "exit_code", "launch_parallel", "plan_runs", "run_and_report"]
