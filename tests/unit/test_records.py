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
    """A --save'd report (real: 2x H200, commit b7713e6) reads back into a ScanReport: int dict keys included."""
    from pathlib import Path

    from qmoe_doctor.core.records import from_jsonable
    from qmoe_doctor.core.reports import ScanReport

    path = Path(__file__).parent.parent / "fixtures/reports/scan/2026-11-22-2xh200-b7713e6/scan-unguarded.json"
    report = from_jsonable(ScanReport, json.loads(path.read_text()))
    assert report.sessions[0].gpu_of_ordinal == {0: 0, 1: 1}
    assert [d.cause for d in report.diagnoses] == ["missing-device-guard"]


def test_eight_gpu_scans_cover_every_ordered_pair_and_reclassify_healthy() -> None:
    """Issue 9 (8x H200, 2026-11-22): a full scan was stopped after 48 of the 56 ordered pairs
    (its printed lines are all that is left, commit c1a2d84), then the other 8 were scanned as
    two-GPU scans (--save'd reports, commit 9a99b45). Together they cover all 56 ordered pairs,
    every probe passed, and the two-GPU scans' recorded outcomes classify to no diagnosis here too."""
    import itertools
    import re
    from pathlib import Path

    from qmoe_doctor.core.records import Outcome, Status, from_jsonable
    from qmoe_doctor.core.reports import ScanReport
    from qmoe_doctor.diagnose.scan_rules import classify

    scans = Path(__file__).parent.parent / "fixtures/reports/scan"
    lines = (scans / "2026-11-22-8xh200-c1a2d84" / "scan-stopped-after-48-pairs.log").read_text().splitlines()
    probe = re.compile(r"^\s+(\d)->(\d)/([\w:-]+): (\w+)")
    pairs = {(int(m[1]), int(m[2])) for m in map(probe.match, lines) if m}
    assert all(line.rstrip().endswith(": pass") for line in lines if line.strip())
    assert len(pairs) == 48
    for path in sorted((scans / "2026-11-22-8xh200-9a99b45").glob("scan-gpus-*.json")):
        report = from_jsonable(ScanReport, json.loads(path.read_text()))
        assert report.complete and report.healthy and all(o.status is Status.PASS for o in report.outcomes)
        got = classify([from_jsonable(Outcome, o) for o in json.loads(path.read_text())["outcomes"]], kernel="builtin")
        assert got.diagnoses == () and got.unexplained == ()
        for session in report.sessions:
            if "->" in session.label:
                a, b = (int(x) for x in re.findall(r"GPU (\d)", session.label))
                pairs.add((a, b))
    assert pairs == set(itertools.permutations(range(8), 2))


# --- placement: written by the planner, derived from the probe id only for old reports ------------


def test_placement_round_trips_and_names_its_cell() -> None:
    from qmoe_doctor.core.records import Placement, pair_placement

    where = pair_placement(0, 1)
    s = ProbeSpec(probe_id=where.probe_id(Condition.PEER), kernel="builtin", condition=Condition.PEER,
                  placement=where, device=1, current=0, shape=Shape(m=8, e=2, n=8, k=8))
    data = json.loads(to_json(s))
    assert data["placement"] == {"group": "0->1", "gpu_a": 0, "gpu_b": 1, "rank": None, "variant": "", "rerun": ""}
    assert from_json(ProbeSpec, to_json(s)) == s
    assert (where.label, where.is_pair, s.probe_id) == ("GPU 0 -> GPU 1", True, "0->1/peer")
    sweep = Placement(group="GPU 1", gpu_b=1, variant="padded-rows", rerun="debug")
    assert sweep.cell_name(Condition.OFFSETS) == "offsets:padded-rows+debug" and not sweep.is_pair


@pytest.mark.parametrize(
    ("probe_id", "group", "gpu_a", "gpu_b", "rank", "variant", "rerun"),
    [
        ("0->1/peer", "0->1", 0, 1, None, "", ""),
        ("GPU 1/offsets:padded-rows", "GPU 1", None, 1, None, "padded-rows", ""),
        ("GPU 1/launch-config:64x128x64-w4-s4", "GPU 1", None, 1, None, "64x128x64-w4-s4", ""),
        ("GPU 1/int32-boundary+debug", "GPU 1", None, 1, None, "", "debug"),
        ("0->1/peer+memcheck", "0->1", 0, 1, None, "", "memcheck"),
        ("CPU/single", "CPU", None, None, None, "", ""),
        ("rank 1/parallel-ep", "rank 1", None, None, 1, "", ""),
        ("local rank 3/parallel-dp", "local rank 3", None, None, 3, "", ""),
        ("pipeline", "pipeline", None, None, None, "", ""),
    ],
)
def test_legacy_placement_of_old_probe_ids(
    probe_id: str, group: str, gpu_a: int | None, gpu_b: int | None, rank: int | None, variant: str, rerun: str
) -> None:
    from qmoe_doctor.core.records import legacy_placement

    p = legacy_placement(probe_id)
    assert (p.group, p.gpu_a, p.gpu_b, p.rank, p.variant, p.rerun) == (group, gpu_a, gpu_b, rank, variant, rerun)


def test_recorded_reports_without_placement_read_with_one_derived() -> None:
    """Reports saved before ProbeSpec had a placement (recorded scans, parallel runs) read back
    with the placement their probe ids imply; the matrix groups them as before."""
    from pathlib import Path

    from qmoe_doctor.core.records import from_jsonable
    from qmoe_doctor.core.reports import ParallelReport, ScanReport
    from qmoe_doctor.diagnose.matrix import build_matrix

    recorded = Path(__file__).parent.parent / "fixtures/reports"
    doc = json.loads((recorded / "scan/2026-11-22-2xh200-b7713e6/scan-int32_offsets.json").read_text())
    assert all("placement" not in o["spec"] for o in doc["outcomes"])  # written before the field
    report = from_jsonable(ScanReport, doc)
    for o in report.outcomes:
        p = o.spec.placement
        assert p.probe_id(o.spec.condition) == o.probe_id
        assert p.variant == str(o.spec.params.get("variant", ""))
        assert p.is_pair == o.spec.condition.is_pair
    debug = next(o for o in report.outcomes if o.probe_id == "GPU 1/int32-boundary+debug")
    assert debug.spec.placement.rerun == "debug" and debug.spec.placement.gpu_b == 1
    assert set(build_matrix(report.outcomes).groups()) == {"0->1", "1->0", "GPU 0", "GPU 1"}
    doc = json.loads((recorded / "parallel/2026-11-22-2xh200-e60e57e/parallel-specimen-rank_no_set_device.json").read_text())
    parallel = from_jsonable(ParallelReport, doc)
    assert [(o.spec.placement.group, o.spec.placement.rank) for o in parallel.outcomes] == [
        ("rank 0", 0), ("rank 1", 1),
    ]


def test_rank_spec_names_the_rank() -> None:
    from qmoe_doctor.core.records import Placement, rank_spec

    template = ProbeSpec(probe_id="dp", kernel="builtin", condition=Condition.PARALLEL_DP,
                         placement=Placement(group="dp"), shape=Shape(m=8, e=2, n=8, k=8))
    s = rank_spec(template, 1, 1)
    assert (s.probe_id, s.placement.group, s.placement.rank, s.device, s.current) == (
        "rank 1/parallel-dp", "rank 1", 1, 1, 1,
    )
    assert rank_spec(template, 3, None, local=True).probe_id == "local rank 3/parallel-dp"
