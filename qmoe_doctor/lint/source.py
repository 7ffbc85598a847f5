"""Finding, reading and parsing the files to lint. Sources are parsed with :mod:`ast`: never
imported, never executed.

    paths --find_sources--> [Path] (+ LintError for a missing path, LintSkip for a non-source)
    Path --read_source--> Source(path, tree, lines) | LintError | LintSkip
    [Source] --context_sources--> [Source] of the files they import (read, never reported)

Everything read comes through :mod:`qmoe_doctor.core.inputs`: special files are refused before
they are opened (a FIFO named ``x.py`` would block the lint forever, ``/dev/zero`` never ends)
and a source is capped at ``MAX_SOURCE_BYTES``. A source that Python's parser cannot hold
(an expression a thousand levels deep raises RecursionError or MemoryError inside
``ast.parse``), that is not UTF-8 (nor in its declared encoding) or does not parse is a
one-line ``LintError``, never a traceback.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import stat
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qmoe_doctor.core.inputs import InputError, read_bytes
from qmoe_doctor.lint.findings import LintError, LintSkip

#: A kernel source is well under 1 MiB; an AST takes ~100x its source in memory (4 MiB of
#: kernel code: 400 MB, 3 s), so one file is capped well below the 64 MiB of other inputs.
MAX_SOURCE_BYTES = 4 * 2**20

_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    """One parsed file."""

    path: str  # posix form, as reported
    tree: ast.Module
    lines: tuple[str, ...]


# --------------------------------------------------------------------------------------------
# Finding the files
# --------------------------------------------------------------------------------------------


def iter_python_files(
    directory: Path, on_error: Callable[[Path, OSError], None] | None = None
) -> Iterator[Path]:
    """``*.py`` entries under ``directory``, sorted, each folder's files before its subfolders;
    skips hidden folders, caches and virtualenvs, and does not follow links to folders. An
    entry is yielded by name whatever it is (reading decides); a folder that cannot be listed
    goes to ``on_error``. Iterative: a folder tree thousands deep does not exhaust the stack."""
    stack = [directory]
    while stack:
        root = stack.pop()
        try:
            with os.scandir(root) as it:
                entries = list(it)
        except OSError as exc:
            if on_error is not None:
                on_error(root, exc)
            continue
        dirs: list[str] = []
        files: list[str] = []
        for entry in entries:
            try:  # is_dir follows links, as os.walk does to sort names; neither opens anything
                is_dir, is_link = entry.is_dir(), entry.is_symlink()
            except OSError:
                is_dir, is_link = False, False
            if not is_dir:
                files.append(entry.name)
            elif not is_link and not entry.name.startswith(".") and entry.name not in _SKIP_DIRS:
                if not os.path.exists(os.path.join(entry.path, "pyvenv.cfg")):  # a virtualenv
                    dirs.append(entry.name)
        for name in sorted(files):
            if name.endswith(".py"):
                yield root / name
        stack.extend(root / d for d in sorted(dirs, reverse=True))


def _walk(top: Path, errors: list[LintError], skipped: list[LintSkip]) -> list[Path]:
    """The sources under a named folder; that folder unlistable is an error, one below it a skip."""

    def unlistable(folder: Path, exc: OSError) -> None:
        reason = f"cannot list this folder ({exc.strerror or exc})"
        if folder == top:
            errors.append(LintError(path=folder.as_posix(), kind="unreadable", message=reason))
        else:
            skipped.append(LintSkip(path=folder.as_posix(), kind="unlistable", reason=reason))

    return list(iter_python_files(top, unlistable))


def find_sources(paths: Sequence[str]) -> tuple[list[tuple[Path, bool]], list[LintError], list[LintSkip]]:
    """The files to read, each with whether the user named it (a named file that cannot be
    linted is an error; an entry met while walking that is not a source is a skip). A named
    path that does not exist is an error, and so is a named folder that cannot be listed."""
    files: list[tuple[Path, bool]] = []
    errors: list[LintError] = []
    skipped: list[LintSkip] = []
    for raw in paths:
        top = Path(raw)
        if raw == "-":  # standard input, through the same bounded reader as every input
            files.append((top, True))
            continue
        try:
            is_dir = stat.S_ISDIR(top.stat().st_mode)
        except OSError:
            is_dir = False
        if is_dir:
            files.extend((p, False) for p in _walk(top, errors, skipped))
            continue
        try:
            top.lstat()
        except (FileNotFoundError, NotADirectoryError):
            errors.append(LintError(path=raw, kind="missing", message="no such file or directory"))
            continue
        except OSError:
            pass  # e.g. a folder on the way that cannot be searched: reading names the reason
        files.append((top, True))
    return files, errors, skipped


# --------------------------------------------------------------------------------------------
# Reading and parsing
# --------------------------------------------------------------------------------------------

_NotASource = tuple[Literal["special-file", "broken-link"], str]


def _not_a_source(path: Path) -> _NotASource | None:
    """``(kind, reason)`` when ``path`` is not a regular file to read; stat only, never opens."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        try:
            is_link = path.is_symlink()
        except OSError:
            is_link = False
        if not is_link:
            return None  # vanished or no permission: reading says which
        if isinstance(exc, FileNotFoundError):
            try:
                return "broken-link", f"a symbolic link to {os.readlink(path)!r}, which does not exist"
            except OSError:
                pass  # removed meanwhile
        return "broken-link", f"a symbolic link that cannot be followed ({exc.strerror or exc})"
    for test, what in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return "special-file", f"{what}, not a source file"
    return None


