"""`qmoe-doctor run [OPTIONS] -- COMMAND`: the command line, the reports and the exit codes.

Bad input is refused in one line with exit 2 before anything runs: no command, a command not
found, a missing ``--`` (the command's own options would be read as ours), an output path that
cannot be written. The command's exit status is the run's.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.launches import FindingKind, LaunchFacts, ProcessRecord, TensorArg
from qmoe_doctor.core.records import Confidence, from_jsonable
from qmoe_doctor.core.reports import RunDiagnosis, RunPass, RunReport
from qmoe_doctor.diagnose.launch_rules import other_device
from qmoe_doctor.reports.run_junit import run_junit_text

pytestmark = pytest.mark.timeout(120)
runner = CliRunner()
ENV = {"COLUMNS": "200", "TRITON_INTERPRET": "1"}

PROGRAM = """\
import sys
import torch
import triton
import triton.language as tl


@triton.jit
def double(x_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) * 2, mask=offs < N)


double[(1,)](torch.ones(8), 8, BLOCK=8)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def error_line(output: str) -> str:
    (line,) = [ln for ln in output.splitlines() if ln.startswith("error: ")]
    return line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "no command to run: qmoe-doctor run [OPTIONS] -- COMMAND"),
        (["--"], "no command after --"),
        (["python3", "train.py", "--lr", "1"], "put -- before the command, so its options stay its own"),
        (["--ring", "8", "python3", "train.py"], "put -- before the command"),
        (["--", "qmoe-doctor-no-such-program", "x"], "qmoe-doctor-no-such-program: command not found"),
        (["--", "./no/such/file.py"], "./no/such/file.py: no such file"),
        (["--bogus", "--", "true"], "No such option"),
        (["--ring", "0", "--", "true"], "Invalid value for '--ring'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    result = runner.invoke(app, ["run", *args], env=ENV)
    assert result.exit_code == 2, result.output
    assert says in result.output, result.output


def test_output_paths_are_checked_before_the_command_starts(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    prog = tmp_path / "p.py"
    prog.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    for option, value in (("--save", tmp_path), ("--junit", tmp_path / "missing" / "r.xml")):
        result = runner.invoke(app, ["run", option, str(value), "--", sys.executable, str(prog)], env=ENV)
        assert result.exit_code == 2 and option in error_line(result.output), result.output
    assert not marker.exists()


def test_the_commands_exit_status_json_and_junit(tmp_path: Path) -> None:
    prog = tmp_path / "p.py"
    prog.write_text(PROGRAM)
    save, junit = tmp_path / "run.json", tmp_path / "run.xml"
    result = runner.invoke(
        app,
        ["run", "--json", "--save", str(save), "--junit", str(junit), "--", sys.executable, str(prog), "3"],
        env=ENV,
    )
    assert result.exit_code == 3, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "run" and doc["schema_version"] >= 1
    assert json.loads(save.read_text()) == doc
    assert doc["command_exit"] == 3 and doc["command"][-1] == "3"
    (record,) = doc["passes"][0]["processes"]
    back = from_jsonable(ProcessRecord, record)
    assert back.launches == 1 and back.ring[0].kernel == "double"
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "1"  # the exit status


def test_the_human_report_follows_the_commands_output(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    prog = tmp_path / "p.py"
    prog.write_text(PROGRAM.replace("double[(1,)]", "print('user output', flush=True)\ndouble[(1,)]"))
    result = runner.invoke(app, ["run", "--", sys.executable, str(prog)], env=ENV)
    assert result.exit_code == 0, result.output
    assert "user output" in capfd.readouterr().out  # the command's stdout is the terminal's, untouched
    assert "qmoe-doctor run:" in result.stdout and "1 launch of 1 kernel" in result.stdout
    assert "No finding" in result.stdout


def report_with_a_finding() -> RunReport:
    x = TensorArg(name="x_ptr", device="cuda:1", data_ptr=1, nbytes=8, shape=(2,), strides=(1,), dtype="float32", numel=2)
    (f,) = other_device(LaunchFacts(seq=3, kernel="_k", device="cuda:0", tensors=(x,)), lambda a, b: True)
    d = RunDiagnosis(
        cause=f.cause, kind=FindingKind.OTHER_DEVICE, confidence=Confidence.HIGH, summary=f.message, kernel="_k",
        processes=("rank 0 (pid 1)",), launches=4, finding=f,
    )
    first = RunPass(label="run", argv=("python", "t.py"), exit_code=0, end="exited with status 0", wall_s=1.0)
    return RunReport(command=("python", "t.py"), started="2026-11-26T00:00:00+00:00", wall_s=1.0, exit_code=0,
                     command_exit=0, passes=(first,), diagnoses=(d,))


def test_junit_names_each_diagnosis_by_its_cause() -> None:
    root = ET.fromstring(run_junit_text(report_with_a_finding()))
    failures = root.findall(".//failure")
    assert [f.get("type") for f in failures] == ["missing-device-guard"]
    assert "with torch.cuda.device" in (failures[0].text or "") and CAUSES["missing-device-guard"].docs in (failures[0].text or "")


def test_the_diagnosis_renders_with_its_fix_as_code() -> None:
    from rich.console import Console

    from qmoe_doctor.cli.render.run import render_run

    console = Console(record=True, width=200)
    render_run(console, report_with_a_finding())
    text = console.export_text()
    assert "missing-device-guard" in text and "tensor: x_ptr (2 fp32) on cuda:1" in text
    assert "with torch.cuda.device(x.device):" in text and "seen in rank 0 (pid 1): 4 launches" in text


def test_a_cuda_error_is_reported_and_the_commands_exit_status_kept(tmp_path: Path) -> None:
    prog = tmp_path / "p.py"
    prog.write_text(PROGRAM.replace("sys.exit(", "raise RuntimeError('CUDA error: an illegal memory access was encountered')\nsys.exit("))
    result = runner.invoke(app, ["run", "--", sys.executable, str(prog)], env=ENV)
    assert result.exit_code == 1  # the command's own: the uncaught exception
    assert "CUDA error in pid" in result.stdout and "last launches, oldest first" in result.stdout
    assert "#1 double (launch 1 of it)" in result.stdout


@pytest.mark.parametrize(("options", "code"), [([], 0), (["--fail-on-finding"], 1), (["--strict"], 1)])
def test_fail_on_finding_turns_a_clean_exit_with_a_diagnosis_into_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: list[str], code: int
) -> None:
    prog = tmp_path / "p.py"
    prog.write_text(PROGRAM)
    found = report_with_a_finding().diagnoses
    monkeypatch.setattr("qmoe_doctor.workflows.run.run_findings.diagnoses", lambda records, label="run": found)
    result = runner.invoke(app, ["run", *options, "--", sys.executable, str(prog)], env=ENV)
    assert result.exit_code == code, result.output
    assert "missing-device-guard" in result.stdout


def test_the_run_needs_no_torch_in_the_doctor(tmp_path: Path) -> None:
    """The parent runs the command and reads records; the monitor lives in the command."""
    import subprocess

    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom qmoe_doctor.cli.app import app\n"
        "r = CliRunner().invoke(app, ['run', '--', 'true'])\nassert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('torch', 'triton', 'qmoe_doctor.monitor') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
