"""Any way a child ends without giving its outcome becomes an Outcome (the model: pytest-forked's
``report_process_crash``).

A probe's child can exit (a status, or a signal such as SIGSEGV), hang (killed at its deadline,
its stacks asked for first), never become ready (died or hung while starting), never start at all
(no such interpreter), or write something the parent cannot read. Each is data: status ERROR, the
last phase the child reached (its breadcrumbs), an error kind (``classify_exit`` reads the log
tail: a CUDA error printed before a crash names the kind), and a message that says who ended how,
where, and after how long: ``worker 2 timed out at import after 15 s``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.error_kind import classify_exit, describe_exit
from qmoe_doctor.core.records import ErrorKind, Outcome, Phase, ProbeSpec, Status


class Ending(StrEnum):
    NOT_STARTED = "not-started"  # the program could not be started (an OSError)
    EXITED = "exited"  # it exited or was killed by a signal, without writing its outcome
    TIMED_OUT = "timed-out"  # still running at its deadline: stacks asked for, group killed
    UNREADABLE = "unreadable"  # it wrote something the parent cannot read (a protocol error)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildEnd:
    """How one child ended, as the parent saw it."""

    ending: Ending
    who: str  # "worker 2", "rank 1": the child, in the message
    exit_code: int | None = None  # EXITED: its status (negative: the signal); None: unknown
    timeout_s: float | None = None  # TIMED_OUT: the budget it overran
    ready: bool = True  # False: it ended while starting, before it said it was ready
    detail: str = ""  # NOT_STARTED / UNREADABLE: what went wrong; otherwise added after "; "
    tail: str = ""  # the end of its log (stdout and stderr, where library messages land)
    wall_s: float = 0.0


def message(end: ChildEnd, phase: Phase, where: str = "") -> str:
    """In words: ``worker 2 killed by SIGSEGV (signal 11) at launch``. ``where`` replaces the
    phase as the place ("init-process-group (setup phase)")."""
    at = where or phase.value
    if end.ending is Ending.NOT_STARTED or end.ending is Ending.UNREADABLE:
        return end.detail or f"{end.who}: {end.ending.value}"
    if end.ending is Ending.TIMED_OUT:
        after = f"{end.timeout_s:g} s" if end.timeout_s is not None else "its deadline"
        if not end.ready:
            text = f"{end.who} timed out at {Phase.SPAWN.value} after {after}: it never said it was ready"
        else:
            text = f"{end.who} timed out at {at} after {after}"
        text += "; killed its process group"
    elif end.exit_code is None:
        text = f"{end.who} wrote no result, last at {at}"
    elif not end.ready:
        text = f"{end.who} {describe_exit(end.exit_code)} before it was ready"
    else:
        text = f"{end.who} {describe_exit(end.exit_code)} at {at}"
    return text + (f"; {end.detail}" if end.detail else "")


def kind_of(end: ChildEnd) -> ErrorKind:
    if end.ending is Ending.TIMED_OUT:
        return ErrorKind.TIMEOUT
    if end.ending is Ending.EXITED and end.ready and end.exit_code is not None:
        return classify_exit(end.exit_code, end.tail)
    # could not start, died while starting (a broken interpreter, not the kernel: an import
    # error there is ours), or wrote nonsense: the check itself could not run
    return ErrorKind.OTHER


def error_type_of(end: ChildEnd) -> str:
    if end.ending is Ending.NOT_STARTED or not end.ready:
        return "spawn"
    if end.ending is Ending.TIMED_OUT:
        return "timeout"
    if end.ending is Ending.UNREADABLE:
        return "protocol"
    return "signal" if end.exit_code is not None and end.exit_code < 0 else "exit"


def crash_outcome(
    spec: ProbeSpec,
    end: ChildEnd,
    *,
    phase: Phase = Phase.SPAWN,
    where: str = "",
    facts: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> Outcome:
    """The Outcome of ``spec`` whose child ended as ``end``, the last phase it reached being
    ``phase`` (SPAWN for a child that was never ready)."""
    return Outcome(
        probe_id=spec.probe_id,
        spec=spec,
        status=Status.ERROR,
        phase=phase if end.ready and end.ending is not Ending.NOT_STARTED else Phase.SPAWN,
        error_kind=kind_of(end),
        error_type=error_type_of(end),
        error_message=message(end, phase, where),
        facts=dict(facts or {}),
        notes=tuple(notes),
        stderr_tail=end.tail,
        wall_s=end.wall_s,
        exit_code=end.exit_code if end.ending is Ending.EXITED else None,
    )


__all__ = ["ChildEnd", "Ending", "crash_outcome", "error_type_of", "kind_of", "message"]
