"""The baseline: whether the kernel can be used at all, and what its other cells may then say.

Every session calls the kernel on the canonical inputs before it changes anything: the planned
shape, valid routing, contiguous operands on one device. ``single`` does (a device's cells),
``guarded`` does for a GPU pair, and ``repeat-call`` makes the process's first call on the same
inputs. What those calls did decides what the session's other cells may claim:

=========================================  ===================================================
the canonical-input call                   what follows
=========================================  ===================================================
``single`` / ``guarded`` passed            a variant the kernel refuses before any launch is
                                           ``rejected`` (``blind_spots.refusal``): only the
                                           variant changed, so the refusal is about it
``single`` / ``guarded`` raised            the kernel cannot be used as given (``unusable``):
                                           exit 2, its error quoted; no cell is a refusal
it needs CUDA, on the CPU tier             the tier cannot run the kernel: that cell and the
                                           session's others are not checked (skipped, the
                                           reason said once), never a fault (``needs_cuda``);
                                           with nothing else run, exit 4
it timed out calling the kernel            the session's other cells are not run, nor the
                                           scan's later sessions: each would wait out the same
                                           timeout (``hang_reason``)
the child died or hung importing it        the kernel cannot be used (``import_death``): exit
                                           2, how the child ended named
=========================================  ===================================================

Pure functions of outcomes; the scan applies ``stop_reason`` after each outcome of a session
(``isolate.worker_pool.run_session``) and ``unusable`` to each outcome as it arrives.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from qmoe_doctor.core.error_kind import describe_exit, match_text
from qmoe_doctor.core.records import Condition, ErrorKind, Outcome, Phase, Placement, Shape, Status

#: The cells that call the kernel on the canonical inputs, first thing (``routed``: a routed
#: kernel's valid top-k routing; refusing it is no contract, a timeout there stops the session).
CANONICAL_CONDITIONS = frozenset({Condition.REPEAT_CALL, Condition.SINGLE, Condition.GUARDED, Condition.ROUTED})
#: A CUDA error named in a message ("CUDA error: ...", "Triton Error [CUDA]: ..."): the device
#: failed, which is a failing cell, never a kernel that cannot be used.
_CUDA_ERROR = re.compile(r"CUDA error|Triton Error \[CUDA\]|cudaError|CUDA_ERROR", re.IGNORECASE)
#: Exceptions that stop the interpreter rather than refuse anything.
_STOPS = frozenset({"SystemExit", "KeyboardInterrupt"})
#: Error kinds a Python exception out of the kernel's call has when it names no device failure.
PYTHON_ERROR_KINDS = frozenset({ErrorKind.BAD_INPUT, ErrorKind.OTHER})
#: Phases in which a timed-out probe was inside a call of the kernel (or waiting on its launch).
_CALLING = frozenset({Phase.COMPILE, Phase.LAUNCH, Phase.SYNC})
#: Where a raise came from, as ``kernel_call.raise_origin`` records it, when the call raised.
_CALL_ORIGINS = frozenset({"kernel", "triton", "torch"})


def baseline_condition(placement: Placement) -> Condition:
    """The cell whose pass the group's refusals need: ``guarded`` for a GPU pair, else ``single``."""
    return Condition.GUARDED if placement.is_pair else Condition.SINGLE


def group_baselines(outcomes: Iterable[Outcome]) -> dict[str, Outcome]:
    """Group -> its baseline cell's outcome (reruns left out)."""
    found: dict[str, Outcome] = {}
    for o in outcomes:
        placement = o.spec.placement
        if not placement.rerun and o.spec.condition is baseline_condition(placement):
            found.setdefault(placement.group, o)
    return found


def baseline_passed(outcome: Outcome, baseline: Outcome | None) -> bool:
    """Whether the same kernel was right on the canonical inputs where ``outcome`` ran: the
    probe's own call with valid routing just before its variant (the fact ``baseline_ok`` of the
    invalid-routing and int32 cells), else the group's baseline cell in the same session."""
    own = outcome.facts.get("baseline_ok")
    if isinstance(own, bool):
        return own
    return baseline is not None and baseline.probe_id != outcome.probe_id and baseline.status is Status.PASS


def raised_by_call(outcome: Outcome) -> bool:
    """The probe ended in the exception that escaped the kernel's call (observed by the child:
    ``raised_in_call``), raised outside the doctor's own code. Recordings from before that fact:
    ``raised_in``, which the child writes only when a call of the kernel raised."""
    if outcome.status is not Status.ERROR:
        return False
    raised_in = outcome.facts.get("raised_in")
    in_call = outcome.facts.get("raised_in_call")
    if in_call is None:
        return raised_in in _CALL_ORIGINS
    return in_call is True and raised_in != "doctor"


def python_error(outcome: Outcome) -> bool:
    """An exception of the kernel's Python side (any type), not a device failure, not an
    interpreter stop, not a missing CUDA."""
    if outcome.error_kind not in PYTHON_ERROR_KINDS or needs_cuda(outcome):
        return False
    name = (outcome.error_type or "").rsplit(".", 1)[-1]
    return name not in _STOPS and not _CUDA_ERROR.search(outcome.error_message or "")


def needs_cuda(outcome: Outcome) -> bool:
    """The cell ended because the process has no CUDA ("Torch not compiled with CUDA enabled",
    "No CUDA GPUs are available", Triton's "0 active drivers": ``core.error_kind``). The text
    is read again for recordings that classified it before the kind existed."""
    if outcome.status is not Status.ERROR:
        return False
    return outcome.error_kind is ErrorKind.NEEDS_CUDA or (
        match_text(outcome.error_message or "") is ErrorKind.NEEDS_CUDA
    )


