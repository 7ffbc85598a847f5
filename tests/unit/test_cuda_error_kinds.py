"""Every sticky CUDA error is a CUDA error, each with its own kind: to the classifier (exception
text, a dead child's stderr), to ``explain`` and to the records read back.

The texts: four sticky CUDA errors have been recorded on our GPUs (tests/fixtures): an illegal
memory access, a device-side assert, and, from a device-side TMA-descriptor kernel on one H100
(2026-12-07), a misaligned address and an illegal instruction, in each of the forms a program
shows them (a Python traceback at the next synchronize, Triton's launcher under
CUDA_LAUNCH_BLOCKING=1, a C++ abort when the caching allocator is off, memcheck's log); the
first tests below read those. For the others the tests DERIVE the message from the
recorded one by putting CUDA's own text and enum name where the recorded ones stand: torch 2.11
prints ``torch.AcceleratorError: CUDA error: <cudaGetErrorString text>`` and ``Search for
`<cudaError name>' in ...`` (recorded: traceback-unmasked-far-overrouted.stderr); Triton's
launcher prints ``RuntimeError: Triton Error [CUDA]: <cuGetErrorString text>`` (recorded: the
blocking pass of run-unmasked, monitor-records/2026-11-25-h100-e9d91ec). The texts and names
substituted are CUDA's, as the CUDA runtime and driver API references list them ("Error types":
cudaError / CUresult) and ``qmoe_doctor.core.error_kind.CUDA_ERRORS`` quotes them; the two
measured on an H100 (an illegal instruction, a misaligned address) are FINDINGS.md's, 2026-12-06.
"""

from __future__ import annotations

import json

import pytest
from recorded_logs import FIXTURES, recorded_2xh200

from qmoe_doctor.core.error_kind import (
    CUDA_ERROR_OF,
    CUDA_ERRORS,
    CudaError,
    classify_error,
    classify_exit,
    cuda_error_kind,
    match_text,
)
from qmoe_doctor.core.launches import ProcessEnd
from qmoe_doctor.core.records import (
    CUDA_ERROR_KINDS,
    POISONING_KINDS,
    Condition,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Shape,
    Status,
    from_jsonable,
    is_cuda_error,
    to_jsonable,
)
from qmoe_doctor.diagnose.explain import explain_text
from qmoe_doctor.isolate.crash import ChildEnd, Ending, crash_outcome

RECORDED_TORCH = recorded_2xh200("traceback-unmasked-far-overrouted.stderr")
RECORDED_TEXT = "an illegal memory access was encountered"
RECORDED_NAME = "cudaErrorIllegalAddress"
BLOCKING_RECORD = (
    FIXTURES / "monitor-records" / "2026-11-25-h100-e9d91ec" / "unmasked" / "blocking" / "process-3171-5c94d4f6.json"
)
RECORDED_TRITON = json.loads(BLOCKING_RECORD.read_text())["ring"][0]["raised"]
#: Every sticky CUDA error that has a text; 226 (CUDA 12.8+) is matched by its enum names only.
WITH_TEXT = [e for e in CUDA_ERRORS if e.text is not None]


def torch_traceback(e: CudaError) -> str:
    """DERIVED: the recorded torch traceback with ``e``'s text and runtime enum name."""
    assert RECORDED_TEXT in RECORDED_TORCH and f"`{RECORDED_NAME}'" in RECORDED_TORCH
    return RECORDED_TORCH.replace(RECORDED_TEXT, e.text or "").replace(RECORDED_NAME, e.runtime)


def triton_message(e: CudaError) -> str:
    """DERIVED: the recorded Triton launch error with ``e``'s text."""
    assert RECORDED_TRITON == f"RuntimeError: Triton Error [CUDA]: {RECORDED_TEXT}"
    return RECORDED_TRITON.replace(RECORDED_TEXT, e.text or "")


def _id(e: CudaError) -> str:
    return str(e.kind)


