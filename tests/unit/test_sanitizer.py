"""compute-sanitizer: finding the binary and building its command (``machine/sanitizer.py``),
parsing its output (``diagnose/sanitizer_log.py``; the XML reader is the test helper
``sanitizer_xml.py``), and attributing addresses to tensors (``diagnose/attribution.py``).

Three kinds of input, always labelled:

* RECORDED: our own compute-sanitizer logs (tests/fixtures/sanitizer/<recording>/, see
  tests/fixtures/MANIFEST.md). The generic tests glob every recording, so newly recorded logs are checked too.
* DERIVED VARIANTS: a recorded log transformed inside the test (cut, interleaved, prefixed,
  re-worded); the transformation is named where it is made (tests/unit/recorded_logs.py).
* HAND-WRITTEN FORMAT SAMPLES: a few short lines we wrote ourselves from the format of record
  kinds we have not recorded yet (racecheck hazards, initcheck, ``Program hit`` API errors,
  legacy cuda-memcheck, tool notes). They test the parser's branches, not its fidelity to the
  tool: replace each with a recording once one exists.

Not covered by any recording or sample: synccheck records (only the tool-inference branch is
exercised by a hand-written line) and a real ``--xml`` report (the XML reader is exercised by
re-wrapping a recorded text log in elements).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shlex
import stat
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
from format_samples import API_SAMPLE, INITCHECK_SAMPLE, LEGACY_SAMPLE, NOTES_SAMPLE, RACE_SAMPLE
from recorded_logs import (
    ALL_LOGS,
    ALL_XML,
    MANIFEST,
    RECORDED,
    SANITIZER_2XH200,
    first_records,
    interleave,
    older_address_wording,
    path_2xh200,
    prefixed,
    read,
    recorded_2xh200,
    rel,
)
from sanitizer_xml import parse_sanitizer_xml

from qmoe_doctor.core import knobs
from qmoe_doctor.core.records import Outcome, TensorInfo, from_json, from_jsonable
from qmoe_doctor.diagnose.attribution import attribute, attribute_address
from qmoe_doctor.diagnose.sanitizer_log import (
    NearestAllocation,
    SanitizerReport,
    parse_host_frame,
    parse_location,
    parse_sanitizer_log,
    short_function_name,
)
from qmoe_doctor.machine.sanitizer import (
    SanitizerInfo,
    SanitizerTool,
    find_compute_sanitizer,
    sanitizer_command,
)

NOCACHE = "memcheck-unmasked-overrouted-nocache.log"  # 450 errors, 1 byte past a 131,072-byte buffer
FAR = "memcheck-unmasked-far-overrouted.log"  # 2,667 errors, 129,937 bytes past a 112-byte buffer


def parse(name: str) -> SanitizerReport:
    return parse_sanitizer_log(recorded_2xh200(name))


def test_the_recorded_run_is_present() -> None:
    assert MANIFEST.is_file()
    assert {p.name for p in ALL_LOGS if p.parent == SANITIZER_2XH200} >= {
        "memcheck-builtin-clean.log",
        "memcheck-unmasked-overrouted-cached.log",
        NOCACHE,
        FAR,
        "racecheck-builtin-clean.log",
    }


# --- RECORDED, generic: every log of every recording -------------------------------------------------


@pytest.mark.parametrize("path", ALL_LOGS, ids=rel)
def test_every_recorded_log_parses_and_its_summary_counts_its_records(path: Path) -> None:
    r = parse_sanitizer_log(read(path))
    assert r.recognized and not r.truncated and r.partial_last_line is None
    assert all(e.complete for e in r.errors)
    assert not r.starts_mid_record
    assert r.error_summary is not None or r.racecheck_summary is not None
    if r.error_summary is not None:
        # --print-limit prints the first N and counts the rest in a second summary line
        assert r.records == r.error_summary - r.errors_not_printed
    if r.racecheck_summary is not None and not r.errors_not_printed:
        rs = r.racecheck_summary
        races = [e for e in r.errors if e.category == "race"]
        assert len(races) == rs.displayed == rs.errors + rs.warnings
        assert len([e for e in races if e.severity == "error"]) == rs.errors
    assert r.clean == (not r.errors and not r.error_summary and not r.has_findings)
    assert sum(g.count for g in r.groups) == r.records
    # folded as read: each group's first record and one per kept address stay whole
    assert len(r.errors) == sum(len(g.addresses) + (g.first.address is None) for g in r.groups)
    for e in r.errors:
        # compute-sanitizer's convention: an access at base + size is "1 bytes after"
        if e.address is not None and e.nearest is not None and e.nearest.relation == "after":
            assert e.address - e.nearest.end + 1 == e.nearest.distance
        if e.address is not None and e.nearest is not None and e.nearest.relation == "before":
            assert e.nearest.base - e.address == e.nearest.distance
        assert not e.extra, f"continuation lines the parser did not recognize: {e.extra[:3]}"


@pytest.mark.parametrize("path", ALL_XML, ids=rel)
def test_every_recorded_xml_report_parses(path: Path) -> None:
    """No XML report is recorded yet (the next GPU run adds them): this then checks the reader
    against a real file. Until then pytest reports this test as skipped (empty parameter set)."""
    r = parse_sanitizer_xml(path)
    assert isinstance(r, SanitizerReport)
    sibling = path.with_suffix(".log")
    if sibling.is_file():  # the same run saved as text too: the XML must not lose records
        text = parse_sanitizer_log(read(sibling))
        assert {e.address for e in text.errors} <= {e.address for e in r.errors}


MEMCHECK_PAIRS = [
    p for p in ALL_LOGS if p.name.startswith("memcheck-") and p.with_suffix(".stdout").is_file()
]


@pytest.mark.parametrize("path", MEMCHECK_PAIRS, ids=rel)
def test_recorded_memcheck_log_agrees_with_the_probe_outcome_of_the_same_process(path: Path) -> None:
    """RECORDED: the probe printed its Outcome line under the sanitizer. Errors memcheck reports
    abort the kernel, and the next CUDA call reports an unspecified launch failure."""
    r = parse_sanitizer_log(read(path))
    out = from_json(Outcome, path.with_suffix(".stdout").read_text(encoding="utf-8").strip().splitlines()[-1])
    if r.has_findings:
        assert out.status == "error" and "unspecified launch failure" in (out.error_message or "")
    if out.status == "pass":
        assert r.clean


@pytest.mark.parametrize("path", ALL_LOGS, ids=rel)
def test_any_cut_of_a_recorded_log_parses(path: Path) -> None:
    """DERIVED: the log cut at ~40 places (mid-line included), keeping the front and the back."""
    text = read(path)
    full = parse_sanitizer_log(text)
    full_addresses = {e.address for e in full.errors}
    step = max(1, len(text) // 41)
    for cut in range(0, len(text), step):
        r = parse_sanitizer_log(text[:cut])
        assert r.records <= full.records
        # a value read from a line cut mid-way would be wrong: every address kept is the full log's
        assert {e.address for e in r.errors if e.address is not None} <= full_addresses
        if cut and not text[:cut].endswith("\n"):
            assert r.partial_last_line is not None or not r.truncated
        tail = parse_sanitizer_log(text[cut:])
        assert tail.records <= full.records + 1


# --- RECORDED, specific: the over-routed cell under memcheck, 2x H200 --------------------------------


def test_recorded_far_over_routed_run_with_print_limit_and_python_frames() -> None:
    r = parse(FAR)
    assert r.tool == "memcheck" and not r.legacy_cuda_memcheck
    assert r.error_summary == 2667 and r.errors_not_printed == 2617  # 50 printed
    assert len(r.errors) == 50 and all(e.complete for e in r.errors) and not r.truncated
    assert r.program_lines == 0 and r.streams == ("",)
    (g,) = r.groups
    assert g.count == 50 and g.distinct_addresses == 50 and g.threads == 50
    assert g.kernel == "_grouped_gemm_kernel_unmasked"
    assert g.location is not None
    assert (g.location.pc, g.location.file, g.location.line) == (0x3330, "unmasked_rows.py", 111)
    e = r.errors[0]
    assert (e.category, e.space, e.access, e.size) == ("invalid-access", "global", "write", 16)
    assert (e.thread, e.block) == ((96, 0, 0), (8, 0, 0))
    assert e.address == 0x7F8B00A75000 and e.out_of_bounds and not e.misaligned
    assert e.nearest == NearestAllocation(relation="after", distance=129_937, base=0x7F8B00A55400, size=112)
    assert e.backtrace_at == "kernel launch time"
    assert len(e.host_frames) == 33
    frames = [(h.function, h.file, h.line) for h in e.host_frames if h.file]
    assert frames[:3] == [("__call__", "driver.py", 713), ("run", "jit.py", 744), ("<lambda>", "jit.py", 370)]
    assert ("moe_grouped_gemm", "unmasked_rows.py", 29) in frames
    assert frames[-1] == ("main", "run_probe.py", 29)
    launcher = e.host_frames[0]
    assert (launcher.function, launcher.module, launcher.offset) == (
        "launch",
        "__triton_launcher.cpython-312-x86_64-linux-gnu.so",
        0x2057,
    )
    # "Host Frame:  [0x18218f] in python3": a frame without a symbol
    anonymous = e.host_frames[1]
    assert (anonymous.function, anonymous.module, anonymous.offset) == (None, "python3", 0x18218F)


def test_recorded_one_byte_past_the_output_without_the_caching_allocator() -> None:
    r = parse(NOCACHE)
    assert r.error_summary == 450 and r.errors_not_printed == 400 and len(r.errors) == 50
    (g,) = r.groups
    assert g.location is not None and g.location.pc == 0x3390
    first = r.errors[0]
    assert first.nearest == NearestAllocation(relation="after", distance=1, base=0x7F7CC49A0000, size=131_072)
    assert first.address == first.nearest.end  # the first byte past the allocation
    # 16-byte stores by consecutive threads: the addresses step by 16 from the end of the buffer
    assert [e.nearest.distance for e in r.errors[:4] if e.nearest] == [1, 17, 33, 49]
    assert {e.block for e in r.errors} == {(14, 0, 0)}


@pytest.mark.parametrize(
    ("name", "tool"),
    [
        ("memcheck-builtin-clean.log", None),
        ("memcheck-unmasked-overrouted-cached.log", None),  # the caching allocator hid the writes
        ("racecheck-builtin-clean.log", "racecheck"),
    ],
)
def test_recorded_clean_runs(name: str, tool: str | None) -> None:
    r = parse(name)
    assert r.clean and not r.has_findings and r.tool == tool and not r.errors


def test_location_and_host_frame_forms_from_the_recording() -> None:
    loc = parse_location("_grouped_gemm_kernel_unmasked+0x3390 in unmasked_rows.py:111")
    assert (loc.function, loc.pc, loc.file, loc.line) == (
        "_grouped_gemm_kernel_unmasked",
        0x3390,
        "unmasked_rows.py",
        111,
    )
    assert loc.render() == "_grouped_gemm_kernel_unmasked+0x3390 (unmasked_rows.py:111)"
    h = parse_host_frame("_PyEval_EvalFrameDefault [0x1db2ed] in python3")
    assert (h.function, h.module, h.offset, h.file) == ("_PyEval_EvalFrameDefault", "python3", 0x1DB2ED, None)
    h = parse_host_frame("guarded_forward in _common.py:80")
    assert (h.function, h.file, h.line, h.offset) == ("guarded_forward", "_common.py", 80, None)
    assert h.is_python_source


# --- DERIVED VARIANTS: cut ----------------------------------------------------------------------


def test_every_line_and_mid_line_cut_of_the_first_records() -> None:
    """DERIVED: the banner + first 3 records of the recorded log (with its summary lines), cut at
    every line boundary and in the middle of every line."""
    text = first_records(recorded_2xh200(NOCACHE), 3)
    full = parse_sanitizer_log(text)
    assert len(full.errors) == 3
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line) // 2)  # mid-line
        offsets.append(offsets[-1] - len(line) // 2 + len(line))  # line end
    for cut in offsets:
        r = parse_sanitizer_log(text[:cut])
        assert {e.address for e in r.errors if e.address is not None} <= {e.address for e in full.errors}
        assert {e.nearest for e in r.errors if e.nearest} <= {e.nearest for e in full.errors}
        complete = [e for e in r.errors if e.complete]
        assert complete == list(full.errors[: len(complete)])
        if cut < len(text):
            assert r.truncated or r.error_summary is not None
        assert all(e.complete for e in r.errors[:-1])  # only the record the cut fell in is cut


def test_address_line_cut_mid_number_is_not_read() -> None:
    """DERIVED: the recorded log cut inside the first record's address."""
    text = recorded_2xh200(NOCACHE)
    cut = text.index("0x7f7cc49c0000") + len("0x7f7cc4")
    r = parse_sanitizer_log(text[:cut])
    (e,) = r.errors
    assert e.address is None and not e.complete and r.truncated
    assert e.kernel == "_grouped_gemm_kernel_unmasked"
    assert r.partial_last_line is not None and r.partial_last_line.endswith("0x7f7cc4")


