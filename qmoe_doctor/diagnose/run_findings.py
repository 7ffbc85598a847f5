"""What ``qmoe-doctor run`` concludes from its processes' records (pure functions).

* :func:`diagnoses`: the monitor's findings of every process, one diagnosis per cause, kind and
  kernel, with the processes that showed it and the first launch;
* :func:`cuda_errors`: each CUDA error with the launches before it, and the faulting kernel when
  the pass launched with CUDA_LAUNCH_BLOCKING=1 (then the launch that raised is the one);
* :func:`unflushed`: processes that ended without writing their final record;
* :func:`sanitizer_targets`: which kernels a compute-sanitizer rerun checks, and how many launches;
* :func:`tensor_tables`: every recorded tensor by device, to attribute addresses against;
* :func:`address_notes`: compute-sanitizer's invalid addresses placed in those tensors;
* :func:`placed_diagnoses`: a diagnosis when the placed addresses agree (one kernel, one side of
  its arguments, one and the same cause that fits), else why they give none.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from qmoe_doctor.core.error_kind import match_text
from qmoe_doctor.core.launches import FindingKind, Launch, LaunchFinding, ProcessRecord, TensorArg
from qmoe_doctor.core.records import Confidence, ErrorKind, TensorInfo
from qmoe_doctor.core.reports import AddressNote, PlacedFit, RunCudaError, RunDiagnosis, RunPassLabel
from qmoe_doctor.diagnose.attribution import attribute, describe_tensor
from qmoe_doctor.diagnose.sanitizer_log import SanitizerReport

#: Launches before a CUDA error that a report shows.
LAST_LAUNCHES = 8
#: Kernels a compute-sanitizer rerun checks at most (its filter is one regular expression).
MAX_SANITIZED_KERNELS = 8
#: Launches per kernel a sanitizer rerun checks when no fault points at one.
SANITIZE_FIRST_LAUNCHES = 2

_CUDA_KINDS = (ErrorKind.ILLEGAL_ADDRESS, ErrorKind.DEVICE_ASSERT)
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
#: How each confidence is reached, in the report's words (RunDiagnosis.basis).
_OBSERVED = "observed at the launch: the tensors' devices were read"
_BASIS = {
    FindingKind.RANK_ON_DEVICE_0: _OBSERVED + ", with the rank's LOCAL_RANK",
    FindingKind.OTHER_DEVICE: _OBSERVED,
    FindingKind.MIXED_DEVICES: _OBSERVED,
    FindingKind.CPU_TENSOR: _OBSERVED,
    FindingKind.INT32_BY_SIZE: (
        "the lint's int32 offset product joined to a tensor size observed at the launch: the wrap is "
        "reachable, not seen to happen"
    ),
    FindingKind.DEFAULT_STREAM: "a heuristic over the ring's last launches (docs/run.md says what makes it wrong)",
}
#: The share of the invalid addresses read from memcheck's log that must land on the same side
#: of the kernel's arguments, where one and the same cause fits, for the placement to give a
#: diagnosis. Short of it the addresses disagree (some past y, some inside x): no diagnosis, and
#: the report says how they split.
AGREEMENT_SHARE = 0.9
#: The argument groups a disagreement lists before "and N more".
_SPLIT_SHOWN = 4
_ORDER = (
    FindingKind.RANK_ON_DEVICE_0,
    FindingKind.OTHER_DEVICE,
    FindingKind.MIXED_DEVICES,
    FindingKind.CPU_TENSOR,
    FindingKind.INT32_BY_SIZE,
    FindingKind.DEFAULT_STREAM,
    FindingKind.PLACED_ACCESS,
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
                basis=_BASIS.get(kind, ""),
            )
        )
    out.sort(key=lambda d: (_ORDER.index(d.kind) if d.kind in _ORDER else len(_ORDER), d.kernel))
    return tuple(out)


def _cuda_launch(launch: Launch) -> bool:
    return bool(launch.raised) and match_text(launch.raised) in _CUDA_KINDS


def cuda_errors(records: Sequence[ProcessRecord], *, blocking: bool) -> tuple[RunCudaError, ...]:
    """Every process that met a CUDA error, with its last launches. With ``blocking`` (the pass
    ran with CUDA_LAUNCH_BLOCKING=1) each launch completed before the next call, so the launch
    that raised the error is the faulting kernel."""
    out: list[RunCudaError] = []
    for record in _processes_in_order(records):
        end = record.end
        message = record.cuda_error or (end.detail if end is not None and end.error_kind in _CUDA_KINDS else "")
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
                error_kind=end.error_kind if end is not None and end.error_kind is not None else match_text(message),
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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    """Where a recorded tensor came from: its process, its launch, the argument."""

    record: ProcessRecord
    launch: Launch
    tensor: TensorArg


def _labelled(records: Sequence[ProcessRecord]) -> Iterator[tuple[str, str, _Source]]:
    """(device, label, source) of every sized tensor in the records, findings' launches first,
    then the rings', in the records' order."""
    for record in records:
        launches = [f.launch for f in record.findings if f.launch is not None]
        for launch in (*launches, *record.ring):
            for t in launch.tensors:
                if t.nbytes > 0:
                    label = f"{t.name} of {launch.kernel} #{launch.kernel_seq}"
                    yield t.device, label, _Source(record=record, launch=launch, tensor=t)


def tensor_tables(records: Sequence[ProcessRecord]) -> dict[str, list[TensorInfo]]:
    """Every tensor the records hold (rings and findings), by device, named after its launch
    (``w_ptr of _grouped_gemm_kernel #12``); a tensor passed again keeps its latest name."""
    tables: dict[str, dict[tuple[int, int], TensorInfo]] = {}
    for device, label, source in _labelled(records):
        t = source.tensor
        tables.setdefault(device, {})[(t.data_ptr, t.nbytes)] = t.tensor_info(label)
    return {device: list(by_ptr.values()) for device, by_ptr in tables.items()}


def _sources(records: Sequence[ProcessRecord]) -> dict[str, _Source]:
    """The launch and argument behind each label of :func:`tensor_tables` (the latest)."""
    return {label: source for _, label, source in _labelled(records)}


def address_notes(report: SanitizerReport, records: Sequence[ProcessRecord]) -> tuple[AddressNote, ...]:
    """Each distinct invalid address of memcheck's log, placed against the records' tensors on
    every device (the nearest first)."""
    notes: list[AddressNote] = []
    for a in attribute(report, tensor_tables(records)):
        m = a.matches[0] if a.matches else None
        notes.append(
            AddressNote(
                address=a.address,
                kernel=a.kernel,
                access=a.access,
                tensor=m.tensor if m else None,
                device=m.device if m else None,
                relation=m.relation if m else None,
                cross_device=a.cross_device,
                sentences=a.sentences,
                gap=m.gap if m else None,
                region=m.region if m else None,
                row=m.row if m else None,
                expert=m.expert if m else None,
                # an address inside another GPU's tensor is a cross-GPU read, whatever is nearest here
                fits=m.fits if m and not a.cross_device else (),
            )
        )
    return tuple(notes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """What the placed addresses say together: a diagnosis (when they agree) and one line on
    how they agree or split (``SanitizerRun.agreement``)."""

    diagnoses: tuple[RunDiagnosis, ...] = ()
    note: str = ""


_SIDE = {"after": "after the end of", "before": "before the start of", "inside": "inside"}


def _span(values: Sequence[int], unit: str = "") -> str:
    low, high = min(values), max(values)
    return f"{low:,}{unit}" if low == high else f"{low:,} to {high:,}{unit}"


def _fits_words(fits: tuple[PlacedFit, ...]) -> str:
    return " or ".join(f.words for f in fits) if fits else "no cause"


def _scan_command(launch: Launch, fit: PlacedFit) -> str:
    """The scan that proves ``fit`` on the kernel, when the launch came through a wrapper the
    monitor named; else how to get one."""
    only = f" --only {fit.cell}" if fit.cell else ""
    if launch.wrapper:
        return f"qmoe-doctor scan --kernel {launch.wrapper}{only}"
    at = f" (at {launch.launch_site.render()})" if launch.launch_site is not None else ""
    why = (
        "no module-level function between the launch and your line takes (x, w, m_sizes)"
        if launch.wrapper is not None
        else "the record names no wrapper (its call sites were not sampled, or it predates them)"
    )
    return (
        f"{why}: put the call that launches {launch.kernel}{at} in a function fn(x, w, m_sizes) -> y "
        f"in a module, then qmoe-doctor scan --kernel FILE.py:fn{only} (another signature: an adapter, "
        "README: --kernel)"
    )


def _argument_words(members: Sequence[tuple[AddressNote, _Source]], relation: str, count: str) -> str:
    """``64 of 64 invalid writes after the end of y_ptr of K #1 (4096 x 1536 bf16) on cuda:0, 0 to 1,008 bytes
    after its 12,582,912-byte region (rows 4096-4099, past M=4096)``"""
    first_note, first = members[0]
    verbs = sorted({a.access.split(" ")[0] for a, _ in members})
    accesses = " and ".join(f"{v}s" if v != "access" else "accesses" for v in verbs)
    t = first.tensor
    text = f"{count} invalid {accesses} {_SIDE[relation]} {describe_tensor(t.tensor_info(first_note.tensor))} on {t.device}"
    gaps = [a.gap for a, _ in members if a.gap is not None]
    if gaps:
        text += f", {_span(gaps, ' bytes')} {relation} its {t.nbytes:,}-byte region"
    rows = [a.row for a, _ in members if a.row is not None]
    if rows and relation == "after" and len(t.shape) >= 2 and first_note.expert is None:
        low, high = min(rows), max(rows)
        text += f" (row{f's {low}-{high}' if high > low else f' {low}'}, past M={t.shape[0]})"
    return text


def placed_diagnoses(addresses: Sequence[AddressNote], records: Sequence[ProcessRecord]) -> Placement:
    """A diagnosis from memcheck's placed addresses when they agree: at least AGREEMENT_SHARE of
    the addresses read land on the same side (after the end, or before the start) of arguments of
    the same kernel, and where each landed fits the same one cause (rows past M of x and of y
    both fit m_sizes summing past M: invalid-routing). Medium confidence: memcheck saw the
    accesses, but no condition was flipped to show what makes them; the scan command proves it.
    ``records``: the sanitize pass's, the ones the addresses were placed against."""
    if not addresses:
        return Placement()
    sources = _sources(records)
    total = len(addresses)
    # by argument and side, for the words; by the cause that fits, for the agreement
    by_argument: dict[tuple[str, str], int] = {}
    groups: dict[tuple[str, str, tuple[PlacedFit, ...]], list[tuple[AddressNote, str]]] = {}
    unplaced = 0
    for a in addresses:
        if a.tensor is None or a.relation is None:
            unplaced += 1
            continue
        source = sources.get(a.tensor)
        argument = source.tensor.name if source is not None else a.tensor
        relation = "inside" if a.cross_device else a.relation
        by_argument[(argument, relation)] = by_argument.get((argument, relation), 0) + 1
        groups.setdefault((a.kernel or "", relation, a.fits), []).append((a, argument))
    if not groups:
        return Placement(note=f"none of the {total} invalid addresses lies near a recorded tensor: no diagnosis")
    split_items = sorted(by_argument.items(), key=lambda kv: -kv[1])
    split = [f"{n} {_SIDE.get(rel, rel)} {arg}" for (arg, rel), n in split_items[:_SPLIT_SHOWN]]
    if len(split_items) > _SPLIT_SHOWN:
        split.append(f"{sum(n for _, n in split_items[_SPLIT_SHOWN:])} elsewhere")
    if unplaced:
        split.append(f"{unplaced} near no recorded tensor")
    need = (
        f"a diagnosis needs {AGREEMENT_SHARE:.0%} of the addresses read past the end or before the start of "
        "the kernel's arguments, where one and the same cause fits"
    )
    (kernel, relation, fits), members = max(groups.items(), key=lambda kv: len(kv[1]))
    arguments = list(dict.fromkeys(argument for _, argument in members))
    names = " and ".join(arguments)
    share = f"{len(members)} of {total}"
    if len(members) < AGREEMENT_SHARE * total:
        return Placement(note=f"the {total} invalid addresses disagree ({', '.join(split)}): no diagnosis; {need}")
    if relation == "inside":
        return Placement(
            note=(
                f"{share} invalid addresses lie inside {names} (a live tensor: another GPU's memory or a "
                f"block freed since, their sentences say which): no diagnosis from where they landed; {need}"
            )
        )
    if len(fits) != 1:
        return Placement(
            note=(
                f"{share} invalid addresses land {_SIDE[relation]} {names}, where {_fits_words(fits)} fits: "
                "not one cause, no diagnosis"
            )
        )
    (fit,) = fits
    placed = [(a, sources[a.tensor]) for a, _ in members if a.tensor in sources]
    if not placed:
        return Placement(note=f"{share} invalid addresses agree on {names}, but no launch of it is in the records")
    placed.sort(key=lambda p: (p[1].record.pid, p[1].launch.seq))
    per_argument: dict[str, list[tuple[AddressNote, _Source]]] = {}
    for a, source in placed:
        per_argument.setdefault(source.tensor.name, []).append((a, source))
    if len(per_argument) == 1:
        (only,) = per_argument.values()
        summary = f"memcheck placed {_argument_words(only, relation, share)}"
    else:
        parts = [_argument_words(group, relation, str(len(group))) for group in per_argument.values()]
        summary = f"memcheck placed {share} invalid addresses: {'; '.join(parts)}"
    summary += f": {fit.words} fits"
    launch = placed[0][1].launch
    launches = {(s.record.pid, s.launch.seq) for _, s in placed}
    processes = tuple(dict.fromkeys(s.record.label for _, s in placed))
    finding = LaunchFinding(
        kind=FindingKind.PLACED_ACCESS,
        cause=fit.cause,
        kernel=launch.kernel,
        message=summary,
        launch_device=launch.device,
        tensors=tuple(group[0][1].tensor for group in per_argument.values()),
        outcome="ran",
        first_seq=launch.seq,
        count=len(launches),
        launch=launch,
    )
    where = _SIDE[relation]
    diagnosis = RunDiagnosis(
        cause=fit.cause,
        kind=FindingKind.PLACED_ACCESS,
        confidence=Confidence.MEDIUM,
        summary=summary,
        kernel=kernel or launch.kernel,
        processes=processes,
        launches=len(launches),
        finding=finding,
        seen_in="sanitize",
        basis=f"placed by memcheck, {share} addresses {where} {names}; not yet proven differentially",
        repro=_scan_command(launch, fit),
    )
    return Placement(
        diagnoses=(diagnosis,),
        note=f"{share} invalid addresses agree: {where} {names} of {launch.kernel}, {fit.words} fits: {fit.cause}",
    )


__all__ = [
    "AGREEMENT_SHARE",
    "LAST_LAUNCHES",
    "MAX_SANITIZED_KERNELS",
    "Placement",
    "SanitizerTargets",
    "address_notes",
    "cuda_errors",
    "diagnoses",
    "placed_diagnoses",
    "sanitizer_targets",
    "tensor_tables",
    "unflushed",
]
