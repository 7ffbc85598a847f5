"""diagnose/explain.py, diagnose/traceback.py and `qmoe-doctor explain` (workflows/explain.py):
what a saved log or traceback shows, which causes fit; and the inputs the command refuses.

Inputs, always labelled (see tests/unit/test_sanitizer.py for the same scheme):

* RECORDED: our own logs and tracebacks (tests/fixtures/sanitizer/<recording>/ and
  tests/fixtures/tracebacks/<recording>/). The generic tests glob every recording, so newly recorded files
  are explained too.
* DERIVED VARIANTS: a recorded file transformed in the test (rank prefixes, two ranks
  interleaved, cut, re-worded lines); or an exception line rebuilt from the ``error_type`` and
  ``error_message`` our probes recorded in a saved scan report / Outcome line.
* HAND-WRITTEN FORMAT SAMPLES: exception lines of kinds we have not recorded (OutOfResources,
  device mismatch, out of memory, a C++ abort) and sanitizer records we have not recorded
  (racecheck hazards, initcheck, ``Program hit``), written by us with made-up values.

Every command explain suggests is checked against the flags the commands really declare.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
import typer.main
import typer.testing
from format_samples import API_SAMPLE, INITCHECK_SAMPLE, RACE_SAMPLE
from recorded_logs import (
    ALL_LOGS,
    ALL_TRACEBACKS,
    MANIFEST,
    RECORDED,
    first_records,
    interleave,
    older_address_wording,
    path_2xh200,
    prefixed,
    read,
    recorded_2xh200,
    rel,
)
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.conditions import DEFAULT_CONDITIONS
from qmoe_doctor.core.inputs import MAX_INPUT_BYTES, InputError
from qmoe_doctor.core.records import ErrorKind, Outcome, from_json
from qmoe_doctor.diagnose.explain import (
    Explanation,
    NothingToExplain,
    _repro,
    _scan,
    explain_text,
)
from qmoe_doctor.diagnose.traceback import parse_traceback
from qmoe_doctor.workflows.explain import explain_input

runner = CliRunner()

NOCACHE = "memcheck-unmasked-overrouted-nocache.log"
FAR = "memcheck-unmasked-far-overrouted.log"
NOPEER = "traceback-unguarded-nopeer.stderr"  # ValueError, pointer argument 0
BUFFER = "traceback-default-buffer-peer.stderr"  # ValueError, pointer argument 2
ILLEGAL = "traceback-unmasked-far-overrouted.stderr"  # torch.AcceleratorError, illegal memory access
INT32 = "traceback-int32-debug.stderr.gz"  # TRITON_DEBUG=1 int32 overflow asserts + traceback
LAUNCHER = "/work/main/kernels/grouped_gemm.py:launch_grouped_gemm"


def causes(text: str) -> list[str]:
    return [f.cause for f in explain_text(text).fits]


# --- every suggested command must use flags that exist -------------------------------------------


def _declared_options(command: str) -> set[str]:
    """The long options ``qmoe-doctor COMMAND`` accepts, as the CLI really parses them (however
    the command declares them)."""
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {opt for param in cmd.params for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")}


SCAN_OPTIONS = _declared_options("scan")
REPRO_OPTIONS = _declared_options("repro")


def check_command(cmd: str) -> None:
    argv = shlex.split(cmd)
    assert argv[0] == "qmoe-doctor" and argv[1] in ("scan", "repro"), cmd
    allowed = SCAN_OPTIONS if argv[1] == "scan" else REPRO_OPTIONS
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert set(opts) <= allowed, f"{cmd}: unknown flags {set(opts) - allowed}"
    assert {"--gpus", "--kernel"} <= set(opts), cmd
    assert re.fullmatch(r"\d+(,\d+)*", opts["--gpus"]), cmd
    if "--only" in opts:
        only = opts["--only"].split(",")
        assert only and {c.value for c in DEFAULT_CONDITIONS} >= set(only), (
            f"{cmd}: scan does not plan {only}"
        )


def check_commands(e: Explanation) -> None:
    assert e.next_steps
    for cmd in [*e.next_steps, *(f.settle for f in e.fits)]:
        check_command(cmd)


def test_command_helpers() -> None:
    assert _repro("0,1", "k.py:f") == "qmoe-doctor repro --gpus 0,1 --kernel k.py:f"
    assert _scan("0,1", "k.py:f") == "qmoe-doctor scan --gpus 0,1 --kernel k.py:f"
    assert (
        _scan("1,0", "k.py:f", ("no-peer", "peer"))
        == "qmoe-doctor scan --gpus 1,0 --kernel k.py:f --only no-peer,peer"
    )
    with pytest.raises(ValueError):
        _scan("0,1", "k.py:f", ("selftest-ok",))  # a Condition, but never planned by scan
    with pytest.raises(ValueError):
        _scan("0,1", "k.py:f", ("no-such-condition",))
    for cmd in (_repro("0,1", "k.py:f"), _scan("0,1", "k.py:f", ("int32-boundary",))):
        check_command(cmd)


# --- RECORDED, generic: every recorded file of every recording --------------------------------------


@pytest.mark.parametrize("path", ALL_LOGS + ALL_TRACEBACKS, ids=rel)
def test_every_recorded_file_is_explained_with_valid_commands(path: Path) -> None:
    e = explain_text(read(path), source=path.name)
    check_commands(e)
    clean = path.suffix == ".log" and e.sanitizer is not None and e.sanitizer.clean
    assert e.findings is not clean
    assert e.input_kind == ("sanitizer-log" if path.suffix == ".log" else "traceback")
    if path.suffix != ".log":
        assert e.traceback is not None and (e.traceback.exception is not None or e.traceback.asserts)


# --- RECORDED tracebacks ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "arg", "condition"), [(NOPEER, 0, "_no_peer"), (BUFFER, 2, "_peer")])
def test_recorded_pointer_check_failures(name: str, arg: int, condition: str) -> None:
    e = explain_text(recorded_2xh200(name))
    assert e.input_kind == "traceback" and e.findings
    assert e.error_kind is ErrorKind.POINTER_INACCESSIBLE and e.pointer_argument == arg
    assert e.kernel == "_grouped_gemm_kernel"
    assert e.headline == "Triton refused a pointer argument at launch"
    assert any(f"refused pointer argument {arg}" in f for f in e.facts)
    assert (
        "Triton kernel launched: _grouped_gemm_kernel (from /work/main/kernels/grouped_gemm.py:277 in launch_grouped_gemm)"
        in e.facts
    )
    # the user's frames (ours here: the probe harness and the specimen), none of Triton's
    assert e.user_frames[-1] == "/work/main/kernels/grouped_gemm.py:277 in launch_grouped_gemm"
    assert any(f.endswith(f"in {condition}") for f in e.user_frames)
    assert not any("/triton/" in f for f in e.user_frames)
    assert [(f.cause, f.settle) for f in e.fits] == [
        (
            "missing-device-guard",
            f"qmoe-doctor scan --gpus 0,1 --kernel {LAUNCHER} --only no-peer,peer,producer-race",
        ),
        ("default-device-buffer", f"qmoe-doctor scan --gpus 0,1 --kernel {LAUNCHER} --only no-peer,peer"),
    ]
    assert not any("asynchronous" in c for c in e.caveats)  # raised at the launch itself


def test_recorded_illegal_address_surfacing_at_a_later_sync() -> None:
    e = explain_text(recorded_2xh200(ILLEGAL))
    assert e.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert e.facts[0] == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert e.kernel is None  # the launch is not in the traceback
    assert e.user_frames[-1] == "/work/main/probes/conditions.py:156 in sync_all"
    assert [f.cause for f in e.fits] == [
        "invalid-routing",
        "cross-device-stream-race",
        "int32-offset-overflow",
        "missing-device-guard",
    ]
    # nothing in the text tells them apart: one full scan settles them all
    assert e.next_steps == ("qmoe-doctor scan --gpus 0,1 --kernel path.py:fn",)
    assert any("asynchronous" in c for c in e.caveats)


def test_recorded_int32_overflow_asserts_gzipped() -> None:
    e = explain_text(recorded_2xh200(INT32))
    assert e.error_kind is ErrorKind.DEVICE_ASSERT
    assert e.assert_site == "/work/main/kernels/specimens/int32_offsets.py:102"
    tb = e.traceback
    assert tb is not None and tb.exception is not None
    assert (tb.exception.type, tb.exception.message) == (
        "torch.AcceleratorError",
        "CUDA error: device-side assert triggered",
    )
    # one assert line per thread; two of them were split by the traceback's own writes (real
    # interleaving in the recording): their tails are still counted, without a file:line
    assert len(tb.asserts) == 3936
    assert len([a for a in tb.asserts if a.file is None]) == 2
    assert {a.message for a in tb.asserts} == {"int32 overflow detected for operation mul"}
    assert (tb.asserts[0].block, tb.asserts[0].thread) == ("101,0,0", "32,0,0")
    assert [f.cause for f in e.fits] == ["int32-offset-overflow"]
    assert e.next_steps == (
        "qmoe-doctor scan --gpus 0 --kernel /work/main/kernels/specimens/int32_offsets.py:fn --only int32-boundary",
    )
    assert any("replace fn" in c for c in e.caveats) and any("asynchronous" in c for c in e.caveats)
    assert "/work/main/probes/conditions.py:410 in _int32_boundary" in e.user_frames


# --- DERIVED traceback variants --------------------------------------------------------------------


def test_two_ranks_interleaved_with_rank_prefixes() -> None:
    """DERIVED: the two recorded pointer-check tracebacks as [rank0] and [rank1], one line each in turn."""
    text = (
        "\n".join(interleave(prefixed(recorded_2xh200(NOPEER), "[rank0]: "), prefixed(recorded_2xh200(BUFFER), "[rank1]: "))) + "\n"
    )
    r = parse_traceback(text)
    assert r.streams == ("rank0", "rank1")
    assert [(x.stream, x.message) for x in r.exceptions] == [
        ("rank0", "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"),
        ("rank1", "Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)"),
    ]
    # rank0's frames end in its exception; rank1's do not mix into them
    assert [f.function for f in r.frames] == [f.function for f in parse_traceback(recorded_2xh200(NOPEER)).frames]
    assert any(f.file.endswith("default_buffer.py") for f in r.other_user_frames)
    e = explain_text(text)
    assert e.pointer_argument == 0
    assert "device-never-set" in [f.cause for f in e.fits]
    assert any("lines from 2 ranks/workers: rank0, rank1" in f for f in e.facts)
    assert any("further exceptions in the text: rank1: ValueError" in f for f in e.facts)
    check_commands(e)


def test_traceback_cut_before_its_exception_line() -> None:
    """DERIVED: the recorded traceback without its last line (the exception)."""
    text = "".join(recorded_2xh200(NOPEER).splitlines(keepends=True)[:-1])
    e = explain_text(text)
    assert e.traceback is not None and e.traceback.truncated and e.traceback.exception is None
    assert not e.findings
    assert any("cut before its exception line" in c for c in e.caveats)
    check_commands(e)


@pytest.mark.parametrize(
    "prefix",
    ["2026-11-22T00:47:10.123456789Z stderr F ", "E   ", "(Worker pid=4242) "],
    ids=["container-log", "pytest", "worker-tag"],
)
def test_tool_prefixes_are_stripped(prefix: str) -> None:
    """DERIVED: the recorded traceback with a collector's, pytest's or a worker's prefix (ours)."""
    text = "\n".join(prefix + ln for ln in recorded_2xh200(BUFFER).splitlines()) + "\n"
    e = explain_text(text)
    assert e.error_kind is ErrorKind.POINTER_INACCESSIBLE and e.pointer_argument == 2
    assert e.kernel == "_grouped_gemm_kernel"


