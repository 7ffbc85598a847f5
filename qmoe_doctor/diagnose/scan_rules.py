"""Classification: from the outcome matrix to diagnoses, by differential evidence only.

A rule names a cause only when the same inputs pass under a baseline and fail (or run
remotely) as exactly one condition changes. One function per cause, named after it, in the
table ``RULES``:

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
invalid-routing            single (valid m_sizes), or the same  m_sizes summing past M, or
                           operands with valid routing first    holding a -1 sentinel
                           in the probe
int32-offset-overflow      single (experts below 2**31)         rows on the first expert whose
                                                                offset passes 2**31 - 1
misaligned-operand         single, and x and w 16 bytes into    x and w 2 bytes (bf16) into
                           their buffers (storage-offset-8)     their buffers: a base that is
                                                                not 16-byte aligned
autotune-inplace-rerun     second call of the process           first call of the process
launch-config-fault        single (the kernel's own config)     a pinned config that runs
                                                                wrong; any cell the device
                                                                refuses for its resources
=========================  ===================================  ==============================

Cells that pass only by accident (an untouched current device whose null stream runs in the
operand device's context) are explained, not called healthy; so is a CPU tier whose Triton
interpreter cannot run at all, a cell whose input the kernel refused by contract (``rejected``),
and a cell whose check could not see what it claims (``unchecked``, ``blind_spots``). Each rule
returns the cells it accounts for; ``classify`` reports every failing cell that no rule accounts
for as unexplained.

Severity. Invalid routing is a *fault* when the kernel reads or writes outside its tensors (a
canary hit, an illegal access, a crash); wrong values with every access inside its tensors are a
*hardening* finding (``Diagnosis.severity``): reported, listed apart from the faults
(``Classification.hardening``), exit 0 (README, "Exit codes").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from qmoe_doctor.core.records import (
    Condition,
    Confidence,
    Diagnosis,
    ErrorKind,
    Evidence,
    Outcome,
    Phase,
    Status,
)
from qmoe_doctor.diagnose.baseline import not_run_after
from qmoe_doctor.diagnose.blind_spots import touches_outside, unchecked_reason, writes_checked
from qmoe_doctor.diagnose.device_assert import AssertSite, assert_sites, find_device_asserts
from qmoe_doctor.diagnose.matrix import (
    Cell,
    Matrix,
    build_matrix,
    debug_reruns,
    describe,
    evidence,
    variant_of,
)

#: The scan cells whose differential evidence settles each cause: the ``--only`` of its repro
#: command (a single-device cause cites the conditions that failed, in this order).
SETTLED_BY: dict[str, tuple[Condition, ...]] = {
    "missing-device-guard": (Condition.NO_PEER, Condition.PEER, Condition.PRODUCER_RACE),
    "default-device-buffer": (Condition.NO_PEER, Condition.PEER),
    "cross-device-stream-race": (Condition.PEER, Condition.PRODUCER_RACE, Condition.SIZES_RACE),
    "wrong-device-stream": (Condition.SIDE_STREAM,),
    "invalid-routing": (Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES),
    "int32-offset-overflow": (Condition.INT32_BOUNDARY,),
    "misaligned-operand": (Condition.OFFSETS,),
    "autotune-inplace-rerun": (Condition.REPEAT_CALL,),
    "launch-config-fault": (Condition.LAUNCH_CONFIG,),
}

#: The pair cells that move the current device off the operand device.
_OFF_GUARD = (
    Condition.UNTOUCHED,
    Condition.NO_PEER,
    Condition.PEER,
    Condition.PRODUCER_RACE,
    Condition.SIZES_RACE,
)
_RACES = (Condition.PRODUCER_RACE, Condition.SIZES_RACE)


# ---------------------------------------------------------------------------------------------
# The rule interface
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleContext:
    """What every rule may read besides the matrix."""

    kernel: str  # the --kernel reference, for repro commands
    names: Mapping[str, str] = field(default_factory=dict)  # group -> how the report names it
    debug_runs: Mapping[str, Outcome] = field(default_factory=dict)  # probe id -> TRITON_DEBUG=1 rerun
    accounted: frozenset[str] = frozenset()  # probe ids the rules before this one account for

    def where(self, group: str) -> str:
        return self.names.get(group, group)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """What one rule found: its diagnoses, cells that need a word, and the cells it explains."""

    diagnoses: tuple[Diagnosis, ...] = ()
    explanations: tuple[str, ...] = ()
    accounts_for: frozenset[str] = frozenset()  # probe ids
    hardening: tuple[Diagnosis, ...] = ()  # severity "hardening": not faults


Rule = Callable[[Matrix, RuleContext], Finding]


@dataclass(frozen=True, slots=True, kw_only=True)
class Classification:
    diagnoses: tuple[Diagnosis, ...]  # faults (exit 1)
    explanations: tuple[str, ...]  # "works by accident" and other cells that need a word
    unexplained: tuple[Evidence, ...]  # failing cells no rule accounts for
    hardening: tuple[Diagnosis, ...] = ()  # wrong values from excluded input, in bounds (exit 0)


def _repro(kernel: str, places: Sequence[str], only: Sequence[Condition]) -> str:
    gpus = ""
    for place in places[:1]:
        nums = [tok for tok in place.replace("->", " ").replace("GPU", " ").split() if tok.isdigit()]
        if nums:
            gpus = " --gpus " + ",".join(nums)
    return f"qmoe-doctor scan --kernel {kernel}{gpus} --only {','.join(only)}"


def _found(
    cause: str,
    ctx: RuleContext,
    *,
    summary: str,
    evidence: Sequence[Evidence],
    places: Sequence[str],
    confidence: Confidence = Confidence.HIGH,
    only: Sequence[Condition] | None = None,
    accounts_for: set[str],
    explanations: Sequence[str] = (),
) -> Finding:
    """A finding that names ``cause`` when there is evidence for it (else only explanations)."""
    diagnoses: tuple[Diagnosis, ...] = ()
    if evidence:
        diagnoses = (
            Diagnosis(
                cause=cause,
                confidence=confidence,
                summary=summary,
                evidence=tuple(evidence),
                where=tuple(places),
                repro=_repro(ctx.kernel, places, SETTLED_BY[cause] if only is None else only),
            ),
        )
    return Finding(diagnoses=diagnoses, explanations=tuple(explanations), accounts_for=frozenset(accounts_for))


# ---------------------------------------------------------------------------------------------
# Pair rules: the current device moved off the operand device, against the GUARDED baseline
# ---------------------------------------------------------------------------------------------


def _alloc_on_current(cell: Cell | None) -> int:
    if cell is None:
        return 0
    value = cell.outcome.facts.get("alloc_on_current_bytes", 0)
    return int(value) if isinstance(value, (int, float)) else 0


def _wrong_device_output(cell: Cell | None) -> bool:
    if cell is None or cell.outcome.out_device is None or cell.outcome.spec.device is None:
        return False
    return not cell.outcome.out_device.endswith(f":{cell.outcome.spec.device}")


def _guarded_pairs(matrix: Matrix) -> list[tuple[str, Cell]]:
    """(group, guarded baseline) of every pair whose baseline passed."""
    out: list[tuple[str, Cell]] = []
    for group in matrix.groups():
        base = matrix.get(group, Condition.GUARDED)
        if base is not None and base.ok:
            out.append((group, base))
    return out


def _off_cells(matrix: Matrix, group: str) -> list[Cell]:
    cells = [matrix.get(group, c) for c in _OFF_GUARD]
    return [c for c in cells if c is not None and c.label != "skipped"]


def _peer_pointer_rejected(matrix: Matrix, group: str) -> bool:
    """With peer access a->b on, every pointer on b passes Triton's launch check: a pointer that
    still fails it lives on another device (the current one)."""
    peer = matrix.get(group, Condition.PEER)
    return peer is not None and peer.outcome.error_kind is ErrorKind.POINTER_INACCESSIBLE


def _buffer_cells(matrix: Matrix, group: str) -> list[Cell]:
    """The off-guard cells that fail or run remotely, when the call allocated on the current
    device (or returned its output there, or a pointer fails the check with peer access on);
    else none. A pair that shows this is the buffer's, and the other pair rules skip it."""
    off_cells = _off_cells(matrix, group)
    allocs = [c for c in off_cells if _alloc_on_current(c) > 0 or _wrong_device_output(c)]
    bad = [c for c in off_cells if c.failed or c.label == "slow"]
    if (allocs or _peer_pointer_rejected(matrix, group)) and bad:
        return bad
    return []


