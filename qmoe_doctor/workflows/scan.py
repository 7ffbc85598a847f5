"""The scan engine: plan -> isolated sessions -> follow-ups -> classification -> report.

::

    ScanPlan --round by round--> sessions of a round at once (one thread each, each its own
      child pinned to its own GPU pair) --> per session: run_session, then its follow-ups
      (memcheck of blind invalid-routing cells, TRITON_DEBUG=1 of a failing int32 boundary)
    outcomes, in plan order --classify--> ScanReport (diagnoses, hardening, coverage)

Where the time goes (docs/performance.md): each session pays a child's start-up (import torch
and triton, a CUDA context) and the kernel's first compile per shape, then its cells; a pair
session of the default scan took about 11.7 s on H200s. Sessions of one round share no GPU
(``plan.pair_rounds``), so they run at the same time; the outcomes join the report in plan order
whatever order they finish in, so the report and its order do not depend on the timing.

No rendering here (``cli.render.scan`` draws the report) and no torch (probes run in children).
The workers' logs go to ``--log-dir`` (kept), or to a ``qmoe-doctor-*`` folder in the temp dir
that is kept when the scan found something, could not run or was stopped, and removed when it
ended healthy (``isolate.logs.LogDir``); ``ScanReport.log_dir`` says where they are, "" if gone.
Under ``--autotune cached`` the scan's Triton cache is a folder of it (``core.autotune``).
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

from qmoe_doctor.core.audit import DEFAULT_TOKENS, audit_shape
from qmoe_doctor.core.autotune import SCAN_CACHE_DIR, session_env
from qmoe_doctor.core.coverage import Coverage, coverage_of
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
from qmoe_doctor.core.reports import LintResult, ScanReport, SessionInfo
from qmoe_doctor.core.shapes import get_preset
from qmoe_doctor.diagnose.baseline import (
    cpu_cannot_run,
    hang_reason,
    needs_cuda_reason,
    stop_reason,
    unusable,
)
from qmoe_doctor.diagnose.matrix import Cell as Cell  # re-exported: the CLI draws the matrix
from qmoe_doctor.diagnose.matrix import build_matrix as build_matrix
from qmoe_doctor.diagnose.scan_rules import classify
from qmoe_doctor.isolate import process
from qmoe_doctor.isolate.logs import LogDir
from qmoe_doctor.isolate.signals import interruptible
from qmoe_doctor.isolate.worker_pool import not_run, run_session
from qmoe_doctor.machine.sanitizer import SanitizerInfo, find_compute_sanitizer
from qmoe_doctor.plan.scan import ScanPlan, Session, debug_rerun, plan_scan
from qmoe_doctor.workflows.blind_cells import settle_blind_cells


class KernelUnusable(Exception):
    """The kernel under test could not be used in the probe child: its import failed, killed or
    hung the child, its reference resolved to something of another signature, or it raised on
    the canonical inputs of its baseline cell (``diagnose.baseline.unusable``). (A malformed
    reference is ``core.kernel_ref.KernelRefError``, refused in the parent before any child
    starts.)"""


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
    lint: LintResult | None = None,
    lint_notes: Sequence[str] = (),
) -> ScanReport:
    """Run every session of the plan, each followed by the follow-ups its results call for.
    ``lint`` (the lint of what the kernel reaches, made by the caller) and ``lint_notes`` (why
    there is none) go into the report as they are: notes, never part of the verdict.

    The sessions of one round of the plan run at once, each in a thread of its own; ``on_event``
    is called from those threads, one call at a time. ``on_progress`` gets a report of everything
    so far (``complete=False``, the sessions not run yet in ``not_run``) after each round:
    ``scan --save`` writes it, so that a scan that is stopped (a CI job's time limit, a device
    call's) leaves its finished pairs behind (8x H200, 2026-11-22: the eight-GPU scan was stopped after 48 of
    56 pairs and left nothing). The workers' logs stay in ``log_dir`` when given, else in a temp
    folder kept only when the scan did not end healthy. Raises KernelUnusable when the kernel
    cannot be used in the child."""
    with LogDir.open(log_dir) as logs, interruptible():
        report = _scan(
            plan,
            gpus=gpus,
            log_dir=logs.path,
            on_event=on_event,
            inventory=inventory,
            audit_presets=audit_presets,
            on_progress=on_progress,
            lint=lint,
            lint_notes=tuple(lint_notes),
        )
        if not report.healthy or checked_nothing(report):
            logs.keep()
    return replace(report, log_dir=logs.reported)


class _Stopped(Exception):
    """A session's thread ends early: a session beside it failed, or the scan was interrupted."""


