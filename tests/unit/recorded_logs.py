"""Our own recorded compute-sanitizer logs and tracebacks, and the derived variants the tests make
from them.

Every file read here was written by our own tools on our own GPU runs and lives under
``tests/fixtures/recorded/<run>/sanitizer/`` (each run's README.md says how it was recorded). The
lists below are globbed, so a new run's ``*.log``, ``*.xml`` and ``traceback-*.stderr[.gz]`` files
are picked up by the generic tests without editing them.

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
RECORDED = FIXTURES / "recorded"
RUN1 = RECORDED / "h200x2-run1" / "sanitizer"  # 2x H200, compute-sanitizer 2025.3.1.0, torch 2.11, triton 3.6

ALL_LOGS = sorted(RECORDED.glob("*/sanitizer/*.log"))
ALL_XML = sorted(RECORDED.glob("*/sanitizer/*.xml"))
ALL_TRACEBACKS = sorted(
    p for p in RECORDED.glob("*/sanitizer/traceback-*") if p.name.endswith((".stderr", ".stderr.gz"))
)


def read(path: Path) -> str:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8")


def run1(name: str) -> str:
    return read(RUN1 / name)


def rel(path: Path) -> str:
    """A short test id: ``h200x2-run1/memcheck-builtin-clean.log``."""
    return f"{path.parent.parent.name}/{path.name}"


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
