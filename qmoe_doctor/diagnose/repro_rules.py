"""The repro's decisions, from outcomes to words: where the pipeline failed, when the shrink
may stop, which diagnosis is the verdict and which probe the minimal one, whether memcheck can
confirm it, and what memcheck's log confirmed.

Pure functions over records: ``workflows.repro`` runs the children and the sanitizer and asks
these at each step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from qmoe_doctor.core import knobs
from qmoe_doctor.core.allocator import AllocatorSnapshot
from qmoe_doctor.core.records import (
    CUDA_ERROR_KINDS,
    Condition,
    Confidence,
    Diagnosis,
    ErrorKind,
    Outcome,
    Status,
    TensorInfo,
)
from qmoe_doctor.core.reports import PipelineSummary, ReproReport, SanitizerConfirmation
from qmoe_doctor.diagnose.attribution import Attribution, attribute
from qmoe_doctor.diagnose.matrix import build_matrix
from qmoe_doctor.diagnose.sanitizer_log import SanitizerReport
from qmoe_doctor.diagnose.scan_rules import classify

#: Outcomes memcheck can see: a device access the MMU or the sanitizer refuses. Every sticky
#: CUDA error but the kernel's own assert, the watchdog's timeout and the hardware's faults: an
#: illegal instruction is how a TMA store past its tensor ends (memcheck placed those writes:
#: FINDINGS.md, 2026-12-06), a launch failure how memcheck itself stops a kernel.
ACCESS_FAULT_KINDS = (
    CUDA_ERROR_KINDS
    - {ErrorKind.DEVICE_ASSERT, ErrorKind.LAUNCH_TIMEOUT, ErrorKind.ECC_UNCORRECTABLE, ErrorKind.ERROR_CONTAINED}
) | {ErrorKind.SIGNAL}
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
        ErrorKind.NEEDS_CUDA,
    }
)

# ---------------------------------------------------------------------------------------------
# Reading the pipeline's outcome
# ---------------------------------------------------------------------------------------------


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


def shrink_outcomes(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The shrink probes among the outcomes (the pipeline left out)."""
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
    shrink = shrink_outcomes(outcomes)
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
    failing = [o for o in shrink_outcomes(outcomes) if o.failed]
    if verdict is not None:
        ids = {e.probe_id for e in verdict.evidence}
        cited = [o for o in failing if o.probe_id in ids]
        if cited:
            return tuple(cited)
    return tuple(failing)


def is_access_fault(o: Outcome) -> bool:
    return o.error_kind in ACCESS_FAULT_KINDS or bool(o.canary_hits)


# ---------------------------------------------------------------------------------------------
# Sanitizer: whether to confirm, and what the log confirmed
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerDecision:
    run: bool
    target: Outcome | None  # the probe to re-run under memcheck
    reason: str  # plain words: why it runs, or why not


def sanitizer_decision(
    minimal: Sequence[Outcome], info: object | None, *, enabled: bool = True
) -> SanitizerDecision:
    """Whether to confirm under memcheck, and on which probe: the first of the minimal failing
    probes whose failure is a device access fault. Pure: ``info`` is what
    ``machine.sanitizer.find_compute_sanitizer`` found (None: nothing; only its presence counts)."""
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


def _gpu_word(device: str, gpu_of_ordinal: Mapping[int, int]) -> str:
    if device.startswith("cuda:"):
        ordinal = int(device.split(":", 1)[1])
        if ordinal in gpu_of_ordinal:
            return f"{device} (GPU {gpu_of_ordinal[ordinal]})"
    return device


def tensor_tables(tensors: Sequence[TensorInfo]) -> dict[str, list[TensorInfo]]:
    tables: dict[str, list[TensorInfo]] = {}
    for t in tensors:
        tables.setdefault(t.device, []).append(t)
    return tables


def confirmation_from_log(
    report: SanitizerReport,
    sanitized: Outcome | None,
    gpu_of_ordinal: Mapping[int, int],
    common: dict[str, Any],
    *,
    timed_out: bool = False,
    snapshot: AllocatorSnapshot | None = None,
) -> SanitizerConfirmation:
    """What memcheck's log says of the re-run probe: clean, or confirmed with the first error and
    every reported address attributed to the tensors of the sanitized run (``common``: the
    fields of the confirmation that do not depend on the log)."""
    errors = report.error_summary if report.error_summary is not None else report.records
    status_word = str(sanitized.status) if sanitized else None
    failure = report.tool_failures[0] if report.tool_failures else None
    if failure is not None and not any(e.category == "invalid-access" for e in report.errors):
        # the tool gave up (recorded on an H100: "failed to handle a hardware exception") before
        # it saw an access: its error count is its own failure and what followed from it
        return SanitizerConfirmation(
            status="failed",
            reason=(
                f"compute-sanitizer failed inside the run ({failure}) before it reported an invalid "
                "access: the fault is neither confirmed nor ruled out"
            ),
            errors=errors,
            sanitized_status=status_word,
            **common,
        )
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
        reason += f" ({report.records} printed)"
    if not tables:
        reason += "; no tensor table came back from the sanitized run, so the addresses stay unattributed"
    if failure is not None:
        reason += f"; then the tool failed ({failure}): later accesses were not checked"
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


def shrink_cells(report: ReproReport) -> list[tuple[str, str]]:
    """(probe id, label) of each shrink probe in run order; labels as the scan's matrix has them
    (pass, slow N.Nx, wrong, or the error kind)."""
    cells = {c.outcome.probe_id: c for c in build_matrix(shrink_outcomes(report.outcomes)).cells.values()}
    out = []
    for o in shrink_outcomes(report.outcomes):
        cell = cells.get(o.probe_id)
        if cell is None:
            continue
        label = cell.label + (f" {cell.slowdown:.1f}x" if cell.label == "slow" and cell.slowdown else "")
        out.append((o.probe_id, label))
    return out


__all__ = [
    "ACCESS_FAULT_KINDS",
    "HOST_SIDE_KINDS",
    "SanitizerDecision",
    "StopReason",
    "confirmation_from_log",
    "is_access_fault",
    "minimal_failures",
    "pick_verdict",
    "sanitizer_decision",
    "shrink_cells",
    "shrink_outcomes",
    "stop_reason",
    "summarize_pipeline",
    "tensor_tables",
]
