"""Every case of the hostile-input report (output paths, markup, unbounded reads, pathological
input, signals, contradictions, timeouts, declared variables, litter), re-run on the CPU: a clear
one-line message and the documented exit code, no traceback, nothing computed lost, no process
left behind. One test per kind of case, parametrized by the cases of that kind.

What runs for real and what is replaced:

* Output paths are refused before any work: the workflows are replaced by a stub that fails the
  test if reached. Read-only places are real: ``/proc`` and ``/sys`` take no new file, as root
  too (chmod does not stop root), and ``/dev/full`` is a device, refused as one. A write that
  fails at the end (a full disk) is simulated by replacing the one writer, around a real run.
* Markup, the kernel-import error path, timeouts, contradictions and signals run the real CLI
  and real probe children under the Triton interpreter (a CPU scan takes ~2 s). Children that
  hang or fail to start are made with a ``sitecustomize`` hook or a fake interpreter script
  (``QMOE_DOCTOR_CHILD_PYTHON``), never with torch.
* Unbounded reads run in a subprocess with its address space capped (RLIMIT_AS, 2 GiB): a reader
  that grew with its input would die of MemoryError (exit 4) instead of refusing it (exit 2).
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fake_nvml import two_h200_nvswitch
from made_reports import one_probe_scan
from signal_dispositions import restore_defaults
from test_signals import WORKER_MODULE, marked, wait_for
from typer.testing import CliRunner, Result

from qmoe_doctor.cli import output
from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.commands import bench as bench_cmd
from qmoe_doctor.cli.commands import check as check_cmd
from qmoe_doctor.cli.commands import scan as scan_cmd
from qmoe_doctor.core import knobs, lifeline
from qmoe_doctor.core.events import Interrupted
from qmoe_doctor.core.inputs import MAX_INPUT_BYTES
from qmoe_doctor.workflows.bench import load_report

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
BENCH_2XH200 = REPO / "tests" / "fixtures" / "reports" / "bench" / "2026-11-22-2xh200-ab67830" / "bench.json"
MARKUP = "[/] [bold red]x[/bold red] [link=file:///x]y[/link]"
LINUX = Path("/proc/self/environ").exists()
needs_linux = pytest.mark.skipif(not LINUX, reason="uses /proc, /sys and /dev/full")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _cpu_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No GPU, no chosen interpreter, a temp folder of this test's own (litter is visible)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name in (knobs.QMOE_CHILD_PYTHON, knobs.QMOE_SANITIZER, knobs.QMOE_RESULT_FD):
        monkeypatch.delenv(name, raising=False)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR


def flat(text: str) -> str:
    return " ".join(text.split())


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error: ")]


def assert_refused(result: Result, code: int, *words: str) -> str:
    """Exit ``code`` with exactly one ``error:`` line holding every word; no traceback, no markup
    crash. Returns the line (the message, wrapped lines joined)."""
    shown = f"exit {result.exit_code}\nstdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
    assert result.exception is None or isinstance(result.exception, SystemExit), (result.exception, shown)
    assert "Traceback" not in result.output and "MarkupError" not in result.output, shown
    assert result.exit_code == code, shown
    lines = error_lines(result.stderr)
    assert len(lines) == 1, shown
    said = flat(result.stderr[result.stderr.index("error: ") :])
    for word in words:
        assert flat(word) in said, (word, shown)
    return said


def assert_no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr and "MarkupError" not in proc.stderr, proc.stderr[
        -3000:
    ]


def doctor(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess (``python -m qmoe_doctor``)."""
    return subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", *args],
        env={**os.environ, "COLUMNS": "1000", **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kw,
    )


# =================================================================================================
# Output paths: checked before any work, exit 2 with the path named; a late failure loses nothing
# =================================================================================================


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the run started before its output paths were checked")

    for module, name in ((scan_cmd, "run_scan"), (check_cmd, "run_check"), (bench_cmd, "run_bench")):
        monkeypatch.setattr(module, name, forbidden)


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    return {
        "missing": str(tmp_path / "no" / "such" / "report.out"),
        "folder": str(tmp_path / "folder"),
        "file": str(tmp_path / "file"),
        "through_file": str(tmp_path / "file" / "logs"),
    }


