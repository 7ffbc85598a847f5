"""One convention for every shared option (``qmoe_doctor.cli.options``): ``--json`` a flag (the
document to stdout) and ``--save FILE`` (the same document to a file) wherever a report exists;
``--gpus`` refused when empty or with ``--cpu``; options that cannot apply refused or warned
about, never silently ignored; config files that would crash a parser refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli import devices, parallel_runs
from qmoe_doctor.cli.app import COMMANDS, app
from qmoe_doctor.cli.commands import bench as bench_cmd
from qmoe_doctor.cli.commands import check as check_cmd
from qmoe_doctor.cli.commands import repro as repro_cmd
from qmoe_doctor.cli.commands import scan as scan_cmd
from qmoe_doctor.cli.options import CONDITION_NAMES
from qmoe_doctor.machine.inventory import Inventory

runner = CliRunner()
WIDE = {"COLUMNS": "250", "CUDA_VISIBLE_DEVICES": ""}
#: Commands that make a report: --json and --save both. specimens is a catalogue (--json only);
#: explain's options are its own helper's (docs say so).
REPORTS = ("scan", "check", "repro", "parallel", "env", "audit", "lint", "bench")
GPU_OPTION = ("scan", "check", "repro", "parallel", "env", "bench")


def _help(command: str) -> str:
    result = runner.invoke(app, [command, "--help"], env=WIDE)
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.replace("│", " ").split())


@pytest.fixture(autouse=True)
def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("nothing may run")

    for module, name in (
        (scan_cmd, "run_scan"),
        (check_cmd, "run_check"),
        (repro_cmd, "run_repro"),
        (parallel_runs, "run_parallel"),
        (bench_cmd, "run_bench"),
    ):
        monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr(
        devices, "collect_inventory", lambda: Inventory(nvml_error="NVML Shared Library Not Found")
    )


@pytest.mark.parametrize("command", REPORTS)
def test_json_is_a_flag_and_save_takes_a_file(command: str) -> None:
    text = _help(command).replace(" <bool>", "")  # typer may print a flag's type
    assert "--json Write the versioned JSON document to stdout" in text, text
    assert "--save FILE Also write the versioned JSON document to FILE" in text, text


def test_every_command_speaks_json() -> None:
    for command in COMMANDS:
        assert "--json" in _help(command), command


def test_check_json_with_a_path_gets_a_hint_to_save() -> None:
    result = runner.invoke(app, ["check", "--cpu", "--json", "out.json", "--junit", "r.xml"], env=WIDE)
    assert result.exit_code == 2
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert "--json is a flag" in line and "--save out.json" in line
    assert not Path("r.xml").exists()


def test_only_lists_the_conditions_and_refuses_none() -> None:
    text = _help("scan")
    assert all(name in text for name in CONDITION_NAMES)
    for value, says in ((",", "names no condition"), ("single,bogus", "unknown condition 'bogus'")):
        result = runner.invoke(app, ["scan", "--cpu", "--only", value], env=WIDE)
        assert result.exit_code == 2 and says in result.stderr, result.output


@pytest.mark.parametrize("command", GPU_OPTION)
def test_empty_gpus_is_refused(command: str) -> None:
    args = [command, "--gpus", ""] + (["--tiny"] if command == "bench" else [])
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    assert "--gpus" in result.stderr


@pytest.mark.parametrize("command", ("scan", "check", "parallel"))
def test_gpus_with_cpu_is_refused(command: str) -> None:
    result = runner.invoke(app, [command, "--cpu", "--gpus", "0"], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "--gpus 0 selects GPUs and --cpu runs on none" in result.stderr


def test_rows_on_the_cpu_tier_is_refused_or_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    result = runner.invoke(app, ["scan", "--cpu", "--rows", "64"], env=WIDE)
    assert result.exit_code == 2 and "--cpu runs the CPU tier's own small shape" in result.stderr
    seen: list[Any] = []

    def stop(plan: Any, **kw: Any) -> Any:
        seen.append(plan)
        raise KeyboardInterrupt

    monkeypatch.setattr(scan_cmd, "run_scan", stop)
    result = runner.invoke(app, ["scan", "--rows", "64"], env=WIDE)  # no GPU here: the CPU tier
    assert seen and "warning: --rows is ignored" in result.stderr, result.output


@pytest.mark.parametrize(
    "option", (["--rows", "64"], ["--only", "single"], ["--no-sweeps"], ["--configs", "64x64x32-w4-s2"])
)
def test_scan_parallel_refuses_the_scan_only_options(option: list[str]) -> None:
    result = runner.invoke(app, ["scan", "--parallel", "dp", "--cpu", *option], env=WIDE)
    assert result.exit_code == 2, result.output
    assert f"{option[0].replace('--no-', '--')} would be ignored" in " ".join(result.stderr.split())


def test_parallel_command_modules_do_not_import_each_other() -> None:
    for name in ("scan", "parallel", "repro", "check"):
        source = Path(__file__).resolve().parents[2] / "qmoe_doctor" / "cli" / "commands" / f"{name}.py"
        assert "qmoe_doctor.cli.commands" not in source.read_text(), name


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        ('{"num_experts": ' + "9" * 3000 + "}", "3000 digits long"),
        ('{"num_experts": ' + "9" * 5000 + "}", "out of range"),
        (None, "is a device file"),  # /dev/zero
    ],
    ids=["deep", "3000 digits", "5000 digits", "/dev/zero"],
)
def test_hostile_configs_are_one_line_and_exit_2(content: str | None, says: str, tmp_path: Path) -> None:
    path = Path("/dev/zero")
    if content is not None:
        path = tmp_path / "config.json"
        path.write_text(content)
    result = runner.invoke(app, ["audit", "--config", str(path), "--json"], env=WIDE)
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert str(path) in line and says in line and result.stdout == ""


def test_env_save_and_json_are_the_same_document(tmp_path: Path) -> None:
    target = tmp_path / "inventory.json"
    result = runner.invoke(app, ["env", "--json", "--save", str(target)], env=WIDE)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(target.read_text())
