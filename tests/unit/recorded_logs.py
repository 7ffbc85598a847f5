"""Our own recorded compute-sanitizer logs and tracebacks, and the derived variants the tests make
from them.

Every file read here was written by our own tools on our own GPU runs and lives under
``tests/fixtures/sanitizer/<recording>/`` (compute-sanitizer logs, the probe's Outcome line beside
each) and ``tests/fixtures/tracebacks/<recording>/`` (Python's stderr), a recording named by date,
machine and commit; ``tests/fixtures/MANIFEST.md`` says how each was recorded. The lists below are
globbed, so a new recording's ``*.log``, ``*.xml`` and ``traceback-*.stderr[.gz]`` files are picked
up by the generic tests without editing them.

DERIVED VARIANTS are made from those files by the functions below (cut, interleaved, prefixed,
re-worded): they are labelled as such wherever a test uses them. No log text from elsewhere is
used.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Sequence
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SANITIZER = FIXTURES / "sanitizer"
TRACEBACKS = FIXTURES / "tracebacks"
#: The recorded reports (``reports/scan/<recording>/scan-*.json``, ``reports/check/...``).
RECORDED = FIXTURES / "reports"
MANIFEST = FIXTURES / "MANIFEST.md"
#: 2x H200, 2026-11-22, commit 7ada31c: compute-sanitizer 2025.3.1.0, torch 2.11, triton 3.6
H200X2 = "2026-11-22-2xh200-7ada31c"
SANITIZER_2XH200 = SANITIZER / H200X2  # its compute-sanitizer logs and the probes' Outcome lines
TRACEBACKS_2XH200 = TRACEBACKS / H200X2  # its Python tracebacks

ALL_LOGS = sorted(SANITIZER.glob("*/*.log"))
ALL_XML = sorted(SANITIZER.glob("*/*.xml"))
ALL_TRACEBACKS = sorted(p for p in TRACEBACKS.glob("*/traceback-*") if p.name.endswith((".stderr", ".stderr.gz")))


def read(path: Path) -> str:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8")


def path_2xh200(name: str) -> Path:
    """A file of the 2x H200 recording: its sanitizer log or Outcome line, else its traceback."""
    path = SANITIZER_2XH200 / name
    return path if path.is_file() else TRACEBACKS_2XH200 / name


def recorded_2xh200(name: str) -> str:
    """The text of :func:`path_2xh200`, gunzipped where gzipped."""
    return read(path_2xh200(name))


def rel(path: Path) -> str:
    """A short test id: ``2026-11-22-2xh200-7ada31c/memcheck-builtin-clean.log``."""
    return f"{path.parent.name}/{path.name}"


# --- derived variants -----------------------------------------------------------------------------


def first_records(text: str, n: int) -> str:
    """DERIVED: the banner and the first ``n`` records of a recorded log, closed by the log's own
    summary lines (the big recorded logs hold 50 near-identical records; tests that do not need
    all of them run faster on a few)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    seen = 0
    summary = [ln for ln in lines if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln]
    for ln in lines:
        if ln in summary:
            break
        body = ln.split("=========", 1)[-1]
        if (
            body.startswith(" ")
            and not body.startswith("  ")
            and body.strip()
            and body.strip() != "COMPUTE-SANITIZER"
        ):
            seen += 1
            if seen > n:
                break
        out.append(ln)
    return "".join(out + summary)


def interleave(a: Sequence[str], b: Sequence[str]) -> list[str]:
    """DERIVED: two line lists merged one line from each in turn (two processes writing to one
    terminal)."""
    mixed: list[str] = []
    for i in range(max(len(a), len(b))):
        mixed += list(a[i : i + 1]) + list(b[i : i + 1])
    return mixed


def prefixed(text: str, tag: str) -> list[str]:
    """DERIVED: every line with a launcher's prefix, as torchrun writes ``[rank0]: ...``."""
    return [tag + ln for ln in text.splitlines()]


def older_address_wording(text: str) -> str:
    """DERIVED: the 2025.x ``Access to 0x...`` address lines re-worded as the older releases'
    ``Address 0x...`` (the rest of the line is unchanged)."""
    return re.sub(r"(=========\s+)Access to (0x[0-9a-fA-F]+)", r"\1Address \2", text)
