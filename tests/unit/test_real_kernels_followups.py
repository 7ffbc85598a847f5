"""The scan's memcheck follow-up of blind invalid-routing cells, on recorded GPU outcomes.

The outcomes are the recorded over-routed cells of 2x H200 (commit b7713e6; ``canary_after_output:
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

RECORDED = Path(__file__).parent.parent / "fixtures" / "reports" / "scan"
SANITIZER = SanitizerInfo(path="/usr/local/cuda/bin/compute-sanitizer", version="2025.3.1", found_via="PATH")


def _outcomes(report: str) -> list[Outcome]:
    doc = json.loads((RECORDED / "2026-11-22-2xh200-b7713e6" / f"{report}.json").read_text())
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
    doc = json.loads((RECORDED / "2026-11-22-2xh200-7ada31c" / "scan-builtin.json").read_text())
    outcomes = [from_jsonable(Outcome, o) for o in doc["outcomes"]]
    _settle(outcomes, confirm, SANITIZER)
    # that recording's negative-sizes cells had their canary: only the over-routed ones are blind
    assert sorted(confirm.asked) == ["GPU 0/over-routed", "GPU 1/over-routed"]


# --------------------------------------------------------------------------------------------
# In the scan: run_scan settles each session's blind cells, with a stand-in compute-sanitizer
# --------------------------------------------------------------------------------------------

#: A stand-in for compute-sanitizer (the pattern of tests/unit/test_run_reruns.py): it answers
#: --version, records what it was asked to run, and writes memcheck's log of one invalid write
#: past the end of an allocation, without running the probe (there is no GPU here).
STAND_IN = """\
#!{python}
import json, os, sys

args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Compute Sanitizer\\nVersion 2025.3.1.0")
    sys.exit(0)
log, i = None, 0
while i < len(args) and args[i].startswith("--"):
    if args[i] == "--log-file":
        log = args[i + 1]
    i += 2
spec = json.loads(args[-1])
json.dump({{"probe_id": spec["probe_id"], "tool": args[args.index("--tool") + 1],
           "caching": os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")}}, open(os.environ["STAND_IN_SEEN"], "w"))
open(log, "w").write(
    "========= COMPUTE-SANITIZER\\n"
    "========= Invalid __global__ write of size 16 bytes\\n"
    "=========     at _running_row_mask_kernel+0x1b0 in running_row_mask.py:88\\n"
    "=========     by thread (3,0,0) in block (0,0,0)\\n"
    "=========     Address 0x7f0000020500 is out of bounds\\n"
    "=========     and is 1,281 bytes after the nearest allocation at 0x7f0000000000 of size 131,072 bytes\\n"
    "========= \\n"
    "========= ERROR SUMMARY: 1 error\\n"
)
"""


def _blind_scan(monkeypatch: Any, tmp_path: Path) -> Any:
    """A one-GPU scan of single + over-routed whose probes (no child: there is no GPU here) pass
    without a canary after the kernel's own output: the over-routed cell is blind."""
    from qmoe_doctor.core.options import ScanOptions
    from qmoe_doctor.core.records import Condition, Phase, Status
    from qmoe_doctor.plan.scan import plan_scan
    from qmoe_doctor.workflows import scan as scan_workflow

    def run_session(
        specs: Any, *, base_env: Any, log_dir: Path, on_event: Any = None, stop_after: Any = None
    ) -> list[Outcome]:
        return [
            Outcome(
                probe_id=s.probe_id,
                spec=s,
                status=Status.PASS,
                phase=Phase.DONE,
                facts={"canary_after_output": False, "output_guard": False},
            )
            for s in specs
        ]

    @dataclass(frozen=True)
    class Gpu:
        index: int = 0
        uuid: str = "GPU-aaa"

    monkeypatch.setattr(scan_workflow, "run_session", run_session)
    opts = ScanOptions(conditions=frozenset({Condition.SINGLE, Condition.OVER_ROUTED}), sweeps=False)
    plan = plan_scan("specimen:running_row_mask", [Gpu()], opts)
    return scan_workflow.run_scan(plan, gpus=(0,), log_dir=tmp_path / "logs")


def test_scan_turns_a_blind_over_routed_cell_into_the_fault_when_memcheck_sees_the_write(
    monkeypatch: Any, tmp_path: Path
) -> None:
    import sys

    from qmoe_doctor.core import knobs

    stand_in = tmp_path / "compute-sanitizer"
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    monkeypatch.setenv(knobs.QMOE_SANITIZER, str(stand_in))
    monkeypatch.setenv("STAND_IN_SEEN", str(tmp_path / "seen.json"))
    report = _blind_scan(monkeypatch, tmp_path)
    seen = json.loads((tmp_path / "seen.json").read_text())
    # the blind cell alone, under memcheck, with the caching allocator off
    assert seen == {"probe_id": "GPU 0/over-routed+memcheck", "tool": "memcheck", "caching": "1"}
    (fault,) = report.diagnoses
    assert (fault.cause, fault.severity) == ("invalid-routing", "fault") and report.hardening == ()
    over = next(o for o in report.outcomes if o.probe_id == "GPU 0/over-routed")
    assert str(over.status) == "wrong" and over.facts["memcheck"] == "errors"
    assert over.canary_hits[0].startswith("memcheck: Invalid __global__ write of size 16 bytes")
    assert any("memcheck: Invalid __global__ write" in e.detail for e in fault.evidence)
    assert report.coverage is not None and report.coverage.unchecked == ()
    assert not report.healthy


def test_scan_leaves_the_blind_cell_unchecked_with_the_reason_without_a_sanitizer(
    monkeypatch: Any, tmp_path: Path
) -> None:
    from qmoe_doctor.core import knobs
    from qmoe_doctor.workflows import scan as scan_workflow

    monkeypatch.delenv(knobs.QMOE_SANITIZER, raising=False)
    monkeypatch.setattr(scan_workflow, "find_compute_sanitizer", lambda: None)
    report = _blind_scan(monkeypatch, tmp_path)
    assert report.diagnoses == () and report.unexplained == ()
    over = next(o for o in report.outcomes if o.probe_id == "GPU 0/over-routed")
    assert str(over.status) == "pass" and over.facts["memcheck"] == "unavailable"
    labels = {c.outcome.probe_id: c.label for c in build_matrix(report.outcomes).cells.values()}
    assert labels["GPU 0/over-routed"] == "unchecked" and labels["GPU 0/single"] == "pass"
    assert any("GPU 0/over-routed unchecked" in e and NO_SANITIZER in e for e in report.explanations)
    assert report.coverage is not None and report.coverage.unchecked == ("GPU 0/over-routed",)
    assert not report.coverage.complete
