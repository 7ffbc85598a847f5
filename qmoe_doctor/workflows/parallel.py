"""Parallel modes (parent side, never imports torch): plan, launch, collect, classify per rank.

``qmoe-doctor scan --parallel dp,pp,tp,ep`` runs our MoE block (forward and backward) the four
ways users scale it, one launch per mode, each rank compared with a single-device run of the
same weights and inputs that the rank makes itself (``probes/parallel/modes.py``):

=====  ======================================================  ==================================
mode   how                                                     launched as
=====  ======================================================  ==================================
dp     DistributedDataParallel, gradients all-reduced          torchrun, one rank per GPU
tp     gate_up by columns, down by rows, outputs all-reduced   torchrun, one rank per GPU
ep     experts sharded, tokens dispatched by all-to-all        torchrun, one rank per GPU
pp     layers over the GPUs of one process (device_map)        one process, no torchrun
single the block on one GPU: the tokens/s baseline             one process, no torchrun
=====  ======================================================  ==================================

A torchrun launch is ``python -m torch.distributed.run --nproc-per-node N --rdzv-backend c10d
--rdzv-endpoint HOST:PORT -m qmoe_doctor.probes.parallel.rank --spec SPEC --out DIR``: a fresh
interpreter per rank (never a fork after CUDA init), a fresh free port per launch on one node,
the user's endpoint across nodes (every node runs the same command; docs/parallel.md). Every
rank's environment carries ``knobs.NVLS_OFF``. Each rank writes ``rank-R.json`` (its Outcome),
``rank-R.crumbs`` (breadcrumbs and facts as they happen) and ``rank-R.log`` in the run's
directory; the parent reads them back. A rank that died becomes an Outcome from its exit status
(torchrun's failure summary names it), its last breadcrumb and its log tail, as ``isolate``
does for probes. On timeout the parent asks every rank for its stacks (SIGUSR1), then kills each
rank's process group (torchrun starts every rank in a session of its own) and the launcher's.

Classification: ``classify.classify`` on the per-rank outcomes (labels, the generic rules such
as launch-config-fault, the failing cells), then the parallel rules of ``classify_parallel``:
``device-never-set`` and ``invalid-routing`` under expert parallelism, named per rank, and ranks
that failed only because another rank did (stopped by torchrun, or fed wrong rows by another
rank's experts) explained rather than counted.
"""

from __future__ import annotations

import datetime as _dt
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast, get_args

from qmoe_doctor import __version__
from qmoe_doctor.core import knobs
from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.error_kind import describe_exit
from qmoe_doctor.core.events import Event as ParallelEvent
from qmoe_doctor.core.events import EventKind, OnEvent
from qmoe_doctor.core.records import (
    SCHEMA_VERSION,
    Condition,
    Confidence,
    Diagnosis,
    ErrorKind,
    Evidence,
    Outcome,
    Phase,
    ProbeSpec,
    Shape,
    Status,
    to_json,
    to_jsonable,
)
from qmoe_doctor.core.shapes import PRESETS, get_preset
from qmoe_doctor.diagnose.matrix import cell_label
from qmoe_doctor.diagnose.scan_rules import Classification, classify
from qmoe_doctor.isolate import torchrun
from qmoe_doctor.isolate.process import child_env, child_python
from qmoe_doctor.isolate.torchrun import (
    RANK_MODULE,
    TORCHRUN_MODULE,
    Crumbs,
    RankExit,
    collect_run,
    free_port,
    parse_torchrun_failures,
)
from qmoe_doctor.plan.scan import PlannedGpu

#: Seconds one launch may take, start-up and compilation included (a 30B-preset run on H200:
#: import, NCCL set-up, compile from a warm cache, four passes: well under a minute).
DEFAULT_RUN_TIMEOUT_S = 300.0


DType = Literal["bfloat16", "float16", "float32"]


class Mode(StrEnum):
    SINGLE = "single"  # the one-device baseline
    DP = "dp"
    PP = "pp"
    TP = "tp"
    EP = "ep"


