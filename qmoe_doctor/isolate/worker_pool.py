"""Run probes in child processes; the parent survives whatever a probe does.

A CUDA fault poisons the process that made it, so every probe runs in a child
(``python -m qmoe_doctor.probes.worker``, a fresh interpreter, never a fork), in its own session
so that a timeout kills the whole process group. Specs run in order in one warm child; a spec
with ``fresh_process`` or its own ``env`` gets a child of its own. After a poisoning outcome
(``records.POISONING_KINDS``), a crash or a timeout, the next spec gets a new child. Crashes,
signals and timeouts come back as Outcome records, with the last breadcrumb the child wrote and
the tail of its log (stdout and stderr, where library and device messages land).

See ``probes/worker.py`` for the line protocol. Never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from qmoe_doctor.core import knobs
from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.error_kind import classify_exit, describe_exit
from qmoe_doctor.core.records import (
    POISONING_KINDS,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Status,
    from_jsonable,
    to_json,
)

WORKER_MODULE = "qmoe_doctor.probes.worker"

#: Start-up allowance, seconds: the wait for a new child's "ready", and extra time for the first
#: probe in each child (import torch and triton, create the CUDA context: 4.6-7.8 s measured on an
#: H200 with warm caches; slow shared filesystems take several times that).
DEFAULT_STARTUP_S = 60.0
#: How long a timed-out child gets to dump its stacks (faulthandler on SIGUSR1) before SIGKILL.
STACK_DUMP_WAIT_S = 0.5
#: How long a child whose stdin was closed gets to exit on its own before its group is killed.
CLOSE_GRACE_S = 5.0
#: How much of a child's log an Outcome keeps.
TAIL_LINES = 60
TAIL_CHARS = 8000
_POLL_S = 0.1  # how often a child's liveness is checked while waiting for its messages
#: Always in a child's environment, whatever base_env or a spec says.
FORCED_ENV: Mapping[str, str] = {**knobs.NVLS_OFF, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


class EventKind(StrEnum):
    WORKER_STARTED = "worker-started"  # a child said "ready" (detail says why it was started)
    WORKER_RESTARTED = "worker-restarted"  # a child replaced one that was poisoned, died or hung
    WORKER_FAILED = "worker-failed"  # a child died or hung before "ready"
    PROBE_STARTED = "probe-started"
    CRUMB = "crumb"  # the probe entered ``phase``
    OUTCOME = "outcome"


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Progress of a session, for the CLI's stderr display."""

    kind: EventKind
    probe_id: str | None = None
    phase: Phase | None = None
    outcome: Outcome | None = None
    worker: int | None = None  # the child's number in this session, from 1
    pid: int | None = None
    detail: str = ""
    t: float = field(default_factory=time.time)


OnEvent = Callable[[Event], None]


def child_python(python: str | None = None) -> str:
    """The interpreter for probe children: the argument, else $QMOE_DOCTOR_CHILD_PYTHON, else
    this interpreter."""
    return python or os.environ.get(knobs.QMOE_CHILD_PYTHON) or sys.executable


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


class _Timeout:
    pass


class _Dead:
    pass


_TIMEOUT = _Timeout()
_DEAD = _Dead()


