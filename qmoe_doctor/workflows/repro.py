"""The repro engine: reproduce a multi-GPU failure the way users hit it, then shrink it.

Stages (``qmoe-doctor repro``; docs/repro.md):

1. **Pipeline.** A small stack of MoE blocks on the user's kernel, split over the selected GPUs
   as ``device_map="auto"`` splits a model, the first GPU current, trained a few steps and
   checked layer by layer against the torch twin (``probes/pipeline.py``).
2. **Shrink.** The scan's probes for one ordered pair (a = the first GPU, current; b = the GPU
   where the pipeline first diverged, holding the operands), fewest conditions first, stopping
   as soon as the evidence names a cause with high confidence; ``classify`` names it.
3. **Confirm.** When the minimal failing probe faulted on a device access (illegal address,
   signal, canary hit), it is re-run alone under compute-sanitizer memcheck with the caching
   allocator off, and every reported address is attributed to a tensor. NVML's Xid events (and
   the kernel log's Xid lines, where readable) are watched on the pair's GPUs meanwhile
   (``qmoe_doctor.machine.xid``); an Xid 31 fault address is placed like the sanitizer's.
4. **Script.** ``reproscript`` writes a standalone script of the minimal failing condition.

Children, fewest first. A fresh child costs ~5 s (FINDINGS: 4.6-7.8 s), a probe in a warm one
well under 1 s, so everything runs in one warm child where the process state allows:

    child 1: a->b/guarded, a->b/no-peer, a->b/peer, PIPELINE, a->b/producer-race,
             a->b/sizes-race, GPU b/side-stream, GPU b/negative-sizes, GPU b/over-routed

The three pair cells run *before* the pipeline because their preconditions do not survive it:
the pipeline's first ``.to()`` turns peer access a->b on for good, and no-peer needs it off.
They cost a fraction of a second, and together they are the evidence of the most common cause
(missing-device-guard: pointer check without peer access, a remote launch with it), so a kernel
with that fault has its verdict the moment the pipeline has run. The session stops early (the
stop rule, ``stop_reason``) once a cause is named with high confidence, when nothing failed, or
when the guarded baseline failed: the fault then needs no second GPU, and the single-device
ladder runs in a fresh child (REPEAT_CALL needs the process's first call of the kernel):

    child 2 (only then): GPU b/repeat-call, GPU b/single, GPU b/side-stream,
                         GPU b/negative-sizes, GPU b/over-routed

With more than two GPUs, a pipeline that first diverges on a GPU c other than the second one
gets the pair ladder a->c in a child of its own. A poisoning fault (illegal address) retires a
child; ``isolate`` starts the next one.

Planning is ``plan.repro``, the decisions (stop rule, verdict, minimal probe, whether and what
memcheck confirmed) ``diagnose.repro_rules``; this module runs the children and the sanitizer and
assembles the report. The probes' logs go to ``--log-dir`` (kept), or to a ``qmoe-repro-*``
folder in the temp dir that is kept when something failed and removed when nothing did.

No torch here: probes run in children (``isolate``), the sanitizer in a subprocess.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from qmoe_doctor.core import knobs
from qmoe_doctor.core.allocator import read_allocator_snapshot
from qmoe_doctor.core.causes import get_cause
from qmoe_doctor.core.events import Event, EventKind, OnEvent
from qmoe_doctor.core.options import SANITIZER_TIMEOUT_S, ReproOptions
from qmoe_doctor.core.records import (
    Condition,
    Confidence,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Status,
    to_jsonable,
)
from qmoe_doctor.core.reports import (
    ReproReport,
    SanitizerConfirmation,
    SanitizerStatus,
    StageTime,
)
from qmoe_doctor.core.xid import XidReport
from qmoe_doctor.diagnose.repro_rules import (
    StopReason,
    confirmation_from_log,
    is_access_fault,
    minimal_failures,
    pick_verdict,
    sanitizer_decision,
    shrink_cells,
    shrink_outcomes,
    stop_reason,
    summarize_pipeline,
    tensor_tables,
)
from qmoe_doctor.diagnose.sanitizer_log import parse_sanitizer_log
from qmoe_doctor.diagnose.scan_rules import classify
from qmoe_doctor.diagnose.xid import xid_evidence
from qmoe_doctor.isolate.logs import LogDir
from qmoe_doctor.isolate.one_shot import (
    CommandResult,
    RunCommand,
    outcome_from_stdout,
    probe_command,
    run_command,
)
from qmoe_doctor.isolate.process import child_env
from qmoe_doctor.isolate.worker_pool import run_session
from qmoe_doctor.machine.sanitizer import SanitizerInfo, find_compute_sanitizer, sanitizer_command
from qmoe_doctor.machine.xid import XidWatcher
from qmoe_doctor.plan.repro import (
    AFTER_PIPELINE,
    BEFORE_PIPELINE,
    PAIR_LADDER,
    PIPELINE_ID,
    SINGLE_LADDER,
    PairLadder,
    ReproPlan,
    plan_pair,
    plan_repro,
)
from qmoe_doctor.plan.scan import PlannedGpu
from qmoe_doctor.reports.repro_script import SCRIPT_CONDITIONS, render_script, script_name
from qmoe_doctor.workflows.scan import KernelUnusable

SANITIZER_PRINT_LIMIT = 100  # records printed; the summary still counts them all

# ---------------------------------------------------------------------------------------------
# Sanitizer confirmation: re-run the minimal probe under memcheck
# ---------------------------------------------------------------------------------------------


#: Starts watching NVML indices for Xid errors (``XidWatcher``; tests pass a fake NVML).
WatchXid = Callable[[Sequence[int]], XidWatcher]


def confirm_with_sanitizer(
    target: Outcome,
    info: SanitizerInfo,
    *,
    base_env: Mapping[str, str],
    gpu_of_ordinal: Mapping[int, int],
    log_dir: Path,
    timeout_s: float = SANITIZER_TIMEOUT_S,
    runner: RunCommand = run_command,
    python: str | None = None,
    watch_xid: WatchXid | None = XidWatcher,
) -> SanitizerConfirmation:
    """Re-run ``target``'s spec alone under memcheck, with the caching allocator off (it hides
    out-of-bounds accesses inside a pooled segment), and attribute every reported address to
    the tensors of *that* run, on every device (a cross-GPU dereference shows as plain
    out-of-bounds measured against the wrong device's allocation). Xid errors on the run's GPUs
    are watched meanwhile (``watch_xid``; None: not watched)."""
    placement = replace(target.spec.placement, rerun="memcheck")
    spec = replace(
        target.spec,
        probe_id=f"{target.spec.probe_id}+memcheck",
        placement=placement,
        env={},
        fresh_process=False,
    )
    slug = target.spec.probe_id.replace("/", "_").replace(">", "").replace(" ", "_")
    log_path = Path(log_dir) / f"memcheck-{slug}.log"
    argv = probe_command(spec, python)
    cmd = sanitizer_command(info, "memcheck", argv, log_path=log_path, print_limit=SANITIZER_PRINT_LIMIT)
    env = child_env(base_env, {**target.spec.env, knobs.PYTORCH_NO_CUDA_MEMORY_CACHING: "1"})
    xid: XidReport | None = None
    if watch_xid is not None:
        with watch_xid(sorted(set(gpu_of_ordinal.values()))) as watcher:
            result = runner(cmd, env, timeout_s)
        xid = watcher.report()
    else:
        result = runner(cmd, env, timeout_s)
    sanitized = outcome_from_stdout(result.stdout)
    snapshot = read_allocator_snapshot(sanitized.facts.get("allocator_snapshot")) if sanitized else None
    common: dict[str, Any] = {
        "probe_id": target.probe_id,
        "tool": info.path,
        "version": info.version,
        "log_path": str(log_path),
        "wall_s": result.wall_s,
        "xid": xid,
        "xid_evidence": xid_evidence(
            xid,
            tensor_tables(sanitized.tensors) if sanitized else {},
            device_of_gpu={gpu: f"cuda:{o}" for o, gpu in gpu_of_ordinal.items()},
            snapshot=snapshot,
        )
        if xid is not None
        else (),
    }
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    if not text.strip():
        why = "timed out" if result.returncode is None else f"exited with status {result.returncode}"
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or [""]
        return SanitizerConfirmation(
            status="failed",
            reason=f"compute-sanitizer {why} and wrote no log: {tail[0][:200]}",
            sanitized_status=str(sanitized.status) if sanitized else None,
            **common,
        )
    report = parse_sanitizer_log(text)
    return confirmation_from_log(
        report, sanitized, gpu_of_ordinal, common, timed_out=result.returncode is None, snapshot=snapshot
    )


# ---------------------------------------------------------------------------------------------
# The report and the engine
# ---------------------------------------------------------------------------------------------


def report_json(report: ReproReport) -> dict[str, Any]:
    body: dict[str, Any] = to_jsonable(report)
    body["reproduced"] = report.reproduced
    body["faulty"] = report.faulty
    return body


class SessionRunner(Protocol):
    """``isolate.run_session``'s signature: tests pass a fake that runs no child."""

    def __call__(
        self,
        specs: Sequence[ProbeSpec],
        *,
        base_env: Mapping[str, str],
        log_dir: Path,
        on_event: OnEvent | None = None,
    ) -> list[Outcome]: ...


OnProgress = Callable[[float, str], None]  # (seconds since start, message)


class _Stop(Exception):
    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason)
        self.reason = reason


