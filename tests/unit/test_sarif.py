"""SARIF 2.1.0 from `lint --sarif` and `check --sarif`, validated against the published OASIS
schema (tests/fixtures/schemas/sarif-schema-2.1.0.json) with jsonschema, never by hand: rule ids,
cause ids, locations, the fix and the docs page of every finding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from test_junit import _report
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.causes import CAUSES, DOCS_URL
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.reports import CheckReport, LintResult
from qmoe_doctor.lint import LintError
from qmoe_doctor.reports.sarif import UNEXPLAINED, check_sarif, lint_sarif

REPO = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO / "tests" / "fixtures" / "schemas" / "sarif-schema-2.1.0.json"
SPECIMENS = REPO / "kernels" / "specimens"


def validate(log: dict[str, Any]) -> dict[str, Any]:
    """``log`` checked against the published schema (formats too: uri, uri-reference), then
    returned; a violation fails with the schema's own message."""
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    errors = sorted(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(log), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])
    return log


def results(log: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for run in log["runs"] for r in run["results"]]


def rules(log: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for run in log["runs"] for r in run["tool"]["driver"]["rules"]}


def test_the_vendored_schema_is_the_published_one_and_rejects_a_broken_log() -> None:
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    assert "2.1.0" in schema.get("$id", schema.get("id", ""))
    log = lint_sarif(LintResult(paths=(), files=()), exit_code=0)
    validate(log)
    broken = json.loads(json.dumps(log))
    broken["runs"][0]["results"] = [{"ruleId": "x", "message": {}, "level": "fatal"}]
    with pytest.raises(AssertionError, match="level"):
        validate(broken)


def test_lint_sarif_has_rule_cause_location_fix_and_docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the CLI, in the folder CI runs in: the planted specimens' findings, each on its
    file, line and column relative to the checkout, with its cause, fix and docs page."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "lint.sarif"
    got = CliRunner().invoke(
        app, ["lint", "kernels/specimens/unguarded.py", "kernels/specimens/int32_offsets.py", "--sarif", str(out)]
    )
    assert got.exit_code == ExitCode.FAULT, got.output
    log = validate(json.loads(out.read_text()))
    found = results(log)
    assert {r["ruleId"] for r in found} == {"unguarded-launch", "int32-offset"}
    by_rule = rules(log)
    run = log["runs"][0]
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == REPO.as_uri() + "/"
    assert run["invocations"][0] == {"executionSuccessful": True, "exitCode": 1}
    for r in found:
        rule = by_rule[r["ruleId"]]
        assert run["tool"]["driver"]["rules"][r["ruleIndex"]] is rule
        cause = r["properties"]["cause"]
        assert cause in CAUSES and rule["properties"]["cause"] == cause
        assert rule["helpUri"] == f"{DOCS_URL}causes/{cause}.md"
        assert (REPO / "docs" / "causes" / f"{cause}.md").is_file()
        assert r["properties"]["fix"] and CAUSES[cause].mechanism in rule["help"]["text"]
        where = r["locations"][0]["physicalLocation"]
        assert where["artifactLocation"]["uriBaseId"] == "%SRCROOT%"
        path = REPO / where["artifactLocation"]["uri"]
        line = path.read_text().splitlines()[where["region"]["startLine"] - 1]
        col = where["region"]["startColumn"]
        assert where["region"]["snippet"]["text"] == line.strip()
        assert 1 <= col <= len(line) and not line[col - 1].isspace(), (line, col)
    guard = next(r for r in found if r["ruleId"] == "unguarded-launch")
    assert guard["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "kernels/specimens/unguarded.py"


def test_a_column_counts_characters_not_utf8_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "k.py").write_text(
        "import triton\n\n\n@triton.jit\ndef add(x_ptr):\n    pass\n\n\n"
        "def run(x):\n    é = 'ü'; add[(1,)](x)\n",
        encoding="utf-8",
    )
    out = tmp_path / "k.sarif"
    CliRunner().invoke(app, ["lint", "k.py", "--select", "unguarded-launch", "--sarif", str(out)])
    (hit,) = results(validate(json.loads(out.read_text())))
    region = hit["locations"][0]["physicalLocation"]["region"]
    line = (tmp_path / "k.py").read_text(encoding="utf-8").splitlines()[region["startLine"] - 1]
    assert line[region["startColumn"] - 1 :].startswith("add[(1,)](x)")