# (command, option, where, what the line says). "where" is a key of `places`, or a real path
# that cannot be written: /proc and /sys take no new file (as root too), /dev/full is a device.
FILE_OPTIONS = [("check", "--save"), ("check", "--junit"), ("scan", "--save"), ("bench", "--save")]
DIR_OPTIONS = [("check", "--log-dir"), ("scan", "--log-dir"), ("bench", "--out")]
PATH_CASES = (
    [(c, o, "missing", "does not exist") for c, o in FILE_OPTIONS]
    + [(c, o, "folder", "is a folder") for c, o in FILE_OPTIONS]
    + [(c, o, "/dev/full", "is not a regular file") for c, o in FILE_OPTIONS]
    + [(c, o, "/proc/qmoe-report.out", "cannot write in /proc") for c, o in FILE_OPTIONS]
    + [(c, o, "/sys/qmoe-report.out", "cannot write in /sys") for c, o in FILE_OPTIONS]
    + [(c, o, "file", "is a file, not a folder") for c, o in DIR_OPTIONS]
    + [(c, o, "through_file", "is a file, not a folder") for c, o in DIR_OPTIONS]
    + [(c, o, "/proc/qmoe-logs", "cannot write in /proc") for c, o in DIR_OPTIONS]
    + [(c, o, "/sys/qmoe-logs", "cannot write in /sys") for c, o in DIR_OPTIONS]
)
BASE_ARGS = {"check": ["check", "--cpu"], "scan": ["scan", "--cpu"], "bench": ["bench", "--tiny"]}


@needs_linux
@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(
    ("command", "option", "where", "says"), PATH_CASES, ids=[f"{c} {o} {w}" for c, o, w, _ in PATH_CASES]
)
def test_output_paths_are_refused_before_any_work(
    command: str, option: str, where: str, says: str, places: dict[str, str]
) -> None:
    path = places.get(where, where)
    result = runner.invoke(app, [*BASE_ARGS[command], option, path])
    assert_refused(result, 2, f"{option} {path}", says)