def test_log_cut_at_a_line_boundary_keeps_the_record_marked_cut() -> None:
    """DERIVED: the recorded log's first 5 lines (up to the address line)."""
    lines = recorded_2xh200(NOCACHE).splitlines(keepends=True)
    (e,) = parse_sanitizer_log("".join(lines[:5])).errors
    assert e.address == 0x7F7CC49C0000 and e.nearest is None and not e.complete


def test_summary_without_final_newline_is_still_read() -> None:
    """DERIVED: the recorded clean log without its last newline."""
    r = parse_sanitizer_log(recorded_2xh200("memcheck-builtin-clean.log").rstrip("\n"))
    assert r.clean and r.partial_last_line is None


def test_log_starting_mid_record_is_flagged() -> None:
    """DERIVED: the recorded log without its banner and the first 3 lines of its first record."""
    text = first_records(recorded_2xh200(NOCACHE), 3)
    lines = text.splitlines(keepends=True)
    r = parse_sanitizer_log("".join(lines[4:]))
    assert r.starts_mid_record
    full = parse_sanitizer_log(text)
    assert [e.address for e in r.errors] == [e.address for e in full.errors[1:]]


# --- DERIVED VARIANTS: interleaved and prefixed ----------------------------------------------------


def _records(r: SanitizerReport) -> list[tuple[object, ...]]:
    return [
        (e.category, e.kernel, e.address, e.size, e.thread, e.nearest, len(e.host_frames)) for e in r.errors
    ]