H100_TRACEBACKS = FIXTURES / "tracebacks" / "2026-12-07-h100-3d8e2cb"
H100_MEMCHECK = FIXTURES / "sanitizer" / "2026-12-07-h100-3d8e2cb" / "memcheck-tma-misaligned.log"
#: Each recorded file, the kind it must be read as, and how the program ended (the recording).
RECORDED_H100 = {
    # Python traceback at torch.cuda.synchronize(): exit 1
    "traceback-tma-misaligned.stderr": (ErrorKind.MISALIGNED_ADDRESS, 1),
    # Triton's launcher under CUDA_LAUNCH_BLOCKING=1: exit 1
    "traceback-tma-misaligned-blocking.stderr": (ErrorKind.MISALIGNED_ADDRESS, 1),
    # caching allocator off: a C++ exception when the scratch buffer is freed, SIGABRT
    "traceback-tma-misaligned-nocache.stderr": (ErrorKind.MISALIGNED_ADDRESS, -6),
    "traceback-tma-overrun-nocache.stderr": (ErrorKind.ILLEGAL_INSTRUCTION, -6),
    "traceback-tma-overrun-nocache-blocking.stderr": (ErrorKind.ILLEGAL_INSTRUCTION, -6),
}


@pytest.mark.parametrize("name", sorted(RECORDED_H100))
def test_recorded_h100_ends_are_read_as_their_kind_by_the_crash_classifier_and_explain(name: str) -> None:
    kind, code = RECORDED_H100[name]
    text = (H100_TRACEBACKS / name).read_text()
    assert classify_exit(code, text) is kind
    outcome = crash_outcome(SPEC, ChildEnd(ending=Ending.EXITED, who="worker 1", exit_code=code, tail=text), phase=Phase.SYNC)
    assert outcome.error_kind is kind and kind in POISONING_KINDS
    x = explain_text(text)
    assert x.findings and x.error_kind is kind
    expected = ["misaligned-operand"] if kind is ErrorKind.MISALIGNED_ADDRESS else ["invalid-routing", "misaligned-operand"]
    assert [f.cause for f in x.fits] == expected


def test_recorded_h100_blocking_launch_names_the_kernel_and_no_later_call() -> None:
    x = explain_text((H100_TRACEBACKS / "traceback-tma-misaligned-blocking.stderr").read_text())
    assert x.facts[0] == "RuntimeError: Triton Error [CUDA]: misaligned address"
    assert x.kernel == "k" and x.headline.startswith("a misaligned memory access in k (cudaErrorMisalignedAddress")
    assert not any("surfaced at a later CUDA call" in c for c in x.caveats)
    later = explain_text((H100_TRACEBACKS / "traceback-tma-misaligned.stderr").read_text())
    assert any("surfaced at a later CUDA call" in c for c in later.caveats)


def test_recorded_h100_memcheck_hardware_exception_is_a_misaligned_address() -> None:
    """memcheck reports the misaligned TMA access as a hardware exception, "Misaligned shared or
    local address", not as an invalid __global__ access."""
    x = explain_text(H100_MEMCHECK.read_text())
    assert x.input_kind == "sanitizer-log" and x.findings
    assert x.error_kind is ErrorKind.MISALIGNED_ADDRESS and x.kernel == "k"
    assert [(f.cause, f.settle) for f in x.fits] == [
        ("misaligned-operand", "qmoe-doctor scan --gpus 0 --kernel t.py:fn --only offsets")
    ]
    assert "Misaligned shared or local address: 100 times" in x.facts


def test_the_derived_texts_are_the_recorded_ones() -> None:
    """Where a recording exists, the derived form the other tests use is what the GPU printed."""
    misaligned = (H100_TRACEBACKS / "traceback-tma-misaligned.stderr").read_text()
    derived = torch_traceback(CUDA_ERROR_OF[ErrorKind.MISALIGNED_ADDRESS])
    tail = misaligned[misaligned.index("torch.AcceleratorError:") :]
    assert tail.strip() == derived[derived.index("torch.AcceleratorError:") :].strip()
    blocking = (H100_TRACEBACKS / "traceback-tma-misaligned-blocking.stderr").read_text().strip().splitlines()[-1]
    assert blocking == triton_message(CUDA_ERROR_OF[ErrorKind.MISALIGNED_ADDRESS])
    overrun = (H100_TRACEBACKS / "traceback-tma-overrun-nocache-blocking.stderr").read_text()
    assert triton_message(ILLEGAL) in overrun.splitlines()


ILLEGAL = CUDA_ERROR_OF[ErrorKind.ILLEGAL_INSTRUCTION]


