"""The probe child: ``python -m qmoe_doctor.probes.worker``, started by ``qmoe_doctor.isolate.worker_pool``.

Protocol. The parent writes one ProbeSpec JSON line (``records.to_json``) at a time on stdin and
closes stdin, between probes, to end the worker; an end of stdin while a probe runs means the
parent is gone (killed), and the worker kills its own process group (``watch_parent``). The
worker answers on a dedicated pipe whose fd the parent names in ``$QMOE_DOCTOR_RESULT_FD``
(stdout and stderr belong to libraries and go to the worker's log), one JSON object per line,
each written with one ``os.write`` and so flushed at once:

- ``{"type": "ready", "pid": ..., "python": "3.12.3", "t": ...}`` once, after start-up;
- ``{"type": "crumb", "probe_id": ..., "phase": "launch", "t": ...}`` before each phase;
- ``{"type": "outcome", "outcome": {...Outcome...}}`` when the probe ends, even by an exception;
- ``{"type": "protocol-error", "message": ...}`` for a spec line it cannot read (then it exits).

After an outcome whose error kind poisons the process (``records.POISONING_KINDS``: an illegal
access leaves the CUDA context unusable) the worker exits, and the parent starts a new one.

torch is never imported at module level here: self-test children run without it, and a probe's
``qmoe_doctor.probes.conditions`` (which imports torch) is loaded only when a real probe needs it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from typing import Any

from qmoe_doctor import __version__
from qmoe_doctor.core import error_kind, knobs
from qmoe_doctor.core.records import (
    POISONING_KINDS,
    Condition,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Status,
    from_json,
    from_jsonable,
    to_jsonable,
)

from . import device_log
from .context import Emit, ProbeContext

#: Lines of an exception's text kept in Outcome.error_message.
ERROR_MESSAGE_LINES = 20

# Outcome fields the worker fills itself; run_probe may return any other Outcome field, plus
# "facts" and "notes", which are merged with what the probe recorded on its context.
_RESERVED = frozenset({"schema_version", "probe_id", "spec", "tensors", "wall_s"})


class ProbeProtocolError(Exception):
    """run_probe returned something that is not a set of Outcome fields (a bug in the probe)."""


class _Emitter:
    """Writes protocol lines to the result fd: one ``os.write`` per line, under a lock, so a
    breadcrumb from another thread cannot interleave with an outcome."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    def __call__(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message, separators=(",", ":"), allow_nan=True) + "\n").encode()
        with self._lock:
            try:
                while data:
                    written = os.write(self._fd, data)
                    data = data[written:]
            except BrokenPipeError:  # the parent is gone: nobody will read the outcome
                os._exit(3)


def exception_type_name(exc: BaseException) -> str:
    """``module.Class`` of an exception (bare for builtins), as Outcome.error_type holds it."""
    cls = type(exc)
    if cls.__module__ in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def exception_message(exc: BaseException, who: str = "probe") -> str:
    """The first ERROR_MESSAGE_LINES lines of an exception's text, as Outcome.error_message."""
    if isinstance(exc, SystemExit):
        return f"the {who} called sys.exit({exc.code!r})"
    text = str(exc).strip() or repr(exc)
    return "\n".join(text.splitlines()[:ERROR_MESSAGE_LINES])


def _dispatch(ctx: ProbeContext) -> dict[str, Any]:
    if ctx.spec.condition.is_selftest:
        from qmoe_doctor.probes import selftest

        return selftest.run_probe(ctx)
    ctx.crumb(Phase.IMPORT)
    if ctx.spec.condition is Condition.PIPELINE:
        from qmoe_doctor.probes import pipeline  # imports torch and triton

        return pipeline.run_probe(ctx)
    from qmoe_doctor.probes import conditions  # imports torch and triton

    result: dict[str, Any] = conditions.run_probe(ctx)
    return result


def _assemble(ctx: ProbeContext, fields: Any, wall_s: float) -> Outcome:
    if not isinstance(fields, dict):
        raise ProbeProtocolError(
            f"run_probe returned {type(fields).__name__}, expected a dict of Outcome fields"
        )
    fields = dict(fields)
    known = set(Outcome.__dataclass_fields__)
    bad = sorted(set(fields) - (known - _RESERVED))
    if bad:
        raise ProbeProtocolError(f"run_probe returned fields the worker owns or Outcome lacks: {bad}")
    facts = ctx.facts
    facts.update(fields.pop("facts", None) or {})
    notes = ctx.notes + tuple(fields.pop("notes", None) or ())
    fields.setdefault("phase", Phase.DONE)
    data = to_jsonable(
        {
            **fields,
            "probe_id": ctx.spec.probe_id,
            "spec": ctx.spec,
            "facts": facts,
            "notes": notes,
            "tensors": ctx.tensors,
            "wall_s": wall_s,
        }
    )
    try:
        json.dumps(data, allow_nan=True)
        return from_jsonable(Outcome, data)
    except (TypeError, ValueError, KeyError) as exc:
        raise ProbeProtocolError(f"run_probe returned fields that are not an Outcome: {exc}") from exc


