"""Records round-trip through JSON and refuse what they cannot read."""

from __future__ import annotations

import json

import pytest

from qmoe_doctor.core.causes import CAUSES, get_cause
from qmoe_doctor.core.records import (
    SCHEMA_VERSION,
    Condition,
    Confidence,
    Diagnosis,
    ErrorKind,
    Evidence,
    Outcome,
    Phase,
    ProbeSpec,
    Shape,
    Status,
    TensorInfo,
    from_json,
    to_json,
)


def spec() -> ProbeSpec:
    return ProbeSpec(
        probe_id="0->1/peer", kernel="builtin", condition=Condition.PEER, device=1, current=0,
        shape=Shape(m=4096, e=128, n=1536, k=2048), params={"extra_rows": 64}, env={"TRITON_DEBUG": "1"},
    )


def test_outcome_round_trip() -> None:
    o = Outcome(
        probe_id="0->1/peer", spec=spec(), status=Status.ERROR, phase=Phase.SYNC,
        error_kind=ErrorKind.ILLEGAL_ADDRESS, rel_error=None, canary_hits=("after y",),
        calls_rel_error=(8.0, 1e-3), facts={"alloc_on_current_bytes": 0, "nested": {"a": [1, 2]}},
        tensors=(TensorInfo(name="x", device="cuda:1", data_ptr=0x7F00, nbytes=16, shape=(2, 4), strides=(4, 1), dtype="torch.bfloat16"),),
    )
    back = from_json(Outcome, to_json(o))
    assert back == o
    assert isinstance(back.tensors[0].shape, tuple)


def test_diagnosis_round_trip() -> None:
    d = Diagnosis(
        cause="missing-device-guard", confidence=Confidence.HIGH, summary="s",
        evidence=(Evidence(probe_id="p", condition=Condition.NO_PEER, label="pointer-inaccessible", detail="d"),),
        where=("GPU 0 -> GPU 1",), repro="qmoe-doctor scan",
    )
    assert from_json(Diagnosis, to_json(d)) == d


def test_nan_survives() -> None:
    o = Outcome(probe_id="p", spec=spec(), status=Status.WRONG, phase=Phase.DONE, rel_error=float("nan"))
    back = from_json(Outcome, to_json(o))
    assert back.rel_error != back.rel_error


def test_newer_schema_is_refused_and_unknown_keys_ignored() -> None:
    data = json.loads(to_json(Outcome(probe_id="p", spec=spec(), status=Status.PASS, phase=Phase.DONE)))
    data["future_field"] = 1
    assert from_json(Outcome, json.dumps(data)).status is Status.PASS
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match="schema_version"):
        from_json(Outcome, json.dumps(data))


def test_bad_enum_value_is_refused() -> None:
    data = json.loads(to_json(spec()))
    data["condition"] = "nonsense"
    with pytest.raises(ValueError):
        from_json(ProbeSpec, json.dumps(data))


def test_every_cause_has_its_fixed_parts() -> None:
    for cid, cause in CAUSES.items():
        assert cid == cause.id and cid == cid.lower() and " " not in cid
        assert cause.mechanism and cause.fix and cause.title
    with pytest.raises(KeyError, match="known"):
        get_cause("nope")


def test_saved_scan_report_reads_back() -> None:
    """A --save'd report (real, run 2) reads back into a ScanReport: int dict keys included."""
    from pathlib import Path

    from qmoe_doctor.core.records import from_jsonable
    from qmoe_doctor.core.reports import ScanReport

    path = Path(__file__).parent.parent / "fixtures/recorded/h200x2-run2/scans/scan-unguarded.json"
    report = from_jsonable(ScanReport, json.loads(path.read_text()))
    assert report.sessions[0].gpu_of_ordinal == {0: 0, 1: 1}
    assert [d.cause for d in report.diagnoses] == ["missing-device-guard"]


def test_eight_gpu_scans_cover_every_ordered_pair_and_reclassify_healthy() -> None:
    """Issue 9 (runs 50 and 52, 8x H200): run 50's full scan was stopped after 48 of the 56
    ordered pairs (its printed lines are all that is left), run 52 scanned the other 8 as two-GPU
    scans (--save'd reports). Together they cover all 56 ordered pairs, every probe passed, and
    run 52's recorded outcomes classify to no diagnosis here too."""
    import itertools
    import re
    from pathlib import Path

    from qmoe_doctor.core.records import Outcome, Status, from_jsonable
    from qmoe_doctor.core.reports import ScanReport
    from qmoe_doctor.diagnose.scan_rules import classify

    runs = Path(__file__).parent.parent / "fixtures/recorded/h200x8-runs50-52"
    lines = (runs / "scan-run50-partial.log").read_text().splitlines()
    probe = re.compile(r"^\s+(\d)->(\d)/([\w:-]+): (\w+)")
    pairs = {(int(m[1]), int(m[2])) for m in map(probe.match, lines) if m}
    assert all(line.rstrip().endswith(": pass") for line in lines if line.strip())
    assert len(pairs) == 48
    for path in sorted(runs.glob("run52-scan-*.json")):
        report = from_jsonable(ScanReport, json.loads(path.read_text()))
        assert report.complete and report.healthy and all(o.status is Status.PASS for o in report.outcomes)
        got = classify([from_jsonable(Outcome, o) for o in json.loads(path.read_text())["outcomes"]], kernel="builtin")
        assert got.diagnoses == () and got.unexplained == ()
        for session in report.sessions:
            if "->" in session.label:
                a, b = (int(x) for x in re.findall(r"GPU (\d)", session.label))
                pairs.add((a, b))
    assert pairs == set(itertools.permutations(range(8), 2))
