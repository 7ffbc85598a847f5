"""Records round-trip through JSON and refuse what they cannot read."""

from __future__ import annotations

import json

import pytest

from qmoe_doctor.causes import CAUSES, get_cause
from qmoe_doctor.records import (
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

    from qmoe_doctor.records import from_jsonable
    from qmoe_doctor.scan import ScanReport

    path = Path(__file__).parent.parent / "fixtures/recorded/h200x2-run2/scans/scan-unguarded.json"
    report = from_jsonable(ScanReport, json.loads(path.read_text()))
    assert report.sessions[0].gpu_of_ordinal == {0: 0, 1: 1}
    assert [d.cause for d in report.diagnoses] == ["missing-device-guard"]
