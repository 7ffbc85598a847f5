"""The one table from library exceptions to messages and exit codes (``qmoe_doctor.cli.errors``):
whatever a command's library raises, the user gets one line on stderr and the documented exit
code, never a traceback, and text from outside (an exception message, a path) never reaches rich
as markup."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli import errors
from qmoe_doctor.cli.app import COMMANDS, app
from qmoe_doctor.cli.commands import lint as lint_cmd
from qmoe_doctor.cli.output import OutputPathError
from qmoe_doctor.core.audit import ConfigError
from qmoe_doctor.core.events import Interrupted
from qmoe_doctor.core.inputs import InputError
from qmoe_doctor.core.kernel_ref import KernelRefError
from qmoe_doctor.machine.inventory import GpuSelectionError
from qmoe_doctor.workflows.bench import BenchError
from qmoe_doctor.workflows.parallel import ParallelPlanError
from qmoe_doctor.workflows.scan import KernelUnusable

runner = CliRunner()
MARKUP = "a [/] b [bold]c[/bold] [link=x]"

# (what the library raised, exit code, what the line says)
TABLE = [
    (KernelRefError("x:y:z", "no such thing"), 2, "--kernel 'x:y:z': no such thing"),
    (KernelUnusable("cannot import module 'm'"), 2, "the kernel could not be used: cannot import module 'm'"),
    (GpuSelectionError("--gpus '9': no GPU 9"), 2, "--gpus '9': no GPU 9"),
    (InputError("conf.json: is a FIFO"), 2, "conf.json: is a FIFO"),
    (ConfigError("conf.json: missing key 'num_experts'."), 2, "missing key 'num_experts'"),
    (OutputPathError("--save x: is a folder"), 2, "--save x: is a folder"),
    (ParallelPlanError("unknown parallel mode 'zz'"), 2, "unknown parallel mode 'zz'"),
    (ValueError("QMOE_DOCTOR_PROBE_TIMEOUT='x' is not a number of seconds"), 2, "is not a number of seconds"),
    (RecursionError("maximum recursion depth exceeded"), 2, "maximum recursion depth exceeded"),
    (BenchError("the benchmark child exited with status 7"), 4, "exited with status 7"),
    (OSError(28, "No space left on device"), 4, "No space left on device"),
    (MemoryError(), 4, "MemoryError"),
    (errors.CliError("refused", code=errors.ExitCode.TOO_FEW_GPUS), 3, "refused"),
    (ValueError(MARKUP), 2, MARKUP),
]


def _raising(exc: BaseException) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return run


@pytest.mark.parametrize(
    ("exc", "code", "says"), TABLE, ids=[type(t[0]).__name__ + f"-{t[1]}" for t in TABLE]
)
def test_every_library_error_is_one_line_and_its_exit_code(
    exc: BaseException, code: int, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lint_cmd, "run_lint", _raising(exc))
    result = runner.invoke(app, ["lint", "kernels"])
    assert result.exit_code == code, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert "Traceback" not in result.output and result.stdout == ""


def test_every_rule_is_reachable_and_specific_rules_come_first() -> None:
    """First match wins: no rule hides a later one (a subclass after its base never applies)."""
    for i, rule in enumerate(errors.ERRORS):
        for earlier in errors.ERRORS[:i]:
            assert not issubclass(rule.error, earlier.error), (rule.error, earlier.error)


@pytest.mark.parametrize(
    ("exc", "code"),
    [(KeyboardInterrupt(), 130), (Interrupted(signal.SIGTERM), 143), (Interrupted(signal.SIGHUP), 129)],
)
def test_interrupts_exit_128_plus_the_signal(
    exc: BaseException, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lint_cmd, "run_lint", _raising(exc))
    result = runner.invoke(app, ["lint", "kernels"])
    assert result.exit_code == code, result.output
    assert "interrupted" in result.stderr and "Traceback" not in result.output


def test_a_bug_is_one_line_exit_4_and_its_traceback_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(errors.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(lint_cmd, "run_lint", _raising(KeyError(MARKUP)))
    result = runner.invoke(app, ["lint", "kernels"])
    assert result.exit_code == 4, result.output
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert "internal error (a bug in qmoe-doctor): KeyError" in line and MARKUP in line
    (saved,) = tmp_path.glob("qmoe-doctor-crash-*.txt")
    assert "Traceback" in saved.read_text() and str(saved) in line


def test_every_command_is_guarded() -> None:
    for name, command in COMMANDS.items():
        wrapped = next(c for c in app.registered_commands if c.name == name).callback
        assert wrapped is not None and getattr(wrapped, "__wrapped__", None) is command, name


def test_markup_in_user_text_prints_as_text(tmp_path: Path) -> None:
    """A kernel path, a --gpus value and a config path holding '[/]' print as they are."""
    for args in (
        ["scan", "--kernel", "[/]/k.py:fn"],
        ["scan", "--gpus", "[/]"],
        ["audit", "--config", str(tmp_path / "[/]" / "config.json")],
        ["check", "--kernel", "specimen:[/]"],
    ):
        result = runner.invoke(app, args, env={"CUDA_VISIBLE_DEVICES": ""})
        assert result.exit_code == 2, (args, result.output)
        assert "[/]" in result.stderr and "MarkupError" not in result.output, result.output


def test_an_exception_message_with_markup_from_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a kernel's import raised reaches the terminal as text."""
    (tmp_path / "k.py").write_text(f"raise ImportError({MARKUP!r})\n\ndef fn(x, w, m_sizes):\n    return x\n")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(
        app, ["scan", "--cpu", "--only", "single", "--kernel", "k.py:fn"], env={"CUDA_VISIBLE_DEVICES": ""}
    )
    assert result.exit_code == 2, result.output
    assert MARKUP in result.stderr and "Traceback" not in result.output


def test_json_stays_clean_when_a_command_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """stdout carries the machine contract only: an error goes to stderr."""
    monkeypatch.setattr(lint_cmd, "run_lint", _raising(ValueError("unknown rule 'x'")))
    result = runner.invoke(app, ["lint", "kernels", "--json"])
    assert result.exit_code == 2 and result.stdout == ""
    ok = runner.invoke(app, ["specimens", "--json"])
    assert json.loads(ok.stdout)["kind"] == "specimens"