@pytest.mark.parametrize("path", ALL_LOGS, ids=rel)
def test_program_output_interleaved_at_random_lines(path: Path) -> None:
    """DERIVED: lines of our recorded traceback dropped between the sanitizer's lines change nothing."""
    text = read(path)
    noise = [ln for ln in far_overrouted_traceback().splitlines() if ln.strip()]
    rng = random.Random(path.name)
    mixed: list[str] = []
    for i, line in enumerate(text.splitlines(keepends=True)):
        if i % 2 == 0 or rng.random() < 0.3:
            mixed.append(rng.choice(noise) + "\n")
        mixed.append(line)
    r = parse_sanitizer_log("".join(mixed))
    full = parse_sanitizer_log(text)
    assert _records(r) == _records(full)
    assert (r.error_summary, r.errors_not_printed, r.racecheck_summary) == (
        full.error_summary,
        full.errors_not_printed,
        full.racecheck_summary,
    )
    assert r.program_lines > full.program_lines


def far_overrouted_traceback() -> str:
    return recorded_2xh200("traceback-unmasked-far-overrouted.stderr")


def test_two_processes_interleaved_line_by_line_with_rank_prefixes() -> None:
    """DERIVED: two recorded logs (first 3 records each) prefixed ``[rank0]: `` / ``[rank1]: `` and
    merged one line from each in turn; the last line loses its newline (a partial line)."""
    a_text, b_text = first_records(recorded_2xh200(NOCACHE), 3), first_records(recorded_2xh200(FAR), 3)
    mixed = interleave(prefixed(a_text, "[rank0]: "), prefixed(b_text, "[rank1]: "))
    r = parse_sanitizer_log("\n".join(mixed))
    assert r.streams == ("[rank0]:", "[rank1]:")
    by_stream = {s: [e for e in r.errors if e.stream == s] for s in r.streams}
    a, b = parse_sanitizer_log(a_text), parse_sanitizer_log(b_text)
    assert _records(SanitizerReport(errors=tuple(by_stream["[rank0]:"]))) == _records(a)
    # rank1's log is the longer one, so its last summary line is the text's last line: whole
    # even without a newline, since its count is complete; both processes' summaries add up
    assert _records(SanitizerReport(errors=tuple(by_stream["[rank1]:"]))) == _records(b)
    assert r.error_summary == 450 + 2667 and r.errors_not_printed == 400 + 2617