def _scan(
    plan: ScanPlan,
    *,
    gpus: Sequence[int],
    log_dir: Path,
    on_event: Callable[[Event], None] | None,
    inventory: dict[str, Any] | None,
    audit_presets: Sequence[str],
    on_progress: Callable[[ScanReport], None] | None,
    lint: LintResult | None = None,
    lint_notes: tuple[str, ...] = (),
) -> ScanReport:
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    one_at_a_time = threading.Lock()  # on_event is called from every session's thread
    stop = threading.Event()

    def watch(event: Event) -> None:
        if stop.is_set():
            raise _Stopped()
        if on_event is not None:
            with one_at_a_time:
                on_event(event)
        out = event.outcome
        if event.kind is not EventKind.OUTCOME or out is None:
            return
        with one_at_a_time:
            finished.append(out)
        if out.error_kind is ErrorKind.KERNEL_IMPORT:
            raise KernelUnusable(out.error_message or "the kernel could not be resolved")
        why = unusable(out)  # its import killed or hung the child; its baseline raised
        if why is not None:
            raise KernelUnusable(why)

    outcomes: list[Outcome] = []
    finished: list[Outcome] = []  # every probe's outcome as it came, the sessions still running too
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
            hardening=result.hardening,
            explanations=result.explanations,
            unexplained=result.unexplained,
            coverage=coverage(outcomes),
            skipped=plan.skipped + lint_notes,
            log_dir=str(log_dir),
            inventory=inventory or {},
            audit=tuple(
                audit_shape(get_preset(name), DEFAULT_TOKENS) for name in dict.fromkeys(audit_presets)
            ),
            complete=complete,
            not_run=not_run,
            lint=lint,
        )

    # the memcheck follow-up of blind cells (workflows.blind_cells) needs the sanitizer: looked
    # up once; None on the CPU tier, whose cells are never blind that way
    sanitizer = find_compute_sanitizer() if gpus else None
    autotune_env = session_env(plan.autotune, str(log_dir / SCAN_CACHE_DIR))

    def session_outcomes(session: Session) -> list[Outcome]:
        env = {**session.env, **autotune_env}
        return _run_one(session, env=env, log_dir=log_dir, watch=watch, sanitizer=sanitizer, stop=stop)

    rounds = plan.rounds
    ended: list[str] = []  # the sessions whose outcomes are in ``outcomes``
    hung: tuple[str, str] | None = None  # (probe id, reason): the kernel hung on the canonical inputs
    try:
        for done, sessions in enumerate(rounds, start=1):
            if hung is not None:  # every later session would wait out the same timeout
                outcomes.extend(not_run(spec, hung[1], hung[0]) for s in sessions for spec in s.specs)
                ended.extend(s.label for s in sessions)
                continue
            for got in _at_once(sessions, session_outcomes, stop):
                outcomes.extend(got)  # in plan order, whichever session finished first
            ended.extend(s.label for s in sessions)
            hung = next(((o.probe_id, why) for o in outcomes if (why := hang_reason(o)) is not None), None)
            if on_progress is not None and done < len(rounds):
                on_progress(report(False, tuple(s.label for later in rounds[done:] for s in later)))
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM: the probes that finished are saved too, those of the sessions cut
        # short included (a CPU scan is one session: without this nothing at all was kept)
        if on_progress is not None:
            # by probe id: an ended session's outcomes may be new objects (a blind cell settled
            # under memcheck) of probes whose first outcome is also in ``finished``
            have = {o.probe_id for o in outcomes}
            with one_at_a_time:
                outcomes.extend(o for o in finished if o.probe_id not in have)
            on_progress(report(False, tuple(s.label for r in rounds for s in r if s.label not in ended)))
        raise
    return report(True)


