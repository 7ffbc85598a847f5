"""The CI health check: lint, the CPU tier and a fast GPU subset of the scan, per kernel.

::

    kernels --plan_check--> (cpu plan, gpu plan) --run_scan--> ScanReport per tier
    ScanReports + lint --check_verdicts--> KernelCheck (cells, diagnoses, exit code) --> CheckReport
    CheckReport --render--> terminal | JSON (``check_json``) | JUnit XML (``qmoe_doctor.reports.junit``)

What each tier can see:

* **lint** (``qmoe_doctor.lint.rules``, source only, over every file the kernel's function reaches:
  ``kernel_lint``): launches outside a device guard, int32 offsets, per-device state cached from
  one GPU or read from the current device for a launch, streams and buffers of the current
  device, autotuned in-place kernels. Runs anywhere; proves nothing about behaviour.
* **CPU tier** (no GPU, Triton interpreter, float32): invalid routing (``m_sizes`` past M, -1
  sentinels), first-call-only faults (autotuned in-place kernels), offset / stride edges, and
  plain wrong numbers. It cannot see placement, peer access, streams or int32 overflow (the
  interpreter does no bounds checking and has no devices).
* **GPU subset** (``GPU_FAST_CONDITIONS`` on the first ordered pair): the device guard, buffers
  on the current device, the producer race and the caller's stream, plus the single-device cells
  on the pair's operand GPU. Target: under a minute on two GPUs. ``qmoe-doctor scan`` runs every
  pair and the slow cells (untouched context, m_sizes race, int32 boundary, sweeps).

Planning is ``plan.check``, the verdicts ``diagnose.check_verdicts``; this module runs the tiers
and assembles the records. The workers' logs go to ``--log-dir`` (kept), or to a
``qmoe-doctor-check-*`` folder in the temp dir that is kept when the check is not healthy and
removed when it is. ``on_progress`` gets the report so far after every tier, so that a check that
is stopped leaves its finished kernels and tiers behind (``check --save``).

No torch here: probes run in children (``qmoe_doctor.isolate.worker_pool``).
"""

from __future__ import annotations

import datetime as _dt
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from qmoe_doctor.core.events import Event
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.options import GPU_FAST_CONDITIONS, GPU_FAST_MAX_PAIRS, CheckOptions
from qmoe_doctor.core.records import Diagnosis, Evidence, Outcome
from qmoe_doctor.core.reports import (
    CellResult,
    CheckReport,
    KernelCheck,
    LintResult,
    Tier,
    TierResult,
)
from qmoe_doctor.diagnose.check_verdicts import cell_results, count_verdicts, judge_kernel, worst
from qmoe_doctor.isolate.logs import LogDir
from qmoe_doctor.lint import LintReport, lint_paths, lint_reached
from qmoe_doctor.plan.check import lint_entry, no_lint_note, plan_check
from qmoe_doctor.plan.scan import PlannedGpu, ScanPlan
from qmoe_doctor.reports.json import json_document
from qmoe_doctor.workflows.scan import KernelUnusable, all_spawn_failures, coverage, run_scan

__all__ = [
    "GPU_FAST_CONDITIONS",
    "GPU_FAST_MAX_PAIRS",
    "CheckOptions",
    "OnProgress",
    "OnTier",
    "check_json",
    "check_kernel",
    "kernel_lint",
    "run_check",
    "run_lint",
]

OnTier = Callable[[str, Tier, ScanPlan], None]  # (kernel, tier, its plan) before the tier runs
OnProgress = Callable[[CheckReport], None]  # the report so far (complete=False) after each tier


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "kernel"


def lint_result(report: LintReport) -> LintResult:
    """The lint section of a check report: what was linted, the findings, the paths it could not."""
    return LintResult(
        paths=report.paths,
        files=report.files,
        findings=report.findings,
        errors=report.errors,
        reached_from=report.reached_from,
        notes=report.notes,
    )


def run_lint(paths: Sequence[str]) -> LintResult:
    return lint_result(lint_paths(paths))


def kernel_lint(kernel: str) -> tuple[LintResult | None, tuple[str, ...]]:
    """The lint of what ``kernel`` reaches (``check`` and ``scan``), from its function through
    the calls and imports to the modules whose kernels it launches, never importing it; and the
    notes: why there is no lint (its source cannot be found without importing it)."""
    entry = lint_entry(kernel)
    if entry is None:
        return None, (no_lint_note(kernel),)
    return lint_result(lint_reached(entry.source, entry.function, search=entry.search)), ()


