"""The CI health check: lint, the CPU tier and a fast GPU subset of the scan, per kernel.

::

    kernels --plan_check--> (cpu plan, gpu plan) --run_scan--> ScanReport per tier
    ScanReports + lint --> KernelCheck (cells, diagnoses, exit code) --> CheckReport
    CheckReport --render--> terminal | JSON (``check_json``) | JUnit XML (``qmoe_doctor.reports.junit``)

What each tier can see:

* **lint** (``qmoe_doctor.lint.rules``, source only): launches outside a device guard, int32 offsets,
  per-device state cached from one GPU, streams and buffers of the current device, autotuned
  in-place kernels. Runs anywhere; proves nothing about behaviour.
* **CPU tier** (no GPU, Triton interpreter, float32): invalid routing (``m_sizes`` past M, -1
  sentinels), first-call-only faults (autotuned in-place kernels), offset / stride edges, and
  plain wrong numbers. It cannot see placement, peer access, streams or int32 overflow (the
  interpreter does no bounds checking and has no devices).
* **GPU subset** (``GPU_FAST_CONDITIONS`` on the first ordered pair): the device guard, buffers
  on the current device, the producer race and the caller's stream, plus the single-device cells
  on the pair's operand GPU. Target: under a minute on two GPUs. ``qmoe-doctor scan`` runs every
  pair and the slow cells (untouched context, m_sizes race, int32 boundary, sweeps).

No torch here: probes run in children (``qmoe_doctor.isolate.worker_pool``).
"""

from __future__ import annotations

import datetime as _dt
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from qmoe_doctor import __version__
from qmoe_doctor.core.conditions import DEFAULT_CONDITIONS
from qmoe_doctor.core.events import Event
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.kernel_ref import KernelRef
from qmoe_doctor.core.options import GPU_FAST_CONDITIONS, GPU_FAST_MAX_PAIRS, CheckOptions, ScanOptions
from qmoe_doctor.core.records import (
    SCHEMA_VERSION,
    Condition,
    Diagnosis,
    ErrorKind,
    Evidence,
    Outcome,
    Phase,
    Status,
)
from qmoe_doctor.core.reports import ScanReport
from qmoe_doctor.diagnose.matrix import Cell, cell_label, describe, group_of
from qmoe_doctor.lint import LintError, LintFinding, LintReport, lint_paths
from qmoe_doctor.plan.scan import PlannedGpu, ScanPlan, plan_scan
from qmoe_doctor.reports.json import json_document
from qmoe_doctor.workflows.scan import KernelRefError, all_spawn_failures, group_names, run_scan

__all__ = [
    "GPU_FAST_CONDITIONS",
    "GPU_FAST_MAX_PAIRS",
    "CellResult",
    "CheckOptions",
    "CheckReport",
    "KernelCheck",
    "LintResult",
    "TierResult",
    "cell_results",
    "check_json",
    "default_lint_paths",
    "plan_check",
    "run_check",
    "worst",
]

Tier = Literal["cpu", "gpu"]
#: pass: ran and was right; fail: wrong, crashed, or the slow evidence of a diagnosis;
#: skip: did not apply (reason in detail); error: the check could not run it (spawn, import).
Verdict = Literal["pass", "fail", "skip", "error"]


#: Exit codes of a kernel's check, most important first: the overall code is the first of these
#: that any kernel (or the lint section) got.
_PRECEDENCE = (ExitCode.USAGE, ExitCode.CHECK_BROKEN, ExitCode.FAULT, ExitCode.HEALTHY)

LOG_CHARS = 4000  # of a failing cell's error text and stderr tail kept for CI logs


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LintResult:
    paths: tuple[str, ...]  # as given (or the kernel's own source)
    files: tuple[str, ...]  # the Python files linted
    findings: tuple[LintFinding, ...] = ()
    errors: tuple[LintError, ...] = ()  # missing, unreadable or unparsable files

    @classmethod
    def from_report(cls, report: LintReport) -> LintResult:
        return cls(paths=report.paths, files=report.files, findings=report.findings, errors=report.errors)

    @property
    def exit_code(self) -> ExitCode:
        if self.errors:
            return ExitCode.USAGE  # as `qmoe-doctor lint`: a path that is not a readable source
        return ExitCode.FAULT if self.findings else ExitCode.HEALTHY


