"""`qmoe-doctor explain` (placeholder: being written)."""

from __future__ import annotations

import typer


def explain_command() -> None:
    """Not written yet."""
    raise typer.Exit(4)
