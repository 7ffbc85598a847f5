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

No torch here: probes run in children (``isolate``), the sanitizer in a subprocess.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from qmoe_doctor import __version__
from qmoe_doctor.core import knobs
from qmoe_doctor.core.allocator import AllocatorSnapshot, read_allocator_snapshot
from qmoe_doctor.core.causes import get_cause
from qmoe_doctor.core.events import Event, EventKind, OnEvent
from qmoe_doctor.core.options import ScanOptions
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
    TensorInfo,
    to_jsonable,
)
from qmoe_doctor.core.shapes import get_preset
from qmoe_doctor.core.xid import XidReport
from qmoe_doctor.diagnose.attribution import Attribution, attribute
from qmoe_doctor.diagnose.matrix import build_matrix
from qmoe_doctor.diagnose.sanitizer_log import SanitizerReport, parse_sanitizer_log
from qmoe_doctor.diagnose.scan_rules import classify
from qmoe_doctor.diagnose.xid import xid_evidence
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
from qmoe_doctor.plan.scan import PlannedGpu, plan_scan
from qmoe_doctor.reports.repro_script import SCRIPT_CONDITIONS, render_script, script_name
from qmoe_doctor.workflows.scan import KernelRefError

PIPELINE_ID = "pipeline"
#: Pair cells run in the warm child before the pipeline (their preconditions do not survive it).
BEFORE_PIPELINE = (Condition.GUARDED, Condition.NO_PEER, Condition.PEER)
#: After the pipeline, in the same child: the races, then the operand GPU's stream and routing cells.
AFTER_PIPELINE = (
    Condition.PRODUCER_RACE,
    Condition.SIZES_RACE,
    Condition.SIDE_STREAM,
    Condition.NEGATIVE_SIZES,
    Condition.OVER_ROUTED,
)
#: When the guarded baseline fails: the single-device ladder on b, in a fresh child.
SINGLE_LADDER = (
    Condition.REPEAT_CALL,
    Condition.SINGLE,
    Condition.SIDE_STREAM,
    Condition.NEGATIVE_SIZES,
    Condition.OVER_ROUTED,
)
PAIR_LADDER = BEFORE_PIPELINE + AFTER_PIPELINE
#: Outcomes memcheck can see: a device access the MMU or the sanitizer refuses.
ACCESS_FAULT_KINDS = frozenset({ErrorKind.ILLEGAL_ADDRESS, ErrorKind.SIGNAL})
#: Failures raised on the host before the kernel touches device memory.
HOST_SIDE_KINDS = frozenset(
    {
        ErrorKind.POINTER_INACCESSIBLE,
        ErrorKind.DEVICE_MISMATCH,
        ErrorKind.INVALID_HANDLE,
        ErrorKind.OUT_OF_RESOURCES,
        ErrorKind.BAD_INPUT,
        ErrorKind.KERNEL_IMPORT,
        ErrorKind.OOM,
    }
)
#: memcheck costs ~47x per kernel and ~1 s of start-up (FINDINGS); a probe of the scan's main
#: shape took 6-8 s under it on an H200. Generous, since a hang must not stall the verdict's report.
SANITIZER_TIMEOUT_S = 300.0
SANITIZER_PRINT_LIMIT = 100  # records printed; the summary still counts them all
#: The shrink probes' shape preset when the pipeline uses "tiny": a remote launch is only
#: measurably slower (the evidence of a missing guard) at a real size.
SHRINK_PRESET = "qwen3-30b-a3b"


