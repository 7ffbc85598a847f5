"""The parallel modes' engine: plan -> one launch per mode -> classify per rank -> report.

``qmoe-doctor parallel --modes dp,pp,tp,ep`` (``plan.parallel`` plans the launches, ``core.modes``
says how each mode is launched). A torchrun launch is ``python -m torch.distributed.run
--nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m qmoe_doctor.probes.parallel.rank
--spec SPEC --out DIR``: a fresh interpreter per rank (never a fork after CUDA init), a fresh free
port per launch on one node, the user's endpoint across nodes (every node runs the same command;
docs/parallel.md); pp and the one-device baseline run the rank module alone. Every rank's
environment carries ``knobs.NVLS_OFF``. ``isolate.torchrun`` starts, waits, kills and reads every
rank back (a rank that died becomes an Outcome from its exit status, last breadcrumb and log
tail); ``diagnose.parallel_rules`` names the causes per rank; this module builds the command
line, summarizes each mode (correctness, tokens/s, speedup against one GPU) and the report.

The ranks' logs go to ``--log-dir`` (kept), or to a ``qmoe-doctor-parallel-*`` folder in the temp
dir that is kept when the run found something or could not run, and removed when it was healthy.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qmoe_doctor.core import knobs
from qmoe_doctor.core.error_kind import describe_exit
from qmoe_doctor.core.events import Event, EventKind, OnEvent
from qmoe_doctor.core.modes import Mode
from qmoe_doctor.core.options import ParallelOptions
from qmoe_doctor.core.records import ErrorKind, Outcome, Phase, Status, to_json, to_jsonable
from qmoe_doctor.core.reports import ModeResult, ParallelReport
from qmoe_doctor.diagnose.parallel_rules import classify_parallel, describe_outcome, number
from qmoe_doctor.isolate import torchrun
from qmoe_doctor.isolate.logs import LogDir
from qmoe_doctor.isolate.process import child_env, child_python
from qmoe_doctor.isolate.torchrun import RANK_MODULE, TORCHRUN_MODULE, collect_run, free_port
from qmoe_doctor.plan.parallel import ParallelPlan, ParallelPlanError, PlannedRun, parse_modes, plan_parallel

# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------


def build_command(
    run: PlannedRun,
    spec_path: Path,
    run_dir: Path,
    *,
    python: str,
    opts: ParallelOptions,
    port: int | None = None,
) -> list[str]:
    """The command line of one launch (torchrun for dp/tp/ep, the rank module alone otherwise)."""
    rank_args = ["-m", RANK_MODULE, "--spec", str(spec_path), "--out", str(run_dir)]
    if not run.torchrun:
        return [python, *rank_args]
    endpoint = opts.rdzv_endpoint or f"localhost:{port or free_port()}"
    return [
        python,
        "-m",
        TORCHRUN_MODULE,
        "--nnodes",
        str(opts.nnodes),
        "--nproc-per-node",
        str(run.nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        f"{opts.rdzv_id}-{run.mode.value}",
        "--max-restarts",
        "0",
        *rank_args,
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchRecord:
    """What happened to one launch, for the report and for reproducing it."""

    mode: Mode
    command: tuple[str, ...]
    run_dir: str
    exit_code: int | None
    timed_out: bool
    wall_s: float


def launch_run(
    run: PlannedRun,
    run_dir: Path,
    *,
    opts: ParallelOptions,
    python: str | None = None,
    on_event: OnEvent | None = None,
) -> tuple[LaunchRecord, list[Outcome]]:
    """Start one launch, wait for it (at most ``opts.timeout_s``), and read every rank's Outcome
    (``isolate.torchrun``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(to_json(run.spec) + "\n")
    command = build_command(run, spec_path, run_dir, python=child_python(python), opts=opts)
    emit = on_event or (lambda event: None)
    emit(Event(kind=EventKind.RUN_STARTED, mode=run.mode, detail=" ".join(command)))
    end = torchrun.launch(
        command,
        env=child_env(run.env),  # os.environ + the run's + FORCED_ENV (NVLink multicast off)
        run_dir=run_dir,
        timeout_s=opts.timeout_s,
        on_result=lambda o: emit(Event(kind=EventKind.RANK_DONE, mode=run.mode, outcome=o)),
    )
    record = LaunchRecord(
        mode=run.mode,
        command=tuple(command),
        run_dir=str(run_dir),
        exit_code=end.exit_code,
        timed_out=end.timed_out,
        wall_s=end.wall_s,
    )
    outcomes = collect_run(
        run, run_dir, exit_code=end.exit_code, timed_out=end.timed_out, timeout_s=opts.timeout_s
    )
    emit(Event(kind=EventKind.RUN_FINISHED, mode=run.mode, detail=describe_exit(end.exit_code)))
    return record, outcomes


# ---------------------------------------------------------------------------------------------
# Summaries and the report
# ---------------------------------------------------------------------------------------------


_SEVERITY = {Status.PASS: 0, Status.SKIPPED: 1, Status.WRONG: 2, Status.ERROR: 3}


def summarize(run: PlannedRun, record: LaunchRecord, outcomes: Sequence[Outcome]) -> ModeResult:
    status = max((o.status for o in outcomes), key=lambda s: _SEVERITY[s], default=Status.ERROR)
    errors = [o.rel_error for o in outcomes if o.rel_error is not None]
    steps = [number(o.facts.get("parallel.step_ms")) for o in outcomes]
    timed = [s for s in steps if s is not None]
    step_ms = max(timed) if timed and len(timed) == len(steps) else None  # every rank timed
    tokens = run.spec.params.get("tokens")
    tps = tokens / (step_ms / 1e3) if isinstance(tokens, int) and step_ms else None
    return ModeResult(
        mode=run.mode,
        world_size=run.world_size,
        devices_used=run.devices_used,
        torchrun=run.torchrun,
        nproc=run.nproc,
        shape=run.spec.shape,
        seed=run.spec.seed,
        cuda_visible_devices=run.env.get(knobs.CUDA_VISIBLE_DEVICES),
        status=status,
        ranks=tuple(o.probe_id for o in outcomes),
        max_rel_error=max(errors) if errors else None,
        tolerance=next((o.tolerance for o in outcomes if o.tolerance is not None), None),
        step_ms=step_ms,
        tokens_per_step=tokens if isinstance(tokens, int) else None,
        tokens_per_s=tps,
        command=record.command,
        run_dir=record.run_dir,
        exit_code=record.exit_code,
        timed_out=record.timed_out,
        wall_s=record.wall_s,
    )


def with_scaling(results: Sequence[ModeResult]) -> list[ModeResult]:
    """Speedup and efficiency of each mode against the one-device baseline, when both ran."""
    base = next((r for r in results if r.mode is Mode.SINGLE and r.status is Status.PASS), None)
    if base is None or not base.tokens_per_s:
        return list(results)
    out = []
    for r in results:
        if r.tokens_per_s and r.mode is not Mode.SINGLE:
            speedup = r.tokens_per_s / base.tokens_per_s
            r = replace(r, speedup=speedup, efficiency=speedup / max(1, r.devices_used))
        elif r.mode is Mode.SINGLE:
            r = replace(r, speedup=1.0, efficiency=1.0)
        out.append(r)
    return out


def run_parallel(
    plan: ParallelPlan,
    *,
    log_dir: Path | None = None,
    python: str | None = None,
    on_event: OnEvent | None = None,
) -> ParallelReport:
    """Every launch of the plan in turn, then the classification of all ranks. The ranks' logs
    stay in ``log_dir`` when given, else in a temp folder kept only when the run was not
    healthy (``report.log_dir`` says where; "" when removed)."""
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    with LogDir.open(log_dir, prefix="qmoe-doctor-parallel-") as logs:
        results: list[ModeResult] = []
        outcomes: list[Outcome] = []
        for run in plan.runs:
            run_dir = _fresh_dir(logs.path, run.mode.value)
            record, run_outcomes = launch_run(
                run, run_dir, opts=plan.options, python=python, on_event=on_event
            )
            outcomes += run_outcomes
            results.append(summarize(run, record, run_outcomes))
        result = classify_parallel(
            outcomes,
            kernel=plan.kernel,
            gpu_of_ordinal=plan.gpu_of_ordinal,
            gpus=plan.gpus,
            cpu=plan.tier == "cpu",
        )
        o = plan.options
        report = ParallelReport(
            kernel=plan.kernel,
            tier=plan.tier,
            started=started,
            wall_s=time.perf_counter() - t0,
            preset=str(o.preset),
            tokens=int(o.tokens or 0),
            dtype=str(o.dtype),
            backend=str(o.backend),
            gpus=plan.gpus,
            gpu_of_ordinal=dict(plan.gpu_of_ordinal),
            modes=tuple(with_scaling(results)),
            outcomes=tuple(outcomes),
            diagnoses=result.diagnoses,
            explanations=result.explanations,
            unexplained=result.unexplained,
            skipped=plan.skipped,
        )
        if not report.healthy or nothing_ran(report):
            logs.keep()
    if not logs.kept:  # removed: no run folder to point at
        report = replace(report, modes=tuple(replace(m, run_dir="") for m in report.modes))
    return replace(report, log_dir=logs.reported)


def _fresh_dir(root: Path, name: str) -> Path:
    path = root / name
    n = 1
    while path.exists():
        n += 1
        path = root / f"{name}-{n}"
    return path


def report_json(report: ParallelReport) -> dict[str, Any]:
    body: dict[str, Any] = to_jsonable(report)
    body["healthy"] = report.healthy
    return body


def kernel_import_failure(report: ParallelReport) -> Outcome | None:
    """The first rank that could not resolve the kernel reference (a usage error)."""
    return next((o for o in report.outcomes if o.error_kind is ErrorKind.KERNEL_IMPORT), None)


def nothing_ran(report: ParallelReport) -> bool:
    """No rank got past its imports: the check itself could not run (torch missing, ...)."""
    return not report.outcomes or all(
        o.status is Status.ERROR and o.phase in (Phase.SPAWN, Phase.IMPORT) for o in report.outcomes
    )


__all__ = [
    "LaunchRecord",
    "ParallelPlan",
    "ParallelPlanError",
    "build_command",
    "describe_outcome",
    "kernel_import_failure",
    "launch_run",
    "nothing_ran",
    "parse_modes",
    "plan_parallel",
    "report_json",
    "run_parallel",
    "summarize",
    "with_scaling",
]
