"""`qmoe-doctor run`: every sticky CUDA error is a CUDA error, and no run that met one, or whose
sanitizer pass found an error, ends "No finding".

The records: the launch monitor's record of the run pass of ``run-unmasked`` (one H100,
2026-11-25, monitor-records/2026-11-25-h100-e9d91ec/unmasked/run: an over-routed kernel that
ended in ``AcceleratorError: CUDA error: an illegal memory access was encountered``), DERIVED to
the error a persistent TMA-descriptor kernel over-routed the same way ended in on an H100
(FINDINGS.md, 2026-12-06: ``CUDA error: an illegal instruction was encountered``), in the shape
this monitor writes (a ``cuda-error`` end) and in the shape a monitor that did not know the
error wrote (a plain exception, no CUDA error recorded): the report of that run said "no fault to
aim at" and ended "No finding". And a program on the Triton interpreter that raises the error
after its launches, as a CUDA fault surfaces at a later call.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from recorded_logs import FIXTURES
from rich.console import Console

from qmoe_doctor.cli.render.run import render_run, summary_line
from qmoe_doctor.core import knobs
from qmoe_doctor.core.error_kind import CUDA_ERROR_OF, CUDA_ERRORS, CudaError
from qmoe_doctor.core.launches import EndKind, ProcessRecord
from qmoe_doctor.core.records import ErrorKind, from_jsonable
from qmoe_doctor.core.reports import RunPass, RunReport, SanitizerRun
from qmoe_doctor.diagnose import run_findings
from qmoe_doctor.monitor.writer import end_of
from qmoe_doctor.reports.run_junit import run_junit_text
from qmoe_doctor.workflows.run import RunOptions, run_program

pytestmark = pytest.mark.timeout(240)

RUN_RECORD = FIXTURES / "monitor-records" / "2026-11-25-h100-e9d91ec" / "unmasked" / "run" / "process-3111-a153b5d2.json"
RECORDED_TEXT = "an illegal memory access was encountered"
RECORDED_NAME = "cudaErrorIllegalAddress"
ILLEGAL_INSTRUCTION = CUDA_ERROR_OF[ErrorKind.ILLEGAL_INSTRUCTION]


def record(e: CudaError, *, old_monitor: bool = False) -> ProcessRecord:
    """DERIVED: the recorded run-pass record with ``e``'s text and enum name; ``old_monitor``: as a
    monitor that did not know the error wrote it."""
    raw = RUN_RECORD.read_text()
    assert RECORDED_TEXT in raw and RECORDED_NAME in raw
    doc: dict[str, Any] = json.loads(raw.replace(RECORDED_TEXT, e.text or "").replace(RECORDED_NAME, e.runtime))
    doc["end"]["error_kind"] = str(e.kind)
    if old_monitor:
        doc["end"].update(kind="exception", error_kind=None)
        doc["cuda_error"] = ""
    return from_jsonable(ProcessRecord, doc)


def report(processes: tuple[ProcessRecord, ...], *, sanitizer: SanitizerRun | None = None, exit_code: int = 1) -> RunReport:
    first = RunPass(
        label="run",
        argv=("python3", "examples/qwen3_moe_device_map.py"),
        exit_code=exit_code,
        end=f"exited with status {exit_code}",
        wall_s=20.0,
        processes=processes,
        cuda_errors=run_findings.cuda_errors(processes, blocking=False),
    )
    return RunReport(
        command=first.argv,
        started="2026-12-06T00:00:00+00:00",
        wall_s=20.0,
        exit_code=exit_code,
        command_exit=exit_code,
        passes=(first,),
        sanitizer=sanitizer,
    )


def rendered(r: RunReport) -> str:
    console = Console(record=True, width=200)
    render_run(console, r)
    return console.export_text()


class AcceleratorError(RuntimeError):
    """torch.AcceleratorError's name, as the monitor writes it (``type(exc).__name__``)."""


@pytest.mark.parametrize("e", [e for e in CUDA_ERRORS if e.text], ids=lambda e: str(e.kind))
def test_the_monitor_ends_a_process_on_each_cuda_error_as_a_cuda_error(e: CudaError) -> None:
    end = end_of(AcceleratorError(f"CUDA error: {e.text}\nSearch for `{e.runtime}' in https://docs.nvidia.com/"), seq=7)
    assert end.kind is EndKind.CUDA_ERROR and end.error_kind is e.kind and end.seq == 7


@pytest.mark.parametrize("old_monitor", [False, True], ids=["this-monitor", "old-monitor"])
def test_an_illegal_instruction_is_a_cuda_error_the_sanitizer_aims_at(old_monitor: bool) -> None:
    rec = record(ILLEGAL_INSTRUCTION, old_monitor=old_monitor)
    (error,) = run_findings.cuda_errors([rec], blocking=False)
    assert error.error_kind is ErrorKind.ILLEGAL_INSTRUCTION
    assert "CUDA error: an illegal instruction was encountered" in error.message
    assert [launch.kernel for launch in error.last_launches] == ["_grouped_gemm_kernel_unmasked"]
    targets = run_findings.sanitizer_targets([error], [], [rec])
    assert targets is not None
    assert targets.why == "the kernels launched just before the CUDA error"  # never "no fault to aim at"
    assert targets.kernels == ("_grouped_gemm_kernel_unmasked",)


