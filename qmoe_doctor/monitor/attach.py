"""The entry point the bootstrap calls once a Triton launch module has been executed.

The first call makes the process's one :class:`~qmoe_doctor.monitor.session.Monitor` from the
settings ``qmoe-doctor run`` put in the environment, installs the exit hooks (atexit,
excepthook, SIGTERM/SIGINT) and a fork handler (a forked child writes a record of its own);
every call patches the module it is given.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from qmoe_doctor.monitor.hook import PATCHES
from qmoe_doctor.monitor.session import Monitor, Settings
from qmoe_doctor.monitor.writer import install_exit_hooks


class _State:
    monitor: Monitor | None = None
    off = False  # the settings were unusable: said once, the program runs unmonitored


def current() -> Monitor | None:
    """This process's monitor, made at the first call; None when the monitor is off."""
    if _State.monitor is not None or _State.off:
        return _State.monitor
    try:
        settings = Settings.from_env()
    except ValueError as exc:
        sys.stderr.write(f"qmoe-doctor: the launch monitor is off: {exc}\n")
        _State.off = True
        return None
    if settings is None:
        _State.off = True
        return None
    monitor = Monitor(settings)
    for problem in install_exit_hooks(monitor):
        monitor.problem(problem)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=monitor.forked)
    _State.monitor = monitor
    return monitor


def attach(module: ModuleType) -> None:
    """Patch the launch path ``module`` holds (``triton.runtime.jit`` or ``.interpreter``)."""
    patch = PATCHES.get(module.__name__)
    monitor = current()
    if patch is None or monitor is None:
        return
    patch(module, monitor)


__all__ = ["attach", "current"]
