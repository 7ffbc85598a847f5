"""What a cell's check could not see, and what a kernel refused: read from an outcome's facts.

Two things make a cell's plain label wrong:

* **A blind check.** A cell that passed although its check could not see what the cell claims
  is ``unchecked``, never ``pass``. ``docs/cells.md`` lists every cell, when it can be blind, and
  how each is covered; the cases decided here are:

  - ``over-routed`` / ``negative-sizes``: the claim is "nothing written outside y". It is seen
    only when a canary follows the kernel's own output (``canary_after_output``: the probe's
    guard rows around an output the kernel allocates with ``torch.empty``/``zeros`` of its
    shape, or the caching allocator's block right after it). Recorded GPU scans before the guard
    rows never had one: those passes were blind. On a GPU the scan confirms such a cell with a
    compute-sanitizer memcheck run (``diagnose/followups.py``); without the sanitizer it stays
    unchecked, with the reason.
  - ``repeat-call``: the claim is "the first call of a process is right". For an autotuned
    kernel the first-call fault needs the autotuner to benchmark on the caller's buffers; a
    first call that did not benchmark (a result cached on disk, or one config left after
    pruning) could not show it.

* **A contract refusal.** A kernel whose call raises, any exception type, before it launched
  anything (``assert x.is_contiguous()``, torch's ``view size is not compatible`` in a wrapper
  that flattens ``w``), while the same kernel passed the baseline cell with the canonical inputs
  in the same session (``baseline.baseline_passed``), refuses an input it does not support,
  loudly and with nothing written: the cell is ``rejected`` (correct), and the report names the
  refused input. Only the variant changed, so the refusal is about it. Not a refusal: an
  exception raised in the doctor's own probe code, one raised after a launch, one whose launch
  count was not observed, a device failure, a missing CUDA (``baseline.needs_cuda``), a cell
  whose baseline failed or did not run (the kernel raises whatever it is given:
  ``baseline.unusable``). For the invalid-routing cells a device-side assert on the counts
  (``torch._grouped_mm``'s offsets check) is a refusal too.

Pure functions of the outcome and its group's baseline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qmoe_doctor.core.records import Condition, ErrorKind, Outcome, Status
from qmoe_doctor.diagnose.baseline import (
    CANONICAL_CONDITIONS,
    PYTHON_ERROR_KINDS,
    baseline_passed,
    needs_cuda,
    python_error,
    raised_by_call,
)

#: Conditions that feed the kernel invalid input on purpose: refusing it loudly (its own
#: ValueError, or a device-side assert such as torch._grouped_mm's offsets check) is correct.
INVALID_INPUT_CONDITIONS = frozenset(
    {
        Condition.OVER_ROUTED,
        Condition.NEGATIVE_SIZES,
        # the routed protocol's edges (probes/routed_conditions.py)
        Condition.IDS_OUT_OF_RANGE,
        Condition.DROPPED_SLOTS,
        Condition.MAP_PAST_LOCAL,
        Condition.PADDED_COUNT,
        Condition.GATHER_PAST_T,
    }
)
#: Cells whose claim is "nothing written outside the output" (a canary must follow it): the
#: invalid-routing cells and the expert-map cell (valid expert-parallel routing, -1 entries).
WRITE_CHECKED_CONDITIONS = INVALID_INPUT_CONDITIONS | {Condition.EXPERT_MAP}
#: Error kinds a refusal can have: an exception of the kernel's Python side, or a device-side
#: assert on the counts in the invalid-routing cells.
REJECTION_KINDS = PYTHON_ERROR_KINDS | {ErrorKind.DEVICE_ASSERT}

#: The operands each offsets variant changes (probes/conditions.OFFSET_VARIANTS says how).
VARIANT_OPERANDS: dict[str, tuple[str, ...]] = {
    "storage-offset-1": ("x", "w"),
    "storage-offset-8": ("x", "w"),
    "padded-rows": ("x",),
    "transposed-w": ("w",),
    "empty-experts": ("m_sizes",),
    "hot-expert": ("m_sizes",),
    "last-expert": ("m_sizes",),
    "m-not-multiple": ("x",),
}
_CONDITION_OPERANDS: dict[Condition, tuple[str, ...]] = {
    Condition.OVER_ROUTED: ("m_sizes",),
    Condition.NEGATIVE_SIZES: ("m_sizes",),
    Condition.INT32_BOUNDARY: ("w",),
    Condition.IDS_OUT_OF_RANGE: ("topk_ids",),
    Condition.DROPPED_SLOTS: ("topk_ids",),
    Condition.EXPERT_MAP: ("topk_ids", "expert_map"),
    Condition.MAP_PAST_LOCAL: ("expert_map",),
    Condition.PADDED_COUNT: ("num_tokens_post_padded",),
    Condition.GATHER_PAST_T: ("gather_indx",),
}
_OPERAND_WORDS = re.compile(
    r"\b(x|w|m_sizes|hidden_states|topk_ids|topk_weights|expert_map|num_tokens_post_padded|gather_indx)\b"
)
#: The fact a memcheck follow-up of a blind cell leaves (``diagnose/followups.py``): clean |
#: errors | unavailable | failed; ``memcheck_reason`` says why in words.
MEMCHECK_FACT = "memcheck"


def writes_checked(outcome: Outcome) -> bool:
    """Whether a write outside the kernel's output could be seen in this cell: a canary followed
    the output, or a memcheck run of the cell came back clean."""
    return outcome.facts.get("canary_after_output") is True or outcome.facts.get(MEMCHECK_FACT) == "clean"


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """A kernel's loud refusal of an input, before launch."""

    operand: str  # "x", "w", "m_sizes", "x and w", or "an input" when nothing says which
    statement: str  # the check that refused: its message, else its source line
    site: str | None  # file:line of the raise, when recorded

    def render(self) -> str:
        at = f" at {self.site}" if self.site else ""
        return f"the kernel refuses {self.operand} before launch ({self.statement}{at})"


