"""The sanitize pass of ``qmoe-doctor run`` on one NVIDIA H100 80GB HBM3 (2026-11-25, commit
c2b8123), read again: ``examples/qwen3_moe_device_map.py --gpus 0 --kernel specimen:unmasked_rows
--over-route 64 --steps 1`` under ``run --sanitize``. Memcheck ran on the faulting kernel only, on
every launch up to the fault (no ``--launch-count``), caching allocator off.

* ``sanitizer/2026-11-25-h100-c2b8123/memcheck-unmasked-overrouted-64-example.log.gz``: its log;
* ``monitor-records/2026-11-25-h100-c2b8123/sanitize-64/``: the monitor's record of that pass;
* ``reports/run/2026-11-25-h100-c2b8123/run-sanitize-64.json.gz``: the report.

The log's invalid addresses, placed against the record's tensors by today's attribution, must land
past the end of the output ``y`` of that launch, as the report says.
"""

from __future__ import annotations

import json
from pathlib import Path

from recorded_logs import read

from qmoe_doctor.core.records import from_jsonable
from qmoe_doctor.core.reports import RunReport
from qmoe_doctor.diagnose import run_findings
from qmoe_doctor.diagnose.attribution import attribute
from qmoe_doctor.diagnose.sanitizer_log import parse_sanitizer_log
from qmoe_doctor.workflows.run import read_records

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RECORDING = "2026-11-25-h100-c2b8123"
LOG = FIXTURES / "sanitizer" / RECORDING / "memcheck-unmasked-overrouted-64-example.log.gz"
RECORDS = FIXTURES / "monitor-records" / RECORDING / "sanitize-64"
REPORT = FIXTURES / "reports" / "run" / RECORDING / "run-sanitize-64.json.gz"
FAULTING = "_grouped_gemm_kernel_unmasked"


def _report() -> RunReport:
    return from_jsonable(RunReport, json.loads(read(REPORT)))


def test_the_memcheck_log_is_a_finished_run_with_invalid_writes() -> None:
    parsed = parse_sanitizer_log(read(LOG))
    assert not parsed.tool_failures  # compute-sanitizer finished: no "Internal Sanitizer Error"
    assert parsed.error_summary == 980
    accesses = [e for e in parsed.errors if e.address is not None]
    assert accesses and {(e.space, e.access, e.kernel) for e in accesses} == {("global", "write", FAULTING)}


def test_every_invalid_address_lands_past_the_end_of_y() -> None:
    parsed = parse_sanitizer_log(read(LOG))
    records, notes = read_records(RECORDS)
    assert len(records) == 1
    placed = attribute(parsed, run_findings.tensor_tables(records))
    assert placed
    for a in placed:
        assert a.kernel == FAULTING
        assert a.matches, a.address
        best = a.matches[0]
        assert best.tensor.startswith(f"y_ptr of {FAULTING}") and best.relation == "after", best


def test_the_report_says_what_the_log_and_the_record_say() -> None:
    report = _report()
    assert [p.label for p in report.passes] == ["run", "sanitize"]  # one pass: the filter held
    s = report.sanitizer
    assert s is not None and s.kernels == (FAULTING,) and s.launch_count is None
    assert s.errors == 980 and s.note == "980 errors; 64 of 64 invalid addresses placed against recorded tensors"
    parsed = parse_sanitizer_log(read(LOG))
    records, _ = read_records(RECORDS)
    again = attribute(parsed, run_findings.tensor_tables(records))
    assert [a.address for a in again] == [a.address for a in s.addresses]
    assert {a.tensor for a in s.addresses} == {again[0].matches[0].tensor}
