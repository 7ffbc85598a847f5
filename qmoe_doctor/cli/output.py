"""One output sink: results to stdout, progress and logs to stderr. Commands never print.

``--json`` output is the machine contract: every document carries ``schema_version`` and
``kind`` so consumers can dispatch on it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

from qmoe_doctor.reports.json import json_document


def stdout_console() -> Console:
    """Results. Created per call so tests (CliRunner) capture the swapped sys.stdout."""
    return Console(file=sys.stdout, highlight=False, soft_wrap=False)


def stderr_console() -> Console:
    """Progress, warnings and logs."""
    return Console(file=sys.stderr, highlight=False)


def emit_json(kind: str, payload: Any) -> None:
    """Write one versioned JSON document to stdout."""
    sys.stdout.write(json.dumps(json_document(kind, payload), indent=2, allow_nan=True) + "\n")
    sys.stdout.flush()
