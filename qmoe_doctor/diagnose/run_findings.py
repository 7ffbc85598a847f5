"""What ``qmoe-doctor run`` concludes from its processes' records (pure functions).

* :func:`diagnoses`: the monitor's findings of every process, one diagnosis per cause, kind and
  kernel, with the processes that showed it and the first launch;
* :func:`cuda_errors`: each CUDA error with the launches before it, and the faulting kernel when
  the pass launched with CUDA_LAUNCH_BLOCKING=1 (then the launch that raised is the one);
* :func:`unflushed`: processes that ended without writing their final record;
* :func:`sanitizer_targets`: which kernels a compute-sanitizer rerun checks, and how many launches;
* :func:`tensor_tables`: every recorded tensor by device, to attribute addresses against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qmoe_doctor.core.error_kind import cuda_error_kind
from qmoe_doctor.core.launches import FindingKind, Launch, LaunchFinding, ProcessRecord
from qmoe_doctor.core.records import Confidence, TensorInfo, is_cuda_error
from qmoe_doctor.core.reports import RunCudaError, RunDiagnosis, RunPassLabel

#: Launches before a CUDA error that a report shows.
LAST_LAUNCHES = 8
#: Kernels a compute-sanitizer rerun checks at most (its filter is one regular expression).
MAX_SANITIZED_KERNELS = 8
#: Launches per kernel a sanitizer rerun checks when no fault points at one.
SANITIZE_FIRST_LAUNCHES = 2

#: Observed at a launch: the tensors' devices (and the rank's LOCAL_RANK) were read, not inferred.
#: The int32 finding joins a static finding (the lint) to an observed size: it shows the wrap is
#: reachable, not that it ran. The default-stream finding is a heuristic over the ring
#: (``diagnose.stream_rules`` says what makes it wrong).
_CONFIDENCE = {
    FindingKind.RANK_ON_DEVICE_0: Confidence.HIGH,
    FindingKind.OTHER_DEVICE: Confidence.HIGH,
    FindingKind.MIXED_DEVICES: Confidence.HIGH,
    FindingKind.CPU_TENSOR: Confidence.HIGH,
    FindingKind.INT32_BY_SIZE: Confidence.MEDIUM,
    FindingKind.DEFAULT_STREAM: Confidence.MEDIUM,
}
_ORDER = (
    FindingKind.RANK_ON_DEVICE_0,
    FindingKind.OTHER_DEVICE,
    FindingKind.MIXED_DEVICES,
    FindingKind.CPU_TENSOR,
    FindingKind.INT32_BY_SIZE,
    FindingKind.DEFAULT_STREAM,
)


def _processes_in_order(records: Iterable[ProcessRecord]) -> list[ProcessRecord]:
    return sorted(records, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.started, r.pid))


def diagnoses(records: Sequence[ProcessRecord], label: RunPassLabel = "run") -> tuple[RunDiagnosis, ...]:
    """One diagnosis per (kind, kernel) over all processes: ranks launching the same kernel on
    their own devices show the same fault."""
    groups: dict[tuple[FindingKind, str], list[tuple[ProcessRecord, LaunchFinding]]] = {}
    for record in _processes_in_order(records):
        for finding in record.findings:
            groups.setdefault((finding.kind, finding.kernel), []).append((record, finding))
    out: list[RunDiagnosis] = []
    for (kind, kernel), members in groups.items():
        first_record, first = members[0]
        processes = tuple(dict.fromkeys(r.label for r, _ in members))
        launches = sum(f.count for _, f in members)
        where = f" (in {len(processes)} processes)" if len(processes) > 1 else ""
        out.append(
            RunDiagnosis(
                cause=first.cause,
                kind=kind,
                confidence=_CONFIDENCE.get(kind, Confidence.MEDIUM),
                summary=first.message + where,
                kernel=kernel,
                processes=processes,
                launches=launches,
                finding=first,
                seen_in=label,
            )
        )
    out.sort(key=lambda d: (_ORDER.index(d.kind) if d.kind in _ORDER else len(_ORDER), d.kernel))
    return tuple(out)


def _cuda_launch(launch: Launch) -> bool:
    return bool(launch.raised) and cuda_error_kind(launch.raised) is not None


def _cuda_end(record: ProcessRecord) -> str:
    """The text of the CUDA error the process ended on, or "". Read again from the end's text
    too: a monitor from before each sticky CUDA error had its kind recorded an illegal
    instruction as a plain exception."""
    end = record.end
    if end is None or not (is_cuda_error(end.error_kind) or cuda_error_kind(end.detail)):
        return ""
    return end.detail


def cuda_errors(records: Sequence[ProcessRecord], *, blocking: bool) -> tuple[RunCudaError, ...]:
    """Every process that met a CUDA error, with its last launches. With ``blocking`` (the pass
    ran with CUDA_LAUNCH_BLOCKING=1) each launch completed before the next call, so the launch
    that raised the error is the faulting kernel."""
    out: list[RunCudaError] = []
    for record in _processes_in_order(records):
        end = record.end
        message = record.cuda_error or _cuda_end(record)
        if not message:
            continue
        ring = record.ring
        raised = [launch for launch in ring if _cuda_launch(launch)]
        last = ring[-LAST_LAUNCHES:]
        if raised:
            cut = ring.index(raised[0]) + 1
            last = ring[max(0, cut - LAST_LAUNCHES) : cut]
        faulting: str | None = None
        exact = False
        if blocking and raised:
            faulting, exact = raised[0].kernel, True
            note = f"launches were blocking: `{faulting}` (launch #{raised[0].seq}) raised the error: it is the faulting kernel"
        elif blocking:
            tail = f"; the last Triton launch before it was `{last[-1].kernel}`" if last else ""
            note = "launches were blocking and no Triton launch raised it: the fault is in another kernel (a torch op)" + tail
        else:
            kernels = list(dict.fromkeys(launch.kernel for launch in reversed(last)))
            note = (
                "CUDA reports a kernel's fault at a later call: the faulting kernel is among the last "
                f"launches ({', '.join(f'`{k}`' for k in kernels)}); rerun with --blocking to name it"
                if kernels
                else "no Triton launch was recorded before it"
            )
        out.append(
            RunCudaError(
                process=record.label,
                pid=record.pid,
                rank=record.rank,
                message=message,
                # the kind of the first CUDA error (the one the message quotes)
                error_kind=cuda_error_kind(message)
                or (end.error_kind if end is not None and is_cuda_error(end.error_kind) else None),
                last_launches=tuple(last),
                faulting=faulting,
                exact=exact,
                note=note,
            )
        )
    return tuple(out)


def unflushed(records: Sequence[ProcessRecord]) -> tuple[str, ...]:
    """One note per process whose last record is a periodic one: it died without writing again
    (SIGKILL, a segfault, os._exit), so the launches after its last flush are not known."""
    notes = []
    for record in _processes_in_order(records):
        if record.end is None:
            notes.append(
                f"{record.label} ended without writing its final record (killed, crashed hard, or "
                f"os._exit): what it flushed last is shown, {record.launches:,} launches in; later "
                "launches are not known"
            )
    return tuple(notes)


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerTargets:
    kernels: tuple[str, ...]
    launch_count: int
    why: str


def sanitizer_targets(
    errors: Sequence[RunCudaError],
    found: Sequence[RunDiagnosis],
    records: Sequence[ProcessRecord],
) -> SanitizerTargets | None:
    """The kernels a memcheck rerun checks (the faulting one when known, else those launched
    just before a CUDA error, else those with a finding, else every kernel seen) and the launches
    it checks (``--launch-count``: enough to reach the launch that faulted)."""
    exact = [e for e in errors if e.exact and e.faulting]
    if exact:
        kernel = exact[0].faulting
        assert kernel is not None
        reach = max((launch.kernel_seq for e in exact for launch in e.last_launches if launch.kernel == kernel), default=1)
        return SanitizerTargets(kernels=(kernel,), launch_count=reach + 1, why="the faulting kernel")
    if errors:
        seqs: dict[str, int] = {}
        for e in errors:
            for launch in e.last_launches:
                seqs[launch.kernel] = max(seqs.get(launch.kernel, 0), launch.kernel_seq)
        if seqs:
            kernels = tuple(list(seqs)[-MAX_SANITIZED_KERNELS:])
            return SanitizerTargets(
                kernels=kernels,
                launch_count=sum(seqs[k] for k in kernels) + len(kernels),
                why="the kernels launched just before the CUDA error",
            )
    if found:
        kernels = tuple(dict.fromkeys(d.kernel for d in found))[:MAX_SANITIZED_KERNELS]
        first = {d.kernel: d.finding.launch.kernel_seq if d.finding.launch else 1 for d in found}
        return SanitizerTargets(
            kernels=kernels,
            launch_count=sum(first[k] for k in kernels) + SANITIZE_FIRST_LAUNCHES * len(kernels),
            why="the kernels with a finding",
        )
    seen = tuple(dict.fromkeys(k.name for r in records for k in r.kernels))[:MAX_SANITIZED_KERNELS]
    if not seen:
        return None
    return SanitizerTargets(
        kernels=seen, launch_count=SANITIZE_FIRST_LAUNCHES * len(seen), why="every kernel launched (no fault to aim at)"
    )


def tensor_tables(records: Sequence[ProcessRecord]) -> dict[str, list[TensorInfo]]:
    """Every tensor the records hold (rings and findings), by device, named after its launch
    (``w_ptr of _grouped_gemm_kernel #12``); a tensor passed again keeps its latest name."""
    tables: dict[str, dict[tuple[int, int], TensorInfo]] = {}
    launches: list[Launch] = []
    for record in records:
        launches.extend(f.launch for f in record.findings if f.launch is not None)
        launches.extend(record.ring)
    for launch in launches:
        for t in launch.tensors:
            if t.nbytes <= 0:
                continue
            label = f"{t.name} of {launch.kernel} #{launch.kernel_seq}"
            tables.setdefault(t.device, {})[(t.data_ptr, t.nbytes)] = t.tensor_info(label)
    return {device: list(by_ptr.values()) for device, by_ptr in tables.items()}


__all__ = [
    "LAST_LAUNCHES",
    "MAX_SANITIZED_KERNELS",
    "SanitizerTargets",
    "cuda_errors",
    "diagnoses",
    "sanitizer_targets",
    "tensor_tables",
    "unflushed",
]
