"""`qmoe-doctor lint` on hostile input: special files, broken links, unreadable, oversized,
undecodable and pathologically deep sources. Each is a one-line reason, never a hang, a
traceback or unbounded memory: a path the user named that cannot be linted is an error (exit
2); an entry met while walking a folder that is not a source is skipped with its reason.

Tests that could block on a FIFO carry a timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core import inputs
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.lint import (
    MAX_KERNEL_NESTING,
    MAX_SOURCE_BYTES,
    LintError,
    LintReport,
    Rule,
    iter_python_files,
    lint_paths,
    lint_source,
)
from qmoe_doctor.lint.nodes import deepest

T = TypeVar("T")

HEADER = "import torch\nimport triton\nimport triton.language as tl\n"
# One finding of each of two rules: an int32 offset in the kernel, an unguarded launch.
FAULTY = HEADER + textwrap.dedent(
    """
    @triton.jit
    def scale_kernel(x_ptr, stride_xm):
        row = tl.program_id(0)
        tl.load(x_ptr + row * stride_xm)

    def scale(x):
        scale_kernel[(1,)](x, x.stride(0))
    """
)


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["lint", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def _one_error(report: LintReport, path: Path) -> LintError:
    (error,) = report.errors
    assert error.path == path.as_posix()
    assert "\n" not in error.as_line() and "\n" not in error.source
    assert report.findings == () and report.files == ()
    return error


def _assert_cli_error(path: Path, *words: str) -> None:
    """The command exits 2 with one `error: PATH...: reason` line and no traceback."""
    code, _, err = _cli("--plain", str(path))
    assert code == ExitCode.USAGE, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path.as_posix()}"), err
    for word in words:
        assert word in lines[0], err


def _at_stack_depth(frames: int, call: Callable[[], T]) -> T:
    """Run ``call`` with ``frames`` more frames on the stack (a caller deep in its own work)."""
    if frames <= 0:
        return call()
    return _at_stack_depth(frames - 1, call)


def _depth_now() -> int:
    frame, n = sys._getframe(), 0
    while frame is not None:
        frame, n = frame.f_back, n + 1
    return n


@pytest.fixture
def walked(tmp_path: Path) -> Path:
    """A folder with one real source (two findings) to lint next to whatever a test adds."""
    (tmp_path / "ops.py").write_text(FAULTY)
    return tmp_path


def _assert_rest_linted(report: LintReport, root: Path) -> None:
    assert report.files == ((root / "ops.py").as_posix(),)
    assert sorted(f.rule for f in report.findings) == sorted([Rule.INT32_OFFSET, Rule.UNGUARDED_LAUNCH])
    assert report.errors == ()


# --------------------------------------------------------------------------- special files


@pytest.mark.timeout(30)
def test_fifo_in_a_walked_folder_is_skipped_not_opened(walked: Path) -> None:
    os.mkfifo(walked / "x.py")  # opening it for reading would block until a writer comes
    report = lint_paths([walked])
    _assert_rest_linted(report, walked)
    (skip,) = report.skipped
    assert (skip.path, skip.kind) == ((walked / "x.py").as_posix(), "special-file")
    assert "FIFO" in skip.reason and "\n" not in skip.as_line()
    code, out, _ = _cli("--json", str(walked))
    assert code == ExitCode.FAULT  # the findings of ops.py; the FIFO is no error
    assert json.loads(out)["skipped"] == [
        {"path": (walked / "x.py").as_posix(), "kind": "special-file", "reason": skip.reason}
    ]


@pytest.mark.timeout(30)
def test_fifo_named_directly_is_an_error(tmp_path: Path) -> None:
    fifo = tmp_path / "x.py"
    os.mkfifo(fifo)
    error = _one_error(lint_paths([fifo]), fifo)
    assert error.kind == "unreadable" and "FIFO" in error.message
    _assert_cli_error(fifo, "FIFO")


@pytest.mark.timeout(30)
def test_fifo_imported_by_a_linted_file_is_not_read_for_context(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    os.mkfifo(tmp_path / "pkg" / "kernels.py")
    (tmp_path / "pkg" / "ops.py").write_text("from .kernels import scale_kernel\n")
    report = lint_paths([tmp_path / "pkg" / "ops.py"])
    assert report.clean and report.files == ((tmp_path / "pkg" / "ops.py").as_posix(),)


@pytest.mark.timeout(30)
def test_device_file_never_read(walked: Path) -> None:
    (walked / "zero.py").symlink_to("/dev/zero")  # never ends: reading it would fill memory
    report = lint_paths([walked])
    _assert_rest_linted(report, walked)
    (skip,) = report.skipped
    assert skip.kind == "special-file" and "character device" in skip.reason
    for named in (Path("/dev/zero"), walked / "zero.py"):
        error = _one_error(lint_paths([named]), named)
        assert error.kind == "unreadable" and "character device" in error.message
    _assert_cli_error(Path("/dev/zero"), "character device")


@pytest.mark.timeout(30)
def test_socket_is_skipped_or_refused(walked: Path) -> None:
    path = walked / "s.py"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        report = lint_paths([walked])
        _assert_rest_linted(report, walked)
        (skip,) = report.skipped
        assert skip.kind == "special-file" and "socket" in skip.reason
        error = _one_error(lint_paths([path]), path)
        assert error.kind == "unreadable" and "socket" in error.message
        _assert_cli_error(path, "socket")


# --------------------------------------------------------------------------- links, permissions


def test_dangling_and_looping_links(walked: Path) -> None:
    (walked / "dangling.py").symlink_to("nowhere.py")
    (walked / "loop.py").symlink_to("loop.py")
    report = lint_paths([walked])
    _assert_rest_linted(report, walked)
    assert [(Path(s.path).name, s.kind) for s in report.skipped] == [
        ("dangling.py", "broken-link"),
        ("loop.py", "broken-link"),
    ]
    assert "'nowhere.py', which does not exist" in report.skipped[0].reason
    dangling = _one_error(lint_paths([walked / "dangling.py"]), walked / "dangling.py")
    assert dangling.kind == "missing" and "nowhere.py" in dangling.message
    loop = _one_error(lint_paths([walked / "loop.py"]), walked / "loop.py")
    assert loop.kind == "missing" and "cannot be followed" in loop.message
    _assert_cli_error(walked / "dangling.py", "symbolic link")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_by_mode(walked: Path) -> None:
    locked = walked / "locked.py"
    locked.write_text("x = 1\n")
    locked.chmod(0)
    try:
        report = lint_paths([walked])
        (error,) = report.errors
        assert (error.path, error.kind) == (locked.as_posix(), "unreadable")
        assert "permission denied" in error.message.lower()
        assert {f.rule for f in report.findings} == {Rule.INT32_OFFSET, Rule.UNGUARDED_LAUNCH}
        _assert_cli_error(locked, "ermission denied")
    finally:
        locked.chmod(0o644)


def test_unreadable_file_is_an_error_and_the_rest_is_linted(
    walked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same as by mode, for any user: the bounded reader's open fails with EACCES."""
    locked = walked / "locked.py"
    locked.write_text("x = 1\n")

    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(str(path)).name == "locked.py":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    # the reader opens with os.open (O_NONBLOCK: a FIFO swapped in after the stat cannot block)
    monkeypatch.setattr(inputs.os, "open", refusing_open)
    report = lint_paths([walked])
    (error,) = report.errors
    assert (error.path, error.kind) == (locked.as_posix(), "unreadable")
    assert error.as_line() == f"{locked.as_posix()}: cannot read (Permission denied)"
    assert {f.rule for f in report.findings} == {Rule.INT32_OFFSET, Rule.UNGUARDED_LAUNCH}
    _assert_cli_error(locked, "Permission denied")


