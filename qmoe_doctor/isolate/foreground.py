"""The user's own command, in the foreground: ``qmoe-doctor run -- COMMAND``.

Unlike every other child, its standard input, output and error are the doctor's own (nothing is
captured: progress bars, colours and prompts behave as without the doctor). The rest is
``process``'s: a session and process group of its own, ``FORCED_ENV`` on top of its environment
(NVLink multicast stays off), and the parent-death signal, so a doctor killed by SIGKILL takes
the command with it.

Signals are passed on, not acted on: SIGINT, SIGTERM or SIGHUP that reach the doctor go to the
command's process group, so the command (and the launch monitor in it) ends the way it would
have without the doctor, writes its records, and the doctor reports what it saw. A second signal,
or ``grace_s`` after the first, kills the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from qmoe_doctor.core import lifeline
from qmoe_doctor.isolate.process import FORCED_ENV, Child, SpawnError
from qmoe_doctor.isolate.signals import SIGNALS

#: Seconds the command gets to end after a passed-on signal before its group is killed.
GRACE_S = 30.0
#: How often the end of the command is looked for.
POLL_S = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class ForegroundEnd:
    returncode: int  # negative: killed by that signal (subprocess's convention)
    forwarded: int | None  # the first signal the doctor got and passed on
    killed: bool  # the doctor killed the group (a second signal, or the grace ran out)
    wall_s: float


def _arm_parent_death(parent_pid: int) -> None:
    lifeline.die_with_parent(parent_pid)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signum)


@dataclass(slots=True)
class _Passing:
    grace_s: float
    forwarded: int | None = None
    deadline: float | None = None
    killed: bool = False


@contextlib.contextmanager
def _passing_on(pid: int, state: _Passing) -> Iterator[None]:
    """While the command runs: the doctor's SIGINT/SIGTERM/SIGHUP go to its process group."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if state.forwarded is None:
            state.forwarded = signum
            state.deadline = time.monotonic() + state.grace_s
            _signal_group(pid, signum)
        else:
            state.killed = True
            _signal_group(pid, signal.SIGKILL)

    previous: dict[int, Any] = {}
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN:
            continue
        previous[signum] = signal.SIG_DFL if current is None else current
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def run_foreground(
    argv: Sequence[str], env: Mapping[str, str], *, grace_s: float = GRACE_S
) -> ForegroundEnd:
    """Run ``argv`` with ``env`` (and FORCED_ENV on top) on the doctor's terminal until it ends.
    Raises SpawnError when it cannot be started."""
    full_env = {**env, **FORCED_ENV}
    parent = os.getpid()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            env=full_env,
            start_new_session=True,  # its own group: what it leaves behind is killed whole
            preexec_fn=(lambda: _arm_parent_death(parent)) if lifeline.AVAILABLE else None,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SpawnError(f"cannot start {argv[0]}: {exc}") from exc
    child = Child(proc, argv, None)
    state = _Passing(grace_s=grace_s)
    try:
        with _passing_on(proc.pid, state):
            # exit_status() leaves the ended command unreaped, so its pid (its group's id) cannot
            # be reused before the group is killed below
            while child.exit_status() is None:
                time.sleep(POLL_S)
                if state.deadline is not None and time.monotonic() > state.deadline and not state.killed:
                    state.killed = True
                    _signal_group(proc.pid, signal.SIGKILL)
    finally:
        # whatever the command left in its group (a daemon, a hung worker) does not outlive the
        # run; the doctor failing mid-run takes the command down too
        code = child.kill()
    return ForegroundEnd(
        returncode=code, forwarded=state.forwarded, killed=state.killed, wall_s=time.monotonic() - t0
    )


__all__ = ["GRACE_S", "ForegroundEnd", "run_foreground"]
