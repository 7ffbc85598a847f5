"""A diagnosis from memcheck's placed addresses (``run --sanitize``): synthetic placements.

Each case is a monitor record of one launch (x, w, y, m_sizes of a grouped GEMM on cuda:0) and a
compute-sanitizer log in its own format whose invalid addresses land where the case says, read by
``sanitizer_log`` and placed by ``run_findings.address_notes`` as the sanitize pass places them.
``run_findings.placed_diagnoses`` names a cause only when the addresses agree: at least
AGREEMENT_SHARE of them on one side of the kernel's arguments, where one and the same cause fits
(rows past M of x and of y both fit m_sizes summing past M). The rows name which edge each case
covers.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from qmoe_doctor.core.launches import FindingKind, Launch, ProcessRecord, SourceSite, TensorArg
from qmoe_doctor.core.records import Confidence
from qmoe_doctor.diagnose import run_findings
from qmoe_doctor.diagnose.sanitizer_log import parse_sanitizer_log

KERNEL = "_grouped_gemm_kernel"
M, N, K, E = 256, 128, 64, 8


def _tensor(name: str, ptr: int, shape: tuple[int, ...], dtype: str, itemsize: int) -> TensorArg:
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    numel = math.prod(shape)
    return TensorArg(
        name=name, device="cuda:0", data_ptr=ptr, nbytes=numel * itemsize, shape=shape, strides=strides,
        dtype=dtype, numel=numel,
    )  # fmt: skip


X = _tensor("x_ptr", 0x7F0000000000, (M, K), "bfloat16", 2)
W = _tensor("w_ptr", 0x7F0000100000, (E, N, K), "bfloat16", 2)
Y = _tensor("y_ptr", 0x7F0000200000, (M, N), "bfloat16", 2)
SIZES = _tensor("m_sizes_ptr", 0x7F0000300000, (E,), "int32", 4)
BY_NAME = {t.name: t for t in (X, W, Y, SIZES)}


def record(wrapper: str | None = "moe_lib.ops:grouped_gemm") -> ProcessRecord:
    launch = Launch(
        seq=3, kernel=KERNEL, kernel_seq=1, grid=(132,), device="cuda:0", stream=0, tensors=(X, W, Y, SIZES),
        call_site=SourceSite(file="/venv/lib/python3.11/site-packages/moe_lib/layer.py", line=40, function="forward"),
        launch_site=SourceSite(file="/venv/lib/python3.11/site-packages/moe_lib/ops.py", line=88, function="grouped_gemm"),
        user_site=SourceSite(file="/home/me/train.py", line=12, function="step"),
        wrapper=wrapper,
    )  # fmt: skip
    return ProcessRecord(pid=4242, ppid=1, ring=(launch,), launches=3)


def address(where: str) -> int:
    """``y_ptr+0``: 0 bytes after y's region (its first byte after); ``w_ptr-16``: 16 bytes
    before its start; ``x_ptr@64``: 64 bytes inside."""
    for sign in "+-@":
        if sign in where:
            name, _, n = where.partition(sign)
            t = BY_NAME[name]
            return {"+": t.data_ptr + t.nbytes, "-": t.data_ptr, "@": t.data_ptr}[sign] + (
                -int(n) if sign == "-" else int(n)
            )
    raise ValueError(where)


def memcheck_log(places: list[str]) -> str:
    """compute-sanitizer 2025.3's records, one per address (no nearest-allocation line: the
    placement reads the recorded tensors, not it); a write, or a read where the place ends in
    ``/read``."""
    lines = ["========= COMPUTE-SANITIZER"]
    for i, place in enumerate(places):
        where, _, access = place.partition("/")
        access = access or "write"
        lines += [
            f"========= Invalid __global__ {access} of size 16 bytes",
            f"=========     at {KERNEL}+0x{0x1b0 + 16 * i:x} in moe_lib/ops.py:61",
            f"=========     by thread ({i % 128},0,0) in block ({i // 128},0,0)",
            f"=========     Access to 0x{address(where):x} is out of bounds",
            "========= ",
        ]
    lines.append(f"========= ERROR SUMMARY: {len(places)} errors")
    return "\n".join(lines) + "\n"


def placed(places: list[str], *, wrapper: str | None = "moe_lib.ops:grouped_gemm") -> run_findings.Placement:
    records = [record(wrapper)]
    notes = run_findings.address_notes(parse_sanitizer_log(memcheck_log(places)), records)
    assert len(notes) == len(places)
    return run_findings.placed_diagnoses(notes, records)


#: 64 writes of 16 bytes after y: 4 rows of 128 bf16 past M, as an over-routed last expert writes
PAST_Y = [f"y_ptr+{16 * i}" for i in range(64)]


def test_agreeing_writes_past_y_are_invalid_routing_with_how_the_confidence_was_reached() -> None:
    p = placed(PAST_Y)
    (d,) = p.diagnoses
    assert (d.cause, d.kind, d.confidence, d.seen_in) == (
        "invalid-routing",
        FindingKind.PLACED_ACCESS,
        Confidence.MEDIUM,
        "sanitize",
    )
    assert d.basis == "placed by memcheck, 64 of 64 addresses after the end of y_ptr; not yet proven differentially"
    assert d.repro == "qmoe-doctor scan --kernel moe_lib.ops:grouped_gemm --only over-routed"
    assert d.summary == (
        f"memcheck placed 64 of 64 invalid writes after the end of y_ptr of {KERNEL} #1 (256 x 128 bf16) on "
        "cuda:0, 0 to 1,008 bytes after its 65,536-byte region (rows 256-259, past M=256): m_sizes summing "
        "past M fits"
    )
    assert d.kernel == KERNEL and d.processes == ("pid 4242",) and d.launches == 1
    assert d.finding.launch is not None and d.finding.launch.seq == 3 and d.finding.tensors == (Y,)
    assert p.note == f"64 of 64 invalid addresses agree: after the end of y_ptr of {KERNEL}, m_sizes summing past M fits: invalid-routing"


def test_a_stated_share_agrees_and_says_so() -> None:
    # 60 of 64 (94%) after y, 4 inside x: at least AGREEMENT_SHARE (90%) agree
    p = placed(PAST_Y[:60] + [f"x_ptr@{64 * i}" for i in range(4)])
    (d,) = p.diagnoses
    assert d.cause == "invalid-routing" and "60 of 64 addresses after the end of y_ptr" in d.basis
    assert d.summary.startswith("memcheck placed 60 of 64 invalid writes after the end of y_ptr")


@pytest.mark.parametrize(
    ("places", "split"),
    [
        # some past y, some inside x: no one argument
        (PAST_Y[:40] + [f"x_ptr@{64 * i}" for i in range(24)], "40 after the end of y_ptr, 24 inside x_ptr"),
        # past y (rows past M) and past the weight stack (two causes fit): not one cause
        (PAST_Y[:32] + [f"w_ptr+{16 * i}" for i in range(32)], "32 after the end of y_ptr, 32 after the end of w_ptr"),
        # after y and before y: one argument, two sides
        (PAST_Y[:50] + [f"y_ptr-{16 * (i + 1)}" for i in range(14)], "50 after the end of y_ptr, 14 before the start of y_ptr"),
    ],
)
def test_disagreeing_placements_give_no_diagnosis_and_say_why(places: list[str], split: str) -> None:
    p = placed(places)
    assert p.diagnoses == ()
    assert p.note == (
        f"the 64 invalid addresses disagree ({split}): no diagnosis; a diagnosis needs 90% of the addresses "
        "read past the end or before the start of the kernel's arguments, where one and the same cause fits"
    )


def test_reads_past_x_and_writes_past_y_agree_on_the_one_cause_they_both_fit() -> None:
    # over-routed tiles read rows past the end of x and write rows past the end of y
    p = placed([f"x_ptr+{16 * i}/read" for i in range(32)] + PAST_Y[:32])
    (d,) = p.diagnoses
    assert d.cause == "invalid-routing" and d.repro.endswith("--only over-routed")
    assert d.basis == (
        "placed by memcheck, 64 of 64 addresses after the end of x_ptr and y_ptr; not yet proven differentially"
    )
    assert d.summary == (
        f"memcheck placed 64 of 64 invalid addresses: 32 invalid reads after the end of x_ptr of {KERNEL} #1 "
        "(256 x 64 bf16) on cuda:0, 0 to 496 bytes after its 32,768-byte region (rows 256-259, past M=256); "
        f"32 invalid writes after the end of y_ptr of {KERNEL} #1 (256 x 128 bf16) on cuda:0, 0 to 496 bytes "
        "after its 65,536-byte region (rows 256-257, past M=256): m_sizes summing past M fits"
    )
    assert d.finding.tensors == (X, Y)


def test_all_inside_one_tensor_gives_no_diagnosis() -> None:
    p = placed([f"w_ptr@{4096 * i}" for i in range(10)])
    assert p.diagnoses == () and p.note.startswith("10 of 10 invalid addresses lie inside w_ptr")


def test_past_the_weight_stack_two_causes_fit_so_none_is_named() -> None:
    p = placed([f"w_ptr+{16 * i}" for i in range(20)])
    assert p.diagnoses == ()
    assert p.note == (
        "20 of 20 invalid addresses land after the end of w_ptr, where out-of-range routing or an int32 "
        "product that wrapped fits: not one cause, no diagnosis"
    )


def test_before_x_no_cause_fits_so_none_is_named() -> None:
    p = placed([f"x_ptr-{16 * (i + 1)}" for i in range(8)])
    assert p.diagnoses == () and "where no cause fits" in p.note


def test_without_a_named_wrapper_the_report_says_how_to_extract_the_kernel() -> None:
    (looked,) = placed(PAST_Y, wrapper="").diagnoses
    assert looked.repro.startswith("no module-level function between the launch and your line takes (x, w, m_sizes)")
    assert "moe_lib/ops.py:88 in grouped_gemm" in looked.repro
    assert looked.repro.endswith("qmoe-doctor scan --kernel FILE.py:fn --only over-routed (another signature: an adapter, README: --kernel)")
    (older,) = placed(PAST_Y, wrapper=None).diagnoses
    assert older.repro.startswith("the record names no wrapper")


def test_no_address_no_note() -> None:
    assert run_findings.placed_diagnoses((), [record()]) == run_findings.Placement()


def test_an_address_near_no_recorded_tensor_counts_against_agreement() -> None:
    records = [record()]
    notes = list(run_findings.address_notes(parse_sanitizer_log(memcheck_log(PAST_Y[:8])), records))
    far = [dataclasses.replace(n, tensor=None, device=None, relation=None, fits=()) for n in notes[:2]]
    p = run_findings.placed_diagnoses([*notes[2:], *far], records)
    assert p.diagnoses == () and "(6 after the end of y_ptr, 2 near no recorded tensor)" in p.note
