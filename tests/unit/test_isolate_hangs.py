"""Hangs and --timeout: a probe's timeout is its whole time, its child's start-up included, and a
hang is named by the phase it stopped in.

The hang at import needs no torch: a ``sitecustomize`` on the child's PYTHONPATH makes importing
``qmoe_doctor.probes.conditions`` (where a real probe imports torch, triton and the kernel) never
end, as a kernel module that blocks at import, or torch on a hung network file system, does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qmoe_doctor.core.records import Condition, ErrorKind, Phase, ProbeSpec, Shape, Status
from qmoe_doctor.isolate.worker_pool import run_session

pytestmark = pytest.mark.timeout(120)

SHAPE = Shape(m=8, e=2, n=4, k=4, dtype="float32")

HANG_AT_IMPORT = '''\
"""Test hook: importing qmoe_doctor.probes.conditions never ends (tests/unit/test_isolate_hangs.py)."""
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import time


class _HangAtImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != "qmoe_doctor.probes.conditions":
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pids = [os.getpid()]
        if os.environ.get("HANG_GRANDCHILD"):  # a child of the probe's own, in its group
            child = subprocess.Popen(
                [sys.executable, "-c", "import time\\nwhile True: time.sleep(60)"], stdin=subprocess.DEVNULL
            )
            pids.append(child.pid)
        with open(os.environ["HANG_PID_FILE"], "a") as fh:
            fh.write(" ".join(map(str, pids)) + "\\n")
        while True:
            time.sleep(60)


sys.meta_path.insert(0, _HangAtImport())
'''


def import_hang_env(tmp_path: Path, *, grandchild: bool = False) -> dict[str, str]:
    """Environment for a child whose probes hang at import; each hung process appends its pid
    (and its grandchild's) to ``tmp_path/hung.pids``."""
    hook = tmp_path / "hang-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HANG_AT_IMPORT)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "HANG_PID_FILE": str(tmp_path / "hung.pids"),
        "HANG_GRANDCHILD": "1" if grandchild else "",
    }


def test_a_probe_hung_at_import_is_killed_at_its_timeout_and_the_phase_is_named(tmp_path: Path) -> None:
    hung = ProbeSpec(probe_id="hung", kernel="builtin", condition=Condition.SINGLE, shape=SHAPE, timeout_s=3.0)
    after = ProbeSpec(probe_id="after", kernel="builtin", condition=Condition.SELFTEST_OK, shape=SHAPE)
    out = run_session([hung, after], base_env=import_hang_env(tmp_path), log_dir=tmp_path / "logs")
    timed_out = out[0]
    assert (timed_out.status, timed_out.error_kind, timed_out.error_type, timed_out.phase) == (
        Status.ERROR,
        ErrorKind.TIMEOUT,
        "timeout",
        Phase.IMPORT,
    )
    assert "worker 1 timed out at import after 3 s" in (timed_out.error_message or "")
    assert timed_out.wall_s >= 3.0  # no start-up allowance on top, and never less than asked
    assert "exec_module" in timed_out.stderr_tail  # the stacks, asked for before the kill
    assert out[1].status is Status.PASS and out[1].facts["worker.index"] == 2


def test_scan_timeout_covers_a_hang_at_import_and_says_so(tmp_path: Path) -> None:
    """``scan --timeout 3`` with every probe child hung at import: the report says where the
    hang was and after how long; the check could not run (exit 4)."""
    env = {**os.environ, **import_hang_env(tmp_path), "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", "scan", "--cpu", "--timeout", "3", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 4, result.stderr
    doc = json.loads(result.stdout)
    env_check = next(o for o in doc["outcomes"] if o["spec"]["condition"] == Condition.INTERPRETER_CHECK.value)
    assert (env_check["error_kind"], env_check["phase"]) == ("timeout", "import")
    assert "timed out at import after 3 s" in env_check["error_message"]
    skipped = [o for o in doc["outcomes"] if o["status"] == "skipped"]
    assert skipped and all("timed out at import" in " ".join(o["notes"]) for o in skipped)
    assert not any("interpreter cannot run" in " ".join(o["notes"]) for o in skipped)
