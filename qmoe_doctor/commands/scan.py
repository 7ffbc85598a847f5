"""`qmoe-doctor scan` (placeholder: being written)."""

from __future__ import annotations

import typer


def scan_command() -> None:
    """Not written yet."""
    raise typer.Exit(4)