def test_worker_tags_in_parentheses_and_indentation() -> None:
    """DERIVED: the recorded log with a worker tag of our own wording before every line, two
    workers, then the same log indented by two spaces."""
    text = first_records(recorded_2xh200(NOCACHE), 2)
    lines = text.splitlines()
    tagged = interleave(
        [f"(Worker rank=0 pid=101) {ln}" for ln in lines], [f"(Worker rank=1 pid=202) {ln}" for ln in lines]
    )
    r = parse_sanitizer_log("\n".join(tagged) + "\n")
    assert len(r.streams) == 2 and r.records == 4 and sum(g.count for g in r.groups) == 4
    r = parse_sanitizer_log("".join("  " + ln + "\n" for ln in lines))
    assert _records(r) == _records(parse_sanitizer_log(text))


def test_longer_rules_of_equals_signs_are_not_sanitizer_lines() -> None:
    """DERIVED: a pytest-style rule (30 '=') before the recorded clean log."""
    text = "=" * 30 + " 3 passed " + "=" * 30 + "\n" + recorded_2xh200("memcheck-builtin-clean.log")
    r = parse_sanitizer_log(text)
    assert r.program_lines == 1 and r.error_summary == 0 and r.clean


def test_collector_timestamps_do_not_split_one_process() -> None:
    """DERIVED: a container-log timestamp, different on every line, before each recorded line."""
    lines = first_records(recorded_2xh200(NOCACHE), 2).splitlines()
    stamped = [f"2026-11-22T00:47:10.{i:09d}+00:00 stderr F {ln}" for i, ln in enumerate(lines)]
    r = parse_sanitizer_log("\n".join(stamped) + "\n")
    assert r.streams == ("",)
    assert len(r.errors) == 2 and r.errors[0].address == 0x7F7CC49C0000


# --- DERIVED VARIANTS: re-worded lines (forms other releases print) ----------------------------------


def test_older_address_wording() -> None:
    """DERIVED: 'Access to 0x...' re-worded to the older 'Address 0x...'."""
    text = first_records(recorded_2xh200(NOCACHE), 3)
    variant = older_address_wording(text)
    assert "Access to" not in variant and "Address 0x7f7cc49c0000 is out of bounds" in variant
    assert _records(parse_sanitizer_log(variant)) == _records(parse_sanitizer_log(text))
    assert all(e.out_of_bounds for e in parse_sanitizer_log(variant).errors)


def test_access_at_wording_and_no_nearest_allocation() -> None:
    """DERIVED: 'Access to' re-worded 'Access at', and the nearest-allocation lines removed (older
    releases print none)."""
    text = first_records(recorded_2xh200(NOCACHE), 2).replace("Access to 0x", "Access at 0x")
    text = "".join(ln for ln in text.splitlines(keepends=True) if "nearest allocation" not in ln)
    r = parse_sanitizer_log(text)
    assert [e.address for e in r.errors] == [0x7F7CC49C0000, 0x7F7CC49C0010]
    assert all(e.nearest is None and e.out_of_bounds and not e.extra for e in r.errors)


@pytest.mark.parametrize(
    ("replacement", "expected"),
    [
        (
            "and is 2,147,483,904 bytes before the nearest allocation at 0x7f7d00000000 of size 6,442,450,944 bytes",
            NearestAllocation(
                relation="before", distance=2_147_483_904, base=0x7F7D00000000, size=6_442_450_944
            ),
        ),
        (
            "and is inside the nearest allocation at 0x7f7cc49a0000 of size 262,144 bytes",
            NearestAllocation(relation="inside", distance=0, base=0x7F7CC49A0000, size=262_144),
        ),
        (
            "and is 1 byte after the nearest allocation at 0x7f7cc49a0000 of size 131072 bytes",
            NearestAllocation(relation="after", distance=1, base=0x7F7CC49A0000, size=131_072),
        ),
    ],
    ids=["before", "inside", "singular-no-separators"],
)
def test_nearest_allocation_relations(replacement: str, expected: NearestAllocation) -> None:
    """DERIVED: the recorded record's nearest-allocation line replaced by the 'before' and
    'inside' forms (numbers ours), and by 'byte'/no thousands separators."""
    text = first_records(recorded_2xh200(NOCACHE), 1)
    variant = re.sub(r"and is 1 bytes after the nearest allocation.*", replacement, text, count=1)
    (e,) = parse_sanitizer_log(variant).errors
    assert e.nearest == expected


def test_shared_space_and_misaligned_wording() -> None:
    """DERIVED: '__global__' re-worded '__shared__', and 'is out of bounds' re-worded 'is misaligned'."""
    text = first_records(recorded_2xh200(NOCACHE), 1)
    (e,) = parse_sanitizer_log(text.replace("__global__", "__shared__")).errors
    assert (e.space, e.access, e.size) == ("shared", "write", 16)
    (e,) = parse_sanitizer_log(text.replace("is out of bounds", "is misaligned")).errors
    assert e.misaligned and not e.out_of_bounds


