"""`qmoe-doctor repro`: reproduce the failure the way users hit it, shrink it, and name it.

A skin over :func:`qmoe_doctor.workflows.repro.run_repro` (docs/repro.md): validate, pick the GPUs,
call, render, exit with a documented code. ``--parallel`` goes through
:mod:`qmoe_doctor.cli.parallel_runs` and writes a per-rank script for each scriptable diagnosis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.devices import Need, select_devices
from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.cli.output import check_outputs, deliver, stderr_console
from qmoe_doctor.cli.parallel_runs import exit_code, launch_parallel, plan_runs
from qmoe_doctor.cli.render.parallel import render_parallel, render_scripts
from qmoe_doctor.cli.render.repro import render_repro
from qmoe_doctor.core import knobs
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.options import DEFAULT_RUN_TIMEOUT_S, ParallelOptions, ReproOptions
from qmoe_doctor.reports.json import json_document
from qmoe_doctor.reports.parallel_script import script_specs, write_parallel_scripts
from qmoe_doctor.workflows.parallel import nothing_ran
from qmoe_doctor.workflows.parallel import report_json as parallel_report_json
from qmoe_doctor.workflows.repro import plan_repro, report_json, run_repro

NEED_TWO_GPUS = (
    "repro needs two CUDA GPUs: it splits a model's layers across GPUs the way "
    'device_map="auto" does, which is where these faults happen'
)


def repro_command(
    ctx: typer.Context,
    gpus: opt.GpusOpt = None,
    parallel: Annotated[
        str | None,
        typer.Option(
            "--parallel",
            help="Instead, reproduce per-rank faults: run these parallel modes (dp,pp,tp,ep; torchrun, one rank "
            "per GPU), diagnose each rank, and write a torchrun script for each device-never-set or "
            "invalid-routing diagnosis.",
        ),
    ] = None,
    cpu: opt.CpuOpt = False,
    kernel: opt.KernelOpt = "builtin",
    preset: opt.PresetOpt = "tiny",
    layers: Annotated[
        int | None,
        typer.Option(
            "--layers",
            min=2,
            help="Layers of the pipeline, or of --parallel's pp stack (default: two per GPU).",
        ),
    ] = None,
    steps: Annotated[
        int,
        typer.Option(
            "--steps", min=1, help="Training steps (forward, backward, update); not with --parallel."
        ),
    ] = 2,
    out: Annotated[
        Path,
        typer.Option("--out", help="Folder for the standalone repro script(s) (checked before the run)."),
    ] = Path("."),
    json_out: opt.JsonOpt = False,
    save: opt.SaveOpt = None,
    no_sanitizer: Annotated[
        bool, typer.Option("--no-sanitizer", help="Do not confirm access faults under compute-sanitizer.")
    ] = False,
    log_dir: opt.LogDirOpt = None,
    timeout: opt.TimeoutOpt = opt.DEFAULT_TIMEOUT_S,
) -> None:
    """Reproduce a multi-GPU failure the way users hit it (MoE layers split over the GPUs, the
    first GPU current, forward and backward), shrink it to the fewest conditions that still
    fail, name the cause, confirm access faults under compute-sanitizer, and write a
    standalone repro script. --gpus: the GPUs to split the model over, in order (default: the
    first two; with --parallel: one rank per GPU, default all).

    With --parallel dp,pp,tp,ep: launch the ranks with torchrun (the tiny preset, no timing),
    check each rank against one device, diagnose per rank, and write a script per
    device-never-set or invalid-routing diagnosis that reproduces it rank by rank under
    `torchrun --nproc-per-node W`. Without GPUs (or with --cpu) the ranks are CPU processes.

    Exit codes: 0 nothing failed, 1 fault reproduced, 2 usage error (including fewer than two
    GPUs), 4 the probes could not run, 130 interrupted (143 by SIGTERM).
    """
    ref = opt.kernel_ref(kernel)
    opt.preset(preset)
    check_outputs(files={"--save": save}, dirs={"--out": out, "--log-dir": log_dir})
    if not no_sanitizer and parallel is None:
        knobs.compute_sanitizer()  # a wrong $QMOE_DOCTOR_COMPUTE_SANITIZER: exit 2 now, not "not found" at the end
    if parallel is not None:
        if opt.given(ctx, "steps"):
            raise CliError(
                "--steps sets the pipeline repro's training steps; --parallel runs one checked step per mode"
            )
        timeout_s = timeout if opt.given(ctx, "timeout") else DEFAULT_RUN_TIMEOUT_S
        options = ParallelOptions(
            preset=preset, layers=layers, steps=0, warmup=0, baseline=False, timeout_s=timeout_s
        )
        repro_parallel(
            parallel, str(ref), gpus, cpu, options, out=out, json_out=json_out, save=save, log_dir=log_dir
        )
    if cpu:
        raise CliError(
            "--cpu runs the ranks of --parallel on the CPU; the pipeline repro needs two GPUs "
            "(`qmoe-doctor scan --cpu` runs the single-device conditions without one)"
        )
    need = Need(
        count=2,
        why=NEED_TWO_GPUS,
        hint="`qmoe-doctor scan --cpu` runs the single-device conditions without a GPU.",
        few_hint="`qmoe-doctor scan` runs the single-GPU conditions on it.",
    )
    devices = select_devices(gpus, need=need, first=2)
    opts = ReproOptions(
        preset=preset, layers=layers, steps=steps, sanitizer=not no_sanitizer, timeout_s=timeout
    )
    if opts.n_layers(len(devices.gpus)) < len(devices.gpus):
        raise CliError(
            f"--layers {layers}: cannot span {len(devices.gpus)} GPUs; give at least one layer per GPU"
        )
    plan = plan_repro(str(ref), devices.gpus, opts)
    err = stderr_console()

    def progress(t: float, text: str) -> None:
        err.print(Text.assemble((f"[{t:6.1f} s] ", "dim"), text), soft_wrap=True)

    report = run_repro(plan, opts, devices.gpus, log_dir=log_dir, out_dir=out, on_progress=progress)
    deliver(
        json_document("repro", report_json(report)),
        lambda out: render_repro(out, report),
        json_out=json_out,
        save=save,
        log_dir=report.log_dir,
    )
    if report.could_not_run:
        raise typer.Exit(ExitCode.CHECK_BROKEN)
    raise typer.Exit(ExitCode.FAULT if report.faulty else ExitCode.HEALTHY)


def repro_parallel(
    modes: str,
    kernel: str,
    gpus: str | None,
    cpu: bool,
    options: ParallelOptions,
    *,
    out: Path,
    json_out: bool,
    save: Path | None,
    log_dir: Path | None,
) -> NoReturn:
    """``repro --parallel``: plan and run the modes, write a per-rank script for each
    scriptable diagnosis, render, exit."""
    plan = plan_runs(modes=modes, kernel=kernel, gpus=gpus, cpu=cpu, options=options)
    if not plan.runs:
        raise CliError(f"nothing to run: {'; '.join(plan.skipped) or 'no mode fits the selected devices'}")
    report = launch_parallel(plan, log_dir=log_dir)
    written = (
        []
        if nothing_ran(report)
        else write_parallel_scripts(script_specs(report), out, cpu_tier=plan.tier == "cpu")
    )
    body = parallel_report_json(report)
    body["scripts"] = [
        {
            "cause": w.cause,
            "path": w.path,
            "command": w.command,
            "gpu_command": w.gpu_command,
            "cpu_command": w.cpu_command,
        }
        for w in written
    ]
    body["faulty"] = not report.healthy
    def render(console: Console) -> None:
        render_parallel(console, report)
        render_scripts(console, report, written)

    deliver(json_document("repro-parallel", body), render, json_out=json_out, save=save, log_dir=report.log_dir)
    raise typer.Exit(exit_code(report))
