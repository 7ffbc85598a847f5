"""``misaligned-operand`` from differential evidence, and an over-routed cell that ends in an
illegal instruction read as the one that ends in an illegal address.

The outcome lists are the recorded scan of the built-in kernel on one H100 (2026-11-25,
commit e9d91ec: every cell passed; its ``offsets:storage-offset-1`` cell handed the kernel x and
w at ``data_ptr % 16 == 2``, its ``storage-offset-8`` cell at 0), with one or two cells
replaced by the failure a kernel that assumes alignment gives. The replacement is what the probe
worker writes for that failure: the recorded ``torch.AcceleratorError`` message of the same
scan's int32 cell (``scan-int32_offsets.json``), DERIVED to CUDA's text and enum name of the
error (FINDINGS.md, 2026-12-06: a TMA-descriptor kernel given x two bytes into its storage ended
in ``CUDA error: misaligned address``; over-routed by 64 rows, in ``CUDA error: an illegal
instruction was encountered``), classified by the worker's own classifier.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from recorded_logs import RECORDED

from qmoe_doctor.core.error_kind import CUDA_ERROR_OF, classify_error
from qmoe_doctor.core.records import Confidence, ErrorKind, Outcome, Phase, Status, from_jsonable
from qmoe_doctor.diagnose.scan_rules import Classification, classify

H100 = RECORDED / "scan" / "2026-11-25-h100-e9d91ec"
BAD = "GPU 0/offsets:storage-offset-1"
GOOD = "GPU 0/offsets:storage-offset-8"
SINGLE = "GPU 0/single"
OVER = "GPU 0/over-routed"


def recorded(name: str) -> tuple[str, list[Outcome]]:
    doc = json.loads((H100 / f"scan-{name}.json").read_text())
    return doc["kernel"], [from_jsonable(Outcome, o) for o in doc["outcomes"]]


def _recorded_message() -> str:
    _, outcomes = recorded("int32_offsets")
    (cell,) = [o for o in outcomes if o.probe_id == "GPU 0/int32-boundary"]
    assert cell.error_message is not None and cell.error_type == "torch.AcceleratorError"
    return cell.error_message


RECORDED_MESSAGE = _recorded_message()


def cuda_message(kind: ErrorKind) -> str:
    """DERIVED: the recorded AcceleratorError message with ``kind``'s text and enum name."""
    e = CUDA_ERROR_OF[kind]
    assert e.text is not None
    return RECORDED_MESSAGE.replace("an illegal memory access was encountered", e.text).replace(
        "cudaErrorIllegalAddress", e.runtime
    )


def failed(o: Outcome, kind: ErrorKind, **facts: Any) -> Outcome:
    """``o`` ended in the CUDA error ``kind`` at the synchronize after the call."""
    message = cuda_message(kind)
    return dataclasses.replace(
        o,
        status=Status.ERROR,
        phase=Phase.SYNC,
        error_type="torch.AcceleratorError",
        error_message=message,
        error_kind=classify_error("torch.AcceleratorError", message),
        rel_error=None,
        unwritten=None,
        facts={**o.facts, **facts},
    )


def scan(replaced: dict[str, Outcome | None] | None = None) -> Classification:
    kernel, outcomes = recorded("builtin")
    changes = replaced or {}
    cells = [changes.get(o.probe_id, o) for o in outcomes]
    return classify([o for o in cells if o is not None], kernel=kernel)


def cell(probe_id: str) -> Outcome:
    _, outcomes = recorded("builtin")
    (found,) = [o for o in outcomes if o.probe_id == probe_id]
    return found


def test_the_recorded_scan_is_healthy() -> None:
    result = scan()
    assert result.diagnoses == () and result.unexplained == ()


def test_a_misaligned_address_where_the_aligned_twin_passes_is_a_misaligned_operand() -> None:
    bad = failed(cell(BAD), ErrorKind.MISALIGNED_ADDRESS)
    assert bad.error_kind is ErrorKind.MISALIGNED_ADDRESS
    result = scan({BAD: bad})
    (diag,) = result.diagnoses
    assert diag.cause == "misaligned-operand" and diag.confidence is Confidence.HIGH
    assert result.unexplained == ()
    cited = {e.probe_id: e for e in diag.evidence}
    assert set(cited) == {SINGLE, GOOD, BAD}
    assert cited[BAD].label == "misaligned-address"
    # which operands, how far off the 16-byte grid: from the pointers the probe handed the kernel
    assert cited[BAD].detail.startswith("x and w data_ptr % 16 == 2 (not 16-byte aligned): ")
    assert "CUDA error: misaligned address" in cited[BAD].detail
    assert cited[GOOD].detail.startswith("x and w data_ptr % 16 == 0 (16-byte aligned): correct")
    assert "x and w data_ptr % 16 == 2" in diag.summary and "`misaligned-address`" in diag.summary
    assert diag.repro == "qmoe-doctor scan --kernel builtin --gpus 0 --only offsets"
    assert diag.where == ("GPU 0",)