def read_source(path: Path, *, named: bool) -> Source | LintError | LintSkip:
    """Read and parse one file. An entry met while walking a folder that is not a regular file
    (``named`` false) is a skip; everything else that cannot be linted is an error."""
    name = path.as_posix()
    if name == "-":
        name = "<stdin>"
    odd = _not_a_source(path) if name != "<stdin>" else None
    if odd is not None:
        kind, reason = odd
        if not named:
            return LintSkip(path=name, kind=kind, reason=reason)
        return LintError(path=name, kind="missing" if kind == "broken-link" else "unreadable", message=reason)
    try:
        data = read_bytes(path, limit=MAX_SOURCE_BYTES, gunzip=False)
    except InputError as exc:
        message = str(exc).removeprefix(f"{path}: ")  # the report puts the path in front
        if message.startswith("larger than"):
            message = f"larger than {MAX_SOURCE_BYTES // 2**20} MiB, the most the lint reads of one source"
        return LintError(path=name, kind="unreadable", message=message)
    return parse_source(name, data)


def parse_source(path: str, data: bytes) -> Source | LintError:
    """Decode (PEP 263 coding line, BOM) and parse ``data``; an error names what is wrong."""
    try:
        text = importlib.util.decode_source(data)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        return LintError(path=path, kind="unreadable", message=f"cannot decode: {_decode_problem(data, exc)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like
            tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        return LintError(
            path=path,
            kind="syntax",
            message=f"syntax error: {_one_line(exc.msg)}",
            line=exc.lineno,
            col=exc.offset,
            source=_clip(_one_line((exc.text or "").strip())),
        )
    except (RecursionError, MemoryError):
        # CPython's parser gives up on ~1000 levels of `1+1+...` (RecursionError "during ast
        # construction") and on ~100k unary operators or `**` (MemoryError, its own stack).
        return LintError(
            path=path,
            kind="syntax",
            message="cannot parse: an expression is nested too deeply for Python's parser",
        )
    except ValueError as exc:  # e.g. source with null bytes
        return LintError(path=path, kind="syntax", message=f"cannot parse: {_one_line(exc)}")
    return Source(path=path, tree=tree, lines=tuple(text.splitlines()))


def _one_line(what: object) -> str:
    return " ".join(str(what).split())


def _clip(line: str, width: int = 120) -> str:
    """A source line for a message: 5,000 parentheses are not worth printing."""
    return line if len(line) <= width else line[: width - 3] + "..."


def _decode_problem(data: bytes, exc: Exception) -> str:
    """Why the bytes are not text (PEP 263: UTF-8 unless a coding line names another encoding),
    with the first bad byte and its line."""
    if isinstance(exc, UnicodeDecodeError):
        bad, where = exc.object[exc.start], exc.object.count(b"\n", 0, exc.start) + 1
        return f"not {exc.encoding} text as its coding line says (byte 0x{bad:02x} on line {where})"
    problem = _one_line(exc)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as not_utf8:
        where = data.count(b"\n", 0, not_utf8.start) + 1
        return f"{problem} (not UTF-8: byte 0x{data[not_utf8.start]:02x} on line {where})"
    return problem


# --------------------------------------------------------------------------------------------
# Context: the files the linted ones import
# --------------------------------------------------------------------------------------------

_MAX_CONTEXT_FILES = 64  # bounds the reading of imported files that were not asked for
_EXTERNAL_ROOTS = frozenset({"torch", "triton", "numpy", "typer", "rich", "pytest", "__future__"})
_STDLIB: frozenset[str] = frozenset(getattr(sys, "stdlib_module_names", ()))


def _import_candidates(path: Path, nodes: Iterable[ast.AST]) -> Iterator[Path]:
    """Files that the imports of ``path`` may name, found next to it or in its parent folders:
    ``from .grouped_gemm import f`` or ``from pkg.kernels.grouped_gemm import f``."""
    here = path.parent
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
            if node.module is None or node.level:
                modules += [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]
            level = node.level
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
            level = 0
        else:
            continue
        for module in modules:
            parts = [p for p in module.split(".") if p]
            if not parts or (not level and (parts[0] in _EXTERNAL_ROOTS or parts[0] in _STDLIB)):
                continue
            if level:
                base = here
                for _ in range(level - 1):
                    base = base.parent
                yield base.joinpath(*parts).with_suffix(".py")
                continue
            base = here
            for _ in range(4):  # the package root is a few folders up at most
                for k in range(len(parts), 0, -1):
                    yield base.joinpath(*parts[-k:]).with_suffix(".py")
                if base.parent == base:
                    break
                base = base.parent


def context_sources(importers: Iterable[tuple[str, Iterable[ast.AST]]], linted: set[str]) -> list[Source]:
    """Parse (never import) the files that the linted ones import from, given as ``(path,
    nodes)``, that were not linted themselves, so a launch helper or kernel defined there is
    recognised. Whatever cannot be read or parsed there is passed over in silence: those files
    were not asked for."""
    out: list[Source] = []
    seen = set(linted)
    for path, nodes in importers:
        for cand in _import_candidates(Path(path), nodes):
            name = cand.as_posix()
            if name in seen or not os.path.isfile(cand):  # a regular file (stat, no open; no raise)
                continue
            seen.add(name)
            parsed = read_source(cand, named=False)
            if isinstance(parsed, Source):
                out.append(parsed)
            if len(out) >= _MAX_CONTEXT_FILES:
                return out
    return out


__all__ = [
    "MAX_SOURCE_BYTES",
    "Source",
    "context_sources",
    "find_sources",
    "iter_python_files",
    "parse_source",
    "read_source",
]