# ---------------------------------------------------------------------------------------------
# Options and plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ReproOptions:
    preset: str = "tiny"  # the pipeline's blocks
    layers: int | None = None  # default: two per GPU
    steps: int = 2
    tokens: int = 128
    busy_cycles: int = 20_000_000  # queued work per layer (probes/pipeline.py BUSY_CYCLES)
    shrink_preset: str | None = None  # default: the pipeline's preset, or SHRINK_PRESET for "tiny"
    rows: int = 4096  # M of the shrink probes (the scan's main cells)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    seed: int = 0
    sanitizer: bool = True
    timeout_s: float = knobs.DEFAULT_PROBE_TIMEOUT_S
    sanitizer_timeout_s: float = SANITIZER_TIMEOUT_S

    def n_layers(self, n_gpus: int) -> int:
        return self.layers if self.layers is not None else 2 * n_gpus

    def shrink_scan_options(self) -> ScanOptions:
        preset = self.shrink_preset or (SHRINK_PRESET if self.preset == "tiny" else self.preset)
        return ScanOptions(
            preset=preset,
            rows=self.rows,
            dtype=self.dtype,
            seed=self.seed,
            conditions=frozenset(PAIR_LADDER + SINGLE_LADDER),
            timeout_s=self.timeout_s,
            sweeps=False,
            max_pairs=1,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PairLadder:
    """The shrink probes of one ordered pair, from ``plan_scan`` restricted to that pair."""

    a: int  # NVML index, current at the call
    b: int  # NVML index, holds the operands
    env: dict[str, str]  # a child that sees exactly (a, b) as cuda:0, cuda:1
    pair: dict[Condition, ProbeSpec]
    single: dict[Condition, ProbeSpec]  # single-device cells on b (ordinal 1)

    def specs(self, conditions: Sequence[Condition]) -> list[ProbeSpec]:
        out = []
        for cond in conditions:
            spec = self.pair.get(cond) or self.single.get(cond)
            if spec is not None:
                out.append(spec)
        return out

    @property
    def names(self) -> dict[str, str]:
        return {f"{self.a}->{self.b}": f"GPU {self.a} -> GPU {self.b}", f"GPU {self.b}": f"GPU {self.b}"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReproPlan:
    kernel: str
    gpus: tuple[int, ...]  # NVML indices in pipeline order (--gpus order)
    env: dict[str, str]  # child 1: every selected GPU, in order, as cuda:0, cuda:1, ...
    gpu_of_ordinal: dict[int, int]
    pipeline: ProbeSpec
    ladder: PairLadder  # (first GPU, second GPU)

    @property
    def first_session(self) -> tuple[ProbeSpec, ...]:
        return (
            *self.ladder.specs(BEFORE_PIPELINE),
            self.pipeline,
            *self.ladder.specs(AFTER_PIPELINE),
        )


def plan_pair(kernel: str, a: PlannedGpu, b: PlannedGpu, opts: ReproOptions) -> PairLadder:
    plan = plan_scan(kernel, [a, b], opts.shrink_scan_options())
    session = plan.sessions[0]  # max_pairs=1: the session of a -> b
    pair = {s.condition: s for s in session.specs if s.condition.is_pair}
    single = {s.condition: s for s in session.specs if not s.condition.is_pair}
    return PairLadder(a=a.index, b=b.index, env=dict(session.env), pair=pair, single=single)


def pipeline_spec(kernel: str, n_gpus: int, opts: ReproOptions) -> ProbeSpec:
    p = get_preset(opts.preset)
    n, k = p.gate_up_nk
    return ProbeSpec(
        probe_id=PIPELINE_ID,
        kernel=kernel,
        condition=Condition.PIPELINE,
        device=0,
        current=0,
        # descriptive: the gate_up GEMM of one layer (tokens x top-k rows)
        shape=Shape(m=opts.tokens * p.top_k, e=p.num_experts, n=n, k=k, dtype=opts.dtype, routing="random"),
        seed=opts.seed,
        params={
            "layers": opts.n_layers(n_gpus),
            "steps": opts.steps,
            "devices": list(range(n_gpus)),
            "preset": opts.preset,
            "tokens": opts.tokens,
            "busy_cycles": opts.busy_cycles,
        },
        timeout_s=opts.timeout_s,
    )


def plan_repro(kernel: str, gpus: Sequence[PlannedGpu], opts: ReproOptions | None = None) -> ReproPlan:
    """Plan child 1: the pipeline over every selected GPU and the ladder of (gpus[0], gpus[1])."""
    opts = opts or ReproOptions()
    if len(gpus) < 2:
        raise ValueError(f"repro needs two GPUs, got {len(gpus)}")
    if opts.n_layers(len(gpus)) < len(gpus):
        raise ValueError(f"{opts.n_layers(len(gpus))} layers cannot span {len(gpus)} GPUs")
    ladder = plan_pair(kernel, gpus[0], gpus[1], opts)
    return ReproPlan(
        kernel=kernel,
        gpus=tuple(g.index for g in gpus),
        env=knobs.pin_gpus(g.uuid for g in gpus),
        gpu_of_ordinal={i: g.index for i, g in enumerate(gpus)},
        pipeline=pipeline_spec(kernel, len(gpus), opts),
        ladder=ladder,
    )


# ---------------------------------------------------------------------------------------------
# Reading the pipeline's outcome
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSummary:
    status: Status
    layers: int
    steps: int
    preset: str
    layer_gpus: tuple[int, ...]  # NVML index of each layer
    failed: bool
    step: int | None = None  # where it first failed
    layer: int | None = None
    gpu: int | None = None  # NVML index of that layer (or of the device where it surfaced)
    ordinal: int | None = None  # the same as a CUDA ordinal inside the child
    stage: str | None = None  # forward | backward | sync | compare
    what: str = ""  # wrong | misplaced | the error kind
    rel_error: float | None = None
    tolerance: float | None = None
    error_message: str | None = None
    current_device_kept: bool | None = None
    wall_s: float = 0.0

    def describe(self) -> str:
        where = ", ".join(f"layer {i} on GPU {g}" for i, g in enumerate(self.layer_gpus))
        head = f"{self.layers} layers of {self.preset} ({where}), {self.steps} steps"
        if not self.failed:
            return f"{head}: every layer's output and gradients matched the torch twin"
        at = []
        if self.step is not None:
            at.append(f"step {self.step}")
        if self.layer is not None:
            at.append(f"layer {self.layer}")
        if self.gpu is not None:
            at.append(f"GPU {self.gpu}")
        place = ", ".join(at) or "before the first layer"
        if self.status is Status.ERROR:
            msg = (self.error_message or "").strip().splitlines()
            text = f"{head}: {self.what} at {place} ({self.stage or 'setup'})"
            if self.stage == "sync":
                text += ", where asynchronous errors of that step's kernels surface"
            return text + (f": {msg[0][:160]}" if msg else "")
        err = (
            f", rel. error {self.rel_error:.3g} (tolerance {self.tolerance:g})"
            if self.rel_error is not None
            else ""
        )
        return f"{head}: first diverged at {place}, {self.stage}: {self.what}{err}"


def summarize_pipeline(outcome: Outcome, gpu_of_ordinal: Mapping[int, int]) -> PipelineSummary:
    facts = outcome.facts
    params = outcome.spec.params
    devices = [d for d in params.get("devices", [])]
    placement = [int(i) for i in facts.get("pipeline.placement", []) if isinstance(i, int)]
    layer_gpus = tuple(gpu_of_ordinal.get(devices[j], devices[j]) for j in placement if j < len(devices))

    def gpu_of(device: Any) -> tuple[int | None, int | None]:
        if isinstance(device, str) and device.startswith("cuda:"):
            ordinal = int(device.split(":", 1)[1])
            return gpu_of_ordinal.get(ordinal, ordinal), ordinal
        return None, None

    base = PipelineSummary(
        status=outcome.status,
        layers=int(params.get("layers", len(placement))),
        steps=int(params.get("steps", 0)),
        preset=str(params.get("preset", "")),
        layer_gpus=layer_gpus,
        failed=outcome.failed,
        current_device_kept=facts.get("pipeline.current_device_kept"),
        wall_s=outcome.wall_s,
        tolerance=outcome.tolerance,
    )
    first = facts.get("pipeline.first_failure")
    if outcome.status is Status.WRONG and isinstance(first, dict):
        gpu, ordinal = gpu_of(first.get("device"))
        return replace(
            base,
            step=first.get("step"),
            layer=first.get("layer"),
            gpu=gpu,
            ordinal=ordinal,
            stage=first.get("stage"),
            what=str(first.get("what", "wrong")),
            rel_error=first.get("rel_error"),
        )
    if outcome.status is Status.ERROR:
        raw_at = facts.get("pipeline.at")
        at: dict[str, Any] = raw_at if isinstance(raw_at, dict) else {}
        gpu, ordinal = gpu_of(at.get("device"))
        return replace(
            base,
            step=at.get("step"),
            layer=at.get("layer"),
            gpu=gpu,
            ordinal=ordinal,
            stage=at.get("stage") or outcome.phase.value,
            what=str(outcome.error_kind or ErrorKind.OTHER),
            error_message=outcome.error_message,
        )
    return base


# ---------------------------------------------------------------------------------------------
# The stop rule, the verdict and the minimal probe
# ---------------------------------------------------------------------------------------------

StopReason = Literal["verdict", "nothing-failed", "guarded-failed", "other-pair"]


def _shrink(outcomes: Sequence[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.spec.condition is not Condition.PIPELINE]


def stop_reason(
    outcomes: Sequence[Outcome],
    *,
    kernel: str,
    names: Mapping[str, str],
    pair_ordinal: int = 1,
    gpu_of_ordinal: Mapping[int, int] | None = None,
) -> StopReason | None:
    """Why child 1 may stop after the outcomes so far (None: run the next probe). Nothing stops
    before the pipeline has run: it is the reproduction; the cells before it are cheap."""
    pipe = next((o for o in outcomes if o.spec.condition is Condition.PIPELINE), None)
    if pipe is None:
        return None
    if pipe.failed:
        summary = summarize_pipeline(pipe, gpu_of_ordinal or {})
        # a layer on a third GPU diverged first: its pair needs a ladder of its own
        if (
            summary.layer is not None
            and summary.ordinal is not None
            and summary.ordinal not in (0, pair_ordinal)
        ):
            return "other-pair"
    shrink = _shrink(outcomes)
    guarded = next((o for o in shrink if o.spec.condition is Condition.GUARDED), None)
    if guarded is not None and guarded.failed:
        return "guarded-failed"
    result = classify(shrink, kernel=kernel, gpu_names=dict(names))
    if any(d.confidence is Confidence.HIGH for d in result.diagnoses):
        return "verdict"
    cells = build_matrix(shrink).cells.values()
    if not pipe.failed and not any(c.failed or c.label == "slow" for c in cells):
        return "nothing-failed"
    return None


_RANK = {Confidence.HIGH: 0, Confidence.MEDIUM: 1, Confidence.LOW: 2}


def pick_verdict(diagnoses: Sequence[Diagnosis], run_order: Sequence[str]) -> Diagnosis | None:
    """The primary diagnosis: the most confident, then the one whose evidence starts earliest in
    the ladder (fewest conditions)."""
    position = {pid: i for i, pid in enumerate(run_order)}

    def key(d: Diagnosis) -> tuple[int, int]:
        first = min((position.get(e.probe_id, len(position)) for e in d.evidence), default=len(position))
        return _RANK[d.confidence], first

    return min(diagnoses, key=key) if diagnoses else None


def minimal_failures(outcomes: Sequence[Outcome], verdict: Diagnosis | None) -> tuple[Outcome, ...]:
    """The failing shrink probes, in ladder order: those the verdict rests on when it names a
    cause, else every failing one. The first is *the* minimal probe."""
    failing = [o for o in _shrink(outcomes) if o.failed]
    if verdict is not None:
        ids = {e.probe_id for e in verdict.evidence}
        cited = [o for o in failing if o.probe_id in ids]
        if cited:
            return tuple(cited)
    return tuple(failing)


def is_access_fault(o: Outcome) -> bool:
    return o.error_kind in ACCESS_FAULT_KINDS or bool(o.canary_hits)


# ---------------------------------------------------------------------------------------------
# Sanitizer confirmation
# ---------------------------------------------------------------------------------------------

SanitizerStatus = Literal["confirmed", "clean", "not-run", "unavailable", "failed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerDecision:
    run: bool
    target: Outcome | None  # the probe to re-run under memcheck
    reason: str  # plain words: why it runs, or why not


def sanitizer_decision(
    minimal: Sequence[Outcome], info: SanitizerInfo | None, *, enabled: bool = True
) -> SanitizerDecision:
    """Whether to confirm under memcheck, and on which probe: the first of the minimal failing
    probes whose failure is a device access fault. Pure: ``info`` is what
    ``find_compute_sanitizer`` found (None: nothing)."""
    if not minimal:
        return SanitizerDecision(run=False, target=None, reason="nothing to confirm: no shrink probe failed")
    target = next((o for o in minimal if is_access_fault(o)), None)
    if not enabled:
        return SanitizerDecision(run=False, target=target, reason="skipped (--no-sanitizer)")
    if target is None:
        return SanitizerDecision(run=False, target=None, reason=_why_not_visible(minimal[0]))
    if info is None:
        return SanitizerDecision(
            run=False,
            target=target,
            reason=(
                f"unconfirmed: compute-sanitizer was not found (${knobs.QMOE_SANITIZER}, PATH, "
                "$CUDA_HOME/bin, /usr/local/cuda*/bin); the access fault stands on the CUDA error "
                f"alone. Install the CUDA toolkit's compute-sanitizer or set {knobs.QMOE_SANITIZER}."
            ),
        )
    what = "a canary hit (a write outside the output)" if target.canary_hits else str(target.error_kind)
    return SanitizerDecision(
        run=True,
        target=target,
        reason=f"{target.probe_id} ended in {what}: re-run alone under memcheck, caching allocator off",
    )


def _why_not_visible(o: Outcome) -> str:
    kind = o.error_kind
    if o.status is Status.WRONG:
        return (
            f"{o.probe_id} gave wrong numbers without an invalid access (a race reads "
            "valid, stale memory; wrong arithmetic stays inside its tensors). memcheck reports 0 "
            "errors for both silent-corruption cases we measured, so it could not confirm anything; "
            "the comparison against the float32 reference is the proof."
        )
    if kind in HOST_SIDE_KINDS:
        return (
            f"{o.probe_id} failed with {kind}, raised on the host at launch, before the "
            "kernel touched device memory: there is no device access for memcheck to check."
        )
    if kind is ErrorKind.DEVICE_ASSERT:
        return (
            f"{o.probe_id} hit a device-side assert, the kernel's own check, not an invalid "
            "access; TRITON_DEBUG=1 names its source line."
        )
    if kind is ErrorKind.TIMEOUT:
        return f"{o.probe_id} hung; memcheck does not diagnose hangs (and runs ~47x slower)."
    return f"{o.probe_id} failed with {kind or o.status}, not a device memory access fault: nothing for memcheck to see."


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerConfirmation:
    status: SanitizerStatus
    reason: str
    probe_id: str | None = None
    tool: str | None = None  # path of the binary
    version: str | None = None
    errors: int | None = None  # ERROR SUMMARY
    first_error: str | None = None  # "Invalid __global__ write of size 16 bytes at f+0x10 (f.py:11)"
    touched: str | None = None  # the tensor the first bad access touched, in words
    attributions: tuple[str, ...] = ()  # one sentence per distinct address (the first few)
    tensors_hit: dict[str, int] = field(default_factory=dict)  # nearest tensor -> addresses
    sanitized_status: str | None = None  # the probe's own status under the sanitizer
    log_path: str | None = None
    wall_s: float = 0.0
    xid: XidReport | None = None  # Xid errors on the pair's GPUs during the sanitized run
    xid_evidence: tuple[str, ...] = ()  # the same in words, an Xid 31 address placed


def _gpu_word(device: str, gpu_of_ordinal: Mapping[int, int]) -> str:
    if device.startswith("cuda:"):
        ordinal = int(device.split(":", 1)[1])
        if ordinal in gpu_of_ordinal:
            return f"{device} (GPU {gpu_of_ordinal[ordinal]})"
    return device


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
    spec = replace(target.spec, probe_id=f"{target.spec.probe_id}+memcheck", env={}, fresh_process=False)
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
    return _confirmation(
        report, sanitized, gpu_of_ordinal, common, timed_out=result.returncode is None, snapshot=snapshot
    )


def tensor_tables(tensors: Sequence[TensorInfo]) -> dict[str, list[TensorInfo]]:
    tables: dict[str, list[TensorInfo]] = {}
    for t in tensors:
        tables.setdefault(t.device, []).append(t)
    return tables


def _confirmation(
    report: SanitizerReport,
    sanitized: Outcome | None,
    gpu_of_ordinal: Mapping[int, int],
    common: dict[str, Any],
    *,
    timed_out: bool = False,
    snapshot: AllocatorSnapshot | None = None,
) -> SanitizerConfirmation:
    errors = report.error_summary if report.error_summary is not None else len(report.errors)
    status_word = str(sanitized.status) if sanitized else None
    if not errors:
        ran = f"the probe itself was {status_word} under it" if status_word else "the probe wrote no outcome"
        reason = (
            "memcheck reported 0 errors: the fault did not recur under the sanitizer ("
            + ran
            + "; its timing can make a race appear or vanish)"
        )
        if timed_out:
            reason = "memcheck was killed at the timeout before it reported any error"
        return SanitizerConfirmation(
            status="clean", reason=reason, errors=0, sanitized_status=status_word, **common
        )
    first = report.groups[0] if report.groups else None
    first_error = None
    if first is not None:
        loc = f" at {first.location.render()}" if first.location else ""
        first_error = f"{first.first.message}{loc}"
    tables = tensor_tables(sanitized.tensors) if sanitized else {}
    attributions: tuple[Attribution, ...] = attribute(report, tables, snapshot=snapshot) if tables else ()
    hits: dict[str, int] = {}
    for a in attributions:
        if a.matches:
            m = a.matches[0]
            key = f"{m.description} on {_gpu_word(m.device, gpu_of_ordinal)}"
            hits[key] = hits.get(key, 0) + 1
    touched = None
    if attributions and attributions[0].matches:
        a0 = attributions[0]
        touched = a0.sentences[0].rstrip(".")
        for device in tables:
            touched = touched.replace(f" on {device}", f" on {_gpu_word(device, gpu_of_ordinal)}")
        if a0.cross_device:
            touched += "; " + a0.sentences[-1].rstrip(".")
        nearest = next((e.nearest for e in report.errors if e.address == a0.address and e.nearest), None)
        match = a0.matches[0]
        tensor = next((t for t in tables.get(match.device, []) if t.name == match.tensor), None)
        if nearest is not None and tensor is not None and not nearest.base <= tensor.data_ptr < nearest.end:
            touched += (
                f" (memcheck measured it against an allocation of {nearest.size:,} bytes at "
                f"0x{nearest.base:x}, which holds none of the probe's tensors: the nearest tensor is a guess)"
            )
    reason = f"memcheck confirms the access fault: {errors:,} error{'s' if errors != 1 else ''}"
    if report.errors_not_printed:
        reason += f" ({len(report.errors)} printed)"
    if not tables:
        reason += "; no tensor table came back from the sanitized run, so the addresses stay unattributed"
    return SanitizerConfirmation(
        status="confirmed",
        reason=reason,
        errors=errors,
        first_error=first_error,
        touched=touched,
        attributions=tuple(" ".join(a.sentences) for a in attributions[:5]),
        tensors_hit=hits,
        sanitized_status=status_word,
        **common,
    )


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTime:
    name: str
    seconds: float
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReproReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    kernel: str
    started: str  # ISO 8601, UTC
    gpus: tuple[int, ...]  # NVML indices, pipeline order
    pair: tuple[int, int]  # (a current, b operands) of the shrink, NVML indices
    pipeline: PipelineSummary | None
    outcomes: tuple[Outcome, ...]  # in run order, the pipeline among them
    tried: tuple[str, ...]  # probe ids run, in order
    diagnoses: tuple[Diagnosis, ...] = ()
    explanations: tuple[str, ...] = ()
    unexplained: tuple[Evidence, ...] = ()
    verdict: str | None = None  # cause id of the primary diagnosis
    minimal: tuple[str, ...] = ()  # probe ids of the minimal failing probes, first = the minimal one
    stop: str | None = None  # why the shrink stopped where it did
    sanitizer: SanitizerConfirmation
    script: str | None = None  # path of the standalone repro script
    script_note: str = ""  # why no script, or how to run it
    stages: tuple[StageTime, ...] = ()
    time_to_verdict_s: float = 0.0
    wall_s: float = 0.0
    log_dir: str = ""
    notes: tuple[str, ...] = ()

    @property
    def reproduced(self) -> bool:
        """The pipeline failed: the failure reproduced the way users hit it."""
        return self.pipeline is not None and self.pipeline.failed

    @property
    def faulty(self) -> bool:
        return self.reproduced or bool(self.diagnoses) or bool(self.unexplained)

    @property
    def could_not_run(self) -> bool:
        """Every probe died before its child was ready: nothing was tested."""
        return bool(self.outcomes) and all(
            o.status is Status.ERROR and o.phase is Phase.SPAWN for o in self.outcomes
        )


def shrink_cells(report: ReproReport) -> list[tuple[str, str]]:
    """(probe id, label) of each shrink probe in run order; labels as the scan's matrix has them
    (pass, slow N.Nx, wrong, or the error kind)."""
    cells = {c.outcome.probe_id: c for c in build_matrix(_shrink(report.outcomes)).cells.values()}
    out = []
    for o in _shrink(report.outcomes):
        cell = cells.get(o.probe_id)
        if cell is None:
            continue
        label = cell.label + (f" {cell.slowdown:.1f}x" if cell.label == "slow" and cell.slowdown else "")
        out.append((o.probe_id, label))
    return out


def report_json(report: ReproReport) -> dict[str, Any]:
    body: dict[str, Any] = to_jsonable(report)
    body["reproduced"] = report.reproduced
    body["faulty"] = report.faulty
    return body


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


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
                raise KernelRefError(o.error_message or "the kernel could not be resolved")
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
    pipeline order (for a third GPU's ladder). Raises KernelRefError when the kernel does not
    resolve in the child."""
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="qmoe-repro-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runner: SessionRunner = session_runner or run_session
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
            result = classify(_shrink(outcomes), kernel=plan.kernel, gpu_names=names)
            return "verdict" if any(d.confidence is Confidence.HIGH for d in result.diagnoses) else None

        notes.append(
            f"the guarded baseline (GPU {ladder.b} current) failed too: the fault needs no second GPU; "
            f"ran the single-device ladder on GPU {ladder.b}"
        )
        stop = eng.session(ladder.specs(SINGLE_LADDER), ladder.env, single_stop) or stop
        eng.stage(f"single-device ladder on GPU {ladder.b}", t, f"stopped: {stop}")

    # --- classification ---
    shrink = _shrink(eng.outcomes)
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
        own = ladder_of.get(decision.target.probe_id.split("/", 1)[0], ladder)
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
        own = ladder_of.get(first.probe_id.split("/", 1)[0], ladder)
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
    "ACCESS_FAULT_KINDS",
    "AFTER_PIPELINE",
    "BEFORE_PIPELINE",
    "PIPELINE_ID",
    "SINGLE_LADDER",
    "CommandResult",
    "PairLadder",
    "PipelineSummary",
    "ReproOptions",
    "ReproPlan",
    "ReproReport",
    "SanitizerConfirmation",
    "SanitizerDecision",
    "confirm_with_sanitizer",
    "is_access_fault",
    "minimal_failures",
    "pick_verdict",
    "plan_repro",
    "report_json",
    "run_command",
    "run_repro",
    "sanitizer_decision",
    "shrink_cells",
    "stop_reason",
    "summarize_pipeline",
]
