"""Device-side assertion lines a probe printed, read back from the worker's own log.

A failed device-side assert (``TRITON_DEBUG=1``'s int32 overflow check, aten's index checks)
prints one line per failing thread, ``file.py:79: kernel: block: [..], thread: [..] Assertion
`int32 overflow detected for operation mul` failed.``, through the CUDA driver's printf buffer
onto the process's stdout. Only these lines name the kernel's source line; the exception Python
raises later says "device-side assert triggered", and the tail of the log the parent attaches
holds the traceback, not them (thousands of lines come before it: 3,962 in the recorded
``tests/fixtures/tracebacks/2026-11-22-2xh200-7ada31c/traceback-int32-debug.stderr.gz``).

A worker's stdout and stderr are one log file (``isolate.worker_pool``), so the worker notes
the file's size when a probe starts and, when the probe ends in a device assert, reads what was
appended since and keeps the assertion lines: the first ``MAX_LINES`` and their total count, as
the outcome facts ``device_assert_lines`` and ``device_assert_count``. The parent parses them
(``diagnose/device_assert.py``). No torch here; nothing when stdout is not a regular file.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat

#: Assertion lines kept (the rest are counted): the sites repeat once per thread.
MAX_LINES = 64
#: Bytes of the log read at most (one line per failing thread: 616 KB for 3,962 threads).
MAX_BYTES = 8 << 20
_MARK = b"Assertion "
_LOG_FD = 1


def log_offset() -> int | None:
    """The size of this process's log now (stdout as a regular file), or None."""
    try:
        st = os.fstat(_LOG_FD)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _flush_c_stdio() -> None:
    """The driver prints through C stdio, which buffers a file fully: flush it first."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).fflush(None)


def assertion_lines(data: bytes, *, limit: int = MAX_LINES) -> tuple[list[str], int]:
    """(the first ``limit`` assertion lines, how many there were) in a chunk of log bytes."""
    kept: list[str] = []
    total = 0
    for raw in data.splitlines():
        if _MARK not in raw or b" failed" not in raw:
            continue
        total += 1
        if len(kept) < limit:
            kept.append(raw.decode("utf-8", "replace").strip()[:1000])
    return kept, total


def assertions_since(offset: int | None) -> tuple[list[str], int]:
    """The assertion lines appended to this process's log since ``offset`` (``log_offset()``
    when the probe started)."""
    if offset is None:
        return [], 0
    _flush_c_stdio()
    try:
        with open(f"/proc/self/fd/{_LOG_FD}", "rb") as log:
            log.seek(offset)
            data = log.read(MAX_BYTES)
    except OSError:
        return [], 0
    return assertion_lines(data)


__all__ = ["MAX_LINES", "assertion_lines", "assertions_since", "log_offset"]
