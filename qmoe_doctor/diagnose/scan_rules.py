"""Classification: from the outcome matrix to diagnoses, by differential evidence only.

A rule names a cause only when the same inputs pass under a baseline and fail (or run
remotely) as exactly one condition changes:

=========================  ===================================  ==============================
cause                      baseline that must pass              the one condition that flips
=========================  ===================================  ==============================
missing-device-guard       guarded (current = operand device)   current device != operand
                                                                device, no allocation there
default-device-buffer      guarded                              current device != operand
                                                                device, and the call allocated
                                                                on the current device
cross-device-stream-race   peer (remote call, producer done)    producer still queued on b's
                                                                stream (only when the launch
                                                                is not remote: else it is the
                                                                guard's consequence)
wrong-device-stream        single (caller on default stream)    caller on a side stream
invalid-routing            single (valid m_sizes)               m_sizes summing past M
autotune-inplace-rerun     second call of the process           first call of the process
int32-offset-overflow      single (experts below 2**31)         rows on the first expert whose
                                                                offset passes 2**31 - 1
launch-config-fault        single                               a config the device rejects
=========================  ===================================  ==============================

Cells that pass only by accident (an untouched current device whose null stream runs in the
operand device's context) are explained, not called healthy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from qmoe_doctor.core import knobs
from qmoe_doctor.core.records import (
    Condition,
    Confidence,
    Diagnosis,
    ErrorKind,
    Evidence,
    Outcome,
    Status,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """One outcome with its rendered label."""

    outcome: Outcome
    label: str  # pass | slow | wrong | skipped | <error kind>
    slowdown: float | None = None  # kernel_ms / guarded baseline kernel_ms

    @property
    def ok(self) -> bool:
        return self.label == "pass"

    @property
    def failed(self) -> bool:
        return self.label not in ("pass", "slow", "skipped", "rejected")


@dataclass(frozen=True, slots=True, kw_only=True)
class Matrix:
    """Outcomes keyed by (group, condition, variant). A group is a pair ("0->1") or a device
    ("GPU 1", "CPU"): the part of the probe id before the slash. A variant tells apart several
    cells of one condition (offset sweeps, launch configs); it is "" otherwise."""

    cells: dict[tuple[str, Condition, str], Cell] = field(default_factory=dict)

    def get(self, group: str, cond: Condition, variant: str = "") -> Cell | None:
        return self.cells.get((group, cond, variant))

    def groups(self) -> list[str]:
        seen: dict[str, None] = {}
        for group, _, _ in self.cells:
            seen.setdefault(group, None)
        return list(seen)

    def variants(self, group: str, cond: Condition) -> list[Cell]:
        return [c for (g, k, _), c in self.cells.items() if g == group and k is cond]


def variant_of(outcome: Outcome) -> str:
    return str(outcome.spec.params.get("variant", ""))


def group_of(outcome: Outcome) -> str:
    return outcome.probe_id.split("/", 1)[0]


#: Conditions that feed the kernel invalid input on purpose: refusing it loudly (its own
#: ValueError, or a device-side assert such as torch._grouped_mm's offsets check) is correct.
INVALID_INPUT_CONDITIONS = frozenset({Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES})
REJECTION_KINDS = frozenset({ErrorKind.BAD_INPUT, ErrorKind.DEVICE_ASSERT})


def cell_label(outcome: Outcome, baseline_ms: float | None) -> tuple[str, float | None]:
    if outcome.status is Status.SKIPPED:
        return "skipped", None
    if (
        outcome.status is Status.ERROR
        and outcome.spec.condition in INVALID_INPUT_CONDITIONS
        and outcome.error_kind in REJECTION_KINDS
    ):
        return "rejected", None
    if outcome.status is Status.ERROR:
        return str(outcome.error_kind or ErrorKind.OTHER), None
    if outcome.status is Status.WRONG:
        return "wrong", None
    slowdown = None
    if outcome.kernel_ms and baseline_ms:
        slowdown = outcome.kernel_ms / baseline_ms
        if slowdown >= knobs.SLOW_FACTOR:
            return "slow", slowdown
    return "pass", slowdown


def build_matrix(outcomes: Iterable[Outcome]) -> Matrix:
    outcomes = [o for o in outcomes if not o.probe_id.endswith("+debug")]
    baselines: dict[str, float] = {}
    for o in outcomes:
        if o.spec.condition is Condition.GUARDED and o.status is Status.PASS and o.kernel_ms:
            baselines[group_of(o)] = o.kernel_ms
    cells: dict[tuple[str, Condition, str], Cell] = {}
    for o in outcomes:
        group = group_of(o)
        base = baselines.get(group) if o.spec.condition.is_pair else None
        label, slowdown = cell_label(o, base)
        cells[(group, o.spec.condition, variant_of(o))] = Cell(outcome=o, label=label, slowdown=slowdown)
    return Matrix(cells=cells)


def describe(cell: Cell) -> str:
    """One line: what a cell showed (the report's evidence detail, check's JUnit detail)."""
    o = cell.outcome
    if cell.label == "slow" and cell.slowdown:
        return f"correct but {cell.slowdown:.1f}x slower than the guarded baseline: it ran remotely"
    if o.status is Status.ERROR:
        msg = (o.error_message or "").strip().splitlines()
        return f"{o.error_type or 'error'}: {msg[0][:160] if msg else o.error_kind}"
    if o.status is Status.WRONG:
        parts = []
        if o.rel_error is not None:
            parts.append(
                f"rel. error {o.rel_error:.3g}" + (f" (tolerance {o.tolerance:g})" if o.tolerance else "")
            )
        if o.unwritten:
            parts.append(f"{o.unwritten} output elements never written")
        if o.canary_hits:
            parts.append("wrote past the output (" + ", ".join(o.canary_hits) + ")")
        if o.out_device and o.spec.device is not None and not o.out_device.endswith(f":{o.spec.device}"):
            parts.append(f"output returned on {o.out_device}")
        if o.calls_rel_error:
            parts.append("per call rel. error " + ", ".join(f"{e:.3g}" for e in o.calls_rel_error))
        return "; ".join(parts) or "wrong result"
    if o.status is Status.PASS:
        return "correct" + (f" ({o.kernel_ms:.3f} ms)" if o.kernel_ms else "")
    return "; ".join(o.notes) or "skipped"


def _ev(cell: Cell, detail: str | None = None) -> Evidence:
    o = cell.outcome
    return Evidence(
        probe_id=o.probe_id, condition=o.spec.condition, label=cell.label, detail=detail or describe(cell)
    )


def _alloc_on_current(cell: Cell | None) -> int:
    if cell is None:
        return 0
    value = cell.outcome.facts.get("alloc_on_current_bytes", 0)
    return int(value) if isinstance(value, (int, float)) else 0


def _wrong_device_output(cell: Cell | None) -> bool:
    if cell is None or cell.outcome.out_device is None or cell.outcome.spec.device is None:
        return False
    return not cell.outcome.out_device.endswith(f":{cell.outcome.spec.device}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Classification:
    diagnoses: tuple[Diagnosis, ...]
    explanations: tuple[str, ...]  # "works by accident" and other cells that need a word
    unexplained: tuple[Evidence, ...]  # failing cells no rule accounts for


def classify(
    outcomes: Sequence[Outcome],
    *,
    kernel: str,
    gpu_names: dict[str, str] | None = None,
) -> Classification:
    """``gpu_names`` maps a group ("0->1", "GPU 1") to how the report names it."""
    matrix = build_matrix(outcomes)
    names = gpu_names or {}
    diagnoses: list[Diagnosis] = []
    explanations: list[str] = []
    explained: set[str] = set()

    def where(group: str) -> str:
        return names.get(group, group)

    # --- pair rules -----------------------------------------------------------------------
    guard_ev: list[Evidence] = []
    guard_where: list[str] = []
    buffer_ev: list[Evidence] = []
    buffer_where: list[str] = []
    race_ev: list[Evidence] = []
    race_where: list[str] = []
    for group in matrix.groups():
        base = matrix.get(group, Condition.GUARDED)
        if base is None or not base.ok:
            continue
        off = [
            matrix.get(group, c)
            for c in (
                Condition.UNTOUCHED,
                Condition.NO_PEER,
                Condition.PEER,
                Condition.PRODUCER_RACE,
                Condition.SIZES_RACE,
            )
        ]
        off_cells = [c for c in off if c is not None and c.label != "skipped"]
        allocs = [c for c in off_cells if _alloc_on_current(c) > 0 or _wrong_device_output(c)]
        bad = [c for c in off_cells if c.failed or c.label == "slow"]
        peer_cell = matrix.get(group, Condition.PEER)
        # With peer access a->b on, every pointer on b passes Triton's launch check: a pointer
        # that still fails it lives on another device (the current one).
        foreign_pointer = (
            peer_cell is not None and peer_cell.outcome.error_kind is ErrorKind.POINTER_INACCESSIBLE
        )
        if (allocs or foreign_pointer) and bad:
            buffer_ev.append(_ev(base, "correct with the operand device current"))
            for c in bad:
                extra = ""
                if _alloc_on_current(c):
                    extra = f"; the call allocated {_alloc_on_current(c):,} bytes on the current device"
                elif c is peer_cell and foreign_pointer:
                    extra = "; peer access a->b is on, so the rejected pointer is not on b"
                buffer_ev.append(_ev(c, describe(c) + extra))
                explained.add(c.outcome.probe_id)
            buffer_where.append(where(group))
            continue
        peer = matrix.get(group, Condition.PEER)
        no_peer = matrix.get(group, Condition.NO_PEER)
        remote = peer is not None and peer.label == "slow"
        pointer_check = (
            no_peer is not None
            and no_peer.outcome.error_kind is ErrorKind.POINTER_INACCESSIBLE
            and peer is not None
            and peer.outcome.error_kind is not ErrorKind.POINTER_INACCESSIBLE
        )
        races = [
            c
            for c in (matrix.get(group, Condition.PRODUCER_RACE), matrix.get(group, Condition.SIZES_RACE))
            if c is not None and c.failed
        ]
        if remote or pointer_check:
            guard_ev.append(_ev(base, "correct with the operand device current"))
            for c in off_cells:
                if c.failed or c.label == "slow":
                    guard_ev.append(_ev(c))
                    explained.add(c.outcome.probe_id)
            guard_where.append(where(group))
        elif races and peer is not None and peer.ok:
            race_ev.append(_ev(peer, "correct when the producer has finished"))
            for c in races:
                race_ev.append(_ev(c))
                explained.add(c.outcome.probe_id)
            race_where.append(where(group))
        untouched = matrix.get(group, Condition.UNTOUCHED)
        if untouched is not None and untouched.label in ("pass", "slow") and (remote or pointer_check):
            ctx_after = untouched.outcome.facts.get("context_on_current_after")
            explanations.append(
                f"{where(group)}: the untouched-context cell passed by accident: no CUDA context "
                "existed on the current device, so the launch on its null stream ran in the operand "
                "device's context"
                + (" (still no context there afterwards)" if ctx_after is False else "")
                + ". Any earlier use of that device (a copy, a tensor, set_device) breaks it."
            )
    if guard_ev:
        # Two independent signatures of a launch on the current device: the pointer check fails
        # without peer access, and with peer access the kernel runs remotely or races.
        pointer = any(e.label == str(ErrorKind.POINTER_INACCESSIBLE) for e in guard_ev)
        remote_or_race = any(
            e.label == "slow" or e.condition in (Condition.PRODUCER_RACE, Condition.SIZES_RACE)
            for e in guard_ev
        )
        strong = pointer and remote_or_race
        diagnoses.append(
            Diagnosis(
                cause="missing-device-guard",
                confidence=Confidence.HIGH if strong else Confidence.MEDIUM,
                summary=(
                    "the kernel runs on the current device, not on its tensors' device: correct "
                    "with the operand device current, and fails, runs remotely or races as soon as "
                    "another device is current"
                ),
                evidence=tuple(guard_ev),
                where=tuple(guard_where),
                repro=_repro(kernel, guard_where, "no-peer,peer,producer-race"),
            )
        )
    if buffer_ev:
        diagnoses.append(
            Diagnosis(
                cause="default-device-buffer",
                confidence=Confidence.HIGH,
                summary=(
                    "the call allocates on the current device instead of its tensors' device, "
                    "and fails or misplaces its output whenever another device is current"
                ),
                evidence=tuple(buffer_ev),
                where=tuple(buffer_where),
                repro=_repro(kernel, buffer_where, "no-peer,peer"),
            )
        )
    if race_ev:
        diagnoses.append(
            Diagnosis(
                cause="cross-device-stream-race",
                confidence=Confidence.HIGH,
                summary=(
                    "the kernel is not ordered after the stream that produces its inputs: right "
                    "when the producer has finished, wrong while it is still queued"
                ),
                evidence=tuple(race_ev),
                where=tuple(race_where),
                repro=_repro(kernel, race_where, "peer,producer-race,sizes-race"),
            )
        )

    # --- single-device rules: one condition against the SINGLE baseline of the same device ---
    single_rules = (
        (Condition.SIDE_STREAM, "wrong-device-stream", _side_stream_summary),
        (Condition.OVER_ROUTED, "invalid-routing", _routing_summary),
        (Condition.NEGATIVE_SIZES, "invalid-routing", _routing_summary),
        (Condition.INT32_BOUNDARY, "int32-offset-overflow", _boundary_summary),
    )
    debug_runs = {o.probe_id.removesuffix("+debug"): o for o in outcomes if o.probe_id.endswith("+debug")}
    by_cause: dict[str, tuple[list[Evidence], list[str], list[str]]] = {}
    summaries: dict[str, str] = {}
    for cond, cause, summarize in single_rules:
        evidence, places, conds = by_cause.setdefault(cause, ([], [], []))
        for group in matrix.groups():
            cell = matrix.get(group, cond)
            if cell is None or not cell.failed:
                continue
            if cell.outcome.error_kind is ErrorKind.OUT_OF_RESOURCES:
                continue  # a launch-config fault, handled below
            facts = cell.outcome.facts
            if "baseline_ok" in facts:
                # the probe called the kernel on the same operands with valid routing first
                if not facts["baseline_ok"]:
                    continue
                base_err = facts.get("baseline_rel_error")
                evidence.append(
                    _ev(
                        cell,
                        "same operands, valid routing, same process: correct"
                        + (f" (rel. error {base_err:.3g})" if isinstance(base_err, float) else ""),
                    )
                )
                evidence.append(_ev(cell))
            else:
                base = matrix.get(group, Condition.SINGLE)
                if base is None or not base.ok:
                    continue
                base_ev = _ev(base, "correct on the same device with the baseline condition")
                if base_ev not in evidence:
                    evidence.append(base_ev)
                evidence.append(_ev(cell))
            dbg = debug_runs.get(cell.outcome.probe_id)
            if dbg is not None:
                evidence.append(
                    Evidence(
                        probe_id=dbg.probe_id,
                        condition=dbg.spec.condition,
                        label=str(dbg.error_kind or dbg.status),
                        detail="with TRITON_DEBUG=1: " + _first_line(dbg.error_message or dbg.stderr_tail),
                    )
                )
            explained.add(cell.outcome.probe_id)
            if where(group) not in places:
                places.append(where(group))
            if cond.value not in conds:
                conds.append(cond.value)
            summaries[cause] = summarize(matrix, places)
    for cause, (evidence, places, conds) in by_cause.items():
        if evidence:
            diagnoses.append(
                Diagnosis(
                    cause=cause,
                    confidence=Confidence.HIGH,
                    summary=summaries[cause],
                    evidence=tuple(evidence),
                    where=tuple(places),
                    repro=_repro(kernel, places, ",".join(conds)),
                )
            )

    # --- first call vs second call ---
    ev_rerun: list[Evidence] = []
    rerun_where: list[str] = []
    for group in matrix.groups():
        cell = matrix.get(group, Condition.REPEAT_CALL)
        if cell is None or len(cell.outcome.calls_rel_error) < 2:
            continue
        first, second = cell.outcome.calls_rel_error[:2]
        tol = cell.outcome.tolerance or 0.0
        if not (first <= tol) and second <= tol:
            ev_rerun.append(
                _ev(
                    cell,
                    f"first call of the process rel. error {first:.3g}, second call {second:.3g} "
                    f"(tolerance {tol:g}), identical inputs",
                )
            )
            explained.add(cell.outcome.probe_id)
            rerun_where.append(where(group))
    if ev_rerun:
        # Cells whose in-probe baseline (the first call for a new shape in that process) was
        # wrong while the next call was right show the same first-call failure.
        for c in matrix.cells.values():
            facts = c.outcome.facts
            if c.outcome.probe_id in explained:
                continue
            first = facts.get("first_call_in_process") is True or facts.get("first_call_for_shape") is True
            if c.outcome.status is Status.WRONG and first:
                # a cell that is the first call of its process, or the first for its shape (the
                # untouched cell runs alone; M = 4093 is a new autotune key), cannot tell its own
                # condition apart from the first-call fault
                ev_rerun.append(_ev(c, "first call for its process or shape: " + describe(c)))
                explained.add(c.outcome.probe_id)
            elif c.failed and facts.get("baseline_ok") is False and facts.get("variant_ok") is True:
                ev_rerun.append(
                    _ev(
                        c,
                        "first call for this shape in the process wrong "
                        f"(rel. error {facts.get('baseline_rel_error')}), the next call right",
                    )
                )
                explained.add(c.outcome.probe_id)
        diagnoses.append(
            Diagnosis(
                cause="autotune-inplace-rerun",
                confidence=Confidence.HIGH,
                summary="the first call of each process is wrong and the second, on the same inputs, is right",
                evidence=tuple(ev_rerun),
                where=tuple(rerun_where),
                repro=_repro(kernel, rerun_where, "repeat-call"),
            )
        )

    # --- launch configs the device rejects, or that run and give wrong numbers ---
    ev_cfg: list[Evidence] = []
    cfg_where: list[str] = []
    for (group, cond, _variant), c in matrix.cells.items():
        o = c.outcome
        if o.error_kind is ErrorKind.OUT_OF_RESOURCES:
            facts = o.facts
            limit = ""
            if facts.get("smem_bytes_estimate") and facts.get("smem_limit_bytes"):
                limit = (
                    f" (config {facts.get('config')}: about {int(facts['smem_bytes_estimate']):,} B of "
                    f"shared memory asked, {int(facts['smem_limit_bytes']):,} B per block on this device)"
                )
            ev_cfg.append(_ev(c, describe(c) + limit))
        elif cond is Condition.LAUNCH_CONFIG and c.failed:
            base = matrix.get(group, Condition.SINGLE)
            if base is None or not base.ok:
                continue
            ev_cfg.append(_ev(base, "correct with the kernel's own config choice"))
            ev_cfg.append(_ev(c, f"config {o.facts.get('config')}: " + describe(c)))
        else:
            continue
        explained.add(o.probe_id)
        if where(group) not in cfg_where:
            cfg_where.append(where(group))
    if ev_cfg:
        diagnoses.append(
            Diagnosis(
                cause="launch-config-fault",
                confidence=Confidence.HIGH,
                summary=(
                    "a launch config the device cannot run (more shared memory or registers than a "
                    "block may have), or one that runs and gives wrong numbers"
                ),
                evidence=tuple(ev_cfg),
                where=tuple(cfg_where),
                repro=_repro(kernel, cfg_where, "launch-config"),
            )
        )

    for c in matrix.cells.values():
        if c.outcome.spec.condition is Condition.INTERPRETER_CHECK and c.failed:
            explained.add(c.outcome.probe_id)
            explanations.append(
                "the Triton interpreter cannot run a trivial reference kernel on this machine ("
                + describe(c)
                + "): the CPU tier was skipped; that says nothing about the kernel under test"
            )
    unexplained = tuple(
        _ev(c) for c in matrix.cells.values() if c.failed and c.outcome.probe_id not in explained
    )
    return Classification(
        diagnoses=tuple(diagnoses), explanations=tuple(explanations), unexplained=unexplained
    )


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if "overflow" in line or "Assertion" in line:
            return line.strip()[:200]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _side_stream_summary(matrix: Matrix, places: list[str]) -> str:
    return (
        "correct when the caller works on the default stream, wrong when the caller's current "
        "stream is a side stream whose producer is still queued: the launch is not on the "
        "caller's current stream"
    )


def _routing_summary(matrix: Matrix, places: list[str]) -> str:
    return (
        "correct with valid m_sizes; with m_sizes summing past M or holding a -1 sentinel the "
        "kernel computes the wrong rows or writes outside y: it trusts m_sizes instead of "
        "clamping counts and masking rows by M"
    )


def _boundary_summary(matrix: Matrix, places: list[str]) -> str:
    for cell in matrix.cells.values():
        if cell.outcome.spec.condition is Condition.INT32_BOUNDARY and cell.failed:
            f = cell.outcome.facts
            expert = f.get("expert")
            off = f.get("expert_offset_elements")
            if expert is not None and off is not None:
                return (
                    f"correct below 2**31 elements, wrong on expert {expert}, whose base offset "
                    f"{int(off):,} elements passes 2**31 - 1: an index x stride product is formed in int32"
                )
    return "wrong once an offset passes 2**31 - 1 elements: an index x stride product is formed in int32"


def _repro(kernel: str, places: Sequence[str], only: str) -> str:
    gpus = ""
    for place in places[:1]:
        nums = [tok for tok in place.replace("->", " ").replace("GPU", " ").split() if tok.isdigit()]
        if nums:
            gpus = " --gpus " + ",".join(nums)
    return f"qmoe-doctor scan --kernel {kernel}{gpus} --only {only}"