class _Worker:
    """One child process: its pipes, log and liveness, read without threads (select)."""

    def __init__(self, *, index: int, proc: subprocess.Popen[bytes], result_fd: int, log_path: Path) -> None:
        self.index = index
        self.proc = proc
        self.pid = proc.pid
        self.log_path = log_path
        self.probes_run = 0
        self.ready = False
        self._fd = result_fd
        self._buffer = b""
        self._pending: deque[dict[str, Any]] = deque()
        self._eof = False
        self._closed = False

    # --- liveness ---

    def exit_status(self) -> int | None:
        """The child's return code if it has exited, without reaping it where the OS allows:
        an unreaped child keeps its pid, so killing its process group afterwards cannot hit an
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

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    # --- protocol ---

    def send(self, line: str) -> bool:
        """Write one line on the child's stdin; False if the child is gone."""
        stdin = self.proc.stdin
        if stdin is None:
            return False
        try:
            stdin.write(line.encode() + b"\n")
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False
        return True

    def _read(self, timeout: float) -> None:
        readable, _, _ = select.select([self._fd], [], [], max(timeout, 0.0))
        if not readable:
            return
        try:
            chunk = os.read(self._fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            self._eof = True
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if isinstance(message, dict):
                self._pending.append(message)

    def next_message(self, deadline: float) -> dict[str, Any] | _Timeout | _Dead:
        """The next protocol message; _TIMEOUT at the deadline; _DEAD once the child has exited
        (or closed its pipe) and every message it wrote has been returned."""
        while True:
            if self._pending:
                return self._pending.popleft()
            if self._eof or self.exit_status() is not None:
                while not self._eof and select.select([self._fd], [], [], 0)[0]:
                    self._read(0)  # drain what it wrote just before dying
                if self._pending:
                    continue
                return _DEAD
            now = time.monotonic()
            if now >= deadline:
                return _TIMEOUT
            self._read(min(_POLL_S, deadline - now))

    # --- ending ---

    def kill(self, *, dump_stacks: bool = False) -> int:
        """Kill the child's whole process group (grandchildren included) and reap the child.
        Idempotent: once the child is reaped its pid may be reused, so nothing is signalled."""
        if self.proc.returncode is not None:
            self._release()
            return self.proc.returncode
        if dump_stacks and self.ready and self.exit_status() is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGUSR1)  # faulthandler: every thread's stack to the log
            time.sleep(STACK_DUMP_WAIT_S)
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)  # the child leads its own session and group
        returncode = self.proc.wait()
        self._release()
        return returncode

    def close(self) -> int:
        """End the child politely (EOF on stdin), then kill whatever is left of its group."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self.exit_status() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.kill()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


class _SpawnError(Exception):
    def __init__(self, *, kind: ErrorKind, message: str, tail: str, exit_code: int | None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.tail = tail
        self.exit_code = exit_code


_MISSING_PACKAGE_HINT = (
    "the child interpreter cannot import qmoe_doctor: install qmoe-doctor into the environment of "
    f"{{python}} (set by ${knobs.QMOE_CHILD_PYTHON}, default: this interpreter)"
)


class _Session:
    def __init__(
        self,
        *,
        base_env: Mapping[str, str],
        log_dir: Path,
        python: str,
        on_event: OnEvent | None,
        startup_s: float,
    ) -> None:
        self.base_env = dict(base_env)
        self.log_dir = log_dir
        self.python = python
        self.on_event = on_event
        self.startup_s = startup_s
        self.last_index = 0  # number of the last worker started (its log is worker-NNN.log)
        self.warm: _Worker | None = None
        self.warm_replaced: str | None = None  # why the last warm child was retired
        self.live: set[_Worker] = set()
        self.broken: dict[tuple[tuple[str, str], ...], _SpawnError] = {}

    def _new_log(self) -> tuple[int, IO[bytes]]:
        """The next worker number and its log, ``worker-NNN.log``. Numbers continue past logs
        already in log_dir, so sessions sharing a directory never overwrite each other's."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        while True:
            self.last_index += 1
            try:
                return self.last_index, open(self.log_dir / f"worker-{self.last_index:03d}.log", "xb")
            except FileExistsError:
                continue

    def emit(self, kind: EventKind, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(Event(kind=kind, **fields))

    # --- children ---

    def spawn(
        self, spec_env: Mapping[str, str], reason: str, event: EventKind = EventKind.WORKER_STARTED
    ) -> _Worker:
        index, log = self._new_log()
        log_path = Path(log.name)
        env = child_env(self.base_env, spec_env)
        read_fd, write_fd = os.pipe()
        env[knobs.QMOE_RESULT_FD] = str(write_fd)
        command = [self.python, "-m", WORKER_MODULE]
        with log:
            header = f"# qmoe-doctor worker {index} ({reason}): {' '.join(command)}"
            if spec_env:
                header += f" with {' '.join(f'{k}={v}' for k, v in sorted(spec_env.items()))}"
            log.write(header.encode() + b"\n")
            log.flush()
            try:
                proc = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    pass_fds=(write_fd,),
                    start_new_session=True,  # a group of its own: a timeout kills it whole
                )
            except OSError as exc:
                os.close(read_fd)
                text = f"cannot start {self.python}: {exc}"
                self.emit(EventKind.WORKER_FAILED, worker=index, detail=text)
                raise _SpawnError(kind=ErrorKind.OTHER, message=text, tail="", exit_code=None) from exc
            finally:
                os.close(write_fd)
        worker = _Worker(index=index, proc=proc, result_fd=read_fd, log_path=log_path)
        self.live.add(worker)
        message = worker.next_message(time.monotonic() + self.startup_s)
        failure: _SpawnError | None = None
        if isinstance(message, _Timeout):
            worker.kill()
            failure = _SpawnError(
                kind=ErrorKind.TIMEOUT,
                message=f"worker {index} was not ready after {self.startup_s:.0f} s",
                tail=read_tail(log_path),
                exit_code=None,
            )
        elif isinstance(message, _Dead):
            code = worker.kill()
            tail = read_tail(log_path)
            text = f"worker {index} {describe_exit(code)} before it was ready"
            if "No module named 'qmoe_doctor" in tail or "No module named qmoe_doctor" in tail:
                text += "; " + _MISSING_PACKAGE_HINT.format(python=self.python)
            failure = _SpawnError(kind=ErrorKind.OTHER, message=text, tail=tail, exit_code=code)
        elif message.get("type") != "ready":
            worker.kill()
            failure = _SpawnError(
                kind=ErrorKind.OTHER,
                message=f"worker {index} wrote {message!r} before 'ready'",
                tail=read_tail(log_path),
                exit_code=None,
            )
        if failure is not None:
            self.live.discard(worker)
            self.emit(EventKind.WORKER_FAILED, worker=index, pid=worker.pid, detail=failure.message)
            raise failure
        worker.ready = True
        self.emit(event, worker=index, pid=worker.pid, detail=reason)
        return worker

    def warm_worker(self) -> _Worker:
        if self.warm is not None and self.warm.exit_status() is not None:
            self.retire(self.warm, f"worker {self.warm.index} exited between probes")
        if self.warm is None:
            replaced = self.warm_replaced
            if replaced is None:
                self.warm = self.spawn({}, "first worker")
            else:
                self.warm = self.spawn({}, replaced, EventKind.WORKER_RESTARTED)
            self.warm_replaced = None
        return self.warm

    def retire(self, worker: _Worker, reason: str | None = None, *, kill: bool = True) -> None:
        if kill:
            worker.kill()
        else:
            worker.close()
        self.live.discard(worker)
        if worker is self.warm:
            self.warm = None
            self.warm_replaced = reason

    def close(self, *, graceful: bool) -> None:
        for worker in list(self.live):
            if graceful:
                worker.close()
            else:
                worker.kill()
            self.live.discard(worker)
        self.warm = None

    # --- probes ---

    def run(self, spec: ProbeSpec) -> Outcome:
        own = spec.fresh_process or bool(spec.env)
        key = tuple(sorted(spec.env.items()))
        failure = self.broken.get(key)
        if failure is not None:  # this environment already failed to start twice: do not retry
            return self._spawn_failed(spec, failure)
        for attempt in range(2):
            try:
                if own:
                    reason = "fresh process" if spec.fresh_process else "spec environment"
                    worker = self.spawn(spec.env, f"{reason} for {spec.probe_id}")
                else:
                    worker = self.warm_worker()
            except _SpawnError as err:
                failure = err
                if attempt == 0:
                    continue
                self.broken[key] = err
                return self._spawn_failed(spec, err)
            outcome = self._run_on(worker, spec)
            if own and worker in self.live:
                self.retire(worker, kill=False)
            return outcome
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn_failed(self, spec: ProbeSpec, err: _SpawnError) -> Outcome:
        outcome = Outcome(
            probe_id=spec.probe_id,
            spec=spec,
            status=Status.ERROR,
            phase=Phase.SPAWN,
            error_kind=err.kind,
            error_type="spawn",
            error_message=err.message,
            stderr_tail=err.tail,
            exit_code=err.exit_code,
        )
        self.emit(EventKind.PROBE_STARTED, probe_id=spec.probe_id)
        self.emit(EventKind.OUTCOME, probe_id=spec.probe_id, outcome=outcome, phase=outcome.phase)
        return outcome

    def _run_on(self, worker: _Worker, spec: ProbeSpec) -> Outcome:
        budget = spec.timeout_s + (self.startup_s if worker.probes_run == 0 else 0.0)
        probe_index = worker.probes_run
        worker.probes_run += 1
        log_start = worker.log_size()
        self.emit(EventKind.PROBE_STARTED, probe_id=spec.probe_id, worker=worker.index, pid=worker.pid)
        start = time.monotonic()
        deadline = start + budget
        phase = Phase.SPAWN
        worker.send(to_json(spec))  # a dead child shows as _DEAD below
        outcome: Outcome | None = None
        while outcome is None:
            message = worker.next_message(deadline)
            if isinstance(message, _Timeout):
                worker.kill(dump_stacks=True)
                outcome = self._synthesized(
                    spec,
                    phase=phase,
                    kind=ErrorKind.TIMEOUT,
                    error_type="timeout",
                    message=f"no outcome after {budget:.1f} s; killed the worker's process group",
                    tail=read_tail(worker.log_path, log_start),
                    wall_s=time.monotonic() - start,
                    exit_code=None,
                )
                self.retire(worker, f"worker {worker.index} timed out on {spec.probe_id}")
            elif isinstance(message, _Dead):
                code = worker.kill()
                tail = read_tail(worker.log_path, log_start)
                outcome = self._synthesized(
                    spec,
                    phase=phase,
                    kind=classify_exit(code, tail),
                    error_type="signal" if code < 0 else "exit",
                    message=f"worker {describe_exit(code)} during {spec.probe_id} ({phase.value} phase)",
                    tail=tail,
                    wall_s=time.monotonic() - start,
                    exit_code=code,
                )
                self.retire(worker, f"worker {worker.index} died on {spec.probe_id}")
            elif message.get("type") == "crumb" and message.get("probe_id") == spec.probe_id:
                try:
                    phase = Phase(str(message.get("phase")))
                except ValueError:
                    continue
                self.emit(
                    EventKind.CRUMB, probe_id=spec.probe_id, phase=phase, worker=worker.index, pid=worker.pid
                )
            elif message.get("type") == "outcome":
                outcome = self._received(worker, spec, message, phase, log_start, start)
            elif message.get("type") == "protocol-error":
                self.retire(worker, f"worker {worker.index} could not read {spec.probe_id}")
                outcome = self._synthesized(
                    spec,
                    phase=phase,
                    kind=ErrorKind.OTHER,
                    error_type="protocol",
                    message=f"worker {worker.index}: {message.get('message')}",
                    tail=read_tail(worker.log_path, log_start),
                    wall_s=time.monotonic() - start,
                    exit_code=None,
                )
        outcome = dataclasses.replace(
            outcome,
            facts={
                **outcome.facts,
                "worker.index": worker.index,
                "worker.pid": worker.pid,
                "worker.probe_index": probe_index,
            },
        )
        self.emit(
            EventKind.OUTCOME,
            probe_id=spec.probe_id,
            phase=outcome.phase,
            outcome=outcome,
            worker=worker.index,
            pid=worker.pid,
        )
        return outcome

    def _received(
        self,
        worker: _Worker,
        spec: ProbeSpec,
        message: dict[str, Any],
        phase: Phase,
        log_start: int,
        start: float,
    ) -> Outcome:
        try:
            outcome = from_jsonable(Outcome, message.get("outcome"))  # type: ignore[arg-type]
            if outcome.probe_id != spec.probe_id:
                raise ValueError(f"outcome for {outcome.probe_id!r}")
        except (TypeError, ValueError, KeyError) as exc:
            self.retire(worker, f"worker {worker.index} wrote an unreadable outcome")
            return self._synthesized(
                spec,
                phase=phase,
                kind=ErrorKind.OTHER,
                error_type="protocol",
                message=f"unreadable outcome from worker {worker.index}: {exc}",
                tail=read_tail(worker.log_path, log_start),
                wall_s=time.monotonic() - start,
                exit_code=None,
            )
        if outcome.status is Status.ERROR and not outcome.stderr_tail:
            outcome = dataclasses.replace(outcome, stderr_tail=read_tail(worker.log_path, log_start))
        if outcome.error_kind in POISONING_KINDS:
            # The worker exits after writing it; make sure of it and start afresh next time.
            self.retire(
                worker,
                f"worker {worker.index} poisoned by {outcome.error_kind} in {spec.probe_id}",
                kill=False,
            )
        return outcome

    @staticmethod
    def _synthesized(
        spec: ProbeSpec,
        *,
        phase: Phase,
        kind: ErrorKind,
        error_type: str,
        message: str,
        tail: str,
        wall_s: float,
        exit_code: int | None,
    ) -> Outcome:
        return Outcome(
            probe_id=spec.probe_id,
            spec=spec,
            status=Status.ERROR,
            phase=phase,
            error_kind=kind,
            error_type=error_type,
            error_message=message,
            stderr_tail=tail,
            wall_s=wall_s,
            exit_code=exit_code,
        )