def _launches_on_current(matrix: Matrix, group: str) -> bool:
    """The guard's two signatures: with peer access the kernel runs remotely (slow), or without
    it Triton's pointer check fails while with it the check passes."""
    peer = matrix.get(group, Condition.PEER)
    no_peer = matrix.get(group, Condition.NO_PEER)
    remote = peer is not None and peer.label == "slow"
    pointer_check = (
        no_peer is not None
        and no_peer.outcome.error_kind is ErrorKind.POINTER_INACCESSIBLE
        and peer is not None
        and peer.outcome.error_kind is not ErrorKind.POINTER_INACCESSIBLE
    )
    return remote or pointer_check


def missing_device_guard(matrix: Matrix, ctx: RuleContext) -> Finding:
    ev: list[Evidence] = []
    places: list[str] = []
    explained: set[str] = set()
    explanations: list[str] = []
    for group, base in _guarded_pairs(matrix):
        if _buffer_cells(matrix, group) or not _launches_on_current(matrix, group):
            continue
        ev.append(evidence(base, "correct with the operand device current"))
        for c in _off_cells(matrix, group):
            if c.failed or c.label == "slow":
                ev.append(evidence(c))
                explained.add(c.outcome.probe_id)
        places.append(ctx.where(group))
        untouched = matrix.get(group, Condition.UNTOUCHED)
        if untouched is not None and untouched.label in ("pass", "slow"):
            ctx_after = untouched.outcome.facts.get("context_on_current_after")
            explanations.append(
                f"{ctx.where(group)}: the untouched-context cell passed by accident: no CUDA context "
                "existed on the current device, so the launch on its null stream ran in the operand "
                "device's context"
                + (" (still no context there afterwards)" if ctx_after is False else "")
                + ". Any earlier use of that device (a copy, a tensor, set_device) breaks it."
            )
    # Two independent signatures of a launch on the current device: the pointer check fails
    # without peer access, and with peer access the kernel runs remotely or races.
    pointer = any(e.label == str(ErrorKind.POINTER_INACCESSIBLE) for e in ev)
    remote_or_race = any(e.label == "slow" or e.condition in _RACES for e in ev)
    return _found(
        "missing-device-guard",
        ctx,
        confidence=Confidence.HIGH if pointer and remote_or_race else Confidence.MEDIUM,
        summary=(
            "the kernel runs on the current device, not on its tensors' device: correct "
            "with the operand device current, and fails, runs remotely or races as soon as "
            "another device is current"
        ),
        evidence=ev,
        places=places,
        accounts_for=explained,
        explanations=explanations,
    )


