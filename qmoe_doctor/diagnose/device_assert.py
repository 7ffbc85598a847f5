"""Device-side assertion lines: where in the kernel an assert fired, and what it checked.

A failed device-side assert prints one line per failing thread on the process's stderr; the
CUDA error itself ("device-side assert triggered") surfaces later, at the next synchronizing
call, so these lines are the only place that names the kernel's file and line. The forms, as
our runs recorded them (``tests/fixtures/tracebacks/2026-11-22-2xh200-7ada31c/traceback-int32-debug.stderr.gz``;
the outcomes' ``stderr_tail`` in ``tests/fixtures/reports/check/2026-11-22-2xh200-ab67830/check-torch.json``)::

    /work/main/kernels/specimens/int32_offsets.py:102: unknown: block: [101,0,0], thread: [32,0,0] Assertion `int32 overflow detected for operation mul` failed.
    /pytorch/aten/src/ATen/native/cuda/GroupMMCommon.cuh:89: prepare_grouped_gemm_data: block: [0,0,0], thread: [7,0,0] Assertion `offset <= tensor_ShapeA[0] && "expected offset to be less than tensor size\\n"` failed.

The first is Triton's: with ``TRITON_DEBUG=1`` it checks every integer add, sub and mul of the
kernel for overflow and names the operation (``int32 overflow detected for operation mul``);
the function is ``unknown`` there. The second is aten's, with a C++ function name (which may
hold ``::`` and template arguments). SYCL-style ``global id: [...], local id: [...]`` is read
like block and thread; a line with a block and no thread is read too. Lines whose front was overwritten by another thread's write (measured on
2x H200: ``:102: unknown: block: ...``) keep their message, block and thread, without a file.

Pure functions of text; the lines may carry launcher prefixes (``[rank0]: ``), which are
stripped as ``log_lines`` does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from qmoe_doctor.diagnose.log_lines import strip_prefix

# file:line: function: block: [...], thread: [...] Assertion `message` failed
_ASSERT = re.compile(
    r"^(?:(?P<file>(?:[A-Za-z]:)?[^\s:]+):(?P<line>\d+):\s*)?(?:(?P<func>(?:[^:\[\]`]|::)+?):\s*)?"
    r"(?:(?:block|global id): \[(?P<block>[^\]]*)\](?:,\s*(?:thread|local id): \[(?P<thread>[^\]]*)\])?\s*)?"
    r"Assertion [`'](?P<msg>.*?)[`'] failed"
)
# the end of an assertion line whose front was cut off (no anchor: anything may precede it)
_ASSERT_TAIL = re.compile(
    r"(?:(?:block|global id): \[(?P<block>[^\]]*)\](?:,\s*(?:thread|local id): \[(?P<thread>[^\]]*)\])?\s*)?"
    r"Assertion [`'](?P<msg>.*?)[`'] failed"
)
# Triton's overflow check (TRITON_DEBUG=1): "int32 overflow detected for operation mul"
_OVERFLOW = re.compile(r"int(?P<bits>\d+) overflow detected for operation (?P<op>\w+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceAssert:
    """One assertion line: one thread whose assert failed."""

    message: str  # "int32 overflow detected for operation mul"
    file: str | None = None  # None when the line's front was cut off
    line: int | None = None
    function: str | None = None  # None for Triton's "unknown"
    block: str | None = None  # "101,0,0"
    thread: str | None = None  # "32,0,0"

    @property
    def site(self) -> str | None:
        """``file.py:102``, when the line kept its front."""
        return f"{self.file}:{self.line}" if self.file and self.line is not None else None

    @property
    def overflow_bits(self) -> int | None:
        """32 for Triton's ``int32 overflow detected for operation ...``; None for other asserts."""
        found = overflow_check(self.message)
        return found[0] if found else None

    @property
    def operation(self) -> str | None:
        """The operation Triton's overflow check names (``mul``, ``add``, ``sub``); None for
        other asserts."""
        found = overflow_check(self.message)
        return found[1] if found else None