def cpu_cannot_run(outcome: Outcome) -> bool:
    """A cell of the CPU tier that needs CUDA: not checked there, never a fault or a refusal."""
    return outcome.spec.device is None and needs_cuda(outcome)


def _fact(outcome: Outcome, key: str) -> str | None:
    value = outcome.facts.get(key)
    return value if isinstance(value, str) and value else None


def quote(outcome: Outcome) -> str:
    """An outcome's error in one line: ``Type: first line of its message at file.py:12``, the
    failing line itself for a bare ``assert``, and the kernel's own line when torch or Triton
    raised (``kernel_site``)."""
    lines = [ln.strip() for ln in (outcome.error_message or "").splitlines() if ln.strip()]
    kind = outcome.error_type or "error"
    first = lines[0][:200] if lines else ""
    source = _fact(outcome, "raise_source")
    if source and first in ("", f"{kind}()", "AssertionError()"):
        text = f"{kind}: `{source}`"  # a bare assert: its line says what it checks
    else:
        text = f"{kind}: {first}" if first else kind
    site = _fact(outcome, "kernel_site") or _fact(outcome, "raise_site")
    return text + (f" at {site}" if site else "")


def needs_cuda_reason(outcome: Outcome) -> str:
    """One line: why a CPU-tier cell that needs CUDA was not checked (the same for every cell
    that ended the same way, so a report says it once)."""
    return (
        f"the kernel needs CUDA ({quote(outcome)}), which the CPU tier does not have, so it was not "
        "checked there; a GPU runner is needed (qmoe-doctor check or scan --gpus on a machine with a GPU)"
    )


def _operands(shape: Shape) -> str:
    return f"x ({shape.m}, {shape.k}), w ({shape.e}, {shape.n}, {shape.k}), m_sizes ({shape.e},)"


def import_death(outcome: Outcome) -> str | None:
    """How the probe child ended while importing the kernel (its last breadcrumb: phase import,
    step "kernel"), in one line, or None."""
    if outcome.status is not Status.ERROR or outcome.phase is not Phase.IMPORT:
        return None
    if outcome.facts.get("step") != "kernel":
        return None
    if outcome.error_kind is ErrorKind.TIMEOUT:
        return (
            f"its import never finished: the probe child timed out at import after "
            f"{outcome.spec.timeout_s:g} s ({outcome.probe_id}) and was killed"
        )
    if outcome.exit_code is not None:
        return f"its import ended the probe child: {describe_exit(outcome.exit_code)} at import ({outcome.probe_id})"
    return None


def unusable(outcome: Outcome) -> str | None:
    """Why the kernel cannot be used as given, when ``outcome`` shows it, or None: the child died
    or hung importing it, or its baseline cell raised on the canonical inputs (a Python exception
    of any type out of its call: it raises whatever a cell changes)."""
    death = import_death(outcome)
    if death is not None:
        return death
    placement = outcome.spec.placement
    if placement.rerun or outcome.spec.condition is not baseline_condition(placement):
        return None
    if not raised_by_call(outcome) or not python_error(outcome):
        return None
    launches = outcome.facts.get("kernel_launches")
    when = ""
    if isinstance(launches, int) and not isinstance(launches, bool):
        when = ", before any launch" if launches == 0 else f", after {launches} launch(es)"
    return (
        f"it raises on the canonical inputs ({outcome.probe_id}: {_operands(outcome.spec.shape)}, "
        f"{outcome.spec.shape.dtype}): {quote(outcome)}{when}"
    )


def hang_reason(outcome: Outcome) -> str | None:
    """Why no other cell of the kernel is run after ``outcome``, when it timed out inside the
    kernel's call on the canonical inputs (every cell would wait out the same timeout), or None."""
    placement = outcome.spec.placement
    if placement.rerun or outcome.spec.condition not in CANONICAL_CONDITIONS:
        return None
    if outcome.error_kind is not ErrorKind.TIMEOUT or outcome.phase not in _CALLING:
        return None
    return (
        f"not run: the kernel hung on the canonical inputs ({outcome.probe_id} timed out at "
        f"{outcome.phase.value} after {outcome.spec.timeout_s:g} s); each cell would wait out the same "
        "timeout (raise --timeout if the kernel only compiles or autotunes slowly)"
    )


def stop_reason(outcome: Outcome) -> str | None:
    """Why a session runs none of its cells after ``outcome``, or None: the kernel hung on the
    canonical inputs (``hang_reason``: the scan runs no later session either), or, on the CPU
    tier, its baseline needs CUDA (no cell can run there)."""
    hung = hang_reason(outcome)
    if hung is not None:
        return hung
    placement = outcome.spec.placement
    if not placement.rerun and outcome.spec.condition is baseline_condition(placement) and cpu_cannot_run(outcome):
        return needs_cuda_reason(outcome)
    return None


def not_run_after(outcome: Outcome) -> str | None:
    """The probe id whose outcome ended the session before this cell ran, or None."""
    after = outcome.facts.get("not_run_after")
    return after if outcome.status is Status.SKIPPED and isinstance(after, str) and after else None


__all__ = [
    "CANONICAL_CONDITIONS",
    "PYTHON_ERROR_KINDS",
    "baseline_condition",
    "baseline_passed",
    "cpu_cannot_run",
    "group_baselines",
    "hang_reason",
    "import_death",
    "needs_cuda",
    "needs_cuda_reason",
    "not_run_after",
    "python_error",
    "quote",
    "raised_by_call",
    "stop_reason",
    "unusable",
]
