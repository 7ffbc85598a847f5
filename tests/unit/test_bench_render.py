"""The bench table printed to a pipe or a CI log keeps its numbers (rich assumed 80 columns off a
terminal and shrank every number column to "…"), on a narrow terminal the numbers stay whole
too, and the header names the launch-config table our kernels used."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from qmoe_doctor.cli.render.bench import config_table_line, render_report
from qmoe_doctor.core.bench import BenchReport, report_from_jsonable

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "reports" / "bench" / "2026-11-22-h200-34deb04" / "bench.json"
#: Numbers of that report (one H200, commit 34deb04) in every column of the GEMM table: 128, 512, 2048, 8192 tokens, error.
NUMBERS = ("31.7 7%", "123.7 19%", "382.1 51%", "564.2 82%", "1.7e-03", "232.7")


def _report() -> BenchReport:
    return report_from_jsonable(json.loads(RECORDED.read_text()))


def _render(console: Console) -> str:
    render_report(console, _report())
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def test_piped_the_table_prints_at_its_natural_width_with_every_number() -> None:
    """A console on a StringIO is what rich sees on a pipe: not a terminal, 80 columns."""
    out = _render(Console(file=io.StringIO(), width=80, soft_wrap=False, highlight=False, markup=False))
    assert "…" not in out
    for number in NUMBERS:
        assert number in out, number
    assert max(len(line) for line in out.splitlines()) > 80  # printed wider than the default


def test_on_a_narrow_terminal_numbers_stay_whole_and_the_names_wrap() -> None:
    out = _render(Console(file=io.StringIO(), width=100, force_terminal=True, color_system=None))
    assert "…" not in out
    for number in ("31.7 7%", "123.7 19%", "382.1 51%", "564.2 82%"):
        assert number in out, number
    table = [line for line in out.splitlines() if line[:1] in "┏┃┡│├└"]
    assert table and all(len(line) <= 100 for line in table)


def test_the_header_names_the_config_table_when_the_report_records_it() -> None:
    report = _report()
    assert config_table_line(report) == ""  # recorded before the field: no line
    if "config_table" not in {f.name for f in dataclasses.fields(BenchReport)}:
        pytest.skip("BenchReport has no config_table field yet (core/bench.py)")
    text = "configs-nvidia-h200-sm90-132sm.json (packaged, tuned on NVIDIA H200; this device)"
    with_table = dataclasses.replace(report, config_table=text)  # type: ignore[call-arg]
    console = Console(file=io.StringIO(), width=80)
    render_report(console, with_table)
    assert f"our launch configs: {text}" in console.file.getvalue()  # type: ignore[attr-defined]


def test_qmoe_doctor_bench_piped_through_the_cli_shows_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CliRunner's output is not a terminal: the command's own table must keep its numbers."""
    from typer.testing import CliRunner

    from qmoe_doctor.cli.app import app
    from qmoe_doctor.cli.commands import bench as command

    def recorded(*args: Any, **kwargs: Any) -> BenchReport:
        return _report()

    monkeypatch.setattr(command, "run_bench", recorded)
    result = CliRunner().invoke(app, ["bench", "--tiny", "--no-plot", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    table = result.stdout if hasattr(result, "stdout") else result.output
    assert "…" not in table
    for number in NUMBERS:
        assert number in table, number
    assert re.search(r"qmoe\s+│\s+31\.7 7%", table)
