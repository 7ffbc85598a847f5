"""Parallel launches: start torchrun (or one rank alone), wait, kill, and read every rank back.

A launch is ``python -m torch.distributed.run ... -m qmoe_doctor.probes.parallel.rank --spec SPEC
--out DIR`` (dp, tp, ep) or the rank module alone (pp, the one-device baseline), started by
``process.spawn`` with its output in ``DIR/launcher.log``. Each rank writes, in DIR,
``rank-R.json`` (its Outcome), ``rank-R.crumbs`` (breadcrumbs and facts as they happen) and
``rank-R.log``; ``collect_run`` reads them back. A rank that died becomes an Outcome from its
exit status (torchrun's failure summary names it), its last breadcrumb and its log tail
(``crash.crash_outcome``, as for probe workers).

Killing: torchrun starts every rank in a session of its own, so killing the launcher's group
alone would leave the ranks running. On timeout or interruption the parent asks every rank for
its stacks (SIGUSR1), then kills each rank's process group and the launcher's. If the doctor
itself is killed (SIGKILL), the launcher dies by its parent-death signal and each rank by its own
(``probes/parallel/rank.py`` arms it against torchrun). Never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from qmoe_doctor.core.error_kind import describe_exit
from qmoe_doctor.core.records import Outcome, Phase, ProbeSpec, Status, from_json, rank_spec
from qmoe_doctor.isolate.crash import ChildEnd, Ending, crash_outcome
from qmoe_doctor.isolate.process import STACK_DUMP_WAIT_S, Child, read_tail, spawn
from qmoe_doctor.isolate.signals import interruptible

RANK_MODULE = "qmoe_doctor.probes.parallel.rank"
TORCHRUN_MODULE = "torch.distributed.run"
LAUNCHER_LOG = "launcher.log"
_POLL_S = 0.1


class Launch(Protocol):
    """What collection needs to know of a planned launch (``plan.parallel.PlannedRun``)."""

    @property
    def spec(self) -> ProbeSpec: ...  # the template every rank reads
    @property
    def nproc(self) -> int: ...  # local processes
    @property
    def world_size(self) -> int: ...  # nproc x nnodes
    @property
    def torchrun(self) -> bool: ...  # launched by torchrun (else: one rank alone)


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# Launch and kill
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchEnd:
    """How one launch ended."""

    exit_code: int  # the launcher's
    timed_out: bool  # killed at the timeout, ranks and all
    wall_s: float


def launch(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    run_dir: Path,
    timeout_s: float,
    on_result: Callable[[Outcome], None] | None = None,
) -> LaunchEnd:
    """Run one launch in ``run_dir`` for at most ``timeout_s`` seconds, start-up included;
    ``on_result`` gets each rank's Outcome as its file appears. On timeout, or when the parent is
    interrupted (``Interrupted``, re-raised), every rank is asked for its stacks and killed."""
    with interruptible():
        child = spawn(command, env=env, log_path=run_dir / LAUNCHER_LOG, header="# " + " ".join(command))
        deadline = child.started + timeout_s
        reported: set[str] = set()
        timed_out = False
        try:
            while child.exit_status() is None:
                _report_new(run_dir, reported, on_result)
                if time.monotonic() >= deadline:
                    timed_out = True
                    kill_launch(child, run_dir)
                    break
                time.sleep(_POLL_S)
            if not timed_out:
                _kill_leftovers(run_dir, child.pid)  # a rank torchrun could not stop
        except BaseException:  # Interrupted, or anything else: leave no rank behind
            kill_launch(child, run_dir)
            raise
        exit_code = child.kill()  # reaps it (and whatever is left of its group)
        _report_new(run_dir, reported, on_result)
        return LaunchEnd(exit_code=exit_code, timed_out=timed_out, wall_s=child.wall_s)


def _report_new(run_dir: Path, reported: set[str], on_result: Callable[[Outcome], None] | None) -> None:
    if on_result is None:
        return
    for path in sorted(run_dir.glob("rank-*.json")):
        if path.name in reported:
            continue
        reported.add(path.name)
        try:
            outcome = from_json(Outcome, path.read_text())
        except (OSError, ValueError, TypeError, KeyError):
            continue
        on_result(outcome)


def kill_launch(launcher: Child, run_dir: Path) -> None:
    """Every rank's stacks to its log (SIGUSR1), then SIGKILL to each rank's process group and to
    the launcher's."""
    ranks = _rank_pids(run_dir, launcher.pid)
    for pid in ranks:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
    if ranks:
        time.sleep(STACK_DUMP_WAIT_S)
    for pid in ranks:
        _kill_group_of(pid, launcher.pid)
    launcher.kill()