@dataclass(frozen=True, slots=True, kw_only=True)
class CellResult:
    """One probe as CI sees it (a JUnit test case)."""

    probe_id: str
    tier: Tier
    group: str  # as the report names it: "CPU", "GPU 1", "GPU 0 -> GPU 1"
    name: str  # the condition, with its variant: "peer", "offsets:padded-rows", "int32-boundary+debug"
    label: str  # pass | slow | wrong | skipped | <error kind>
    verdict: Verdict
    detail: str  # one line: what it showed, or why it was skipped
    cause: str | None = None  # the diagnosis that cites this failing cell; None: unexplained
    wall_s: float = 0.0
    notes: tuple[str, ...] = ()
    log: str = ""  # error text and the child's stderr tail (failures and errors)


@dataclass(frozen=True, slots=True, kw_only=True)
class TierResult:
    tier: Tier
    gpus: tuple[int, ...]  # NVML indices (empty for the CPU tier)
    wall_s: float
    counts: dict[str, int]  # verdict -> cells
    skipped: tuple[str, ...] = ()  # what the plan left out, and why
    spawn_failed: bool = False  # every probe died before its child was ready
    log_dir: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelCheck:
    kernel: str
    exit_code: int  # an ExitCode value
    problem: str = ""  # why the check of this kernel could not give an answer, when it could not
    wall_s: float = 0.0
    lint: LintResult | None = None  # the kernel's own source (when no --lint paths were given)
    tiers: tuple[TierResult, ...] = ()
    cells: tuple[CellResult, ...] = ()
    summary: dict[str, int] = field(default_factory=dict)  # verdict -> cells, over every tier
    diagnoses: tuple[Diagnosis, ...] = ()
    unexplained: tuple[Evidence, ...] = ()
    explanations: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    started: str  # ISO 8601, UTC
    wall_s: float
    gpus: tuple[int, ...]  # NVML indices the GPU subset used (empty: CPU only)
    exit_code: int  # an ExitCode value: the process's exit status
    kernels: tuple[KernelCheck, ...] = ()
    lint: LintResult | None = None  # the --lint paths, when given
    notes: tuple[str, ...] = ()  # why a tier did not run, NVML trouble
    inventory: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.exit_code == ExitCode.HEALTHY


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


def tier_options(tier: Tier, opts: CheckOptions) -> ScanOptions:
    if opts.conditions is not None:
        conditions = opts.conditions
    else:
        conditions = DEFAULT_CONDITIONS if tier == "cpu" else GPU_FAST_CONDITIONS
    return ScanOptions(
        preset=opts.preset,
        rows=opts.rows,
        conditions=conditions,
        timeout_s=opts.timeout_s,
        max_pairs=opts.max_pairs if tier == "gpu" else None,
    )


def plan_check(
    kernel: str, gpus: Sequence[PlannedGpu], opts: CheckOptions | None = None
) -> tuple[tuple[Tier, ScanPlan], ...]:
    """The scans a check of ``kernel`` runs: the CPU tier (unless disabled), then the GPU
    subset when GPUs are given."""
    opts = opts or CheckOptions()
    plans: list[tuple[Tier, ScanPlan]] = []
    if opts.cpu_tier:
        plans.append(("cpu", plan_scan(kernel, [], tier_options("cpu", opts))))
    if gpus:
        plans.append(("gpu", plan_scan(kernel, gpus, tier_options("gpu", opts))))
    return tuple(plans)


# --------------------------------------------------------------------------------------------
# Lint targets
# --------------------------------------------------------------------------------------------


def default_lint_paths(ref: str) -> tuple[str, ...]:
    """What ``check`` lints for a kernel when no ``--lint`` is given: its source file, found
    without importing it (``KernelRef.source_path``: our kernel, a specimen, a file, a module
    through the import system's finders, an adapter's target); () when it has none to find."""
    try:
        source = KernelRef.parse(ref).source_path()
    except ValueError:  # a malformed reference (KernelRefError): the probes will say so
        return ()
    return (str(source),) if source is not None else ()


# --------------------------------------------------------------------------------------------
# From outcomes to cells
# --------------------------------------------------------------------------------------------


def _log(o: Outcome) -> str:
    parts = [p for p in (o.error_message or "", o.stderr_tail) if p]
    text = "\n--- child stderr (tail) ---\n".join(parts) if len(parts) == 2 else "".join(parts)
    return text[-LOG_CHARS:]


