"""diagnose/device_assert.py: device-side assertion lines -> where the assert fired and what it checked.

Inputs, labelled as in test_sanitizer.py:

* RECORDED: the TRITON_DEBUG=1 run of the int32 specimen on 2x H200
  (``tracebacks/2026-11-22-2xh200-7ada31c/traceback-int32-debug.stderr.gz``: 3,936 assert lines, two of them cut
  by the traceback's own writes), the ``stderr_tail`` of a scan's ``+debug`` rerun
  (``reports/scan/2026-11-22-2xh200-7ada31c/scan-int32_offsets.json``), and torch._grouped_mm's own asserts in a check
  report (``reports/check/2026-11-22-2xh200-ab67830/check-torch.json``).
* HAND-WRITTEN FORMAT SAMPLES: forms we have not recorded (an aten function with ``::`` and
  template arguments, single quotes, SYCL's ``global id``, a launcher prefix), values made up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from recorded_logs import RECORDED, recorded_2xh200

from qmoe_doctor.diagnose.device_assert import (
    AssertSite,
    DeviceAssert,
    assert_sites,
    find_device_asserts,
    is_device_assert_line,
    overflow_check,
    parse_device_assert,
)
from qmoe_doctor.diagnose.traceback import parse_traceback

SPECIMEN = "/work/main/kernels/specimens/int32_offsets.py"


def _strings(doc: Any, key: str) -> list[str]:
    """Every string value under ``key`` anywhere in a JSON document."""
    if isinstance(doc, dict):
        found = [v for k, v in doc.items() if k == key and isinstance(v, str)]
        return found + [s for v in doc.values() for s in _strings(v, key)]
    if isinstance(doc, list):
        return [s for v in doc for s in _strings(v, key)]
    return []


def _recorded_json(*parts: str) -> Any:
    return json.loads(Path(RECORDED, *parts).read_text(encoding="utf-8"))


# --- RECORDED ----------------------------------------------------------------------------------


def test_recorded_triton_overflow_asserts_give_file_line_and_operation() -> None:
    asserts = find_device_asserts(recorded_2xh200("traceback-int32-debug.stderr.gz"))
    assert len(asserts) == 3936
    first = asserts[0]
    assert (first.file, first.line, first.function) == (SPECIMEN, 102, None)  # Triton prints "unknown"
    assert (first.block, first.thread) == ("101,0,0", "32,0,0")
    assert first.site == f"{SPECIMEN}:102"
    assert (first.overflow_bits, first.operation) == (32, "mul")
    whole, cut = assert_sites(asserts)
    assert (whole.site, whole.operation, whole.threads, whole.blocks) == (f"{SPECIMEN}:102", "mul", 3934, 96)
    assert whole.render() == f"int32 overflow in mul at {SPECIMEN}:102: 3,934 threads in 96 blocks"
    # two lines lost their front to the traceback's writes: message kept, no file:line invented
    assert (cut.site, cut.operation, cut.threads) == (None, "mul", 2)
    assert cut.render() == "int32 overflow in mul (file:line cut off): 2 threads in 1 block"


def test_the_traceback_reader_keeps_the_same_asserts() -> None:
    text = recorded_2xh200("traceback-int32-debug.stderr.gz")
    assert parse_traceback(text).asserts == find_device_asserts(text)


def test_recorded_debug_rerun_stderr_tail_of_a_scan() -> None:
    doc = _recorded_json("scan", "2026-11-22-2xh200-7ada31c", "scan-int32_offsets.json")
    (tail,) = [o["stderr_tail"] for o in doc["outcomes"] if o["probe_id"].endswith("int32-boundary+debug")]
    (site,) = assert_sites(find_device_asserts(tail))
    assert (site.file, site.line, site.overflow_bits, site.operation) == (SPECIMEN, 102, 32, "mul")
    assert site.threads == len([ln for ln in tail.splitlines() if "Assertion" in ln])


def test_recorded_aten_asserts_name_the_function_and_no_operation() -> None:
    logs = [s for s in _strings(_recorded_json("check", "2026-11-22-2xh200-ab67830", "check-torch.json"), "log") if "Assertion" in s]
    sites = [site for log in logs for site in assert_sites(find_device_asserts(log))]
    assert [(s.file, s.line) for s in sites] == [
        ("/pytorch/aten/src/ATen/native/cuda/GroupMMCommon.cuh", 89),
        ("/pytorch/aten/src/ATen/native/cuda/GroupMMCommon.cuh", 54),
    ]
    assert {s.function for s in sites} == {"prepare_grouped_gemm_data"}
    assert all(s.operation is None and s.overflow_bits is None for s in sites)
    assert sites[0].message == 'offset <= tensor_ShapeA[0] && "expected offset to be less than tensor size\\n"'


# --- HAND-WRITTEN format samples -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (  # an aten kernel's C++ signature: "::", templates, commas
            "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1290: void at::native::index_select<float, long>"
            "(at::cuda::detail::TensorInfo<T, long>, int): block: [5,0,0], thread: [64,0,0] Assertion "
            "`srcIndex < srcSelectDimSize` failed.",
            DeviceAssert(
                message="srcIndex < srcSelectDimSize",
                file="/pytorch/aten/src/ATen/native/cuda/Indexing.cu",
                line=1290,
                function="void at::native::index_select<float, long>(at::cuda::detail::TensorInfo<T, long>, int)",
                block="5,0,0",
                thread="64,0,0",
            ),
        ),
        (  # single quotes, an add
            "moe.py:57: unknown: block: [0,0,0], thread: [3,0,0] Assertion 'int32 overflow detected for "
            "operation add' failed.",
            DeviceAssert(
                message="int32 overflow detected for operation add",
                file="moe.py",
                line=57,
                block="0,0,0",
                thread="3,0,0",
            ),
        ),
        (  # SYCL's ids
            "k.py:9: f: global id: [7,0,0], local id: [1,0,0] Assertion `x` failed.",
            DeviceAssert(message="x", file="k.py", line=9, function="f", block="7,0,0", thread="1,0,0"),
        ),
        ("nothing to see here", None),
        ("AssertionError: plain Python", None),
    ],
)
def test_sample_forms(line: str, expected: DeviceAssert | None) -> None:
    assert parse_device_assert(line) == expected


def test_a_launcher_prefix_is_stripped_before_reading_the_file() -> None:
    line = "moe.py:57: unknown: block: [0,0,0], thread: [3,0,0] Assertion `int32 overflow detected for operation mul` failed."
    (a,) = find_device_asserts(f"[rank1]: {line}\n")
    assert (a.site, a.operation) == ("moe.py:57", "mul")
    assert is_device_assert_line(line)
    cut = ":57: unknown: block: [0,0,0], thread: [3,0,0] Assertion `x` failed."  # front overwritten
    assert not is_device_assert_line(cut) and parse_device_assert(cut) == DeviceAssert(
        message="x", block="0,0,0", thread="3,0,0"
    )


def test_overflow_check_reads_the_message_or_the_exception_line() -> None:
    assert overflow_check("int32 overflow detected for operation mul") == (32, "mul")
    assert overflow_check("RuntimeError: ... int64 overflow detected for operation sub ...") == (64, "sub")
    assert overflow_check("offset <= size") is None


def test_sites_fold_by_place_and_message_in_first_seen_order() -> None:
    a = DeviceAssert(message="int32 overflow detected for operation mul", file="k.py", line=3, block="0,0,0")
    b = DeviceAssert(message="x < n", file="k.py", line=9, block="1,0,0")
    sites = assert_sites([a, b, a, DeviceAssert(message=a.message, file="k.py", line=3, block="2,0,0")])
    assert sites == (
        AssertSite(
            file="k.py", line=3, function=None, message=a.message, overflow_bits=32, operation="mul",
            threads=3, blocks=2,
        ),
        AssertSite(
            file="k.py", line=9, function=None, message="x < n", overflow_bits=None, operation=None,
            threads=1, blocks=1,
        ),
    )
    assert sites[1].render() == "'x < n' at k.py:9: 1 thread in 1 block"
    assert assert_sites([]) == ()