def _scan_error(scan: str, probe_id: str) -> str:
    """DERIVED: 'type: message', as Python prints an exception, from a recorded scan outcome."""
    doc = json.loads((RECORDED / "scan" / "2026-11-22-2xh200-7ada31c" / scan).read_text(encoding="utf-8"))
    (o,) = [o for o in doc["outcomes"] if o["probe_id"] == probe_id]
    return f"{o['error_type']}: {o['error_message']}\n"


def test_invalid_resource_handle_from_a_recorded_scan_outcome() -> None:
    e = explain_text(_scan_error("scan-unguarded.json", "0->1/peer"))
    assert e.error_kind is ErrorKind.INVALID_HANDLE
    assert e.facts[0] == "RuntimeError: Triton Error [CUDA]: invalid resource handle"
    assert [f.cause for f in e.fits] == ["thread-without-context", "per-device-state-cached"]
    assert e.next_steps == ("qmoe-doctor repro --gpus 0,1 --kernel path.py:fn",)
    check_commands(e)


def test_launch_failure_under_memcheck_from_a_recorded_outcome() -> None:
    """DERIVED: the exception our over-routed probe raised under memcheck (its Outcome line)."""
    line = path_2xh200("memcheck-unmasked-overrouted-nocache.stdout").read_text(encoding="utf-8").strip()
    o = from_json(Outcome, line.splitlines()[-1])
    assert o.error_type is not None and o.error_message is not None
    e = explain_text(f"{o.error_type}: {o.error_message}\n")
    assert e.error_kind is ErrorKind.LAUNCH_FAILURE  # its own kind, no longer read as illegal-address
    assert e.facts[0] == "torch.AcceleratorError: CUDA error: unspecified launch failure"
    assert [f.cause for f in e.fits] == ["invalid-routing", "int32-offset-overflow"]
    check_commands(e)


