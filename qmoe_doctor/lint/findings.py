"""What a lint run says: the rule ids and their fixed text, and the records it returns.

    Rule --RULES--> RuleInfo (cause, summary, generic fix)
    LintReport(findings=(LintFinding, ...), errors=(LintError, ...), skipped=(LintSkip, ...))

The rule ids, their fixed text and the finding, error and skip records live in
``core.lint_findings`` (reports hold them, and the report writers import only core); they are
re-exported here. A *finding* is
a fault in a source that was linted, an *error* a path the user asked for that could not be
linted (exit 2), a *skip* an entry of a walked folder that is not a source at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qmoe_doctor.core.lint_findings import RULES, LintError, LintFinding, LintSkip, Rule, RuleInfo


def parse_rules(names: Iterable[str | Rule] | None) -> tuple[Rule, ...] | None:
    """Rule ids (strings, commas allowed inside) to Rules; ``None`` stays ``None``.
    Raises ``ValueError`` naming an unknown id and the known ones."""
    if names is None:
        return None
    out: list[Rule] = []
    for item in names:
        for raw in str(item).split(","):
            name = raw.strip()
            if not name:
                continue
            try:
                rule = Rule(name)
            except ValueError:
                known = ", ".join(r.value for r in Rule)
                raise ValueError(f"unknown lint rule {name!r}; known: {known}") from None
            if rule not in out:
                out.append(rule)
    return tuple(out)


def active_rules(
    select: Iterable[str | Rule] | None, ignore: Iterable[str | Rule] | None
) -> tuple[Rule, ...]:
    """The rules a run checks: ``select`` (default: all, in rule order) less ``ignore``."""
    chosen = parse_rules(select)
    skipped = parse_rules(ignore) or ()
    base = chosen if chosen else tuple(Rule)
    return tuple(r for r in base if r not in skipped)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LintReport:
    """The result of one lint run over a set of paths."""

    paths: tuple[str, ...]  # as given
    files: tuple[str, ...]  # the Python files that were parsed and linted
    rules: tuple[Rule, ...]  # the rules that ran
    findings: tuple[LintFinding, ...] = ()
    errors: tuple[LintError, ...] = ()
    skipped: tuple[LintSkip, ...] = ()  # entries of walked folders that are not sources
    # lint_reached: the function the files were reached from ("file.py:function"), and what the
    # reach did not follow or left out, each with its reason
    reached_from: str = ""
    notes: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        return not self.findings and not self.errors

    def by_file(self) -> dict[str, tuple[LintFinding, ...]]:
        grouped: dict[str, list[LintFinding]] = {}
        for f in self.findings:
            grouped.setdefault(f.path, []).append(f)
        return {path: tuple(items) for path, items in grouped.items()}

    def counts(self) -> dict[str, int]:
        """Findings per rule id, in rule order, rules without findings left out."""
        out: dict[str, int] = {}
        for rule in Rule:
            n = sum(1 for f in self.findings if f.rule is rule)
            if n:
                out[rule.value] = n
        return out


__all__ = [
    "RULES",
    "LintError",
    "LintFinding",
    "LintReport",
    "LintSkip",
    "Rule",
    "RuleInfo",
    "active_rules",
    "parse_rules",
]