def _label(o: Outcome) -> str:
    if o.status is Status.ERROR:
        return str(o.error_kind or ErrorKind.OTHER)
    return str(o.status)


class _Engine:
    def __init__(
        self,
        plan: ReproPlan,
        opts: ReproOptions,
        *,
        log_dir: Path,
        session_runner: SessionRunner,
        on_progress: OnProgress | None,
        on_event: OnEvent | None,
        clock: Callable[[], float],
    ) -> None:
        self.plan = plan
        self.opts = opts
        self.log_dir = log_dir
        self.session_runner = session_runner
        self.on_progress = on_progress
        self.on_event = on_event
        self.clock = clock
        self.t0 = clock()
        self.outcomes: list[Outcome] = []
        self.stages: list[StageTime] = []

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def say(self, text: str) -> None:
        if self.on_progress is not None:
            self.on_progress(self.elapsed(), text)

    def stage(self, name: str, started: float, detail: str = "") -> None:
        seconds = self.elapsed() - started
        self.stages.append(StageTime(name=name, seconds=seconds, detail=detail))
        self.say(f"{name}: {seconds:.1f} s" + (f" ({detail})" if detail else ""))

    def session(
        self,
        specs: Sequence[ProbeSpec],
        env: Mapping[str, str],
        stop: Callable[[Sequence[Outcome]], StopReason | None],
    ) -> StopReason | None:
        """Run specs in one session (one warm child, more after poisoning faults) until the stop
        rule says enough; the outcomes join ``self.outcomes``."""
        got: list[Outcome] = []

        def watch(event: Event) -> None:
            if self.on_event is not None:
                self.on_event(event)
            if event.kind is EventKind.WORKER_STARTED or event.kind is EventKind.WORKER_RESTARTED:
                self.say(f"worker {event.worker} ready ({event.detail})")
            if event.kind is not EventKind.OUTCOME or event.outcome is None:
                return
            o = event.outcome
            if o.error_kind is ErrorKind.KERNEL_IMPORT:
                raise KernelUnusable(o.error_message or "the kernel could not be resolved")
            got.append(o)
            self.say(f"{o.probe_id}: {_label(o)} ({o.wall_s:.2f} s in the child)")
            reason = stop([*self.outcomes, *got])
            if reason is not None:
                raise _Stop(reason)

        reason: StopReason | None = None
        try:
            returned = self.session_runner(specs, base_env=env, log_dir=self.log_dir, on_event=watch)
            if len(returned) > len(got):  # a runner that reports no events
                got = list(returned)
        except _Stop as stopped:
            reason = stopped.reason
        self.outcomes += got
        return reason


