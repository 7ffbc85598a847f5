"""The JSON documents: the machine contract of every command (``--json``, ``--save``).

Every document carries ``schema_version`` and ``kind`` so consumers can dispatch on it.
Files are written whole or not at all (a run killed mid-write keeps the previous file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qmoe_doctor.core.records import json_document

__all__ = ["dumps", "json_document", "write_atomic"]


def dumps(doc: Any) -> str:
    """Indented JSON, one document, newline-terminated (NaN kept: rel. errors can be nan)."""
    return json.dumps(doc, indent=2, allow_nan=True) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