def _kill_leftovers(run_dir: Path, launcher_pid: int) -> None:
    for pid in _rank_pids(run_dir, launcher_pid):
        _kill_group_of(pid, launcher_pid)


def _kill_group_of(pid: int, launcher_pid: int) -> None:
    with contextlib.suppress(OSError):
        pgid = os.getpgid(pid)
        if pgid in (pid, launcher_pid):  # its own session (torchrun) or the launcher's (alone)
            os.killpg(pgid, signal.SIGKILL)


def _rank_pids(run_dir: Path, launcher_pid: int) -> list[int]:
    """Live rank processes of this launch: the pids the ranks wrote in their crumbs, and the
    launcher's children (a rank that died before writing any), each checked to be running our
    rank module right now (a pid may have been reused). torchrun itself is not one of them."""
    pids: set[int] = set(_children_of(launcher_pid))
    for path in run_dir.glob("rank-*.crumbs"):
        start = read_crumbs(path).start
        if isinstance(start.get("pid"), int):
            pids.add(int(start["pid"]))
    return sorted(p for p in pids if _is_rank_process(p))


def _children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc; elsewhere none are found)."""
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


def _is_rank_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        # no /proc (macOS): trust a live pid we were told about
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    state = ""
    with contextlib.suppress(OSError, IndexError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    args = cmdline.split(b"\0")
    return RANK_MODULE.encode() in args and TORCHRUN_MODULE.encode() not in args and state not in ("Z", "X")


# ---------------------------------------------------------------------------------------------
# Collect
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Crumbs:
    """What a rank's ``rank-R.crumbs`` says, read back."""

    start: dict[str, Any] = field(default_factory=dict)
    phase: Phase = Phase.SPAWN
    stage: str = "start"
    facts: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def read_crumbs(path: Path) -> Crumbs:
    """A rank's breadcrumbs; a line cut by a kill is skipped."""
    start: dict[str, Any] = {}
    phase = Phase.SPAWN
    stage = "start"
    facts: dict[str, Any] = {}
    notes: list[str] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return Crumbs()
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if not isinstance(msg, dict):
            continue
        kind = msg.get("type")
        if kind == "start":
            start = msg
        elif kind == "fact" and isinstance(msg.get("key"), str):
            facts[msg["key"]] = msg.get("value")
        elif kind == "note":
            notes.append(str(msg.get("text", "")))
        if kind in ("crumb", "stage"):
            with contextlib.suppress(ValueError):
                phase = Phase(str(msg.get("phase")))
        if isinstance(msg.get("stage"), str):
            stage = msg["stage"]
    return Crumbs(start=start, phase=phase, stage=stage, facts=facts, notes=tuple(notes))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit:
    """One entry of torchrun's failure summary."""

    rank: int
    local_rank: int
    exit_code: int
    root_cause: bool


_FAILURE_ENTRY = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n\s*exitcode\s*:\s*(?P<code>-?\d+)",
    re.IGNORECASE,
)
_ROOT_CAUSE = "Root Cause (first observed failure):"


def parse_torchrun_failures(text: str) -> dict[int, RankExit]:
    """Global rank -> exit of each rank torchrun's ``ChildFailedError`` summary lists::

    Failures:
    [1]:
      rank      : 0 (local_rank: 0)
      exitcode  : -15 (pid: 31198)  (SIGTERM)
    Root Cause (first observed failure):
    [0]:
      rank      : 1 (local_rank: 1)
      exitcode  : 3 (pid: 31199)
    """
    head, _, root = text.rpartition(_ROOT_CAUSE) if _ROOT_CAUSE in text else (text, "", "")
    found: dict[int, RankExit] = {}
    for part, is_root in ((head, False), (root, True)):
        for m in _FAILURE_ENTRY.finditer(part):
            rank = int(m.group("rank"))
            found[rank] = RankExit(
                rank=rank,
                local_rank=int(m.group("local")),
                exit_code=int(m.group("code")),
                root_cause=is_root,
            )
    return found


