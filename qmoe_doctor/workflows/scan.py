"""The scan engine: plan -> isolated sessions -> follow-ups -> classification -> report.

No rendering here (``cli.render.scan`` draws the report) and no torch (probes run in children).
The workers' logs go to ``--log-dir`` (kept), or to a ``qmoe-doctor-*`` folder in the temp dir
that is kept when the scan found something, could not run or was stopped, and removed when it
ended healthy (``isolate.logs.LogDir``); ``ScanReport.log_dir`` says where they are, "" if gone.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from qmoe_doctor.core.audit import DEFAULT_TOKENS, audit_shape
from qmoe_doctor.core.events import Event, EventKind
from qmoe_doctor.core.options import ScanOptions
from qmoe_doctor.core.records import (
    Condition,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Status,
    to_jsonable,
)
from qmoe_doctor.core.reports import ScanReport, SessionInfo
from qmoe_doctor.core.shapes import get_preset
from qmoe_doctor.diagnose.matrix import Cell as Cell  # re-exported: the CLI draws the matrix
from qmoe_doctor.diagnose.matrix import build_matrix as build_matrix
from qmoe_doctor.diagnose.scan_rules import classify
from qmoe_doctor.isolate.logs import LogDir
from qmoe_doctor.isolate.worker_pool import run_session
from qmoe_doctor.plan.scan import ScanPlan, debug_rerun, plan_scan


class KernelUnusable(Exception):
    """The kernel under test could not be used in the probe child: its import failed, or its
    reference resolved to something of another signature. (A malformed reference is
    ``core.kernel_ref.KernelRefError``, refused in the parent before any child starts.)"""


def group_names(plan: ScanPlan) -> dict[str, str]:
    """Groups of the plan's probes ("0->1") to report names ("GPU 0 -> GPU 1")."""
    return {s.placement.group: s.placement.label for s in plan.specs}


def run_scan(
    plan: ScanPlan,
    *,
    gpus: Sequence[int] = (),
    log_dir: Path | None = None,
    on_event: Callable[[Event], None] | None = None,
    inventory: dict[str, Any] | None = None,
    audit_presets: Sequence[str] = (),
    on_progress: Callable[[ScanReport], None] | None = None,
) -> ScanReport:
    """Run every session of the plan, then the follow-ups the results call for.

    ``on_progress`` gets a report of everything so far (``complete=False``, the sessions not
    run yet in ``not_run``) after each session: ``scan --save`` writes it, so that a scan that is
    stopped (a CI job's time limit, a device call's) leaves its finished pairs behind (run 50: the
    eight-GPU scan was stopped after 48 of 56 pairs and left nothing). The workers' logs stay in
    ``log_dir`` when given, else in a temp folder kept only when the scan did not end healthy.
    Raises KernelUnusable when the kernel cannot be used in the child."""
    with LogDir.open(log_dir) as logs:
        report = _scan(
            plan,
            gpus=gpus,
            log_dir=logs.path,
            on_event=on_event,
            inventory=inventory,
            audit_presets=audit_presets,
            on_progress=on_progress,
        )
        if not report.healthy or checked_nothing(report):
            logs.keep()
    return replace(report, log_dir=logs.reported)