@pytest.mark.parametrize(("command", "option"), DIR_OPTIONS, ids=[f"{c} {o}" for c, o in DIR_OPTIONS])
def test_a_missing_folder_for_a_folder_option_is_made(
    command: str, option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Into a missing folder: a folder option's parents are created, not refused."""
    reached: list[str] = []

    def stub(*args: Any, **kwargs: Any) -> Any:
        reached.append(command)
        raise SystemExit(99)

    for module, name in ((scan_cmd, "run_scan"), (check_cmd, "run_check"), (bench_cmd, "run_bench")):
        monkeypatch.setattr(module, name, stub)
    result = runner.invoke(app, [*BASE_ARGS[command], option, str(tmp_path / "new" / "deep" / "folder")])
    assert result.exit_code == 99 and reached == [command], result.output


def _enospc_for(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one writer fails for ``target`` as a full disk does; every other write goes through."""
    real = output.write_atomic

    def full(path: Path, text: str) -> None:
        if Path(path) == target:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(output, "write_atomic", full)


LATE_CASES = [
    (["scan", "--cpu", "--only", "single"], "--save", "the JSON report", "scan"),
    (
        ["check", "--cpu", "--only", "single", "-k", "builtin", "--lint", "{clean}"],
        "--save",
        "the JSON report",
        "check",
    ),
    (
        ["check", "--cpu", "--only", "single", "-k", "builtin", "--lint", "{clean}"],
        "--junit",
        "the JUnit report",
        None,
    ),
]


@pytest.mark.parametrize(
    ("args", "option", "what", "kind"), LATE_CASES, ids=[f"{a[0]} {o}" for a, o, _, _ in LATE_CASES]
)
def test_a_write_that_fails_at_the_end_lands_in_the_log_folder(
    args: list[str], option: str, what: str, kind: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real CPU run; its report's write fails at the end (ENOSPC): the verdict stands, the
    report is in the log folder and the line says where."""
    clean = tmp_path / "clean.py"
    clean.write_text("X = 1\n")
    target, logs = tmp_path / "report.out", tmp_path / "logs"
    _enospc_for(target, monkeypatch)
    argv = [a.format(clean=clean) for a in args] + [option, str(target), "--log-dir", str(logs)]
    result = runner.invoke(app, argv)
    assert result.exit_code in (0, 1), result.output
    assert "Traceback" not in result.output
    (spare,) = logs.rglob("report.unsaved.out")
    assert f"could not write {what} to {target} (No space left on device); it is in {spare}" in flat(
        result.stderr
    )
    text = spare.read_text()
    if kind is not None:
        assert json.loads(text)["kind"] == kind
    else:
        assert text.startswith("<?xml") and "<testsuite" in text
    assert not target.exists()


@needs_linux
def test_bench_without_out_in_a_read_only_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default ./qmoe-bench in a working directory that takes no file (/proc) becomes a temp
    folder, said on stderr."""
    monkeypatch.chdir("/proc")
    seen: list[Path] = []

    def measured(request: Any, *, workdir: Path, **kw: Any) -> Any:
        seen.append(workdir)
        return load_report(BENCH_2XH200)

    monkeypatch.setattr(bench_cmd, "run_bench", measured)
    result = runner.invoke(app, ["bench", "--tiny", "--no-plot"])
    assert result.exit_code == 0, result.output
    (workdir,) = seen
    assert workdir.parent == tmp_path / "tmp" and workdir.name.startswith("qmoe-bench-")
    assert f"writing the bench files to {workdir}" in flat(result.stderr)
    assert json.loads((workdir / "bench.json").read_text())["kind"] == "bench"


# =================================================================================================
# Text from the user is never markup: --gpus, kernel paths, module names, exception messages
# =================================================================================================


@pytest.fixture
def markup_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Kernels whose paths and whose import errors hold markup: a file under a folder named
    ``a[`` / ``]b`` (the path reads ``a[/]b/k.py``), and a module that raises at import."""
    folder = tmp_path / "a[" / "]b"
    folder.mkdir(parents=True)
    (folder / "k.py").write_text(f"raise ImportError({MARKUP!r})\n\ndef fn(x, w, m_sizes):\n    return x\n")
    (tmp_path / "qd_markup_mod.py").write_text(
        f"raise RuntimeError({MARKUP!r})\n\ndef fn(x, w, m_sizes):\n    return x\n"
    )
    (tmp_path / "qd_markup_call.py").write_text(
        f"def fn(x, w, m_sizes):\n    raise RuntimeError({MARKUP!r})\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


# (argv, exit code, text that must be printed as it is). Refusals run nothing; the kernel-import
# rows start a real probe child, whose exception message comes back with markup in it.
MARKUP_CASES = [
    (["scan", "--gpus", "[/]"], 2, "[/]"),
    (["bench", "--gpus", "[/]"], 2, "[/]"),
    (["check", "--gpus", "[bold]0[/bold]"], 2, "[bold]0[/bold]"),
    (["scan", "--kernel", "[/]/missing.py:fn"], 2, "[/]/missing.py"),
    (["scan", "--kernel", "[/]mod:fn"], 2, "[/]mod"),
    (["check", "--kernel", "specimen:[/]"], 2, "specimen:[/]"),
    (["bench", "--preset", "[/]"], 2, "[/]"),
    (["scan", "--cpu", "--only", "single", "--kernel", "a[/]b/k.py:fn"], 2, MARKUP),
    (["check", "--cpu", "--only", "single", "--kernel", "a[/]b/k.py:fn"], 2, MARKUP),
    (["scan", "--cpu", "--only", "single", "--kernel", "qd_markup_mod:fn"], 2, MARKUP),
]


@pytest.mark.parametrize(("args", "code", "text"), MARKUP_CASES, ids=[" ".join(c[0]) for c in MARKUP_CASES])
def test_markup_from_the_user_prints_as_text(
    args: list[str], code: int, text: str, markup_kernels: Path
) -> None:
    result = runner.invoke(app, args)
    assert_refused(result, code, text)


def test_markup_from_the_user_with_gpus_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same --gpus values where NVML lists GPUs: refused as indices, printed as text."""
    monkeypatch.setitem(sys.modules, "pynvml", two_h200_nvswitch().module())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    for command in ("scan", "bench", "env"):
        assert_refused(runner.invoke(app, [command, "--gpus", "[/]"]), 2, "'[/]' is not a GPU index")


def test_markup_in_a_kernel_error_at_call_time_is_text_in_the_report(markup_kernels: Path) -> None:
    """A kernel that raises with markup on every call: unusable (its baseline raised, exit 2),
    and the error quoted is text."""
    result = runner.invoke(app, ["scan", "--cpu", "--only", "single", "--kernel", "qd_markup_call:fn"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and "MarkupError" not in result.output
    assert result.exit_code == 2, result.output
    assert MARKUP in flat(result.output)


def test_markup_in_the_bench_child_output_and_failure(tmp_path: Path) -> None:
    """The bench child (a fake interpreter here) prints markup and fails: exit 4, text as is."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{MARKUP}'\necho '{MARKUP}' >&2\nexit 3\n")
    fake.chmod(0o755)
    proc = doctor(
        "bench",
        "--tiny",
        "--no-plot",
        "--out",
        str(tmp_path / "out"),
        env={knobs.QMOE_CHILD_PYTHON: str(fake)},
    )
    assert_no_traceback(proc)
    assert proc.returncode == 4, proc.stderr
    assert MARKUP in proc.stderr and len(error_lines(proc.stderr)) == 1, proc.stderr


# =================================================================================================
# Unbounded reads: every kind of input capped (decompressed size included), special files refused
# =================================================================================================

ADDRESS_SPACE = 2 * 2**30


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _gzip_bomb(path: Path, size: int) -> None:
    """``size`` bytes of zeros gzipped (about size/1000 on disk), written in pieces."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    piece = bytes(1 << 20)
    with open(path, "wb") as fh:
        for _ in range(size >> 20):
            fh.write(z.compress(piece))
        fh.write(z.flush())


def _damaged_gzip(path: Path, how: str) -> Path:
    """A gzip of a 190 kB text, cut in half or with 64 bytes in its middle inverted."""
    data = gzip.compress("".join(f"========= line {i}\n" for i in range(10_000)).encode())
    half = len(data) // 2
    if how == "truncated":
        path.write_bytes(data[:half])
    else:
        path.write_bytes(data[:half] + bytes(b ^ 0xFF for b in data[half : half + 64]) + data[half + 64 :])
    return path


def _fifo(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def _folder_with(tmp_path: Path, kind: str) -> Path:
    """A folder holding a clean source and one special entry named like a source."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "ok.py").write_text("X = 1\n")
    if kind == "fifo":
        os.mkfifo(folder / "pipe.py")
    elif kind == "device":
        (folder / "zero.py").symlink_to("/dev/zero")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(folder / "sock.py"))
        sock.close()
    return folder


# (id, argv builder, stdin, exit code, what the line says). Each runs in a subprocess whose
# address space is capped: reading its input whole would be MemoryError (exit 4), not exit 2.
READ_CASES: list[tuple[str, Callable[[Path], list[str]], str | None, int, str]] = [
    ("explain /dev/zero", lambda t: ["explain", "/dev/zero"], None, 2, "/dev/zero: is a device file"),
    ("audit --config /dev/zero", lambda t: ["audit", "--config", "/dev/zero"], None, 2, "/dev/zero: is a device file"),
    ("lint /dev/zero", lambda t: ["lint", "/dev/zero"], None, 2, "/dev/zero"),
    ("explain a FIFO", lambda t: ["explain", str(_fifo(t, "log"))], None, 2, "is a FIFO"),
    ("audit --config a FIFO", lambda t: ["audit", "--config", str(_fifo(t, "config.json"))], None, 2, "is a FIFO"),
    ("lint a FIFO named *.py", lambda t: ["lint", str(_fifo(t, "k.py"))], None, 2, "FIFO"),
    ("explain a gzip bomb", lambda t: (_gzip_bomb(t / "b.log.gz", 200 << 20), ["explain", str(t / "b.log.gz")])[1], None, 2, "decompresses to more than 64 MiB"),
    ("explain a corrupt .gz", lambda t: ["explain", str(_damaged_gzip(t / "c.log.gz", "corrupt"))], None, 2, "corrupt gzip"),
    ("explain a truncated .gz", lambda t: ["explain", str(_damaged_gzip(t / "t.log.gz", "truncated"))], None, 2, "truncated gzip"),
    ("explain stdin from /dev/zero", lambda t: ["explain", "-"], "/dev/zero", 2, "standard input: larger than 64 MiB"),
    ("audit --config bigger than its cap", lambda t: ((t / "big.json").write_bytes(b" " * (MAX_INPUT_BYTES + 1)), ["audit", "--config", str(t / "big.json")])[1], None, 2, "larger than"),
]  # fmt: skip


@needs_linux
@pytest.mark.parametrize(
    ("name", "argv", "stdin", "code", "says"), READ_CASES, ids=[c[0] for c in READ_CASES]
)
def test_unbounded_inputs_are_refused_in_bounded_memory(
    name: str, argv: Callable[[Path], list[str]], stdin: str | None, code: int, says: str, tmp_path: Path
) -> None:
    args = argv(tmp_path)
    with open(stdin or os.devnull, "rb") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "qmoe_doctor", *args],
            stdin=fh,
            capture_output=True,
            text=True,
            timeout=120,  # a FIFO opened for reading blocks forever: fail, never hang
            check=False,
            preexec_fn=_capped,
            env={**os.environ, "COLUMNS": "300"},
        )
    assert_no_traceback(proc)
    assert proc.returncode == code, proc.stderr
    (line,) = error_lines(proc.stderr)
    assert flat(says) in flat(proc.stderr), proc.stderr
    assert line