CONDITION_OF: Mapping[Mode, Condition] = {
    Mode.SINGLE: Condition.PARALLEL_SINGLE,
    Mode.DP: Condition.PARALLEL_DP,
    Mode.PP: Condition.PARALLEL_PP,
    Mode.TP: Condition.PARALLEL_TP,
    Mode.EP: Condition.PARALLEL_EP,
}
MODE_OF: Mapping[Condition, Mode] = {c: m for m, c in CONDITION_OF.items()}
#: Modes that run one process per GPU under torchrun (the others run in one process).
TORCHRUN_MODES = frozenset({Mode.DP, Mode.TP, Mode.EP})
USER_MODES = (Mode.DP, Mode.PP, Mode.TP, Mode.EP)


class ParallelPlanError(ValueError):
    """The options cannot make a run (sizes that do not split over the ranks, too few GPUs)."""


def parse_modes(text: str) -> tuple[Mode, ...]:
    """``"dp,pp,tp,ep"`` -> modes in the order given; a ParallelPlanError names a bad one."""
    modes: list[Mode] = []
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        try:
            mode = Mode(part)
        except ValueError:
            known = ", ".join(m.value for m in USER_MODES)
            raise ParallelPlanError(f"unknown parallel mode {part!r}; known: {known}") from None
        if mode not in modes:
            modes.append(mode)
    if not modes:
        raise ParallelPlanError("no parallel mode given; use e.g. --parallel dp,pp,tp,ep")
    return tuple(modes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelOptions:
    """What to run. ``None`` fields take the tier's default (``resolved``)."""

    modes: tuple[Mode, ...] = USER_MODES
    preset: str | None = None  # GPU: qwen3-30b-a3b; CPU: tiny
    tokens: int | None = None  # global tokens per step. GPU: 16384; CPU: 16
    steps: int | None = None  # timed steps. GPU: 5; CPU: 0 (interpreter timings mean nothing)
    warmup: int | None = None  # untimed steps after the checked one. GPU: 1; CPU: 0
    layers: int | None = None  # pp: blocks in the stack (default 2 per GPU)
    seed: int = 0
    dtype: str | None = None  # GPU: bfloat16; CPU: float32 (bf16 tl.dot is broken in the interpreter)
    backend: str | None = None  # GPU: nccl; CPU: gloo
    baseline: bool | None = None  # run the one-device baseline for tokens/s. GPU: yes; CPU: no
    nproc_per_node: int | None = None  # GPU: one per selected GPU; CPU: 2 processes
    nnodes: int = 1
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous (None: localhost, a free port)
    rdzv_id: str = "qmoe-doctor"
    timeout_s: float = DEFAULT_RUN_TIMEOUT_S
    inject: dict[str, Any] | None = None  # self-tests of the orchestration (probes/parallel/rank.py)

    def resolved(self, *, cpu: bool, n_devices: int) -> ParallelOptions:
        return replace(
            self,
            preset=self.preset or ("tiny" if cpu else "qwen3-30b-a3b"),
            tokens=self.tokens if self.tokens is not None else (16 if cpu else 16384),
            steps=self.steps if self.steps is not None else (0 if cpu else 5),
            warmup=self.warmup if self.warmup is not None else (0 if cpu else 1),
            dtype=self.dtype or ("float32" if cpu else "bfloat16"),
            backend=self.backend or ("gloo" if cpu else "nccl"),
            baseline=self.baseline if self.baseline is not None else not cpu,
            nproc_per_node=self.nproc_per_node or (2 if cpu else n_devices),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedRun:
    """One launch: a mode, its spec (written to ``spec.json``), how many local processes."""

    mode: Mode
    spec: ProbeSpec  # the template each rank reads; probe_id is the mode
    nproc: int  # local processes (1: pp and single, no torchrun)
    world_size: int  # nproc x nnodes
    devices_used: int  # GPUs (or CPU processes) one step of the mode uses, for the efficiency
    env: dict[str, str]  # environment on top of os.environ (CUDA_VISIBLE_DEVICES, ...)

    @property
    def torchrun(self) -> bool:
        return self.mode in TORCHRUN_MODES


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    kernel: str
    tier: str  # "gpu" or "cpu"
    options: ParallelOptions  # resolved
    runs: tuple[PlannedRun, ...]
    gpus: tuple[int, ...] = ()  # NVML indices, in --gpus order
    gpu_of_ordinal: dict[int, int] = field(default_factory=dict)  # child ordinal -> NVML index
    skipped: tuple[str, ...] = ()


def plan_parallel(
    kernel: str, gpus: Sequence[PlannedGpu], opts: ParallelOptions | None = None, *, cpu: bool = False
) -> ParallelPlan:
    """The launches for ``opts.modes`` over the selected GPUs (or CPU processes with ``cpu``).

    Raises ParallelPlanError when the sizes do not split over the ranks."""
    opts = opts or ParallelOptions()
    cpu = cpu or not gpus
    o = opts.resolved(cpu=cpu, n_devices=len(gpus))
    assert o.preset is not None and o.tokens is not None and o.nproc_per_node is not None  # resolved
    if o.preset not in PRESETS:
        raise ParallelPlanError(f"unknown preset {o.preset!r}; known: {', '.join(PRESETS)}")
    if o.nnodes < 1 or o.nproc_per_node < 1 or o.tokens < 1:
        raise ParallelPlanError("--nnodes, processes per node and --tokens must be positive")
    if o.nnodes > 1 and not o.rdzv_endpoint:
        raise ParallelPlanError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if not cpu and o.nproc_per_node > len(gpus):
        raise ParallelPlanError(f"{o.nproc_per_node} processes per node but {len(gpus)} GPU(s) selected")
    if o.dtype not in get_args(DType):
        raise ParallelPlanError(f"dtype must be one of {', '.join(get_args(DType))}, got {o.dtype!r}")
    dtype = cast(DType, o.dtype)
    shape = get_preset(o.preset)
    world = o.nproc_per_node * o.nnodes
    devices: list[int | None] = [None] * o.nproc_per_node if cpu else list(range(o.nproc_per_node))
    env: dict[str, str] = (
        {knobs.TRITON_INTERPRET: "1", knobs.CUDA_VISIBLE_DEVICES: ""}
        if cpu
        else knobs.pin_gpus(g.uuid for g in gpus[: o.nproc_per_node])
    )
    skipped: list[str] = []
    runs: list[PlannedRun] = []
    n_local_devices = len(devices)
    modes = list(o.modes)
    if o.baseline and Mode.SINGLE not in modes:
        modes.insert(0, Mode.SINGLE)
    for mode in modes:
        reason = _does_not_fit(
            mode, shape.num_experts, shape.intermediate, o.tokens, world, n_local_devices, cpu
        )
        if reason:
            if mode in o.modes and world > 1:
                raise ParallelPlanError(f"{mode}: {reason}")
            skipped.append(f"{mode}: {reason}")
            continue
        layers = (o.layers or 2 * n_local_devices) if mode is Mode.PP else 1
        params: dict[str, Any] = {
            "mode": mode.value,
            "preset": o.preset,
            "tokens": o.tokens,
            "layers": layers,
            "steps": o.steps,
            "warmup": o.warmup,
            "backend": o.backend,
            "devices": devices if mode in TORCHRUN_MODES or mode is Mode.PP else devices[:1],
            "pg_timeout_s": o.timeout_s,
        }
        if o.inject:
            params["inject"] = dict(o.inject)
        n, k = shape.gate_up_nk
        spec = ProbeSpec(
            probe_id=mode.value,
            kernel=kernel,
            condition=CONDITION_OF[mode],
            device=devices[0],
            current=devices[0],
            shape=Shape(
                m=o.tokens * shape.top_k, e=shape.num_experts, n=n, k=k, dtype=dtype, routing="random"
            ),
            seed=o.seed,
            params=params,
            timeout_s=o.timeout_s,
        )
        torchrun = mode in TORCHRUN_MODES
        runs.append(
            PlannedRun(
                mode=mode,
                spec=spec,
                nproc=o.nproc_per_node if torchrun else 1,
                world_size=world if torchrun else 1,
                devices_used=world if torchrun else (n_local_devices if mode is Mode.PP else 1),
                env=dict(env),
            )
        )
    if cpu:
        skipped.append(
            "CPU tier: ranks are CPU processes (gloo, Triton interpreter, float32): the orchestration, "
            "sharding and collectives are checked; device placement and NCCL need GPUs"
        )
    return ParallelPlan(
        kernel=kernel,
        tier="cpu" if cpu else "gpu",
        options=o,
        runs=tuple(runs),
        gpus=tuple(g.index for g in gpus[: o.nproc_per_node]) if not cpu else (),
        gpu_of_ordinal={} if cpu else {i: g.index for i, g in enumerate(gpus[: o.nproc_per_node])},
        skipped=tuple(skipped),
    )


def _does_not_fit(
    mode: Mode, experts: int, intermediate: int, tokens: int, world: int, local: int, cpu: bool
) -> str | None:
    where = "processes" if cpu else "GPUs"
    if mode is Mode.PP:
        return None if local >= 2 else f"needs two {where} in one process (one selected)"
    if mode is Mode.SINGLE:
        return None
    if world < 2:
        return f"needs two {where} or more (one selected)"
    if mode in (Mode.DP, Mode.EP) and tokens % world:
        return f"{tokens} tokens do not split evenly over {world} ranks (--tokens)"
    if mode is Mode.EP and experts % world:
        return f"{experts} experts do not split evenly over {world} ranks"
    if mode is Mode.TP and intermediate % world:
        return f"moe_intermediate_size {intermediate} does not split evenly over {world} ranks"
    return None


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
    emit(ParallelEvent(kind=EventKind.RUN_STARTED, mode=run.mode, detail=" ".join(command)))
    end = torchrun.launch(
        command,
        env=child_env(run.env),  # os.environ + the run's + FORCED_ENV (NVLink multicast off)
        run_dir=run_dir,
        timeout_s=opts.timeout_s,
        on_result=lambda o: emit(ParallelEvent(kind=EventKind.RANK_DONE, mode=run.mode, outcome=o)),
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
    emit(ParallelEvent(kind=EventKind.RUN_FINISHED, mode=run.mode, detail=describe_exit(end.exit_code)))
    return record, outcomes


# ---------------------------------------------------------------------------------------------
# Summaries and the report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeResult:
    """One mode over its ranks: correctness and throughput against one GPU."""

    mode: Mode
    world_size: int
    devices_used: int
    status: Status  # the worst rank's
    ranks: tuple[str, ...]  # probe ids of its outcomes
    max_rel_error: float | None = None
    tolerance: float | None = None
    step_ms: float | None = None  # the slowest rank's median step
    tokens_per_step: int | None = None
    tokens_per_s: float | None = None
    speedup: float | None = None  # tokens/s over the one-device baseline's
    efficiency: float | None = None  # speedup / devices used
    command: tuple[str, ...] = ()
    run_dir: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    wall_s: float = 0.0


_SEVERITY = {Status.PASS: 0, Status.SKIPPED: 1, Status.WRONG: 2, Status.ERROR: 3}


def summarize(run: PlannedRun, record: LaunchRecord, outcomes: Sequence[Outcome]) -> ModeResult:
    status = max((o.status for o in outcomes), key=lambda s: _SEVERITY[s], default=Status.ERROR)
    errors = [o.rel_error for o in outcomes if o.rel_error is not None]
    steps = [_num(o.facts.get("parallel.step_ms")) for o in outcomes]
    timed = [s for s in steps if s is not None]
    step_ms = max(timed) if timed and len(timed) == len(steps) else None  # every rank timed
    tokens = run.spec.params.get("tokens")
    tps = tokens / (step_ms / 1e3) if isinstance(tokens, int) and step_ms else None
    return ModeResult(
        mode=run.mode,
        world_size=run.world_size,
        devices_used=run.devices_used,
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


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    kernel: str
    tier: str
    started: str
    wall_s: float
    preset: str
    tokens: int
    dtype: str
    backend: str
    gpus: tuple[int, ...]
    gpu_of_ordinal: dict[int, int]
    modes: tuple[ModeResult, ...]
    outcomes: tuple[Outcome, ...]
    diagnoses: tuple[Diagnosis, ...]
    explanations: tuple[str, ...] = ()
    unexplained: tuple[Evidence, ...] = ()
    skipped: tuple[str, ...] = ()
    log_dir: str = ""

    @property
    def healthy(self) -> bool:
        return not self.diagnoses and not self.unexplained


def run_parallel(
    plan: ParallelPlan,
    *,
    log_dir: Path | None = None,
    python: str | None = None,
    on_event: OnEvent | None = None,
) -> ParallelReport:
    """Every launch of the plan in turn, then the classification of all ranks."""
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="qmoe-doctor-parallel-"))
    root.mkdir(parents=True, exist_ok=True)
    results: list[ModeResult] = []
    outcomes: list[Outcome] = []
    for run in plan.runs:
        run_dir = _fresh_dir(root, run.mode.value)
        record, run_outcomes = launch_run(run, run_dir, opts=plan.options, python=python, on_event=on_event)
        outcomes += run_outcomes
        results.append(summarize(run, record, run_outcomes))
    result = classify_parallel(outcomes, kernel=plan.kernel, plan=plan)
    o = plan.options
    return ParallelReport(
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
        log_dir=str(root),
    )


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


# ---------------------------------------------------------------------------------------------
# Classification
# ---------------------------------------------------------------------------------------------


def _ev(outcome: Outcome, detail: str, label: str | None = None) -> Evidence:
    return Evidence(
        probe_id=outcome.probe_id,
        condition=outcome.spec.condition,
        label=label or cell_label(outcome, None)[0],
        detail=detail,
    )


def _rank_of(outcome: Outcome) -> int | None:
    value = outcome.facts.get("parallel.rank")
    if isinstance(value, int):
        return value
    head = outcome.probe_id.split("/", 1)[0]
    return int(head.rsplit(" ", 1)[-1]) if head.rsplit(" ", 1)[-1].isdigit() else None


def _place(outcome: Outcome, gpu_of_ordinal: Mapping[int, int]) -> str:
    head = outcome.probe_id.split("/", 1)[0]
    ordinal = outcome.spec.device
    if ordinal is None:
        return head
    nvml = gpu_of_ordinal.get(ordinal)
    return f"{head} (cuda:{ordinal}" + (f", GPU {nvml})" if nvml is not None else ")")


def _describe(outcome: Outcome) -> str:
    if outcome.status is Status.ERROR:
        lines = (outcome.error_message or "").strip().splitlines()
        return f"{outcome.error_type or 'error'}: {lines[0][:200] if lines else outcome.error_kind}"
    checks = outcome.facts.get("parallel.checks") or []
    bad = [c for c in checks if isinstance(c, dict) and not c.get("ok")]
    parts = [f"{c.get('name')} rel. error {_fmt(c.get('rel_error'))}" for c in bad[:4]]
    if outcome.tolerance is not None and parts:
        parts[-1] += f" (tolerance {outcome.tolerance:g})"
    single = outcome.facts.get("parallel.single") or {}
    if single and not single.get("ok", True):
        parts.append(
            f"its single-device run differs from the torch twin (rel. error {_fmt(single.get('rel_error'))})"
        )
    if parts or outcome.status is not Status.PASS:
        return "; ".join(parts) or str(outcome.status)
    numbered = [c for c in checks if isinstance(c, dict) and isinstance(c.get("rel_error"), (int, float))]
    worst = max(numbered, key=lambda c: float(c["rel_error"]), default=None)
    text = "correct" + (f" (worst: {worst['name']} {_fmt(worst['rel_error'])})" if worst else "")
    step = _num(outcome.facts.get("parallel.step_ms"))
    return text + (f", step {step:.1f} ms" if step is not None else "")


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _single_ok(outcome: Outcome) -> bool | None:
    single = outcome.facts.get("parallel.single")
    return bool(single.get("ok")) if isinstance(single, dict) and "ok" in single else None


def _current_device(outcome: Outcome) -> int | None:
    for key in ("parallel.current_device_after_setup", "parallel.current_device"):
        value = outcome.facts.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _off_device_calls(outcome: Outcome) -> tuple[int, int, list[dict[str, Any]]]:
    calls = outcome.facts.get("parallel.kernel_calls") or {}
    if not isinstance(calls, dict):
        return 0, 0, []
    off = sum(int(v) for v in (calls.get("off_device") or {}).values())
    misplaced = sum(int(v) for v in (calls.get("misplaced") or {}).values())
    return off, misplaced, list(calls.get("examples") or [])


def _foreign(outcome: Outcome, own: int) -> tuple[dict[int, int], list[int]]:
    peaks = outcome.facts.get("parallel.peak_allocated") or {}
    allocs = {int(d): int(b) for d, b in peaks.items() if str(d).isdigit() and int(d) != own and int(b) > 0}
    contexts = [int(c) for c in outcome.facts.get("parallel.contexts") or [] if int(c) != own]
    return allocs, contexts


def classify_parallel(
    outcomes: Sequence[Outcome], *, kernel: str, plan: ParallelPlan | None = None
) -> Classification:
    """The classifier's generic rules on the per-rank outcomes, then the parallel rules."""
    gpu_of = dict(plan.gpu_of_ordinal) if plan is not None else {}
    base = classify(outcomes, kernel=kernel)
    diagnoses = list(base.diagnoses)
    explanations = list(base.explanations)
    explained: set[str] = {e.probe_id for d in base.diagnoses for e in d.evidence}
    by_mode: dict[Condition, list[Outcome]] = {}
    for o in outcomes:
        if o.spec.condition in MODE_OF:
            by_mode.setdefault(o.spec.condition, []).append(o)

    def repro(condition: Condition) -> str:
        mode = MODE_OF[condition].value
        gpus = f" --gpus {','.join(str(g) for g in plan.gpus)}" if plan is not None and plan.gpus else ""
        cpu = " --cpu" if plan is not None and plan.tier == "cpu" else ""
        return f"qmoe-doctor scan --parallel {mode} --kernel {kernel}{gpus}{cpu}"

    # --- device-never-set: a rank whose current device is not its own, and work landed there ---
    for condition in (Condition.PARALLEL_DP, Condition.PARALLEL_TP, Condition.PARALLEL_EP):
        ranks = by_mode.get(condition, [])
        evidence: list[Evidence] = []
        places: list[str] = []
        high = False
        for o in ranks:
            own = o.spec.device
            current = _current_device(o)
            if own is None or current is None or current == own:
                continue
            off, misplaced, examples = _off_device_calls(o)
            allocs, contexts = _foreign(o, own)
            if not (off or misplaced or allocs or o.failed):
                explanations.append(
                    f"{_place(o, gpu_of)}: its current device stayed cuda:{current}, not its own cuda:{own}, "
                    "but nothing of it ran or was allocated there (the kernel follows its tensors' device)"
                )
                continue
            facts = [f"current device cuda:{current} after set-up, its own is cuda:{own}"]
            if off:
                facts.append(f"{off} kernel call(s) made with cuda:{current} current and x on cuda:{own}")
            if misplaced:
                facts.append(f"{misplaced} kernel output(s) returned on another device")
            for d, b in sorted(allocs.items()):
                facts.append(f"torch allocated {b:,} bytes on cuda:{d}")
            if contexts:
                facts.append("CUDA context(s) on " + ", ".join(f"cuda:{c}" for c in contexts))
            if examples:
                ex = examples[0]
                facts.append(
                    f"e.g. {ex.get('what')}: current cuda:{ex.get('current_device')}, x on {ex.get('x_device')}"
                    + (f", output on {ex.get('out_device')}" if ex.get("out_device") else "")
                )
            if o.failed:
                facts.append(_describe(o))
            if _single_ok(o):
                evidence.append(
                    _ev(
                        o,
                        f"same rank, kernel and inputs with cuda:{own} current (its single-device run): correct",
                        "pass",
                    )
                )
                high = True
            evidence.append(_ev(o, "; ".join(facts)))
            explained.add(o.probe_id)
            places.append(_place(o, gpu_of))
        if evidence:
            for peer in ranks:  # a rank whose current device is its own, same program
                if (
                    peer.probe_id not in explained
                    and peer.status is Status.PASS
                    and _current_device(peer) == peer.spec.device
                ):
                    evidence.append(
                        _ev(peer, f"its current device is its own (cuda:{peer.spec.device}): correct")
                    )
                    high = True
                    break
            diagnoses.append(
                Diagnosis(
                    cause="device-never-set",
                    confidence=Confidence.HIGH if high else Confidence.MEDIUM,
                    summary=(
                        f"under {MODE_OF[condition].value}, {', '.join(places)} never made its own GPU current: "
                        "its current device stayed cuda:0, so whatever follows the current device (a default "
                        "allocation, an unguarded launch) landed on GPU 0 and failed or crossed GPUs"
                    ),
                    evidence=tuple(evidence),
                    where=tuple(places),
                    repro=repro(condition),
                )
            )

    # --- invalid-routing under expert parallelism: global ids reach a local weight stack ---
    ep_ranks = by_mode.get(Condition.PARALLEL_EP, [])
    culprits: list[Outcome] = []
    evidence = []
    high = False
    for o in ep_ranks:
        f = o.facts
        n_bad = f.get("ep.ids_out_of_range")
        bad_ids = isinstance(n_bad, int) and n_bad > 0
        local_wrong = f.get("ep.local_expert_ok") is False
        if not (bad_ids or (local_wrong and o.failed)) or _single_ok(o) is False:
            continue
        per_rank = f.get("ep.experts_per_rank")
        if _single_ok(o):
            evidence.append(
                _ev(o, "same rank, all experts on one device (its single-device run): correct", "pass")
            )
        facts = []
        if bad_ids:
            examples = f.get("ep.bad_id_examples") or []
            shown = ", ".join(
                f"global {e.get('global')} -> local {e.get('local')}"
                for e in examples[:3]
                if isinstance(e, dict)
            )
            facts.append(
                f"{n_bad} of {f.get('ep.recv_rows')} received rows carry local expert ids outside [0, {per_rank})"
                + (f" ({shown})" if shown else "")
                + ": global ids reached the local weight stack"
            )
        if local_wrong:
            facts.append(
                "its experts' rows differ from the full block's at the rows' global ids "
                f"(rel. error {_fmt(f.get('ep.local_expert_rel_error'))})"
            )
        facts.append(_describe(o))
        evidence.append(_ev(o, "; ".join(facts)))
        high = high or (bad_ids and (local_wrong or o.failed) and _single_ok(o) is True)
        explained.add(o.probe_id)
        culprits.append(o)
    if culprits:
        names = [_place(o, gpu_of) for o in culprits]
        for peer in ep_ranks:
            if peer in culprits or not peer.failed:
                continue
            if peer.facts.get("ep.local_expert_ok") is True and not peer.facts.get("ep.ids_out_of_range"):
                evidence.append(
                    _ev(
                        peer,
                        f"its own experts are right (rel. error {_fmt(peer.facts.get('ep.local_expert_rel_error'))}); "
                        f"its tokens' rows computed by {', '.join(names)} are not: " + _describe(peer),
                    )
                )
                explained.add(peer.probe_id)
                high = True
        diagnoses.append(
            Diagnosis(
                cause="invalid-routing",
                confidence=Confidence.HIGH if high else Confidence.MEDIUM,
                summary=(
                    f"under expert parallelism {', '.join(names)} indexed its local stack of "
                    f"{culprits[0].facts.get('ep.experts_per_rank')} experts with ids past its end: the global "
                    "expert ids were not remapped to local ones (ids - first local expert); the same block on "
                    "one device is right"
                ),
                evidence=tuple(evidence),
                where=tuple(names),
                repro=repro(Condition.PARALLEL_EP),
            )
        )

    # --- ranks that failed only because another did ---
    for condition, ranks in by_mode.items():
        failed_first = [o for o in ranks if o.failed and "parallel.terminated_after" not in o.facts]
        for o in ranks:
            after = o.facts.get("parallel.terminated_after")
            if after is None or o.probe_id in explained:
                continue
            if any(_rank_of(f) == after for f in failed_first):
                explanations.append(
                    f"{_place(o, gpu_of)} ({MODE_OF[condition].value}) was stopped by torchrun after rank {after} "
                    f"failed (it was at {o.facts.get('parallel.at', '?')}): not a fault of its own"
                )
                explained.add(o.probe_id)
        # a rank that hung in the step while other ranks of the same run failed with a diagnosed
        # cause: a collective waits for every rank (8 ranks, run 51: rank 0 waited for the seven
        # that failed until the parent's timeout). Only with its own single-device run correct,
        # and only when another rank's failure is diagnosed: a hang of its own stays unexplained.
        culprits_here = [_place(f, gpu_of) for f in failed_first if f.probe_id in explained]
        for o in ranks:
            if (
                culprits_here
                and o.error_kind is ErrorKind.TIMEOUT
                and o.probe_id not in explained
                and _single_ok(o) is True
            ):
                explanations.append(
                    f"{_place(o, gpu_of)} ({MODE_OF[condition].value}) timed out at "
                    f"{o.facts.get('parallel.at', '?')} while {', '.join(culprits_here)} had failed (diagnosed "
                    "above): a collective waits for every rank; its own single-device run is correct, so "
                    "not a fault of its own"
                )
                explained.add(o.probe_id)
        for o in ranks:
            if o.failed and o.probe_id not in explained and _single_ok(o) is False:
                explanations.append(
                    f"{_place(o, gpu_of)} ({MODE_OF[condition].value}): its single-device run is wrong too (against "
                    f"the torch twin), so the kernel fails without any parallelism: "
                    f"`qmoe-doctor scan --kernel {kernel}` names why"
                )

    by_id = {o.probe_id: o for o in outcomes}
    unexplained = tuple(
        replace(e, detail=_describe(by_id[e.probe_id])) if e.probe_id in by_id else e
        for e in base.unexplained
        if e.probe_id not in explained
    )
    return Classification(
        diagnoses=tuple(diagnoses), explanations=tuple(explanations), unexplained=unexplained
    )


def kernel_import_failure(report: ParallelReport) -> Outcome | None:
    """The first rank that could not resolve the kernel reference (a usage error)."""
    return next((o for o in report.outcomes if o.error_kind is ErrorKind.KERNEL_IMPORT), None)


def nothing_ran(report: ParallelReport) -> bool:
    """No rank got past its imports: the check itself could not run (torch missing, ...)."""
    return not report.outcomes or all(
        o.status is Status.ERROR and o.phase in (Phase.SPAWN, Phase.IMPORT) for o in report.outcomes
    )


def describe_outcome(outcome: Outcome) -> str:
    return _describe(outcome)


__all__ = [
    "CONDITION_OF",
    "DEFAULT_RUN_TIMEOUT_S",
    "RANK_MODULE",
    "TORCHRUN_MODES",
    "USER_MODES",
    "Crumbs",
    "EventKind",
    "LaunchRecord",
    "Mode",
    "ModeResult",
    "ParallelEvent",
    "ParallelOptions",
    "ParallelPlan",
    "ParallelPlanError",
    "ParallelReport",
    "PlannedRun",
    "RankExit",
    "build_command",
    "classify_parallel",
    "collect_run",
    "describe_outcome",
    "free_port",
    "kernel_import_failure",
    "launch_run",
    "nothing_ran",
    "parse_modes",
    "parse_torchrun_failures",
    "plan_parallel",
    "report_json",
    "run_parallel",
    "summarize",
    "with_scaling",
]