def cell_results(
    report: ScanReport, tier: Tier, names: dict[str, str] | None = None
) -> tuple[CellResult, ...]:
    """One CellResult per outcome of a scan, with its verdict and, for failures, the cause."""
    names = names or {}
    baselines: dict[str, float] = {}
    for o in report.outcomes:
        if o.spec.condition is Condition.GUARDED and o.status is Status.PASS and o.kernel_ms:
            baselines[group_of(o)] = o.kernel_ms
    cited: dict[str, str] = {}
    details: dict[str, str] = {}
    for d in report.diagnoses:
        for e in d.evidence:
            cited.setdefault(e.probe_id, d.cause)
            if e.label != "pass":
                details[e.probe_id] = e.detail  # the failing entry comes after the baseline's
    for e in report.unexplained:
        details[e.probe_id] = e.detail
    cells: list[CellResult] = []
    for o in report.outcomes:
        group = group_of(o)
        base = baselines.get(group) if o.spec.condition.is_pair else None
        label, slowdown = cell_label(o, base)
        cause: str | None = None
        verdict: Verdict
        if o.status is Status.SKIPPED:
            verdict = "skip"
        elif label == "rejected":
            verdict = "pass"  # the kernel refused invalid input loudly: what it should do
        elif o.spec.condition is Condition.INTERPRETER_CHECK and o.failed:
            verdict = "skip"  # the machine's interpreter, not the kernel: the tier did not run
        elif o.status is Status.ERROR and (o.phase is Phase.SPAWN or o.error_kind is ErrorKind.KERNEL_IMPORT):
            verdict = "error"
        elif o.failed or (label == "slow" and o.probe_id in cited):
            verdict = "fail"
            cause = cited.get(o.probe_id)
        else:
            verdict = "pass"
        _, slash, name = o.probe_id.partition("/")
        cells.append(
            CellResult(
                probe_id=o.probe_id,
                tier=tier,
                group=names.get(group, group),
                name=name if slash else str(o.spec.condition),
                label=label,
                verdict=verdict,
                detail=details.get(o.probe_id) or describe(Cell(outcome=o, label=label, slowdown=slowdown)),
                cause=cause,
                wall_s=o.wall_s,
                notes=o.notes,
                log=_log(o) if verdict in ("fail", "error") else "",
            )
        )
    return tuple(cells)


def _counts(cells: Iterable[CellResult]) -> dict[str, int]:
    counts = {"pass": 0, "fail": 0, "skip": 0, "error": 0}
    for c in cells:
        counts[c.verdict] += 1
    return counts


def worst(codes: Iterable[int]) -> ExitCode:
    """The exit code that matters most among several (usage > broken > fault > healthy)."""
    got = {ExitCode(c) for c in codes}
    for code in _PRECEDENCE:
        if code in got:
            return code
    return ExitCode.HEALTHY


def _judge(
    lint: LintResult | None, tiers: Sequence[TierResult], cells: Sequence[CellResult], faults: bool
) -> tuple[ExitCode, str]:
    if lint is not None and lint.errors:
        return ExitCode.USAGE, "; ".join(e.as_line() for e in lint.errors)
    broken = [t for t in tiers if t.spawn_failed]
    if broken:
        return ExitCode.CHECK_BROKEN, (
            f"no probe child of the {', '.join(t.tier for t in broken)} tier could start; "
            f"see the worker logs in {broken[0].log_dir}"
        )
    if faults or (lint is not None and lint.findings):
        return ExitCode.FAULT, ""
    errors = [c for c in cells if c.verdict == "error"]
    if errors:
        return (
            ExitCode.CHECK_BROKEN,
            f"{len(errors)} probe(s) could not run: {errors[0].probe_id}: {errors[0].detail}",
        )
    # the interpreter check runs our own reference kernel: it checks the machine, not the kernel
    kernel_cells = [c for c in cells if not c.name.startswith(Condition.INTERPRETER_CHECK.value)]
    if not any(c.verdict == "pass" for c in kernel_cells):
        reasons = sorted({c.detail for c in kernel_cells if c.verdict == "skip"})
        why = "; ".join(reasons[:3]) if reasons else "no probe was planned for these options"
        return ExitCode.CHECK_BROKEN, f"no probe ran, so nothing was checked: {why}"
    return ExitCode.HEALTHY, ""


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "kernel"


def run_lint(paths: Sequence[str]) -> LintResult:
    return LintResult.from_report(lint_paths(paths))