# --- HAND-WRITTEN exception lines of kinds we have not recorded ------------------------------------


def test_sample_out_of_resources_required_and_limit() -> None:
    """HAND-WRITTEN FORMAT SAMPLE: Triton's shared-memory refusal, values made up."""
    text = "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: 232448.\n"
    e = explain_text(text)
    assert e.error_kind is ErrorKind.OUT_OF_RESOURCES
    assert e.resources == (262144, 232448)
    assert any("29,696 over" in f for f in e.facts)
    assert [(f.cause, f.settle) for f in e.fits] == [
        ("launch-config-fault", "qmoe-doctor repro --gpus 0 --kernel path.py:fn"),
        ("per-device-state-cached", "qmoe-doctor repro --gpus 0,1 --kernel path.py:fn"),
    ]
    check_commands(e)


def test_sample_device_mismatch_names_the_gpus() -> None:
    """HAND-WRITTEN FORMAT SAMPLE: torch's two-device message, devices made up."""
    text = "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:3 and cuda:2!\n"
    e = explain_text(text)
    assert e.error_kind is ErrorKind.DEVICE_MISMATCH
    assert [f.cause for f in e.fits] == ["default-device-buffer", "missing-device-guard"]
    assert e.next_steps == ("qmoe-doctor scan --gpus 2,3 --kernel path.py:fn --only untouched,no-peer,peer",)
    check_commands(e)