def default_device_buffer(matrix: Matrix, ctx: RuleContext) -> Finding:
    ev: list[Evidence] = []
    places: list[str] = []
    explained: set[str] = set()
    for group, base in _guarded_pairs(matrix):
        bad = _buffer_cells(matrix, group)
        if not bad:
            continue
        peer_cell = matrix.get(group, Condition.PEER)
        foreign_pointer = _peer_pointer_rejected(matrix, group)
        ev.append(evidence(base, "correct with the operand device current"))
        for c in bad:
            extra = ""
            if _alloc_on_current(c):
                extra = f"; the call allocated {_alloc_on_current(c):,} bytes on the current device"
            elif c is peer_cell and foreign_pointer:
                extra = "; peer access a->b is on, so the rejected pointer is not on b"
            ev.append(evidence(c, describe(c) + extra))
            explained.add(c.outcome.probe_id)
        places.append(ctx.where(group))
    return _found(
        "default-device-buffer",
        ctx,
        summary=(
            "the call allocates on the current device instead of its tensors' device, "
            "and fails or misplaces its output whenever another device is current"
        ),
        evidence=ev,
        places=places,
        accounts_for=explained,
    )


def cross_device_stream_race(matrix: Matrix, ctx: RuleContext) -> Finding:
    ev: list[Evidence] = []
    places: list[str] = []
    explained: set[str] = set()
    for group, _base in _guarded_pairs(matrix):
        if _buffer_cells(matrix, group) or _launches_on_current(matrix, group):
            continue  # a race after a launch on the wrong device is the guard's consequence
        peer = matrix.get(group, Condition.PEER)
        races = [c for c in (matrix.get(group, r) for r in _RACES) if c is not None and c.failed]
        if not races or peer is None or not peer.ok:
            continue
        ev.append(evidence(peer, "correct when the producer has finished"))
        for c in races:
            ev.append(evidence(c))
            explained.add(c.outcome.probe_id)
        places.append(ctx.where(group))
    return _found(
        "cross-device-stream-race",
        ctx,
        summary=(
            "the kernel is not ordered after the stream that produces its inputs: right "
            "when the producer has finished, wrong while it is still queued"
        ),
        evidence=ev,
        places=places,
        accounts_for=explained,
    )


