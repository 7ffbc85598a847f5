"""`qmoe-doctor audit` (placeholder: being written)."""

from __future__ import annotations

import typer


def audit_command() -> None:
    """Not written yet."""
    raise typer.Exit(4)
