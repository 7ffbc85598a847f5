"""What a scan covered: the cells that ran, those whose check was blind, and the conditions that
could not run here. The verdict says it ("no fault in the 13 cells that ran; placement, peer and
stream conditions need two GPUs"), so that a CPU run, or one GPU, is never read as a clean bill
for what it could not test.

Stdlib only. The cell labels come from the outcome matrix (``diagnose.matrix``): the caller
passes them, probe id -> label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qmoe_doctor.core.conditions import PAIR_ORDER
from qmoe_doctor.core.records import Condition, Outcome, Status

#: Conditions that are not the kernel's cells (the CPU tier's check of its own interpreter).
_NOT_CELLS = frozenset({Condition.INTERPRETER_CHECK})


@dataclass(frozen=True, slots=True, kw_only=True)
class Coverage:
    """What a scan's verdict covers."""

    # cells of the kernel that ran, reruns left out; a skipped one did not (nor one the CPU tier
    # could not run because it needs CUDA: its label is "skipped")
    cells_ran: int
    conditions_ran: tuple[str, ...]  # their conditions, in run order
    unchecked: tuple[str, ...] = ()  # probe ids that passed with a blind check (docs/cells.md)
    rejected: tuple[str, ...] = ()  # probe ids whose input the kernel refused by contract
    not_covered: tuple[str, ...] = ()  # what could not run here, and why, in words

    @property
    def complete(self) -> bool:
        """Every condition of a full scan ran and every check could see what it claims."""
        return not self.not_covered and not self.unchecked

    @property
    def caveats(self) -> tuple[str, ...]:
        """What a verdict over these cells must add: refusals, blind cells, what did not run."""
        parts = []
        if self.rejected:
            parts.append(f"{len(self.rejected)} rejected by the kernel's contract")
        if self.unchecked:
            parts.append(f"{len(self.unchecked)} unchecked ({', '.join(self.unchecked)})")
        if self.not_covered:
            parts.append("not covered: " + "; ".join(self.not_covered))
        return tuple(parts)

    def sentence(self) -> str:
        """``13 cells ran; 1 unchecked (CPU/over-routed); not covered: ...``"""
        ran = f"{self.cells_ran} cell{'s' if self.cells_ran != 1 else ''} ran"
        return "; ".join((ran, *self.caveats))


def coverage_of(outcomes: Sequence[Outcome], labels: Mapping[str, str]) -> Coverage:
    """The coverage of a scan's outcomes; ``labels`` maps probe id -> cell label (reruns, which
    are evidence and not cells, have none and are left out)."""
    cells = [
        o
        for o in outcomes
        if o.probe_id in labels and o.spec.condition not in _NOT_CELLS and not o.spec.placement.rerun
    ]
    ran = [o for o in cells if labels.get(o.probe_id) != "skipped" and o.status is not Status.SKIPPED]
    conditions = tuple(dict.fromkeys(o.spec.condition.value for o in ran))
    ran_conditions = {o.spec.condition for o in ran}
    not_covered: list[str] = []
    if not ran_conditions & set(PAIR_ORDER):
        not_covered.append(
            "placement, peer-access and cross-device stream conditions (they need two GPUs: --gpus 0,1)"
        )
    if Condition.SIDE_STREAM not in ran_conditions:
        not_covered.append("the caller's side stream (CUDA streams: a GPU)")
    if Condition.INT32_BOUNDARY not in ran_conditions:
        not_covered.append("the int32 offset boundary (a weight stack over 4 GiB on a GPU)")
    if Condition.ROUTED in ran_conditions and Condition.GATHERED_INT32 not in ran_conditions:
        not_covered.append("the gathered int32 boundary of the routed rows (T*k*N past 2**31 on a GPU)")
    return Coverage(
        cells_ran=len(ran),
        conditions_ran=conditions,
        unchecked=tuple(o.probe_id for o in ran if labels.get(o.probe_id) == "unchecked"),
        rejected=tuple(o.probe_id for o in ran if labels.get(o.probe_id) == "rejected"),
        not_covered=tuple(not_covered),
    )


__all__ = ["Coverage", "coverage_of"]