def test_sample_out_of_memory_and_cxx_abort() -> None:
    """HAND-WRITTEN FORMAT SAMPLES: an out-of-memory exception line, and a C++ abort."""
    e = explain_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    assert e.error_kind is ErrorKind.OOM
    assert [f.cause for f in e.fits] == ["device-never-set", "default-device-buffer"]
    check_commands(e)
    text = (
        "terminate called after throwing an instance of 'c10::Error'\n"
        "  what():  CUDA error: an illegal memory access was encountered\n"
    )
    e = explain_text(text)
    assert e.traceback is not None and e.traceback.exception is not None
    assert e.traceback.exception.type == "c10::Error"
    assert e.error_kind is ErrorKind.ILLEGAL_ADDRESS
    check_commands(e)


def test_sample_assert_without_int32_fits_routing() -> None:
    """HAND-WRITTEN FORMAT SAMPLE: a device assert of a kernel's own bounds check."""
    text = "kern.py:40: unknown: block: [3,0,0], thread: [1,0,0] Assertion `expert id out of range` failed.\n"
    e = explain_text(text)
    assert e.error_kind is ErrorKind.DEVICE_ASSERT and e.assert_site == "kern.py:40"
    assert [(f.cause, f.settle) for f in e.fits] == [
        (
            "invalid-routing",
            "qmoe-doctor scan --gpus 0,1 --kernel kern.py:fn --only over-routed,negative-sizes",
        )
    ]


# --- RECORDED sanitizer logs ----------------------------------------------------------------------


