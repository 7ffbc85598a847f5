"""One output sink: results to stdout, progress and logs to stderr. Commands never print.

Markup is off on both consoles. Every string that did not come from our own code (a ``--gpus``
value, a kernel path or module name, an exception's message, a child's output) may hold text rich
would read as markup, and ``[/]`` in it raised ``rich.errors.MarkupError`` mid-report. Our own
styling goes through ``Text`` and ``style=``, never markup in a string. The same strings may hold
terminal control sequences (a sanitizer log with ``\x1b]0;...\x07`` sets the terminal's title,
``\x1b[2J`` clears it): both consoles print every control character of the text they are given
escaped (``\x1b``), newlines and tabs kept; rich's own styling is not text and is untouched.

``--json`` writes the versioned document (``qmoe_doctor.reports.json``) to stdout; ``--save FILE``
writes the same document to a file. Every output path is checked before any work starts
(:func:`check_output_file`, :func:`check_output_dir`), and a write that still fails at the end (a
full disk) lands in a fallback file whose path is said (:func:`save_text`): nothing computed is lost.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.segment import Segment
from rich.text import Text

from qmoe_doctor.core.inputs import os_problem, shown_path
from qmoe_doctor.reports.json import dumps, json_document, write_atomic

#: Control characters a terminal acts on (C0 but newline and tab, DEL, C1): printed escaped.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    """``text`` with every control character a terminal would act on written as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class SafeConsole(Console):
    """A console that never lets text it prints drive the terminal: control characters in the
    text (not in rich's own styling, which it emits apart as styles and control segments) are
    escaped where the buffer is rendered, so every renderer is covered, tables and panels too."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            Segment(escape_controls(text), style, control)
            if control is None and _CONTROL.search(text)
            else Segment(text, style, control)
            for text, style, control in buffer
        )


def stdout_console() -> Console:
    """Results. Created per call so tests (CliRunner) capture the swapped sys.stdout."""
    return SafeConsole(file=sys.stdout, highlight=False, soft_wrap=False, markup=False, emoji=False)


def stderr_console() -> Console:
    """Progress, warnings and logs."""
    return SafeConsole(file=sys.stderr, highlight=False, markup=False, emoji=False)


#: How much of a value the user gave a message quotes back (a 100 kB --preset is not echoed).
QUOTE_CHARS = 80
#: The longest one-line message (an exception's text can be a whole log).
MESSAGE_CHARS = 2000


def quoted(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` for a message, clipped to about ``limit`` characters with the length said."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(str(value))} characters)"


def _one_line(message: str) -> str:
    flat = " ".join(message.split())
    return flat if len(flat) <= MESSAGE_CHARS else f"{flat[:MESSAGE_CHARS]}... ({len(flat)} characters)"


#: Widest a table is printed to a pipe (a log line longer than this is a table gone wrong).
PIPE_MAX_WIDTH = 400


def print_table(console: Console, table: RenderableType, *, max_width: int = PIPE_MAX_WIDTH) -> None:
    """``console.print(table)``, at the table's natural width when the console is not a terminal:
    off a terminal (a pipe, a CI log) rich assumes 80 columns and cut whatever did not fit to "…"
    (every number of the bench table, the code of a lint finding's fix). ``max_width`` caps it
    there: a table of prose wraps its prose to fit (its code columns fold, never cut). Every
    renderer prints its tables through here; on a terminal the table fits the window."""
    if console.is_terminal:
        console.print(table)
        return
    natural = console.measure(table, options=console.options.update(width=max_width)).maximum
    before = console.width  # print(width=) cannot go past the console's own width
    console.width = max(before, natural)
    try:
        console.print(table, crop=False)
    finally:
        console.width = before


def error(message: str) -> None:
    """One line on stderr: ``error: MESSAGE`` (folded to one line, clipped, controls escaped)."""
    stderr_console().print(Text.assemble(("error: ", "bold red"), (_one_line(message), "red")), soft_wrap=True)


def warning(message: str) -> None:
    stderr_console().print(Text.assemble(("warning: ", "bold yellow"), (message, "yellow")), soft_wrap=True)


def note(message: str, style: str = "yellow") -> None:
    """Progress-side information on stderr (what runs where, what was left out)."""
    stderr_console().print(Text(message, style=style), soft_wrap=True)


def emit_document(doc: dict[str, Any]) -> None:
    """Write one JSON document to stdout."""
    sys.stdout.write(dumps(doc))
    sys.stdout.flush()


def emit_json(kind: str, payload: Any) -> None:
    """Write one versioned JSON document (``schema_version``, ``kind``) to stdout."""
    emit_document(json_document(kind, payload))


# ---------------------------------------------------------------------------------------------
# Output paths: checked before any work, written whole, never lost
# ---------------------------------------------------------------------------------------------


class OutputPathError(ValueError):
    """An output path the run could not write: one line naming the option and the path."""


def _probe_write(folder: Path, option: str, path: Path) -> None:
    """Create and remove a file in ``folder``: what a read-only file system, a missing
    permission or a quota says now rather than after the run."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".qmoe-doctor-", suffix=".probe", dir=folder)
    except OSError as exc:
        raise OutputPathError(
            f"{option} {shown_path(path)}: cannot write in {shown_path(folder)} ({os_problem(exc)})"
        ) from None
    os.close(fd)
    Path(probe).unlink(missing_ok=True)


def check_output_file(path: Path, *, option: str) -> Path:
    """Refuse, before any work starts, a file the run could not write at its end: a folder, a
    device (``/dev/full``), FIFO or socket, a missing or read-only folder. Returns ``path``."""
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    except OSError as exc:  # a name too long, a symbolic link loop, no permission on the way
        raise OutputPathError(f"{option} {shown_path(path)}: cannot use it ({os_problem(exc)})") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputPathError(
                f"{option} {shown_path(path)}: is a folder; give a file name, e.g. {shown_path(path / 'report.json')}"
            )
        if not stat.S_ISREG(st.st_mode):
            raise OutputPathError(
                f"{option} {shown_path(path)}: is not a regular file (a device, FIFO or socket); give a file name"
            )
        if not os.access(path, os.W_OK):
            raise OutputPathError(f"{option} {shown_path(path)}: the file is not writable")
    folder = path.parent
    if not folder.exists():
        raise OutputPathError(f"{option} {shown_path(path)}: the folder {shown_path(folder)} does not exist")
    if not folder.is_dir():
        raise OutputPathError(f"{option} {shown_path(path)}: {shown_path(folder)} is not a folder")
    # the report is written beside it first (path.tmp) and renamed: the folder must take a file
    _probe_write(folder, option, path)
    return path


def check_output_dir(path: Path, *, option: str) -> Path:
    """Refuse, before any work starts, a folder the run could not create or write in: an
    existing file, a file on the way, a read-only parent. Creates nothing. Returns ``path``."""
    existing = path
    try:
        while not existing.exists():
            if existing.parent == existing:
                break
            existing = existing.parent
        is_file = existing.exists() and not existing.is_dir()
    except OSError as exc:  # a name too long, a symbolic link loop
        raise OutputPathError(f"{option} {shown_path(path)}: cannot use it ({os_problem(exc)})") from None
    if is_file:
        where = "" if existing == path else f" ({shown_path(existing)} is a file)"
        raise OutputPathError(f"{option} {shown_path(path)}: is a file, not a folder{where}")
    _probe_write(existing, option, path)
    return path


def check_outputs(
    *, files: Mapping[str, Path | None] | None = None, dirs: Mapping[str, Path | None] | None = None
) -> None:
    """Every output path a command was given, option -> path (None: not given), checked before
    any work starts: ``files`` are written at the end, ``dirs`` are folders the run writes in.
    Two file options naming one file are refused: the second report would overwrite the first."""
    seen: dict[str, str] = {}
    for option, path in (files or {}).items():
        if path is not None:
            check_output_file(path, option=option)
            same = seen.setdefault(os.path.realpath(path), option)
            if same != option:
                raise OutputPathError(f"{same} and {option} name the same file {path}; give each its own")
    for option, path in (dirs or {}).items():
        if path is not None:
            check_output_dir(path, option=option)


def save_text(path: Path, text: str, *, what: str, fallback_dir: Path | None = None) -> Path:
    """Write ``text`` to ``path`` whole (a temp file and a rename). If that fails now (a full
    disk, a folder removed during the run), write it to ``fallback_dir`` (the run's log folder)
    or the temp folder, say where on stderr, and return that path: nothing computed is lost."""
    try:
        write_atomic(path, text)
        return path
    except OSError as exc:
        failure = exc
    folders = [f for f in (fallback_dir, Path(tempfile.gettempdir())) if f is not None]
    for folder in folders:
        spare = folder / f"{path.stem}.unsaved{path.suffix}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(spare, text)
        except OSError:
            continue
        warning(f"could not write {what} to {path} ({failure.strerror or failure}); it is in {spare}")
        return spare
    raise OutputPathError(
        f"could not write {what} to {path} ({failure.strerror or failure}), nor to "
        + ", ".join(str(f) for f in folders)
    )


def save_document(path: Path, doc: dict[str, Any], *, fallback_dir: Path | None = None) -> Path:
    """Write a JSON document (``--save``) whole; see :func:`save_text`."""
    return save_text(path, dumps(doc), what="the JSON report", fallback_dir=fallback_dir)


def deliver(
    doc: dict[str, Any],
    render: Callable[[Console], None],
    *,
    json_out: bool,
    save: Path | None,
    log_dir: str | Path | None = None,
) -> None:
    """A command's result, the one way: the JSON document to ``--save`` (whole, or to a spare
    file in the log folder when the write fails at the end), then either the document on stdout
    (``--json``) or the rendering."""
    if save is not None:
        save_document(save, doc, fallback_dir=Path(log_dir) if log_dir else None)
    if json_out:
        emit_document(doc)
    else:
        render(stdout_console())


__all__ = [
    "MESSAGE_CHARS",
    "QUOTE_CHARS",
    "OutputPathError",
    "SafeConsole",
    "check_output_dir",
    "check_output_file",
    "check_outputs",
    "deliver",
    "emit_document",
    "emit_json",
    "error",
    "escape_controls",
    "note",
    "quoted",
    "save_document",
    "save_text",
    "stderr_console",
    "stdout_console",
    "warning",
]