def _fact_str(outcome: Outcome, key: str) -> str | None:
    value = outcome.facts.get(key)
    return value if isinstance(value, str) and value else None


def refusal(outcome: Outcome, baseline: Outcome | None = None) -> Refusal | None:
    """The outcome as a contract refusal, or None (see the module docstring). ``baseline`` is
    its group's baseline cell (``baseline.group_baselines``); without one that passed, and
    without the probe's own passing call on valid input, nothing is a refusal."""
    if outcome.status is not Status.ERROR or outcome.error_kind not in REJECTION_KINDS:
        return None
    if outcome.spec.condition in CANONICAL_CONDITIONS or needs_cuda(outcome):
        return None  # the canonical inputs refused: the kernel cannot be used (baseline.unusable)
    if _fact_str(outcome, "raised_in") == "doctor" or not baseline_passed(outcome, baseline):
        return None  # the probe's own check; or a kernel that fails the canonical inputs too
    device_assert = outcome.error_kind is ErrorKind.DEVICE_ASSERT
    if device_assert and outcome.spec.condition not in INVALID_INPUT_CONDITIONS:
        return None  # a device assert on valid input is a failure (TRITON_DEBUG's overflow check)
    if not device_assert:
        # an exception out of the call, before it launched anything: both observed by the child
        launches = outcome.facts.get("kernel_launches")
        launched_nothing = isinstance(launches, int) and not isinstance(launches, bool) and launches == 0
        if not (launched_nothing and raised_by_call(outcome) and python_error(outcome)):
            return None
    return Refusal(operand=refused_operand(outcome), statement=_statement(outcome), site=_fact_str(outcome, "raise_site"))


def _statement(outcome: Outcome) -> str:
    message = (outcome.error_message or "").strip().splitlines()
    first = message[0].strip() if message else ""
    bare = not first or first in (f"{outcome.error_type}()", "AssertionError()")
    source = _fact_str(outcome, "raise_source")
    if bare and source:
        return f"`{source}`"
    return f"{outcome.error_type or 'error'}: {first[:160]}" if first else (outcome.error_type or "error")


def refused_operand(outcome: Outcome) -> str:
    """Which input a refusal is about: the operand its text names, among those the cell changed;
    else the ones the cell changed (padded-rows -> x, transposed-w -> w)."""
    changed = VARIANT_OPERANDS.get(outcome.spec.placement.variant) or _CONDITION_OPERANDS.get(
        outcome.spec.condition, ()
    )
    text = " ".join(filter(None, (outcome.error_message, _fact_str(outcome, "raise_source"))))
    named = list(dict.fromkeys(_OPERAND_WORDS.findall(text)))
    hits = [n for n in named if n in changed] or ([named[0]] if len(named) == 1 and not changed else [])
    chosen = hits or list(changed)
    return " and ".join(chosen) if chosen else "an input"


def unchecked_reason(outcome: Outcome) -> str | None:
    """Why a passing cell's check could not see what the cell claims, or None."""
    if outcome.status is not Status.PASS:
        return None
    cond = outcome.spec.condition
    facts = outcome.facts
    if cond in WRITE_CHECKED_CONDITIONS and not writes_checked(outcome):
        why = facts.get("memcheck_reason")
        return (
            "no canary could follow the kernel's own output (it was not allocated as "
            "torch.empty/zeros of the output's shape, and no allocator block right after it "
            "could be held): writes past y were not checked"
            + (f"; the memcheck follow-up: {why}" if isinstance(why, str) and why else "")
        )
    if cond is Condition.REPEAT_CALL and facts.get("first_call_autotune_benchmarked") is False:
        return (
            "the kernel's autotuner did not benchmark on the first call (a result cached on "
            "disk, or one config left after its pruning): a first-call fault could not show"
        )
    return None


def returned_instead(outcome: Outcome) -> str | None:
    """What the kernel returned when it was not a tensor ("None", "a tuple"), or None."""
    kind = _fact_str(outcome, "returned")
    if kind is None:
        return None
    return "None" if kind == "NoneType" else f"a {kind}"


def touches_outside(outcome: Outcome, *, rejected: bool = False) -> bool:
    """Evidence of an access outside the kernel's tensors: a canary hit, or an end that is no
    refusal (``rejected``: the cell's label) and no wrong number (an illegal access, a crash, a
    hang)."""
    if outcome.canary_hits:
        return True
    return outcome.status is Status.ERROR and not rejected


__all__ = [
    "INVALID_INPUT_CONDITIONS",
    "MEMCHECK_FACT",
    "REJECTION_KINDS",
    "VARIANT_OPERANDS",
    "WRITE_CHECKED_CONDITIONS",
    "Refusal",
    "refusal",
    "refused_operand",
    "returned_instead",
    "touches_outside",
    "unchecked_reason",
    "writes_checked",
]
