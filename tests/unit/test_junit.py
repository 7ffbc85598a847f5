"""JUnit XML of `qmoe-doctor check`: the shape CI servers read, counts that add up, text that parses."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.records import Condition, Confidence, Diagnosis, Evidence
from qmoe_doctor.core.reports import CellResult, CheckReport, KernelCheck, LintResult
from qmoe_doctor.lint import LintError, LintFinding, Rule
from qmoe_doctor.reports.junit import junit_text

SUITE_ATTRS = {"name", "tests", "failures", "errors", "skipped", "time"}
CASE_CHILDREN = {"failure", "error", "skipped", "system-out", "system-err"}


def assert_junit_shape(text: str) -> ET.Element:
    """testsuites > testsuite[name,tests,failures,errors,skipped,time] > testcase[classname,name,
    time] > failure[message,type] / error[message,type] / skipped[message] / system-out, with
    every count equal to what the children say. Returns the root."""
    root = ET.fromstring(text)
    assert root.tag == "testsuites"
    assert {"tests", "failures", "errors", "skipped", "time"} <= set(root.attrib)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in root:
        assert suite.tag == "testsuite"
        assert SUITE_ATTRS <= set(suite.attrib), suite.attrib
        float(suite.get("time", "x"))
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for child in suite:
            if child.tag == "properties":
                assert all(p.tag == "property" and {"name", "value"} <= set(p.attrib) for p in child)
                continue
            assert child.tag == "testcase", child.tag
            assert {"classname", "name", "time"} <= set(child.attrib), child.attrib
            float(child.get("time", "x"))
            counts["tests"] += 1
            kinds = [c.tag for c in child]
            assert set(kinds) <= CASE_CHILDREN, kinds
            outcome = [k for k in kinds if k in ("failure", "error", "skipped")]
            assert len(outcome) <= 1, kinds
            if outcome:
                assert kinds[0] == outcome[0], "failure / error / skipped comes before system-out"
            for c in child:
                if c.tag in ("failure", "error"):
                    assert c.get("message") and c.get("type"), c.attrib
                elif c.tag == "skipped":
                    assert c.get("message"), c.attrib
            counts["failures"] += kinds.count("failure")
            counts["errors"] += kinds.count("error")
            counts["skipped"] += kinds.count("skipped")
        for key, value in counts.items():
            assert int(suite.get(key, "-1")) == value, (suite.get("name"), key)
            totals[key] += value
    for key, value in totals.items():
        assert int(root.get(key, "-1")) == value, key
    return root


def _cell(name: str, verdict: str, label: str, detail: str, cause: str | None = None, log: str = "") -> CellResult:
    return CellResult(
        probe_id=f"CPU/{name}",
        tier="cpu",
        group="CPU",
        name=name,
        label=label,
        verdict=verdict,  # type: ignore[arg-type]
        detail=detail,
        cause=cause,
        wall_s=0.25,
        log=log,
    )


def _finding(path: str, line: int) -> LintFinding:
    return LintFinding(
        path=path,
        line=line,
        col=5,
        rule=Rule.UNGUARDED_LAUNCH,
        cause="missing-device-guard",
        message="launch outside a device guard",
        fix="with torch.cuda.device(x.device): ...",
        source="kernel[grid](x)",
    )


DIAG = Diagnosis(
    cause="invalid-routing",
    confidence=Confidence.HIGH,
    summary="trusts m_sizes",
    evidence=(Evidence(probe_id="CPU/over-routed", condition=Condition.OVER_ROUTED, label="wrong", detail="x"),),
    where=("CPU",),
    repro="qmoe-doctor scan --kernel specimen:unmasked_rows --only over-routed",
)


def _report() -> CheckReport:
    faulty = KernelCheck(
        kernel="specimen:unmasked_rows",
        exit_code=ExitCode.FAULT,
        wall_s=3.5,
        cells=(
            _cell("single", "pass", "pass", "correct"),
            _cell("over-routed", "fail", "wrong", "wrote past the output (after y)", cause="invalid-routing"),
            # ANSI colours and a NUL byte from a child's stderr must not break the XML
            _cell("repeat-call", "fail", "illegal-address", "crashed", log="\x1b[31mboom\x1b[0m \x00 <&>"),
            _cell("side-stream", "skip", "skipped", "streams exist only on CUDA devices"),
        ),
        diagnoses=(DIAG,),
        lint=LintResult(
            paths=("k.py",), files=("k.py", "clean.py"), findings=(_finding("k.py", 3), _finding("k.py", 9))
        ),
    )
    broken = KernelCheck(
        kernel="mylib.ops:fn",
        exit_code=ExitCode.USAGE,
        problem="the kernel could not be used: cannot import module 'mylib'",
    )
    return CheckReport(
        started="2026-11-22T10:00:00+00:00",
        wall_s=9.0,
        gpus=(),
        exit_code=ExitCode.USAGE,
        kernels=(faulty, broken),
        lint=LintResult(
            paths=("gone.py", "x.py"),
            files=("x.py",),
            errors=(LintError(path="bad.py", kind="syntax", message="invalid syntax", line=2, col=1),),
        ),
    )


def test_shape_counts_and_grouping() -> None:
    root = assert_junit_shape(junit_text(_report()))
    suites = {s.get("name"): s for s in root}
    assert list(suites) == ["specimen:unmasked_rows", "mylib.ops:fn", "lint"]
    faulty = suites["specimen:unmasked_rows"]
    assert (faulty.get("tests"), faulty.get("failures"), faulty.get("skipped")) == ("7", "4", "1")
    cases = {c.get("name"): c for c in faulty.iter("testcase")}
    assert cases["single"].get("classname") == "specimen:unmasked_rows.CPU"
    failure = cases["over-routed"].find("failure")
    assert failure is not None
    assert failure.get("type") == "invalid-routing"
    assert failure.get("message") == "wrong: wrote past the output (after y)"
    assert "repro: qmoe-doctor scan" in (failure.text or "")
    assert "docs/causes/invalid-routing.md" in (failure.text or "")
    crash = cases["repeat-call"].find("failure")
    assert crash is not None and crash.get("type") == "unexplained"
    out = cases["repeat-call"].find("system-out")
    assert out is not None and "boom" in (out.text or "") and "\x1b" not in (out.text or "")
    skipped = cases["side-stream"].find("skipped")
    assert skipped is not None and skipped.get("message") == "streams exist only on CUDA devices"
    lint_cases = [c for c in faulty.iter("testcase") if c.get("classname") == "specimen:unmasked_rows.lint"]
    assert [c.get("name") for c in lint_cases] == [
        "unguarded-launch k.py:3:5", "unguarded-launch k.py:9:5", "clean.py",
    ]
    lint_failure = lint_cases[0].find("failure")
    assert lint_failure is not None and lint_failure.get("type") == "missing-device-guard"


def test_a_kernel_that_could_not_be_checked_is_an_error_case() -> None:
    root = assert_junit_shape(junit_text(_report()))
    suite = next(s for s in root if s.get("name") == "mylib.ops:fn")
    (case,) = suite.iter("testcase")
    error = case.find("error")
    assert error is not None and error.get("type") == "usage-error"
    assert "cannot import module" in (error.get("message") or "")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["exit_code"] == "2" and props["exit_status"] == "usage"


def test_lint_paths_suite_reports_parse_errors() -> None:
    root = assert_junit_shape(junit_text(_report()))
    suite = next(s for s in root if s.get("name") == "lint")
    assert (suite.get("tests"), suite.get("errors")) == ("2", "1")
    error = next(suite.iter("error"))
    assert error.get("type") == "lint-syntax" and "bad.py:2:1" in (error.get("message") or "")


def test_long_messages_are_cut_to_one_line() -> None:
    report = _report()
    long = KernelCheck(
        kernel="builtin",
        exit_code=ExitCode.FAULT,
        cells=(_cell("single", "fail", "wrong", "word\n" * 200),),
    )
    root = assert_junit_shape(junit_text(CheckReport(started=report.started, wall_s=1.0, gpus=(), exit_code=1, kernels=(long,))))
    failure = next(root.iter("failure"))
    message = failure.get("message") or ""
    assert "\n" not in message and len(message) <= 300 and message.endswith("...")
