"""Recordings of ``qmoe-doctor run`` on two NVIDIA H100 80GB HBM3 (``nvidia-h100-x2``, 2026-11-25,
commit 2261a74), read again through today's device checks: what each recorded launch shows must
still come out of the rules, one cause per fault.

``reports/run/2026-11-25-2xh100-2261a74/`` holds the reports of
``examples/qwen3_moe_device_map.py --gpus 0,1`` (four layers split over the two GPUs with
``device_map``) under ``qmoe-doctor run``: our kernel (healthy), ``specimen:unguarded``, the same
under ``--strict``, and ``specimen:default_buffer``. ``reports/run/2026-11-25-2xh100-88138dc/`` holds the runs made after the
one-cause rule, the default-stream check and the rank check were added: ``specimen:default_buffer``
again, ``specimen:wrong_stream`` and our kernel with a side stream current on both GPUs, and
``examples/moe_ranks.py`` under torchrun with two ranks, our kernel and
``specimen:rank_no_set_device``. ``tests/fixtures/MANIFEST.md`` gives the commands and versions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recorded_logs import read

from qmoe_doctor.core.launches import FindingKind, Launch, LaunchFacts
from qmoe_doctor.core.records import from_jsonable
from qmoe_doctor.core.reports import RunReport
from qmoe_doctor.diagnose import run_findings
from qmoe_doctor.diagnose.launch_rules import check_launch
from qmoe_doctor.diagnose.stream_rules import wrong_stream

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "tests" / "fixtures" / "reports" / "run" / "2026-11-25-2xh100-2261a74"
LATER = RUNS.parent / "2026-11-25-2xh100-88138dc"
EXAMPLE = "examples/qwen3_moe_device_map.py"


def _report(name: str, folder: Path = RUNS) -> RunReport:
    raw: Any = json.loads(read(folder / name))
    return from_jsonable(RunReport, raw)


def _facts(launch: Launch, local_rank: int | None = None) -> LaunchFacts:
    assert launch.tensors, "a flagged launch keeps its tensors"
    return LaunchFacts(
        seq=launch.seq, kernel=launch.kernel, device=launch.device, tensors=launch.tensors, local_rank=local_rank
    )


def _ring(report: RunReport) -> list[Launch]:
    return [launch for p in report.passes for r in p.processes for launch in r.ring]


def _flagged(report: RunReport) -> list[Launch]:
    return [f.launch for p in report.passes for r in p.processes for f in r.findings if f.launch is not None]


def _peer(a: int, b: int) -> bool:
    return True  # the two H100s of that machine reach each other over NVLink (recorded: peer_access true)


def test_every_recording_is_the_example_over_both_gpus() -> None:
    for name in ("run-ours.json.gz", "run-unguarded.json.gz", "run-unguarded-strict.json", "run-default_buffer.json"):
        report = _report(name)
        assert any(EXAMPLE in arg for arg in report.command) and "0,1" in report.command, report.command
        launches = [*(launch for p in report.passes for r in p.processes for launch in r.ring), *_flagged(report)]
        devices = {t.device for launch in launches for t in launch.tensors}
        assert {"cuda:0", "cuda:1"} <= devices, (name, devices)


def test_our_kernel_over_two_gpus_shows_nothing_again() -> None:
    report = _report("run-ours.json.gz")
    assert report.healthy and report.exit_code == 0
    launches = [launch for p in report.passes for r in p.processes for launch in r.ring]
    assert len(launches) > 50
    for launch in launches:
        assert launch.device in ("cuda:0", "cuda:1")
        if launch.tensors:
            assert check_launch(_facts(launch), _peer) == (), launch
    # every launch on the default stream: the stream check has nothing to say either
    assert wrong_stream(launches) == []


def test_the_unguarded_launch_is_a_missing_guard_with_its_call_site() -> None:
    report = _report("run-unguarded.json.gz")
    (launch, *_) = _flagged(report)
    assert launch.device == "cuda:0" and {t.device for t in launch.tensors} == {"cuda:1"}
    assert launch.call_site is not None and launch.call_site.file.endswith(EXAMPLE)
    found = check_launch(_facts(launch), _peer)
    assert [(f.kind, f.cause) for f in found] == [(FindingKind.OTHER_DEVICE, "missing-device-guard")]
    again = run_findings.diagnoses([r for p in report.passes for r in p.processes])
    assert [d.cause for d in again] == [d.cause for d in report.diagnoses] == ["missing-device-guard"]


def test_strict_stopped_the_program_at_that_launch() -> None:
    report = _report("run-unguarded-strict.json")
    assert report.command_exit == 1
    (process,) = report.passes[0].processes
    assert process.end is not None and process.end.detail.startswith("CrossDeviceLaunchError")
    (finding,) = process.findings
    assert finding.outcome == "stopped" and process.end.seq == finding.first_seq


def test_the_default_buffer_launch_now_gives_one_cause() -> None:
    report = _report("run-default_buffer.json")
    # recorded before the one-cause rule: the same launch under two causes
    assert sorted(d.cause for d in report.diagnoses) == ["default-device-buffer", "missing-device-guard"]
    (launch, *_) = _flagged(report)
    (in_ring,) = [r for p in report.passes for pr in p.processes for r in pr.ring if r.seq == launch.seq]
    assert launch.device == "cuda:1" and in_ring.raised.startswith("ValueError: Pointer argument")
    found = check_launch(_facts(launch), _peer)
    assert [(f.kind, f.cause) for f in found] == [(FindingKind.MIXED_DEVICES, "default-device-buffer")]
    (finding,) = found
    assert [t.name for t in finding.tensors if t.device == "cuda:0"] == ["y_ptr"]


# --- after the one-cause rule, the default-stream check and the rank check (88138dc) --------------


def test_the_default_buffer_run_reported_one_cause_live() -> None:
    report = _report("run-default_buffer.json.gz", LATER)
    assert [d.cause for d in report.diagnoses] == ["default-device-buffer"]
    (launch, *_) = _flagged(report)
    assert [f.cause for f in check_launch(_facts(launch), _peer)] == ["default-device-buffer"]


def test_the_default_stream_launches_are_found_again_from_the_recorded_ring() -> None:
    report = _report("run-wrong_stream.json.gz", LATER)
    ring = _ring(report)
    streams = {(launch.device, launch.stream != 0) for launch in ring}
    assert streams == {("cuda:0", True), ("cuda:0", False), ("cuda:1", True), ("cuda:1", False)}
    found = wrong_stream(ring)
    assert sorted((f.kernel, f.launch_device, f.cause) for f in found) == [
        ("_grouped_gemm_kernel", "cuda:0", "wrong-device-stream"),
        ("_grouped_gemm_kernel", "cuda:1", "wrong-device-stream"),
    ]
    assert [d.cause for d in report.diagnoses] == ["wrong-device-stream"]


def test_our_kernel_with_a_side_stream_current_stays_clean() -> None:
    report = _report("run-ours-side-stream.json.gz", LATER)
    ring = _ring(report)
    assert ring and all(launch.stream not in (0, None) for launch in ring)  # every launch on the side streams
    assert wrong_stream(ring) == [] and report.diagnoses == () and report.exit_code == 0


def test_torchrun_ranks_with_our_kernel_stay_clean() -> None:
    report = _report("ranks-ours.json.gz", LATER)
    processes = [r for p in report.passes for r in p.processes]
    assert sorted(r.local_rank or 0 for r in processes) == [0, 1] and None not in {r.local_rank for r in processes}
    for record in processes:
        assert {launch.device for launch in record.ring} == {f"cuda:{record.local_rank}"}
        for launch in record.ring:
            if launch.tensors:
                assert check_launch(_facts(launch, record.local_rank), _peer) == ()
    assert report.diagnoses == () and report.exit_code == 0


def test_the_rank_that_never_set_its_device_is_named_on_rank_1_only() -> None:
    report = _report("ranks-no-set-device.json.gz", LATER)
    processes = {r.local_rank: r for p in report.passes for r in p.processes}
    assert processes[0].findings == ()
    (finding,) = processes[1].findings
    assert finding.launch is not None
    found = check_launch(_facts(finding.launch, 1), _peer)
    assert [(f.kind, f.cause) for f in found] == [(FindingKind.RANK_ON_DEVICE_0, "device-never-set")]
    # the same launch read without its rank: only the stray buffer, which the rank check explains
    assert sorted(f.cause for f in check_launch(_facts(finding.launch), _peer)) == ["default-device-buffer"]
    assert [d.cause for d in report.diagnoses] == ["device-never-set"]
