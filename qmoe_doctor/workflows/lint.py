"""`qmoe-doctor lint`: static checks over source paths. The lint package does the work; this is
the workflow the CLI calls (the CLI never imports the lint package itself).

No torch here: sources are read with ``ast``, never imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qmoe_doctor.lint import RULES, LintReport, lint_paths, parse_rules

#: Every rule id, in the order the rules run (for the CLI's help).
RULE_NAMES = tuple(r.value for r in RULES)


def run_lint(
    paths: Sequence[str | Path], *, select: str | None = None, ignore: str | None = None
) -> LintReport:
    """Lint ``paths`` with the rules ``select`` names (comma-separated; None: all) less those
    ``ignore`` names. Raises ValueError for an unknown rule."""
    return lint_paths(
        list(paths),
        select=parse_rules(select.split(",")) if select else None,
        ignore=parse_rules(ignore.split(",")) if ignore else None,
    )


__all__ = ["RULE_NAMES", "LintReport", "run_lint"]