def collect_run(
    run: Launch, run_dir: Path, *, exit_code: int | None, timed_out: bool, timeout_s: float
) -> list[Outcome]:
    """One Outcome per rank of this node: the rank's own file, or one made from its exit status,
    breadcrumbs and log for a rank that wrote none."""
    launcher_text = ""
    with contextlib.suppress(OSError):
        launcher_text = (run_dir / LAUNCHER_LOG).read_text(errors="replace")
    failures = parse_torchrun_failures(launcher_text) if run.torchrun else {}
    crumbs = {
        int(p.name[5:-7]): read_crumbs(p) for p in run_dir.glob("rank-*.crumbs") if p.name[5:-7].isdigit()
    }
    results: dict[int, Outcome] = {}
    for path in run_dir.glob("rank-*.json"):
        if not path.name[5:-5].isdigit():
            continue
        try:
            results[int(path.name[5:-5])] = from_json(Outcome, path.read_text())
        except (OSError, ValueError, TypeError, KeyError) as exc:
            crumbs.setdefault(int(path.name[5:-5]), Crumbs(notes=(f"unreadable result file: {exc}",)))
    ranks = set(results) | set(crumbs) | set(failures)
    local_seen = {int(c.start.get("local_rank", r)) for r, c in crumbs.items()} | {
        f.local_rank for f in failures.values()
    }
    if run.world_size == run.nproc:  # one node: global ranks are the local ones
        ranks |= set(range(run.nproc))
    root = next((f.rank for f in failures.values() if f.root_cause), None)
    ended = _LaunchEnded(
        exit_code=exit_code, timed_out=timed_out, timeout_s=timeout_s, launcher_text=launcher_text
    )
    outcomes: list[Outcome] = []
    for rank in sorted(ranks):
        if rank in results:
            outcome = results[rank]
            if outcome.status is Status.ERROR and not outcome.stderr_tail:
                outcome = replace(outcome, stderr_tail=read_tail(run_dir / f"rank-{rank}.log"))
            if rank in failures and outcome.exit_code is None:
                outcome = replace(outcome, exit_code=failures[rank].exit_code)
            outcomes.append(outcome)
            continue
        outcomes.append(
            _dead_rank(
                run, run_dir, rank, crumbs.get(rank, Crumbs()), failures.get(rank), root=root, ended=ended
            )
        )
    if run.world_size != run.nproc:  # several nodes: local ranks that left no trace at all
        for local in sorted(set(range(run.nproc)) - local_seen):
            outcomes.append(
                _dead_rank(run, run_dir, local, Crumbs(), None, root=root, ended=ended, local=True)
            )
    return outcomes


@dataclass(frozen=True, slots=True, kw_only=True)
class _LaunchEnded:
    exit_code: int | None
    timed_out: bool
    timeout_s: float
    launcher_text: str


def _dead_rank(
    run: Launch,
    run_dir: Path,
    rank: int,
    crumbs: Crumbs,
    failure: RankExit | None,
    *,
    root: int | None,
    ended: _LaunchEnded,
    local: bool = False,
) -> Outcome:
    local_rank = int(crumbs.start.get("local_rank", failure.local_rank if failure else rank))
    devices = run.spec.params.get("devices") or [None]
    ordinal = devices[local_rank] if 0 <= local_rank < len(devices) else None
    spec = rank_spec(run.spec, rank, ordinal, local=local)  # as the rank would have written it
    tail = read_tail(run_dir / f"rank-{rank}.log") if not local else ""
    if not tail.strip():
        tail = "\n".join(ended.launcher_text.splitlines()[-60:])
    facts: dict[str, Any] = {**crumbs.facts, "parallel.at": crumbs.stage}
    code = failure.exit_code if failure else (ended.exit_code if not run.torchrun else None)
    if code is not None:
        facts["parallel.exit_code"] = code
    who = f"rank {rank}"
    if ended.timed_out:
        end = ChildEnd(ending=Ending.TIMED_OUT, who=who, timeout_s=ended.timeout_s, tail=tail)
    elif code is not None:
        end = ChildEnd(ending=Ending.EXITED, who=who, exit_code=code, tail=tail)
    else:
        launcher = describe_exit(ended.exit_code or 0)
        end = ChildEnd(ending=Ending.EXITED, who=who, detail=f"the launcher {launcher}", tail=tail)
    terminated = not ended.timed_out and code == -signal.SIGTERM and root is not None and root != rank
    if terminated:
        facts["parallel.terminated_after"] = root
    outcome = crash_outcome(
        spec,
        end,
        phase=crumbs.phase,
        where=f"{crumbs.stage} ({crumbs.phase.value} phase)",
        facts=facts,
        notes=crumbs.notes,
    )
    outcome = replace(outcome, exit_code=code)
    if terminated:
        outcome = replace(
            outcome,
            error_type="terminated",
            error_message=f"{outcome.error_message}: torchrun stopped it after rank {root} failed",
        )
    return outcome


__all__ = [
    "LAUNCHER_LOG",
    "RANK_MODULE",
    "TORCHRUN_MODULE",
    "Crumbs",
    "Launch",
    "LaunchEnd",
    "RankExit",
    "collect_run",
    "free_port",
    "kill_launch",
    "launch",
    "parse_torchrun_failures",
    "read_crumbs",
]
