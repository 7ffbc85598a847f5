"""The sanitize pass of ``qmoe-doctor run`` on one NVIDIA H100 80GB HBM3 (2026-11-25, commit
c2b8123), read again: ``examples/qwen3_moe_device_map.py --gpus 0 --kernel specimen:unmasked_rows
--over-route 64 --steps 1`` under ``run --sanitize``. Memcheck ran on the faulting kernel only, on
every launch up to the fault (no ``--launch-count``), caching allocator off.

* ``sanitizer/2026-11-25-h100-c2b8123/memcheck-unmasked-overrouted-64-example.log.gz``: its log;
* ``monitor-records/2026-11-25-h100-c2b8123/sanitize-64/``: the monitor's record of that pass;
* ``reports/run/2026-11-25-h100-c2b8123/run-sanitize-64.json.gz``: the report.

The log's invalid addresses, placed against the record's tensors by today's attribution, must land
past the end of the output ``y`` of that launch, as the report says; all 64 agree, so today they
are a diagnosis (invalid-routing), which the report of that day did not give ("0 diagnoses").
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

from recorded_logs import read
from rich.console import Console

from qmoe_doctor.cli.render.run import render_run
from qmoe_doctor.core.launches import FindingKind
from qmoe_doctor.core.records import Confidence, from_jsonable
from qmoe_doctor.core.reports import AddressNote, RunReport
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


def _placed_again() -> tuple[tuple[AddressNote, ...], run_findings.Placement]:
    """The log's addresses placed against the record by today's code, and what they say together."""
    records, _ = read_records(RECORDS)
    notes = run_findings.address_notes(parse_sanitizer_log(read(LOG)), records)
    return notes, run_findings.placed_diagnoses(notes, records)


def test_the_64_writes_past_y_agree_on_invalid_routing() -> None:
    """The report of that run said "0 diagnoses, 1 CUDA error": the placed addresses, read again,
    are a diagnosis, medium confidence, with how it was reached."""
    notes, placement = _placed_again()
    assert len(notes) == 64 and all(n.relation == "after" and n.tensor == notes[0].tensor for n in notes)
    (d,) = placement.diagnoses
    assert (d.cause, d.kind, d.confidence, d.kernel, d.seen_in) == (
        "invalid-routing", FindingKind.PLACED_ACCESS, Confidence.MEDIUM, FAULTING, "sanitize",
    )  # fmt: skip
    assert d.basis == "placed by memcheck, 64 of 64 addresses after the end of y_ptr; not yet proven differentially"
    assert d.summary == (
        f"memcheck placed 64 of 64 invalid writes after the end of y_ptr of {FAULTING} #1 (4096 x 1536 bf16) on "
        "cuda:0, 0 to 9,456 bytes after its 12,582,912-byte region (rows 4096-4099, past M=4096): m_sizes "
        "summing past M fits"
    )
    # recorded before launches named their wrapper: the report says how to extract the kernel
    assert d.repro.startswith("the record names no wrapper") and "--only over-routed" in d.repro
    assert "kernels/specimens/_common.py:36 in launch_kernel" in d.repro
    assert placement.note.startswith("64 of 64 invalid addresses agree: after the end of y_ptr")


def test_distances_count_as_addresssanitizer_does_and_the_old_report_keeps_its_own() -> None:
    notes, _ = _placed_again()
    parsed = parse_sanitizer_log(read(LOG))
    first = next(e for e in parsed.errors if e.address == notes[0].address)
    assert first.nearest is not None and first.nearest.distance == 1  # the log: "1 bytes after"
    assert (notes[0].gap, notes[0].region, notes[0].row) == (0, 12_582_912, 4096)
    assert notes[0].sentences[0] == (
        f"write 0 bytes after the 12,582,912-byte region of y_ptr of {FAULTING} #1 (4096 x 1536 bf16) on cuda:0: "
        "row 4096, i.e. rows past M=4096 (m_sizes summing past M fits)."
    )
    # the report recorded then reads back whole; its addresses have no gap (the field is new) and
    # their sentences keep the count of their day
    old = _report().sanitizer
    assert old is not None and all(a.gap is None and a.fits == () for a in old.addresses)
    assert old.addresses[0].sentences[0].startswith("write 1 byte past the end of y_ptr")


def test_the_report_renders_the_diagnosis_with_its_confidence_and_the_scan_that_proves_it() -> None:
    notes, placement = _placed_again()
    old = _report()
    assert old.sanitizer is not None
    report = replace(
        old,
        diagnoses=placement.diagnoses,
        sanitizer=replace(old.sanitizer, addresses=notes, agreement=placement.note),
    )
    console = Console(file=io.StringIO(), width=400, color_system=None)
    render_run(console, report)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert (
        "invalid-routing  [invalid-access-placed, medium confidence: placed by memcheck, 64 of 64 addresses "
        "after the end of y_ptr; not yet proven differentially]"
    ) in text
    assert "  prove it: the record names no wrapper" in text
    assert "  together: 64 of 64 invalid addresses agree" in text
    assert "write 0 bytes after the 12,582,912-byte region of y_ptr" in text
    assert "1 diagnosis" in text  # the report of that day: "0 diagnoses"