@needs_linux
@pytest.mark.parametrize("kind", ["fifo", "device", "socket"])
def test_lint_of_a_folder_holding_a_special_file_skips_it(kind: str, tmp_path: Path) -> None:
    folder = _folder_with(tmp_path, kind)
    proc = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", "lint", str(folder), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=_capped,
    )
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["files"] == [(folder / "ok.py").as_posix()], doc


# =================================================================================================
# Pathological but valid input: one line naming the file and what is wrong, exit 2
# =================================================================================================

DEEP_KERNEL = (
    "import triton\nimport triton.language as tl\n\n@triton.jit\ndef k(x_ptr, stride_xm):\n"
    "    pid = tl.program_id(0)\n    tl.store(x_ptr + " + " + ".join(["pid * stride_xm"] * 3000) + ", 1)\n"
)
PATHOLOGICAL = [
    ("deep JSON config", ["audit", "--config"], "config.json", '{"text_config": ' * 100_000 + "1" + "}" * 100_000, "nested too deep"),
    ("deep JSON array", ["audit", "--config"], "config.json", "[" * 100_000 + "]" * 100_000, "nested too deep"),
    ("3000-digit integer", ["audit", "--config"], "config.json", '{"num_experts": ' + "9" * 3001 + "}", "3001 digits long"),
    ("5000-digit integer", ["audit", "--config"], "config.json", '{"num_experts": ' + "9" * 5000 + "}", "out of range"),
    ("deep expression source", ["lint"], "deep.py", DEEP_KERNEL, "deep"),
    ("deep parentheses source", ["lint"], "parens.py", "x = " + "(" * 5000 + "1" + ")" * 5000 + "\n", "parens.py"),
    ("5000-digit number in a log", ["explain"], "huge.log", "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: " + "9" * 5000 + " errors\n", "no tool writes"),
    ("5000-digit line number in a traceback", ["explain"], "huge.txt", 'Traceback (most recent call last):\n  File "k.py", line ' + "9" * 5000 + ", in f\nValueError: x\n", "no tool writes"),
    ("5000-digit pointer argument in a traceback", ["explain"], "ptr.txt", 'Traceback (most recent call last):\n  File "k.py", line 3, in f\nValueError: Pointer argument (at ' + "9" * 5000 + ") cannot be accessed from Triton (cpu tensor?)\n", "thousands of digits"),
    ("5000-digit line in a device assert", ["explain"], "assert.txt", "/k.py:" + "9" * 5000 + ": unknown: block: [1,0,0] Assertion `int32 overflow detected for operation mul` failed.\n", "thousands of digits"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "args", "file", "content", "says"), PATHOLOGICAL, ids=[c[0] for c in PATHOLOGICAL]
)
def test_pathological_input_is_one_line_naming_the_file(
    name: str, args: list[str], file: str, content: str, says: str, tmp_path: Path
) -> None:
    path = tmp_path / file
    path.write_text(content)
    result = runner.invoke(app, [*args, str(path)])
    assert_refused(result, 2, str(path), says)