def test_without_recorded_pointers_the_offset_comes_from_the_variant_and_dtype() -> None:
    bad = dataclasses.replace(failed(cell(BAD), ErrorKind.MISALIGNED_ADDRESS), tensors=())
    (diag,) = scan({BAD: bad}).diagnoses
    (ev,) = [e for e in diag.evidence if e.probe_id == BAD]
    assert ev.detail.startswith("x and w 2 bytes into their buffers (not 16-byte aligned)")


@pytest.mark.parametrize(
    ("kind", "confidence"),
    [(ErrorKind.ILLEGAL_INSTRUCTION, Confidence.MEDIUM), (ErrorKind.MISALIGNED_ADDRESS, Confidence.HIGH)],
)
def test_an_illegal_instruction_there_is_a_misaligned_operand_of_medium_confidence(
    kind: ErrorKind, confidence: Confidence
) -> None:
    """A TMA copy off the 16-byte grid ends in an illegal instruction (triton #7385): the
    differential evidence names the cause, the error does not name alignment."""
    (diag,) = scan({BAD: failed(cell(BAD), kind)}).diagnoses
    assert (diag.cause, diag.confidence) == ("misaligned-operand", confidence)


def test_wrong_values_there_are_a_misaligned_operand_of_medium_confidence() -> None:
    wrong = dataclasses.replace(cell(BAD), status=Status.WRONG, rel_error=0.9)
    (diag,) = scan({BAD: wrong}).diagnoses
    assert (diag.cause, diag.confidence) == ("misaligned-operand", Confidence.MEDIUM)
    assert "wrong values" in diag.summary


def test_no_diagnosis_when_the_aligned_offset_fails_too() -> None:
    """Both offsets fail: the kernel mishandles a storage offset itself, whatever its alignment.
    No cause is named; both cells stay unexplained, never hidden."""
    result = scan(
        {BAD: failed(cell(BAD), ErrorKind.MISALIGNED_ADDRESS), GOOD: failed(cell(GOOD), ErrorKind.MISALIGNED_ADDRESS)}
    )
    assert result.diagnoses == ()
    assert {e.probe_id for e in result.unexplained} == {BAD, GOOD}


def test_no_diagnosis_when_single_fails_or_the_aligned_twin_did_not_run() -> None:
    bad = failed(cell(BAD), ErrorKind.MISALIGNED_ADDRESS)
    wrong_single = dataclasses.replace(cell(SINGLE), status=Status.WRONG, rel_error=0.5)
    assert "misaligned-operand" not in {d.cause for d in scan({BAD: bad, SINGLE: wrong_single}).diagnoses}
    result = scan({BAD: bad, GOOD: None})
    assert result.diagnoses == () and [e.probe_id for e in result.unexplained] == [BAD]


def test_another_failure_of_the_misaligned_cell_is_not_read_as_alignment() -> None:
    bad = failed(cell(BAD), ErrorKind.ILLEGAL_ADDRESS)
    result = scan({BAD: bad})
    assert result.diagnoses == () and [e.probe_id for e in result.unexplained] == [BAD]


def test_a_loud_refusal_of_the_misaligned_view_is_rejected_not_a_fault() -> None:
    """torch._grouped_mm's check before launch (recorded on an H100): correct, no diagnosis."""
    refused = dataclasses.replace(
        cell(BAD),
        status=Status.ERROR,
        phase=Phase.LAUNCH,
        error_type="RuntimeError",
        error_message="expected data_ptr to be aligned to 16 bytes",
        error_kind=classify_error("RuntimeError", "expected data_ptr to be aligned to 16 bytes"),
        facts={**cell(BAD).facts, "raised_in": "kernel", "kernel_launches": 0},
    )
    assert refused.error_kind is ErrorKind.BAD_INPUT
    result = scan({BAD: refused})
    assert result.diagnoses == () and result.unexplained == ()


# --- an over-routed cell: illegal instruction == illegal address ---------------------------------


@pytest.mark.parametrize("kind", [ErrorKind.ILLEGAL_INSTRUCTION, ErrorKind.LAUNCH_FAILURE, ErrorKind.MISALIGNED_ADDRESS])
def test_an_over_routed_cell_ending_in_any_cuda_error_is_invalid_routing_as_an_illegal_address(
    kind: ErrorKind,
) -> None:
    """Measured (FINDINGS.md, 2026-12-06): a TMA-descriptor kernel over-routed by 64 rows ends in
    an illegal instruction, not an illegal address. The probe's in-process baseline (valid
    routing, same operands) passed first."""
    facts = {"baseline_ok": True, "variant_ok": False}
    reference = scan({OVER: failed(cell(OVER), ErrorKind.ILLEGAL_ADDRESS, **facts)})
    result = scan({OVER: failed(cell(OVER), kind, **facts)})
    (ref,) = reference.diagnoses
    (diag,) = result.diagnoses
    assert (diag.cause, diag.severity, diag.confidence) == ("invalid-routing", "fault", Confidence.HIGH)
    assert (diag.cause, diag.severity, diag.confidence, diag.repro, diag.where) == (
        ref.cause,
        ref.severity,
        ref.confidence,
        ref.repro,
        ref.where,
    )
    assert [e.probe_id for e in diag.evidence] == [e.probe_id for e in ref.evidence]
    assert {e.label for e in diag.evidence if e.probe_id == OVER} == {str(kind)}  # the cell's own kind
    assert result.unexplained == () and result.hardening == ()
