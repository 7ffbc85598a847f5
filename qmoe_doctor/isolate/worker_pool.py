"""Run probes in warm child processes; the parent survives whatever a probe does.

A CUDA fault poisons the process that made it, so every probe runs in a child
(``python -m qmoe_doctor.probes.worker``, started by ``process.spawn``: a fresh interpreter in a
session of its own). Specs run in order in one warm child; a spec with ``fresh_process`` or its
own ``env`` gets a child of its own. After a poisoning outcome (``records.POISONING_KINDS``), a
crash or a timeout, the next spec gets a new child. Crashes, signals and timeouts come back as
Outcome records (``crash.crash_outcome``), with the last breadcrumb the child wrote and the tail
of its log (stdout and stderr, where library and device messages land).

A probe's ``timeout_s`` is its whole time, counted from when it is asked for: when it needs a new
child, that child's start-up (until it says "ready", then the imports of its first probe) is part
of it, and a hang is named by the phase it stopped in ("timed out at import after 15 s").

See ``probes/worker.py`` for the line protocol. Never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qmoe_doctor.core import knobs
from qmoe_doctor.core.events import Event, EventKind, OnEvent
from qmoe_doctor.core.records import (
    POISONING_KINDS,
    Outcome,
    Phase,
    ProbeSpec,
    Status,
    from_jsonable,
    to_json,
)
from qmoe_doctor.isolate.crash import ChildEnd, Ending, crash_outcome
from qmoe_doctor.isolate.crash import message as describe_end
from qmoe_doctor.isolate.process import Child, SpawnError, child_env, child_python, spawn
from qmoe_doctor.isolate.signals import interruptible

WORKER_MODULE = "qmoe_doctor.probes.worker"

#: How long a child whose stdin was closed gets to exit on its own before its group is killed.
CLOSE_GRACE_S = 5.0
_POLL_S = 0.1  # how often a child's liveness is checked while waiting for its messages


class _Timeout:
    pass


class _Dead:
    pass


_TIMEOUT = _Timeout()
_DEAD = _Dead()


class _Worker:
    """One probe worker: a Child, the protocol pipe it answers on, read without threads (select)."""

    def __init__(self, *, index: int, child: Child, result_fd: int) -> None:
        self.index = index
        self.child = child
        self.pid = child.pid
        self.log_path = child.log_path or Path(os.devnull)
        self.probes_run = 0
        self.ready = False
        self._fd = result_fd
        self._buffer = b""
        self._pending: deque[dict[str, Any]] = deque()
        self._eof = False
        self._closed = False

    @property
    def name(self) -> str:
        return f"worker {self.index}"

    def exit_status(self) -> int | None:
        return self.child.exit_status()

    def log_size(self) -> int:
        return self.child.log_size()

    # --- protocol ---

    def send(self, line: str) -> bool:
        """Write one line on the child's stdin; False if the child is gone."""
        stdin = self.child.proc.stdin
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
        """Kill the child's whole process group and reap it (stacks first on request, when it is
        far enough to have faulthandler listening)."""
        code = self.child.kill(dump_stacks=dump_stacks and self.ready)
        self._release()
        return code

    def close(self) -> int:
        """End the child politely (EOF on stdin), then kill whatever is left of its group."""
        if self.child.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.child.proc.stdin.close()
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
        if self.child.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.child.proc.stdin.close()


@dataclasses.dataclass(slots=True, kw_only=True)
class _Probe:
    """One probe on one worker, while it runs: where its log starts and the phase it reached."""

    spec: ProbeSpec
    worker: _Worker
    start: float  # when it was asked for (monotonic), its worker's start-up included
    log_start: int  # the worker's log size when the probe was sent: its own output follows
    phase: Phase = Phase.SPAWN  # the last breadcrumb
    step: str = ""  # the part of the phase it named ("kernel": importing the kernel under test)

    def ended(self, ending: Ending, *, where: str = "", **fields: Any) -> Outcome:
        """The Outcome of this probe, its worker having ended (or misbehaved) as ``ending``; the
        last breadcrumb's step, when it named one, is the fact ``step``."""
        end = ChildEnd(
            ending=ending,
            who=self.worker.name,
            tail=self.worker.child.tail(self.log_start),
            wall_s=time.monotonic() - self.start,
            **fields,
        )
        facts = {"step": self.step} if self.step else None
        return crash_outcome(self.spec, end, phase=self.phase, where=where, facts=facts)


