"""isolate.torchrun without torch: a stand-in launcher starts one "rank" in a session of its own,
as torchrun does, and both hang. The launch is killed at its timeout or on SIGTERM, the rank too
(found through the pid its crumbs name), and the rank's Outcome says where it hung."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from qmoe_doctor.core.events import Interrupted
from qmoe_doctor.core.records import Condition, ErrorKind, Outcome, Phase, ProbeSpec, Shape, Status, to_json
from qmoe_doctor.isolate.torchrun import RANK_MODULE, collect_run, launch

pytestmark = pytest.mark.timeout(60)

# A rank: writes its crumbs (start, then the set-up stage), then hangs. Its command line carries
# the rank module's name, which is how the parent recognises a rank process.
RANK = textwrap.dedent(
    """
    import json, os, sys, time
    out = sys.argv[1]
    with open(os.path.join(out, "rank-0.crumbs"), "a") as fh:
        fh.write(json.dumps({"type": "start", "pid": os.getpid(), "rank": 0, "local_rank": 0, "world_size": 1}) + "\\n")
        fh.write(json.dumps({"type": "crumb", "phase": "setup", "stage": "init-process-group"}) + "\\n")
    while True:
        time.sleep(60)
    """
)
LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], start_new_session=True)
    while True:
        time.sleep(60)
    """
)


@dataclass(frozen=True)
class OneRank:
    spec: ProbeSpec
    nproc: int = 1
    world_size: int = 1
    torchrun: bool = True


SPEC = ProbeSpec(
    probe_id="dp",
    kernel="builtin",
    condition=Condition.PARALLEL_DP,
    shape=Shape(m=8, e=2, n=4, k=4, dtype="float32"),
    params={"devices": [None]},
)


def rank_pid(run_dir: Path) -> int:
    crumbs = run_dir / "rank-0.crumbs"
    deadline = time.monotonic() + 30
    while not (crumbs.is_file() and crumbs.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(json.loads(crumbs.read_text().splitlines()[0])["pid"])


def gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "-c", LAUNCHER, RANK, str(run_dir), RANK_MODULE]


def test_a_hung_launch_is_killed_at_its_timeout_ranks_and_all(tmp_path: Path) -> None:
    seen: list[Outcome] = []
    pid_box: list[int] = []
    threading.Thread(target=lambda: pid_box.append(rank_pid(tmp_path)), daemon=True).start()
    end = launch(command(tmp_path), env=dict(os.environ), run_dir=tmp_path, timeout_s=3.0, on_result=seen.append)
    assert end.timed_out and end.exit_code == -signal.SIGKILL and end.wall_s >= 3.0
    assert pid_box and gone(pid_box[0]), "the rank, in a session of its own, survived the kill"
    assert seen == []
    (outcome,) = collect_run(OneRank(spec=SPEC), tmp_path, exit_code=end.exit_code, timed_out=True, timeout_s=3.0)
    assert (outcome.probe_id, outcome.status, outcome.error_kind, outcome.phase) == (
        "rank 0/parallel-dp",
        Status.ERROR,
        ErrorKind.TIMEOUT,
        Phase.SETUP,
    )
    assert "rank 0 timed out at init-process-group (setup phase) after 3 s" in (outcome.error_message or "")
    assert outcome.facts["parallel.at"] == "init-process-group"


def test_sigterm_mid_launch_kills_the_ranks_and_is_raised(tmp_path: Path) -> None:
    def terminate_once_the_rank_runs() -> None:
        rank_pid(tmp_path)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_once_the_rank_runs, daemon=True).start()
    with pytest.raises(Interrupted) as caught:
        launch(command(tmp_path), env=dict(os.environ), run_dir=tmp_path, timeout_s=50.0)
    assert caught.value.exit_code == 143
    assert gone(rank_pid(tmp_path))


def test_results_are_reported_as_they_appear(tmp_path: Path) -> None:
    done = Outcome(probe_id="rank 0/parallel-dp", spec=SPEC, status=Status.PASS, phase=Phase.DONE)
    code = f"open({str(tmp_path / 'rank-0.json')!r}, 'w').write({to_json(done)!r})"
    seen: list[Outcome] = []
    end = launch([sys.executable, "-c", code], env={}, run_dir=tmp_path, timeout_s=30, on_result=seen.append)
    assert (end.exit_code, end.timed_out) == (0, False)
    assert [o.probe_id for o in seen] == ["rank 0/parallel-dp"]
    assert (tmp_path / "launcher.log").read_text().startswith("# ")
