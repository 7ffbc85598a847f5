"""`qmoe-doctor scan`: run a kernel under controlled conditions and name what breaks it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.devices import select_devices
from qmoe_doctor.cli.errors import CliError, interrupt_code, say_kept_logs
from qmoe_doctor.cli.output import (
    check_outputs,
    deliver,
    note,
    save_document,
    warning,
)
from qmoe_doctor.cli.parallel_runs import run_and_report
from qmoe_doctor.cli.render.progress import probe_bar
from qmoe_doctor.cli.render.scan import could_not_run, render_report
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.launch_configs import parse_config
from qmoe_doctor.core.options import DEFAULT_RUN_TIMEOUT_S, ParallelOptions, ScanOptions
from qmoe_doctor.core.records import to_jsonable
from qmoe_doctor.core.reports import ScanReport
from qmoe_doctor.reports.json import json_document
from qmoe_doctor.workflows.check import kernel_lint
from qmoe_doctor.workflows.scan import plan_scan, report_json, run_scan

#: What ``--parallel`` cannot honour: the scan's own cells (``qmoe-doctor parallel`` has the knobs).
SCAN_ONLY = ("rows", "only", "sweeps", "configs", "autotune", "pairs_at_once")


def scan_command(
    ctx: typer.Context,
    kernel: opt.KernelOpt = "builtin",
    gpus: opt.GpusOpt = None,
    preset: opt.PresetOpt = opt.DEFAULT_PRESET,
    rows: opt.RowsOpt = 4096,
    only: opt.OnlyOpt = None,
    cpu: opt.CpuOpt = False,
    json_out: opt.JsonOpt = False,
    save: opt.SaveOpt = None,
    log_dir: opt.LogDirOpt = None,
    timeout: opt.TimeoutOpt = opt.DEFAULT_TIMEOUT_S,
    sweeps: Annotated[
        bool,
        typer.Option("--sweeps/--no-sweeps", help="Offset/stride and launch-config sweeps on the first GPU."),
    ] = True,
    configs: Annotated[
        str | None,
        typer.Option(
            "--configs",
            help="Launch configs to pin, comma-separated BMxBNxBK-wW-sS (default: the kernel's own table).",
        ),
    ] = None,
    autotune: opt.AutotuneOpt = opt.DEFAULT_AUTOTUNE,
    pairs_at_once: Annotated[
        int | None,
        typer.Option(
            "--pairs-at-once",
            min=1,
            help="GPU pairs scanned at the same time (default: every pair of a round that shares no GPU, "
            "4 on 8 GPUs). 1 scans them one after another. The report is the same, in the same order.",
        ),
    ] = None,
    parallel: Annotated[
        str | None,
        typer.Option(
            "--parallel",
            help="Instead, run the MoE block under these parallel modes (dp,pp,tp,ep), as `qmoe-doctor parallel "
            "--modes` does with its defaults; refused with --rows, --only, --sweeps, --configs, --autotune or "
            "--pairs-at-once.",
        ),
    ] = None,
) -> None:
    """Run the kernel under controlled placements, peer-access states and stream orderings,
    each probe in an isolated process, and name the cause of every failure.

    Exit codes: 0 healthy, 1 fault diagnosed, 2 usage error, 4 the scan could not run (nothing
    ran, or no probe child could start), 130 interrupted (143 by SIGTERM).
    """
    ref = opt.kernel_ref(kernel)
    opt.preset(preset)
    check_outputs(files={"--save": save}, dirs={"--log-dir": log_dir})
    if parallel is not None:
        ignored = [f"--{name.replace('_', '-')}" for name in SCAN_ONLY if opt.given(ctx, name)]
        if ignored:
            raise CliError(
                f"--parallel runs the parallel modes, not the scan's cells: {', '.join(ignored)} would be ignored"
            )
        options = ParallelOptions(
            preset=preset if opt.given(ctx, "preset") else None,
            timeout_s=timeout if opt.given(ctx, "timeout") else DEFAULT_RUN_TIMEOUT_S,
        )
        run_and_report(
            modes=parallel,
            kernel=str(ref),
            gpus=gpus,
            cpu=cpu,
            options=options,
            json_out=json_out,
            save=save,
            log_dir=log_dir,
        )
    conditions = opt.conditions(only)
    if cpu and opt.given(ctx, "rows"):
        raise CliError("--rows sets the GPU cells' rows; --cpu runs the CPU tier's own small shape")
    try:
        pinned = tuple(parse_config(c) for c in configs.split(",") if c.strip()) if configs else ()
    except ValueError as exc:
        raise CliError(f"--configs {configs!r}: {exc}") from None
    devices = select_devices(gpus, cpu=cpu, cpu_fallback="running the CPU tier")
    if devices.fallback and opt.given(ctx, "rows"):
        warning("--rows is ignored: the CPU tier runs its own small shape")
    scan_opts = ScanOptions(
        preset=preset,
        rows=rows,
        conditions=conditions,
        timeout_s=timeout,
        sweeps=sweeps,
        launch_configs=pinned,
        autotune=autotune,
        pairs_at_once=pairs_at_once,
    )
    plan = plan_scan(str(ref), devices.gpus, scan_opts)
    lint, lint_notes = kernel_lint(str(ref))  # notes only: the scan's verdict is its cells'
    so_far: list[ScanReport] = []

    def on_progress(report: ScanReport) -> None:  # --save holds every finished session
        so_far[:] = [report]
        if save is not None:
            save_document(
                save,
                json_document("scan", report_json(report)),
                fallback_dir=Path(report.log_dir) if report.log_dir else None,
            )

    try:
        with probe_bar(len(plan.specs)) as on_event:
            report = run_scan(
                plan,
                gpus=devices.indices,
                log_dir=log_dir,
                on_event=on_event,
                on_progress=on_progress,
                inventory=to_jsonable(devices.inventory) if devices.inventory else None,
                audit_presets=(preset, scan_opts.boundary_preset),
                lint=lint,
                lint_notes=lint_notes,
            )
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM from a job's time limit (core.events.Interrupted)
        if save is not None and so_far:
            note(
                f"interrupted: the report so far ({len(so_far[0].outcomes)} probes, complete: false) is in {save}"
            )
        else:
            note("interrupted: nothing was saved (--save keeps the report of every finished session)")
        say_kept_logs(exc)
        raise typer.Exit(interrupt_code(exc)) from None
    deliver(
        json_document("scan", report_json(report)),
        lambda out: render_report(out, report),
        json_out=json_out,
        save=save,
        log_dir=report.log_dir,
    )
    if could_not_run(report) is not None:
        raise typer.Exit(ExitCode.CHECK_BROKEN)
    raise typer.Exit(ExitCode.HEALTHY if report.healthy else ExitCode.FAULT)
