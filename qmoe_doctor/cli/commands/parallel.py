"""`qmoe-doctor parallel` and `qmoe-doctor scan --parallel MODES`: the MoE block under data,
pipeline, tensor and expert parallelism, each rank checked against one GPU, and timed.

A skin over :mod:`qmoe_doctor.workflows.parallel`: validate, pick the GPUs, call, render, exit with a
documented code. ``scan --parallel`` takes scan's own options (kernel, GPUs, preset, CPU tier,
output); this command also takes every knob of the runs (docs/parallel.md).
"""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.commands.scan import KERNEL_HELP, check_kernel_ref
from qmoe_doctor.cli.output import emit_json, stderr_console, stdout_console
from qmoe_doctor.cli.render.scan import STYLE, diagnosis_panel
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.records import Status
from qmoe_doctor.core.shapes import PRESETS
from qmoe_doctor.machine.inventory import GpuInfo, GpuSelectionError, collect_inventory, select_gpus
from qmoe_doctor.workflows.parallel import (
    DEFAULT_RUN_TIMEOUT_S,
    MODE_OF,
    EventKind,
    ParallelEvent,
    ParallelOptions,
    ParallelPlan,
    ParallelPlanError,
    ParallelReport,
    describe_outcome,
    kernel_import_failure,
    nothing_ran,
    parse_modes,
    plan_parallel,
    report_json,
    run_parallel,
)

MODES_HELP = "Comma-separated modes: dp (DDP), pp (layers over GPUs, one process), tp (tensor), ep (expert)."


def run_parallel_cli(
    *,
    modes: str,
    kernel: str,
    gpus: str | None,
    cpu: bool,
    options: ParallelOptions,
    json_out: bool,
    save: Path | None,
    log_dir: Path | None,
) -> None:
    """Validate, plan, run, render; always ends with ``typer.Exit``."""
    plan = prepare_parallel(modes=modes, kernel=kernel, gpus=gpus, cpu=cpu, options=options)
    report = launch_parallel(plan, log_dir=log_dir)
    if save is not None:
        save.write_text(json.dumps(report_json(report), indent=2, allow_nan=True) + "\n")
    if json_out:
        emit_json("parallel", report_json(report))
    else:
        render_parallel(stdout_console(), report)
    if nothing_ran(report):
        raise typer.Exit(ExitCode.CHECK_BROKEN)
    raise typer.Exit(ExitCode.HEALTHY if report.healthy else ExitCode.FAULT)


def prepare_parallel(
    *, modes: str, kernel: str, gpus: str | None, cpu: bool, options: ParallelOptions
) -> ParallelPlan:
    """Validate the options, pick the GPUs (CPU ranks, with a note, when none is visible) and
    plan the launches; a usage error raises ``typer.BadParameter`` or ``typer.Exit(2)``."""
    err = stderr_console()
    check_kernel_ref(kernel)
    try:
        chosen = parse_modes(modes)
    except ParallelPlanError as exc:
        raise typer.BadParameter(str(exc), param_hint="--parallel") from None
    selected: tuple[GpuInfo, ...] = ()
    if not cpu:
        inv = collect_inventory()
        if inv.gpus:
            try:
                selected = select_gpus(inv, gpus)
            except GpuSelectionError as exc:
                err.print(Text(f"error: {exc}", style="red"), soft_wrap=True)
                raise typer.Exit(ExitCode.USAGE) from None
        elif gpus:
            err.print(
                f"[red]error:[/] --gpus {gpus} given but no GPU is visible ({inv.nvml_error or 'NVML found none'})"
            )
            raise typer.Exit(ExitCode.USAGE)
        else:
            err.print(
                f"[yellow]no GPU found[/] ({inv.nvml_error or 'NVML lists none'}): running the ranks as CPU "
                "processes (gloo, Triton interpreter)"
            )
    try:
        return plan_parallel(kernel, selected, replace(options, modes=chosen), cpu=cpu or not selected)
    except ParallelPlanError as exc:
        err.print(Text(f"error: {exc}", style="red"), soft_wrap=True)
        raise typer.Exit(ExitCode.USAGE) from None


