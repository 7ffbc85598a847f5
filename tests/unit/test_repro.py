"""`qmoe-doctor repro` on the CPU: planning, the shrink ladder and its stop rule (a fake
``run_session``, no child), verdict and minimal-probe selection, the sanitizer decision and
confirmation (our recorded H200 memcheck logs), script rendering, the CLI's usage errors, and
the pipeline probe's helpers (and the probe itself under the Triton interpreter)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import py_compile
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from qmoe_doctor.cli import devices
from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.commands import repro as repro_cmd
from qmoe_doctor.core import knobs
from qmoe_doctor.core.events import Event, EventKind, OnEvent
from qmoe_doctor.core.options import ReproOptions
from qmoe_doctor.core.records import (
    Condition,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Shape,
    Status,
    TensorInfo,
    from_json,
    to_json,
)
from qmoe_doctor.core.reports import ReproReport, SanitizerConfirmation
from qmoe_doctor.diagnose.repro_rules import (
    minimal_failures,
    pick_verdict,
    sanitizer_decision,
    stop_reason,
    summarize_pipeline,
)
from qmoe_doctor.isolate.one_shot import CommandResult
from qmoe_doctor.isolate.worker_pool import run_session
from qmoe_doctor.machine.inventory import GpuInfo, Inventory
from qmoe_doctor.machine.sanitizer import SanitizerInfo
from qmoe_doctor.plan.repro import ReproPlan, plan_repro
from qmoe_doctor.reports.repro_script import (
    SCRIPT_CONDITIONS,
    UnsupportedCondition,
    render_script,
    script_kernel_ref,
    script_name,
)
from qmoe_doctor.workflows.repro import confirm_with_sanitizer, report_json, run_repro

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "sanitizer" / "2026-11-22-2xh200-7ada31c"
runner = CliRunner()


@dataclass(frozen=True)
class FakeGpu:
    index: int
    uuid: str


GPUS = (FakeGpu(0, "GPU-aaaa"), FakeGpu(1, "GPU-bbbb"))
KERNEL = "specimen:unguarded"


# ---------------------------------------------------------------------------------------------
# Synthetic outcomes and a fake session runner
# ---------------------------------------------------------------------------------------------


def outcome(spec: ProbeSpec, status: Status, **fields: Any) -> Outcome:
    fields = {"phase": Phase.DONE, **fields}
    return Outcome(probe_id=spec.probe_id, spec=spec, status=status, **fields)


def ok(ms: float | None = None) -> Callable[[ProbeSpec], Outcome]:
    return lambda s: outcome(s, Status.PASS, rel_error=1.7e-3, tolerance=1e-2, kernel_ms=ms)


def wrong(err: float = 0.5, **fields: Any) -> Callable[[ProbeSpec], Outcome]:
    return lambda s: outcome(s, Status.WRONG, rel_error=err, tolerance=1e-2, **fields)


def error(kind: ErrorKind, message: str = "boom", **fields: Any) -> Callable[[ProbeSpec], Outcome]:
    fields.setdefault("phase", Phase.SYNC)
    return lambda s: outcome(
        s, Status.ERROR, error_kind=kind, error_type="RuntimeError", error_message=message, **fields
    )


def pipeline_wrong(layer: int, device: str) -> Callable[[ProbeSpec], Outcome]:
    first = {
        "step": 0,
        "layer": layer,
        "device": device,
        "stage": "forward",
        "what": "wrong",
        "rel_error": 0.5,
        "tolerance": 0.02,
    }
    facts = {"pipeline.placement": [0, 0, 1, 1], "pipeline.first_failure": first}
    return lambda s: outcome(s, Status.WRONG, rel_error=0.5, tolerance=0.02, facts=facts)


def pipeline_ok() -> Callable[[ProbeSpec], Outcome]:
    facts = {"pipeline.placement": [0, 0, 1, 1], "pipeline.first_failure": None}
    return lambda s: outcome(s, Status.PASS, rel_error=3e-3, tolerance=0.02, facts=facts)


class FakeSessions:
    """Stands in for isolate.run_session: outcomes from a table keyed by condition, reported
    through on_event as the real one does (so the engine's stop rule works)."""

    def __init__(self, table: Mapping[Condition, Callable[[ProbeSpec], Outcome]]) -> None:
        self.table = dict(table)
        self.sessions: list[list[str]] = []  # probe ids each session ran (until the stop rule said enough)
        self.envs: list[dict[str, str]] = []

    def __call__(
        self,
        specs: Sequence[ProbeSpec],
        *,
        base_env: Mapping[str, str],
        log_dir: Path,
        on_event: OnEvent | None = None,
    ) -> list[Outcome]:
        ran: list[str] = []
        self.sessions.append(ran)
        self.envs.append(dict(base_env))
        out = []
        for spec in specs:
            ran.append(spec.probe_id)
            o = self.table.get(spec.condition, ok())(spec)
            out.append(o)
            if on_event is not None:
                on_event(Event(kind=EventKind.OUTCOME, probe_id=spec.probe_id, outcome=o))
        return out


def repro(
    table: Mapping[Condition, Callable[[ProbeSpec], Outcome]],
    tmp_path: Path,
    *,
    gpus: Sequence[FakeGpu] = GPUS,
    sanitizer: SanitizerInfo | None = None,
    command_runner: Any = None,
    opts: ReproOptions | None = None,
) -> tuple[ReproReport, FakeSessions]:
    opts = opts or ReproOptions()
    plan = plan_repro(KERNEL, gpus, opts)
    fake = FakeSessions(table)
    kwargs: dict[str, Any] = {}
    if command_runner is not None:
        kwargs["command_runner"] = command_runner
    report = run_repro(
        plan,
        opts,
        gpus,
        log_dir=tmp_path / "logs",
        out_dir=tmp_path / "out",
        session_runner=fake,
        find_sanitizer=lambda: sanitizer,
        **kwargs,
    )
    return report, fake


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def test_plan_runs_the_pair_cells_before_the_pipeline_in_one_child() -> None:
    plan = plan_repro(KERNEL, GPUS)
    assert [s.probe_id for s in plan.first_session] == [
        "0->1/guarded",
        "0->1/no-peer",
        "0->1/peer",  # their preconditions do not survive the pipeline
        "pipeline",
        "0->1/producer-race",
        "0->1/sizes-race",
        "GPU 1/side-stream",
        "GPU 1/negative-sizes",
        "GPU 1/over-routed",
    ]
    assert not any(s.fresh_process or s.env for s in plan.first_session)  # one warm child
    assert plan.env[knobs.CUDA_VISIBLE_DEVICES] == "GPU-aaaa,GPU-bbbb"
    p = plan.pipeline
    assert p.condition is Condition.PIPELINE and p.current == 0
    assert p.params["layers"] == 4 and p.params["devices"] == [0, 1] and p.params["preset"] == "tiny"
    # the shrink probes use a real shape: a remote launch is only measurably slower there
    guarded = plan.first_session[0]
    assert (guarded.shape.m, guarded.shape.e, guarded.shape.n, guarded.shape.k) == (4096, 128, 1536, 2048)
    assert (guarded.device, guarded.current) == (1, 0)


def test_plan_over_three_gpus_spans_them_all_and_ladders_the_first_pair() -> None:
    gpus = (*GPUS, FakeGpu(5, "GPU-cccc"))
    plan = plan_repro(KERNEL, gpus, ReproOptions(layers=6))
    assert plan.pipeline.params["devices"] == [0, 1, 2] and plan.pipeline.params["layers"] == 6
    assert plan.gpu_of_ordinal == {0: 0, 1: 1, 2: 5}
    assert plan.first_session[0].probe_id == "0->1/guarded"


@pytest.mark.parametrize(("gpus", "opts"), [(GPUS[:1], ReproOptions()), (GPUS, ReproOptions(layers=1))])
def test_plan_refuses_what_cannot_span_two_gpus(gpus: Sequence[FakeGpu], opts: ReproOptions) -> None:
    with pytest.raises(ValueError):
        plan_repro(KERNEL, gpus, opts)


# ---------------------------------------------------------------------------------------------
# The shrink: stop rule, verdict, minimal probe (fake run_session)
# ---------------------------------------------------------------------------------------------

UNGUARDED = {
    Condition.GUARDED: ok(0.32),
    Condition.NO_PEER: error(
        ErrorKind.POINTER_INACCESSIBLE, "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"
    ),
    Condition.PEER: ok(3.9),  # 12x: ran remotely
    Condition.PIPELINE: pipeline_wrong(2, "cuda:1"),
    Condition.PRODUCER_RACE: wrong(0.5),
    Condition.SIZES_RACE: error(
        ErrorKind.ILLEGAL_ADDRESS, "CUDA error: an illegal memory access was encountered"
    ),
}


def test_unguarded_verdict_right_after_the_pipeline_in_one_child(tmp_path: Path) -> None:
    report, fake = repro(UNGUARDED, tmp_path)
    assert len(fake.sessions) == 1  # one child: the cheapest path to the verdict
    assert report.tried == ("0->1/guarded", "0->1/no-peer", "0->1/peer", "pipeline")
    assert report.stop == "verdict"
    assert report.verdict == "missing-device-guard"
    assert report.minimal[0] == "0->1/no-peer"
    assert report.reproduced and report.faulty
    assert report.pipeline is not None and (report.pipeline.layer, report.pipeline.gpu) == (2, 1)
    # pointer-inaccessible is raised on the host: memcheck has nothing to see
    assert report.sanitizer.status == "not-run" and "host" in report.sanitizer.reason
    assert report.script is not None and Path(report.script).name == "qmoe-repro-missing-device-guard.py"
    py_compile.compile(report.script, doraise=True)
    assert "CONDITION = 'no-peer'" in Path(report.script).read_text()


def test_race_stops_at_the_first_race_cell_and_explains_why_memcheck_is_blind(tmp_path: Path) -> None:
    table = {**UNGUARDED, Condition.NO_PEER: ok(), Condition.PEER: ok(0.33)}  # guarded, but racing
    report, fake = repro(table, tmp_path)
    assert report.tried[-1] == "0->1/producer-race" and report.stop == "verdict"
    assert report.verdict == "cross-device-stream-race"
    assert report.minimal == ("0->1/producer-race",)
    assert report.sanitizer.status == "not-run" and "0 errors" in report.sanitizer.reason


def test_access_fault_is_confirmed_under_memcheck_with_the_recorded_log(tmp_path: Path) -> None:
    table = {**UNGUARDED, Condition.NO_PEER: ok(), Condition.PEER: ok(0.33), Condition.PRODUCER_RACE: ok()}
    info = SanitizerInfo(path="/usr/local/cuda/bin/compute-sanitizer", version="2025.3.1.0", found_via="PATH")
    calls: list[tuple[list[str], dict[str, str]]] = []
    fake_run = recorded_memcheck_runner("memcheck-unmasked-overrouted-nocache", calls)
    report, _ = repro(table, tmp_path, sanitizer=info, command_runner=fake_run)
    assert report.verdict == "cross-device-stream-race" and report.minimal == ("0->1/sizes-race",)
    s = report.sanitizer
    assert s.status == "confirmed" and s.errors == 450 and s.probe_id == "0->1/sizes-race"
    assert s.first_error is not None and "unmasked_rows.py:111" in s.first_error
    ((argv, env),) = calls
    assert argv[:3] == [info.path, "--tool", "memcheck"] and "qmoe_doctor.probes.run_one" in argv
    assert env[knobs.PYTORCH_NO_CUDA_MEMORY_CACHING] == "1"  # the allocator hides OOB in a pool
    assert env[knobs.CUDA_VISIBLE_DEVICES] == "GPU-aaaa,GPU-bbbb"
    spec = from_json(ProbeSpec, argv[-1])
    assert spec.condition is Condition.SIZES_RACE and spec.probe_id.endswith("+memcheck")
    assert report.script is not None and "CONDITION = 'sizes-race'" in Path(report.script).read_text()


def test_guarded_failure_moves_to_the_single_device_ladder_in_a_fresh_child(tmp_path: Path) -> None:
    table = {
        Condition.GUARDED: wrong(0.7),
        Condition.PIPELINE: pipeline_wrong(0, "cuda:0"),
        Condition.REPEAT_CALL: lambda s: outcome(
            s, Status.WRONG, rel_error=0.9, tolerance=1e-2, calls_rel_error=(0.9, 1.7e-3)
        ),
    }
    report, fake = repro(table, tmp_path)
    assert len(fake.sessions) == 2
    assert fake.sessions[0][-1] == "pipeline"  # child 1 stopped once the pipeline had run
    assert fake.sessions[1][0] == "GPU 1/repeat-call"  # the process's first kernel call
    assert report.verdict == "autotune-inplace-rerun" and report.stop == "verdict"
    assert report.minimal == ("GPU 1/repeat-call",)
    assert any("needs no second GPU" in n for n in report.notes)


def test_nothing_failed_stops_after_the_pipeline_and_lists_what_was_tried(tmp_path: Path) -> None:
    report, fake = repro(
        {Condition.PIPELINE: pipeline_ok(), Condition.GUARDED: ok(0.3), Condition.PEER: ok(0.31)}, tmp_path
    )
    assert report.stop == "nothing-failed" and not report.faulty and report.verdict is None
    assert report.tried == ("0->1/guarded", "0->1/no-peer", "0->1/peer", "pipeline")
    assert report.script is None and report.sanitizer.status == "not-run"
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_pipeline_failure_on_a_third_gpu_gets_that_pair_its_own_ladder(tmp_path: Path) -> None:
    gpus = (*GPUS, FakeGpu(5, "GPU-cccc"))
    table = {
        **UNGUARDED,
        Condition.PIPELINE: pipeline_wrong(4, "cuda:2"),
        Condition.NO_PEER: ok(),
        Condition.PEER: ok(0.33),
    }
    report, fake = repro(table, tmp_path, gpus=gpus, opts=ReproOptions(layers=6))
    assert len(fake.sessions) == 2
    assert fake.sessions[1][0] == "0->5/guarded"
    assert fake.envs[1][knobs.CUDA_VISIBLE_DEVICES] == "GPU-aaaa,GPU-cccc"
    assert report.pair == (0, 5)


def test_kernel_that_does_not_import_is_unusable(tmp_path: Path) -> None:
    from qmoe_doctor.workflows.scan import KernelUnusable

    with pytest.raises(KernelUnusable, match="no module"):
        repro({Condition.GUARDED: error(ErrorKind.KERNEL_IMPORT, "no module named 'mykern'")}, tmp_path)


@pytest.mark.parametrize("faulty", [False, True])
def test_probe_logs_are_removed_when_nothing_failed_and_kept_otherwise(
    faulty: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where the repro's own log folder goes
    table = {Condition.PEER: wrong()} if faulty else {}
    opts = ReproOptions()
    report = run_repro(
        plan_repro(KERNEL, GPUS, opts), opts, GPUS, out_dir=tmp_path / "out", session_runner=FakeSessions(table),
        find_sanitizer=lambda: None,
    )
    kept = list(tmp.glob("qmoe-repro-*"))
    assert report.faulty is faulty
    assert (report.log_dir, kept) == ((str(kept[0]), kept) if faulty else ("", []))


def test_children_that_never_start_mean_could_not_run(tmp_path: Path) -> None:
    dead = error(ErrorKind.OTHER, "worker 1 exited with status 1 before it was ready", phase=Phase.SPAWN)
    report, _ = repro(dict.fromkeys(Condition, dead), tmp_path)
    assert report.could_not_run


def test_json_report_is_versioned_and_round_trips(tmp_path: Path) -> None:
    report, _ = repro(UNGUARDED, tmp_path)
    body = json.loads(json.dumps(report_json(report), allow_nan=True))
    assert body["schema_version"] == 1 and body["verdict"] == "missing-device-guard"
    assert body["reproduced"] is True and body["pipeline"]["layer"] == 2
    assert [s["name"] for s in body["stages"]][0] == "pipeline and pair ladder"


def test_stop_rule_waits_for_the_pipeline() -> None:
    plan = plan_repro(KERNEL, GPUS)
    early = [UNGUARDED[s.condition](s) for s in plan.first_session[:3]]
    names = plan.ladder.names
    assert stop_reason(early, kernel=KERNEL, names=names) is None  # a verdict, but no repro yet
    with_pipe = [*early, UNGUARDED[Condition.PIPELINE](plan.pipeline)]
    assert stop_reason(with_pipe, kernel=KERNEL, names=names) == "verdict"


def test_pick_verdict_prefers_confidence_then_the_earliest_evidence() -> None:
    from qmoe_doctor.core.records import Confidence, Diagnosis, Evidence

    def diag(cause: str, conf: Confidence, pid: str) -> Diagnosis:
        ev = Evidence(probe_id=pid, condition=Condition.PEER, label="wrong", detail="")
        return Diagnosis(cause=cause, confidence=conf, summary="", evidence=(ev,))

    order = ["0->1/guarded", "0->1/no-peer", "0->1/peer", "pipeline", "0->1/producer-race"]
    late = diag("cross-device-stream-race", Confidence.HIGH, "0->1/producer-race")
    early = diag("missing-device-guard", Confidence.HIGH, "0->1/no-peer")
    medium = diag("default-device-buffer", Confidence.MEDIUM, "0->1/guarded")
    assert pick_verdict([late, medium, early], order) is early
    assert pick_verdict([], order) is None
    plan = plan_repro(KERNEL, GPUS)
    outs = [UNGUARDED[s.condition](s) for s in plan.first_session[:3]]
    assert [o.probe_id for o in minimal_failures(outs, None)] == ["0->1/no-peer"]


def test_pipeline_summary_places_a_crash_from_its_breadcrumb() -> None:
    spec = plan_repro(KERNEL, GPUS).pipeline
    crashed = outcome(
        spec,
        Status.ERROR,
        error_kind=ErrorKind.ILLEGAL_ADDRESS,
        error_message="CUDA error: an illegal memory access",
        phase=Phase.SYNC,
        facts={
            "pipeline.placement": [0, 0, 1, 1],
            "pipeline.at": {"step": 1, "layer": None, "stage": "sync", "device": None},
        },
    )
    s = summarize_pipeline(crashed, {0: 3, 1: 7})
    assert s.failed and s.step == 1 and s.stage == "sync" and s.what == "illegal-address"
    assert s.layer_gpus == (3, 3, 7, 7)
    assert "asynchronous" in s.describe()


# ---------------------------------------------------------------------------------------------
# Sanitizer: the decision and the confirmation
# ---------------------------------------------------------------------------------------------

INFO = SanitizerInfo(path="/opt/cuda/bin/compute-sanitizer", version="2025.3.1.0", found_via="PATH")
SPEC = plan_repro(KERNEL, GPUS).ladder.pair[Condition.SIZES_RACE]


@pytest.mark.parametrize(
    ("make", "info", "enabled", "runs", "words"),
    [
        (error(ErrorKind.ILLEGAL_ADDRESS), INFO, True, True, "memcheck"),
        (error(ErrorKind.SIGNAL), INFO, True, True, "signal"),
        (wrong(0.0, canary_hits=("after y",)), INFO, True, True, "canary"),
        (error(ErrorKind.ILLEGAL_ADDRESS), None, True, False, "not found"),
        (error(ErrorKind.ILLEGAL_ADDRESS), INFO, False, False, "--no-sanitizer"),
        (wrong(0.5), INFO, True, False, "0 errors"),
        (error(ErrorKind.POINTER_INACCESSIBLE), INFO, True, False, "on the host"),
        (error(ErrorKind.DEVICE_ASSERT), INFO, True, False, "TRITON_DEBUG"),
        (error(ErrorKind.TIMEOUT), INFO, True, False, "hung"),
    ],
)
def test_sanitizer_decision(
    make: Callable[[ProbeSpec], Outcome], info: SanitizerInfo | None, enabled: bool, runs: bool, words: str
) -> None:
    d = sanitizer_decision([make(SPEC)], info, enabled=enabled)
    assert d.run is runs
    assert words in d.reason


def test_sanitizer_decision_confirms_the_first_access_fault_among_the_minimal_probes() -> None:
    plan = plan_repro(KERNEL, GPUS)
    race = wrong(0.5)(plan.ladder.pair[Condition.PRODUCER_RACE])
    fault = error(ErrorKind.ILLEGAL_ADDRESS)(SPEC)
    d = sanitizer_decision([race, fault], INFO)
    assert d.run and d.target is fault
    assert sanitizer_decision([], INFO).run is False


def recorded_memcheck_runner(
    name: str, calls: list[tuple[list[str], dict[str, str]]] | None = None, extra: Sequence[TensorInfo] = ()
) -> Callable[[Sequence[str], Mapping[str, str], float], CommandResult]:
    """Plays back a recorded run: the log goes where --log-file says, the probe's outcome (its
    tensor table) comes out on stdout behind the run_one marker."""

    def run(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> CommandResult:
        if calls is not None:
            calls.append((list(argv), dict(env)))
        log = Path(argv[list(argv).index("--log-file") + 1])
        log.write_text((RECORDED / f"{name}.log").read_text())
        recorded = from_json(Outcome, (RECORDED / f"{name}.stdout").read_text().strip().splitlines()[-1])
        recorded = dataclasses.replace(recorded, tensors=recorded.tensors + tuple(extra))
        return CommandResult(
            returncode=0,
            stdout="probe chatter\nQMOE-OUTCOME " + to_json(recorded) + "\n",
            stderr="",
            wall_s=6.6,
        )

    return run


def _confirm(name: str, tmp_path: Path, extra: Sequence[TensorInfo] = ()) -> SanitizerConfirmation:
    target = error(ErrorKind.ILLEGAL_ADDRESS)(SPEC)
    return confirm_with_sanitizer(
        target,
        INFO,
        base_env={},
        gpu_of_ordinal={0: 0, 1: 1},
        log_dir=tmp_path,
        runner=recorded_memcheck_runner(name, extra=extra),
    )


def test_confirmation_attributes_the_write_past_y(tmp_path: Path) -> None:
    # the recorded probe registered x, w and m_sizes; run_one adds the kernel's outputs (y#N):
    # the allocation memcheck measured against (0x7f7cc49a0000, 131,072 bytes) is y
    y = TensorInfo(
        name="y#1",
        device="cuda:0",
        data_ptr=0x7F7CC49A0000,
        nbytes=131072,
        shape=(256, 256),
        strides=(256, 1),
        dtype="bfloat16",
    )
    c = _confirm("memcheck-unmasked-overrouted-nocache", tmp_path, extra=(y,))
    assert c.status == "confirmed" and c.errors == 450
    assert c.touched is not None and c.touched.startswith(
        "write 0 bytes after the 131,072-byte region of y#1 (256 x 256 bf16) on cuda:0 (GPU 0)"
    )
    assert c.sanitized_status == "error"
    assert sum(c.tensors_hit.values()) == 50  # every printed address placed
    assert c.log_path is not None and Path(c.log_path).is_file()


def test_confirmation_says_when_the_nearest_tensor_is_only_a_guess(tmp_path: Path) -> None:
    # without y in the table, the nearest known tensor (w) is far from the allocation memcheck named
    c = _confirm("memcheck-unmasked-overrouted-nocache", tmp_path)
    assert c.status == "confirmed" and c.touched is not None
    assert "holds none of the probe's tensors" in c.touched


def test_confirmation_of_a_clean_run_says_the_fault_did_not_recur(tmp_path: Path) -> None:
    c = _confirm("memcheck-builtin-clean", tmp_path)
    assert c.status == "clean" and c.errors == 0 and "did not recur" in c.reason


def test_confirmation_when_the_sanitizer_writes_nothing(tmp_path: Path) -> None:
    def broken(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> CommandResult:
        return CommandResult(returncode=None, stdout="", stderr="killed\n", wall_s=300.0)

    c = confirm_with_sanitizer(
        error(ErrorKind.ILLEGAL_ADDRESS)(SPEC),
        INFO,
        base_env={},
        gpu_of_ordinal={},
        log_dir=tmp_path,
        runner=broken,
    )
    assert c.status == "failed" and "timed out" in c.reason


def test_run_one_prints_the_outcome_line_for_a_selftest() -> None:
    import subprocess

    spec = ProbeSpec(
        probe_id="st", kernel="builtin", condition=Condition.SELFTEST_OK, shape=Shape(m=1, e=1, n=1, k=1)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor.probes.run_one", to_json(spec)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("QMOE-OUTCOME ")][-1]
    assert from_json(Outcome, line.removeprefix("QMOE-OUTCOME ")).status is Status.PASS


def test_run_one_registers_the_kernels_outputs_for_attribution() -> None:
    from qmoe_doctor.probes import conditions, run_one

    spec = ProbeSpec(
        probe_id="CPU/single",
        kernel="builtin",
        condition=Condition.SINGLE,
        shape=Shape(m=40, e=4, n=24, k=32, dtype="float32"),
    )
    o = from_json(Outcome, run_one.run(spec))
    assert o.status is Status.PASS
    names = [t.name for t in o.tensors]
    assert names[:3] == ["x", "w", "m_sizes"] and "y#1" in names
    y = next(t for t in o.tensors if t.name == "y#1")
    assert (y.shape, y.nbytes) == ((40, 24), 40 * 24 * 4)
    assert conditions.load_kernel.__name__ == "load_kernel"  # the probe module is left as it was


# ---------------------------------------------------------------------------------------------
# Scripts
# ---------------------------------------------------------------------------------------------


def _spec_for(cond: Condition) -> ProbeSpec:
    pair = cond.is_pair
    shape = Shape(
        m=40,
        e=4,
        n=24,
        k=32,
        dtype="float32",
        routing="uniform" if cond in (Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES) else "random",
    )
    return ProbeSpec(
        probe_id=f"x/{cond.value}",
        kernel=KERNEL,
        condition=cond,
        device=1,
        current=0 if pair else 1,
        shape=shape,
        seed=3,
    )


@pytest.mark.parametrize("cond", sorted(SCRIPT_CONDITIONS, key=lambda c: c.value), ids=lambda c: c.value)
def test_script_renders_compiles_and_its_cpu_parts_run(cond: Condition, tmp_path: Path) -> None:
    spec = _spec_for(cond)
    src = render_script(
        spec, cause="missing-device-guard", cause_title="t", gpus=(0, 1), cuda_visible_devices="GPU-a,GPU-b"
    )
    compile(src, script_name("missing-device-guard", cond), "exec")
    import ast

    top = {
        (n.module if isinstance(n, ast.ImportFrom) else alias.name).split(".")[0]
        for n in ast.parse(src).body
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for alias in n.names
    }
    assert top <= {"__future__", "importlib", "math", "sys", "time", "pathlib", "torch", "triton"}, top
    path = tmp_path / "repro.py"
    path.write_text(src)
    py_compile.compile(str(path), doraise=True)
    # import it (not as __main__) and run what runs on a CPU
    namespace: dict[str, Any] = {"__name__": "repro_under_test"}
    exec(compile(src, str(path), "exec"), namespace)
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch
    from qmoe_doctor.kernels.routing import routing_sizes

    probe_rows = routing_sizes(spec.shape.routing, spec.shape.m, spec.shape.e, seed=spec.seed)
    assert namespace["SIZES"] == probe_rows  # same rows as the probe
    x, w, m_sizes = namespace["make_operands"](torch.device("cpu"))
    ref = namespace["reference"](x, w, namespace["SIZES"])
    assert torch.allclose(ref, moe_grouped_gemm_torch(x, w, m_sizes, out_dtype=torch.float32))
    kernel = namespace["load_kernel"](namespace["KERNEL"])
    assert callable(kernel)
    # the producer waits as long as in the probe, behind the same global-timer spin
    from qmoe_doctor.probes import conditions, stream_hold

    assert namespace["HOLD_S"] == conditions.HOLD_S
    assert namespace["FALLBACK_HZ"] == stream_hold.FALLBACK_HZ
    assert (namespace["_hold"] is None) == (stream_hold._hold is None)
    if stream_hold._hold is not None:  # the same spin, restated so the script stands alone

        def body(kernel: Any) -> list[str]:  # the lines after the def line
            lines = [line.strip() for line in inspect.getsource(kernel.fn).splitlines()]
            return lines[next(i for i, line in enumerate(lines) if line.startswith("def ")) + 1 :]

        assert body(namespace["_hold"]) == body(stream_hold._hold)
    if not torch.cuda.is_available():
        assert namespace["main"]() == 2  # SKIP: no GPU here, said plainly


def test_script_reference_masks_negative_and_over_routed_counts() -> None:
    src = render_script(_spec_for(Condition.NEGATIVE_SIZES))
    ns: dict[str, Any] = {"__name__": "t"}
    exec(src, ns)
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch

    x, w, _ = ns["make_operands"](torch.device("cpu"))
    for sizes in ([-1, 21, 10, 10], [10, 10, 10, 74]):
        m = torch.tensor(sizes, dtype=torch.int32)
        assert torch.allclose(
            ns["reference"](x, w, sizes), moe_grouped_gemm_torch(x, w, m, out_dtype=torch.float32)
        )


@pytest.mark.parametrize(
    "cond", [Condition.PIPELINE, Condition.OFFSETS, Condition.LAUNCH_CONFIG, Condition.SELFTEST_OK]
)
def test_script_refuses_conditions_without_a_template(cond: Condition) -> None:
    with pytest.raises(UnsupportedCondition):
        render_script(_spec_for(cond))


def test_script_kernel_refs(tmp_path: Path) -> None:
    assert script_kernel_ref("builtin") == ("qmoe_doctor.kernels.grouped_gemm:moe_grouped_gemm", False)
    assert script_kernel_ref("specimen:unguarded") == (
        "qmoe_doctor.kernels.specimens.unguarded:moe_grouped_gemm",
        False,
    )
    assert script_kernel_ref("pkg.mod:fn") == ("pkg.mod:fn", False)
    assert script_kernel_ref("adapter:vllm")[1] is True
    ref, _ = script_kernel_ref("rel/k.py:fn")
    assert Path(ref.rpartition(":")[0]).is_absolute()
    assert script_name(None, Condition.PEER) == "qmoe-repro-peer.py"


def test_script_docstring_survives_odd_kernel_paths() -> None:
    spec = dataclasses.replace(_spec_for(Condition.PEER), kernel='we"""ird\\dir/k.py:fn')
    compile(render_script(spec), "odd.py", "exec")


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _gpu(i: int) -> GpuInfo:
    return GpuInfo(index=i, name="NVIDIA H200", uuid=f"GPU-{i:04d}", pci_bus_id=f"00000000:0{i}:00.0")


def _inventory(n: int) -> Inventory:
    return Inventory(
        gpus=tuple(_gpu(i) for i in range(n)), nvml_error=None if n else "NVML Shared Library Not Found"
    )


@pytest.mark.parametrize(
    ("n", "args", "needle"),
    [
        (0, [], "needs two CUDA GPUs"),
        (0, [], "scan --cpu"),
        (1, [], "1 GPU(s) visible to NVML"),
        (1, [], "`qmoe-doctor scan` runs the single-GPU conditions"),
        (2, ["--gpus", "1"], "1 GPU(s) selected by --gpus 1"),
        (2, ["--gpus", "0,x"], "not a GPU index"),
        (2, ["--gpus", "0,7"], "no GPU 7"),
        (2, ["--kernel", "specimen:nope"], "nope"),
        (2, ["--preset", "gpt5"], "unknown preset"),
        (2, ["--layers", "1"], "--layers"),
        (3, ["--gpus", "0,1,2", "--layers", "2"], "cannot span 3 GPUs"),
    ],
)
def test_usage_errors_exit_2(n: int, args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "collect_inventory", lambda: _inventory(n))
    monkeypatch.setattr(repro_cmd, "run_repro", lambda *a, **k: pytest.fail("must not run"))
    result = runner.invoke(app, ["repro", *args])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split())


@pytest.mark.parametrize(("table", "code"), [(UNGUARDED, 1), ({Condition.PIPELINE: pipeline_ok()}, 0)])
def test_command_renders_and_exits(
    table: Mapping[Condition, Callable[[ProbeSpec], Outcome]],
    code: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(devices, "collect_inventory", lambda: _inventory(4))
    real = run_repro

    def fake_run(plan: ReproPlan, opts: ReproOptions, gpus: Sequence[Any], **kw: Any) -> ReproReport:
        assert [g.index for g in gpus] == [0, 1]  # the default: the first two GPUs
        kw["session_runner"] = FakeSessions(table)
        kw["find_sanitizer"] = lambda: None
        return real(plan, opts, gpus, **kw)

    monkeypatch.setattr(repro_cmd, "run_repro", fake_run)
    result = runner.invoke(
        app, ["repro", "--kernel", KERNEL, "--out", str(tmp_path), "--log-dir", str(tmp_path / "l")]
    )
    assert result.exit_code == code, result.output
    text = " ".join(result.stdout.split())
    if code:
        assert "missing-device-guard" in text and "minimal failing probe" in text
        assert (tmp_path / "qmoe-repro-missing-device-guard.py").is_file()
        assert "time to verdict" in text
    else:
        assert "nothing failed: tried 0->1/guarded, 0->1/no-peer, 0->1/peer, pipeline" in text
    result = runner.invoke(
        app, ["repro", "--kernel", KERNEL, "--json", "--out", str(tmp_path), "--log-dir", str(tmp_path / "l")]
    )
    doc = json.loads(result.stdout)
    assert doc["kind"] == "repro" and doc["schema_version"] == 1 and doc["faulty"] is bool(code)


# ---------------------------------------------------------------------------------------------
# The pipeline probe: pure helpers, and the probe itself on the CPU (Triton interpreter)
# ---------------------------------------------------------------------------------------------

from qmoe_doctor.probes import pipeline  # noqa: E402  (child side: imports torch)


@pytest.mark.parametrize(
    ("layers", "n", "expect"),
    [
        (4, 2, [0, 0, 1, 1]),
        (2, 2, [0, 1]),
        (5, 2, [0, 0, 0, 1, 1]),  # the first GPU takes the extra layer, as device_map fills in order
        (6, 3, [0, 0, 1, 1, 2, 2]),
        (3, 1, [0, 0, 0]),
    ],
)
def test_layer_placement(layers: int, n: int, expect: list[int]) -> None:
    assert pipeline.layer_placement(layers, n) == expect


def test_layer_placement_refuses_nothing_to_place() -> None:
    with pytest.raises(ValueError):
        pipeline.layer_placement(0, 2)


def _check(
    step: int, layer: int, out: float = 1e-3, dx: float = 1e-3, dw: float = 1e-3, out_device: str = "cuda:1"
) -> pipeline.LayerCheck:
    return pipeline.LayerCheck(
        step=step,
        layer=layer,
        device="cuda:1",
        out_rel_error=out,
        dx_rel_error=dx,
        dw_rel_error=dw,
        dw_worst="gate_up_proj",
        out_device=out_device,
        tolerance=0.02,
    )


def test_first_failure_is_the_earliest_step_then_layer_and_names_its_stage() -> None:
    assert pipeline.first_failure([_check(0, 0), _check(0, 1)]) is None
    f = pipeline.first_failure([_check(1, 0, out=0.9), _check(0, 3, dw=0.5), _check(0, 2)])
    assert f is not None and (f["step"], f["layer"], f["stage"], f["what"]) == (0, 3, "backward", "wrong")
    g = pipeline.first_failure([_check(0, 1, out_device="cuda:0")])
    assert g is not None and (g["stage"], g["what"]) == ("forward", "misplaced")


def test_rel_error_poisons_nan_and_misshapen_outputs() -> None:
    ref = torch.ones(4, 3)
    assert pipeline.rel_error(ref.clone(), ref) == 0.0
    assert pipeline.rel_error(ref * 1.5, ref) == pytest.approx(0.5)
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert pipeline.rel_error(nan, ref) == float("inf")
    assert pipeline.rel_error(torch.ones(3, 4), ref) == float("inf")
    assert pipeline.rel_error(None, ref) == float("inf")


def test_pipeline_params_are_checked() -> None:
    p = pipeline.PipelineParams.from_params({"devices": [0, 1], "steps": 3})
    assert (p.layers, p.steps, p.preset) == (4, 3, "tiny")
    for bad in (
        {"devices": []},
        {"devices": ["cuda:0"]},
        {"devices": [0], "preset": "gpt5"},
        {"devices": [0], "steps": 0},
    ):
        with pytest.raises(ValueError):
            pipeline.PipelineParams.from_params(bad)


def test_make_block_is_deterministic_from_its_seed() -> None:
    shape = pipeline.get_preset("tiny")
    one = pipeline.make_block(shape, None, torch.device("cpu"), torch.float32, seed=5)
    two = pipeline.make_block(shape, None, torch.device("cpu"), torch.float32, seed=5)
    other = pipeline.make_block(shape, None, torch.device("cpu"), torch.float32, seed=6)
    for (name, a), (_, b), (_, c) in zip(
        one.named_parameters(), two.named_parameters(), other.named_parameters(), strict=True
    ):
        assert torch.equal(a, b) and not torch.equal(a, c), name
        assert abs(float(a.detach().std()) * a.shape[-1] ** 0.5 - 1.0) < 0.2, name  # std = fan_in ** -0.5


def test_block_tolerance_is_twice_the_gemm_tolerance() -> None:
    assert pipeline.block_tolerance("bfloat16") == pytest.approx(2e-2)


CPU_PIPELINE = {"layers": 2, "steps": 1, "devices": [None, None], "tokens": 8, "preset": "tiny"}


def _pipeline_spec(kernel: str) -> ProbeSpec:
    return ProbeSpec(
        probe_id="pipeline",
        kernel=kernel,
        condition=Condition.PIPELINE,
        shape=Shape(m=16, e=8, n=64, k=64, dtype="float32"),
        params=dict(CPU_PIPELINE),
    )


@pytest.mark.slow
def test_pipeline_probe_on_the_cpu_matches_the_twin() -> None:
    from qmoe_doctor.probes.context import ProbeContext

    ctx = ProbeContext(_pipeline_spec("builtin"))
    fields = pipeline.run_probe(ctx)
    assert fields["status"] is Status.PASS, ctx.facts
    assert ctx.facts["pipeline.first_failure"] is None
    assert [r["layer"] for r in ctx.facts["pipeline.results"]] == [0, 1]
    assert all(r["ok"] for r in ctx.facts["pipeline.results"])


WRONG_DOWN_OF_LAYER_1 = '''
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch
calls = []

def fused(x, w, m_sizes):
    """Right for layer 0 (calls 1, 2: gate_up, down); layer 1's down projection (call 4) 1.5x."""
    calls.append(1)
    y = moe_grouped_gemm_torch(x, w, m_sizes)
    return y * 1.5 if len(calls) == 4 else y
'''


@pytest.mark.slow
def test_pipeline_probe_in_a_worker_names_the_first_diverging_layer(tmp_path: Path) -> None:
    src = tmp_path / "bad_kernel.py"
    src.write_text(WRONG_DOWN_OF_LAYER_1)
    env = {knobs.TRITON_INTERPRET: "1", knobs.CUDA_VISIBLE_DEVICES: ""}
    (o,) = run_session([_pipeline_spec(f"{src}:fused")], base_env=env, log_dir=tmp_path / "logs")
    assert o.status is Status.WRONG, (o.error_message, o.stderr_tail)
    first = o.facts["pipeline.first_failure"]
    assert (first["step"], first["layer"], first["stage"]) == (0, 1, "forward")
    assert first["rel_error"] == pytest.approx(0.5, rel=1e-3)
    s = summarize_pipeline(o, {})
    assert s.failed and s.layer == 1 and "first diverged" in s.describe()
