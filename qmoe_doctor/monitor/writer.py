"""The process record on disk, and the moments it is written.

``RecordWriter`` writes the record whole: a temporary file beside it and a rename, so the parent
never reads half a record, whatever kills the process mid-write. ``install_exit_hooks`` writes
it when the process ends: at interpreter exit (``atexit``), on an uncaught exception
(``sys.excepthook``, chained to the one installed before), and on SIGTERM and SIGINT (chained:
the handler installed before ours runs after the flush; the default action, death by the
signal, is re-raised so the exit status stays what it would have been). The monitor also flushes
at a CUDA error, at each new finding, and every few seconds (``knobs.RUN_FLUSH_INTERVAL_S``), so
a hard crash (SIGKILL, a segfault, ``os._exit``) leaves what was flushed last.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Protocol

from qmoe_doctor.core.error_kind import match_text
from qmoe_doctor.core.launches import EndKind, ProcessEnd, ProcessRecord
from qmoe_doctor.core.records import is_cuda_error, to_json

#: The signals whose arrival writes the record before the user's handler (or death) follows.
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT") if hasattr(signal, name))
#: Characters of an exception's text a record keeps.
MESSAGE_CHARS = 2000


def record_name(pid: int, token: str) -> str:
    """``process-<pid>-<token>.json``: the token keeps a reused pid's record apart."""
    return f"process-{pid}-{token}.json"


class RecordWriter:
    def __init__(self, folder: str | os.PathLike[str], pid: int, token: str) -> None:
        self.path = Path(folder) / record_name(pid, token)
        self._tmp = itertools.count()
        self.writes = 0

    def write(self, record: ProcessRecord) -> None:
        """Write ``record`` whole. Re-entrant (a signal handler may flush during a flush): each
        write has its own temporary file."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{next(self._tmp)}.tmp")
        try:
            tmp.write_text(to_json(record) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
            self.writes += 1
        finally:
            tmp.unlink(missing_ok=True)


def exception_text(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text[:MESSAGE_CHARS]


def end_of(exc: BaseException, seq: int) -> ProcessEnd:
    """An uncaught exception as a process end: a CUDA error when its text is one."""
    text = exception_text(exc)
    kind = match_text(text)
    if is_cuda_error(kind):
        return ProcessEnd(kind=EndKind.CUDA_ERROR, detail=text, error_kind=kind, seq=seq)
    return ProcessEnd(kind=EndKind.EXCEPTION, detail=text, error_kind=kind, seq=seq)


class Ends(Protocol):
    """What the exit hooks need of the monitor."""

    @property
    def seq(self) -> int: ...

    def finish(self, end: ProcessEnd) -> None: ...


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def install_exit_hooks(monitor: Ends) -> list[str]:
    """atexit, sys.excepthook and the SIGTERM/SIGINT handlers; what could not be installed."""
    problems: list[str] = []
    atexit.register(lambda: monitor.finish(ProcessEnd(kind=EndKind.EXIT, seq=monitor.seq)))

    previous_hook = sys.excepthook

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        try:
            monitor.finish(end_of(exc, monitor.seq))
        finally:
            previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook
    if threading.current_thread() is not threading.main_thread():
        problems.append("Triton was first imported off the main thread: SIGTERM/SIGINT do not write the record")
        return problems
    for signum in SIGNALS:
        try:
            previous = signal.getsignal(signum)
            signal.signal(signum, _chained(monitor, signum, previous))
        except (ValueError, OSError) as exc:
            problems.append(f"cannot handle {signal.Signals(signum).name}: {exc}")
    return problems


def _chained(monitor: Ends, signum: int, previous: _Handler) -> Callable[[int, FrameType | None], Any]:
    def handler(number: int, frame: FrameType | None) -> Any:
        monitor.finish(ProcessEnd(kind=EndKind.SIGNAL, detail=signal.Signals(number).name, seq=monitor.seq))
        if callable(previous):
            return previous(number, frame)
        if previous == signal.SIG_IGN:
            return None
        # the default action (or a handler set outside Python): die by the signal, as without us
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        return None

    return handler


__all__ = [
    "SIGNALS",
    "RecordWriter",
    "end_of",
    "exception_text",
    "install_exit_hooks",
    "record_name",
]
