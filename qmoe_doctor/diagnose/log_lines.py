"""The prefixes that tools put in front of every line of a child's output, and how to take them off.

A traceback or a device-assert line reaches the user through a launcher or a log collector that
tags each line: torchrun's ``[rank3]: ``, a ray / vLLM worker's ``(Worker pid=4242) ``, vLLM's
own log header, a container runtime's timestamp and stream, pytest's ``E   ``. The readers of
tracebacks and device asserts strip them first and keep the rank or worker tag as the stream
the line came from. (compute-sanitizer lines carry their own ``=========`` marker and are read
by ``sanitizer_log``, which keeps any prefix as the stream.)
"""

from __future__ import annotations

import re

_PREFIXES = (
    re.compile(r"^\s*\[(?P<tag>rank\d+)\]:\s?"),  # torchrun
    re.compile(r"^\s*\((?P<tag>[^()]*pid=\d+)\)\s?"),  # ray / vLLM workers
    re.compile(r"^(?:ERROR|WARNING|INFO|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? [\w.]+:\d+\]\s?"),  # vLLM
    re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+(?:Z|[+-]\d\d:?\d\d)? (?:stdout|stderr) [FP] "),  # container logs
    re.compile(r"^E {3}"),  # pytest's failure lines
)


#: The longest number a tool writes in a log or traceback: a 64-bit address is 18 characters as
#: 0x..., a byte count with thousands separators 26. A longer run of digits is damage (or a
#: hostile file), and int() refuses a decimal one of over 4,300 digits with a bare ValueError.
MAX_NUMBER_CHARS = 40


class LogNumberError(ValueError):
    """A number in a log or traceback that no tool writes: the text is damaged."""


def parse_int(text: str) -> int:
    """'131,072' -> 131072; '0x7f..' -> int; '12' -> 12. Raises LogNumberError for a number
    longer than MAX_NUMBER_CHARS (before int() spends time on it)."""
    text = text.strip()
    if len(text) > MAX_NUMBER_CHARS:
        raise LogNumberError(
            f"it holds a number {len(text):,} characters long ({text[:12]}...), which no tool writes"
        )
    if text.lower().startswith("0x"):
        return int(text, 16)
    return int(text.replace(",", ""))


def strip_prefix(line: str) -> tuple[str, str]:
    """(stream tag, line without the tools' prefixes). The tag is the rank or worker ("rank3",
    "Worker pid=4242"), "" when the line carried none."""
    tag = ""
    changed = True
    while changed:
        changed = False
        for rx in _PREFIXES:
            m = rx.match(line)
            if m:
                if "tag" in rx.groupindex and m.group("tag"):
                    tag = m.group("tag")
                line = line[m.end() :]
                changed = True
    return tag, line


__all__ = ["MAX_NUMBER_CHARS", "LogNumberError", "parse_int", "strip_prefix"]