def check_kernel(
    kernel: str,
    *,
    gpus: Sequence[PlannedGpu] = (),
    opts: CheckOptions | None = None,
    lint: Sequence[str] | None = None,
    log_dir: Path,
    on_tier: Callable[[str, Tier, ScanPlan], None] | None = None,
    on_event: Callable[[Event], None] | None = None,
    inventory: dict[str, Any] | None = None,
) -> KernelCheck:
    """Lint ``lint`` paths (None: the kernel's own source; (): none), then run each tier."""
    opts = opts or CheckOptions()
    t0 = time.perf_counter()
    paths = default_lint_paths(kernel) if lint is None else tuple(lint)
    lint_result = run_lint(paths) if paths else None
    tiers: list[TierResult] = []
    cells: list[CellResult] = []
    diagnoses: list[Diagnosis] = []
    unexplained: list[Evidence] = []
    explanations: list[str] = []
    for tier, plan in plan_check(kernel, gpus, opts):
        if on_tier is not None:
            on_tier(kernel, tier, plan)
        tier_dir = log_dir / _slug(kernel) / tier
        try:
            report = run_scan(
                plan,
                gpus=tuple(g.index for g in gpus) if tier == "gpu" else (),
                log_dir=tier_dir,
                on_event=on_event,
                inventory=inventory if tier == "gpu" else None,
            )
        except KernelRefError as exc:
            return KernelCheck(
                kernel=kernel,
                exit_code=int(ExitCode.USAGE),
                problem=f"the kernel could not be used: {exc}",
                wall_s=time.perf_counter() - t0,
                lint=lint_result,
                tiers=tuple(tiers),
                cells=tuple(cells),
                summary=_counts(cells),
                diagnoses=tuple(diagnoses),
                unexplained=tuple(unexplained),
                explanations=tuple(explanations),
            )
        tier_cells = cell_results(report, tier, group_names(plan))
        cells += tier_cells
        diagnoses += report.diagnoses
        unexplained += report.unexplained
        explanations += report.explanations
        tiers.append(
            TierResult(
                tier=tier,
                gpus=report.gpus,
                wall_s=report.wall_s,
                counts=_counts(tier_cells),
                # the CPU plan's "no GPU" note is wrong when the GPU subset runs too
                skipped=report.skipped if tier == "gpu" or not gpus else (),
                spawn_failed=all_spawn_failures(report),
                log_dir=report.log_dir,
            )
        )
    faults = bool(diagnoses or unexplained or any(c.verdict == "fail" for c in cells))
    code, problem = _judge(lint_result, tiers, cells, faults)
    return KernelCheck(
        kernel=kernel,
        exit_code=int(code),
        problem=problem,
        wall_s=time.perf_counter() - t0,
        lint=lint_result,
        tiers=tuple(tiers),
        cells=tuple(cells),
        summary=_counts(cells),
        diagnoses=tuple(diagnoses),
        unexplained=tuple(unexplained),
        explanations=tuple(explanations),
    )


def run_check(
    kernels: Sequence[str],
    *,
    gpus: Sequence[PlannedGpu] = (),
    opts: CheckOptions | None = None,
    lint: Sequence[str] | None = None,
    log_dir: Path | None = None,
    on_tier: Callable[[str, Tier, ScanPlan], None] | None = None,
    on_event: Callable[[Event], None] | None = None,
    inventory: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> CheckReport:
    """Check each kernel. ``lint`` paths, when given, are linted once, on their own (the
    report's ``lint``), and no kernel's source is linted by default."""
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="qmoe-doctor-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    lint_result = run_lint(lint) if lint else None
    results = tuple(
        check_kernel(
            k,
            gpus=gpus,
            opts=opts,
            lint=() if lint else None,
            log_dir=log_dir,
            on_tier=on_tier,
            on_event=on_event,
            inventory=inventory,
        )
        for k in kernels
    )
    codes = [r.exit_code for r in results] + ([lint_result.exit_code] if lint_result else [])
    return CheckReport(
        started=started,
        wall_s=time.perf_counter() - t0,
        gpus=tuple(g.index for g in gpus),
        exit_code=int(worst(codes)),
        kernels=results,
        lint=lint_result,
        notes=tuple(notes),
        inventory=inventory or {},
    )


def check_json(report: CheckReport) -> dict[str, Any]:
    """The versioned ``--json`` document: ``schema_version``, ``kind: "check"``, the report."""
    doc = json_document("check", report)
    doc["healthy"] = report.healthy
    return doc
