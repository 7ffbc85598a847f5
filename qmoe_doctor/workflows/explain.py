"""`explain`: read a saved compute-sanitizer log or traceback the user gives, and explain it.

The input goes through the one bounded reader (``qmoe_doctor.core.inputs.read_text``): a regular
file, a gzip (capped on its decompressed size), or standard input (``-``), each capped; a FIFO,
a device such as ``/dev/zero``, a directory or a corrupt gzip is refused before it can hang or
fill memory. Everything the command refuses is an ``InputError`` naming the input, in one line.
"""

from __future__ import annotations

import os

from qmoe_doctor.core.inputs import InputError, read_text
from qmoe_doctor.diagnose.explain import Explanation, NothingToExplain, explain_text


def explain_input(path: str | os.PathLike[str]) -> Explanation:
    """Explain the text of ``path`` (``-``: standard input). Raises InputError when it cannot be
    read or holds neither a compute-sanitizer log nor a Python traceback."""
    source = os.fspath(path)
    name = "standard input" if source == "-" else source
    text = read_text(path)
    try:
        return explain_text(text, source=source)
    except NothingToExplain as exc:
        raise InputError(f"{name}: {exc}") from None


__all__ = ["Explanation", "explain_input"]