class _SpawnFailed(Exception):
    def __init__(self, end: ChildEnd) -> None:
        super().__init__(end.detail or end.who)
        self.end = end


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
    ) -> None:
        self.base_env = dict(base_env)
        self.log_dir = log_dir
        self.python = python
        self.on_event = on_event
        self.last_index = 0  # number of the last worker started (its log is worker-NNN.log)
        self.warm: _Worker | None = None
        self.warm_replaced: str | None = None  # why the last warm child was retired
        self.live: set[_Worker] = set()
        self.broken: dict[tuple[tuple[str, str], ...], ChildEnd] = {}

    def _named_by(self) -> str:
        """``$QMOE_DOCTOR_CHILD_PYTHON=PATH`` when the user chose the interpreter, else "": said
        first after a start-up failure (reports cut long lines), as the cause to look at before
        the kernel or Triton."""
        chosen = knobs.child_python()
        return f"${knobs.QMOE_CHILD_PYTHON}={self.python}" if chosen and chosen == self.python else ""

    def _not_started(self, exc: SpawnError) -> str:
        cause = exc.__cause__
        if not self._named_by():
            return str(exc)
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(exc)
        return f"cannot start {self._named_by()}: {why}"

    def _new_log(self) -> tuple[int, Path]:
        """The next worker number and its log, ``worker-NNN.log``, created empty. Numbers
        continue past logs already in log_dir, so sessions sharing a directory never overwrite
        each other's."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        while True:
            self.last_index += 1
            path = self.log_dir / f"worker-{self.last_index:03d}.log"
            try:
                with open(path, "xb"):
                    return self.last_index, path
            except FileExistsError:
                continue

    def emit(self, kind: EventKind, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(Event(kind=kind, **fields))

    # --- children ---

    def spawn(
        self,
        spec_env: Mapping[str, str],
        reason: str,
        *,
        deadline: float,
        budget_s: float,
        event: EventKind = EventKind.WORKER_STARTED,
    ) -> _Worker:
        """A new worker, ready before ``deadline``: the end of the ``budget_s`` seconds of the
        probe it is started for."""
        index, log_path = self._new_log()
        env = child_env(self.base_env, spec_env)
        read_fd, write_fd = os.pipe()
        env[knobs.QMOE_RESULT_FD] = str(write_fd)
        command = [self.python, "-m", WORKER_MODULE]
        header = f"# qmoe-doctor worker {index} ({reason}): {' '.join(command)}"
        if spec_env:
            header += f" with {' '.join(f'{k}={v}' for k, v in sorted(spec_env.items()))}"
        start = time.monotonic()
        try:
            child = spawn(
                command, env=env, log_path=log_path, header=header, stdin_pipe=True, pass_fds=(write_fd,)
            )
        except SpawnError as exc:
            os.close(read_fd)
            not_started = ChildEnd(
                ending=Ending.NOT_STARTED,
                who=f"worker {index}",
                ready=False,
                detail=self._not_started(exc),
            )
            self.emit(EventKind.WORKER_FAILED, worker=index, detail=not_started.detail)
            raise _SpawnFailed(not_started) from exc
        finally:
            os.close(write_fd)
        worker = _Worker(index=index, child=child, result_fd=read_fd)
        self.live.add(worker)
        message = worker.next_message(deadline)
        end: ChildEnd | None = None
        if isinstance(message, _Timeout):
            worker.kill()
            end = ChildEnd(
                ending=Ending.TIMED_OUT,
                who=worker.name,
                timeout_s=budget_s,
                ready=False,
                tail=worker.child.tail(),
                wall_s=time.monotonic() - start,
            )
        elif isinstance(message, _Dead):
            code = worker.kill()
            tail = worker.child.tail()
            hint = ""
            if "No module named 'qmoe_doctor" in tail or "No module named qmoe_doctor" in tail:
                hint = _MISSING_PACKAGE_HINT.format(python=self.python)
            elif self._named_by():
                hint = f"the interpreter is {self._named_by()}"
            end = ChildEnd(
                ending=Ending.EXITED,
                who=worker.name,
                exit_code=code,
                ready=False,
                detail=hint,
                tail=tail,
                wall_s=time.monotonic() - start,
            )
        elif message.get("type") != "ready":
            worker.kill()
            end = ChildEnd(
                ending=Ending.UNREADABLE,
                who=worker.name,
                ready=False,
                detail=f"{worker.name} wrote {message!r} before 'ready'",
                tail=worker.child.tail(),
                wall_s=time.monotonic() - start,
            )
        if end is not None:
            self.live.discard(worker)
            self.emit(
                EventKind.WORKER_FAILED, worker=index, pid=worker.pid, detail=describe_end(end, Phase.SPAWN)
            )
            raise _SpawnFailed(end)
        worker.ready = True
        self.emit(event, worker=index, pid=worker.pid, detail=reason)
        return worker

    def warm_worker(self, *, deadline: float, budget_s: float) -> _Worker:
        if self.warm is not None and self.warm.exit_status() is not None:
            self.retire(self.warm, f"worker {self.warm.index} exited between probes")
        if self.warm is None:
            replaced = self.warm_replaced
            if replaced is None:
                self.warm = self.spawn({}, "first worker", deadline=deadline, budget_s=budget_s)
            else:
                self.warm = self.spawn(
                    {}, replaced, deadline=deadline, budget_s=budget_s, event=EventKind.WORKER_RESTARTED
                )
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
        start = time.monotonic()
        deadline = start + spec.timeout_s  # the probe's whole time, a new child's start-up included
        own = spec.fresh_process or bool(spec.env)
        key = tuple(sorted(spec.env.items()))
        known = self.broken.get(key)
        if known is not None:  # this environment already failed to start: do not retry
            return self._spawn_failed(spec, known)
        for attempt in range(2):
            try:
                if own:
                    reason = "fresh process" if spec.fresh_process else "spec environment"
                    worker = self.spawn(
                        spec.env, f"{reason} for {spec.probe_id}", deadline=deadline, budget_s=spec.timeout_s
                    )
                else:
                    worker = self.warm_worker(deadline=deadline, budget_s=spec.timeout_s)
            except _SpawnFailed as failed:
                # A child that died or could not be started may have been unlucky (a flaky
                # file system, fork's EAGAIN): one retry, in the time left. One that hung has
                # used the probe's time.
                retry = attempt == 0 and failed.end.ending is not Ending.TIMED_OUT
                if retry and time.monotonic() < deadline:
                    continue
                self.broken[key] = failed.end
                return self._spawn_failed(spec, failed.end)
            outcome = self._run_on(worker, spec, start, deadline)
            if own and worker in self.live:
                self.retire(worker, kill=False)
            return outcome
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn_failed(self, spec: ProbeSpec, end: ChildEnd) -> Outcome:
        outcome = crash_outcome(spec, end)
        self.emit(EventKind.PROBE_STARTED, probe_id=spec.probe_id)
        self.emit(EventKind.OUTCOME, probe_id=spec.probe_id, outcome=outcome, phase=outcome.phase)
        return outcome

    def _run_on(self, worker: _Worker, spec: ProbeSpec, start: float, deadline: float) -> Outcome:
        probe_index = worker.probes_run
        worker.probes_run += 1
        probe = _Probe(spec=spec, worker=worker, start=start, log_start=worker.log_size())
        self.emit(EventKind.PROBE_STARTED, probe_id=spec.probe_id, worker=worker.index, pid=worker.pid)
        worker.send(to_json(spec))  # a dead child shows as _DEAD below
        outcome: Outcome | None = None
        while outcome is None:
            message = worker.next_message(deadline)
            if isinstance(message, _Timeout):
                worker.kill(dump_stacks=True)
                outcome = probe.ended(Ending.TIMED_OUT, timeout_s=spec.timeout_s)
                self.retire(worker, f"worker {worker.index} timed out on {spec.probe_id}")
            elif isinstance(message, _Dead):
                code = worker.kill()
                outcome = probe.ended(
                    Ending.EXITED, exit_code=code, where=f"{probe.phase.value}, during {spec.probe_id}"
                )
                self.retire(worker, f"worker {worker.index} died on {spec.probe_id}")
            elif message.get("type") == "crumb" and message.get("probe_id") == spec.probe_id:
                try:
                    probe.phase = Phase(str(message.get("phase")))
                except ValueError:
                    continue
                probe.step = str(message.get("step") or "")
                self.emit(
                    EventKind.CRUMB,
                    probe_id=spec.probe_id,
                    phase=probe.phase,
                    worker=worker.index,
                    pid=worker.pid,
                )
            elif message.get("type") == "outcome":
                outcome = self._received(probe, message)
            elif message.get("type") == "protocol-error":
                self.retire(worker, f"worker {worker.index} could not read {spec.probe_id}")
                outcome = probe.ended(Ending.UNREADABLE, detail=f"{worker.name}: {message.get('message')}")
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

    def _received(self, probe: _Probe, message: dict[str, Any]) -> Outcome:
        spec, worker = probe.spec, probe.worker
        try:
            outcome = from_jsonable(Outcome, message.get("outcome"))  # type: ignore[arg-type]
            if outcome.probe_id != spec.probe_id:
                raise ValueError(f"outcome for {outcome.probe_id!r}")
        except (TypeError, ValueError, KeyError) as exc:
            self.retire(worker, f"worker {worker.index} wrote an unreadable outcome")
            return probe.ended(Ending.UNREADABLE, detail=f"unreadable outcome from {worker.name}: {exc}")
        if outcome.status is Status.ERROR and not outcome.stderr_tail:
            outcome = dataclasses.replace(outcome, stderr_tail=worker.child.tail(probe.log_start))
        if outcome.error_kind in POISONING_KINDS:
            # The worker exits after writing it; make sure of it and start afresh next time.
            self.retire(
                worker,
                f"worker {worker.index} poisoned by {outcome.error_kind} in {spec.probe_id}",
                kill=False,
            )
        return outcome


#: Asked after each outcome of a session: a reason ends the session there (``run_session``).
StopAfter = Callable[[Outcome], str | None]


def not_run(spec: ProbeSpec, reason: str, after: str) -> Outcome:
    """The Outcome of a spec a session did not run: SKIPPED, the reason its note, the probe that
    stopped the session its fact ``not_run_after``."""
    return Outcome(
        probe_id=spec.probe_id,
        spec=spec,
        status=Status.SKIPPED,
        phase=Phase.SPAWN,
        facts={"not_run_after": after},
        notes=(reason,),
    )


def run_session(
    specs: Sequence[ProbeSpec],
    *,
    base_env: Mapping[str, str],
    log_dir: Path,
    python: str | None = None,
    on_event: OnEvent | None = None,
    stop_after: StopAfter | None = None,
) -> list[Outcome]:
    """Run ``specs`` in order, in child processes, and return one Outcome per spec, in order.

    Specs share one warm child; a spec with ``fresh_process`` or a non-empty ``env`` gets a child
    of its own (environment merged in) used for it alone. A poisoning error, a crash or a timeout
    retires the child and the next spec runs in a new one. Each probe may take ``spec.timeout_s``
    seconds from when it is asked for, the start-up of a child started for it included. A child
    that dies while starting is retried once, in the time left; an environment whose child could
    not start fails its later specs at once (phase SPAWN). Worker logs go to ``log_dir``.
    SIGINT, SIGTERM and SIGHUP end the session with ``Interrupted`` after killing every worker.
    ``stop_after`` is asked after each outcome; when it gives a reason, the specs after it are not
    run: they come back SKIPPED with that reason (``not_run``), an OUTCOME event each.
    """
    session = _Session(
        base_env=base_env,
        log_dir=Path(log_dir),
        python=child_python(python),
        on_event=on_event,
    )
    graceful = False
    with interruptible():
        try:
            outcomes: list[Outcome] = []
            for i, spec in enumerate(specs):
                outcome = session.run(spec)
                outcomes.append(outcome)
                reason = stop_after(outcome) if stop_after is not None else None
                if reason:
                    for later in specs[i + 1 :]:
                        skipped = not_run(later, reason, outcome.probe_id)
                        session.emit(
                            EventKind.OUTCOME, probe_id=later.probe_id, outcome=skipped, phase=skipped.phase
                        )
                        outcomes.append(skipped)
                    break
            graceful = True
            return outcomes
        finally:
            session.close(graceful=graceful)


__all__ = ["WORKER_MODULE", "StopAfter", "not_run", "run_session"]
