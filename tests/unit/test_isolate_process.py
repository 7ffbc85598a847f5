"""isolate.process, crash, signals, logs and one_shot: the one process primitive, the one
"any way a child ends -> Outcome" function, and what uses them. CPU only, no torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from signal_dispositions import default_dispositions

from qmoe_doctor.core import knobs, lifeline
from qmoe_doctor.core.events import Interrupted
from qmoe_doctor.core.records import Condition, ErrorKind, Phase, ProbeSpec, Shape, Status
from qmoe_doctor.isolate import process
from qmoe_doctor.isolate.crash import ChildEnd, Ending, crash_outcome
from qmoe_doctor.isolate.logs import LogDir
from qmoe_doctor.isolate.one_shot import NOT_STARTED, run_command, stream_child
from qmoe_doctor.isolate.signals import interruptible

pytestmark = pytest.mark.timeout(60)

SPEC = ProbeSpec(probe_id="p", kernel="builtin", condition=Condition.SINGLE, shape=Shape(m=8, e=2, n=4, k=4))
ILLEGAL = "RuntimeError: CUDA error: an illegal memory access was encountered"
SLEEPER = "import time\nwhile True: time.sleep(60)"


def gone(pid: int, timeout_s: float = 5.0) -> bool:
    """True once ``pid`` no longer runs (a zombie nobody reaped counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X"):
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# --- the primitive ---


def test_spawn_leads_its_own_group_with_the_forced_environment(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    code = (
        "import os\n"
        "print(os.getsid(0) == os.getpid(), os.getpgrp() == os.getpid())\n"
        "print(os.environ['NCCL_NVLS_ENABLE'], os.environ['PYTHONFAULTHANDLER'], os.environ['MINE'])\n"
    )
    child = process.spawn(
        [sys.executable, "-c", code],
        env={**os.environ, "NCCL_NVLS_ENABLE": "1", "MINE": "kept"},
        log_path=log,
        header="# the header",
    )
    assert child.wait(30) == 0
    assert log.read_text().splitlines() == ["# the header", "True True", "0 1 kept"]
    assert child not in process.live_children()


def test_kill_takes_the_whole_group_and_is_idempotent(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        f"g = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
        f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
        "time.sleep(60)\n"
    )
    child = process.spawn([sys.executable, "-c", code], env=dict(os.environ), log_path=tmp_path / "log")
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert child.kill() == -signal.SIGKILL
    assert child.kill() == -signal.SIGKILL  # reaped: nothing is signalled again
    assert gone(child.pid) and gone(grandchild)


def test_a_hung_child_dumps_its_stacks_before_the_kill(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import faulthandler, signal, sys, time
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        print("ready", flush=True)
        def stuck_here():
            time.sleep(60)
        stuck_here()
        """
    )
    log = tmp_path / "log"
    child = process.spawn([sys.executable, "-c", code], env=dict(os.environ), log_path=log)
    deadline = time.monotonic() + 30
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill(dump_stacks=True)
    assert "stuck_here" in child.tail()


def test_a_program_that_cannot_start_is_a_spawn_error(tmp_path: Path) -> None:
    with pytest.raises(process.SpawnError, match="cannot start"):
        process.spawn([str(tmp_path / "no-such-program")], env={}, log_path=tmp_path / "log")


def test_read_tail_keeps_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert process.read_tail(log, lines=3) == "line 97\nline 98\nline 99"
    assert process.read_tail(log, start=log.stat().st_size) == ""
    assert process.read_tail(tmp_path / "missing") == ""


@pytest.mark.skipif(not lifeline.AVAILABLE, reason="no parent-death signal on this OS")
def test_a_child_dies_with_its_parent_killed_by_sigkill(tmp_path: Path) -> None:
    """The parent runs no finally when SIGKILLed: the kernel's parent-death signal ends the child."""
    pid_file = tmp_path / "child"
    parent_code = (
        "import os, sys, time\n"
        "from qmoe_doctor.isolate import process\n"
        f"c = process.spawn([sys.executable, '-c', {SLEEPER!r}], env=dict(os.environ), output='merged')\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert not gone(child, 0)
    parent.kill()
    parent.wait()
    assert gone(child), "the child outlived its SIGKILLed parent"


# --- any end -> Outcome ---

# (how the child ended, the last phase it reached) -> (kind, error_type, phase, words in the message)
CRASHES = [
    pytest.param(
        ChildEnd(ending=Ending.EXITED, who="worker 2", exit_code=-11, tail="Fatal Python error: Segmentation fault"),
        Phase.LAUNCH,
        (ErrorKind.SIGNAL, "signal", Phase.LAUNCH, "worker 2 killed by SIGSEGV (signal 11) at launch"),
        id="segfault",
    ),
    pytest.param(
        ChildEnd(ending=Ending.EXITED, who="worker 2", exit_code=3, tail=ILLEGAL),
        Phase.SYNC,
        (ErrorKind.ILLEGAL_ADDRESS, "exit", Phase.SYNC, "worker 2 exited with status 3 at sync"),
        id="cuda-error-text-then-exit",
    ),
    pytest.param(
        ChildEnd(ending=Ending.EXITED, who="worker 2", exit_code=-6, tail="device-side assert triggered"),
        Phase.SYNC,
        (ErrorKind.DEVICE_ASSERT, "signal", Phase.SYNC, "SIGABRT"),
        id="device-assert-abort",
    ),
    pytest.param(
        ChildEnd(ending=Ending.TIMED_OUT, who="worker 1", timeout_s=15.0),
        Phase.IMPORT,
        (ErrorKind.TIMEOUT, "timeout", Phase.IMPORT, "worker 1 timed out at import after 15 s"),
        id="hang-at-import",
    ),
    pytest.param(
        ChildEnd(ending=Ending.TIMED_OUT, who="worker 1", timeout_s=0.5, ready=False),
        Phase.SPAWN,
        (ErrorKind.TIMEOUT, "spawn", Phase.SPAWN, "timed out at spawn after 0.5 s: it never said it was ready"),
        id="never-ready-hang",
    ),
    pytest.param(
        # an import error while starting is the interpreter's, not the kernel's
        ChildEnd(ending=Ending.EXITED, who="worker 1", exit_code=1, ready=False, tail="ModuleNotFoundError: x"),
        Phase.SPAWN,
        (ErrorKind.OTHER, "spawn", Phase.SPAWN, "worker 1 exited with status 1 before it was ready"),
        id="died-before-ready",
    ),
    pytest.param(
        ChildEnd(ending=Ending.NOT_STARTED, who="worker 1", ready=False, detail="cannot start /x/python: ENOENT"),
        Phase.SPAWN,
        (ErrorKind.OTHER, "spawn", Phase.SPAWN, "cannot start /x/python"),
        id="not-started",
    ),
    pytest.param(
        ChildEnd(ending=Ending.UNREADABLE, who="worker 1", detail="unreadable outcome from worker 1: bad"),
        Phase.COMPARE,
        (ErrorKind.OTHER, "protocol", Phase.COMPARE, "unreadable outcome"),
        id="protocol",
    ),
    pytest.param(
        ChildEnd(ending=Ending.EXITED, who="rank 1", detail="the launcher exited with status 1"),
        Phase.SETUP,
        (ErrorKind.OTHER, "exit", Phase.SETUP, "rank 1 wrote no result, last at setup; the launcher exited"),
        id="no-result-no-status",
    ),
]


@pytest.mark.parametrize(("end", "phase", "expected"), CRASHES)
def test_every_way_a_child_ends_is_an_outcome(
    end: ChildEnd, phase: Phase, expected: tuple[ErrorKind, str, Phase, str]
) -> None:
    kind, error_type, shown_phase, words = expected
    outcome = crash_outcome(SPEC, end, phase=phase)
    assert outcome.status is Status.ERROR
    assert (outcome.error_kind, outcome.error_type, outcome.phase) == (kind, error_type, shown_phase)
    assert words in (outcome.error_message or "")
    assert outcome.exit_code == (end.exit_code if end.ending is Ending.EXITED else None)
    assert outcome.stderr_tail == end.tail


# --- signals ---


@pytest.fixture
def terminal_signals() -> Iterator[None]:
    """SIGINT and SIGHUP act as in a terminal while the test runs, even when the suite inherited
    them ignored (a background job, nohup)."""
    with default_dispositions():
        yield


@pytest.mark.usefixtures("terminal_signals")
def test_sigterm_within_a_guard_is_an_interruption_and_kills_the_children(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as caught, interruptible():
        child = process.spawn([sys.executable, "-c", SLEEPER], env=dict(os.environ), log_path=tmp_path / "log")
        signal.raise_signal(signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert (caught.value.signum, caught.value.exit_code, str(caught.value)) == (
        signal.SIGTERM,
        143,
        "interrupted by SIGTERM",
    )
    assert isinstance(caught.value, KeyboardInterrupt)
    assert gone(child.pid) and not process.live_children()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.usefixtures("terminal_signals")
def test_a_second_signal_while_the_first_unwinds_is_not_raised() -> None:
    with pytest.raises(Interrupted) as caught, interruptible():
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            signal.raise_signal(signal.SIGTERM)  # during the clean-up: noted, not raised
    assert caught.value.signum == signal.SIGINT and caught.value.exit_code == 130


@pytest.mark.usefixtures("terminal_signals")
def test_guards_nest_and_ignored_signals_stay_ignored() -> None:
    term = signal.getsignal(signal.SIGTERM)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with interruptible():
            with interruptible():
                signal.raise_signal(signal.SIGHUP)  # ignored: nothing raised
            handler = signal.getsignal(signal.SIGTERM)
            assert handler not in (signal.SIG_DFL, signal.SIG_IGN)  # the outer guard's, still in place
            with pytest.raises(Interrupted):
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == term
    finally:
        signal.signal(signal.SIGHUP, previous)


# --- logs ---


def test_log_dir_asked_for_is_kept(tmp_path: Path) -> None:
    asked = tmp_path / "logs" / "deeper"
    with LogDir.open(asked) as logs:
        (logs.path / "worker-001.log").write_text("x")
        assert logs.reported == str(asked)
    assert (asked / "worker-001.log").is_file()


def test_temporary_log_dir_is_removed_when_healthy_and_kept_when_not(tmp_path: Path) -> None:
    with LogDir.open(None, prefix="qmoe-doctor-test-") as healthy:
        (healthy.path / "worker-001.log").write_text("x")
        assert healthy.reported == ""
    assert not healthy.path.exists()
    with LogDir.open(None, prefix="qmoe-doctor-test-") as failed:
        failed.keep()
        assert failed.reported == str(failed.path)
    assert failed.path.is_dir()
    with pytest.raises(RuntimeError), LogDir.open(None, prefix="qmoe-doctor-test-") as broken:
        raise RuntimeError("an error keeps what ran so far")
    assert broken.path.is_dir()
    for kept in (failed.path, broken.path):
        for f in kept.iterdir():
            f.unlink()
        kept.rmdir()


# --- one-shot children ---


def test_run_command_collects_output_and_kills_the_group_at_the_timeout(tmp_path: Path) -> None:
    done = run_command([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], {}, 30)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n")
    hung = run_command([sys.executable, "-c", "print('before', flush=True)\n" + SLEEPER], {}, 1.0)
    assert hung.returncode is None and hung.stdout == "before\n"
    missing = run_command([str(tmp_path / "no-such-tool")], {}, 5)
    assert missing.returncode == NOT_STARTED and "cannot start" in missing.stderr


def test_stream_child_passes_lines_on_and_dumps_stacks_at_the_timeout(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import faulthandler, signal, time
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        print("first", flush=True)
        def waiting_forever():
            time.sleep(60)
        waiting_forever()
        """
    )
    seen: list[str] = []
    run = stream_child(
        [sys.executable, "-c", code], dict(os.environ), timeout_s=2.0, on_line=seen.append, log_path=tmp_path / "log"
    )
    assert run.returncode is None
    assert seen[0] == "first" and any("waiting_forever" in line for line in seen)
    assert "waiting_forever" in (tmp_path / "log").read_text()
    ok = stream_child([sys.executable, "-c", "print('a'); print('b')"], {}, timeout_s=30)
    assert (ok.returncode, ok.lines) == (0, ["a", "b"])


def test_knobs_read_and_validate_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(knobs.QMOE_RESULT_FD, "seven")
    with pytest.raises(ValueError, match=knobs.QMOE_RESULT_FD):
        knobs.result_fd()
    monkeypatch.setenv(knobs.QMOE_RESULT_FD, "7")
    assert knobs.result_fd() == 7
    monkeypatch.setenv(knobs.QMOE_CHILD_PYTHON, "  ")
    assert knobs.child_python() is None and process.child_python() == sys.executable
    assert knobs.pin_gpus(["GPU-b", "GPU-a"]) == {
        "CUDA_VISIBLE_DEVICES": "GPU-b,GPU-a",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert knobs.pin_gpus([])["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(ValueError, match="UUID"):
        knobs.pin_gpus(["GPU-a", ""])