def launch_parallel(plan: ParallelPlan, *, log_dir: Path | None) -> ParallelReport:
    """Run the plan with progress on stderr (SIGTERM ends it as Ctrl-C does); a kernel that
    no rank could import is a usage error (``typer.Exit(2)``)."""
    err = stderr_console()
    kernel = plan.kernel

    def on_event(event: ParallelEvent) -> None:
        if event.kind is EventKind.RUN_STARTED:
            err.print(Text(f"  {event.mode}: {event.detail}", style="dim"), soft_wrap=True)
        elif event.kind is EventKind.RANK_DONE and event.outcome is not None:
            o = event.outcome
            err.print(
                f"  {event.mode} {o.probe_id.split('/')[0]}: {o.status}"
                + (f" ({o.error_kind})" if o.error_kind else ""),
                style="dim",
            )

    # `timeout 200 qmoe-doctor ...` sends SIGTERM: end as Ctrl-C does, so that the launch in
    # flight kills its ranks (each in a session of its own) instead of orphaning them on the GPUs
    main_thread = threading.current_thread() is threading.main_thread()  # handlers live there only
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main_thread else None
    try:
        report = run_parallel(plan, log_dir=log_dir, on_event=on_event)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    bad_kernel = kernel_import_failure(report)
    if bad_kernel is not None:
        err.print(
            Text(
                f"error: the kernel {kernel!r} could not be used: {bad_kernel.error_message}\n"
                "qmoe-doctor calls kernels as fn(x, w, m_sizes) -> y with x (M, K) rows sorted by expert, "
                "w (E, N, K) and m_sizes (E,).",
                style="red",
            ),
            soft_wrap=True,
        )
        raise typer.Exit(ExitCode.USAGE)
    return report


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def option_given(ctx: typer.Context, name: str) -> bool:
    """Whether the user set option ``name`` (not its default). The source enum is compared by
    name: typer vendors its own click in recent versions."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def run_from_scan(
    ctx: typer.Context,
    *,
    parallel: str,
    kernel: str,
    gpus: str | None,
    preset: str,
    cpu: bool,
    json_out: bool,
    save: Path | None,
    log_dir: Path | None,
    timeout: float,
) -> None:
    """``scan --parallel``: scan's options where they apply, the runs' defaults otherwise (the
    CPU tier's preset is tiny unless --preset was given; --timeout is per launch when given)."""
    options = ParallelOptions(
        preset=preset if option_given(ctx, "preset") else None,
        timeout_s=timeout if option_given(ctx, "timeout") else DEFAULT_RUN_TIMEOUT_S,
    )
    run_parallel_cli(
        modes=parallel,
        kernel=kernel,
        gpus=gpus,
        cpu=cpu,
        options=options,
        json_out=json_out,
        save=save,
        log_dir=log_dir,
    )


def parallel_command(
    modes: str = typer.Option("dp,pp,tp,ep", "--modes", "-m", help=MODES_HELP),
    kernel: str = typer.Option("builtin", "--kernel", "-k", help=KERNEL_HELP),
    gpus: str | None = typer.Option(
        None, "--gpus", help="NVML / nvidia-smi indices of this node's GPUs (default: all)."
    ),
    preset: str | None = typer.Option(
        None,
        "--preset",
        help=f"Shape preset: {', '.join(PRESETS)} (default: qwen3-30b-a3b; tiny on the CPU).",
    ),
    tokens: int | None = typer.Option(
        None, "--tokens", min=1, help="Global tokens per step (default: 16384; 16 on the CPU)."
    ),
    steps: int | None = typer.Option(None, "--steps", min=0, help="Timed steps (default: 5; 0 on the CPU)."),
    warmup: int | None = typer.Option(
        None, "--warmup", min=0, help="Untimed steps before timing (default: 1; 0 on the CPU)."
    ),
    layers: int | None = typer.Option(
        None, "--layers", min=1, help="pp: blocks in the stack (default: 2 per GPU)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and inputs (the same in every rank)."),
    backend: str | None = typer.Option(
        None, "--backend", help="nccl or gloo (default: nccl; gloo on the CPU)."
    ),
    baseline: bool | None = typer.Option(
        None,
        "--baseline/--no-baseline",
        help="Time the block on one GPU first, for speedup and efficiency (default: on GPUs).",
    ),
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", min=1, help="Ranks on this node (default: one per GPU; 2 on the CPU)."
    ),
    nnodes: int = typer.Option(
        1, "--nnodes", min=1, help="Nodes; run the same command on each (docs/parallel.md)."
    ),
    rdzv_endpoint: str | None = typer.Option(
        None,
        "--rdzv-endpoint",
        help="HOST:PORT of the c10d rendezvous, the same on every node (default: localhost, a free port).",
    ),
    rdzv_id: str = typer.Option(
        "qmoe-doctor", "--rdzv-id", help="Rendezvous id, the same on every node (the mode is appended)."
    ),
    cpu: bool = typer.Option(
        False, "--cpu", help="Run the ranks as CPU processes (gloo, Triton interpreter) even when GPUs exist."
    ),
    json_out: bool = typer.Option(False, "--json", help="Write the versioned JSON report to stdout."),
    save: Path | None = typer.Option(None, "--save", help="Also write the JSON report to this file."),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="Where runs write their rank files and logs (default: a temp dir)."
    ),
    timeout: float = typer.Option(
        DEFAULT_RUN_TIMEOUT_S, "--timeout", min=1.0, help="Seconds each launch may take."
    ),
) -> None:
    """Run the MoE block (forward and backward) under data, pipeline, tensor and expert
    parallelism, each rank compared with a single-device run of the same weights and inputs,
    timed against one GPU; failures are diagnosed per rank.

    Exit codes: 0 healthy, 1 fault diagnosed, 2 usage error, 4 the runs could not start.
    """
    if backend is not None and backend not in ("nccl", "gloo"):
        raise typer.BadParameter(f"{backend!r}: use nccl or gloo", param_hint="--backend")
    if preset is not None and preset not in PRESETS:
        raise typer.BadParameter(
            f"unknown preset {preset!r}; known: {', '.join(PRESETS)}", param_hint="--preset"
        )
    options = ParallelOptions(
        preset=preset,
        tokens=tokens,
        steps=steps,
        warmup=warmup,
        layers=layers,
        seed=seed,
        backend=backend,
        baseline=baseline,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        timeout_s=timeout,
    )
    run_parallel_cli(
        modes=modes,
        kernel=kernel,
        gpus=gpus,
        cpu=cpu,
        options=options,
        json_out=json_out,
        save=save,
        log_dir=log_dir,
    )


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _label(status: Status, kind: object) -> Text:
    label = str(kind) if status is Status.ERROR and kind else str(status)
    return Text(label, style=STYLE.get(label, "bold red"))