def execute(spec: ProbeSpec, emit: Emit | None = None) -> tuple[Outcome, bool]:
    """Run one probe in this process. Returns its outcome and whether the process is poisoned
    (must not run another probe). Never raises for anything the probe does short of killing
    the process."""
    ctx = ProbeContext(spec, emit)
    start = time.perf_counter()
    log_start = device_log.log_offset()  # where this probe's part of the worker's log begins
    try:
        fields = _dispatch(ctx)
        return _assemble(ctx, fields, time.perf_counter() - start), False
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are outcomes too
        wall_s = time.perf_counter() - start
        traceback.print_exc()  # to the worker log: the parent attaches its tail
        sys.stderr.flush()
        error_type = exception_type_name(exc)
        message = exception_message(exc)
        kind = classify(exc, error_type, message)
        facts = ctx.facts
        # observed, not guessed: the exception that ends the probe is the one that escaped the
        # kernel's call (the kernel raised), or not (the probe's own code, or one it wrapped)
        facts["raised_in_call"] = exc is ctx.call_error
        if kind is ErrorKind.DEVICE_ASSERT:
            # the per-thread assertion lines name the kernel's file:line; the log's tail does not
            lines, count = device_log.assertions_since(log_start)
            if lines:
                facts.update(device_assert_lines=lines, device_assert_count=count)
        outcome = Outcome(
            probe_id=spec.probe_id,
            spec=spec,
            status=Status.ERROR,
            phase=ctx.phase,
            error_kind=kind,
            error_type=error_type,
            error_message=message,
            facts=facts,
            notes=ctx.notes,
            tensors=ctx.tensors,
            wall_s=wall_s,
        )
        return outcome, kind in POISONING_KINDS


def classify(exc: BaseException, error_type: str, message: str) -> ErrorKind:
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return ErrorKind.OTHER  # the interpreter was asked to stop: do not reuse it
    return error_kind.classify_error(error_type, message)


class Busy:
    """Whether a probe is running: the parent closes the spec pipe only between probes, so an
    end of input during one means the parent is gone (``watch_parent``)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self, busy: bool) -> None:
        if busy:
            self._event.set()
        else:
            self._event.clear()

    def __bool__(self) -> bool:
        return self._event.is_set()


def watch_parent(spec_fd: int, busy: Busy) -> threading.Thread | None:
    """Start a daemon thread that waits for the parent's end of the spec pipe to close and, if a
    probe is running then, kills this worker's whole process group (the probe's own children
    too): a parent killed by SIGKILL closes the pipe and can do nothing else. Between probes the
    main loop sees the end of input itself and exits. Where poll() is missing, no thread."""
    if not hasattr(select, "poll"):  # pragma: no cover - Windows
        return None

    def run() -> None:
        poller = select.poll()
        poller.register(spec_fd, 0)  # no events asked for: POLLHUP, POLLERR, POLLNVAL still come
        while not poller.poll():
            pass
        # Idle now, the main loop reads the end of input and exits; should it have taken a spec
        # line just before, it is busy in a moment, and the parent is gone all the same.
        while not busy:
            time.sleep(0.05)
        sys.stderr.write("qmoe-doctor worker: the parent is gone; killing this worker's group\n")
        sys.stderr.flush()
        os.killpg(os.getpgrp(), signal.SIGKILL)

    thread = threading.Thread(target=run, name="qmoe-parent-watchdog", daemon=True)
    thread.start()
    return thread


def serve(spec_lines: Iterable[str], emit: Emit, busy: Busy | None = None) -> None:
    """The worker loop: one spec line in, breadcrumbs and one outcome out. Returns at the end of
    input or after a poisoning outcome. ``busy`` is set while a probe runs."""
    if busy is None:
        busy = Busy()
    emit(
        {
            "type": "ready",
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "qmoe_doctor": __version__,
            "t": time.time(),
        }
    )
    for line in spec_lines:
        if not line.strip():
            continue
        try:
            spec = from_json(ProbeSpec, line)
        except (TypeError, ValueError, KeyError) as exc:
            # A spec this worker cannot read (a parent of another qmoe-doctor version): say so
            # rather than die with a traceback the parent would classify as the probe's error.
            emit({"type": "protocol-error", "message": f"cannot read the spec: {exc}"})
            return
        busy.set(True)
        outcome, poisoned = execute(spec, emit)
        busy.set(False)  # before the outcome: the parent may close the pipe once it has it
        emit({"type": "outcome", "outcome": to_jsonable(outcome)})
        if poisoned:
            return


def main() -> None:
    faulthandler.enable(all_threads=True)  # fatal signals dump every thread's stack to the log
    if hasattr(signal, "SIGUSR1"):
        # The parent sends SIGUSR1 before killing a hung child: the stacks show where it hung.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        given_fd = knobs.result_fd()
        result_fd = given_fd if given_fd is not None else os.dup(1)  # run by hand: protocol on stdout
        os.set_inheritable(result_fd, False)  # programs a probe runs must not hold the pipe open
    except (ValueError, OSError) as exc:  # a worker started by hand with a bad descriptor
        why = exc if isinstance(exc, ValueError) else f"{knobs.QMOE_RESULT_FD}: {exc.strerror or exc}"
        print(f"error: {why}", file=sys.stderr)
        sys.exit(2)
    # Specs arrive on the original stdin; the probe sees /dev/null there, so nothing it runs can
    # swallow a spec line.
    spec_fd = os.dup(0)
    spec_in = os.fdopen(spec_fd, "r", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # The parent's death, however it dies: the kernel's parent-death signal (armed by the parent
    # when it started this process, Linux) ends this process; the watchdog ends its group.
    busy = Busy()
    if given_fd is not None:
        watch_parent(spec_fd, busy)
    try:
        serve(spec_in, _Emitter(result_fd), busy)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip interpreter teardown: after a CUDA fault, library atexit hooks can hang or crash, and
    # the parent has everything it needs.
    os._exit(0)


if __name__ == "__main__":
    main()
