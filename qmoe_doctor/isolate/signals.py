"""Children die with the parent, whatever ends it.

``interruptible()`` turns SIGINT, SIGTERM and SIGHUP into ``core.events.Interrupted`` in the main
thread while a run has children (a CI job's time limit sends SIGTERM; a closed terminal, SIGHUP),
so the run ends the way Ctrl-C ends it: every ``finally`` on the way out kills its children's
process groups, and the CLI saves what was computed and exits 128 + the signal number. Whatever
child is still alive when the outermost guard is left that way is killed there, so no code path
can leak one. A second signal while the first unwinds is noted, not raised: the clean-up it would
interrupt is what kills the children. A parent killed by SIGKILL runs none of this: the
parent-death signal (``core.lifeline``, armed in every child by ``process.spawn``) and the probe
worker's pipe watchdog (``probes/worker.py``) end the children then.

Every isolation entry point (``worker_pool.run_session``, ``torchrun.launch``,
``one_shot.run_command`` and ``one_shot.stream_child``) runs inside one; a workflow wraps a whole
run in one so that a signal between two sessions is caught too. Guards nest; only the outermost
installs handlers, and only in the main thread (Python runs handlers nowhere else). A signal the
user ignores (``nohup`` sets SIGHUP to SIG_IGN) stays ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from qmoe_doctor.core.events import Interrupted
from qmoe_doctor.isolate import process

#: The signals that end a run as Ctrl-C does.
SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers


class _State:
    depth = 0  # guards entered and not left
    raised: Interrupted | None = None  # the signal being unwound, once one came


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _State.raised is not None:
        return  # the first one is unwinding: let its clean-up finish
    _State.raised = Interrupted(signum)
    raise _State.raised


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within: SIGINT, SIGTERM and SIGHUP raise ``Interrupted``; on leaving by it (or by any
    other exception), every child not reaped yet is killed with its group."""
    if threading.current_thread() is not threading.main_thread():
        yield  # no handlers off the main thread; the caller's finally still kills its children
        return
    if _State.depth:
        _State.depth += 1
        try:
            yield
        finally:
            _State.depth -= 1
        return
    previous: dict[int, _Handler] = {}
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN:
            continue
        previous[signum] = signal.SIG_DFL if current is None else current  # None: set outside Python
        signal.signal(signum, _on_signal)
    _State.depth = 1
    _State.raised = None
    try:
        yield
    except BaseException:
        process.kill_all()
        raise
    finally:
        _State.depth = 0
        for number, handler in previous.items():
            signal.signal(number, handler)
        _State.raised = None


__all__ = ["SIGNALS", "interruptible"]
