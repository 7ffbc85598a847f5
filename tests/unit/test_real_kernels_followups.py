"""The scan's memcheck follow-up of blind invalid-routing cells, on recorded GPU outcomes.

The outcomes are the recorded over-routed cells of 2x H200 run 2 (``canary_after_output:
false``: blind); the sanitizer run is a fake with the answers ``confirm_with_sanitizer`` gives
(its own tests run it on recorded sanitizer logs: tests/unit/test_repro.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qmoe_doctor.core.records import Outcome, from_jsonable
from qmoe_doctor.diagnose.matrix import build_matrix
from qmoe_doctor.diagnose.scan_rules import classify
from qmoe_doctor.machine.sanitizer import SanitizerInfo
from qmoe_doctor.workflows.blind_cells import NO_SANITIZER, settle_blind_cells

RECORDED = Path(__file__).parent.parent / "fixtures" / "recorded"
SANITIZER = SanitizerInfo(path="/usr/local/cuda/bin/compute-sanitizer", version="2025.3.1", found_via="PATH")


def _outcomes(report: str) -> list[Outcome]:
    doc = json.loads((RECORDED / "h200x2-run2" / "scans" / f"{report}.json").read_text())
    return [from_jsonable(Outcome, o) for o in doc["outcomes"]]


@dataclass
class _Found:
    status: str
    reason: str
    errors: int | None = None
    first_error: str | None = None
    touched: str | None = None
    log_path: str | None = None


class _FakeConfirm:
    def __init__(self, answer: _Found) -> None:
        self.answer = answer
        self.asked: list[str] = []

    def __call__(self, target: Outcome, info: SanitizerInfo, **kwargs: Any) -> _Found:
        assert info is SANITIZER and set(kwargs) == {"base_env", "gpu_of_ordinal", "log_dir"}
        self.asked.append(target.probe_id)
        return self.answer


def _settle(outcomes: list[Outcome], confirm: _FakeConfirm | None, sanitizer: SanitizerInfo | None) -> list[Outcome]:
    return settle_blind_cells(
        outcomes, base_env={}, gpu_of_ordinal={0: 0, 1: 1}, log_dir=Path("/tmp"), sanitizer=sanitizer, confirm=confirm
    )


def test_memcheck_errors_turn_a_blind_over_routed_pass_into_the_fault() -> None:
    confirm = _FakeConfirm(
        _Found(
            status="confirmed",
            reason="memcheck confirms the access fault: 514 errors",
            errors=514,
            first_error="Invalid __global__ write of size 16 bytes",
            touched="1,281 bytes after y#1 (131,072 bytes) on cuda:1 (GPU 1)",
            log_path="/tmp/memcheck.log",
        )
    )
    settled = _settle(_outcomes("scan-unmasked_rows"), confirm, SANITIZER)
    # the blind cells of both GPUs, and only those: the over-routed passes, and the sentinel
    # cells, wrong without a canary (in bounds or not: memcheck settles which)
    assert sorted(confirm.asked) == [
        "GPU 0/negative-sizes", "GPU 0/over-routed", "GPU 1/negative-sizes", "GPU 1/over-routed",
    ]  # fmt: skip
    result = classify(settled, kernel="specimen:unmasked_rows")
    (fault,) = result.diagnoses
    assert (fault.cause, fault.severity) == ("invalid-routing", "fault")
    assert any("memcheck: Invalid __global__ write" in e.detail for e in fault.evidence)
    over = next(o for o in settled if o.probe_id == "GPU 1/over-routed")
    assert over.facts["memcheck"] == "errors" and over.facts["memcheck_log"] == "/tmp/memcheck.log"


def test_a_clean_memcheck_run_makes_the_blind_pass_a_checked_pass() -> None:
    confirm = _FakeConfirm(_Found(status="clean", reason="memcheck reported 0 errors", errors=0))
    settled = _settle(_outcomes("scan-builtin"), confirm, SANITIZER)
    labels = {c.outcome.probe_id: c.label for c in build_matrix(settled).cells.values()}
    assert labels["GPU 1/over-routed"] == "pass" and labels["GPU 0/negative-sizes"] == "pass"
    assert "unchecked" not in labels.values()


def test_without_a_sanitizer_the_cell_stays_unchecked_and_says_why() -> None:
    settled = _settle(_outcomes("scan-builtin"), None, None)
    matrix = build_matrix(settled)
    cell = matrix.get("GPU 1", next(o.spec.condition for o in settled if o.probe_id == "GPU 1/over-routed"))
    assert cell is not None and cell.label == "unchecked"
    explanations = classify(settled, kernel="builtin").explanations
    assert any("GPU 1/over-routed unchecked" in e and NO_SANITIZER in e for e in explanations)


def test_cpu_cells_and_cells_with_a_canary_are_not_re_run() -> None:
    confirm = _FakeConfirm(_Found(status="clean", reason="0 errors", errors=0))
    run1 = json.loads((RECORDED / "h200x2-run1" / "scans" / "scan-builtin.json").read_text())
    outcomes = [from_jsonable(Outcome, o) for o in run1["outcomes"]]
    _settle(outcomes, confirm, SANITIZER)
    # run 1's negative-sizes cells had their canary: only the over-routed ones are blind
    assert sorted(confirm.asked) == ["GPU 0/over-routed", "GPU 1/over-routed"]
