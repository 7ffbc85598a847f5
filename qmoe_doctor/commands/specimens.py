"""`qmoe-doctor specimens` (placeholder: being written)."""

from __future__ import annotations

import typer


def specimens_command() -> None:
    """Not written yet."""
    raise typer.Exit(4)