def test_lint_sarif_of_a_path_that_could_not_be_linted_says_the_run_failed(tmp_path: Path) -> None:
    log = validate(
        lint_sarif(
            LintResult(
                paths=("bad.py",),
                files=(),
                errors=(LintError(path="bad.py", kind="syntax", message="invalid syntax", line=2, col=1),),
            ),
            exit_code=ExitCode.USAGE,
            cwd=tmp_path,
        )
    )
    invocation = log["runs"][0]["invocations"][0]
    assert invocation["executionSuccessful"] is False and invocation["exitCode"] == 2
    (note,) = invocation["toolExecutionNotifications"]
    assert "bad.py:2:1: invalid syntax" in note["message"]["text"]
    assert results(log) == []


def test_check_sarif_places_diagnoses_on_the_kernels_def_line_and_names_what_was_not_checked(tmp_path: Path) -> None:
    kernel_file = tmp_path / "k.py"
    kernel_file.write_text("import torch\n\n\ndef fn(x, w, m_sizes):\n    return x\n")

    def site(ref: str) -> tuple[Path, int] | None:
        return (kernel_file, 4) if ref == "specimen:unmasked_rows" else None

    log = validate(check_sarif(_report(), cwd=tmp_path, kernel_site=site))
    found = results(log)
    diagnosis = next(r for r in found if r["ruleId"] == "invalid-routing")
    where = diagnosis["locations"][0]["physicalLocation"]
    assert where["artifactLocation"] == {"uri": "k.py", "uriBaseId": "%SRCROOT%"}
    assert where["region"]["startLine"] == 4
    assert diagnosis["properties"]["repro"].startswith("qmoe-doctor scan")
    assert diagnosis["properties"]["fix"] == CAUSES["invalid-routing"].fix
    assert rules(log)["invalid-routing"]["helpUri"] == f"{DOCS_URL}causes/invalid-routing.md"
    assert [r["ruleId"] for r in found].count("unguarded-launch") == 2  # the kernel's lint findings
    invocation = log["runs"][0]["invocations"][0]
    assert invocation["executionSuccessful"] is False and invocation["exitCode"] == 2
    texts = [n["message"]["text"] for n in invocation["toolExecutionNotifications"]]
    assert any(t.startswith("mylib.ops:fn: not checked (exit 2)") for t in texts)
    assert any("bad.py:2:1" in t for t in texts)


def test_check_sarif_of_recorded_reports_validates(tmp_path: Path) -> None:
    """Real reports: the 2x H200 check of the torch control (a healthy run, no result), and an
    unexplained failing cell and a hardening note made from them."""
    from qmoe_doctor.core.records import Condition, Evidence, from_json

    recorded = REPO / "tests/fixtures/reports/check/2026-11-22-2xh200-ab67830/check-torch.json"
    report = from_json(CheckReport, recorded.read_text())
    validate(check_sarif(report, cwd=tmp_path))
    from dataclasses import replace

    kernel = report.kernels[0]
    odd = Evidence(probe_id="GPU 0/single", condition=Condition.SINGLE, label="wrong", detail="rel. error 0.5")
    faulty = replace(report, kernels=(replace(kernel, unexplained=(odd,), hardening=_report().kernels[0].diagnoses),))
    log = validate(check_sarif(faulty, cwd=tmp_path))
    levels = {r["ruleId"]: r["level"] for r in results(log)}
    assert levels == {UNEXPLAINED: "error", "invalid-routing": "note"}


def test_check_cpu_writes_sarif_for_a_specimen_with_its_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on the CPU tier: the over-routed specimen's diagnosis, on its kernel's def line."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "check.sarif"
    got = CliRunner().invoke(
        app,
        ["check", "--cpu", "--kernel", "specimen:unmasked_rows", "--only", "single,over-routed", "--sarif", str(out)],
    )
    assert got.exit_code == ExitCode.FAULT, got.output
    found = results(validate(json.loads(out.read_text())))
    diagnosis = next(r for r in found if r["ruleId"] == "invalid-routing")
    where = diagnosis["locations"][0]["physicalLocation"]
    assert where["artifactLocation"]["uri"] == "kernels/specimens/unmasked_rows.py"
    source = (SPECIMENS / "unmasked_rows.py").read_text().splitlines()
    assert source[where["region"]["startLine"] - 1].startswith("def ")


def test_save_junit_and_sarif_naming_one_file_are_refused(tmp_path: Path) -> None:
    same = tmp_path / "same.out"
    got = CliRunner().invoke(app, ["check", "--cpu", "--save", str(same), "--junit", str(same)])
    assert got.exit_code == ExitCode.USAGE
    assert "--save and --junit name the same file" in got.output
    assert not same.exists()
