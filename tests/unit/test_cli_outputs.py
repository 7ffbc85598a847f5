"""Output paths: every ``--save``, ``--junit``, ``--log-dir`` and ``--out`` is checked before any
work starts (exit 2, the path named), and a write that still fails at the end lands in a fallback
file whose path is said, so nothing computed is lost. Interrupts exit 130."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from made_reports import one_probe_scan
from typer.testing import CliRunner

from qmoe_doctor.cli import output, parallel_runs
from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.commands import bench as bench_cmd
from qmoe_doctor.cli.commands import check as check_cmd
from qmoe_doctor.cli.commands import repro as repro_cmd
from qmoe_doctor.cli.commands import scan as scan_cmd
from qmoe_doctor.core.events import Interrupted
from qmoe_doctor.workflows.bench import load_report

runner = CliRunner()
BENCH_2XH200 = Path(__file__).resolve().parents[1] / "fixtures" / "reports" / "bench" / "2026-11-22-2xh200-ab67830" / "bench.json"


@pytest.fixture(autouse=True)
def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """No probe, run or child may start in these tests unless a test says otherwise."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the run started before its output paths were checked")

    for module, name in (
        (scan_cmd, "run_scan"),
        (check_cmd, "run_check"),
        (repro_cmd, "run_repro"),
        (parallel_runs, "run_parallel"),
        (bench_cmd, "run_bench"),
    ):
        monkeypatch.setattr(module, name, forbidden)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {"folder": folder, "file": a_file, "missing": tmp_path / "no" / "such" / "report.json"}


# (command line, which of the paths, what the message says): a file option given a folder, a
# device, a missing folder; a folder option given a file or a path through a file.
CASES = [
    (["scan", "--cpu", "--save", "{folder}"], "is a folder"),
    (["scan", "--cpu", "--save", "/dev/full"], "is not a regular file"),
    (["scan", "--cpu", "--save", "{missing}"], "does not exist"),
    (["scan", "--cpu", "--log-dir", "{file}"], "is a file, not a folder"),
    (["scan", "--cpu", "--log-dir", "{file}/logs"], "is a file, not a folder"),
    (["check", "--cpu", "--save", "{folder}"], "is a folder"),
    (["check", "--cpu", "--junit", "/dev/full"], "is not a regular file"),
    (["check", "--cpu", "--junit", "{missing}"], "does not exist"),
    (["check", "--cpu", "--log-dir", "{file}"], "is a file, not a folder"),
    (["repro", "--out", "{file}"], "is a file, not a folder"),
    (["repro", "--save", "{folder}"], "is a folder"),
    (["parallel", "--cpu", "--save", "/dev/full"], "is not a regular file"),
    (["parallel", "--cpu", "--log-dir", "{file}"], "is a file, not a folder"),
    (["bench", "--tiny", "--out", "{file}"], "is a file, not a folder"),
    (["bench", "--tiny", "--save", "{folder}"], "is a folder"),
    (["lint", "kernels", "--save", "{folder}"], "is a folder"),
    (["audit", "--save", "/dev/full"], "is not a regular file"),
    (["env", "--save", "{missing}"], "does not exist"),
]


@pytest.mark.parametrize(("args", "says"), CASES, ids=[" ".join(a) + f" ({s})" for a, s in CASES])
def test_bad_output_paths_are_refused_before_any_work(
    args: list[str], says: str, paths: dict[str, Path]
) -> None:
    argv = [a.format(**paths) for a in args]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    named = next(a for a in argv if a.startswith("/"))
    assert says in _flat(result.stderr) and named in _flat(result.stderr), result.stderr
    assert "Traceback" not in result.output


def test_a_read_only_folder_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(output.tempfile, "mkstemp", read_only)
    target = tmp_path / "report.json"
    result = runner.invoke(app, ["scan", "--cpu", "--save", str(target)])
    assert result.exit_code == 2, result.output
    assert f"--save {target}: cannot write in {tmp_path} (Read-only file system)" in _flat(result.stderr)




def test_a_write_that_fails_at_the_end_lands_in_the_log_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs, target = tmp_path / "logs", tmp_path / "report.json"
    monkeypatch.setattr(scan_cmd, "run_scan", lambda plan, **kw: one_probe_scan(logs))
    real = output.write_atomic

    def disk_full(path: Path, text: str) -> None:
        if path == target:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(output, "write_atomic", disk_full)
    result = runner.invoke(app, ["scan", "--cpu", "--save", str(target), "--log-dir", str(logs)])
    assert result.exit_code == 0, result.output  # the verdict stands
    spare = logs / "report.unsaved.json"
    assert (
        f"could not write the JSON report to {target} (No space left on device); it is in {spare}"
        in _flat(result.stderr)
    )
    doc = json.loads(spare.read_text())
    assert doc["kind"] == "scan" and doc["healthy"] is True and not target.exists()


def test_bench_default_out_in_a_read_only_folder_goes_to_a_temp_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    real = output._probe_write

    def read_only_here(folder: Path, option: str, path: Path) -> None:
        if folder.resolve() == tmp_path.resolve():
            raise output.OutputPathError(f"{option} {path}: cannot write in {folder} (Read-only file system)")
        real(folder, option, path)

    monkeypatch.setattr(output, "_probe_write", read_only_here)
    seen: list[Path] = []

    def measured(request: Any, *, workdir: Path, **kw: Any) -> Any:
        seen.append(workdir)
        return load_report(BENCH_2XH200)

    monkeypatch.setattr(bench_cmd, "run_bench", measured)
    result = runner.invoke(app, ["bench", "--tiny", "--no-plot"])
    assert result.exit_code == 0, result.output
    (workdir,) = seen
    assert workdir.name.startswith("qmoe-bench-") and workdir.parent != tmp_path
    assert f"writing the bench files to {workdir}" in _flat(result.stderr)
    assert (workdir / "bench.json").is_file() and not (tmp_path / "qmoe-bench").exists()
    # a given --out that cannot be written is the user's mistake: exit 2, nothing run
    seen.clear()
    result = runner.invoke(app, ["bench", "--tiny", "--out", str(tmp_path / "mine")])
    assert result.exit_code == 2 and not seen, result.output


@pytest.mark.parametrize(("raised", "code"), [(KeyboardInterrupt(), 130), (Interrupted(15), 143)])
def test_interrupted_check_exits_128_plus_the_signal(
    raised: BaseException, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise raised

    monkeypatch.setattr(check_cmd, "run_check", interrupted)
    result = runner.invoke(app, ["check", "--cpu"])
    assert result.exit_code == code, result.output
    assert "interrupted" in result.stderr


def test_save_writes_the_document_json_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--json and --save FILE are the same versioned document."""
    logs, target = tmp_path / "logs", tmp_path / "report.json"
    monkeypatch.setattr(scan_cmd, "run_scan", lambda plan, **kw: one_probe_scan(logs))
    result = runner.invoke(app, ["scan", "--cpu", "--json", "--save", str(target)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(target.read_text())
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp") or p.endswith(".probe")]
