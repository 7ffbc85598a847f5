"""Children die with their parent: the Linux parent-death signal (``prctl(PR_SET_PDEATHSIG)``).

A parent killed by SIGKILL runs no ``finally`` and no signal handler, so only the kernel can end
its children then. Both sides use this: the parent sets it in every child it starts, between fork
and exec (``isolate.process``), and a torchrun rank sets it itself (its parent is torchrun, which
the doctor's own parent-death signal ends). The signal comes when the *thread* that started the
child ends: the doctor starts children from the thread that waits for them.

Elsewhere (macOS) it does nothing and says so; the probe worker's pipe watchdog
(``probes/worker.py``) covers the worker there. Stdlib only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _find_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]  # type: ignore[attr-defined]
    prctl.restype = ctypes.c_int  # type: ignore[attr-defined]
    return prctl


# Resolved at import, so that a child between fork and exec only makes the call.
_PRCTL = _find_prctl()
AVAILABLE = _PRCTL is not None


def die_with_parent(parent_pid: int | None = None, signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel for ``signum`` when this process's parent ends. ``parent_pid``: the parent
    this process must have (default: the one it has now); when it is already gone (it died before
    the call), exit at once. True when the signal is set."""
    if _PRCTL is None:
        return False
    expected = os.getppid() if parent_pid is None else parent_pid
    if _PRCTL(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return False
    if os.getppid() != expected:  # the parent ended before the signal was armed
        os._exit(128 + signum)
    return True


__all__ = ["AVAILABLE", "die_with_parent"]
