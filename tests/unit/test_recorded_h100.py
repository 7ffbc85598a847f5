"""Recordings of one NVIDIA H100 80GB HBM3 (2026-11-25, tree at commit e9d91ec), classified again
through the product's own readers and rules: what each recording shows must still come out of
today's code.

* ``reports/scan/2026-11-25-h100-e9d91ec/``: ``qmoe-doctor scan --gpus 0 --save`` of the built-in
  kernel, ``torch:grouped_mm`` and the specimens, and the one-GPU sweeps. Re-classified, each gives
  the cause the specimen catalogue (``core.specimens``) says a one-GPU scan can see, and the causes
  the report recorded.
* ``monitor-records/2026-11-25-h100-e9d91ec/unmasked/``: the monitor's process records of
  ``qmoe-doctor run --blocking --sanitize`` on a model whose MoE layer calls the ``unmasked_rows``
  specimen over-routed, one folder per pass, read back through the run workflow's reader.
* ``reports/run/2026-11-25-h100-e9d91ec/``: that run's report, the int32 specimen's run and the
  built-in kernel's run (healthy).
* ``sanitizer/2026-11-25-h100-e9d91ec/``: the sanitize pass's memcheck log, where compute-sanitizer
  itself failed ("Internal Sanitizer Error").
* ``tracebacks/2026-11-25-h100-e9d91ec/``: the worker's stderr of the int32 specimen's
  ``TRITON_DEBUG=1`` rerun (gzipped).

``tests/fixtures/MANIFEST.md`` gives the commands and versions.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.core.launches import FindingKind
from qmoe_doctor.core.records import ErrorKind, Outcome, from_jsonable
from qmoe_doctor.core.reports import RunReport
from qmoe_doctor.core.specimens import get_specimen
from qmoe_doctor.diagnose import run_findings
from qmoe_doctor.diagnose.attribution import attribute
from qmoe_doctor.diagnose.device_assert import find_device_asserts
from qmoe_doctor.diagnose.explain import explain_text
from qmoe_doctor.diagnose.followups import verdict_of
from qmoe_doctor.diagnose.repro_rules import confirmation_from_log
from qmoe_doctor.diagnose.sanitizer_log import parse_sanitizer_log
from qmoe_doctor.diagnose.scan_rules import classify
from qmoe_doctor.workflows.run import read_records

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
H100 = "2026-11-25-h100-e9d91ec"
SCANS = FIXTURES / "reports" / "scan" / H100
RUNS = FIXTURES / "reports" / "run" / H100
RECORDS = FIXTURES / "monitor-records" / H100 / "unmasked"
SANITIZER_LOG = FIXTURES / "sanitizer" / H100 / "memcheck-unmasked-overrouted-internal-error.log"
INT32_DEBUG = FIXTURES / "tracebacks" / H100 / "traceback-int32-debug-worker.stderr.gz"
FAULTING = "_grouped_gemm_kernel_unmasked"


def _json(path: Path) -> Any:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def _run_report(name: str) -> RunReport:
    return from_jsonable(RunReport, _json(RUNS / name))


# --- scan reports ---------------------------------------------------------------------------------

SCAN_REPORTS = sorted(SCANS.glob("*.json"))


def test_every_kind_of_scan_was_recorded() -> None:
    kernels = {_json(p)["kernel"] for p in SCAN_REPORTS}
    assert {"builtin", "torch:grouped_mm", "specimen:unmasked_rows", "specimen:int32_offsets"} <= kernels
    assert len(SCAN_REPORTS) >= 10


def _expected_causes(kernel: str, outcomes: list[Outcome]) -> set[str]:
    """What the specimen catalogue says a scan of these cells can see: the planted cause where
    one of the specimen's misbehaving conditions was probed, none for a correct kernel."""
    if not kernel.startswith("specimen:"):
        return set()
    spec = get_specimen(kernel.split(":", 1)[1])
    probed = {o.spec.condition for o in outcomes}
    return {spec.cause} if spec.cause is not None and probed & set(spec.misbehaves_under) else set()


@pytest.mark.parametrize("path", SCAN_REPORTS, ids=lambda p: p.name)
def test_recorded_scan_reclassifies_to_its_cause(path: Path) -> None:
    doc = _json(path)
    outcomes = [from_jsonable(Outcome, o) for o in doc["outcomes"]]
    got = classify(outcomes, kernel=doc["kernel"])
    causes = {d.cause for d in got.diagnoses}
    assert causes == {d["cause"] for d in doc["diagnoses"]}, path.name
    if path.name.startswith("scan-"):
        assert causes == _expected_causes(doc["kernel"], outcomes), path.name


def test_specimens_with_a_cause_were_diagnosed_on_one_h100() -> None:
    """The faulty specimens a one-GPU scan can see were all seen (not a vacuous table)."""
    seen = set()
    for path in SCAN_REPORTS:
        doc = _json(path)
        outcomes = [from_jsonable(Outcome, o) for o in doc["outcomes"]]
        seen |= {d.cause for d in classify(outcomes, kernel=doc["kernel"]).diagnoses}
    assert {"invalid-routing", "int32-offset-overflow", "autotune-inplace-rerun", "wrong-device-stream"} <= seen