def run_session(
    specs: Sequence[ProbeSpec],
    *,
    base_env: Mapping[str, str],
    log_dir: Path,
    python: str | None = None,
    on_event: OnEvent | None = None,
    startup_s: float = DEFAULT_STARTUP_S,
) -> list[Outcome]:
    """Run ``specs`` in order, in child processes, and return one Outcome per spec, in order.

    Specs share one warm child; a spec with ``fresh_process`` or a non-empty ``env`` gets a child
    of its own (environment merged in) used for it alone. A poisoning error, a crash or a timeout
    retires the child and the next spec runs in a new one. Each probe may take ``spec.timeout_s``
    seconds, plus ``startup_s`` when it is the first in its child; a child has ``startup_s``
    seconds to say "ready". A child that cannot start is retried once per spec; an environment
    that failed twice fails its later specs at once (phase SPAWN). Worker logs go to ``log_dir``.
    """
    session = _Session(
        base_env=base_env,
        log_dir=Path(log_dir),
        python=child_python(python),
        on_event=on_event,
        startup_s=startup_s,
    )
    graceful = False
    try:
        outcomes = [session.run(spec) for spec in specs]
        graceful = True
        return outcomes
    finally:
        session.close(graceful=graceful)


def run_one(
    spec: ProbeSpec,
    *,
    base_env: Mapping[str, str] | None = None,
    log_dir: Path,
    python: str | None = None,
    on_event: OnEvent | None = None,
    startup_s: float = DEFAULT_STARTUP_S,
) -> Outcome:
    """Run one spec in a child of its own: ``run_session([spec])``."""
    (outcome,) = run_session(
        [spec],
        base_env=base_env or {},
        log_dir=log_dir,
        python=python,
        on_event=on_event,
        startup_s=startup_s,
    )
    return outcome


__all__ = [
    "DEFAULT_STARTUP_S",
    "FORCED_ENV",
    "Event",
    "EventKind",
    "OnEvent",
    "child_env",
    "child_python",
    "read_tail",
    "run_one",
    "run_session",
]