def _scan(
    plan: ScanPlan,
    *,
    gpus: Sequence[int],
    log_dir: Path,
    on_event: Callable[[Event], None] | None,
    inventory: dict[str, Any] | None,
    audit_presets: Sequence[str],
    on_progress: Callable[[ScanReport], None] | None,
) -> ScanReport:
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()

    def watch(event: Event) -> None:
        if on_event is not None:
            on_event(event)
        out = event.outcome
        if event.kind is EventKind.OUTCOME and out is not None and out.error_kind is ErrorKind.KERNEL_IMPORT:
            raise KernelUnusable(out.error_message or "the kernel could not be resolved")

    outcomes: list[Outcome] = []

    names = group_names(plan)

    def report(complete: bool, not_run: tuple[str, ...] = ()) -> ScanReport:
        result = classify(outcomes, kernel=plan.kernel, gpu_names=names)
        return ScanReport(
            kernel=plan.kernel,
            tier="gpu" if gpus else "cpu",
            started=started,
            wall_s=time.perf_counter() - t0,
            gpus=tuple(gpus),
            sessions=tuple(
                SessionInfo(
                    label=s.label,
                    gpu_of_ordinal=dict(s.gpu_of_ordinal),
                    cuda_visible_devices=s.env.get("CUDA_VISIBLE_DEVICES"),
                )
                for s in plan.sessions
            ),
            outcomes=tuple(outcomes),
            diagnoses=result.diagnoses,
            explanations=result.explanations,
            unexplained=result.unexplained,
            skipped=plan.skipped,
            log_dir=str(log_dir),
            inventory=inventory or {},
            audit=tuple(
                audit_shape(get_preset(name), DEFAULT_TOKENS) for name in dict.fromkeys(audit_presets)
            ),
            complete=complete,
            not_run=not_run,
        )

    for done, session in enumerate(plan.sessions, start=1):
        specs = list(session.specs)
        if specs and specs[0].condition is Condition.INTERPRETER_CHECK:
            # The environment first: if our own trivial kernel cannot run on this interpreter,
            # the rest of the tier is skipped rather than blamed on the kernel under test.
            (env_check,) = run_session(specs[:1], base_env=session.env, log_dir=log_dir, on_event=watch)
            outcomes.append(env_check)
            specs = specs[1:]
            if env_check.status is not Status.PASS:
                reason = _first_line_of(env_check.error_message) or str(env_check.status)
                outcomes += [_skipped(s, f"{_why_tier_skipped(env_check)}: {reason}") for s in specs]
                continue
        outcomes += run_session(specs, base_env=session.env, log_dir=log_dir, on_event=watch)
        # follow-up: a failing int32 boundary cell is re-run with TRITON_DEBUG=1 so the report
        # can name the overflowing source line
        followups = [
            debug_rerun(o.spec)
            for o in outcomes[-len(session.specs) :]
            if o.spec.condition is Condition.INT32_BOUNDARY and o.status in (Status.WRONG, Status.ERROR)
        ]
        if followups:
            outcomes += run_session(followups, base_env=session.env, log_dir=log_dir, on_event=watch)
        if on_progress is not None and done < len(plan.sessions):
            on_progress(report(False, tuple(s.label for s in plan.sessions[done:])))
    return report(True)


def _why_tier_skipped(env_check: Outcome) -> str:
    """Why a failed environment check skips the tier: the child never started (a missing or
    broken Python, QMOE_DOCTOR_CHILD_PYTHON), or it started and the interpreter failed."""
    if env_check.status is Status.ERROR and env_check.phase is Phase.SPAWN:
        return "no probe child could start"
    return "the Triton interpreter cannot run here"


def _first_line_of(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[0][:200] if lines else ""


def _skipped(spec: ProbeSpec, reason: str) -> Outcome:
    return Outcome(
        probe_id=spec.probe_id, spec=spec, status=Status.SKIPPED, phase=Phase.SPAWN, notes=(reason,)
    )


def nothing_ran(report: ScanReport) -> bool:
    """No probe of the kernel under test ran (all skipped, or only the environment check)."""
    return bool(report.outcomes) and all(
        o.status is Status.SKIPPED or o.spec.condition is Condition.INTERPRETER_CHECK for o in report.outcomes
    )


def all_spawn_failures(report: ScanReport) -> bool:
    """Every probe died before its child was ready: the check itself could not run."""
    return bool(report.outcomes) and all(
        o.status is Status.ERROR and o.phase is Phase.SPAWN for o in report.outcomes
    )


def checked_nothing(report: ScanReport) -> bool:
    """Nothing of the kernel was checked: no probe planned, none could start, or all skipped."""
    return not report.outcomes or all_spawn_failures(report) or nothing_ran(report)


def report_json(report: ScanReport) -> dict[str, Any]:
    body = to_jsonable(report)
    body["healthy"] = report.healthy
    return body  # type: ignore[no-any-return]


__all__ = [
    "Cell",
    "KernelUnusable",
    "ScanOptions",
    "ScanReport",
    "all_spawn_failures",
    "build_matrix",
    "checked_nothing",
    "group_names",
    "nothing_ran",
    "plan_scan",
    "report_json",
    "run_scan",
]