def test_each_sticky_cuda_error_has_its_own_kind_and_poisons_the_worker() -> None:
    assert {e.kind for e in CUDA_ERRORS} == CUDA_ERROR_KINDS
    assert len({e.code for e in CUDA_ERRORS}) == len(CUDA_ERRORS) == len(CUDA_ERROR_KINDS)
    assert CUDA_ERROR_KINDS <= POISONING_KINDS
    # the codes CUDA documents as sticky ("the process must be terminated and relaunched"), and ECC
    assert {e.code for e in CUDA_ERRORS} == {700, 702, 710, 714, 715, 716, 717, 718, 719, 214, 226}
    assert not any(is_cuda_error(k) for k in (ErrorKind.OOM, ErrorKind.SIGNAL, ErrorKind.OTHER, None))


@pytest.mark.parametrize("e", WITH_TEXT, ids=_id)
def test_torch_accelerator_error_names_the_kind(e: CudaError) -> None:
    text = torch_traceback(e)
    assert classify_error(None, text) is e.kind  # the type is read from the traceback
    # the exception as the probe worker sees it: type name and message (first line on)
    message = text.split("torch.AcceleratorError: ", 1)[1]
    assert classify_error("torch.AcceleratorError", message) is e.kind
    # torch's "Search for `cudaError...'" line alone names it too
    (search,) = [ln for ln in text.splitlines() if ln.startswith("Search for")]
    assert match_text(search) is e.kind


@pytest.mark.parametrize("e", WITH_TEXT, ids=_id)
def test_triton_launch_error_names_the_kind(e: CudaError) -> None:
    message = triton_message(e)
    assert classify_error("RuntimeError", message.removeprefix("RuntimeError: ")) is e.kind
    assert cuda_error_kind(message) is e.kind


@pytest.mark.parametrize("e", CUDA_ERRORS, ids=_id)
def test_the_driver_enum_names_the_kind(e: CudaError) -> None:
    # cuda-python's form: "cuLaunchKernel failed: <CUresult.CUDA_ERROR_MISALIGNED_ADDRESS: 716>"
    assert match_text(f"cuLaunchKernel failed: <CUresult.{e.driver}: {e.code}>") is e.kind
    # compute-sanitizer's: "Program hit cudaErrorLaunchFailure (error 719) due to ..."
    assert match_text(f"Program hit {e.runtime} (error {e.code}) due to something") is e.kind


def test_the_first_fault_wins_over_the_launch_failure_it_leaves_behind() -> None:
    """Measured (FINDINGS.md, 2026-12-06): after an illegal instruction the later calls of the
    process report 'unspecified launch failure'. A log holding both names the first."""
    illegal = CUDA_ERROR_OF[ErrorKind.ILLEGAL_INSTRUCTION]
    later = triton_message(CUDA_ERROR_OF[ErrorKind.LAUNCH_FAILURE])
    assert match_text(torch_traceback(illegal) + later + "\n") is ErrorKind.ILLEGAL_INSTRUCTION
    misaligned = CUDA_ERROR_OF[ErrorKind.MISALIGNED_ADDRESS]
    assert match_text(later + "\n" + torch_traceback(misaligned)) is ErrorKind.MISALIGNED_ADDRESS


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        # SIGILL, a CPU fault: faulthandler's line and the shell's, never a CUDA illegal instruction
        ("Fatal Python error: Illegal instruction\n\nCurrent thread 0x00007f (most recent call first):\n", None),
        ("Illegal instruction (core dumped)\n", None),
        # SIGBUS
        ("Fatal Python error: Bus error\n", None),
        # torch's boilerplate after every CUDA error is no device assert
        ("Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n", None),
        # torch._grouped_mm's argument check before launch (recorded on an H100): a refusal
        ("RuntimeError: expected data_ptr to be aligned to 16 bytes\n", ErrorKind.BAD_INPUT),
    ],
)
def test_near_misses_are_not_cuda_errors(text: str, kind: ErrorKind | None) -> None:
    assert cuda_error_kind(text) is None
    assert match_text(text) is kind


# --- the crash classifier: a child that died without writing its outcome ----------------------------


SPEC = ProbeSpec(
    probe_id="GPU 0/offsets:storage-offset-1",
    kernel="k.py:fn",
    condition=Condition.OFFSETS,
    device=0,
    current=0,
    shape=Shape(m=256, e=8, n=256, k=256),
)


