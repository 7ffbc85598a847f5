"""`qmoe-doctor env` (placeholder: being written)."""

from __future__ import annotations

import typer


def env_command() -> None:
    """Not written yet."""
    raise typer.Exit(4)