def _g(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_parallel(console: Console, report: ParallelReport) -> None:
    console.print(
        Text.assemble(
            ("kernel ", "dim"),
            (report.kernel, "bold"),
            ("   tier ", "dim"),
            report.tier,
            ("   preset ", "dim"),
            report.preset,
            ("   tokens/step ", "dim"),
            f"{report.tokens:,}",
            ("   ", "dim"),
            f"{report.dtype} {report.backend}",
            ("   wall ", "dim"),
            f"{report.wall_s:.1f} s",
        )
    )
    if report.gpu_of_ordinal:
        mapping = ", ".join(f"cuda:{o} = GPU {g}" for o, g in sorted(report.gpu_of_ordinal.items()))
        console.print(Text(f"  ranks saw {mapping}", style="dim"))
    modes = Table(
        title="Modes: every rank against a single-device run of the same weights and inputs",
        title_justify="left",
    )
    for col in (
        "mode",
        "ranks",
        "result",
        "max rel. err",
        "tolerance",
        "step ms",
        "tokens/s",
        "vs 1 GPU",
        "efficiency",
    ):
        modes.add_column(col, justify="right" if col not in ("mode", "result") else "left")
    for m in report.modes:
        modes.add_row(
            m.mode.value,
            str(m.world_size),
            Text(
                str(m.status) + (" (timeout)" if m.timed_out else ""),
                style=STYLE.get(str(m.status), "bold red"),
            ),
            _g(m.max_rel_error, ".2g"),
            _g(m.tolerance, "g"),
            _g(m.step_ms, ".1f"),
            _g(m.tokens_per_s, ",.0f"),
            "-" if m.speedup is None else f"{m.speedup:.2f}x",
            "-" if m.efficiency is None else f"{100 * m.efficiency:.0f}%",
        )
    console.print(modes)
    ranks = Table(title="Ranks", title_justify="left")
    for col in ("rank", "mode", "device", "result", "detail"):
        ranks.add_column(col)
    for o in report.outcomes:
        mode = MODE_OF.get(o.spec.condition)
        detail = describe_outcome(o)
        if o.status is Status.ERROR:
            detail += f"  [at {o.facts.get('parallel.at', o.phase)}]"
        ranks.add_row(
            o.probe_id.split("/")[0],
            mode.value if mode else o.spec.condition.value.removeprefix("parallel-"),
            str(o.facts.get("parallel.device", "-" if o.spec.device is None else f"cuda:{o.spec.device}")),
            _label(o.status, o.error_kind),
            detail,
        )
    console.print(ranks)
    for d in report.diagnoses:
        console.print(diagnosis_panel(d))
    for note in report.explanations:
        console.print(Text.assemble(("note: ", "yellow"), note))
    if report.unexplained:
        console.print(
            Text("Failing ranks no rule accounts for (a fault, cause not named):", style="bold red")
        )
        for e in report.unexplained:
            console.print(Text.assemble("  ", (e.probe_id, "cyan"), " ", (e.label, "red"), ": ", e.detail))
    for note in report.skipped:
        console.print(Text.assemble(("skipped: ", "dim"), note))
    if report.healthy:
        console.print(Text("healthy: every rank matched one device; no cause diagnosed", style="bold green"))
    else:
        n = len(report.diagnoses)
        console.print(
            Text(
                f"{n} cause{'s' if n != 1 else ''} diagnosed"
                + (f", {len(report.unexplained)} unexplained failing rank(s)" if report.unexplained else ""),
                style="bold red",
            )
        )
    console.print(Text(f"logs: {report.log_dir}", style="dim"))