@pytest.mark.parametrize("e", WITH_TEXT, ids=_id)
def test_a_dead_child_s_stderr_names_the_kind(e: CudaError) -> None:
    """A worker that printed the CUDA error's traceback and died (SIGABRT from the C++ side, or a
    plain exit) before it could write its outcome."""
    tail = torch_traceback(e)
    for code in (-6, 1):
        assert classify_exit(code, tail) is e.kind
        end = ChildEnd(ending=Ending.EXITED, who="worker 1", exit_code=code, tail=tail)
        outcome = crash_outcome(SPEC, end, phase=Phase.SYNC)
        assert outcome.status is Status.ERROR and outcome.error_kind is e.kind
        assert outcome.error_kind in POISONING_KINDS


def test_a_cpu_illegal_instruction_is_a_signal_not_a_cuda_error() -> None:
    tail = "Fatal Python error: Illegal instruction\n\nCurrent thread 0x00007f (most recent call first):\n"
    assert classify_exit(-4, tail) is ErrorKind.SIGNAL


# --- explain --------------------------------------------------------------------------------------


#: The causes that fit each kind, in order (ILLEGAL_ADDRESS and DEVICE_ASSERT: test_explain.py).
FITS = {
    ErrorKind.MISALIGNED_ADDRESS: [("misaligned-operand", "offsets")],
    ErrorKind.ILLEGAL_INSTRUCTION: [("invalid-routing", "over-routed,negative-sizes"), ("misaligned-operand", "offsets")],
    ErrorKind.LAUNCH_FAILURE: [("invalid-routing", "over-routed,negative-sizes"), ("int32-offset-overflow", "int32-boundary")],
    ErrorKind.LAUNCH_TIMEOUT: [("cross-device-stream-race", "peer,sizes-race"), ("invalid-routing", "over-routed,negative-sizes")],
    ErrorKind.HARDWARE_STACK_ERROR: [],
    ErrorKind.INVALID_PC: [],
    ErrorKind.INVALID_ADDRESS_SPACE: [],
    ErrorKind.ECC_UNCORRECTABLE: [],
}


@pytest.mark.parametrize("kind", sorted(FITS), ids=str)
def test_explain_names_the_kind_and_the_causes_that_fit(kind: ErrorKind) -> None:
    e = CUDA_ERROR_OF[kind]
    x = explain_text(torch_traceback(e))
    assert x.findings and x.error_kind is kind
    assert e.runtime in x.headline and str(e.code) in x.headline
    assert [(f.cause, f.settle.split(" --only ")[-1]) for f in x.fits] == FITS[kind]
    assert any(c.startswith("the CUDA error is sticky") for c in x.caveats)
    # noticed at torch.cuda.synchronize, not at the launch: the frames say where it surfaced
    assert any("surfaced at a later CUDA call" in c for c in x.caveats)
    if not FITS[kind]:
        assert any(c.startswith(f"no cause of the catalogue fits {kind}") for c in x.caveats)


def test_explain_of_a_misaligned_address_settles_it_with_the_offsets_cells_on_one_gpu() -> None:
    x = explain_text(torch_traceback(CUDA_ERROR_OF[ErrorKind.MISALIGNED_ADDRESS]))
    (fit,) = x.fits
    assert fit.settle == "qmoe-doctor scan --gpus 0 --kernel path.py:fn --only offsets"
    assert "16-byte" in fit.why
    assert x.next_steps == (fit.settle,)


def test_explain_of_a_contained_error_fits_a_remote_access() -> None:
    text = RECORDED_TORCH.replace(RECORDED_NAME, "cudaErrorContained")  # DERIVED: the enum name only
    text = text.replace(RECORDED_TEXT, "an exception occurred on the device")
    x = explain_text(text)
    assert x.error_kind is ErrorKind.ERROR_CONTAINED
    assert [f.cause for f in x.fits] == ["missing-device-guard"]