def test_xml_reader_reads_record_lines_inside_elements() -> None:
    """DERIVED: no XML report is recorded yet, so the recorded text log's record lines are wrapped
    in elements of our own naming; the reader assumes no element names. Then the XML cut in half."""
    lines = first_records(recorded_2xh200(NOCACHE), 3).splitlines()
    body = "".join(f"<line>{escape(ln.split('=========', 1)[1])}</line>" for ln in lines)
    r = parse_sanitizer_xml(f"<ComputeSanitizerOutput>{body}</ComputeSanitizerOutput>")
    assert r.error_summary == 450 and r.errors_not_printed == 400
    assert [e.address for e in r.errors] == [0x7F7CC49C0000, 0x7F7CC49C0010, 0x7F7CC49C0020]
    assert r.errors[0].nearest == NearestAllocation(
        relation="after", distance=1, base=0x7F7CC49A0000, size=131_072
    )
    cut = parse_sanitizer_xml(f"<ComputeSanitizerOutput>{body}"[: len(body) // 2])
    assert cut.truncated and len(cut.errors) <= 3


def test_xml_reader_reads_a_saved_file(tmp_path: Path) -> None:
    """DERIVED: the same wrapping, saved as a file (the reader takes a path, like --save writes)."""
    lines = recorded_2xh200("memcheck-builtin-clean.log").splitlines()
    body = "".join(f"<line>{escape(ln.split('=========', 1)[1])}</line>" for ln in lines)
    f = tmp_path / "clean.xml"
    f.write_text(f"<?xml version='1.0'?><ComputeSanitizerOutput>{body}</ComputeSanitizerOutput>")
    assert parse_sanitizer_xml(f).clean
    assert parse_sanitizer_xml(str(f)).clean


def test_empty_and_foreign_text() -> None:
    r = parse_sanitizer_log("")
    assert not r.recognized and not r.errors
    r = parse_sanitizer_log(recorded_2xh200("traceback-unguarded-nopeer.stderr"))  # RECORDED traceback, no log
    assert not r.recognized and r.program_lines > 0 and not r.errors


# --- HAND-WRITTEN FORMAT SAMPLES: record kinds we have not recorded yet (tests/unit/format_samples.py)


def test_sample_racecheck_hazards_and_summary() -> None:
    """HAND-WRITTEN FORMAT SAMPLE (no racecheck hazard is recorded yet)."""
    r = parse_sanitizer_log(RACE_SAMPLE)
    assert r.tool == "racecheck" and not r.truncated
    a, b = r.errors
    assert (a.severity, b.severity) == ("error", "warning")
    assert [(x.access, x.location.pc, x.location.line, x.hazards) for x in a.race_accesses] == [
        ("write", 0x1A0, 40, None),
        ("read", 0x2B0, 52, 128),
        ("read", 0x2C0, 53, 64),
    ]
    assert a.hazards == 192 and a.kernel == "tile_kernel"
    assert r.racecheck_summary is not None
    assert (r.racecheck_summary.displayed, r.racecheck_summary.errors, r.racecheck_summary.warnings) == (
        2,
        1,
        1,
    )
    assert r.has_findings and not r.clean


def test_sample_program_hit_api_error() -> None:
    """HAND-WRITTEN FORMAT SAMPLE (no API-error record is recorded yet)."""
    r = parse_sanitizer_log(API_SAMPLE)
    (e,) = r.errors
    assert (e.category, e.cuda_error, e.cuda_error_code, e.cuda_error_text, e.api_call) == (
        "api-error",
        "cudaErrorLaunchFailure",
        719,
        "unspecified launch failure",
        "cudaEventSynchronize",
    )
    assert e.backtrace_at == "error" and e.host_frames[0].module == "libcudart.so.13"
    assert r.tool == "memcheck"


def test_sample_initcheck_uninitialized_read_and_host_api_error() -> None:
    """HAND-WRITTEN FORMAT SAMPLE (no initcheck run is recorded yet)."""
    r = parse_sanitizer_log(INITCHECK_SAMPLE)
    a, b = r.errors
    assert (a.category, a.space, a.access, a.size) == ("uninitialized", "global", "read", 4)
    assert a.address == 0x7F0000000400 and not a.out_of_bounds
    assert (b.category, b.address) == ("api-memory", 0x7F0000001000)
    assert r.tool == "initcheck" and r.error_summary == 2


def test_sample_legacy_cuda_memcheck_record() -> None:
    """HAND-WRITTEN FORMAT SAMPLE of the pre-2021 cuda-memcheck layout: size without 'bytes',
    '0xPC in FUNCTION(ARGS)', a Device Frame naming the __global__ kernel, old host frames."""
    r = parse_sanitizer_log(LEGACY_SAMPLE)
    assert r.legacy_cuda_memcheck and r.error_summary == 1
    (e,) = r.errors
    assert e.size == 4 and e.address == 0x7F0000000004 and e.out_of_bounds and e.nearest is None
    assert e.location is not None and e.location.pc == 0x2E8
    assert short_function_name(e.location.function or "") == "inner_step"
    assert short_function_name(e.kernel or "") == "outer_kernel"  # the outermost device frame
    assert e.device_frames[0].pc == 0xA0
    assert [(h.function, h.module, h.offset) for h in e.host_frames] == [
        ("cuLaunchKernel", "/usr/lib64/libcuda.so.1", 0x222DD8),
        (None, "./app", 0x1F00),
    ]


def test_sample_notes_and_unknown_top_level_records() -> None:
    """HAND-WRITTEN FORMAT SAMPLE: a tool note and a record kind the parser has no pattern for
    (kept as 'other', never dropped; 'barrier' makes the tool synccheck)."""
    r = parse_sanitizer_log(NOTES_SAMPLE)
    assert r.notes == ("Warning: hand-written tool note (the parser keeps such lines as notes)",)
    (e,) = r.errors
    assert e.category == "other" and e.location is not None and e.location.line == 9
    assert r.tool == "synccheck"


def test_sample_version_banner_in_program_output() -> None:
    """HAND-WRITTEN FORMAT SAMPLE: the version line ``compute-sanitizer --version`` prints, when a
    user pastes it above the log."""
    text = "NVIDIA (R) Compute Sanitizer\nVersion 2025.3.1.0 (build 0) (public-release)\n"
    r = parse_sanitizer_log(text + recorded_2xh200("memcheck-builtin-clean.log"))
    assert r.version == "2025.3.1.0" and r.clean


def test_old_location_forms() -> None:
    """HAND-WRITTEN FORMAT SAMPLES of the location forms older releases print."""
    loc = parse_location("0xda0 in /src/grouped.py:175:grouped_kernel")
    assert (loc.function, loc.pc, loc.file, loc.line) == ("grouped_kernel", 0xDA0, "/src/grouped.py", 175)
    loc = parse_location("0x3b0 in void k<int>(int*, int)")
    assert (loc.pc, short_function_name(loc.function or "")) == (0x3B0, "k")
    loc = parse_location("helper in helper.h:236")
    assert (loc.function, loc.pc, loc.file, loc.line) == ("helper", None, "helper.h", 236)
    assert short_function_name("void ns::Outer<int, (int)1>::inner<(bool)0>(T1, int)") == "ns::Outer::inner"


# --- command construction -----------------------------------------------------------------------

INFO = SanitizerInfo(path="/opt/cs/compute-sanitizer", version="2025.3.1.0", found_via="PATH")


def test_command_with_every_option() -> None:
    cmd = sanitizer_command(
        INFO,
        SanitizerTool.MEMCHECK,
        ["python", "-m", "qmoe_doctor.probes.worker"],
        kernel_regex="grouped_gemm.*",
        launch_count=1,
        launch_skip=2,
        xml_path=Path("/tmp/r.xml"),
        log_path="/tmp/r.log",
        print_limit=100,
        error_exitcode=9,
        target_processes_all=True,
    )
    assert cmd == [
        "/opt/cs/compute-sanitizer",
        "--tool",
        "memcheck",
        "--kernel-name",
        "regex=grouped_gemm.*",
        "--launch-count",
        "1",
        "--launch-skip",
        "2",
        "--print-limit",
        "100",
        "--error-exitcode",
        "9",
        "--target-processes",
        "all",
        "--xml",
        "--save",
        "/tmp/r.xml",
        "--log-file",
        "/tmp/r.log",
        "python",
        "-m",
        "qmoe_doctor.probes.worker",
    ]
    assert "--kernel-regex" not in cmd


def test_command_minimal_and_tool_names() -> None:
    assert sanitizer_command(INFO, "racecheck", ["./a"]) == [INFO.path, "--tool", "racecheck", "./a"]
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        assert sanitizer_command(INFO, tool, ["x"])[2] == tool


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel_regex": "a,b"},
        {"kernel_regex": ""},
        {"launch_count": 0},
        {"launch_skip": -1},
        {"print_limit": -1},
    ],
)
def test_command_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        sanitizer_command(INFO, "memcheck", ["x"], **kwargs)  # type: ignore[arg-type]


