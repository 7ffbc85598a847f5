"""No child outlives the doctor, whatever ends it.

The real CLI (``python -m qmoe_doctor scan --cpu``) runs in a subprocess with every probe child
hung at import (``test_isolate_hangs.import_hang_env``: no torch needed), each hung child with a
grandchild of its own. Once a probe worker hangs, the CLI gets SIGTERM, SIGINT, SIGHUP or
SIGKILL, and every process that carries this test's marker in its environment (the CLI's
descendants, whatever session they lead) is looked for in /proc. SIGTERM, SIGINT and SIGHUP:
the CLI kills the workers' process groups (grandchildren included) and exits 128 + the signal.
SIGKILL runs nothing in the CLI: the kernel's parent-death signal ends the worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from signal_dispositions import restore_defaults
from test_isolate_hangs import import_hang_env

from qmoe_doctor.core import lifeline

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds survivors through /proc"),
]

MARK = "SIGNAL_TEST_MARK"
WORKER_MODULE = b"qmoe_doctor.probes.worker"


def marked(mark: str) -> dict[int, bytes]:
    """Live processes whose environment carries ``MARK=mark``: pid -> command line."""
    needle = f"{MARK}={mark}".encode()
    found: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state not in ("Z", "X"):
            found[int(entry.name)] = cmdline.replace(b"\0", b" ")
    return found


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


def start_hung_scan(tmp_path: Path, mark: str) -> subprocess.Popen[str]:
    """The CLI, with its first probe worker hung at import (and a grandchild of that worker)."""
    env = {
        **os.environ,
        **import_hang_env(tmp_path, grandchild=True),
        MARK: mark,
        "CUDA_VISIBLE_DEVICES": "",
    }
    cli = subprocess.Popen(
        [sys.executable, "-m", "qmoe_doctor", "scan", "--cpu", "--timeout", "600", "--log-dir", str(tmp_path / "logs")],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=restore_defaults,  # the signals the test sends act, even under nohup
    )
    pids = tmp_path / "hung.pids"
    if not wait_for(lambda: pids.is_file() and pids.read_text().endswith("\n"), 60):
        cli.kill()
        out, err = cli.communicate()
        pytest.fail(f"no probe worker hung at import within 60 s:\n{err[-3000:]}")
    workers = [pid for pid, cmd in marked(mark).items() if WORKER_MODULE in cmd]
    assert workers, "the hung worker is not among the marked processes"
    return cli


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signalled_doctor_kills_every_child_and_exits_128_plus_the_signal(
    tmp_path: Path, signum: signal.Signals
) -> None:
    mark = uuid.uuid4().hex
    cli = start_hung_scan(tmp_path, mark)
    assert len(marked(mark)) >= 3  # the CLI, its hung worker, the worker's grandchild
    cli.send_signal(signum)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err
    assert wait_for(lambda: not marked(mark), 5), f"survivors: {marked(mark)}"


@pytest.mark.skipif(not lifeline.AVAILABLE, reason="no parent-death signal on this OS")
def test_a_doctor_killed_by_sigkill_leaves_no_probe_worker(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    cli = start_hung_scan(tmp_path, mark)
    cli.kill()
    cli.communicate(timeout=30)

    def workers() -> dict[int, bytes]:
        return {pid: cmd for pid, cmd in marked(mark).items() if WORKER_MODULE in cmd}

    survived = not wait_for(lambda: not workers(), 5)  # the parent-death signal is asynchronous
    for pid in marked(mark):  # the probe's own grandchild may outlive it: clean up after the test
        os.kill(pid, signal.SIGKILL)
    assert not survived, "a probe worker outlived its SIGKILLed doctor"
