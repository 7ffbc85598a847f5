"""`qmoe-doctor repro`: reproduce the failure the way users hit it, shrink it, and name it.

A skin over :func:`qmoe_doctor.workflows.repro.run_repro` (docs/repro.md): validate, pick the GPUs, call,
render, exit with a documented code.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from qmoe_doctor.cli.commands.parallel import launch_parallel, option_given, prepare_parallel, render_parallel
from qmoe_doctor.cli.commands.scan import check_kernel_ref
from qmoe_doctor.cli.output import emit_json, stderr_console, stdout_console
from qmoe_doctor.cli.render.scan import diagnosis_panel
from qmoe_doctor.core import knobs
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.shapes import PRESETS
from qmoe_doctor.machine.inventory import GpuInfo, GpuSelectionError, collect_inventory, select_gpus
from qmoe_doctor.reports.parallel_script import PARALLEL_SCRIPT_CAUSES, script_specs, write_parallel_scripts
from qmoe_doctor.workflows.parallel import DEFAULT_RUN_TIMEOUT_S, ParallelOptions, nothing_ran
from qmoe_doctor.workflows.parallel import report_json as parallel_report_json
from qmoe_doctor.workflows.repro import (
    ReproOptions,
    ReproReport,
    plan_repro,
    report_json,
    run_repro,
    shrink_cells,
)
from qmoe_doctor.workflows.scan import KernelRefError

KERNEL_HELP = (
    "Kernel to reproduce with, called as fn(x, w, m_sizes) -> y: 'builtin' (ours), 'specimen:NAME' "
    "(see `qmoe-doctor specimens`), 'module.path:function' or 'path/to/file.py:function'."
)
NEED_TWO_GPUS = (
    "repro needs two CUDA GPUs: it splits a model's layers across GPUs the way "
    'device_map="auto" does, which is where these faults happen'
)
NO_GPU_HINT = "`qmoe-doctor scan --cpu` runs the single-device conditions without a GPU."
KERNEL_PARAGRAPH = (
    "qmoe-doctor calls kernels as fn(x, w, m_sizes) -> y with x (M, K) rows sorted by expert, "
    "w (E, N, K) and m_sizes (E,); pass --kernel module:function or path/to/file.py:function "
    "naming such a callable (the probe child must be able to import it: same Python, same "
    "working directory)."
)


def _select(gpus: str | None) -> tuple[GpuInfo, ...]:
    """The GPUs to split the model over, in order; exits 2 when there are not two."""
    err = stderr_console()
    inv = collect_inventory()
    if not inv.gpus:
        why = inv.nvml_error or "NVML lists none"
        err.print(
            Text(f"error: {NEED_TWO_GPUS}; this machine has no GPU that NVML can see ({why}).", style="red"),
            soft_wrap=True,
        )
        err.print(NO_GPU_HINT, soft_wrap=True)
        raise typer.Exit(ExitCode.USAGE)
    try:
        selected = select_gpus(inv, gpus)
    except GpuSelectionError as exc:
        err.print(Text(f"error: {exc}", style="red"), soft_wrap=True)
        raise typer.Exit(ExitCode.USAGE) from None
    if gpus is None:
        selected = selected[:2]  # the default: the first two, in NVML order
    if len(selected) < 2:
        what = f"--gpus {gpus} names one" if gpus else "this machine has one"
        err.print(
            Text(f"error: {NEED_TWO_GPUS}; {what} ({selected[0].describe()}).", style="red"), soft_wrap=True
        )
        if not gpus:
            err.print("`qmoe-doctor scan` runs the single-GPU conditions on it.", soft_wrap=True)
        raise typer.Exit(ExitCode.USAGE)
    return selected


def repro_command(
    ctx: typer.Context,
    gpus: str | None = typer.Option(
        None,
        "--gpus",
        help=(
            "NVML / nvidia-smi indices of the GPUs to split the model over, in order, e.g. 0,1 (default: "
            "the first two; with --parallel: one rank per GPU, default all)."
        ),
    ),
    parallel: str | None = typer.Option(
        None,
        "--parallel",
        help=(
            "Instead, reproduce per-rank faults: run these parallel modes (dp,pp,tp,ep; torchrun, one rank "
            "per GPU), diagnose each rank, and write a torchrun script for each device-never-set or "
            "invalid-routing diagnosis."
        ),
    ),
    cpu: bool = typer.Option(
        False,
        "--cpu",
        help="With --parallel: run the ranks as CPU processes (gloo, Triton interpreter) even when GPUs exist.",
    ),
    kernel: str = typer.Option("builtin", "--kernel", "-k", help=KERNEL_HELP),
    preset: str = typer.Option(
        "tiny",
        "--preset",
        help=f"Shape of the MoE blocks (the pipeline's, or --parallel's): {', '.join(PRESETS)}.",
    ),
    layers: int | None = typer.Option(
        None,
        "--layers",
        min=2,
        help="Layers of the pipeline, or of --parallel's pp stack (default: two per GPU).",
    ),
    steps: int = typer.Option(
        2, "--steps", min=1, help="Training steps (forward, backward, update); not with --parallel."
    ),
    out: Path = typer.Option(Path("."), "--out", help="Directory for the standalone repro script(s)."),
    json_out: bool = typer.Option(False, "--json", help="Write the versioned JSON report to stdout."),
    no_sanitizer: bool = typer.Option(
        False, "--no-sanitizer", help="Do not confirm access faults under compute-sanitizer."
    ),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="Where probe workers write their logs (default: a temp dir)."
    ),
    timeout: float = typer.Option(
        knobs.DEFAULT_PROBE_TIMEOUT_S,
        "--timeout",
        min=1.0,
        help=f"Seconds each probe may take (with --parallel: each launch; default {DEFAULT_RUN_TIMEOUT_S:.0f}).",
    ),
) -> None:
    """Reproduce a multi-GPU failure the way users hit it (MoE layers split over the GPUs, the
    first GPU current, forward and backward), shrink it to the fewest conditions that still
    fail, name the cause, confirm access faults under compute-sanitizer, and write a
    standalone repro script.

    With --parallel dp,pp,tp,ep: launch the ranks with torchrun (the tiny preset, no timing),
    check each rank against one device, diagnose per rank (device-never-set: a rank that never
    made its GPU current; invalid-routing: global expert ids reaching a rank's local weight
    stack), and write a script per such cause that reproduces it rank by rank under
    `torchrun --nproc-per-node W`. Without GPUs (or with --cpu) the ranks are CPU processes.

    Exit codes: 0 nothing failed, 1 fault reproduced, 2 usage error (including fewer than two
    GPUs), 4 the probes could not run.
    """
    err = stderr_console()
    if preset not in PRESETS:
        raise typer.BadParameter(
            f"unknown preset {preset!r}; known: {', '.join(PRESETS)}", param_hint="--preset"
        )
    if parallel is not None:
        if option_given(ctx, "steps"):
            raise typer.BadParameter(
                "sets the pipeline repro's training steps; --parallel runs one checked step per mode",
                param_hint="--steps",
            )
        options = ParallelOptions(
            preset=preset,
            layers=layers,
            steps=0,
            warmup=0,
            baseline=False,
            timeout_s=timeout if option_given(ctx, "timeout") else DEFAULT_RUN_TIMEOUT_S,
        )
        repro_parallel(
            modes=parallel,
            kernel=kernel,
            gpus=gpus,
            cpu=cpu,
            options=options,
            out=out,
            json_out=json_out,
            log_dir=log_dir,
        )
    if cpu:
        raise typer.BadParameter(
            "runs the ranks of --parallel on the CPU; the pipeline repro needs two GPUs "
            "(`qmoe-doctor scan --cpu` runs the single-device conditions without one)",
            param_hint="--cpu",
        )
    check_kernel_ref(kernel)
    selected = _select(gpus)
    opts = ReproOptions(
        preset=preset, layers=layers, steps=steps, sanitizer=not no_sanitizer, timeout_s=timeout
    )
    if opts.n_layers(len(selected)) < len(selected):
        raise typer.BadParameter(
            f"{layers} layers cannot span {len(selected)} GPUs; give at least one layer per GPU",
            param_hint="--layers",
        )
    plan = plan_repro(kernel, selected, opts)

    def progress(t: float, text: str) -> None:
        err.print(Text.assemble((f"[{t:6.1f} s] ", "dim"), text))

    try:
        report = run_repro(plan, opts, selected, log_dir=log_dir, out_dir=out, on_progress=progress)
    except KernelRefError as exc:
        err.print(Text(f"error: the kernel {kernel!r} could not be used: {exc}", style="red"), soft_wrap=True)
        err.print(KERNEL_PARAGRAPH, soft_wrap=True)
        raise typer.Exit(ExitCode.USAGE) from None
    if json_out:
        emit_json("repro", report_json(report))
    else:
        render_repro(stdout_console(), report)
    if report.could_not_run:
        raise typer.Exit(ExitCode.CHECK_BROKEN)
    raise typer.Exit(ExitCode.FAULT if report.faulty else ExitCode.HEALTHY)


def repro_parallel(
    *,
    modes: str,
    kernel: str,
    gpus: str | None,
    cpu: bool,
    options: ParallelOptions,
    out: Path,
    json_out: bool,
    log_dir: Path | None,
) -> None:
    """``repro --parallel``: plan and run the modes as ``scan --parallel`` does, render, write a
    per-rank script for each scriptable diagnosis; always ends with ``typer.Exit``."""
    err = stderr_console()
    plan = prepare_parallel(modes=modes, kernel=kernel, gpus=gpus, cpu=cpu, options=options)
    if not plan.runs:
        why = "; ".join(plan.skipped) or "no mode fits the selected devices"
        err.print(Text(f"error: nothing to run: {why}", style="red"), soft_wrap=True)
        raise typer.Exit(ExitCode.USAGE)
    report = launch_parallel(plan, log_dir=log_dir)
    could_not_run = nothing_ran(report)
    written = (
        []
        if could_not_run
        else write_parallel_scripts(script_specs(report, plan), out, cpu_tier=plan.tier == "cpu")
    )
    others = sorted({d.cause for d in report.diagnoses} - set(PARALLEL_SCRIPT_CAUSES))
    if json_out:
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
        emit_json("repro-parallel", body)
    else:
        console = stdout_console()
        render_parallel(console, report)
        for w in written:
            console.print(
                Text.assemble(("script ", "dim"), (w.path, "bold"), f"   ({w.cause})"), soft_wrap=True
            )
            console.print(Text.assemble(("  run: ", "dim"), w.command), soft_wrap=True)
            if w.command != w.gpu_command:
                console.print(Text.assemble(("  on GPUs: ", "dim"), w.gpu_command), soft_wrap=True)
            elif w.cpu_command:
                console.print(Text.assemble(("  on CPU ranks: ", "dim"), w.cpu_command), soft_wrap=True)
        if written:
            console.print(
                Text(
                    "  each rank prints PASS or FAIL; exit 1 = reproduced (torchrun names the rank), 0 = passed, "
                    "2 = cannot run here",
                    style="dim",
                ),
                soft_wrap=True,
            )
        for cause in others:
            console.print(
                Text.assemble(
                    ("script ", "dim"),
                    f"none for {cause}: per-rank scripts cover {' and '.join(PARALLEL_SCRIPT_CAUSES)}; "
                    "the diagnosis' repro line reruns it",
                ),
                soft_wrap=True,
            )
        if report.unexplained and not report.diagnoses:
            console.print(
                Text.assemble(("script ", "dim"), "none: no cause named for the failing rank(s)"),
                soft_wrap=True,
            )
    if could_not_run:
        raise typer.Exit(ExitCode.CHECK_BROKEN)
    raise typer.Exit(ExitCode.HEALTHY if report.healthy else ExitCode.FAULT)


def render_repro(console: Console, report: ReproReport) -> None:
    """The result, for a terminal: the pipeline, the shrink, the verdict, its confirmation."""
    console.print(
        Text.assemble(
            ("kernel ", "dim"),
            (report.kernel, "bold"),
            ("   GPUs ", "dim"),
            ", ".join(str(g) for g in report.gpus),
            ("   shrink pair ", "dim"),
            f"GPU {report.pair[0]} -> GPU {report.pair[1]}",
        )
    )
    if report.pipeline is not None:
        style = "bold red" if report.pipeline.failed else "green"
        word = "FAILED" if report.pipeline.failed else "passed"
        console.print(Text.assemble(("pipeline ", "dim"), (word, style), ": ", report.pipeline.describe()))
    cells = shrink_cells(report)
    if cells:
        console.print(Text.assemble(("shrink ", "dim"), ", ".join(f"{pid} {label}" for pid, label in cells)))
    for d in report.diagnoses:
        console.print(diagnosis_panel(d))
    for note in report.explanations:
        console.print(Text.assemble(("note: ", "yellow"), note))
    for e in report.unexplained:
        console.print(Text.assemble(("unexplained: ", "red"), e.probe_id, " ", e.label, ": ", e.detail))
    for note in report.notes:
        console.print(Text.assemble(("note: ", "yellow"), note))
    if report.minimal:
        console.print(Text.assemble(("minimal failing probe ", "dim"), (report.minimal[0], "bold cyan")))
    s = report.sanitizer
    console.print(Text.assemble(("sanitizer ", "dim"), (s.status, "bold"), ": ", s.reason))
    if s.first_error:
        console.print(Text.assemble(("  first error ", "dim"), s.first_error))
    if s.touched:
        console.print(Text.assemble(("  bad access: ", "dim"), (s.touched, "bold")))
    for what, n in s.tensors_hit.items():
        console.print(Text(f"  {n} address(es) nearest {what}", style="dim"))
    if s.xid is not None and s.xid.xids:
        for line in s.xid_evidence:
            console.print(Text(f"  {line}", style="dim"))
    if s.log_path:
        console.print(Text(f"  log: {s.log_path}", style="dim"))
    if report.script:
        console.print(Text.assemble(("script ", "dim"), (report.script, "bold"), "   ", report.script_note))
    elif report.faulty:
        console.print(Text.assemble(("script ", "dim"), report.script_note))
    if not report.faulty:
        tried = ", ".join(report.tried)
        console.print(
            Text(
                f"nothing failed: tried {tried}. `qmoe-doctor scan --kernel {report.kernel}` runs every "
                "condition on every GPU pair.",
                style="bold green",
            )
        )
    verdict = report.verdict or ("no cause named" if report.faulty else "healthy")
    console.print(
        Text.assemble(
            ("verdict ", "dim"),
            (verdict, "bold red" if report.faulty else "bold green"),
            ("   time to verdict ", "dim"),
            f"{report.time_to_verdict_s:.1f} s",
            ("   total ", "dim"),
            f"{report.wall_s:.1f} s",
        )
    )
    console.print(Text(f"logs: {report.log_dir}", style="dim"))