@dataclass(frozen=True, slots=True, kw_only=True)
class AssertSite:
    """Assertion lines folded by where they fired and what they said."""

    file: str | None
    line: int | None
    function: str | None
    message: str
    overflow_bits: int | None  # Triton's overflow check: 32 for "int32 overflow ...", else None
    operation: str | None  # the operation that check names ("mul"), else None
    threads: int  # assertion lines (one per failing thread)
    blocks: int  # distinct blocks among them

    @property
    def site(self) -> str | None:
        return f"{self.file}:{self.line}" if self.file and self.line is not None else None

    def render(self) -> str:
        """``int32 overflow in mul at int32_offsets.py:102: 3,934 threads in 40 blocks``"""
        if self.operation and self.overflow_bits:
            what = f"int{self.overflow_bits} overflow in {self.operation}"
        else:
            what = f"'{self.message}'"
        where = f" at {self.site}" if self.site else " (file:line cut off)"
        threads = f"{self.threads:,} thread{'s' if self.threads != 1 else ''}"
        blocks = f" in {self.blocks:,} block{'s' if self.blocks != 1 else ''}" if self.blocks else ""
        return f"{what}{where}: {threads}{blocks}"


def overflow_check(text: str) -> tuple[int, str] | None:
    """(bits, operation) of Triton's overflow check in ``text`` (an assertion message, or the
    exception line that reports it): ``int32 overflow detected for operation mul`` -> (32, "mul")."""
    m = _OVERFLOW.search(text)
    return (int(m.group("bits")), m.group("op")) if m else None


def parse_device_assert(line: str) -> DeviceAssert | None:
    """The assertion on one line (launcher prefixes already stripped), or None."""
    m = _ASSERT.search(line)
    if m:
        func = (m.group("func") or "").strip() or None
        return DeviceAssert(
            message=m.group("msg"),
            file=m.group("file"),
            line=int(m.group("line")) if m.group("line") else None,
            function=None if func == "unknown" else func,
            block=m.group("block"),
            thread=m.group("thread"),
        )
    m = _ASSERT_TAIL.search(line)
    if m:
        # the front of the line was split off by another thread's or the traceback's write:
        # keep what the tail says, no file:line
        return DeviceAssert(message=m.group("msg"), block=m.group("block"), thread=m.group("thread"))
    return None


def is_device_assert_line(line: str) -> bool:
    """A whole assertion line (its front intact): enough to call a text a device-assert report."""
    return _ASSERT.search(line) is not None


def find_device_asserts(text: str) -> tuple[DeviceAssert, ...]:
    """Every assertion line of a stderr text, in order (one per failing thread)."""
    out: list[DeviceAssert] = []
    for raw in text.splitlines():
        found = parse_device_assert(strip_prefix(raw)[1])
        if found is not None:
            out.append(found)
    return tuple(out)


def assert_sites(asserts: Iterable[DeviceAssert]) -> tuple[AssertSite, ...]:
    """Fold assertion lines by (file, line, function, message), first seen first. Lines cut
    before their file fold into a site of their own (file None)."""
    order: list[tuple[str | None, int | None, str | None, str]] = []
    threads: dict[tuple[str | None, int | None, str | None, str], int] = {}
    blocks: dict[tuple[str | None, int | None, str | None, str], set[str]] = {}
    for a in asserts:
        key = (a.file, a.line, a.function, a.message)
        if key not in threads:
            order.append(key)
            threads[key] = 0
            blocks[key] = set()
        threads[key] += 1
        if a.block is not None:
            blocks[key].add(a.block)
    sites: list[AssertSite] = []
    for key in order:
        file, line, function, message = key
        found = overflow_check(message)
        sites.append(
            AssertSite(
                file=file,
                line=line,
                function=function,
                message=message,
                overflow_bits=found[0] if found else None,
                operation=found[1] if found else None,
                threads=threads[key],
                blocks=len(blocks[key]),
            )
        )
    return tuple(sites)


__all__ = [
    "AssertSite",
    "DeviceAssert",
    "assert_sites",
    "find_device_asserts",
    "is_device_assert_line",
    "overflow_check",
    "parse_device_assert",
]
