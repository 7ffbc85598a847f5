"""SARIF 2.1.0 of a lint or check report: the format code-scanning services read (GitHub code
scanning, GitLab, Azure DevOps, IDE viewers).

::

    sarifLog[version, $schema]
      runs[0]
        tool.driver[name, version, informationUri, rules[]]    one rule per lint rule / cause id met
        invocations[0][executionSuccessful, exitCode, toolExecutionNotifications[]]
        originalUriBaseIds[%SRCROOT%]                           the working folder; relative paths hang off it
        results[]                                               one per lint finding, diagnosis, unexplained cell
        artifacts[]                                             every file linted (a kernel's: every file it reaches)

A lint finding's ``ruleId`` is its lint rule (``unguarded-launch``); a diagnosis's is its cause id
(``missing-device-guard``), placed on the ``def`` line of the kernel it was proven on. Every result
carries the cause id (``properties.cause``) and the fix as text (``properties.fix``); every rule its
docs page as ``helpUri``, its mechanism and fix as ``help``. Hardening findings are ``note``s.
Paths the user could not lint, and kernels the check could not run, are tool execution
notifications, and make ``executionSuccessful`` false, as they make the exit status 2 or 4; what
the lint of a kernel did not follow is a notification of level ``note``.
tests/unit/test_sarif.py validates the output against the published SARIF 2.1.0 schema.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from qmoe_doctor import __version__
from qmoe_doctor.core.causes import CAUSES, DOCS_URL, PROJECT_URL
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.kernel_ref import KernelRef, KernelRefError
from qmoe_doctor.core.lint_findings import RULES, LintFinding, Rule
from qmoe_doctor.core.records import Diagnosis, Evidence
from qmoe_doctor.core.reports import CheckReport, KernelCheck, LintResult

__all__ = ["SARIF_SCHEMA", "SARIF_VERSION", "check_sarif", "lint_sarif"]

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SRCROOT = "%SRCROOT%"
#: ruleId of a failing cell no rule explains (a fault, exit 1, with no cause id)
UNEXPLAINED = "unexplained-failure"

#: (path, 1-based line) where a kernel reference's function is defined, or None
KernelSite = Callable[[str], "tuple[Path, int] | None"]


def lint_sarif(result: LintResult, *, exit_code: int, cwd: Path | None = None) -> dict[str, Any]:
    """The SARIF log of one ``qmoe-doctor lint`` run."""
    run = _Run(cwd or Path.cwd())
    run.add_lint(result)
    return run.log(exit_code)


def check_sarif(
    report: CheckReport, *, cwd: Path | None = None, kernel_site: KernelSite | None = None
) -> dict[str, Any]:
    """The SARIF log of one ``qmoe-doctor check``: each kernel's lint findings, diagnoses,
    hardening findings and unexplained failing cells, and the ``--lint`` paths' findings."""
    run = _Run(cwd or Path.cwd())
    site = kernel_site or _kernel_site
    for kernel in report.kernels:
        if kernel.lint is not None:
            run.add_lint(kernel.lint)
        run.add_kernel(kernel, site(kernel.kernel))
    if report.lint is not None:
        run.add_lint(report.lint)
    return run.log(report.exit_code)


def _kernel_site(ref: str) -> tuple[Path, int] | None:
    try:
        return KernelRef.parse(ref).source_site()
    except KernelRefError:
        return None