def test_explain_of_the_triton_launch_error_has_no_later_call_caveat() -> None:
    """Under CUDA_LAUNCH_BLOCKING=1 the error comes out of Triton's launcher: the frames are the
    launch's (the recorded blocking-pass text, DERIVED to an illegal instruction)."""
    e = CUDA_ERROR_OF[ErrorKind.ILLEGAL_INSTRUCTION]
    text = (
        "Traceback (most recent call last):\n"
        '  File "/venv/lib/python3.12/site-packages/triton/backends/nvidia/driver.py", line 713, in __call__\n'
        "    self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,\n"
        + triton_message(e)
        + "\n"
    )
    x = explain_text(text)
    assert x.error_kind is ErrorKind.ILLEGAL_INSTRUCTION
    assert not any("surfaced at a later CUDA call" in c for c in x.caveats)


@pytest.mark.parametrize("kind", [ErrorKind.MISALIGNED_ADDRESS, ErrorKind.ILLEGAL_INSTRUCTION])
def test_a_clean_log_beside_a_cuda_error_is_never_a_clean_run(kind: ErrorKind) -> None:
    """DERIVED: the recorded clean memcheck log with the program's own line naming a CUDA error
    after it (as a C++ program prints it): not "reported no errors", not exit 0."""
    e = CUDA_ERROR_OF[kind]
    line = f"CUDA error: {e.text}\n"
    clean = explain_text(recorded_2xh200("memcheck-builtin-clean.log"))
    assert not clean.findings and clean.headline.startswith("compute-sanitizer reported no errors")
    x = explain_text(recorded_2xh200("memcheck-builtin-clean.log") + line)
    assert x.findings and x.error_kind is kind
    assert not x.headline.startswith("compute-sanitizer reported no errors")
    assert any(c.startswith("compute-sanitizer reported no error in what it checked, yet") for c in x.caveats)
    assert "misaligned-operand" in [f.cause for f in x.fits]
    alone = explain_text(line)  # the line alone is explained, not refused as unreadable
    assert alone.findings and alone.error_kind is kind and alone.fits == x.fits


# --- records written before each kind existed still read ------------------------------------------


def _outcome(kind: str, message: str) -> dict[str, object]:
    doc = to_jsonable(
        Outcome(probe_id=SPEC.probe_id, spec=SPEC, status=Status.ERROR, phase=Phase.SYNC, error_type="torch.AcceleratorError")
    )
    assert isinstance(doc, dict)
    return {**doc, "error_kind": kind, "error_message": message}


@pytest.mark.parametrize(
    ("old", "text", "now"),
    [
        ("illegal-address", "CUDA error: misaligned address", ErrorKind.MISALIGNED_ADDRESS),
        ("illegal-address", "CUDA error: unspecified launch failure", ErrorKind.LAUNCH_FAILURE),
        ("other", "CUDA error: an illegal instruction was encountered", ErrorKind.ILLEGAL_INSTRUCTION),
        ("illegal-address", "CUDA error: an illegal memory access was encountered", ErrorKind.ILLEGAL_ADDRESS),
        ("other", "worker 1 killed by SIGKILL (signal 9) at launch", ErrorKind.OTHER),
        ("device-assert", "CUDA error: unspecified launch failure", ErrorKind.DEVICE_ASSERT),  # kept as written
    ],
)
def test_an_old_record_s_kind_is_read_again_from_its_text(old: str, text: str, now: ErrorKind) -> None:
    assert from_jsonable(Outcome, _outcome(old, text)).error_kind is now
    end = from_jsonable(ProcessEnd, {"kind": "exception", "detail": f"AcceleratorError: {text}", "error_kind": old})
    assert end.error_kind is now


def test_every_recorded_outcome_reads_with_the_kind_its_text_names() -> None:
    """Every Outcome in the recorded scan reports reads back; one whose kind is a CUDA error
    carries the kind its own message names (or, for a crash, its stderr)."""
    seen = 0
    for path in sorted((FIXTURES / "reports" / "scan").glob("*/*.json")):
        for doc in json.loads(path.read_text())["outcomes"]:
            o = from_jsonable(Outcome, doc)
            if is_cuda_error(o.error_kind) and cuda_error_kind(o.error_message or ""):
                seen += 1
                assert o.error_kind is cuda_error_kind(o.error_message or ""), (path.name, o.probe_id)
    assert seen > 0


def test_a_record_round_trips_with_each_new_kind() -> None:
    for kind in CUDA_ERROR_KINDS:
        doc = _outcome(str(kind), "")
        assert from_jsonable(Outcome, doc).error_kind is kind