def test_it_is_reported_exactly_as_the_recorded_illegal_address() -> None:
    recorded = from_jsonable(ProcessRecord, json.loads(RUN_RECORD.read_text()))
    (ref,) = run_findings.cuda_errors([recorded], blocking=False)
    (error,) = run_findings.cuda_errors([record(ILLEGAL_INSTRUCTION)], blocking=False)
    assert ref.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert (error.process, error.last_launches, error.note) == (ref.process, ref.last_launches, ref.note)


@pytest.mark.parametrize("old_monitor", [False, True], ids=["this-monitor", "old-monitor"])
def test_a_run_that_died_of_a_cuda_error_never_ends_no_finding(old_monitor: bool) -> None:
    r = report((record(ILLEGAL_INSTRUCTION, old_monitor=old_monitor),))
    assert not r.healthy
    text = rendered(r)
    assert "No finding" not in text
    assert text.rstrip().splitlines()[-1] == "0 diagnoses, 1 CUDA error; exit 1"
    assert "CUDA error in pid 3111 (run pass)" in text
    junit = ET.fromstring(run_junit_text(r))
    assert [e.get("type") for e in junit.iter("error")] == ["illegal-instruction"]


def test_sanitizer_errors_alone_never_end_no_finding() -> None:
    """The first public kernel over-routed (FINDINGS.md, 2026-11-25): no crash, no CUDA error in
    the run pass; memcheck with the caching allocator off places the writes past y."""
    clean = from_jsonable(ProcessRecord, {**json.loads(RUN_RECORD.read_text()), "end": {"kind": "exit"}, "cuda_error": ""})
    memcheck = SanitizerRun(ran=True, note="450 errors; 64 of the 64 distinct invalid addresses ...", errors=450)
    r = report((clean,), sanitizer=memcheck, exit_code=0)
    assert r.cuda_errors == () and r.diagnoses == ()
    assert not r.healthy and r.sanitizer_errors == 450
    assert summary_line(r).plain == "0 diagnoses, 0 CUDA errors, 450 compute-sanitizer errors; exit 0"
    suite = ET.fromstring(run_junit_text(r)).find("testsuite")
    assert suite is not None and suite.get("failures") == "1"
    # a clean memcheck (or one that did not run) leaves the run healthy
    assert report((clean,), sanitizer=SanitizerRun(ran=True, note="0 errors"), exit_code=0).healthy
    assert summary_line(report((clean,), exit_code=0)).plain.startswith("No finding: every monitored launch")


def test_a_command_that_failed_without_a_finding_says_so() -> None:
    clean = from_jsonable(ProcessRecord, {**json.loads(RUN_RECORD.read_text()), "end": {"kind": "exit"}, "cuda_error": ""})
    line = summary_line(report((clean,), exit_code=3)).plain
    assert line == "No finding in the monitored launches; the command itself failed (exited with status 3)."


# --- a program on the Triton interpreter ---------------------------------------------------------

PROGRAM = """\
import torch
import triton
import triton.language as tl


@triton.jit
def scale_rows(x_ptr, y_ptr, stride_xm, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * stride_xm + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < N)
    tl.store(y_ptr + row * stride_xm + tl.arange(0, BLOCK), x * 2, mask=tl.arange(0, BLOCK) < N)


x = torch.randn(4, 16)
y = torch.empty_like(x)
for _ in range(3):
    scale_rows[(4,)](x, y, x.stride(0), 16, BLOCK=16)
raise torch.AcceleratorError(
    "CUDA error: an illegal instruction was encountered\\n"
    "Search for `cudaErrorIllegalInstruction' in "
    "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information."
)
"""


def test_run_records_an_illegal_instruction_and_aims_the_sanitizer_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(knobs.CUDA_LAUNCH_BLOCKING, None)
    monkeypatch.setattr("qmoe_doctor.workflows.run.find_compute_sanitizer", lambda env=None: None)
    r = run_program([sys.executable, str(prog)], RunOptions(sanitize=True, log_dir=tmp_path / "r"), environ=env)
    (first,) = r.passes
    (error,) = first.cuda_errors
    assert error.error_kind is ErrorKind.ILLEGAL_INSTRUCTION
    assert [launch.seq for launch in error.last_launches] == [1, 2, 3]
    (rec,) = first.processes
    assert rec.end is not None and rec.end.kind is EndKind.CUDA_ERROR
    assert rec.cuda_error.startswith("AcceleratorError: CUDA error: an illegal instruction was encountered")
    s = r.sanitizer
    assert s is not None and not s.ran and "compute-sanitizer was not found" in s.note
    assert s.kernels == ("scale_rows",) and s.launch_count is None  # aimed at the error: every launch
    assert r.command_exit == 1 and not r.healthy
    assert "No finding" not in rendered(r)