def _run_one(
    session: Session,
    *,
    env: Mapping[str, str],
    log_dir: Path,
    watch: Callable[[Event], None],
    sanitizer: SanitizerInfo | None,
    stop: threading.Event,
) -> list[Outcome]:
    """One session's outcomes, its follow-ups after them."""
    specs = list(session.specs)
    got: list[Outcome] = []
    env_first = bool(specs) and specs[0].condition is Condition.INTERPRETER_CHECK
    # a kernel that hangs on the canonical inputs, or needs CUDA on the CPU tier, ends the
    # session there: the cells after it come back skipped, with the reason (diagnose.baseline)
    ran = run_session(specs, base_env=env, log_dir=log_dir, on_event=watch, stop_after=_tier_stop_reason)
    if stop.is_set():
        raise _Stopped()
    if env_first:
        # The environment first, in the same warm child as the cells (one interpreter start,
        # not two): if our own trivial kernel cannot run on this interpreter, the rest of the
        # tier is skipped rather than blamed on the kernel under test.
        env_check, ran = ran[0], ran[1:]
        got.append(env_check)
        if env_check.status is not Status.PASS:
            return got + [_skipped(o.spec, o.notes[0]) for o in ran]
    # follow-up: an invalid-routing cell whose canary could not follow the kernel's own output
    # is re-run alone under memcheck (or stays unchecked, with the reason)
    ran = settle_blind_cells(
        ran, base_env=env, gpu_of_ordinal=session.gpu_of_ordinal, log_dir=log_dir, sanitizer=sanitizer
    )
    got += ran
    # follow-up: a failing int32 boundary cell is re-run with TRITON_DEBUG=1 so the report can
    # name the overflowing source line
    followups = [
        debug_rerun(o.spec)
        for o in ran
        if o.spec.condition in (Condition.INT32_BOUNDARY, Condition.GATHERED_INT32)
        and o.status in (Status.WRONG, Status.ERROR)
    ]
    if followups:
        got += run_session(followups, base_env=env, log_dir=log_dir, on_event=watch)
    return got


def _at_once(
    sessions: Sequence[Session], run: Callable[[Session], list[Outcome]], stop: threading.Event
) -> list[list[Outcome]]:
    """Each session's outcomes, in the order given. One session runs in this thread (signals
    reach its children here, as before rounds existed); several run at once, a thread each. When
    one raises (KernelUnusable) or the scan is interrupted, the others are stopped: their
    children killed, their threads ended at their next event; the first error in plan order is
    raised."""
    if len(sessions) == 1:
        return [run(sessions[0])]
    pool = ThreadPoolExecutor(max_workers=len(sessions), thread_name_prefix="qmoe-doctor-pair")
    futures: list[Future[list[Outcome]]] = []
    try:
        futures = [pool.submit(run, s) for s in sessions]
        wait(futures, return_when=FIRST_EXCEPTION)
        errors = [e for e in (f.exception() for f in futures if f.done()) if e is not None]
        if errors:
            raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
        return [f.result() for f in futures]
    except BaseException:
        stop.set()
        process.kill_all()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def coverage(outcomes: Sequence[Outcome]) -> Coverage:
    """What a verdict over these outcomes covers, from the cells' labels (``core.coverage``)."""
    labels = {c.outcome.probe_id: c.label for c in build_matrix(outcomes).cells.values()}
    return coverage_of(outcomes, labels)


def _tier_stop_reason(outcome: Outcome) -> str | None:
    """``stop_reason``, and a failed environment check: why no cell of the tier runs after it."""
    if outcome.spec.condition is Condition.INTERPRETER_CHECK:
        if outcome.status is Status.PASS:
            return None
        return f"{_why_tier_skipped(outcome)}: {_first_line_of(outcome.error_message) or outcome.status}"
    return stop_reason(outcome)


def _why_tier_skipped(env_check: Outcome) -> str:
    """Why a failed environment check skips the tier: the child never started (a missing or
    broken Python, QMOE_DOCTOR_CHILD_PYTHON), or it started and the interpreter failed."""
    if env_check.status is Status.ERROR and env_check.phase is Phase.SPAWN:
        return "no probe child could start"
    if env_check.status is Status.ERROR and env_check.error_kind is ErrorKind.TIMEOUT:
        return f"the probe child timed out at {env_check.phase} (it never reached the interpreter check)"
    return "the Triton interpreter cannot run here"


def _first_line_of(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[0][:200] if lines else ""


def _skipped(spec: ProbeSpec, reason: str) -> Outcome:
    return Outcome(
        probe_id=spec.probe_id, spec=spec, status=Status.SKIPPED, phase=Phase.SPAWN, notes=(reason,)
    )


def nothing_ran(report: ScanReport) -> bool:
    """No cell of the kernel under test was checked: every one skipped (did not apply, was not
    run, or needs CUDA on the CPU tier), or only the environment check ran."""
    skipped = {c.outcome.probe_id for c in build_matrix(report.outcomes).cells.values() if c.label == "skipped"}
    return bool(report.outcomes) and all(
        o.probe_id in skipped or o.spec.condition is Condition.INTERPRETER_CHECK or o.spec.placement.rerun
        for o in report.outcomes
    )


def not_checked_reason(report: ScanReport) -> str | None:
    """Why the cells of the kernel were not checked when the CPU tier cannot run it (it needs
    CUDA), in one line, or None."""
    for o in report.outcomes:
        if cpu_cannot_run(o):
            return needs_cuda_reason(o)
    return None


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
    "coverage",
    "group_names",
    "not_checked_reason",
    "nothing_ran",
    "plan_scan",
    "report_json",
    "run_scan",
]