# ---------------------------------------------------------------------------------------------
# Single-device rules: one condition against the SINGLE baseline of the same device
# ---------------------------------------------------------------------------------------------


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if "overflow" in line or "Assertion" in line:
            return line.strip()[:200]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _against_single(
    matrix: Matrix,
    ctx: RuleContext,
    conditions: Sequence[Condition],
    select: Callable[[Cell], bool] | None = None,
) -> tuple[list[Evidence], list[str], list[Condition], set[str]]:
    """Evidence that ``conditions`` fail where the device's SINGLE cell (or, when the probe ran
    one, the same operands with valid routing in the same process) passes; with each failing
    cell's TRITON_DEBUG=1 rerun, when there is one. ``select`` keeps some failing cells only.
    (evidence, places, conditions, probe ids)"""
    ev: list[Evidence] = []
    places: list[str] = []
    conds: list[Condition] = []
    explained: set[str] = set()
    for cond in conditions:
        for group in matrix.groups():
            cell = matrix.get(group, cond)
            if cell is None or not cell.failed or (select is not None and not select(cell)):
                continue
            if cell.outcome.error_kind is ErrorKind.OUT_OF_RESOURCES:
                continue  # a launch-config fault
            facts = cell.outcome.facts
            if "baseline_ok" in facts:
                # the probe called the kernel on the same operands with valid routing first
                if not facts["baseline_ok"]:
                    continue
                base_err = facts.get("baseline_rel_error")
                ev.append(
                    evidence(
                        cell,
                        "same operands, valid routing, same process: correct"
                        + (f" (rel. error {base_err:.3g})" if isinstance(base_err, float) else ""),
                    )
                )
                ev.append(evidence(cell))
            else:
                base = matrix.get(group, Condition.SINGLE)
                if base is None or not base.ok:
                    continue
                base_ev = evidence(base, "correct on the same device with the baseline condition")
                if base_ev not in ev:
                    ev.append(base_ev)
                ev.append(evidence(cell))
            dbg = ctx.debug_runs.get(cell.outcome.probe_id)
            if dbg is not None:
                ev.append(debug_evidence(dbg))
            explained.add(cell.outcome.probe_id)
            if ctx.where(group) not in places:
                places.append(ctx.where(group))
            if cond not in conds:
                conds.append(cond)
    return ev, places, conds, explained


def debug_evidence(dbg: Outcome) -> Evidence:
    """A cell's TRITON_DEBUG=1 rerun as evidence: the device-side assert's file:line and what it
    checked (``int32 overflow detected for operation mul``), from the assertion lines the probe
    kept (``probes/device_log.py``), its error text and its stderr tail, in that order; the
    first line of its error otherwise."""
    kept = dbg.facts.get("device_assert_lines")
    lines = [str(line) for line in kept] if isinstance(kept, list) else []
    text = "\n".join([*lines, dbg.error_message or "", dbg.stderr_tail])
    sites = assert_sites(find_device_asserts(text))
    site: AssertSite | None = next((s for s in sites if s.site), sites[0] if sites else None)
    label = str(dbg.error_kind or dbg.status)
    if site is None:
        return Evidence(
            probe_id=dbg.probe_id,
            condition=dbg.spec.condition,
            label=label,
            detail="with TRITON_DEBUG=1: " + _first_line(dbg.error_message or dbg.stderr_tail),
        )
    what = (
        f"int{site.overflow_bits} overflow in {site.operation}"
        if site.operation and site.overflow_bits
        else f"assertion `{site.message}` failed"
    )
    count = dbg.facts.get("device_assert_count")
    threads = count if isinstance(count, int) and count else site.threads
    where = f" at {site.site}" if site.site else " (its file:line was cut off in the log)"
    return Evidence(
        probe_id=dbg.probe_id,
        condition=dbg.spec.condition,
        label=label,
        detail=f"with TRITON_DEBUG=1: {what}{where} ({threads:,} failing thread{'s' if threads != 1 else ''})",
        site=site.site,
        check=site.message,
    )


def wrong_device_stream(matrix: Matrix, ctx: RuleContext) -> Finding:
    ev, places, conds, explained = _against_single(matrix, ctx, (Condition.SIDE_STREAM,))
    return _found(
        "wrong-device-stream",
        ctx,
        summary=(
            "correct when the caller works on the default stream, wrong when the caller's current "
            "stream is a side stream whose producer is still queued: the launch is not on the "
            "caller's current stream"
        ),
        evidence=ev,
        places=places,
        only=conds,
        accounts_for=explained,
    )


#: The invalid-routing cells of both protocols (the routed protocol's: probes/routed_conditions.py;
#: a routed kernel's repro cites those that failed, as every single-device cause does).
_ROUTING = (
    *SETTLED_BY["invalid-routing"],
    Condition.IDS_OUT_OF_RANGE,
    Condition.DROPPED_SLOTS,
    Condition.EXPERT_MAP,
    Condition.MAP_PAST_LOCAL,
    Condition.PADDED_COUNT,
    Condition.GATHER_PAST_T,
)
#: The int32 boundary cells: the expert offset, and the routed protocol's gathered rows.
_INT32_CELLS = (*SETTLED_BY["int32-offset-overflow"], Condition.GATHERED_INT32)
_ROUTING_WORDS = {
    Condition.OVER_ROUTED: "m_sizes summing past M",
    Condition.NEGATIVE_SIZES: "a -1 sentinel in m_sizes",
    Condition.IDS_OUT_OF_RANGE: "expert ids past E or below -1",
    Condition.DROPPED_SLOTS: "-1 ids (dropped slots)",
    Condition.EXPERT_MAP: "an expert_map with -1 for remote experts",
    Condition.MAP_PAST_LOCAL: "expert_map entries past the local expert count",
    Condition.PADDED_COUNT: "a num_tokens_post_padded past its buffer",
    Condition.GATHER_PAST_T: "a gather index past T",
}
#: What a routed kernel trusts that an edge cell shows (the fault's summary).
_IDS_TRUSTED = "it uses expert ids (or expert_map entries) it does not mask by [0, E)"
_ROUTING_TRUST = {
    Condition.IDS_OUT_OF_RANGE: _IDS_TRUSTED,
    Condition.DROPPED_SLOTS: _IDS_TRUSTED,
    Condition.EXPERT_MAP: _IDS_TRUSTED,
    Condition.MAP_PAST_LOCAL: _IDS_TRUSTED,
    Condition.PADDED_COUNT: "it bounds its blocks by num_tokens_post_padded, not by the buffers it was given",
    Condition.GATHER_PAST_T: "it gathers rows by indices it does not mask by T*k",
}
#: Routing the parallel modes produce themselves (valid expert-parallel input): wrong values
#: there are a fault even with every access in bounds (README, "Exit codes").
_EP_ROUTING = frozenset({Condition.EXPERT_MAP})


