"""`qmoe-doctor lint` (placeholder: being written)."""

from __future__ import annotations

import typer


def lint_command() -> None:
    """Not written yet."""
    raise typer.Exit(4)