# --- qmoe-doctor run: the monitor's records ------------------------------------------------------


def test_run_pass_puts_the_faulting_kernel_among_the_last_launches() -> None:
    records, notes = read_records(RECORDS / "run")
    assert records and notes == []
    (error,) = run_findings.cuda_errors(records, blocking=False)
    assert error.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert error.faulting is None and not error.exact  # asynchronous: a guess, said as one
    assert FAULTING in {launch.kernel for launch in error.last_launches}
    assert f"`{FAULTING}`" in error.note and "--blocking" in error.note


def test_blocking_pass_names_the_faulting_kernel() -> None:
    records, notes = read_records(RECORDS / "blocking")
    assert records and notes == []
    (error,) = run_findings.cuda_errors(records, blocking=True)
    assert error.exact and error.faulting == FAULTING
    assert error.last_launches[-1].kernel == FAULTING and error.last_launches[-1].raised
    targets = run_findings.sanitizer_targets([error], (), records)
    assert targets is not None and targets.kernels == (FAULTING,)


def test_recorded_run_report_agrees_with_its_records() -> None:
    """The report the run wrote says what its records, read again, say."""
    report = _run_report("run-unmasked.json")
    assert [p.label for p in report.passes] == ["run", "blocking", "sanitize"]
    for label, blocking in (("run", False), ("blocking", True)):
        records, _ = read_records(RECORDS / label)
        again = run_findings.cuda_errors(records, blocking=blocking)
        (recorded,) = [p for p in report.passes if p.label == label]
        assert [(e.faulting, e.exact, e.error_kind) for e in again] == [
            (e.faulting, e.exact, e.error_kind) for e in recorded.cuda_errors
        ]
    assert report.sanitizer is not None and report.sanitizer.kernels == (FAULTING,)


def test_sanitize_pass_records_read_back() -> None:
    records, notes = read_records(RECORDS / "sanitize")
    assert len(records) == 1 and notes == []
    assert any(k.name == FAULTING for k in records[0].kernels)


def test_int32_run_gives_the_int32_finding() -> None:
    report = _run_report("run-int32.json")
    records = [r for p in report.passes if p.label == "run" for r in p.processes]
    found = run_findings.diagnoses(records)
    int32 = [d for d in found if d.kind is FindingKind.INT32_BY_SIZE]
    assert int32, found
    assert {d.cause for d in int32} == {"int32-offset-overflow"}
    assert [(d.cause, d.kind, d.kernel) for d in found] == [(d.cause, d.kind, d.kernel) for d in report.diagnoses]


def test_builtin_kernel_run_is_healthy_again() -> None:
    report = _run_report("run-ours.json.gz")
    for p in report.passes:
        assert run_findings.diagnoses(p.processes, p.label) == ()
        assert run_findings.cuda_errors(p.processes, blocking=p.label == "blocking") == ()
    assert report.healthy and report.exit_code == 0


# --- the sanitize pass's memcheck log: compute-sanitizer failed -----------------------------------


def test_internal_sanitizer_error_is_a_tool_failure() -> None:
    """Not a clean run (it stopped checking) and not an access fault (no invalid access was
    reported: the API errors are torch's later calls meeting the sticky CUDA error)."""
    text = SANITIZER_LOG.read_text(encoding="utf-8")
    parsed = parse_sanitizer_log(text)
    assert parsed.tool_failures and parsed.tool_failures[0].startswith("Internal Sanitizer Error")
    assert not parsed.clean
    assert not [e for e in parsed.errors if e.category == "invalid-access" or e.address is not None]
    explained = explain_text(text)
    assert any(c.startswith("compute-sanitizer failed during the run") for c in explained.caveats)
    # what the run workflow places against the sanitize pass's recorded tensors: no address
    records, _ = read_records(RECORDS / "sanitize")
    assert run_findings.tensor_tables(records)
    assert attribute(parsed, run_findings.tensor_tables(records)) == ()


def test_a_probe_rerun_whose_sanitizer_failed_is_neither_confirmed_nor_clean() -> None:
    """repro's and the scan follow-up's reading of the same log: ``failed`` (the cell stays
    unchecked), never ``confirmed`` from the tool's own error count."""
    parsed = parse_sanitizer_log(SANITIZER_LOG.read_text(encoding="utf-8"))
    found = confirmation_from_log(parsed, None, {}, {})
    assert found.status == "failed", found
    assert "Internal Sanitizer Error" in found.reason and "neither confirmed nor ruled out" in found.reason
    assert verdict_of(found.status, found.errors) == "failed"


# --- the int32 specimen's TRITON_DEBUG=1 worker stderr -------------------------------------------


def test_int32_debug_worker_stderr_names_the_specimen_line() -> None:
    text = gzip.decompress(INT32_DEBUG.read_bytes()).decode("utf-8")
    asserts = find_device_asserts(text)
    assert asserts and {a.file.rsplit("/", 1)[-1] for a in asserts} == {"int32_offsets.py"}
    assert all("int32 overflow" in a.message for a in asserts)
    explained = explain_text(text)
    assert explained.error_kind is ErrorKind.DEVICE_ASSERT
    assert explained.fits[0].cause == "int32-offset-overflow"