def _outside(cell: Cell) -> bool:
    return touches_outside(cell.outcome, rejected=cell.label == "rejected") or (
        cell.outcome.spec.condition in _EP_ROUTING
    )


def _inside(cell: Cell) -> bool:
    return not _outside(cell)


def invalid_routing(matrix: Matrix, ctx: RuleContext) -> Finding:
    """A fault where invalid routing makes the kernel touch memory outside its tensors; a
    hardening finding where it only computes wrong values, every access in bounds (a plain
    per-expert loop under a -1 sentinel)."""
    ev, places, conds, explained = _against_single(matrix, ctx, _ROUTING, select=_outside)
    how = " or ".join(_ROUTING_WORDS[c] for c in conds) or "invalid m_sizes"
    m_sizes_only = all(c in (Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES) for c in conds)
    fault = _found(
        "invalid-routing",
        ctx,
        summary=(
            f"correct with valid m_sizes; with {how} the kernel reads or writes outside its "
            "tensors: it trusts m_sizes instead of clamping counts and masking rows by M"
            if m_sizes_only
            else f"correct with valid routing; with {how} the kernel reads or writes outside its tensors"
            + (" or computes wrong values for valid expert-parallel routing" if Condition.EXPERT_MAP in conds else "")
            + ": "
            + "; ".join(dict.fromkeys(_ROUTING_TRUST[c] for c in conds if c in _ROUTING_TRUST))
        ),
        evidence=ev,
        places=places,
        only=conds,
        accounts_for=explained,
    )
    h_ev, h_places, h_conds, h_explained = _against_single(matrix, ctx, _ROUTING, select=_inside)
    if not h_ev:
        return fault
    guarded = all(writes_checked(c.outcome) for c in matrix.cells.values() if c.outcome.probe_id in h_explained)
    h_how = " or ".join(_ROUTING_WORDS[c] for c in h_conds)
    clamp = (
        "Clamp counts and mask rows by M"
        if all(c in (Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES) for c in h_conds)
        else "Skip slots whose id (or map entry) is outside [0, E)"
    )
    summary = (
        f"wrong values under invalid routing ({h_how}), "
        + (
            "every access inside the kernel's tensors (guard rows around y intact): a hardening "
            f"finding, not a memory fault. {clamp}, or validate the routing "
            "where it is made"
            if guarded
            else "and no access outside y was seen, but writes outside y could not be checked "
            "(no canary could follow the kernel's output): a hardening finding unless the "
            "sanitizer shows otherwise"
        )
    )
    hardening = Diagnosis(
        cause="invalid-routing",
        confidence=Confidence.HIGH if guarded else Confidence.MEDIUM,
        summary=summary,
        evidence=tuple(h_ev),
        where=tuple(h_places),
        repro=_repro(ctx.kernel, h_places, h_conds),
        severity="hardening",
    )
    return replace(
        fault,
        hardening=(hardening,),
        accounts_for=fault.accounts_for | frozenset(h_explained),
        explanations=(
            *fault.explanations,
            "hardening (reported, exit 0): invalid-routing: "
            + summary
            + " (cells: "
            + ", ".join(sorted(h_explained))
            + ")",
        ),
    )