class _Run:
    """One SARIF run being assembled: its rules (in first-met order), results, notifications."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd.resolve()
        self.rules: dict[str, dict[str, Any]] = {}
        self.results: list[dict[str, Any]] = []
        self.notifications: list[dict[str, Any]] = []
        self.linted: dict[str, None] = {}  # every file linted, in order (run.artifacts)

    # -- results -------------------------------------------------------------------------------

    def add_lint(self, result: LintResult) -> None:
        self.linted.update(dict.fromkeys(result.files))
        for finding in result.findings:
            self._lint_finding(finding)
        for error in result.errors:
            self._notify(f"{error.as_line()} (not linted: {error.kind})", path=error.path, line=error.line)
        where = f"lint of {result.reached_from}: " if result.reached_from else "lint: "
        for note in result.notes:  # what the reach did not follow: said, not an error
            self._notify(where + note, level="note")

    def _lint_finding(self, f: LintFinding) -> None:
        index = self._lint_rule(f.rule)
        self.results.append(
            {
                "ruleId": f.rule.value,
                "ruleIndex": index,
                "level": "error",
                "message": {"text": f"{f.message} (cause: {f.cause})"},
                "locations": [self._location(f.path, f.line, f.col, snippet=f.source)],
                "partialFingerprints": {"qmoeDoctorFinding/v1": f"{f.rule.value}:{f.path}:{f.source}"},
                "properties": {"cause": f.cause, "fix": f.fix},
            }
        )

    def add_kernel(self, kernel: KernelCheck, site: tuple[Path, int] | None) -> None:
        where = [self._location(str(site[0]), site[1], None)] if site is not None else []
        for diagnosis in kernel.diagnoses:
            self._diagnosis(kernel.kernel, diagnosis, where, level="error")
        for diagnosis in kernel.hardening:
            self._diagnosis(kernel.kernel, diagnosis, where, level="note")
        for evidence in kernel.unexplained:
            self._unexplained(kernel.kernel, evidence, where)
        if kernel.exit_code in (ExitCode.USAGE, ExitCode.CHECK_BROKEN):
            self._notify(f"{kernel.kernel}: not checked (exit {kernel.exit_code}): {kernel.problem}".rstrip(": "))

    def _diagnosis(self, kernel: str, d: Diagnosis, where: list[dict[str, Any]], *, level: str) -> None:
        index = self._cause_rule(d.cause)
        cause = CAUSES.get(d.cause)
        evidence = "; ".join(f"{e.probe_id} {e.label}: {e.detail}" for e in d.evidence[:4])
        text = f"{kernel}: {d.summary} (confidence: {d.confidence})"
        if evidence:
            text += f". Evidence: {evidence}"
        if d.repro:
            text += f". Repro: {d.repro}"
        self.results.append(
            {
                "ruleId": d.cause,
                "ruleIndex": index,
                "level": level,
                "message": {"text": text},
                "locations": where,
                "partialFingerprints": {"qmoeDoctorFinding/v1": f"{d.cause}:{kernel}"},
                "properties": {
                    "cause": d.cause,
                    "fix": cause.fix if cause is not None else "",
                    "kernel": kernel,
                    "confidence": str(d.confidence),
                    "severity": d.severity,
                    "where": list(d.where),
                    "repro": d.repro,
                },
            }
        )

    def _unexplained(self, kernel: str, e: Evidence, where: list[dict[str, Any]]) -> None:
        index = self._rule(
            UNEXPLAINED,
            name="UnexplainedFailure",
            short="a failing cell that no cause accounts for",
            full=(
                "A probe failed (wrong values, a crash, a CUDA error) and no rule of the differential "
                "diagnosis explains it. The cell's log says what the kernel did."
            ),
            fix="Read the cell's log (qmoe-doctor check --log-dir DIR keeps it) and rerun the scan with --only.",
            docs=DOCS_URL + "cells.md",
        )
        self.results.append(
            {
                "ruleId": UNEXPLAINED,
                "ruleIndex": index,
                "level": "error",
                "message": {"text": f"{kernel}: {e.probe_id} {e.label}: {e.detail}"},
                "locations": where,
                "partialFingerprints": {"qmoeDoctorFinding/v1": f"{UNEXPLAINED}:{kernel}:{e.probe_id}"},
                "properties": {"kernel": kernel, "cell": e.probe_id, "fix": ""},
            }
        )

    def _notify(
        self, text: str, *, path: str | None = None, line: int | None = None, level: str = "error"
    ) -> None:
        note: dict[str, Any] = {"level": level, "message": {"text": text}}
        if path is not None:
            note["locations"] = [self._location(path, line, None)]
        self.notifications.append(note)

    # -- rules ---------------------------------------------------------------------------------

    def _lint_rule(self, rule: Rule) -> int:
        info = RULES[rule]
        cause = CAUSES.get(info.cause)
        return self._rule(
            rule.value,
            name=_pascal(rule.value),
            short=info.summary,
            full=cause.mechanism if cause is not None else info.summary,
            fix=info.fix,
            docs=_docs_url(info.cause),
            cause=info.cause,
        )

    def _cause_rule(self, cause_id: str) -> int:
        cause = CAUSES.get(cause_id)
        if cause is None:  # a cause id from a newer report: still a rule, with what is known
            return self._rule(cause_id, name=_pascal(cause_id), short=cause_id, full=cause_id, fix="", docs=None)
        return self._rule(
            cause_id,
            name=_pascal(cause_id),
            short=cause.title,
            full=cause.mechanism,
            fix=cause.fix,
            docs=_docs_url(cause_id),
            cause=cause_id,
        )

    def _rule(
        self, rule_id: str, *, name: str, short: str, full: str, fix: str, docs: str | None, cause: str = ""
    ) -> int:
        if rule_id not in self.rules:
            help_text = f"{full}\n\nFix:\n{fix}" if fix else full
            rule: dict[str, Any] = {
                "id": rule_id,
                "name": name,
                "shortDescription": {"text": short},
                "fullDescription": {"text": full},
                "help": {
                    "text": help_text + (f"\n\nDocs: {docs}" if docs else ""),
                    "markdown": full + (f"\n\n**Fix**\n\n```python\n{fix}\n```" if fix else "")
                    + (f"\n\n[Docs]({docs})" if docs else ""),
                },
                "defaultConfiguration": {"level": "error"},
                "properties": {"cause": cause, "tags": ["correctness", "multi-gpu", "triton"]},
            }
            if docs:
                rule["helpUri"] = docs
            self.rules[rule_id] = rule
        return list(self.rules).index(rule_id)

    # -- locations -----------------------------------------------------------------------------

    def _location(self, path: str, line: int | None, col: int | None, *, snippet: str = "") -> dict[str, Any]:
        physical: dict[str, Any] = {"artifactLocation": self._artifact(path)}
        if line is not None and line >= 1:
            region: dict[str, Any] = {"startLine": line}
            if col is not None and col >= 1:
                region["startColumn"] = col
            if snippet:
                region["snippet"] = {"text": snippet}
            physical["region"] = region
        return {"physicalLocation": physical}

    def _artifact(self, path: str) -> dict[str, Any]:
        """A path under the working folder as a relative URI on %SRCROOT% (what code scanning
        maps onto the checkout); any other as an absolute file URI."""
        full = Path(os.path.abspath(path))
        try:
            relative = full.relative_to(self.cwd)
        except ValueError:
            return {"uri": full.as_uri()}
        return {"uri": quote(relative.as_posix()), "uriBaseId": SRCROOT}

    # -- the log -------------------------------------------------------------------------------

    def log(self, exit_code: int) -> dict[str, Any]:
        invocation: dict[str, Any] = {
            "executionSuccessful": exit_code in (ExitCode.HEALTHY, ExitCode.FAULT),
            "exitCode": int(exit_code),
        }
        if self.notifications:
            invocation["toolExecutionNotifications"] = self.notifications
        run: dict[str, Any] = {
            "tool": {
                "driver": {
                    "name": "qmoe-doctor",
                    "version": __version__,
                    "semanticVersion": __version__,
                    "informationUri": PROJECT_URL,
                    "rules": list(self.rules.values()),
                }
            },
            "invocations": [invocation],
            "originalUriBaseIds": {SRCROOT: {"uri": self.cwd.as_uri() + "/"}},
            "columnKind": "unicodeCodePoints",  # ast's col_offset + 1, counted in characters
            "results": self.results,
        }
        if self.linted:
            run["artifacts"] = [
                {"location": self._artifact(path), "roles": ["analysisTarget"]} for path in self.linted
            ]
        return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": [run]}


def _docs_url(cause_id: str) -> str:
    return f"{DOCS_URL}causes/{cause_id}.md"


def _pascal(kebab: str) -> str:
    return "".join(part.capitalize() for part in kebab.split("-"))
