"""A best-effort reader of compute-sanitizer's XML report (``--xml --save FILE``), for the tests.

The doctor itself reads only the text log (``qmoe_doctor.diagnose.sanitizer_log``); this reader
checks that the records of an XML report, once found, would parse the same. No XML report is
recorded yet and no public one was found, so it assumes no element names: every line of every
element's text is fed to the text parser, re-prefixed as the tool prints it (headers and
summaries at the top level, everything else as a continuation). Malformed or truncated XML is
read as text between the tags.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

from qmoe_doctor.diagnose.sanitizer_log import SanitizerReport, is_top_level_line, parse_sanitizer_log


def parse_sanitizer_xml(path_or_text: str | os.PathLike[str]) -> SanitizerReport:
    """Parse an XML report given as a path or as its text."""
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str)
        and "\n" not in path_or_text
        and not path_or_text.lstrip().startswith("<")
    ):
        text = Path(path_or_text).read_text(encoding="utf-8", errors="replace")
    else:
        text = str(path_or_text)
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        # truncated or not XML at all: read whatever record lines sit between the tags
        return parse_sanitizer_log(pseudo_log(re.sub(r"<[^>]+>", "\n", text).splitlines()))
    lines: list[str] = []
    for elem in root.iter():
        lines.extend((elem.text or "").splitlines())
    return parse_sanitizer_log(pseudo_log(lines))


def pseudo_log(lines: Iterable[str]) -> str:
    """Bare record lines, prefixed as the text log prints them."""
    out: list[str] = []
    for ln in lines:
        ln = ln.strip()
        if ln:
            out.append(("========= " if is_top_level_line(ln) else "=========     ") + ln)
    return "\n".join(out) + "\n"