def int32_offset_overflow(matrix: Matrix, ctx: RuleContext) -> Finding:
    ev, places, conds, explained = _against_single(matrix, ctx, _INT32_CELLS)
    summary = "wrong once an offset passes 2**31 - 1 elements: an index x stride product is formed in int32"
    for cell in matrix.cells.values():
        if cell.outcome.probe_id not in explained:
            continue  # a cell that is not evidence (its baseline failed) does not say where it broke
        if cell.outcome.spec.condition is Condition.GATHERED_INT32 and cell.failed:
            f = cell.outcome.facts
            first, rows = f.get("first_wrapping_row"), f.get("rows")
            if first is not None and rows is not None:
                summary = (
                    f"correct on the first tokens, wrong once the gathered rows ({int(rows):,} = T*k) pass row "
                    f"{int(first):,}, whose offset row x N passes 2**31 - 1: a gathered slot id times a row "
                    "stride is formed in int32"
                )
                break
        if cell.outcome.spec.condition is Condition.INT32_BOUNDARY and cell.failed:
            f = cell.outcome.facts
            expert = f.get("expert")
            off = f.get("expert_offset_elements")
            if expert is not None and off is not None:
                summary = (
                    f"correct below 2**31 elements, wrong on expert {expert}, whose base offset "
                    f"{int(off):,} elements passes 2**31 - 1: an index x stride product is formed in int32"
                )
                break
    return _found(
        "int32-offset-overflow",
        ctx,
        summary=summary,
        evidence=ev,
        places=places,
        only=conds,
        accounts_for=explained,
    )


#: The offsets cell whose x and w start off the 16-byte grid, and its aligned twin: the same
#: values, the same strides, a storage offset of 8 elements (16 bytes in bf16/fp16, 32 in fp32).
MISALIGNED_VARIANT = "storage-offset-1"
ALIGNED_VARIANT = "storage-offset-8"
#: How a misaligned operand shows, and how sure each ending makes the diagnosis: CUDA names the
#: fault (misaligned address); a TMA copy off the 16-byte grid ends in an illegal instruction
#: (triton #7385); a device-side descriptor with a misaligned stride reads shifted tiles and
#: gives wrong values without an error (triton #10927).
_MISALIGNED_ENDINGS = {
    ErrorKind.MISALIGNED_ADDRESS: Confidence.HIGH,
    ErrorKind.ILLEGAL_INSTRUCTION: Confidence.MEDIUM,
}
_OPERANDS = ("x", "w")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _alignment(cell: Cell) -> str:
    """Which operands the cell offsets and by how many bytes: from the tensors the probe handed
    the kernel (their data_ptr), else from the variant and the dtype."""
    o = cell.outcome
    variant = variant_of(o)
    dtype = o.spec.shape.dtype
    recorded = {t.name: t for t in o.tensors if t.name in _OPERANDS}
    if set(recorded) == set(_OPERANDS):
        offs = [recorded[n].data_ptr % 16 for n in _OPERANDS]
        if offs[0] == offs[1]:
            return f"x and w data_ptr % 16 == {offs[0]}"
        return ", ".join(f"{n} data_ptr % 16 == {off}" for n, off in zip(_OPERANDS, offs, strict=True))
    elements = int(variant.rsplit("-", 1)[1])
    nbytes = elements * _ITEMSIZE.get(dtype, 2)
    return f"x and w {nbytes} byte{'s' if nbytes != 1 else ''} into their buffers"


def misaligned_operand(matrix: Matrix, ctx: RuleContext) -> Finding:
    """Operands off the 16-byte grid fail where the same operands 16 bytes in pass: the kernel
    needs aligned bases (TMA descriptors, vectorized loads) and does not check. Silent when the
    aligned twin or ``single`` fails too (then the storage offset itself is mishandled)."""
    ev: list[Evidence] = []
    places: list[str] = []
    explained: set[str] = set()
    confidence = Confidence.HIGH
    endings: list[str] = []
    offsets: list[str] = []
    for group in matrix.groups():
        bad = matrix.get(group, Condition.OFFSETS, MISALIGNED_VARIANT)
        good = matrix.get(group, Condition.OFFSETS, ALIGNED_VARIANT)
        base = matrix.get(group, Condition.SINGLE)
        if bad is None or good is None or base is None or not (good.ok and base.ok) or not bad.failed:
            continue
        kind = bad.outcome.error_kind if bad.outcome.status is Status.ERROR else None
        if kind in _MISALIGNED_ENDINGS:
            sure = _MISALIGNED_ENDINGS[kind]
            ending = f"`{kind}`"
        elif bad.outcome.status is Status.WRONG:
            sure, ending = Confidence.MEDIUM, "wrong values"
        else:
            continue  # another failure: not what a misaligned base does
        if sure is Confidence.MEDIUM:
            confidence = Confidence.MEDIUM
        endings.append(ending)
        offsets.append(_alignment(bad))
        base_ev = evidence(base, "correct on the same device with contiguous, freshly allocated operands")
        if base_ev not in ev:
            ev.append(base_ev)
        ev.append(evidence(good, f"{_alignment(good)} (16-byte aligned): " + describe(good)))
        ev.append(evidence(bad, f"{_alignment(bad)} (not 16-byte aligned): " + describe(bad)))
        explained.add(bad.outcome.probe_id)
        if ctx.where(group) not in places:
            places.append(ctx.where(group))
    how = " or ".join(dict.fromkeys(endings)) or "a failure"
    where = "; ".join(dict.fromkeys(offsets))
    return _found(
        "misaligned-operand",
        ctx,
        summary=(
            f"correct with x and w 16-byte aligned ({ALIGNED_VARIANT}), {how} with {where} "
            f"({MISALIGNED_VARIANT}), the same values and strides: the kernel needs 16-byte-aligned "
            "bases (TMA descriptors, vectorized loads) and does not check data_ptr() % 16 where it "
            "makes its descriptors"
        ),
        evidence=ev,
        places=places,
        confidence=confidence,
        accounts_for=explained,
    )


