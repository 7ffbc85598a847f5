"""JUnit XML of a check report: the shape CI servers (Jenkins, GitLab, GitHub test reporters) read.

::

    testsuites[name,tests,failures,errors,skipped,time]
      testsuite[name,tests,failures,errors,skipped,time,timestamp]   one per kernel (+ "lint")
        properties > property[name,value]                            exit code, problem, lint reach
        testcase[classname,name,time]                                one per probe, per lint finding
          failure[message,type] | error[message,type] | skipped[message]
          system-out

A probe's test case has ``classname`` = kernel reference + "." + group ("builtin.CPU",
"builtin.GPU 0 -> GPU 1": CI servers split the package off at the last dot) and ``name`` = its
condition. A failing cell carries a ``failure`` whose ``type`` is the cause that explains it
("unexplained" when no rule does), a skipped one a ``skipped`` with the reason. Each lint finding is
a failing test case of class "<kernel>.lint"; a clean linted file is a passing one (every file the
kernel reaches is linted: the suite's ``lint_reached_from`` property names where the reach
started, each ``lint_note`` what it did not follow). A kernel whose check could not run gets an
``error`` test case named "check".
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.records import Diagnosis
from qmoe_doctor.core.reports import CellResult, CheckReport, KernelCheck, LintResult

__all__ = ["junit_element", "junit_text", "write_junit"]

MESSAGE_CHARS = 300  # of a failure / skipped message attribute (CI servers show it in one line)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
# Characters XML 1.0 cannot carry, even escaped (a child's stderr can hold any of them).
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _clean(text: str) -> str:
    return _NOT_XML.sub("?", _ANSI.sub("", text))


def _one_line(text: str) -> str:
    flat = " ".join(_clean(text).split())
    return flat if len(flat) <= MESSAGE_CHARS else flat[: MESSAGE_CHARS - 3] + "..."


def _seconds(value: float) -> str:
    return f"{max(value, 0.0):.3f}"


class _Counts:
    def __init__(self) -> None:
        self.tests = self.failures = self.errors = self.skipped = 0

    def add(self, other: _Counts) -> None:
        self.tests += other.tests
        self.failures += other.failures
        self.errors += other.errors
        self.skipped += other.skipped

    def stamp(self, element: ET.Element, wall_s: float) -> None:
        element.set("tests", str(self.tests))
        element.set("failures", str(self.failures))
        element.set("errors", str(self.errors))
        element.set("skipped", str(self.skipped))
        element.set("time", _seconds(wall_s))


def _case(suite: ET.Element, counts: _Counts, classname: str, name: str, wall_s: float) -> ET.Element:
    counts.tests += 1
    return ET.SubElement(
        suite, "testcase", {"classname": _clean(classname), "name": _clean(name), "time": _seconds(wall_s)}
    )


def _cause_text(cause: str | None, diagnoses: dict[str, Diagnosis]) -> str:
    if cause is None:
        return "no rule accounts for this failing cell: a fault whose cause is not named"
    lines = []
    d = diagnoses.get(cause)
    if d is not None:
        lines.append(f"{cause}: {d.summary}")
        if d.where:
            lines.append("where: " + ", ".join(d.where))
        if d.repro:
            lines.append(f"repro: {d.repro}")
    else:
        lines.append(cause)
    if cause in CAUSES:
        lines.append(f"docs: {CAUSES[cause].docs}")
    return "\n".join(lines)


def _cell_case(suite: ET.Element, counts: _Counts, kernel: KernelCheck, cell: CellResult) -> None:
    case = _case(suite, counts, f"{kernel.kernel}.{cell.group}", cell.name, cell.wall_s)
    if cell.verdict == "skip":
        counts.skipped += 1
        ET.SubElement(case, "skipped", {"message": _one_line(cell.detail)})
    elif cell.verdict == "error":
        counts.errors += 1
        error = ET.SubElement(
            case, "error", {"message": _one_line(f"{cell.label}: {cell.detail}"), "type": cell.label}
        )
        error.text = _clean(cell.log or cell.detail)
    elif cell.verdict == "fail":
        counts.failures += 1
        diagnoses = {d.cause: d for d in kernel.diagnoses}
        failure = ET.SubElement(
            case,
            "failure",
            {"message": _one_line(f"{cell.label}: {cell.detail}"), "type": cell.cause or "unexplained"},
        )
        failure.text = _clean(
            f"{cell.probe_id} ({cell.tier} tier): {cell.detail}\n{_cause_text(cell.cause, diagnoses)}"
        )
    out = [f"probe {cell.probe_id} ({cell.tier} tier): {cell.label}"]
    out += [f"note: {n}" for n in cell.notes]
    if cell.log:
        out.append(cell.log)
    ET.SubElement(case, "system-out").text = _clean("\n".join(out))


def _lint_cases(suite: ET.Element, counts: _Counts, classname: str, lint: LintResult) -> None:
    flagged = {f.path for f in lint.findings}
    for f in lint.findings:
        case = _case(suite, counts, classname, f"{f.rule} {f.location}", 0.0)
        counts.failures += 1
        failure = ET.SubElement(
            case, "failure", {"message": _one_line(f"{f.rule} [{f.cause}] {f.message}"), "type": f.cause}
        )
        body = [f.as_line()]
        if f.source:
            body.append(f"    {f.source}")
        body.append("fix:\n" + f.fix)
        if f.cause in CAUSES:
            body.append(f"docs: {CAUSES[f.cause].docs}")
        failure.text = _clean("\n".join(body))
    for path in lint.files:
        if path not in flagged:
            _case(suite, counts, classname, path, 0.0)
    for e in lint.errors:
        case = _case(suite, counts, classname, e.path, 0.0)
        counts.errors += 1
        ET.SubElement(
            case, "error", {"message": _one_line(e.as_line()), "type": f"lint-{e.kind}"}
        ).text = _clean(e.as_line() + (f"\n    {e.source}" if e.source else ""))


def _properties(suite: ET.Element, items: Iterable[tuple[str, str]]) -> None:
    props = ET.SubElement(suite, "properties")
    for name, value in items:
        ET.SubElement(props, "property", {"name": name, "value": _clean(value)})


def _suite(root: ET.Element, name: str, timestamp: str) -> ET.Element:
    return ET.SubElement(root, "testsuite", {"name": _clean(name), "timestamp": timestamp})


def junit_element(report: CheckReport) -> ET.Element:
    root = ET.Element("testsuites", {"name": "qmoe-doctor check"})
    total = _Counts()
    timestamp = report.started[:19]  # the schema's xs:dateTime without a zone
    for kernel in report.kernels:
        suite = _suite(root, kernel.kernel, timestamp)
        props = [
            ("exit_code", str(kernel.exit_code)),
            ("exit_status", ExitCode(kernel.exit_code).name.lower()),
        ]
        if kernel.problem:
            props.append(("problem", kernel.problem))
        if kernel.lint is not None and kernel.lint.reached_from:
            props.append(("lint_reached_from", kernel.lint.reached_from))
        if kernel.lint is not None:
            props += [("lint_note", note) for note in kernel.lint.notes]
        _properties(suite, props)
        counts = _Counts()
        if kernel.problem and kernel.exit_code in (ExitCode.USAGE, ExitCode.CHECK_BROKEN):
            case = _case(suite, counts, f"{kernel.kernel}.check", "check", 0.0)
            counts.errors += 1
            kind = "usage-error" if kernel.exit_code == ExitCode.USAGE else "check-broken"
            ET.SubElement(case, "error", {"message": _one_line(kernel.problem), "type": kind}).text = _clean(
                kernel.problem
            )
        for cell in kernel.cells:
            _cell_case(suite, counts, kernel, cell)
        if kernel.lint is not None:
            _lint_cases(suite, counts, f"{kernel.kernel}.lint", kernel.lint)
        counts.stamp(suite, kernel.wall_s)
        total.add(counts)
    if report.lint is not None:
        suite = _suite(root, "lint", timestamp)
        _properties(suite, [("exit_code", str(int(report.lint.exit_code)))])
        counts = _Counts()
        _lint_cases(suite, counts, "lint", report.lint)
        counts.stamp(suite, 0.0)
        total.add(counts)
    total.stamp(root, report.wall_s)
    ET.indent(root)
    return root


def junit_text(report: CheckReport) -> str:
    text: str = ET.tostring(junit_element(report), encoding="unicode", xml_declaration=True)
    return text + "\n"


def write_junit(report: CheckReport, path: Path) -> None:
    path.write_text(junit_text(report), encoding="utf-8")
