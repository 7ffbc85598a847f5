"""Scans recorded on one NVIDIA H100 80GB HBM3 with the stream-order probes holding the stream on
the GPU's global timer (``probes/stream_hold.py``; 2026-12-06, tree at commit dbb9102), classified
again through today's rules: the side-stream cell still sees the planted fault and still passes
the built-in kernel, with the producer queued behind the hold through the kernel's call.
``tests/fixtures/MANIFEST.md`` gives the command and versions."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.core.records import Outcome, Status, from_jsonable
from qmoe_doctor.diagnose.scan_rules import classify

SCANS = Path(__file__).resolve().parents[1] / "fixtures" / "reports" / "scan" / "2026-12-06-h100-dbb9102"


def _scan(name: str) -> tuple[dict[str, Any], list[Outcome]]:
    doc = json.loads(gzip.decompress((SCANS / f"scan-{name}.json.gz").read_bytes()))
    return doc, [from_jsonable(Outcome, o) for o in doc["outcomes"]]


@pytest.mark.parametrize(
    ("name", "causes", "side_stream"),
    [("wrong_stream", {"wrong-device-stream"}, Status.WRONG), ("builtin", set(), Status.PASS)],
)
def test_side_stream_cell_under_the_global_timer_hold(name: str, causes: set[str], side_stream: Status) -> None:
    doc, outcomes = _scan(name)
    assert {d.cause for d in classify(outcomes, kernel=doc["kernel"]).diagnoses} == causes
    assert {d["cause"] for d in doc["diagnoses"]} == causes  # what the run itself reported
    (cell,) = [o for o in outcomes if o.probe_id == "GPU 0/side-stream"]
    assert cell.status is side_stream
    # the race was live: the producer still queued behind the 0.2 s hold when the call returned
    assert cell.facts["producer_pending_after_call"] is True
