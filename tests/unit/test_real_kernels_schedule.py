"""The schedule of disjoint GPU pairs (``plan.pair_rounds``) for 2, 4 and 8 GPUs, and odd counts;
the scan planned round by round (``plan_scan``); ``run_scan`` running a round's sessions at once,
with fake sessions (no child), and reporting in plan order."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.core.autotune import AutotunePolicy
from qmoe_doctor.core.events import Event, EventKind
from qmoe_doctor.core.options import CheckOptions, ScanOptions
from qmoe_doctor.core.records import Condition, ErrorKind, Outcome, Phase, Status
from qmoe_doctor.plan.check import plan_check
from qmoe_doctor.plan.pair_rounds import is_disjoint, pair_rounds
from qmoe_doctor.plan.scan import ScanPlan, plan_scan
from qmoe_doctor.workflows import scan as scan_workflow
from qmoe_doctor.workflows.scan import KernelUnusable, run_scan


@pytest.mark.parametrize(("n", "rounds", "per_round"), [(2, 2, 1), (3, 6, 1), (4, 6, 2), (5, 10, 2), (8, 14, 4)])
def test_every_ordered_pair_once_in_rounds_of_disjoint_pairs(n: int, rounds: int, per_round: int) -> None:
    gpus = list(range(n))
    schedule = pair_rounds(gpus)
    assert len(schedule) == rounds
    assert all(is_disjoint(r) and len(r) == per_round for r in schedule)
    played = [pair for r in schedule for pair in r]
    assert sorted(played) == sorted(itertools.permutations(gpus, 2))  # each ordered pair exactly once


def test_two_gpus_keep_today_s_order() -> None:
    assert pair_rounds([0, 1]) == [[(0, 1)], [(1, 0)]]
    assert pair_rounds([3, 1]) == [[(3, 1)], [(1, 3)]]  # --gpus order, not numeric


def test_the_schedule_is_deterministic_and_follows_the_gpus_given() -> None:
    assert pair_rounds([7, 2, 5, 0]) == pair_rounds([7, 2, 5, 0])
    assert {g for r in pair_rounds([7, 2, 5, 0]) for p in r for g in p} == {7, 2, 5, 0}
    assert pair_rounds([0]) == [] and pair_rounds([]) == []
    assert pair_rounds([0, 0, 1]) == pair_rounds([0, 1])  # a GPU named twice counts once


# --------------------------------------------------------------------------------------------
# The planner: pair sessions round by round
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class G:
    index: int
    uuid: str


def _gpus(n: int) -> list[G]:
    return [G(i, f"GPU-{i:03d}") for i in range(n)]


@pytest.mark.parametrize(("n", "rounds", "per_round"), [(2, 2, 1), (4, 6, 2), (8, 14, 4)])
def test_plan_scan_runs_pair_sessions_round_by_round(n: int, rounds: int, per_round: int) -> None:
    plan = plan_scan("builtin", _gpus(n))
    assert len(plan.rounds) == rounds and all(len(r) == per_round for r in plan.rounds)
    # plan order is round order, and each session is tagged with its round
    assert [s.round for s in plan.sessions] == [i for i, r in enumerate(plan.rounds) for _ in r]
    for number, sessions in enumerate(plan.rounds):
        pinned = [g for s in sessions for g in s.gpu_of_ordinal.values()]
        assert len(pinned) == len(set(pinned)), f"round {number} pins a GPU twice"
        assert [tuple(s.gpu_of_ordinal.values()) for s in sessions] == pair_rounds(list(range(n)))[number]
        # the pin is the session's own pair: a child sees exactly its two GPUs
        for s in sessions:
            a, b = s.gpu_of_ordinal[0], s.gpu_of_ordinal[1]
            assert s.env["CUDA_VISIBLE_DEVICES"] == f"GPU-{a:03d},GPU-{b:03d}"
    # every ordered pair once; single cells once per GPU; the sweeps and the int32 boundary on
    # the first session's operand GPU, as before rounds
    assert sorted(s.label for s in plan.sessions) == sorted(
        f"GPU {a} -> GPU {b}" for a, b in itertools.permutations(range(n), 2)
    )
    singles = sorted(s.probe_id for s in plan.specs if s.condition is Condition.SINGLE)
    assert singles == sorted(f"GPU {i}/single" for i in range(n))
    first = plan.sessions[0]
    assert first.label == "GPU 0 -> GPU 1"
    assert any(s.condition is Condition.INT32_BOUNDARY for s in first.specs)
    assert {s.probe_id.split("/")[0] for s in plan.specs if s.condition is Condition.OFFSETS} == {"GPU 1"}
    assert len({s.probe_id for s in plan.specs}) == len(plan.specs)


def test_two_gpus_keep_the_order_of_one_pair_at_a_time() -> None:
    plan = plan_scan("builtin", _gpus(2))
    assert [(s.label, s.round) for s in plan.sessions] == [("GPU 0 -> GPU 1", 0), ("GPU 1 -> GPU 0", 1)]


def test_pairs_at_once_splits_the_rounds_and_max_pairs_keeps_the_first_pair() -> None:
    full = plan_scan("builtin", _gpus(8))
    serial = plan_scan("builtin", _gpus(8), ScanOptions(pairs_at_once=1))
    assert [s.label for s in serial.sessions] == [s.label for s in full.sessions]  # the same order
    assert all(len(r) == 1 for r in serial.rounds) and len(serial.rounds) == 56
    two = plan_scan("builtin", _gpus(8), ScanOptions(pairs_at_once=2))
    assert len(two.rounds) == 28 and all(len(r) == 2 for r in two.rounds)
    # check's fast subset: the first ordered pair in --gpus order, whatever the schedule
    (only,) = plan_scan("builtin", [G(3, "c"), G(1, "a"), G(2, "b")], ScanOptions(max_pairs=1)).sessions
    assert only.label == "GPU 3 -> GPU 1"
    three = plan_scan("builtin", _gpus(4), ScanOptions(max_pairs=3))
    assert {s.label for s in three.sessions} == {"GPU 0 -> GPU 1", "GPU 0 -> GPU 2", "GPU 0 -> GPU 3"}
    assert all(len(r) == 1 for r in three.rounds)  # they all share GPU 0
    assert "3 of 12 ordered GPU pairs" in three.skipped[0]


@pytest.mark.parametrize("policy", list(AutotunePolicy))
def test_every_spec_and_session_carries_the_autotune_policy(policy: AutotunePolicy) -> None:
    for gpus in ([], _gpus(1), _gpus(2)):
        plan = plan_scan("specimen:autotuned", gpus, ScanOptions(autotune=policy))
        assert plan.autotune is policy
        assert plan.specs and all(s.params["autotune"] == policy.value for s in plan.specs)
        # offsets and launch-config cells keep their own params beside it
        assert all("variant" in s.params for s in plan.specs if s.condition is Condition.OFFSETS)
        cached = {s.env.get("TRITON_CACHE_AUTOTUNING") for s in plan.sessions}
        assert cached == ({"1"} if policy is AutotunePolicy.CACHED else {None})
    check = plan_check("builtin", _gpus(2), CheckOptions(autotune=AutotunePolicy.FULL))
    assert {s.params["autotune"] for _, p in check for s in p.specs} == {"full"}


# --------------------------------------------------------------------------------------------
# run_scan: one round's sessions at once, the report in plan order
# --------------------------------------------------------------------------------------------


class _FakeSessions:
    """``run_session`` without children: each session's specs pass. The sessions of a round meet
    at a barrier (so the round can end only if they ran at the same time), and inside a round
    the later sessions finish first (each waits for the one after it), so completion order is
    the reverse of plan order."""

    def __init__(self, plan: ScanPlan) -> None:
        self.plan = plan
        self.log: list[tuple[str, str]] = []  # ("start" | "end", session label), as they happened
        self.lock = threading.Lock()
        self.barriers = {r[0].round: threading.Barrier(len(r)) for r in plan.rounds}
        self.done = {s.label: threading.Event() for s in plan.sessions}
        self.session_of = {spec.probe_id: s for s in plan.sessions for spec in s.specs}

    def __call__(
        self, specs: Any, *, base_env: Any, log_dir: Path, on_event: Any = None, stop_after: Any = None
    ) -> list[Outcome]:
        session = self.session_of[specs[0].probe_id]
        with self.lock:
            self.log.append(("start", session.label))
        self.barriers[session.round].wait(timeout=60)  # BrokenBarrierError: not run at once
        if on_event is not None:  # every session of the round reports at the same moment
            on_event(Event(kind=EventKind.CRUMB, probe_id=specs[0].probe_id, phase=Phase.LAUNCH))
        siblings = [s for s in self.plan.sessions if s.round == session.round]
        later = siblings[siblings.index(session) + 1 :]
        if later:
            assert self.done[later[0].label].wait(timeout=60)
        out = []
        for spec in specs:
            outcome = Outcome(probe_id=spec.probe_id, spec=spec, status=Status.PASS, phase=Phase.DONE)
            if on_event is not None:
                on_event(Event(kind=EventKind.OUTCOME, probe_id=spec.probe_id, outcome=outcome))
            out.append(outcome)
        with self.lock:
            self.log.append(("end", session.label))
        self.done[session.label].set()
        return out


def test_run_scan_runs_a_round_at_once_and_reports_in_plan_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = plan_scan("builtin", _gpus(4), ScanOptions(conditions=frozenset({Condition.GUARDED, Condition.PEER})))
    fake = _FakeSessions(plan)
    monkeypatch.setattr(scan_workflow, "run_session", fake)
    monkeypatch.setattr(scan_workflow, "find_compute_sanitizer", lambda: None)
    busy = threading.Lock()
    overlapped: list[str] = []
    seen: list[str] = []

    def on_event(event: Event) -> None:  # the CLI's progress bar: never entered twice at once
        if not busy.acquire(blocking=False):
            overlapped.append(str(event.probe_id))
            return
        try:
            if event.kind is EventKind.OUTCOME:
                seen.append(str(event.probe_id))
            else:
                time.sleep(0.2)  # a sibling session's report, unless the scan holds it back
        finally:
            busy.release()

    progress: list[tuple[str, ...]] = []
    report = run_scan(
        plan, gpus=(0, 1, 2, 3), log_dir=tmp_path, on_event=on_event, on_progress=lambda r: progress.append(r.not_run)
    )
    assert [o.probe_id for o in report.outcomes] == [s.probe_id for s in plan.specs]  # plan order
    assert overlapped == [] and sorted(seen) == sorted(s.probe_id for s in plan.specs)
    # within a round the later session ended first; no round started before the last one ended
    for number, sessions in enumerate(plan.rounds):
        ends = [fake.log.index(("end", s.label)) for s in sessions]
        assert ends == sorted(ends, reverse=True)
        if number + 1 < len(plan.rounds):
            starts_next = [fake.log.index(("start", s.label)) for s in plan.rounds[number + 1]]
            assert max(ends) < min(starts_next)
    # a report after every round but the last, each listing the sessions still to run
    assert len(progress) == len(plan.rounds) - 1
    assert progress[0] == tuple(s.label for r in plan.rounds[1:] for s in r)
    assert report.complete and report.healthy and report.coverage is not None


def test_a_kernel_that_cannot_be_used_stops_the_sessions_beside_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = plan_scan("builtin", _gpus(4), ScanOptions(conditions=frozenset({Condition.GUARDED})))
    first, second = plan.rounds[0]
    stopped: list[str] = []
    second_running = threading.Event()

    def run_session(
        specs: Any, *, base_env: Any, log_dir: Path, on_event: Any = None, stop_after: Any = None
    ) -> list[Outcome]:
        spec = specs[0]
        if spec.probe_id == first.specs[0].probe_id:
            assert second_running.wait(timeout=60)  # both at once: the second must be stopped
            broken = Outcome(
                probe_id=spec.probe_id,
                spec=spec,
                status=Status.ERROR,
                phase=Phase.IMPORT,
                error_kind=ErrorKind.KERNEL_IMPORT,
                error_message="No module named 'nowhere'",
            )
            on_event(Event(kind=EventKind.OUTCOME, probe_id=spec.probe_id, outcome=broken))
        second_running.set()
        for _ in range(6000):  # the other session: events until the scan stops it
            try:
                on_event(Event(kind=EventKind.CRUMB, probe_id=spec.probe_id, phase=Phase.LAUNCH))
            except Exception:
                stopped.append(spec.probe_id)
                raise
            time.sleep(0.01)
        raise AssertionError("never stopped")

    monkeypatch.setattr(scan_workflow, "run_session", run_session)
    monkeypatch.setattr(scan_workflow, "find_compute_sanitizer", lambda: None)
    with pytest.raises(KernelUnusable, match="nowhere"):
        run_scan(plan, gpus=(0, 1, 2, 3), log_dir=tmp_path)
    assert stopped == [second.specs[0].probe_id]