# AddressSanitizer's count: the logs' "1 bytes after" and "129,937 bytes after" count the first byte
# after the allocation as 1; the facts say "0 bytes after" and "129,936 bytes after"
@pytest.mark.parametrize(("name", "distance"), [(NOCACHE, "0 bytes"), (FAR, "129,936 bytes")])
def test_recorded_writes_past_an_allocation_fit_routing_or_a_sizes_race(name: str, distance: str) -> None:
    e = explain_text(recorded_2xh200(name))
    assert e.input_kind == "sanitizer-log" and e.findings
    assert e.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert e.kernel == "_grouped_gemm_kernel_unmasked"
    assert e.headline == "an illegal / out-of-bounds memory access in _grouped_gemm_kernel_unmasked"
    assert any(f"{distance} after the nearest allocation" in f for f in e.facts)
    assert any("50 times, 50 distinct addresses" in f for f in e.facts)
    assert [(f.cause, f.settle) for f in e.fits] == [
        (
            "invalid-routing",
            "qmoe-doctor scan --gpus 0,1 --kernel unmasked_rows.py:fn --only over-routed,negative-sizes",
        ),
        (
            "cross-device-stream-race",
            "qmoe-doctor scan --gpus 0,1 --kernel unmasked_rows.py:fn --only peer,sizes-race",
        ),
    ]
    assert any(
        "replace fn with the Python function that launches _grouped_gemm_kernel_unmasked" in c
        for c in e.caveats
    )
    # the user frames skip Triton's launch path (driver.py, jit.py) and the interpreter
    assert e.user_frames[0] == "_common.py:35 in launch_kernel"
    assert "unmasked_rows.py:29 in moe_grouped_gemm" in e.user_frames
    assert not any(f.startswith(("driver.py", "jit.py")) for f in e.user_frames)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("memcheck-builtin-clean.log", "compute-sanitizer reported no errors"),
        ("memcheck-unmasked-overrouted-cached.log", "compute-sanitizer reported no errors"),
        ("racecheck-builtin-clean.log", "compute-sanitizer reported no hazards"),
    ],
)
def test_recorded_clean_runs_are_not_findings(name: str, says: str) -> None:
    e = explain_text(recorded_2xh200(name))
    assert not e.findings and e.fits == ()
    assert e.headline.startswith(says)
    assert any("cannot see races across streams or GPUs" in c for c in e.caveats)
    check_commands(e)


def test_log_and_traceback_in_one_file() -> None:
    """DERIVED: the recorded memcheck log followed by the recorded traceback of the same cell."""
    e = explain_text(first_records(recorded_2xh200(NOCACHE), 3) + "\n" + recorded_2xh200(ILLEGAL))
    assert e.input_kind == "both"
    assert e.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert e.sanitizer is not None and len(e.sanitizer.errors) == 3
    assert e.traceback is not None and e.traceback.exception is not None
    # the log's specific evidence comes first, the traceback's general fits after, no repeats
    cs = [f.cause for f in e.fits]
    assert cs[:2] == ["invalid-routing", "cross-device-stream-race"] and len(cs) == len(set(cs))
    assert "missing-device-guard" in cs
    check_commands(e)


# --- DERIVED sanitizer variants: the other branches of the fits -----------------------------------


def _one_record(replace_nearest: str | None = None, swap: tuple[str, str] | None = None) -> str:
    """DERIVED: the recorded log's first record (with its summary), its nearest-allocation line
    replaced, or one wording swapped, as the test says (numbers ours)."""
    text = first_records(recorded_2xh200(NOCACHE), 1)
    if replace_nearest is not None:
        text = re.sub(r"and is 1 bytes after the nearest allocation.*", replace_nearest, text, count=1)
    if swap is not None:
        assert swap[0] in text
        text = text.replace(*swap)
    return text


def test_address_far_before_a_huge_allocation_fits_int32_overflow_first() -> None:
    text = _one_record(
        "and is 2,147,483,904 bytes before the nearest allocation at 0x7f7d00000000 of size 6,442,450,944 bytes"
    )
    e = explain_text(text)
    assert [(f.cause, f.settle.split(" --only ")[-1]) for f in e.fits] == [
        ("int32-offset-overflow", "int32-boundary"),
        ("missing-device-guard", "no-peer,peer,producer-race"),
        ("default-device-buffer", "no-peer,peer"),
    ]
    assert e.fits[0].settle.startswith("qmoe-doctor scan --gpus 0 ")
    assert any("2,147,483,904 bytes before the nearest allocation" in f for f in e.facts)
    check_commands(e)


def test_address_far_after_an_allocation_fits_placement() -> None:
    text = _one_record(
        "and is 3,221,225,472 bytes after the nearest allocation at 0x7f7cc49a0000 of size 131,072 bytes"
    )
    assert causes(text) == ["missing-device-guard", "default-device-buffer"]


def test_address_inside_the_nearest_allocation_fits_unmapped_memory() -> None:
    e = explain_text(
        _one_record("and is inside the nearest allocation at 0x7f7cc49a0000 of size 262,144 bytes")
    )
    assert [(f.cause, f.settle) for f in e.fits] == [
        ("expandable-segments-unmap", "qmoe-doctor repro --gpus 0,1 --kernel unmasked_rows.py:fn")
    ]
    check_commands(e)


