"""One child for one job: a probe in a worker of its own, a command whose output is read at the
end (compute-sanitizer around ``probes/run_one.py``), or a child whose output is passed on line by
line as it comes (the benchmark).

Each child is started by ``process.spawn`` (own session, FORCED_ENV, parent-death signal) inside
``signals.interruptible``, and killed with its process group at its timeout or when the parent is
interrupted. Never imports torch.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qmoe_doctor.core.events import OnEvent
from qmoe_doctor.core.records import OUTCOME_PREFIX, Outcome, ProbeSpec, from_json, to_json
from qmoe_doctor.isolate.process import STACK_DUMP_WAIT_S, SpawnError, child_python, spawn
from qmoe_doctor.isolate.signals import interruptible
from qmoe_doctor.isolate.worker_pool import run_session

#: The module that runs one probe in its own process (under compute-sanitizer); the Outcome
#: line it prints on stdout starts with ``core.records.OUTCOME_PREFIX``.
RUN_ONE_MODULE = "qmoe_doctor.probes.run_one"
#: Lines of a streamed child's output kept for its error message.
STREAM_TAIL_LINES = 40
#: The return code a command that could not be started gets (the shell's "command not found").
NOT_STARTED = 127


def run_one(
    spec: ProbeSpec,
    *,
    base_env: Mapping[str, str] | None = None,
    log_dir: Path,
    python: str | None = None,
    on_event: OnEvent | None = None,
) -> Outcome:
    """Run one spec in a worker of its own: ``run_session([spec])``."""
    (outcome,) = run_session(
        [spec], base_env=base_env or {}, log_dir=log_dir, python=python, on_event=on_event
    )
    return outcome


def probe_command(spec: ProbeSpec, python: str | None = None) -> list[str]:
    """The command that runs ``spec`` in one process and prints its Outcome line."""
    return [child_python(python), "-m", RUN_ONE_MODULE, to_json(spec)]


def outcome_from_stdout(stdout: str) -> Outcome | None:
    """The last Outcome line ``probe_command``'s process printed (None: it printed none)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(OUTCOME_PREFIX):
            try:
                return from_json(Outcome, line[len(OUTCOME_PREFIX) :])
            except (TypeError, ValueError, KeyError):
                return None
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandResult:
    returncode: int | None  # None: killed at the timeout; NOT_STARTED: could not be started
    stdout: str
    stderr: str
    wall_s: float


RunCommand = Callable[[Sequence[str], Mapping[str, str], float], CommandResult]


def run_command(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> CommandResult:
    """Run argv in a session of its own and collect its output; at the timeout its whole process
    group is killed. A program that cannot be started is NOT_STARTED with the reason on stderr."""
    t0 = time.perf_counter()
    with interruptible():
        try:
            child = spawn(argv, env=env, output="separate")
        except SpawnError as exc:
            return CommandResult(returncode=NOT_STARTED, stdout="", stderr=f"{exc}\n", wall_s=0.0)
        try:
            try:
                out, err = child.proc.communicate(timeout=timeout_s)
                code: int | None = child.proc.returncode
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.proc.communicate()
                code = None
        finally:
            child.kill()
    return CommandResult(
        returncode=code,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        wall_s=time.perf_counter() - t0,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildRun:
    returncode: int | None  # None: killed at the timeout
    tail: str  # the last lines it wrote (stdout and stderr together)
    wall_s: float
    lines: list[str] = field(default_factory=list)


def stream_child(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    timeout_s: float,
    on_line: Callable[[str], None] | None = None,
    log_path: Path | None = None,
) -> ChildRun:
    """Run argv in a session of its own, passing each line it writes (stdout and stderr
    together) to ``on_line`` and to ``log_path``; at the timeout it is asked for its stacks,
    then its process group is killed. Raises SpawnError when it cannot be started."""
    t0 = time.monotonic()
    lines: list[str] = []
    with interruptible():
        log = open(log_path, "w", encoding="utf-8") if log_path is not None else None
        try:
            child = spawn(argv, env=env, output="merged")
        except SpawnError:
            if log is not None:
                log.close()
            raise
        stdout = child.proc.stdout
        assert stdout is not None
        fd = stdout.fileno()
        buffer = b""

        def take(raw: bytes) -> None:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            lines.append(line)
            if log is not None:
                log.write(line + "\n")
                log.flush()
            if on_line is not None:
                on_line(line)

        def pump(until: float) -> bool:
            """Pass on what the child writes until EOF (True) or the deadline (False)."""
            nonlocal buffer
            while True:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return False
                readable, _, _ = select.select([fd], [], [], min(remaining, 0.5))
                if not readable:
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return True
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    take(raw)

        try:
            deadline = t0 + timeout_s
            timed_out = not pump(deadline)
            if not timed_out and child.wait(max(0.1, deadline - time.monotonic())) is None:
                timed_out = True  # it closed its output but did not exit
            if timed_out and child.ask_for_stacks():
                pump(time.monotonic() + STACK_DUMP_WAIT_S)  # its stacks, to the log and on_line
            if buffer:
                take(buffer)
            returncode = child.kill()
        finally:
            child.kill()
            stdout.close()
            if log is not None:
                log.close()
    return ChildRun(
        returncode=None if timed_out else returncode,
        tail="\n".join(lines[-STREAM_TAIL_LINES:]),
        wall_s=time.monotonic() - t0,
        lines=lines,
    )


__all__ = [
    "NOT_STARTED",
    "OUTCOME_PREFIX",
    "RUN_ONE_MODULE",
    "ChildRun",
    "CommandResult",
    "RunCommand",
    "outcome_from_stdout",
    "probe_command",
    "run_command",
    "run_one",
    "stream_child",
]
