"""`qmoe-doctor check`: the CI health check (lint, CPU tier, fast GPU subset), with JUnit and JSON.

A skin over :func:`qmoe_doctor.workflows.check.run_check`: validate, check the GPU count, call, render,
write the reports, exit with a documented code (docs/exit-codes.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.text import Text

from qmoe_doctor.cli.commands.scan import check_kernel_ref, parse_conditions
from qmoe_doctor.cli.output import stderr_console, stdout_console
from qmoe_doctor.core import knobs
from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.kernel_ref import is_adapter_ref, validate_adapter_ref
from qmoe_doctor.core.options import CheckOptions
from qmoe_doctor.core.records import to_jsonable
from qmoe_doctor.core.shapes import PRESETS
from qmoe_doctor.isolate.worker_pool import Event, EventKind
from qmoe_doctor.machine.inventory import (
    GpuInfo,
    GpuSelectionError,
    Inventory,
    collect_inventory,
    select_gpus,
)
from qmoe_doctor.plan.scan import ScanPlan
from qmoe_doctor.reports.junit import write_junit
from qmoe_doctor.workflows.check import CheckReport, KernelCheck, LintResult, Tier, check_json, run_check

KERNEL_HELP = (
    "Kernel to check (repeatable), called as fn(x, w, m_sizes) -> y: 'builtin', 'specimen:NAME', "
    "'module.path:function', 'path/to/file.py:function', or 'adapter:NAME[:TARGET]' for a kernel "
    "with another signature (docs/ci.md). Default: builtin, unless only --lint is given."
)

USAGE_PARAGRAPH = (
    "qmoe-doctor calls kernels as fn(x, w, m_sizes) -> y with x (M, K) rows sorted by expert, "
    "w (E, N, K) and m_sizes (E,); pass --kernel module:function or path/to/file.py:function naming "
    "such a callable, or adapter:NAME:TARGET for a kernel with another signature (docs/ci.md)."
)

# NVML errors that mean "no NVIDIA driver on this machine" (so: zero GPUs, exit 3 under
# --require-gpus) rather than "the driver is there and NVML is broken" (exit 4).
_NO_DRIVER = ("Shared Library Not Found", "Driver Not Loaded", "cannot be imported")


def _validate_kernel(ref: str) -> None:
    if is_adapter_ref(ref):
        try:
            validate_adapter_ref(ref)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--kernel") from None
    else:
        check_kernel_ref(ref)


def _gpus_for_check(
    inv: Inventory, gpus: str | None, require_gpus: int
) -> tuple[tuple[GpuInfo, ...], list[str]]:
    """The GPUs of the GPU subset, after --require-gpus; exits 2, 3 or 4 as documented."""
    err = stderr_console()
    notes: list[str] = []
    if inv.nvml_error and require_gpus > 0 and not any(s in inv.nvml_error for s in _NO_DRIVER):
        err.print(
            Text(f"error: --require-gpus {require_gpus}: cannot count GPUs: {inv.nvml_error}", style="red")
        )
        raise typer.Exit(ExitCode.CHECK_BROKEN)
    try:
        selected = select_gpus(inv, gpus) if inv.gpus else ()
    except GpuSelectionError as exc:
        err.print(Text(f"error: {exc}", style="red"))
        raise typer.Exit(ExitCode.USAGE) from None
    if gpus and not inv.gpus and require_gpus == 0:
        err.print(
            Text(
                f"error: --gpus {gpus} given but no GPU is visible ({inv.nvml_error or 'NVML lists none'})",
                style="red",
            )
        )
        raise typer.Exit(ExitCode.USAGE)
    if len(selected) < require_gpus:
        why = f" ({inv.nvml_error})" if inv.nvml_error else ""
        err.print(
            Text(
                f"error: --require-gpus {require_gpus}: {len(selected)} GPU(s) "
                + ("selected" if gpus else "visible to NVML")
                + f"{why}; nothing was run",
                style="red",
            )
        )
        raise typer.Exit(ExitCode.TOO_FEW_GPUS)
    if not selected:
        notes.append(
            f"no GPU ({inv.nvml_error or 'NVML lists none'}): ran the CPU tier only; placement, "
            "peer-access and stream faults need the GPU subset (a GPU runner)"
        )
    return selected, notes


def check_command(
    kernel: list[str] | None = typer.Option(None, "--kernel", "-k", help=KERNEL_HELP),  # noqa: B008
    lint: list[Path] | None = typer.Option(  # noqa: B008
        None,
        "--lint",
        help="Python file or directory to lint (repeatable). Default: each kernel's own source file "
        "when --kernel is a path or a module.",
    ),
    require_gpus: int = typer.Option(
        0,
        "--require-gpus",
        min=0,
        help="Fail with exit 3, before running anything, when fewer GPUs are there.",
    ),
    gpus: str | None = typer.Option(
        None, "--gpus", help="NVML / nvidia-smi GPU indices for the GPU subset (default: all)."
    ),
    cpu: bool = typer.Option(False, "--cpu", help="CPU tier only, even when GPUs exist."),
    junit: Path | None = typer.Option(None, "--junit", help="Write a JUnit XML report to this file."),
    json_file: Path | None = typer.Option(
        None, "--json", help="Write the versioned JSON report to this file."
    ),
    only: str | None = typer.Option(
        None, "--only", help="Comma-separated conditions (default: the CPU tier's and the fast GPU subset)."
    ),
    preset: str = typer.Option(
        "qwen3-30b-a3b", "--preset", help=f"Shape preset of the GPU cells: {', '.join(PRESETS)}."
    ),
    timeout: float = typer.Option(
        knobs.DEFAULT_PROBE_TIMEOUT_S, "--timeout", min=1.0, help="Seconds each probe may take."
    ),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="Where probe workers write their logs (default: a temp dir)."
    ),
) -> None:
    """CI health check: lint the kernel source, run the CPU tier, and on a GPU machine a fast
    subset of the scan (the first GPU pair; under a minute on two GPUs).

    Exit codes: 0 healthy, 1 fault diagnosed (a diagnosis, an unexplained failing cell or a lint
    finding), 2 usage error, 3 fewer GPUs than --require-gpus, 4 the check could not run.
    """
    err = stderr_console()
    if cpu and require_gpus:
        raise typer.BadParameter(
            "--cpu runs no GPU probe; drop --require-gpus or --cpu", param_hint="--require-gpus"
        )
    if preset not in PRESETS:
        raise typer.BadParameter(
            f"unknown preset {preset!r}; known: {', '.join(PRESETS)}", param_hint="--preset"
        )
    kernels = list(kernel or ([] if lint else ["builtin"]))
    for ref in kernels:
        _validate_kernel(ref)
    lint_paths = [str(p) for p in lint or []]
    missing = [p for p in lint_paths if not Path(p).exists()]
    if missing:
        raise typer.BadParameter(f"no such file or directory: {', '.join(missing)}", param_hint="--lint")
    conditions = parse_conditions(only) if only else None

    selected: tuple[GpuInfo, ...] = ()
    notes: list[str] = []
    inv: Inventory | None = None
    if not cpu:
        inv = collect_inventory()
        selected, notes = _gpus_for_check(inv, gpus, require_gpus)
    for note in notes:
        err.print(Text(note, style="yellow"))

    def on_tier(ref: str, tier: Tier, plan: ScanPlan) -> None:
        where = (
            "CPU tier" if tier == "cpu" else f"GPU subset on GPUs {', '.join(str(g.index) for g in selected)}"
        )
        err.print(Text(f"{ref}: {where}, {len(plan.specs)} probes", style="bold"))

    def on_event(event: Event) -> None:
        if event.kind is EventKind.OUTCOME and event.outcome is not None:
            o = event.outcome
            err.print(
                f"  {o.probe_id}: {o.status}" + (f" ({o.error_kind})" if o.error_kind else ""), style="dim"
            )
        elif event.kind is EventKind.WORKER_RESTARTED:
            err.print(f"  worker replaced: {event.detail}", style="yellow")

    report = run_check(
        kernels,
        gpus=selected,
        opts=CheckOptions(preset=preset, conditions=conditions, timeout_s=timeout),
        lint=lint_paths or None,
        log_dir=log_dir,
        on_tier=on_tier,
        on_event=on_event,
        inventory=to_jsonable(inv) if inv is not None and selected else None,
        notes=notes,
    )
    for k in report.kernels:
        if k.exit_code == ExitCode.USAGE and k.problem:
            err.print(
                Text(f"error: {k.kernel!r}: {k.problem}\n{USAGE_PARAGRAPH}", style="red"), soft_wrap=True
            )
    if junit is not None:
        write_junit(report, junit)
    if json_file is not None:
        json_file.write_text(json.dumps(check_json(report), indent=2, allow_nan=True) + "\n")
    render_check(report)
    raise typer.Exit(report.exit_code)


# --------------------------------------------------------------------------------------------
# Rendering (results to stdout)
# --------------------------------------------------------------------------------------------

_STATUS = {
    ExitCode.HEALTHY: ("healthy", "bold green"),
    ExitCode.FAULT: ("FAULT", "bold red"),
    ExitCode.USAGE: ("USAGE ERROR", "bold red"),
    ExitCode.CHECK_BROKEN: ("COULD NOT CHECK", "bold yellow"),
}


def _render_lint(lint: LintResult, indent: str) -> list[Text]:
    lines = [Text(f"{indent}lint: {len(lint.files)} file(s), {len(lint.findings)} finding(s)", style="dim")]
    for f in lint.findings:
        lines.append(Text.assemble(indent, "  ", (f.as_line(), "red")))
    for e in lint.errors:
        lines.append(Text.assemble(indent, "  ", (f"error: {e.as_line()}", "red")))
    return lines


def _render_kernel(k: KernelCheck) -> list[Text]:
    word, style = _STATUS.get(ExitCode(k.exit_code), ("?", "bold"))
    head = Text.assemble((k.kernel, "bold"), "  ", (word, style), (f"  ({k.wall_s:.1f} s)", "dim"))
    lines = [head]
    for t in k.tiers:
        c = t.counts
        where = "CPU tier" if t.tier == "cpu" else "GPU subset (GPUs " + ", ".join(map(str, t.gpus)) + ")"
        lines.append(
            Text(
                f"  {where}: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped"
                + (f", {c['error']} could not run" if c["error"] else "")
                + f"  ({t.wall_s:.1f} s; logs {t.log_dir})",
                style="dim",
            )
        )
    if k.problem:
        lines.append(Text(f"  {k.problem}", style="red"))
    for d in k.diagnoses:
        docs = CAUSES[d.cause].docs if d.cause in CAUSES else ""
        lines.append(
            Text.assemble("  ", (d.cause, "bold red"), f": {d.summary}", (f"  [{d.confidence}]", "dim"))
        )
        if d.where:
            lines.append(Text(f"    where: {', '.join(d.where)}", style="dim"))
        if d.repro:
            lines.append(Text.assemble(("    repro: ", "dim"), (d.repro, "bold")))
        if docs:
            lines.append(Text(f"    docs: {docs}", style="dim"))
    for e in k.unexplained:
        lines.append(
            Text.assemble("  ", ("unexplained ", "bold red"), (e.probe_id, "cyan"), f" {e.label}: {e.detail}")
        )
    for note in k.explanations:
        lines.append(Text.assemble(("  note: ", "yellow"), note))
    if k.lint is not None:
        lines += _render_lint(k.lint, "  ")
    reasons = sorted({c.detail for c in k.cells if c.verdict == "skip"})
    for r in reasons:
        lines.append(Text(f"  skipped: {r}", style="dim"))
    for t in k.tiers:
        for s in t.skipped:
            lines.append(Text(f"  not run: {s}", style="dim"))
    return lines


def render_check(report: CheckReport) -> None:
    out = stdout_console()
    for k in report.kernels:
        for line in _render_kernel(k):
            out.print(line, soft_wrap=True)
    if report.lint is not None:
        for line in _render_lint(report.lint, ""):
            out.print(line, soft_wrap=True)
    for note in report.notes:
        out.print(Text(f"note: {note}", style="yellow"), soft_wrap=True)
    code = ExitCode(report.exit_code)
    word, style = _STATUS.get(code, ("?", "bold"))
    out.print(Text.assemble(("check: ", "bold"), (word, style), f" (exit {int(code)})"), soft_wrap=True)