def test_older_wording_without_nearest_allocation_fits_everything() -> None:
    """DERIVED: 'Address 0x...' wording and no nearest-allocation line, as older releases print."""
    text = "".join(
        ln
        for ln in older_address_wording(first_records(recorded_2xh200(NOCACHE), 2)).splitlines(keepends=True)
        if "nearest" not in ln
    )
    e = explain_text(text)
    assert [f.cause for f in e.fits] == ["invalid-routing", "int32-offset-overflow", "missing-device-guard"]
    assert e.next_steps == ("qmoe-doctor scan --gpus 0,1 --kernel unmasked_rows.py:fn",)


def test_shared_memory_access_is_not_a_cross_gpu_cause() -> None:
    e = explain_text(_one_record(swap=("__global__", "__shared__")))
    assert e.fits == () and e.findings
    assert any("__shared__" in c for c in e.caveats)
    check_commands(e)  # falls back to a full scan


def test_misaligned_access_fits_a_misaligned_operand_and_no_placement_cause() -> None:
    e = explain_text(_one_record(swap=("is out of bounds", "is misaligned")))
    assert e.error_kind is ErrorKind.MISALIGNED_ADDRESS
    assert [(f.cause, f.settle.split(" --only ")[-1]) for f in e.fits] == [("misaligned-operand", "offsets")]
    assert any("not a placement fault" in c for c in e.caveats)
    assert any("is misaligned" in f for f in e.facts)
    check_commands(e)


def test_log_starting_mid_record_and_cut_at_the_end() -> None:
    lines = first_records(recorded_2xh200(NOCACHE), 3).splitlines(keepends=True)
    e = explain_text("".join(lines[4:60]))
    assert any("starts in the middle of a record" in c for c in e.caveats)
    assert any("no ERROR SUMMARY line" in c for c in e.caveats)


def test_rank_prefixed_logs_are_reported_per_process() -> None:
    """DERIVED: two recorded logs as [rank0] / [rank1], one line each in turn."""
    a, b = first_records(recorded_2xh200(NOCACHE), 2), first_records(recorded_2xh200(FAR), 2)
    e = explain_text("\n".join(interleave(prefixed(a, "[rank0]: "), prefixed(b, "[rank1]: "))) + "\n")
    assert any("lines from 2 processes: [rank0]:, [rank1]:" in f for f in e.facts)
    assert e.sanitizer is not None and len(e.sanitizer.errors) == 4


# --- HAND-WRITTEN sanitizer samples (tests/unit/format_samples.py) -----------------------------------


def test_sample_racecheck_fits_no_cause_and_says_global_races_are_invisible() -> None:
    e = explain_text(RACE_SAMPLE)
    assert e.findings and e.fits == ()
    assert e.headline == "shared-memory race hazards in tile_kernel"
    assert any("racecheck sees shared-memory hazards only" in c for c in e.caveats)
    # race records carry no location of their own: the kernel reference stays a placeholder
    assert e.next_steps == ("qmoe-doctor scan --gpus 0,1 --kernel path.py:fn",)


def test_sample_uninitialized_reads_fit_a_missing_wait() -> None:
    e = explain_text(INITCHECK_SAMPLE)
    assert [(f.cause, f.settle.split(" --only ")[-1]) for f in e.fits] == [
        ("cross-device-stream-race", "peer,producer-race"),
        ("wrong-device-stream", "side-stream"),
    ]
    check_commands(e)


def test_sample_api_error_headline_and_fits() -> None:
    e = explain_text(API_SAMPLE)
    assert e.headline == "cudaErrorLaunchFailure returned by cudaEventSynchronize"
    assert [f.cause for f in e.fits] == ["invalid-routing", "int32-offset-overflow"]
    check_commands(e)


def test_nothing_to_explain() -> None:
    with pytest.raises(NothingToExplain):
        explain_text("")
    with pytest.raises(NothingToExplain):
        explain_text(MANIFEST.read_text(encoding="utf-8"))


# --- the command --------------------------------------------------------------------------------


def run(*args: str) -> Any:
    return runner.invoke(app, ["explain", *args])


@pytest.mark.parametrize("path", ALL_LOGS + ALL_TRACEBACKS, ids=rel)
def test_cli_on_every_recorded_file(path: Path) -> None:
    expected = explain_text(read(path))
    result = run(str(path))
    assert result.exit_code == (1 if expected.findings else 0), result.output
    assert path.name in result.stdout
    assert "To settle it" in result.stdout
    result = run(str(path), "--json")
    assert result.exit_code == (1 if expected.findings else 0)
    doc = json.loads(result.stdout)
    assert doc["kind"] == "explanation" and doc["schema_version"] == 1
    assert doc["input_kind"] == expected.input_kind
    assert doc["findings"] is expected.findings
    for cmd in doc["next_steps"]:
        check_command(cmd)
    for fit in doc["fits"]:
        assert fit["cause"] and fit["why"]
        check_command(fit["settle"])