# ---------------------------------------------------------------------------------------------
# First call against second call; launch configs; the CPU tier itself
# ---------------------------------------------------------------------------------------------


def autotune_inplace_rerun(matrix: Matrix, ctx: RuleContext) -> Finding:
    ev: list[Evidence] = []
    places: list[str] = []
    explained = set(ctx.accounted)
    for group in matrix.groups():
        cell = matrix.get(group, Condition.REPEAT_CALL)
        if cell is None or len(cell.outcome.calls_rel_error) < 2:
            continue
        first, second = cell.outcome.calls_rel_error[:2]
        tol = cell.outcome.tolerance or 0.0
        if not (first <= tol) and second <= tol:
            ev.append(
                evidence(
                    cell,
                    f"first call of the process rel. error {first:.3g}, second call {second:.3g} "
                    f"(tolerance {tol:g}), identical inputs",
                )
            )
            explained.add(cell.outcome.probe_id)
            places.append(ctx.where(group))
    if ev:
        # Cells whose in-probe baseline (the first call for a new shape in that process) was
        # wrong while the next call was right show the same first-call failure.
        for c in matrix.cells.values():
            facts = c.outcome.facts
            if c.outcome.probe_id in explained:
                continue
            first_call = facts.get("first_call_in_process") is True or facts.get("first_call_for_shape") is True
            if c.outcome.status is Status.WRONG and first_call:
                # a cell that is the first call of its process, or the first for its shape (the
                # untouched cell runs alone; M = 4093 is a new autotune key), cannot tell its own
                # condition apart from the first-call fault
                ev.append(evidence(c, "first call for its process or shape: " + describe(c)))
                explained.add(c.outcome.probe_id)
            elif c.failed and facts.get("baseline_ok") is False and facts.get("variant_ok") is True:
                ev.append(
                    evidence(
                        c,
                        "first call for this shape in the process wrong "
                        f"(rel. error {facts.get('baseline_rel_error')}), the next call right",
                    )
                )
                explained.add(c.outcome.probe_id)
    return _found(
        "autotune-inplace-rerun",
        ctx,
        summary="the first call of each process is wrong and the second, on the same inputs, is right",
        evidence=ev,
        places=places,
        accounts_for=explained - ctx.accounted,
    )


def launch_config_fault(matrix: Matrix, ctx: RuleContext) -> Finding:
    ev: list[Evidence] = []
    places: list[str] = []
    explained: set[str] = set()
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
            ev.append(evidence(c, describe(c) + limit))
        elif cond is Condition.LAUNCH_CONFIG and c.failed:
            base = matrix.get(group, Condition.SINGLE)
            if base is None or not base.ok:
                continue
            ev.append(evidence(base, "correct with the kernel's own config choice"))
            ev.append(evidence(c, f"config {o.facts.get('config')}: " + describe(c)))
        else:
            continue
        explained.add(o.probe_id)
        if ctx.where(group) not in places:
            places.append(ctx.where(group))
    return _found(
        "launch-config-fault",
        ctx,
        summary=(
            "a launch config the device cannot run (more shared memory or registers than a "
            "block may have), or one that runs and gives wrong numbers"
        ),
        evidence=ev,
        places=places,
        accounts_for=explained,
    )


def interpreter_unavailable(matrix: Matrix, ctx: RuleContext) -> Finding:
    """Not a cause of the kernel's: the CPU tier's Triton interpreter cannot run here at all."""
    explanations: list[str] = []
    explained: set[str] = set()
    for c in matrix.cells.values():
        if c.outcome.spec.condition is Condition.INTERPRETER_CHECK and c.failed:
            explained.add(c.outcome.probe_id)
            # a child that never started (a missing or broken Python) ran no interpreter at all
            what = (
                "no probe child could start on this machine"
                if c.outcome.phase is Phase.SPAWN
                else "the Triton interpreter cannot run a trivial reference kernel on this machine"
            )
            explanations.append(
                what
                + " ("
                + describe(c)
                + "): the CPU tier was skipped; that says nothing about the kernel under test"
            )
    return Finding(explanations=tuple(explanations), accounts_for=frozenset(explained))