def test_folder_that_cannot_be_listed(walked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (walked / "sub").mkdir()
    (walked / "sub" / "hidden_away.py").write_text(FAULTY)
    real_scandir = os.scandir

    def scandir(path: str | os.PathLike[str]) -> object:
        if Path(path).name in ("sub", "top"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    report = lint_paths([walked])
    _assert_rest_linted(report, walked)
    (skip,) = report.skipped
    assert (skip.path, skip.kind) == ((walked / "sub").as_posix(), "unlistable")
    (walked / "top").mkdir()
    error = _one_error(lint_paths([walked / "top"]), walked / "top")
    assert error.kind == "unreadable" and "cannot list this folder (Permission denied)" in error.message


def test_folder_tree_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    levels = [tmp_path / "a"]
    for _ in range(sys.getrecursionlimit() + 100):  # os.walk recursed once per level
        levels.append(levels[-1] / "a")
    try:
        for level in levels:
            level.mkdir()
        (levels[-1] / "ops.py").write_text(FAULTY)
        assert list(iter_python_files(tmp_path)) == [levels[-1] / "ops.py"]
        report = lint_paths([tmp_path])
        assert len(report.findings) == 2 and report.errors == ()
    finally:  # bottom up: shutil.rmtree (and so pytest's own clean-up) recurses once per level
        (levels[-1] / "ops.py").unlink(missing_ok=True)
        for level in reversed(levels):
            if level.exists():
                level.rmdir()


# --------------------------------------------------------------------------- content


def test_source_larger_than_the_cap(tmp_path: Path) -> None:
    big = tmp_path / "big.py"
    big.write_bytes(b"x = 1\n" * (MAX_SOURCE_BYTES // 6 + 1))
    error = _one_error(lint_paths([big]), big)
    assert error.kind == "unreadable" and f"larger than {MAX_SOURCE_BYTES // 2**20} MiB" in error.message
    _assert_cli_error(big, "larger than")


@pytest.mark.parametrize(
    ("edge", "data", "words"),
    [
        ("latin-1 without a coding line", b'x = "caf\xe9"\n', ["not UTF-8: byte 0xe9 on line 1"]),
        (
            "bytes the declared encoding refuses",
            b'# -*- coding: ascii -*-\nx = "caf\xc3\xa9"\n',
            ["not ascii text", "byte 0xc3 on line 2"],
        ),
        (
            "an unknown declared encoding",
            b"# -*- coding: klingon -*-\nx = 1\n",
            ["unknown encoding: klingon"],
        ),
    ],
)
def test_undecodable_source(tmp_path: Path, edge: str, data: bytes, words: list[str]) -> None:
    path = tmp_path / "enc.py"
    path.write_bytes(data)
    error = _one_error(lint_paths([path]), path)
    assert error.kind == "unreadable" and error.message.startswith("cannot decode: ")
    for word in words:
        assert word in error.message, edge
    _assert_cli_error(path, "cannot decode", *words)


def test_declared_encoding_is_honoured(tmp_path: Path) -> None:
    path = tmp_path / "latin.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\n" + FAULTY.encode() + b'NAME = "caf\xe9"\n')
    report = lint_paths([path])
    assert report.errors == () and len(report.findings) == 2


# Sources that CPython's own parser cannot hold, each a different way it gives up.
UNPARSABLE = [
    ("5,000 nested parentheses (tokenizer limit)", "x = " + "(" * 5000 + "1" + ")" * 5000, "syntax error"),
    ("1+1+... of 100k terms (RecursionError)", "x = " + "+".join(["1"] * 100_000), "nested too deeply"),
    ("a.b.b... of 5k attributes (RecursionError)", "x = a" + ".b" * 5000, "nested too deeply"),
    ("100k unary minus (MemoryError)", "x = " + "-" * 100_000 + "1", "nested too deeply"),
    ("100k not (MemoryError)", "x = " + "not " * 100_000 + "1", "nested too deeply"),
    ("a null byte", "x = 1\0\n", "null bytes"),
]


@pytest.mark.parametrize(("edge", "source", "word"), UNPARSABLE, ids=[c[0] for c in UNPARSABLE])
def test_source_the_parser_cannot_hold(tmp_path: Path, edge: str, source: str, word: str) -> None:
    path = tmp_path / "deep.py"
    path.write_text(source + "\n")
    error = _one_error(lint_paths([path]), path)
    assert error.kind == "syntax" and word in error.message, edge
    assert len(error.as_line()) < 300 and len(error.source) <= 120  # one readable line
    with pytest.raises(SyntaxError):
        lint_source(source)
    _assert_cli_error(path, word)


def _kernel(offset_expr: str) -> str:
    return HEADER + (
        "@triton.jit\n"
        "def deep_kernel(x_ptr, stride_xm):\n"
        "    pid = tl.program_id(0)\n"
        f"    offs = {offset_expr}\n"
        "    tl.store(x_ptr + offs, 1)\n"
    )


def _nested_loads(levels: int) -> str:
    # Nested calls are the costliest per level for the int32 data flow (two frames a level).
    return "tl.load(" * levels + "pid * stride_xm" + ")" * levels


def test_kernel_deeper_than_the_rules_walk_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "deep_kernel.py"
    path.write_text(_kernel(" + ".join(["pid * stride_xm"] * 400)))
    error = _one_error(lint_paths([path]), path)
    assert error.kind == "syntax" and error.line == 5
    assert (
        f"`deep_kernel` is nested 404 levels deep; the lint analyses kernels up to {MAX_KERNEL_NESTING}"
        in (error.message)
    )
    _assert_cli_error(path, "deep_kernel")


def test_deep_code_outside_kernels_is_linted_as_before(tmp_path: Path) -> None:
    """Only kernels are walked recursively: a deep table elsewhere (sympy has some) is fine,
    and a deep node in a message is printed to a fixed depth."""
    path = tmp_path / "table.py"
    deep_sum = " + ".join(["1"] * 700)
    path.write_text(
        FAULTY
        + f"TABLE = {deep_sum}\n\ndef wrap(x: torch.Tensor):\n    return torch.empty({deep_sum}, device='cuda')\n"
    )
    report = lint_paths([path])
    assert report.errors == () and report.files == (path.as_posix(),)
    (alloc,) = [f for f in report.findings if f.rule is Rule.DEFAULT_DEVICE_ALLOC]
    assert alloc.message.startswith("`torch.empty(... + 1 + 1 + 1 + ")  # cut at SHOWN_LEVELS


def _kernel_depth(source: str) -> int:
    (func,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)]
    return deepest(func)[0]


def test_deepest_kernel_accepted_leaves_room_for_the_caller() -> None:
    """MAX_KERNEL_NESTING is low enough that the worst kernel it accepts is analysed with a few
    hundred frames of the caller's own on the stack (the CLI needs a few dozen)."""
    levels = 1
    while _kernel_depth(_kernel(_nested_loads(levels + 1))) <= MAX_KERNEL_NESTING:
        levels += 1  # the deepest nest of loads under the cap
    source = _kernel(_nested_loads(levels))
    assert _kernel_depth(source) == MAX_KERNEL_NESTING
    found = _at_stack_depth(300, lambda: lint_source(source))
    assert [f.rule for f in found] == [Rule.INT32_OFFSET]


def test_a_file_that_exhausts_the_stack_is_set_aside_and_the_rest_linted(tmp_path: Path) -> None:
    """The backstop: called with little stack left, the deepest file becomes an error and the
    others are linted as they would be alone."""
    deep = tmp_path / "deep.py"
    deep.write_text(_kernel(_nested_loads(140)))
    ops = tmp_path / "ops.py"
    ops.write_text(FAULTY)
    alone = lint_paths([ops])
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(_depth_now() + 250)  # enough for ops.py, not for 140 nested loads
    try:
        report = lint_paths([deep, ops])
    finally:
        sys.setrecursionlimit(limit)
    (error,) = report.errors
    assert (error.path, error.kind) == (deep.as_posix(), "syntax")
    assert "too deep for the lint to analyse" in error.message
    assert report.files == (ops.as_posix(),) and report.findings == alone.findings


# --------------------------------------------------------------------------- property

_PIECES = st.sampled_from(
    [
        "(", ")", "[", "]", "{", "}", ":", ",", ".", " ", "\n", "    ", "+", "*", "-", "not ",
        "=", "x", "tl", "triton", "torch", "@triton.jit\n", "def k(x_ptr, stride_xm):\n",
        "tl.program_id(0)", "tl.load(", "kernel[grid](", "with torch.cuda.device(x):\n",
        "torch.empty(4, device='cuda')", "\\", "'", '"', "#", "\x00", "\xe9", "lambda: ", "if ",
    ]
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_PIECES, max_size=80).map("".join))
def test_any_text_gives_findings_or_a_syntax_error(source: str) -> None:
    """Whatever the text: a tuple of findings, or SyntaxError with a one-line reason."""
    try:
        found = lint_source(source)
    except SyntaxError as exc:
        assert "\n" not in str(exc.msg)
    else:
        assert all(f.line >= 1 and "\n" not in f.message for f in found)