def test_cli_json_fields() -> None:
    doc = json.loads(run(str(path_2xh200(NOCACHE)), "--json").stdout)
    assert doc["error_kind"] == "illegal-address"
    first = doc["sanitizer"]["errors"][0]
    # the parsed record keeps compute-sanitizer's own count ("1 bytes after"): the JSON field's
    # meaning never changed; the text counts as AddressSanitizer does ("0 bytes after")
    assert first["nearest"] == {"relation": "after", "distance": 1, "base": 0x7F7CC49A0000, "size": 131072}
    assert doc["sanitizer"]["groups"][0]["count"] == 50
    assert doc["sanitizer"]["error_summary"] == 450 and doc["sanitizer"]["errors_not_printed"] == 400


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("memcheck-builtin-clean.log", "no errors"),
        ("memcheck-unmasked-overrouted-cached.log", "no errors"),
        ("racecheck-builtin-clean.log", "no hazards"),
    ],
)
def test_cli_clean_runs_exit_0(name: str, says: str) -> None:
    result = run(str(path_2xh200(name)))
    assert result.exit_code == 0, result.output
    assert says in result.stdout


def test_cli_recorded_int32_assert_gzipped() -> None:
    result = run(str(path_2xh200(INT32)), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["error_kind"] == "device-assert"
    assert doc["assert_site"] == "/work/main/kernels/specimens/int32_offsets.py:102"
    assert doc["fits"][0]["cause"] == "int32-offset-overflow"
    assert doc["next_steps"][0] == (
        "qmoe-doctor scan --gpus 0 --kernel /work/main/kernels/specimens/int32_offsets.py:fn --only int32-boundary"
    )
    assert any("asynchronous" in c for c in doc["caveats"])


def test_cli_both_in_one_file(tmp_path: Path) -> None:
    """DERIVED: a recorded log and a recorded pointer-check traceback in one file."""
    f = tmp_path / "run.txt"
    f.write_text(first_records(recorded_2xh200(NOCACHE), 2) + "\n" + recorded_2xh200(NOPEER))
    doc = json.loads(run(str(f), "--json").stdout)
    assert doc["input_kind"] == "both" and doc["error_kind"] == "pointer-inaccessible"


def test_cli_reads_stdin() -> None:
    result = runner.invoke(app, ["explain", "-", "--json"], input=recorded_2xh200(BUFFER))
    assert result.exit_code == 1
    assert json.loads(result.stdout)["error_kind"] == "pointer-inaccessible"


@pytest.mark.parametrize("kind", ["missing", "empty", "directory", "foreign"])
def test_cli_unreadable_inputs_exit_2(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.log"
    if kind == "empty":
        path.write_text("")
    elif kind == "directory":
        path.mkdir()
    elif kind == "foreign":
        path.write_text("[project]\nname = 'something'\n")
    result = run(str(path))
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "error:" in result.stderr


# --- hostile inputs: each a one-line error naming the input, exit 2, bounded memory, no hang -------


class _Endless(io.RawIOBase):
    """A stdin that never ends (``yes`` piped in forever), counting what was read from it."""

    def __init__(self) -> None:
        self.served = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = len(buffer)
        buffer[:n] = b"\0" * n
        self.served += n
        return n


def _gzip_of_zeros(members: int) -> bytes:
    """``members`` gzip members of 64 MiB of zeros each (about 65 KB compressed), one after the
    other: a valid gzip that decompresses to ``members`` x 64 MiB."""
    z = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    zeros = bytes(2**20)
    member = b"".join([*(z.compress(zeros) for _ in range(64)), z.flush()])
    return member * members


def _refused(result: Any, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero on this system")
@pytest.mark.timeout(60)
def test_cli_refuses_a_device_file() -> None:
    _refused(run("/dev/zero"), "/dev/zero", "device file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
@pytest.mark.timeout(30)  # opening a FIFO with no writer blocks forever: fail, never hang
def test_cli_refuses_a_fifo_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "run.log"
    os.mkfifo(fifo)
    _refused(run(str(fifo)), str(fifo), "FIFO")


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4, "corrupt gzip"),
        (gzip.compress(b"Traceback (most recent call last):\n" * 2000)[:200], "truncated gzip"),
    ],
    ids=["corrupt", "truncated"],
)
def test_cli_refuses_a_broken_gzip(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "run.log.gz"
    path.write_bytes(content)
    _refused(run(str(path)), str(path), says)


@pytest.mark.timeout(120)
def test_cli_caps_a_gzip_on_its_decompressed_size(tmp_path: Path) -> None:
    """A gzip bomb: 520 KB of gzip, 512 MiB of zeros (an 18 MB one took 8.5 GB of memory while the
    cap applied to the compressed size). Refused at the cap, never held whole. Kept at 512 MiB so
    that a regression fails this test instead of exhausting the machine's memory."""
    path = tmp_path / "zeros.log.gz"
    path.write_bytes(_gzip_of_zeros(8))
    assert path.stat().st_size < 2**20
    tracemalloc.start()
    try:
        result = run(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _refused(result, str(path), "decompresses to more than 64 MiB")
    # at most the cap decompressed (zlib may double its output buffer while it fills it); the
    # whole would be 512 MiB
    assert peak < 3 * MAX_INPUT_BYTES, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.timeout(120)
def test_cli_caps_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    """An endless stdin (``explain - < /dev/zero``): refused once past the cap, having read at
    most a chunk more."""
    endless = _Endless()
    monkeypatch.setattr(typer.testing, "make_input_stream", lambda _input, _charset: io.BufferedReader(endless))
    _refused(runner.invoke(app, ["explain", "-"]), "standard input", "larger than 64 MiB")
    assert MAX_INPUT_BYTES < endless.served <= MAX_INPUT_BYTES + 2 * 2**20


def test_cli_escapes_markup_in_the_input_name(tmp_path: Path) -> None:
    """A path rich would read as markup (``[/]`` closes a tag that was never opened; here the
    slash is the folder's): printed as it is, in the report and in an error."""
    folder = tmp_path / "[bold]logs["
    folder.mkdir()
    path = folder / "]run.log"
    path.write_text(recorded_2xh200(BUFFER))
    result = run(str(path))
    assert result.exit_code == 1, result.output
    assert "[bold]logs[/]run.log" in result.stdout
    _refused(run(str(folder / "]missing[red].log")), "[bold]logs[/]missing[red].log", "no such file")


def test_the_workflow_names_the_input_it_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[project]\nname = 'something'\n")
    with pytest.raises(InputError, match=re.escape(f"{path}: found neither a compute-sanitizer log")):
        explain_input(path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"  \n")))
    with pytest.raises(InputError, match="^standard input: it is empty$"):
        explain_input("-")
    assert explain_input(path_2xh200(NOPEER)).error_kind is ErrorKind.POINTER_INACCESSIBLE


def test_cli_help_documents_exit_status() -> None:
    result = run("--help")
    assert result.exit_code == 0
    assert "Exit status" in result.stdout and "ERROR SUMMARY: 0 errors" in result.stdout


def test_explain_does_not_import_torch() -> None:
    code = (
        "import sys, qmoe_doctor.diagnose.explain, qmoe_doctor.diagnose.sanitizer_log, "
        "qmoe_doctor.diagnose.traceback, qmoe_doctor.workflows.explain, qmoe_doctor.cli.commands.explain; "
        "print('torch' in sys.modules or 'triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_interpreters_alignment_assertion_is_no_cuda_error() -> None:
    """Under TRITON_INTERPRET=1 a descriptor on an unaligned base is an assertion on the CPU: the
    misaligned-operand cause fits, but there is no CUDA error 716 and nothing sticky to say; the
    same fault as CUDA printed it gets both."""
    frames = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 12, in <module>\n'
        "    y = moe(x, w, sizes)\n"
        '  File "/home/u/moe.py", line 40, in moe\n'
        "    kern[grid](x, w, y)\n"
    )
    cpu = explain_text(frames + "triton.runtime.errors.InterpreterError: AssertionError('base must be 16-byte aligned')\n")
    assert cpu.error_kind == "misaligned-address"
    assert "CUDA error 716" not in cpu.headline and "interpreter" in cpu.headline
    assert not any("sticky" in c for c in cpu.caveats)
    assert "misaligned-operand" in {f.cause for f in cpu.fits}
    gpu = explain_text(frames + "torch.AcceleratorError: CUDA error: misaligned address\n")
    assert "CUDA error 716" in gpu.headline and any("sticky" in c for c in gpu.caveats)