def contract_refusals(matrix: Matrix, ctx: RuleContext) -> Finding:
    """Not a cause: cells whose input the kernel refused loudly before launch (``rejected``),
    with the input each refuses. The kernel honours its contract; the report says what it is."""
    explanations: list[str] = []
    for group in matrix.groups():
        parts = []
        for (g, _cond, _variant), c in matrix.cells.items():
            refused = c.refused if g == group and c.label == "rejected" else None
            if refused is not None:
                cell = c.outcome.spec.placement.cell_name(c.outcome.spec.condition)
                parts.append(f"{cell}: {refused.operand} ({refused.statement})")
        if parts:
            explanations.append(
                f"{ctx.where(group)}: the kernel refused inputs its contract excludes, loudly and "
                "before any launch (rejected, not a fault): " + "; ".join(parts)
            )
    return Finding(explanations=tuple(explanations))


def cells_not_run(matrix: Matrix, ctx: RuleContext) -> Finding:
    """Not a cause: cells a session did not run because an outcome before them settled them
    (the kernel hung on the canonical inputs; on the CPU tier, it needs CUDA:
    ``baseline.stop_reason``), said once per stopping cell with the reason."""
    stopped: dict[str, list[Cell]] = {}
    for c in matrix.cells.values():
        after = not_run_after(c.outcome)
        if after is not None:
            stopped.setdefault(after, []).append(c)
    explanations = []
    for after, cells in stopped.items():
        reason = cells[0].outcome.notes[0] if cells[0].outcome.notes else "not run"
        names = ", ".join(c.outcome.spec.placement.cell_name(c.outcome.spec.condition) for c in cells)
        explanations.append(f"{len(cells)} cell(s) after {after} ({names}): {reason}")
    return Finding(explanations=tuple(explanations))


def unchecked_cells(matrix: Matrix, ctx: RuleContext) -> Finding:
    """Not a cause: cells that passed although their check could not see what they claim
    (``unchecked``, docs/cells.md), each with the reason."""
    explanations: list[str] = []
    for c in matrix.cells.values():
        reason = unchecked_reason(c.outcome) if c.label == "unchecked" else None
        if reason is not None:
            explanations.append(f"{c.outcome.probe_id} unchecked: {reason}")
    return Finding(explanations=tuple(explanations))


#: The rules in the order their diagnoses are reported. Order matters once: the first-call rule
#: claims only cells the rules before it left unexplained.
RULES: tuple[Rule, ...] = (
    missing_device_guard,
    default_device_buffer,
    cross_device_stream_race,
    wrong_device_stream,
    invalid_routing,
    int32_offset_overflow,
    misaligned_operand,
    autotune_inplace_rerun,
    launch_config_fault,
    interpreter_unavailable,
    contract_refusals,
    unchecked_cells,
    cells_not_run,
)
#: The rules that name no cause: they explain cells.
NOTE_RULES: tuple[Rule, ...] = (interpreter_unavailable, contract_refusals, unchecked_cells, cells_not_run)


def classify(
    outcomes: Sequence[Outcome],
    *,
    kernel: str,
    gpu_names: dict[str, str] | None = None,
) -> Classification:
    """Run every rule of ``RULES`` over the outcomes' matrix. ``gpu_names`` maps a group
    ("0->1", "GPU 1") to how the report names it."""
    matrix = build_matrix(outcomes)
    ctx = RuleContext(kernel=kernel, names=gpu_names or {}, debug_runs=debug_reruns(outcomes))
    diagnoses: list[Diagnosis] = []
    hardening: list[Diagnosis] = []
    explanations: list[str] = []
    accounted: set[str] = set()
    for rule in RULES:
        found = rule(matrix, replace(ctx, accounted=frozenset(accounted)))
        diagnoses += found.diagnoses
        hardening += found.hardening
        explanations += found.explanations
        accounted |= found.accounts_for
    unexplained = tuple(
        evidence(c) for c in matrix.cells.values() if c.failed and c.outcome.probe_id not in accounted
    )
    return Classification(
        diagnoses=tuple(diagnoses),
        explanations=tuple(explanations),
        unexplained=unexplained,
        hardening=tuple(hardening),
    )


__all__ = [
    "ALIGNED_VARIANT",
    "MISALIGNED_VARIANT",
    "NOTE_RULES",
    "RULES",
    "SETTLED_BY",
    "Classification",
    "Finding",
    "Rule",
    "RuleContext",
    "autotune_inplace_rerun",
    "cells_not_run",
    "classify",
    "contract_refusals",
    "debug_evidence",
    "cross_device_stream_race",
    "default_device_buffer",
    "int32_offset_overflow",
    "interpreter_unavailable",
    "invalid_routing",
    "launch_config_fault",
    "misaligned_operand",
    "missing_device_guard",
    "unchecked_cells",
    "wrong_device_stream",
]
