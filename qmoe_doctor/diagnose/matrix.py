"""The outcome matrix: one cell per (group, condition, variant), each with its rendered label.

A *group* is where a probe ran: an ordered GPU pair ("0->1") for pair conditions, a device
("GPU 1", "CPU") for single-device ones. A *variant* tells apart several cells of one condition
(offset sweeps, launch configs) and is "" otherwise. Both come from the spec's ``Placement``,
which the planner wrote; ``group_of`` and ``variant_of`` are the one place that reads them for
a cell; the rules (``scan_rules``), the renderers and the check's JUnit detail read cells, never
probe ids.

A cell's label is ``pass``, ``slow`` (correct, but ``knobs.SLOW_FACTOR`` times slower than the
guarded baseline of its pair: it ran remotely), ``wrong``, ``skipped`` (did not apply, was not
run, or, on the CPU tier, needs CUDA: not checked), ``rejected`` (an input the kernel's contract
excludes, refused loudly before launch while the same kernel passed its group's baseline cell,
which is correct), ``unchecked`` (passed, but its check could not see what the cell claims) or
the error kind. ``blind_spots`` decides the last two from the outcome's facts and its group's
baseline (``baseline``); labels are settled once a session's outcomes are all in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from qmoe_doctor.core import knobs
from qmoe_doctor.core.records import Condition, ErrorKind, Evidence, Outcome, Placement, Status
from qmoe_doctor.diagnose.baseline import cpu_cannot_run, group_baselines, needs_cuda_reason
from qmoe_doctor.diagnose.blind_spots import (
    INVALID_INPUT_CONDITIONS,
    REJECTION_KINDS,
    Refusal,
    refusal,
    returned_instead,
    unchecked_reason,
)

#: The probe id suffix of a failing cell's rerun under TRITON_DEBUG=1 (``plan.scan.debug_rerun``
#: sets ``Placement.rerun``): evidence for the cell it reruns, not a cell of its own.
DEBUG_SUFFIX = "+debug"


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """One outcome with its rendered label."""

    outcome: Outcome
    label: str  # pass | slow | wrong | skipped | rejected | unchecked | <error kind>
    slowdown: float | None = None  # kernel_ms / guarded baseline kernel_ms
    refused: Refusal | None = None  # what the kernel refused, when the label is "rejected"

    @property
    def ok(self) -> bool:
        return self.label == "pass"

    @property
    def failed(self) -> bool:
        return self.label not in ("pass", "slow", "skipped", "rejected", "unchecked")


@dataclass(frozen=True, slots=True, kw_only=True)
class Matrix:
    """Outcomes keyed by (group, condition, variant)."""

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

    def placements(self) -> dict[str, Placement]:
        """Group -> its placement (whether it is a pair, its GPUs, how a report names it)."""
        return {g: c.outcome.spec.placement for (g, _, _), c in self.cells.items()}


def variant_of(outcome: Outcome) -> str:
    """The cell's variant (its placement's): an offsets variant, a launch config, or ""."""
    return outcome.spec.placement.variant


def group_of(outcome: Outcome) -> str:
    """The cell's group (its placement's): "0->1", "GPU 1", "CPU", "rank 1"."""
    return outcome.spec.placement.group


def group_names(outcomes: Iterable[Outcome]) -> dict[str, str]:
    """Group -> how a report names it ("0->1" -> "GPU 0 -> GPU 1"), from the placements."""
    return {o.spec.placement.group: o.spec.placement.label for o in outcomes}


def is_debug_rerun(outcome: Outcome) -> bool:
    """A failing cell's rerun under TRITON_DEBUG=1."""
    return outcome.spec.placement.rerun == "debug"


def debug_reruns(outcomes: Iterable[Outcome]) -> dict[str, Outcome]:
    """Probe id of the cell -> its TRITON_DEBUG=1 rerun (whose id is the cell's + DEBUG_SUFFIX)."""
    return {o.probe_id.removesuffix(DEBUG_SUFFIX): o for o in outcomes if is_debug_rerun(o)}


def cell_label(
    outcome: Outcome, baseline_ms: float | None, baseline: Outcome | None = None
) -> tuple[str, float | None]:
    """(label, slowdown) of one outcome; ``baseline_ms`` is its pair's guarded kernel time,
    ``baseline`` its group's baseline cell (a refusal needs it to have passed)."""
    if outcome.status is Status.SKIPPED or cpu_cannot_run(outcome):
        return "skipped", None
    if refusal(outcome, baseline) is not None:
        return "rejected", None
    if unchecked_reason(outcome) is not None:
        return "unchecked", None
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


def label_cells(outcomes: Iterable[Outcome]) -> list[Cell]:
    """Every outcome as a cell, debug reruns included, in order: each judged against its group's
    baselines (the guarded time of its pair; its group's baseline cell for refusals)."""
    outcomes = list(outcomes)
    timed: dict[str, float] = {}
    for o in outcomes:
        if o.spec.condition is Condition.GUARDED and o.status is Status.PASS and o.kernel_ms:
            timed[group_of(o)] = o.kernel_ms
    baselines = group_baselines(outcomes)
    cells = []
    for o in outcomes:
        group = group_of(o)
        base_ms = timed.get(group) if o.spec.condition.is_pair else None
        label, slowdown = cell_label(o, base_ms, baselines.get(group))
        refused = refusal(o, baselines.get(group)) if label == "rejected" else None
        cells.append(Cell(outcome=o, label=label, slowdown=slowdown, refused=refused))
    return cells


def build_matrix(outcomes: Iterable[Outcome]) -> Matrix:
    """The cells of a scan (debug reruns left out: they are evidence, not cells)."""
    cells: dict[tuple[str, Condition, str], Cell] = {}
    for cell in label_cells(o for o in outcomes if not is_debug_rerun(o)):
        o = cell.outcome
        cells[(group_of(o), o.spec.condition, variant_of(o))] = cell
    return Matrix(cells=cells)


def describe(cell: Cell) -> str:
    """One line: what a cell showed (the report's evidence detail, check's JUnit detail)."""
    o = cell.outcome
    if cell.label == "slow" and cell.slowdown:
        return f"correct but {cell.slowdown:.1f}x slower than the guarded baseline: it ran remotely"
    if cell.label == "skipped" and cpu_cannot_run(o):
        return needs_cuda_reason(o)
    if cell.refused is not None:
        what = f"; {o.notes[0]}" if o.notes else ""
        return cell.refused.render() + what
    blind = unchecked_reason(o)
    if blind is not None:
        return "no failure seen, but " + blind
    returned = returned_instead(o)
    if returned is not None and o.status is Status.WRONG:
        return f"the kernel returned {returned}, not the (M, N) output tensor"
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
        if o.nan_written:
            parts.append(f"{o.nan_written} output elements written as NaN")
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


def evidence(cell: Cell, detail: str | None = None) -> Evidence:
    """The cell as a piece of evidence; ``detail`` says what it shows (default: ``describe``)."""
    o = cell.outcome
    return Evidence(
        probe_id=o.probe_id, condition=o.spec.condition, label=cell.label, detail=detail or describe(cell)
    )


__all__ = [
    "DEBUG_SUFFIX",
    "INVALID_INPUT_CONDITIONS",
    "REJECTION_KINDS",
    "Cell",
    "Matrix",
    "build_matrix",
    "cell_label",
    "debug_reruns",
    "describe",
    "evidence",
    "group_names",
    "group_of",
    "is_debug_rerun",
    "label_cells",
    "variant_of",
]
