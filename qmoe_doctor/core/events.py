"""What happens while a run goes: progress events for the CLI's stderr display, and the end of
a run by a signal.

The isolation layer (``qmoe_doctor.isolate``) emits the events and raises ``Interrupted``; the
CLI renders the one and maps the other to an exit code, without importing the isolation layer.
Stdlib only.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.records import Outcome, Phase


class EventKind(StrEnum):
    # probe workers (isolate.worker_pool)
    WORKER_STARTED = "worker-started"  # a child said "ready" (detail says why it was started)
    WORKER_RESTARTED = "worker-restarted"  # a child replaced one that was poisoned, died or hung
    WORKER_FAILED = "worker-failed"  # a child died or hung before "ready"
    PROBE_STARTED = "probe-started"
    CRUMB = "crumb"  # the probe entered ``phase``
    OUTCOME = "outcome"
    # parallel launches (isolate.torchrun): ``mode`` names the launch
    RUN_STARTED = "run-started"  # detail: the command line
    RANK_DONE = "rank-done"  # a rank's result file appeared (``outcome``)
    RUN_FINISHED = "run-finished"  # detail: how the launcher ended


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Progress of a run, for the CLI's stderr display."""

    kind: EventKind
    probe_id: str | None = None
    phase: Phase | None = None
    outcome: Outcome | None = None
    worker: int | None = None  # the child's number in this session, from 1
    pid: int | None = None
    mode: str | None = None  # the parallel launch ("dp", "tp", ...), for RUN_* and RANK_DONE
    detail: str = ""
    t: float = field(default_factory=time.time)


OnEvent = Callable[[Event], None]


class Interrupted(KeyboardInterrupt):
    """The run was ended by a signal (SIGINT, SIGTERM or SIGHUP) while it ran children.

    Raised in the main thread by ``isolate.signals.interruptible``, so that every ``finally`` on
    the way out kills its children's process groups. A KeyboardInterrupt, so that whatever lets
    Ctrl-C through lets it through too, and ``except Exception`` never swallows it. The CLI saves
    the partial report where one was asked for and exits with ``exit_code``: the shell's
    convention, 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name}"


#: How a kept log folder is named on the exception that ended the run (a PEP 678 note).
_KEPT_NOTE = "qmoe-doctor logs kept in "


def note_kept_logs(exc: BaseException, folder: object) -> None:
    """Say on ``exc`` that the run it ended kept its logs in ``folder``."""
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        notes = []
        exc.__notes__ = notes  # what BaseException.add_note (3.11+) does
    notes.append(f"{_KEPT_NOTE}{folder}")


def kept_logs(exc: BaseException) -> list[str]:
    """The log folders kept because ``exc`` ended the run (:func:`note_kept_logs`)."""
    return [n.removeprefix(_KEPT_NOTE) for n in getattr(exc, "__notes__", ()) if n.startswith(_KEPT_NOTE)]


__all__ = ["Event", "EventKind", "Interrupted", "OnEvent", "kept_logs", "note_kept_logs"]