def test_command_rejects_unknown_tool_and_empty_argv() -> None:
    with pytest.raises(ValueError):
        sanitizer_command(INFO, "leakcheck", ["x"])
    with pytest.raises(ValueError):
        sanitizer_command(INFO, "memcheck", [])


# --- finding the binary -------------------------------------------------------------------------


def _fake_sanitizer(directory: Path, version_line: str | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "compute-sanitizer"
    banner = "NVIDIA (R) Compute Sanitizer\n"
    if version_line:
        banner += version_line + "\n"
    lines = ["#!/bin/sh", 'if [ "$1" = "--version" ]; then']
    lines += [f"  echo {shlex.quote(line)}" for line in banner.splitlines()]
    lines += ["fi", ""]
    exe.write_text("\n".join(lines))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


def test_finds_binary_on_path_and_reads_version(tmp_path: Path) -> None:
    exe = _fake_sanitizer(tmp_path / "bin", "Version 2025.3.1.0 (build 1) (public-release)")
    info = find_compute_sanitizer(env={"PATH": str(tmp_path / "bin")}, search_dirs=[])
    assert info is not None
    assert (info.path, info.version, info.found_via) == (str(exe), "2025.3.1.0", "PATH")
    assert info.version_tuple == (2025, 3, 1, 0)


def test_env_knob_wins_and_a_wrong_one_is_not_papered_over(tmp_path: Path) -> None:
    on_path = _fake_sanitizer(tmp_path / "bin", "Version 2024.3.0.0")
    explicit = _fake_sanitizer(tmp_path / "other", "Version 2025.1.0.0")
    env = {"PATH": str(on_path.parent), knobs.QMOE_SANITIZER: str(explicit)}
    info = find_compute_sanitizer(env=env, search_dirs=[])
    assert info is not None and info.path == str(explicit) and info.version == "2025.1.0.0"
    assert info.found_via == knobs.QMOE_SANITIZER
    env[knobs.QMOE_SANITIZER] = str(tmp_path / "missing" / "compute-sanitizer")
    assert find_compute_sanitizer(env=env, search_dirs=[]) is None


def test_falls_back_to_cuda_home_then_search_dirs(tmp_path: Path) -> None:
    home = tmp_path / "cuda-12.8"
    exe = _fake_sanitizer(home / "bin", "Version 2025.1.0.0")
    info = find_compute_sanitizer(env={"PATH": "", "CUDA_HOME": str(home)}, query_version=False)
    assert (
        info is not None and info.path == str(exe) and info.found_via == "CUDA_HOME" and info.version is None
    )
    other = _fake_sanitizer(tmp_path / "opt" / "bin", None)
    info = find_compute_sanitizer(env={"PATH": ""}, search_dirs=[(str(other.parent), "opt")])
    assert info is not None and info.path == str(other) and info.version is None


def test_not_found(tmp_path: Path) -> None:
    assert find_compute_sanitizer(env={"PATH": str(tmp_path)}, search_dirs=[]) is None
    plain = tmp_path / "compute-sanitizer"
    plain.write_text("not executable")
    os.chmod(plain, 0o644)
    assert find_compute_sanitizer(env={"PATH": str(tmp_path)}, search_dirs=[]) is None


# --- attribution: RECORDED tensor tables and addresses --------------------------------------------


def outcome_of(name: str) -> Outcome:
    """The probe's Outcome JSON line, printed by the same process that memcheck watched."""
    line = path_2xh200(name).read_text(encoding="utf-8").strip().splitlines()[-1]
    return from_json(Outcome, line)


def output_from_nearest(e_nearest: NearestAllocation, rows: int, cols: int) -> TensorInfo:
    """The kernel's output y (rows x cols bf16), which the probe does not list: built from the
    recorded nearest-allocation line (its base and size are y's)."""
    assert e_nearest.size == rows * cols * 2
    return TensorInfo(
        name="y",
        device="cuda:0",
        data_ptr=e_nearest.base,
        nbytes=e_nearest.size,
        shape=(rows, cols),
        strides=(cols, 1),
        dtype="bfloat16",
    )


def test_attribute_the_recorded_writes_to_the_output_rows_past_m() -> None:
    """RECORDED: the log and the Outcome line of one process (memcheck, over-routed, no caching
    allocator). x, w and m_sizes come from the Outcome; y from the log's nearest allocation."""
    r = parse(NOCACHE)
    out = outcome_of("memcheck-unmasked-overrouted-nocache.stdout")
    assert out.status == "error" and [t.name for t in out.tensors] == ["x", "w", "m_sizes"]
    first = r.errors[0]
    assert first.nearest is not None
    shape = out.spec.shape
    y = output_from_nearest(first.nearest, shape.m, shape.n)
    # the output was allocated after the weights: the 1 byte past it is none of the inputs
    assert all(not (t.data_ptr <= first.nearest.end < t.data_ptr + t.nbytes) for t in out.tensors)
    attributions = attribute(r, {"cuda:0": [*out.tensors, y]})
    assert len(attributions) == 50  # one per distinct address of the one group
    a = attributions[0]
    assert (a.kernel, a.access, a.address) == (
        "_grouped_gemm_kernel_unmasked",
        "write of 16 bytes",
        0x7F7CC49C0000,
    )
    best = a.matches[0]
    assert (best.tensor, best.relation, best.gap, best.region, best.row) == ("y", "after", 0, 131_072, 256)
    # AddressSanitizer's count: the first byte after the region is "0 bytes after" (the log says "1 bytes after")
    assert a.sentences[0] == (
        "write 0 bytes after the 131,072-byte region of y (256 x 256 bf16) on cuda:0: row 256, i.e. rows past "
        "M=256 (m_sizes summing past M fits)."
    )
    assert [(f.cause, f.cell) for f in best.fits] == [("invalid-routing", "over-routed")]
    assert a.sanitizer_device == "cuda:0" and not a.cross_device and a.inside_devices == ()
    # our byte distance is compute-sanitizer's less the one it counts for the first byte after,
    # record by record
    for att, e in zip(attributions, r.errors, strict=True):
        assert e.nearest is not None and e.nearest.relation == "after"
        assert att.address == e.address and att.matches[0].gap == e.nearest.gap == e.nearest.distance - 1
        assert att.matches[0].reach == e.nearest.distance


def test_attribute_the_recorded_far_writes_against_the_logged_allocation() -> None:
    """RECORDED: far over-routing (m_sizes sum 1,048,832 rows for 256). The 112-byte allocation
    named by the log is not one of the Outcome's tensors; placed as one, the distance agrees."""
    r = parse(FAR)
    out = outcome_of("memcheck-unmasked-far-overrouted.stdout")
    assert out.facts["m_sizes_sum"] == 1_048_832
    e = r.errors[0]
    assert e.nearest is not None and e.address is not None
    small = TensorInfo(
        name="alloc112",
        device="cuda:0",
        data_ptr=e.nearest.base,
        nbytes=112,
        shape=(56,),
        strides=(1,),
        dtype="bfloat16",
    )
    a = attribute_address(e.address, {"cuda:0": [*out.tensors, small]}, access="write of 16 bytes")
    assert (a.matches[0].tensor, a.matches[0].gap) == ("alloc112", 129_936)  # the log: "129,937 bytes after"
    assert a.sentences[0].startswith("write 129,936 bytes after the 112-byte region of alloc112 (56 bf16) on cuda:0")


def scan_tensors(scan: str, probe_id: str) -> list[TensorInfo]:
    """RECORDED: the tensor table of one outcome of a saved scan report."""
    doc = json.loads((RECORDED / "scan" / "2026-11-22-2xh200-7ada31c" / scan).read_text(encoding="utf-8"))
    (o,) = [o for o in doc["outcomes"] if o["probe_id"] == probe_id]
    return [from_jsonable(TensorInfo, t) for t in o["tensors"]]


TABLE = scan_tensors("scan-unguarded.json", "0->1/no-peer")  # x (4096, 2048), w (128, 1536, 2048), m_sizes
X, W, SIZES = TABLE


def test_recorded_scan_table_shapes() -> None:
    assert [t.name for t in TABLE] == ["x", "w", "m_sizes"]
    assert (X.shape, W.shape, SIZES.shape) == ((4096, 2048), (128, 1536, 2048), (128,))
    assert {t.device for t in TABLE} == {"cuda:1"}


def test_one_byte_past_x_is_row_m() -> None:
    a = attribute_address(X.data_ptr + X.nbytes, {"cuda:1": TABLE}, access="read of 16 bytes")
    best = a.matches[0]
    assert (best.tensor, best.relation, best.gap, best.row) == ("x", "after", 0, 4096)
    assert a.sentences[0].startswith(
        "read 0 bytes after the 16,777,216-byte region of x (4096 x 2048 bf16) on cuda:1: row 4096"
    )
    assert "m_sizes summing past M" in a.sentences[0]
    assert not a.cross_device


def test_address_inside_the_weight_stack_names_expert_and_row() -> None:
    n, k = 1536, 2048
    addr = W.data_ptr + (17 * n * k + 3 * k + 5) * 2
    a = attribute_address(addr, {"cuda:1": TABLE})
    m = a.matches[0]
    assert (m.tensor, m.relation, m.expert, m.row) == ("w", "inside", 17, 3)
    assert "expert 17, row 3" in a.sentences[0]


def test_past_the_weight_stack_is_an_expert_id_out_of_range() -> None:
    a = attribute_address(W.data_ptr + W.nbytes + 64, {"cuda:1": [W]}, access="read of 16 bytes")
    m = a.matches[0]
    assert (m.relation, m.gap, m.expert) == ("after", 64, 128)
    assert "expert 128 of 128" in a.sentences[0] and "expert id >= 128" in a.sentences[0]
    # two causes fit: no one of them is named from this address alone
    assert [f.cause for f in m.fits] == ["invalid-routing", "int32-offset-overflow"]


def test_before_the_weight_stack_is_a_negative_expert() -> None:
    a = attribute_address(W.data_ptr - 2**20, {"cuda:1": [W]})
    m = a.matches[0]
    assert (m.relation, m.gap, m.expert) == ("before", 2**20, -1)
    # 128 x 1536 x 2048 elements do not reach 2**31: a -1 sentinel expert id fits as well as a wrap
    assert "(an int32 product that wrapped or a -1 sentinel expert id fits)" in a.sentences[0]
    assert [f.cause for f in m.fits] == ["int32-offset-overflow", "invalid-routing"]


def test_before_a_stack_of_2_31_elements_only_a_wrapped_int32_product_fits() -> None:
    big = dataclasses.replace(W, shape=(160, 5120, 6144), strides=(5120 * 6144, 6144, 1), nbytes=160 * 5120 * 6144 * 2)
    m = attribute_address(big.data_ptr - 2**20, {"cuda:1": [big]}).matches[0]
    assert [(f.cause, f.cell) for f in m.fits] == [("int32-offset-overflow", "int32-boundary")]


def test_before_the_start_gives_a_negative_row_and_elements_of_a_vector() -> None:
    a = attribute_address(X.data_ptr - 3, {"cuda:1": [X]})
    assert (a.matches[0].relation, a.matches[0].gap, a.matches[0].row) == ("before", 3, -1)
    assert a.sentences[0].startswith("accessed 3 bytes before the 16,777,216-byte region of x")
    assert a.matches[0].fits == ()  # a negative row: no cause is named from it
    a = attribute_address(SIZES.data_ptr + 4 * 7, {"cuda:1": [SIZES]})
    assert (a.matches[0].relation, a.matches[0].row, a.matches[0].gap) == ("inside", 7, 28)
    assert a.sentences[0].startswith("accessed 28 bytes inside the 512-byte region of m_sizes")
    assert a.sentences[0].endswith("element 7.")


def _moved(table: list[TensorInfo], device: str, shift: int) -> list[TensorInfo]:
    """SYNTHETIC: the recorded table as if a second GPU held the same tensors at other addresses."""
    return [
        TensorInfo(
            name=t.name,
            device=device,
            data_ptr=t.data_ptr + shift,
            nbytes=t.nbytes,
            shape=t.shape,
            strides=t.strides,
            dtype=t.dtype,
        )
        for t in table
    ]


def test_cross_device_address_is_flagged() -> None:
    """The address is x on cuda:1; compute-sanitizer measured it against an allocation on cuda:0
    (a second table made from the recorded one, moved 1 TiB down)."""
    other = _moved(TABLE, "cuda:0", -(2**40))
    addr = X.data_ptr + 4096
    nearest = NearestAllocation(relation="after", distance=123, base=other[0].data_ptr, size=other[0].nbytes)
    a = attribute_address(addr, {"cuda:0": other, "cuda:1": TABLE}, nearest=nearest)
    assert a.inside_devices == ("cuda:1",)
    assert a.sanitizer_device == "cuda:0"
    assert a.cross_device
    assert a.matches[0].device == "cuda:1" and a.matches[0].relation == "inside"
    assert {m.device for m in a.matches} == {"cuda:0", "cuda:1"}  # the nearest on every device
    assert any("inside a live tensor on another GPU (cuda:1)" in s for s in a.sentences)
    assert any("ran on cuda:0" in s for s in a.sentences)


def test_cross_device_without_the_sanitizer_allocation() -> None:
    a = attribute_address(X.data_ptr, {"cuda:0": _moved(TABLE, "cuda:0", -(2**40)), "cuda:1": TABLE})
    assert a.cross_device and a.sanitizer_device is None


def test_inside_the_measured_device_points_at_unmapped_memory() -> None:
    nearest = NearestAllocation(relation="inside", distance=0, base=X.data_ptr, size=X.nbytes)
    a = attribute_address(X.data_ptr + 64, {"cuda:1": TABLE}, nearest=nearest)
    assert not a.cross_device and a.sanitizer_device == "cuda:1"
    assert any("expandable segments" in s for s in a.sentences)


def test_no_tensors_known() -> None:
    a = attribute_address(0x1234, {})
    assert not a.matches and "no tensor is known" in a.sentences[0]