# =================================================================================================
# Signals: no child outlives the doctor, for check as for scan (tests/unit/test_signals.py)
# =================================================================================================

HANG_FROM_WORKER = '''\
"""Test hook: the Nth probe worker started (and every later one) hangs at import of
qmoe_doctor.probes.conditions; the earlier ones run (tests/unit/test_hostile_cases.py)."""
import importlib.abc, importlib.machinery, os, sys, time


class _Hang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != "qmoe_doctor.probes.conditions":
            return None
        fd = os.open(os.environ["HANG_COUNT_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"x")
        os.close(fd)
        if os.path.getsize(os.environ["HANG_COUNT_FILE"]) < int(os.environ["HANG_FROM_WORKER"]):
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(os.environ["HANG_PID_FILE"], "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        while True:
            time.sleep(60)


sys.meta_path.insert(0, _Hang())
'''


def hang_env(tmp_path: Path, *, from_worker: int) -> dict[str, str]:
    hook = tmp_path / "hang-hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANG_FROM_WORKER)
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p),
        "HANG_COUNT_FILE": str(tmp_path / "hang.count"),
        "HANG_FROM_WORKER": str(from_worker),
        "HANG_PID_FILE": str(tmp_path / "hung.pids"),
    }


@pytest.fixture
def hung_doctor(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[str], str]]]:
    """Start the CLI with its probe workers hung at import from the Nth on; returns it once one
    hangs, and its mark. Every marked process left at the end is killed (the test says why)."""
    marks: list[str] = []

    def start(*args: str, from_worker: int = 1) -> tuple[subprocess.Popen[str], str]:
        mark = uuid.uuid4().hex
        marks.append(mark)
        env = {
            **os.environ,
            **hang_env(tmp_path, from_worker=from_worker),
            "SIGNAL_TEST_MARK": mark,
            "COLUMNS": "200",
        }
        cli = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qmoe_doctor",
                *args,
                "--timeout",
                "600",
                "--log-dir",
                str(tmp_path / "logs"),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=restore_defaults,  # the signals the test sends act, even under nohup
        )
        pids = tmp_path / "hung.pids"
        if not wait_for(lambda: pids.is_file() and pids.read_text().endswith("\n"), 90):
            cli.kill()
            _, err = cli.communicate()
            pytest.fail(f"no probe worker hung at import within 90 s:\n{err[-3000:]}")
        assert any(WORKER_MODULE in cmd for cmd in marked(mark).values())
        return cli, mark

    yield start
    for mark in marks:
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)


SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


@needs_linux
@pytest.mark.parametrize("signum", SIGNALS, ids=[s.name for s in SIGNALS])
def test_a_signalled_check_kills_every_child_and_exits_128_plus_the_signal(
    signum: signal.Signals, hung_doctor: Callable[..., tuple[subprocess.Popen[str], str]]
) -> None:
    cli, mark = hung_doctor("check", "--cpu")
    cli.send_signal(signum)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err
    assert wait_for(lambda: not marked(mark), 5), f"survivors: {marked(mark)}"


@needs_linux
@pytest.mark.skipif(not lifeline.AVAILABLE, reason="no parent-death signal on this OS")
def test_a_check_killed_by_sigkill_leaves_no_probe_worker(
    hung_doctor: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    cli, mark = hung_doctor("check", "--cpu")
    cli.kill()
    cli.communicate(timeout=30)
    assert wait_for(lambda: not any(WORKER_MODULE in c for c in marked(mark).values()), 5), marked(mark)


@needs_linux
def test_a_signalled_check_saves_the_report_so_far(
    tmp_path: Path, hung_doctor: Callable[..., tuple[subprocess.Popen[str], str]]
) -> None:
    """SIGTERM while the second kernel's worker hangs (each kernel's CPU tier starts one): --save
    holds the first kernel's report (complete: false), and stderr says where."""
    target = tmp_path / "partial.json"
    cli, mark = hung_doctor(
        "check",
        "--cpu",
        "-k",
        "builtin",
        "-k",
        "specimen:unmasked_rows",
        "--save",
        str(target),
        from_worker=2,
    )
    cli.send_signal(signal.SIGTERM)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 143, err[-3000:]
    doc = json.loads(target.read_text())
    assert doc["kind"] == "check" and doc["complete"] is False, doc
    assert [k["kernel"] for k in doc["kernels"]] == ["builtin"] and doc["not_run"] == [
        "specimen:unmasked_rows"
    ]
    assert f"complete: false) is in {target}" in flat(err)
    assert wait_for(lambda: not marked(mark), 5), f"survivors: {marked(mark)}"


def test_an_interrupted_scan_saves_the_report_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan's side of the same (a CPU scan is one session, so the interruption is staged):
    the report of the finished sessions is in --save when SIGTERM comes."""
    target = tmp_path / "partial.json"

    def first_session_then_sigterm(plan: Any, *, on_progress: Callable[[Any], None], **kw: Any) -> Any:
        on_progress(replace(one_probe_scan(tmp_path), complete=False, not_run=("GPU 0,1",)))
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(scan_cmd, "run_scan", first_session_then_sigterm)
    result = runner.invoke(app, ["scan", "--cpu", "--save", str(target)])
    assert result.exit_code == 143, result.output
    doc = json.loads(target.read_text())
    assert doc["complete"] is False and doc["not_run"] == ["GPU 0,1"] and len(doc["outcomes"]) == 1
    assert f"complete: false) is in {target}" in flat(result.stderr)




# =================================================================================================
# Contradictions and timeouts: nothing run is never "healthy"; --timeout is the whole budget
# =================================================================================================


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def test_scan_only_a_comma_names_no_condition() -> None:
    assert_refused(runner.invoke(app, ["scan", "--cpu", "--only", ","]), 2, "--only ',' names no condition")


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("value", ["1e400", "inf", "nan", "0.5"])
@pytest.mark.parametrize(
    "command", [["scan", "--cpu"], ["check", "--cpu"], ["bench", "--tiny"]], ids=lambda c: c[0]
)
def test_a_timeout_no_child_could_reach_is_refused(command: list[str], value: str) -> None:
    """--timeout 1e400 reads as infinity: refused (exit 2), not a run that never times out."""
    result = runner.invoke(app, [*command, "--timeout", value])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "--timeout" in result.output


def _not_a_python(tmp_path: Path, kind: str) -> str:
    if kind == "missing":
        return str(tmp_path / "nonexistent" / "python")
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexit 3\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("kind", ["missing", "exits-at-once"])
@pytest.mark.parametrize("command", ["scan", "check"])
def test_a_child_python_that_does_not_start(command: str, kind: str, tmp_path: Path) -> None:
    """Nothing ran: exit 4, the last line does not say healthy, the interpreter named (the
    variable that chose it), Triton's interpreter not blamed."""
    python = _not_a_python(tmp_path, kind)
    clean = tmp_path / "clean.py"
    clean.write_text("X = 1\n")
    extra = ["--kernel", "builtin", "--lint", str(clean)] if command == "check" else []
    proc = doctor(command, "--cpu", *extra, env={knobs.QMOE_CHILD_PYTHON: python}, cwd=tmp_path)
    assert_no_traceback(proc)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    everything = flat(proc.stdout + proc.stderr)
    last = _last_line(proc.stdout + "\n" + proc.stderr) if command == "scan" else _last_line(proc.stdout)
    assert "healthy" not in last.lower() or "not" in last.lower(), last
    assert f"${knobs.QMOE_CHILD_PYTHON}={python}" in everything, everything
    assert "Triton interpreter cannot" not in everything, everything


@pytest.mark.parametrize("hang", ["at-import", "interpreter-never-ready"])
@pytest.mark.timeout(60)  # a hidden start-up allowance (60 s) on top of --timeout fails here
def test_timeout_kills_a_hung_probe_and_names_the_phase(hang: str, tmp_path: Path) -> None:
    if hang == "at-import":
        env = hang_env(tmp_path, from_worker=1)
        phase = "import"
    else:
        sleepy = tmp_path / "python"
        sleepy.write_text("#!/bin/sh\nexec sleep 600\n")
        sleepy.chmod(0o755)
        env, phase = {knobs.QMOE_CHILD_PYTHON: str(sleepy)}, "spawn"
    proc = doctor(
        "scan", "--cpu", "--only", "single", "--timeout", "3", "--json", env=env, cwd=tmp_path, timeout=50
    )
    assert_no_traceback(proc)
    assert proc.returncode == 4, proc.stderr
    doc = json.loads(proc.stdout)
    timed_out = [o for o in doc["outcomes"] if o.get("error_kind") == "timeout"]
    assert timed_out, doc["outcomes"]
    assert all(f"timed out at {phase} after 3 s" in o["error_message"] for o in timed_out), timed_out


# =================================================================================================
# Declared variables: every QMOE_* of core/knobs.py is read and validated
# =================================================================================================


def _result_fd_in_a_worker(value: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmoe_doctor.probes.worker"],
        env={**os.environ, knobs.QMOE_RESULT_FD: value},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _through_repro(value: str) -> Result:
    return runner.invoke(app, ["repro"], env={knobs.QMOE_SANITIZER: value})


# variable -> (the bad values, how the product reads it). A value each reader must refuse in one
# line naming the variable; the readers that run in children say it in the child's output.
BAD_VALUES: dict[str, tuple[tuple[str, ...], Callable[[str], Any]]] = {
    knobs.QMOE_SANITIZER: (
        ("/nonexistent/compute-sanitizer", "/dev", "{tmp}/not-executable"),
        _through_repro,
    ),
    knobs.QMOE_RESULT_FD: (("abc", "²", "9" * 5000), lambda v: knobs.result_fd()),
    knobs.QMOE_RUN_RING: (("abc", "-1", "²", "9" * 5000), lambda v: knobs.run_ring({knobs.QMOE_RUN_RING: v})),
    knobs.QMOE_RUN_CALL_SITES: (("x", "1.5"), lambda v: knobs.run_call_sites({knobs.QMOE_RUN_CALL_SITES: v})),
    knobs.QMOE_RUN_STRICT: (("yes", "true", "2"), lambda v: knobs.run_strict({knobs.QMOE_RUN_STRICT: v})),
    knobs.QMOE_RUN_PRINTS: (("abc", "-1", "9" * 5000), lambda v: knobs.run_prints({knobs.QMOE_RUN_PRINTS: v})),
    knobs.QMOE_LEAN_LAUNCH: (("yes", "false", "2"), lambda v: knobs.lean_launch({knobs.QMOE_LEAN_LAUNCH: v})),
    knobs.QMOE_EP_MICRO_BATCHES: (
        ("abc", "0", "-1", "9" * 5000),
        lambda v: knobs.ep_micro_batches({knobs.QMOE_EP_MICRO_BATCHES: v}),
    ),
    knobs.QMOE_EP_DISPATCH: (("bogus", "[/]"), lambda v: knobs.ep_dispatch({knobs.QMOE_EP_DISPATCH: v})),
    knobs.QMOE_EP_TRANSPORT: (("bogus", "[/]"), lambda v: knobs.ep_transport({knobs.QMOE_EP_TRANSPORT: v})),
}
#: Variables whose every value is usable, and where the doctor checks what it names instead.
CHECKED_ELSEWHERE = {
    knobs.QMOE_CHILD_PYTHON: "test_a_child_python_that_does_not_start (exit 4, the variable named)",
    knobs.QMOE_RUN_DIR: "any folder: qmoe-doctor run creates it and the monitor writes there",
    knobs.QMOE_RUN_HOME: "a folder put on the command's sys.path by the run's bootstrap",
    knobs.QMOE_CONFIG_TABLE: "test_knobs_env: a missing or malformed table is a ConfigTableError naming the variable",
    knobs.QMOE_CACHE_DIR: "test_knobs_env: any folder; the tuner creates it and says where it wrote",
}


def test_every_declared_variable_is_covered() -> None:
    declared = {
        getattr(knobs, n) for n in dir(knobs) if n.startswith("QMOE_") and isinstance(getattr(knobs, n), str)
    }
    assert declared == set(BAD_VALUES) | set(CHECKED_ELSEWHERE), declared ^ (
        set(BAD_VALUES) | set(CHECKED_ELSEWHERE)
    )


CASES_BAD = [(name, value) for name, (values, _) in BAD_VALUES.items() for value in values]


@pytest.mark.parametrize(("name", "value"), CASES_BAD, ids=[f"{n}={v[:12]}" for n, v in CASES_BAD])
def test_a_bad_value_of_a_declared_variable_is_one_line_naming_it(
    name: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")  # mode 0644
    value = value.replace("{tmp}", str(tmp_path))
    monkeypatch.setenv(name, value)
    read = BAD_VALUES[name][1]
    if name == knobs.QMOE_SANITIZER:
        assert_refused(read(value), 2, name)
        return
    with pytest.raises(ValueError) as refused:
        read(value)
    message = str(refused.value)
    assert message.startswith(name) and "\n" not in message and len(message) < 300, message


@pytest.mark.parametrize("value", ["abc", "999"])
def test_a_bad_result_fd_in_a_worker_started_by_hand_is_one_line(value: str) -> None:
    proc = _result_fd_in_a_worker(value)
    assert_no_traceback(proc)
    assert proc.returncode == 2 and knobs.QMOE_RESULT_FD in proc.stderr, proc.stderr


# =================================================================================================
# Litter: logs where the user asked, kept and said on failure, removed otherwise
# =================================================================================================


def _litter(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("qmoe-doctor-"))


@pytest.mark.parametrize("command", ["scan", "check"])
def test_a_healthy_cpu_run_leaves_no_log_folder(command: str, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    clean = tmp_path / "clean.py"
    clean.write_text("X = 1\n")
    extra = ["--kernel", "builtin", "--lint", str(clean)] if command == "check" else []
    proc = doctor(command, "--cpu", "--only", "single", *extra, env={"TMPDIR": str(tmp)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _litter(tmp) == [], _litter(tmp)


def test_a_failed_run_keeps_its_logs_and_says_where(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    env = {knobs.QMOE_CHILD_PYTHON: _not_a_python(tmp_path, "exits-at-once"), "TMPDIR": str(tmp)}
    proc = doctor("scan", "--cpu", "--only", "single", env=env, cwd=tmp_path)
    assert proc.returncode == 4
    (kept,) = _litter(tmp)
    assert str(tmp / kept) in flat(proc.stdout + proc.stderr)
    assert any((tmp / kept).rglob("worker-*.log"))


def test_logs_go_where_the_user_asked(tmp_path: Path) -> None:
    tmp, logs = tmp_path / "tmp", tmp_path / "my-logs"
    proc = doctor(
        "scan", "--cpu", "--only", "single", "--log-dir", str(logs), env={"TMPDIR": str(tmp)}, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any(logs.rglob("worker-*.log")) and _litter(tmp) == []
