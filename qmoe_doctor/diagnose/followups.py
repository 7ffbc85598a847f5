"""The scan's follow-up for a blind invalid-routing cell: a compute-sanitizer memcheck run.

When no canary could follow the kernel's own output (``canary_after_output`` is not true: the
kernel allocated ``y`` in a way the probe's guard rows cannot serve, and the caching allocator
held nothing right after it), the over-routed and negative-sizes cells cannot see a write past
``y``. On a GPU the scan then re-runs that one small probe alone under ``compute-sanitizer
--tool memcheck`` with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (the caching allocator hides an
out-of-bounds write inside its pooled segment: 0 errors with it, 514 without, FINDINGS.md), a
few seconds at the cell's size. What it says is folded back into the cell:

* errors: the cell is ``wrong`` with the sanitizer's first error as a canary hit ("memcheck:
  Invalid __global__ write ... after the allocation"), so invalid-routing is a fault;
* clean: the writes were checked (``memcheck: "clean"``): a pass is a pass, wrong values are a
  hardening finding;
* no sanitizer, or it failed: the cell stays ``unchecked`` and says why.

Pure functions; the run itself is ``workflows.repro.confirm_with_sanitizer`` (the isolate and
machine layers), called by the scan workflow for every outcome ``needs_memcheck`` picks.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from qmoe_doctor.core.records import Outcome, Status
from qmoe_doctor.diagnose.blind_spots import INVALID_INPUT_CONDITIONS, MEMCHECK_FACT, writes_checked

MemcheckVerdict = Literal["clean", "errors", "unavailable", "failed"]


def needs_memcheck(outcome: Outcome) -> bool:
    """A GPU invalid-routing cell that ran to completion without a canary after the output
    (and was not followed up yet): the scan confirms it under memcheck."""
    return (
        outcome.spec.device is not None
        and outcome.spec.condition in INVALID_INPUT_CONDITIONS
        and not outcome.spec.placement.rerun
        and outcome.status in (Status.PASS, Status.WRONG)
        and not outcome.canary_hits
        and not writes_checked(outcome)
        and MEMCHECK_FACT not in outcome.facts
    )


def with_memcheck(
    outcome: Outcome,
    verdict: MemcheckVerdict,
    reason: str,
    *,
    first_error: str | None = None,
    touched: str | None = None,
    log_path: str | None = None,
) -> Outcome:
    """The cell with its memcheck follow-up folded in (see the module docstring). ``reason`` is
    the sanitizer confirmation's own sentence; ``first_error`` and ``touched`` its first error
    and the tensor it hit, when it found errors."""
    facts = {**outcome.facts, MEMCHECK_FACT: verdict, "memcheck_reason": reason}
    if log_path:
        facts["memcheck_log"] = log_path
    notes = (*outcome.notes, f"memcheck follow-up ({verdict}): {reason}")
    if verdict != "errors":
        return dataclasses.replace(outcome, facts=facts, notes=notes)
    hit = "memcheck: " + (first_error or "invalid access") + (f" ({touched})" if touched else "")
    return dataclasses.replace(
        outcome,
        status=Status.WRONG,
        canary_hits=(*outcome.canary_hits, hit),
        facts=facts,
        notes=notes,
    )


def verdict_of(status: str, errors: int | None) -> MemcheckVerdict:
    """A ``SanitizerConfirmation``'s status as the follow-up's verdict."""
    if status == "confirmed" and errors:
        return "errors"
    if status == "clean":
        return "clean"
    if status == "unavailable":
        return "unavailable"
    return "failed"


__all__ = ["MEMCHECK_FACT", "MemcheckVerdict", "needs_memcheck", "verdict_of", "with_memcheck", "writes_checked"]
