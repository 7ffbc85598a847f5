"""JUnit XML of a ``qmoe-doctor run`` report (``run --junit FILE``), the shape CI servers read::

    testsuites[name,tests,failures,errors,time]
      testsuite[name="qmoe-doctor run",...]
        testcase[classname="run", name="command"]           the command's exit status
        testcase[classname="run.<pass>", name=<process>]     error: a CUDA error, with its last launches
        testcase[classname="run.diagnoses", name=<cause> <kernel>]   failure, type = cause id
        testcase[classname="run.sanitize", name="compute-sanitizer memcheck"]  failure: its errors
        testcase[classname="run.diagnoses", name="device checks"]    passes when nothing was found
        testcase[classname="run.compare", name="compare with <kind>"]  run --compare: failure at a
                                                         divergent launch, type = its cause id (or "divergence")

Reads only ``core`` records.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.reports import RunReport

MESSAGE_CHARS = 300
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _clean(text: str) -> str:
    return _NOT_XML.sub("?", _ANSI.sub("", text))


def _line(text: str) -> str:
    flat = " ".join(_clean(text).split())
    return flat if len(flat) <= MESSAGE_CHARS else flat[: MESSAGE_CHARS - 3] + "..."


def run_junit_element(report: RunReport) -> ET.Element:
    root = ET.Element("testsuites", {"name": "qmoe-doctor run"})
    suite = ET.SubElement(root, "testsuite", {"name": "qmoe-doctor run", "timestamp": report.started})
    tests = failures = errors = 0

    def case(classname: str, name: str, wall_s: float = 0.0) -> ET.Element:
        nonlocal tests
        tests += 1
        return ET.SubElement(
            suite, "testcase", {"classname": _clean(classname), "name": _clean(name), "time": f"{wall_s:.3f}"}
        )

    first = report.passes[0] if report.passes else None
    command = case("run", "command", first.wall_s if first else 0.0)
    ET.SubElement(command, "system-out").text = _clean(" ".join(report.command))
    if report.command_exit != 0:
        failures += 1
        ET.SubElement(
            command, "failure", {"message": _line(first.end if first else "did not run"), "type": "exit-status"}
        )
    for p in report.passes:
        for e in p.cuda_errors:
            errors += 1
            c = case(f"run.{p.label}", e.process)
            err = ET.SubElement(c, "error", {"message": _line(e.message), "type": str(e.error_kind or "cuda-error")})
            lines = [e.message, e.note, "last launches, oldest first:"]
            lines += [f"  #{launch.seq} {launch.kernel} (launch {launch.kernel_seq} of it)" for launch in e.last_launches]
            err.text = _clean("\n".join(lines))
    for d in report.diagnoses:
        failures += 1
        c = case("run.diagnoses", f"{d.cause} {d.kernel}")
        failure = ET.SubElement(c, "failure", {"message": _line(d.summary), "type": d.cause})
        body = [d.summary, f"seen in: {', '.join(d.processes)} ({d.launches} launches)"]
        launch = d.finding.launch
        site = launch.call_site or launch.launch_site if launch is not None else None
        if site is not None:
            body.append(f"called at: {site.render()}")
        if launch is not None and launch.user_site is not None and launch.user_site != site:
            body.append(f"your line: {launch.user_site.render()}")
        if d.basis:
            body.append(f"confidence: {d.confidence} ({d.basis})")
        if d.repro:
            body.append(f"prove it: {d.repro}")
        cause = CAUSES.get(d.cause)
        if cause is not None:
            body += ["fix:", cause.fix, f"docs: {cause.docs}"]
        failure.text = _clean("\n".join(body))
    s = report.sanitizer
    if s is not None and report.sanitizer_errors:
        failures += 1
        c = case("run.sanitize", "compute-sanitizer memcheck")
        failure = ET.SubElement(c, "failure", {"message": _line(s.note), "type": "memcheck"})
        failure.text = _clean("\n".join([s.note, *(line for a in s.addresses for line in a.sentences)]))
    if not report.diagnoses:
        case("run.diagnoses", "device checks")
    compared = report.compare
    if compared is not None:  # run --compare: one case, failing at a divergent launch
        c = case("run.compare", f"compare with {compared.kind.value}")
        body = [compared.verdict, *compared.explanation]
        if compared.scan:
            body.append(f"prove it: {compared.scan}")
        body += [f"note: {note}" for note in compared.notes]
        if compared.divergence is not None:
            failures += 1
            kind = compared.cause or "divergence"
            ET.SubElement(c, "failure", {"message": _line(compared.verdict), "type": kind}).text = _clean("\n".join(body))
        else:
            ET.SubElement(c, "system-out").text = _clean("\n".join(body))
    for element in (root, suite):
        element.set("tests", str(tests))
        element.set("failures", str(failures))
        element.set("errors", str(errors))
        element.set("time", f"{report.wall_s:.3f}")
    return root


def run_junit_text(report: RunReport) -> str:
    root = run_junit_element(report)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


__all__ = ["run_junit_element", "run_junit_text"]
