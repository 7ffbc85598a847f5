"""One child process: the only place the parent starts, signals, kills and reaps a program.

Every child is a fresh program (``subprocess``, never a bare fork: a CUDA context does not survive
one) that leads a session and process group of its own, so that a hang is killed whole,
grandchildren included. Whatever environment the caller gives it, ``FORCED_ENV`` goes on top
(NVLink multicast off, unbuffered output, faulthandler on), and on Linux the kernel kills it when
the parent ends, however it ends (``core.lifeline``: the parent-death signal, armed between fork
and exec). A hung child is first asked for its stacks (SIGUSR1: the probe programs register
faulthandler on it), then killed with its group.

Its users: ``worker_pool`` (warm probe workers), ``torchrun`` (rank launches) and ``one_shot``
(one program, one result); ``crash`` turns whatever a child's end was into an Outcome. Never
imports torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from qmoe_doctor.core import knobs, lifeline
from qmoe_doctor.isolate.logs import child_tmp

#: Always in a child's environment, whatever the caller, base_env or a spec says.
FORCED_ENV: Mapping[str, str] = {**knobs.NVLS_OFF, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
#: How long a hung child gets to dump its stacks (faulthandler on SIGUSR1) before SIGKILL.
STACK_DUMP_WAIT_S = 0.5
#: How much of a child's log an Outcome keeps.
TAIL_LINES = 60
TAIL_CHARS = 8000

#: Where a child's stdout and stderr go: appended to its log file ("log"), one pipe for both
#: ("merged"), or a pipe each ("separate").
Output = Literal["log", "merged", "separate"]


class SpawnError(Exception):
    """The program could not be started at all (no such file, not executable, ...)."""


def child_python(python: str | None = None) -> str:
    """The interpreter for children: the argument, else $QMOE_DOCTOR_CHILD_PYTHON, else this one."""
    return python or knobs.child_python() or sys.executable


def child_env(base_env: Mapping[str, str], spec_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ, then base_env, then the spec's env, then FORCED_ENV (NVLink multicast stays off)."""
    env = dict(os.environ)
    env.update(base_env)
    env.update(spec_env or {})
    env.update(FORCED_ENV)
    return env


def read_tail(path: Path, start: int = 0, *, lines: int = TAIL_LINES, chars: int = TAIL_CHARS) -> str:
    """The last ``lines`` lines (at most ``chars`` characters) of a log, from byte ``start`` on."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(start, size - 8 * chars))
            data = fh.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    kept = "\n".join(text.rstrip("\n").splitlines()[-lines:])
    return kept[-chars:]


class Child:
    """A started program, leader of its own process group, until it is reaped."""

    def __init__(self, proc: subprocess.Popen[bytes], argv: Sequence[str], log_path: Path | None) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.argv = tuple(argv)
        self.log_path = log_path
        self.started = time.monotonic()

    @property
    def wall_s(self) -> float:
        return time.monotonic() - self.started

    def exit_status(self) -> int | None:
        """The return code if the child has exited, without reaping it where the OS allows: an
        unreaped child keeps its pid, so killing its process group afterwards cannot hit an
        unrelated group that reused the number."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        waitid = getattr(os, "waitid", None)
        if waitid is None:  # pragma: no cover - macOS
            return self.proc.poll()
        try:
            info = waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self.proc.poll()
        if info is None:
            return None
        if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            return -int(info.si_status)
        return int(info.si_status)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Reap the child (its return code), or None if it still runs after ``timeout_s``. Only
        the child is waited for: what it left in its group is killed by ``kill``."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        _LIVE.pop(self.pid, None)
        return code

    def ask_for_stacks(self) -> bool:
        """SIGUSR1 to the child (its faulthandler writes every thread's stack to its log); False
        when it has exited already."""
        if self.exit_status() is not None or not hasattr(signal, "SIGUSR1"):
            return False
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGUSR1)
            return True
        return False

    def kill(self, *, dump_stacks: bool = False) -> int:
        """Kill the child's whole process group (grandchildren included) and reap the child; with
        ``dump_stacks``, ask for its stacks first. Idempotent: once the child is reaped its pid
        may be reused, so nothing is signalled."""
        if self.proc.returncode is not None:
            _LIVE.pop(self.pid, None)
            return self.proc.returncode
        if dump_stacks and self.ask_for_stacks():
            time.sleep(STACK_DUMP_WAIT_S)
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)  # the child leads its own session and group
        code = self.proc.wait()
        _LIVE.pop(self.pid, None)
        return code

    def log_size(self) -> int:
        if self.log_path is None:
            return 0
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def tail(self, start: int = 0) -> str:
        """The end of the child's log from byte ``start`` (its output, when it has a log)."""
        return read_tail(self.log_path, start) if self.log_path is not None else ""


# Children not reaped yet, by pid: killed, groups and all, when a run is interrupted
# (``signals.interruptible``), whatever code path they were started on.
_LIVE: dict[int, Child] = {}


def live_children() -> list[Child]:
    return list(_LIVE.values())


def kill_all() -> None:
    """Kill every child not reaped yet, with its process group."""
    for child in live_children():
        child.kill()


def _arm_parent_death(parent_pid: int) -> None:
    # Runs in the child between fork and exec: one prctl call, resolved before the fork.
    lifeline.die_with_parent(parent_pid)


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path | None = None,
    header: str | None = None,
    output: Output = "log",
    stdin_pipe: bool = False,
    pass_fds: Sequence[int] = (),
) -> Child:
    """Start ``argv`` in a session of its own with ``env`` and FORCED_ENV on top.

    ``output="log"`` appends stdout and stderr to ``log_path`` (after ``header``, one line, when
    given); "merged" and "separate" give pipes on ``child.proc``. stdin is /dev/null unless
    ``stdin_pipe``. Raises SpawnError when the program cannot be started."""
    if output == "log" and log_path is None:
        raise ValueError("output='log' needs a log_path")
    full_env = {**env, **FORCED_ENV}
    if log_path is not None:  # the child's temp files go with its log, removed with the run's folder
        tmp = child_tmp(log_path.parent)
        full_env.update(TMPDIR=str(tmp), TMP=str(tmp), TEMP=str(tmp))
    parent = os.getpid()
    stdin = subprocess.PIPE if stdin_pipe else subprocess.DEVNULL
    log = open(log_path, "ab") if output == "log" and log_path is not None else None
    try:
        if log is not None and header is not None:
            log.write(header.encode("utf-8", "replace") + b"\n")
            log.flush()
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=stdin,
                stdout=log if log is not None else subprocess.PIPE,
                stderr=subprocess.STDOUT if output != "separate" else subprocess.PIPE,
                env=full_env,
                pass_fds=tuple(pass_fds),
                start_new_session=True,  # a group of its own: a hang is killed whole
                preexec_fn=(lambda: _arm_parent_death(parent)) if lifeline.AVAILABLE else None,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SpawnError(f"cannot start {argv[0]}: {exc}") from exc
    finally:
        if log is not None:
            log.close()
    child = Child(proc, argv, log_path)
    _LIVE[child.pid] = child
    return child


__all__ = [
    "FORCED_ENV",
    "STACK_DUMP_WAIT_S",
    "TAIL_CHARS",
    "TAIL_LINES",
    "Child",
    "Output",
    "SpawnError",
    "child_env",
    "child_python",
    "kill_all",
    "live_children",
    "read_tail",
    "spawn",
]