def check_kernel(
    kernel: str,
    *,
    gpus: Sequence[PlannedGpu] = (),
    opts: CheckOptions | None = None,
    lint: Sequence[str] | None = None,
    log_dir: Path,
    on_tier: OnTier | None = None,
    on_event: Callable[[Event], None] | None = None,
    on_partial: Callable[[KernelCheck], None] | None = None,
    inventory: dict[str, Any] | None = None,
) -> KernelCheck:
    """Lint ``lint`` paths (None: what the kernel reaches, ``kernel_lint``; (): none), then run
    each tier; ``on_partial`` gets the kernel's check so far after each tier but the last."""
    opts = opts or CheckOptions()
    t0 = time.perf_counter()
    notes: tuple[str, ...] = ()
    if lint is None:
        lint_res, notes = kernel_lint(kernel)
    else:
        lint_res = run_lint(tuple(lint)) if lint else None
    tiers: list[TierResult] = []
    cells: list[CellResult] = []
    diagnoses: list[Diagnosis] = []
    hardening: list[Diagnosis] = []
    unexplained: list[Evidence] = []
    explanations: list[str] = []
    outcomes: list[Outcome] = []  # of every tier: what the verdict covers

    def assemble(code: ExitCode, problem: str) -> KernelCheck:
        return KernelCheck(
            kernel=kernel,
            exit_code=int(code),
            problem=problem,
            wall_s=time.perf_counter() - t0,
            lint=lint_res,
            tiers=tuple(tiers),
            cells=tuple(cells),
            summary=count_verdicts(cells),
            diagnoses=tuple(diagnoses),
            unexplained=tuple(unexplained),
            explanations=tuple(explanations),
            notes=notes,
            hardening=tuple(hardening),
            coverage=coverage(outcomes) if tiers else None,
        )

    def judged() -> KernelCheck:
        faults = bool(diagnoses or unexplained or any(c.verdict == "fail" for c in cells))
        return assemble(*judge_kernel(lint_res, tiers, cells, faults))

    planned = plan_check(kernel, gpus, opts)
    for done, (tier, plan) in enumerate(planned, start=1):
        if on_tier is not None:
            on_tier(kernel, tier, plan)
        try:
            report = run_scan(
                plan,
                gpus=tuple(g.index for g in gpus) if tier == "gpu" else (),
                log_dir=log_dir / _slug(kernel) / tier,
                on_event=on_event,
                inventory=inventory if tier == "gpu" else None,
            )
        except KernelUnusable as exc:
            return assemble(ExitCode.USAGE, f"the kernel could not be used: {exc}")
        tier_cells = cell_results(report, tier)
        cells.extend(tier_cells)
        diagnoses.extend(report.diagnoses)
        hardening.extend(report.hardening)
        outcomes.extend(report.outcomes)
        unexplained.extend(report.unexplained)
        explanations.extend(report.explanations)
        tiers.append(
            TierResult(
                tier=tier,
                gpus=report.gpus,
                wall_s=report.wall_s,
                counts=count_verdicts(tier_cells),
                # the CPU plan's "no GPU" note is wrong when the GPU subset runs too
                skipped=report.skipped if tier == "gpu" or not gpus else (),
                spawn_failed=all_spawn_failures(report),
                log_dir=report.log_dir,
            )
        )
        if on_partial is not None and done < len(planned):
            on_partial(judged())
    return judged()


def run_check(
    kernels: Sequence[str],
    *,
    gpus: Sequence[PlannedGpu] = (),
    opts: CheckOptions | None = None,
    lint: Sequence[str] | None = None,
    log_dir: Path | None = None,
    on_tier: OnTier | None = None,
    on_event: Callable[[Event], None] | None = None,
    on_progress: OnProgress | None = None,
    inventory: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> CheckReport:
    """Check each kernel. ``lint`` paths, when given, are linted once, on their own (the
    report's ``lint``), and no kernel's source is linted by default. ``on_progress`` gets the
    report so far (``complete=False``, the kernels not checked yet in ``not_run``) after every
    tier. The logs stay in ``log_dir`` when given, else in a temp folder kept only when the
    check is not healthy (``report.log_dir``; "" when removed)."""
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    lint_res = run_lint(lint) if lint else None
    done: list[KernelCheck] = []

    def report(checks: Sequence[KernelCheck], *, complete: bool, root: Path) -> CheckReport:
        codes = [k.exit_code for k in checks] + ([lint_res.exit_code] if lint_res else [])
        return CheckReport(
            started=started,
            wall_s=time.perf_counter() - t0,
            gpus=tuple(g.index for g in gpus),
            exit_code=int(worst(codes)),
            kernels=tuple(checks),
            lint=lint_res,
            notes=tuple(notes),
            inventory=inventory or {},
            log_dir=str(root),
            complete=complete,
            not_run=tuple(kernels[len(checks) :]) if not complete else (),
        )

    with LogDir.open(log_dir, prefix="qmoe-doctor-check-") as logs:

        def partial(kernel_so_far: KernelCheck) -> None:
            if on_progress is not None:
                on_progress(report([*done, kernel_so_far], complete=False, root=logs.path))

        for i, kernel in enumerate(kernels):
            done.append(
                check_kernel(
                    kernel,
                    gpus=gpus,
                    opts=opts,
                    lint=() if lint else None,
                    log_dir=logs.path,
                    on_tier=on_tier,
                    on_event=on_event,
                    on_partial=partial,
                    inventory=inventory,
                )
            )
            if on_progress is not None and i + 1 < len(kernels):
                on_progress(report(done, complete=False, root=logs.path))
        final = report(done, complete=True, root=logs.path)
        if not final.healthy:
            logs.keep()
    if not logs.kept:  # removed: no tier folder to point at
        final = replace(
            final,
            kernels=tuple(
                replace(k, tiers=tuple(replace(t, log_dir="") for t in k.tiers)) for k in final.kernels
            ),
        )
    return replace(final, log_dir=logs.reported)


def check_json(report: CheckReport) -> dict[str, Any]:
    """The versioned ``--json`` document: ``schema_version``, ``kind: "check"``, the report."""
    doc = json_document("check", report)
    doc["healthy"] = report.healthy
    return doc