def run_repro(
    plan: ReproPlan,
    opts: ReproOptions,
    gpus: Sequence[PlannedGpu],
    *,
    log_dir: Path | None = None,
    out_dir: Path | None = None,
    session_runner: SessionRunner | None = None,
    find_sanitizer: Callable[[], SanitizerInfo | None] = find_compute_sanitizer,
    command_runner: RunCommand = run_command,
    watch_xid: WatchXid | None = XidWatcher,
    on_progress: OnProgress | None = None,
    on_event: OnEvent | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> ReproReport:
    """Reproduce, shrink, classify, confirm, write the script. ``gpus`` are the planned GPUs in
    pipeline order (for a third GPU's ladder). Raises KernelUnusable when the kernel does not
    resolve in the child. The probes' logs stay in ``log_dir`` when given, else in a temp folder
    kept only when something failed (``report.log_dir`` says where; "" when removed)."""
    with LogDir.open(log_dir, prefix="qmoe-repro-") as logs:
        report = _reproduce(
            plan,
            opts,
            gpus,
            log_dir=logs.path,
            out_dir=out_dir,
            session_runner=session_runner or run_session,
            find_sanitizer=find_sanitizer,
            command_runner=command_runner,
            watch_xid=watch_xid,
            on_progress=on_progress,
            on_event=on_event,
            clock=clock,
        )
        if report.faulty or report.could_not_run:
            logs.keep()
    return replace(report, log_dir=logs.reported)


def _reproduce(
    plan: ReproPlan,
    opts: ReproOptions,
    gpus: Sequence[PlannedGpu],
    *,
    log_dir: Path,
    out_dir: Path | None,
    session_runner: SessionRunner,
    find_sanitizer: Callable[[], SanitizerInfo | None],
    command_runner: RunCommand,
    watch_xid: WatchXid | None,
    on_progress: OnProgress | None,
    on_event: OnEvent | None,
    clock: Callable[[], float],
) -> ReproReport:
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    runner = session_runner
    eng = _Engine(
        plan,
        opts,
        log_dir=log_dir,
        session_runner=runner,
        on_progress=on_progress,
        on_event=on_event,
        clock=clock,
    )
    ladder = plan.ladder
    names = dict(ladder.names)
    ladder_of = dict.fromkeys(ladder.names, ladder)  # probe-id group -> the ladder that planned it
    notes: list[str] = []

    pair_ordinal = 1  # the ordinal of b in child 1's numbering (plan.gpu_of_ordinal)

    def pair_stop(outcomes: Sequence[Outcome]) -> StopReason | None:
        return stop_reason(
            outcomes,
            kernel=plan.kernel,
            names=names,
            pair_ordinal=pair_ordinal,
            gpu_of_ordinal=plan.gpu_of_ordinal,
        )

    # --- child 1: pair cells, pipeline, the rest of the pair ladder ---
    t = eng.elapsed()
    eng.say(
        f"pipeline: {plan.pipeline.params['layers']} layers of {opts.preset} over "
        + ", ".join(f"GPU {g}" for g in plan.gpus)
        + f", GPU {plan.gpus[0]} current, {opts.steps} steps; shrink ladder GPU {ladder.a} -> GPU {ladder.b}"
    )
    stop = eng.session(plan.first_session, plan.env, pair_stop)
    pipe = next((o for o in eng.outcomes if o.spec.condition is Condition.PIPELINE), None)
    summary = summarize_pipeline(pipe, plan.gpu_of_ordinal) if pipe is not None else None
    eng.stage("pipeline and pair ladder", t, f"stopped: {stop}" if stop else "ladder done")
    if summary is not None:
        eng.say("pipeline: " + summary.describe())

    # --- the other pair, when the pipeline diverged on a third GPU ---
    if stop == "other-pair" and summary is not None and summary.gpu is not None:
        other = next(g for g in gpus if g.index == summary.gpu)
        pair_ordinal = summary.ordinal if summary.ordinal is not None else pair_ordinal
        ladder = plan_pair(plan.kernel, gpus[0], other, opts)
        names.update(ladder.names)
        ladder_of.update(dict.fromkeys(ladder.names, ladder))
        t = eng.elapsed()
        stop = eng.session(ladder.specs(PAIR_LADDER), ladder.env, pair_stop)
        eng.stage(
            f"pair ladder GPU {ladder.a} -> GPU {ladder.b}", t, f"stopped: {stop}" if stop else "ladder done"
        )

    # --- child 2: the guarded baseline failed, so the fault needs no second GPU ---
    if stop == "guarded-failed":
        t = eng.elapsed()

        def single_stop(outcomes: Sequence[Outcome]) -> StopReason | None:
            result = classify(shrink_outcomes(outcomes), kernel=plan.kernel, gpu_names=names)
            return "verdict" if any(d.confidence is Confidence.HIGH for d in result.diagnoses) else None

        notes.append(
            f"the guarded baseline (GPU {ladder.b} current) failed too: the fault needs no second GPU; "
            f"ran the single-device ladder on GPU {ladder.b}"
        )
        stop = eng.session(ladder.specs(SINGLE_LADDER), ladder.env, single_stop) or stop
        eng.stage(f"single-device ladder on GPU {ladder.b}", t, f"stopped: {stop}")

    # --- classification ---
    shrink = shrink_outcomes(eng.outcomes)
    result = classify(shrink, kernel=plan.kernel, gpu_names=names)
    run_order = [o.probe_id for o in eng.outcomes]
    verdict = pick_verdict(result.diagnoses, run_order)
    minimal = minimal_failures(eng.outcomes, verdict)
    time_to_verdict = eng.elapsed()
    if verdict is not None:
        eng.say(f"verdict: {verdict.cause} ({verdict.confidence}) after {time_to_verdict:.1f} s")
    elif minimal:
        eng.say(f"no cause named; failing probes: {', '.join(o.probe_id for o in minimal)}")
    else:
        eng.say(f"nothing failed after {time_to_verdict:.1f} s")
    if summary is not None and summary.failed and not minimal:
        notes.append(
            "the pipeline failed but no single probe of the ladder did: the failure needs the whole "
            "model's state; `qmoe-doctor scan` runs every condition on every pair"
        )

    spawn_only = bool(eng.outcomes) and all(
        o.status is Status.ERROR and o.phase is Phase.SPAWN for o in eng.outcomes
    )
    if spawn_only:
        notes.append("no probe child could start: nothing was tested (see the worker logs)")
        minimal = ()

    # --- sanitizer ---
    t = eng.elapsed()
    info = find_sanitizer() if opts.sanitizer and any(is_access_fault(o) for o in minimal) else None
    decision = sanitizer_decision(minimal, info, enabled=opts.sanitizer)
    if decision.run and decision.target is not None and info is not None:
        eng.say(f"sanitizer: {decision.reason}")
        own = ladder_of.get(decision.target.spec.placement.group, ladder)
        confirmation = confirm_with_sanitizer(
            decision.target,
            info,
            base_env=own.env,
            gpu_of_ordinal={0: own.a, 1: own.b},
            log_dir=log_dir,
            timeout_s=opts.sanitizer_timeout_s,
            runner=command_runner,
            watch_xid=watch_xid,
        )
    else:
        status: SanitizerStatus = (
            "unavailable" if decision.target is not None and opts.sanitizer else "not-run"
        )
        confirmation = SanitizerConfirmation(
            status=status,
            reason=decision.reason,
            probe_id=decision.target.probe_id
            if decision.target
            else (minimal[0].probe_id if minimal else None),
        )
    eng.stage("sanitizer", t, confirmation.status)

    # --- standalone script ---
    script_path: str | None = None
    script_note = ""
    if minimal:
        first = minimal[0]
        own = ladder_of.get(first.spec.placement.group, ladder)
        if first.spec.condition in SCRIPT_CONDITIONS:
            out = Path(out_dir) if out_dir is not None else Path.cwd()
            out.mkdir(parents=True, exist_ok=True)
            path = out / script_name(verdict.cause if verdict else None, first.spec.condition)
            cause_title = get_cause(verdict.cause).title if verdict else "no cause named"
            source = render_script(
                first.spec,
                cause=verdict.cause if verdict else None,
                cause_title=cause_title,
                gpus=(own.a, own.b),
                cuda_visible_devices=own.env.get(knobs.CUDA_VISIBLE_DEVICES),
            )
            path.write_text(source, encoding="utf-8")
            with contextlib.suppress(OSError):
                path.chmod(0o755)
            script_path = str(path)
            script_note = f"python {path}  (exit 1 = reproduced, 0 = passed)"
            eng.say(f"script: {path}")
        else:
            script_note = f"no script template for the {first.spec.condition} condition"
    else:
        script_note = "no failing probe to write a script for"

    return ReproReport(
        kernel=plan.kernel,
        started=started,
        gpus=plan.gpus,
        pair=(ladder.a, ladder.b),
        pipeline=summary,
        outcomes=tuple(eng.outcomes),
        tried=tuple(run_order),
        diagnoses=result.diagnoses,
        explanations=result.explanations,
        unexplained=result.unexplained,
        verdict=verdict.cause if verdict else None,
        minimal=tuple(o.probe_id for o in minimal),
        stop=stop,
        sanitizer=confirmation,
        script=script_path,
        script_note=script_note,
        stages=tuple(eng.stages),
        time_to_verdict_s=time_to_verdict,
        wall_s=eng.elapsed(),
        log_dir=str(log_dir),
        notes=tuple(notes),
    )


__all__ = [
    "AFTER_PIPELINE",
    "BEFORE_PIPELINE",
    "PIPELINE_ID",
    "SINGLE_LADDER",
    "CommandResult",
    "PairLadder",
    "ReproPlan",
    "SessionRunner",
    "WatchXid",
    "confirm_with_sanitizer",
    "plan_repro",
    "report_json",
    "run_repro",
    "shrink_cells",
]
