"""`qmoe-doctor scan`: run a kernel under controlled conditions and name what breaks it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qmoe_doctor.cli.output import emit_json, stderr_console, stdout_console
from qmoe_doctor.cli.render.scan import render_report
from qmoe_doctor.core import knobs
from qmoe_doctor.core.conditions import DEFAULT_CONDITIONS
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.launch_configs import parse_config
from qmoe_doctor.core.options import ScanOptions
from qmoe_doctor.core.records import Condition, to_jsonable
from qmoe_doctor.core.shapes import PRESETS
from qmoe_doctor.isolate.worker_pool import Event, EventKind
from qmoe_doctor.machine.inventory import GpuSelectionError, Inventory, collect_inventory, select_gpus
from qmoe_doctor.plan.scan import plan_scan
from qmoe_doctor.workflows.scan import (
    KernelRefError,
    ScanReport,
    all_spawn_failures,
    nothing_ran,
    report_json,
    run_scan,
)

KERNEL_HELP = (
    "Kernel to scan, called as fn(x, w, m_sizes) -> y: 'builtin' (ours), 'specimen:NAME' "
    "(see `qmoe-doctor specimens`), 'module.path:function' or 'path/to/file.py:function'."
)


def parse_conditions(text: str | None) -> frozenset[Condition]:
    if not text:
        return DEFAULT_CONDITIONS
    chosen = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            chosen.add(Condition(part))
        except ValueError:
            known = ", ".join(c.value for c in sorted(DEFAULT_CONDITIONS, key=lambda c: c.value))
            raise typer.BadParameter(f"unknown condition {part!r}; known: {known}") from None
    return frozenset(chosen)


def check_kernel_ref(ref: str) -> None:
    """What the parent can check without importing the kernel (the child checks the rest)."""
    if ref in ("builtin", "torch:grouped_mm"):
        return
    if ":" not in ref:
        raise typer.BadParameter(
            f"{ref!r}: expected module:function or path/to/file.py:function", param_hint="--kernel"
        )
    where, _, name = ref.rpartition(":")
    if where == "specimen":
        from qmoe_doctor.core.specimens import get_specimen

        try:
            get_specimen(name)
        except KeyError as exc:
            raise typer.BadParameter(str(exc.args[0]), param_hint="--kernel") from None
    elif where.endswith(".py") and not Path(where).is_file():
        raise typer.BadParameter(f"kernel file {where!r} does not exist", param_hint="--kernel")


def scan_command(
    ctx: typer.Context,
    kernel: str = typer.Option("builtin", "--kernel", "-k", help=KERNEL_HELP),
    gpus: str | None = typer.Option(
        None,
        "--gpus",
        help="NVML / nvidia-smi GPU indices, e.g. 0,1 (default: all). The report says which CUDA ordinal each became.",
    ),
    preset: str = typer.Option("qwen3-30b-a3b", "--preset", help=f"Shape preset: {', '.join(PRESETS)}."),
    rows: int = typer.Option(4096, "--rows", min=1, help="Rows (tokens x top-k) of the main cells."),
    only: str | None = typer.Option(None, "--only", help="Comma-separated conditions to run (default: all)."),
    cpu: bool = typer.Option(
        False, "--cpu", help="Run the CPU tier (Triton interpreter) even when GPUs exist."
    ),
    json_out: bool = typer.Option(False, "--json", help="Write the versioned JSON report to stdout."),
    save: Path | None = typer.Option(None, "--save", help="Also write the JSON report to this file."),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="Where probe workers write their logs (default: a temp dir)."
    ),
    timeout: float = typer.Option(
        knobs.DEFAULT_PROBE_TIMEOUT_S, "--timeout", min=1.0, help="Seconds each probe may take."
    ),
    sweeps: bool = typer.Option(
        True, "--sweeps/--no-sweeps", help="Offset/stride and launch-config sweeps on the first GPU."
    ),
    configs: str | None = typer.Option(
        None,
        "--configs",
        help="Launch configs to pin, comma-separated BMxBNxBK-wW-sS (default: the kernel's own table).",
    ),
    parallel: str | None = typer.Option(
        None,
        "--parallel",
        help="Instead, run the MoE block under these parallel modes (dp,pp,tp,ep), each rank against one GPU; `qmoe-doctor parallel --help` has every knob.",
    ),
) -> None:
    """Run the kernel under controlled placements, peer-access states and stream orderings,
    each probe in an isolated process, and name the cause of every failure.

    Exit codes: 0 healthy, 1 fault diagnosed, 2 usage error, 4 the scan could not run.
    """
    if parallel is not None:
        from qmoe_doctor.cli.commands.parallel import run_from_scan

        run_from_scan(
            ctx,
            parallel=parallel,
            kernel=kernel,
            gpus=gpus,
            preset=preset,
            cpu=cpu,
            json_out=json_out,
            save=save,
            log_dir=log_dir,
            timeout=timeout,
        )
    err = stderr_console()
    if preset not in PRESETS:
        raise typer.BadParameter(
            f"unknown preset {preset!r}; known: {', '.join(PRESETS)}", param_hint="--preset"
        )
    check_kernel_ref(kernel)
    conditions = parse_conditions(only)
    inv: Inventory | None = None
    selected: tuple[int, ...] = ()
    planned = []
    if not cpu:
        inv = collect_inventory()
        if inv.gpus:
            try:
                planned = list(select_gpus(inv, gpus))
            except GpuSelectionError as exc:
                err.print(f"[red]error:[/] {exc}")
                raise typer.Exit(ExitCode.USAGE) from None
            selected = tuple(g.index for g in planned)
        elif gpus:
            err.print(
                f"[red]error:[/] --gpus {gpus} given but no GPU is visible ({inv.nvml_error or 'NVML found none'})"
            )
            raise typer.Exit(ExitCode.USAGE)
        else:
            err.print(
                f"[yellow]no GPU found[/] ({inv.nvml_error or 'NVML lists none'}): running the CPU tier"
            )
    try:
        pinned = tuple(parse_config(c) for c in configs.split(",") if c.strip()) if configs else ()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--configs") from None
    opts = ScanOptions(
        preset=preset,
        rows=rows,
        conditions=conditions,
        timeout_s=timeout,
        sweeps=sweeps,
        launch_configs=pinned,
    )
    plan = plan_scan(kernel, planned, opts)
    total = len(plan.specs)
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task("starting probe workers", total=total)

        def on_event(event: Event) -> None:
            if event.kind is EventKind.OUTCOME and event.outcome is not None:
                progress.advance(task)
                o = event.outcome
                err.print(
                    f"  {o.probe_id}: {o.status}" + (f" ({o.error_kind})" if o.error_kind else ""),
                    style="dim",
                )
            elif event.kind in (EventKind.PROBE_STARTED, EventKind.CRUMB) and event.probe_id:
                phase = f" [{event.phase}]" if event.phase else ""
                progress.update(task, description=f"{event.probe_id}{phase}")
            elif event.kind is EventKind.WORKER_RESTARTED:
                err.print(f"  worker replaced: {event.detail}", style="yellow")

        partial: list[ScanReport] = []

        def on_progress(so_far: ScanReport) -> None:
            partial[:] = [so_far]
            if save is not None:
                _write_report(save, so_far)

        try:
            report = run_scan(
                plan,
                gpus=selected,
                log_dir=log_dir,
                on_event=on_event,
                inventory=to_jsonable(inv) if inv is not None else None,
                audit_presets=(preset, opts.boundary_preset),
                on_progress=on_progress,
            )
        except KeyboardInterrupt:
            progress.stop()
            where = (
                f"the report so far ({len(partial[0].outcomes)} probes, complete: false) is in {save}"
                if save is not None and partial
                else "nothing was saved (--save writes the report after every session)"
            )
            err.print(f"[yellow]interrupted[/]: {where}")
            raise typer.Exit(ExitCode.CHECK_BROKEN) from None
        except KernelRefError as exc:
            err.print(
                f"[red]error:[/] the kernel {kernel!r} could not be used: {exc}\n"
                "qmoe-doctor calls kernels as fn(x, w, m_sizes) -> y with x (M, K) rows sorted by "
                "expert, w (E, N, K) and m_sizes (E,); pass --kernel module:function or "
                "path/to/file.py:function naming such a callable."
            )
            raise typer.Exit(ExitCode.USAGE) from None
    if save is not None:
        _write_report(save, report)
    if json_out:
        emit_json("scan", report_json(report))
    else:
        render_report(stdout_console(), report)
    if all_spawn_failures(report) or nothing_ran(report):
        raise typer.Exit(ExitCode.CHECK_BROKEN)
    raise typer.Exit(ExitCode.HEALTHY if report.healthy else ExitCode.FAULT)


def _write_report(path: Path, report: ScanReport) -> None:
    """Write the JSON report whole or not at all (a scan killed mid-write keeps the last one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report_json(report), indent=2, allow_nan=True) + "\n")
    os.replace(tmp, path)
