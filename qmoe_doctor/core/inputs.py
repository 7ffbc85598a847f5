"""One bounded reader for every input the doctor reads: logs, tracebacks, configs, kernel sources.

Every read is capped, whatever the input is: a regular file, a gzip (the cap applies to the
*decompressed* size, read in chunks), standard input (``-``), or something else. Special files
are refused before a byte is read: a FIFO or a terminal would block forever, a character device
such as ``/dev/zero`` never ends, a directory is not a file. Every refusal is an ``InputError``
whose message names the path and what is wrong, in one line, for the CLI to print with exit 2.

Stdlib only (both sides may import it).
"""

from __future__ import annotations

import os
import stat
import sys
import zlib
from pathlib import Path
from typing import BinaryIO

#: Default cap. A compute-sanitizer log of 3,000 records is ~3 MB; a kernel source is < 1 MB.
MAX_INPUT_BYTES = 64 * 2**20
_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"


class InputError(ValueError):
    """An input the doctor will not read, with a one-line reason naming it."""


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


#: How much of a path a message quotes (a 100,000-character path is not echoed whole).
PATH_CHARS = 200


def shown_path(path: str | os.PathLike[str]) -> str:
    """``path`` as a message shows it: whole up to PATH_CHARS characters, else its start, an
    ellipsis and its length."""
    text = os.fspath(path)
    if len(text) <= PATH_CHARS:
        return str(text)
    return f"{str(text)[:PATH_CHARS]}... ({len(text)} characters)"


def os_problem(exc: OSError) -> str:
    """What an OSError on a path means, in words: ``File name too long``, ``Too many levels of
    symbolic links`` (a loop), ``Read-only file system``."""
    return exc.strerror or type(exc).__name__


def check_regular_file(path: str | os.PathLike[str]) -> os.stat_result:
    """Stat ``path`` and refuse anything but a regular file (never opens it, so never blocks).
    A symbolic link loop or a name too long is said as such, never as a missing file."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InputError(f"{shown_path(p)}: no such file") from None
    except PermissionError:
        raise InputError(f"{shown_path(p)}: permission denied") from None
    except OSError as exc:
        raise InputError(f"{shown_path(p)}: cannot read ({os_problem(exc)})") from None
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        raise InputError(f"{shown_path(p)}: is a directory, not a file")
    if stat.S_ISFIFO(mode):
        raise InputError(f"{shown_path(p)}: is a FIFO (named pipe); save its content to a file first")
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        raise InputError(f"{shown_path(p)}: is a device file, not a saved log or source")
    if stat.S_ISSOCK(mode):
        raise InputError(f"{shown_path(p)}: is a socket, not a file")
    if not stat.S_ISREG(mode):
        raise InputError(f"{shown_path(p)}: is not a regular file")
    return st


def _read_capped(fh: BinaryIO, limit: int, name: str) -> bytes:
    """Read at most ``limit`` bytes; an input with more is refused (never silently cut)."""
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = fh.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise InputError(f"{name}: larger than {_mib(limit)}; pass a shorter excerpt")


def _gunzip_capped(data: bytes, limit: int, name: str) -> bytes:
    """Decompress a gzip (several members allowed) in chunks, refusing more than ``limit``
    bytes of output: an 18 MB gzip of zeros must not become 8 GB in memory."""
    out: list[bytes] = []
    total = 0
    rest = data
    try:
        while rest:
            d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            pending = rest
            while pending and not d.eof:
                piece = d.decompress(pending, limit + 1 - total)
                total += len(piece)
                out.append(piece)
                if total > limit:
                    raise InputError(f"{name}: decompresses to more than {_mib(limit)}; pass a shorter excerpt")
                pending = d.unconsumed_tail
                if not piece and not pending:
                    break
            if not d.eof:
                raise InputError(f"{name}: truncated gzip (the stream ends early)")
            rest = d.unused_data.lstrip(b"\0")
            if rest and not rest.startswith(_GZIP_MAGIC):
                break  # trailing bytes that are not another member: ignore, as gzip does
    except zlib.error as exc:
        raise InputError(f"{name}: corrupt gzip ({exc})") from None
    return b"".join(out)


def read_bytes(path: str | os.PathLike[str], *, limit: int = MAX_INPUT_BYTES, gunzip: bool = True) -> bytes:
    """The bytes of a regular file or of stdin (``-``), at most ``limit`` (after decompression
    when the content is a gzip and ``gunzip``). Raises InputError."""
    name = shown_path(path)
    if name == "-":
        data = _read_capped(sys.stdin.buffer, limit, "standard input")
        name = "standard input"
    else:
        check_regular_file(path)
        try:
            # O_NONBLOCK: should the path become a FIFO between the stat and the open, the open
            # returns at once instead of waiting for a writer; fstat then refuses it.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        except OSError as exc:
            raise InputError(f"{name}: cannot read ({exc.strerror or exc})") from None
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InputError(f"{name}: is not a regular file")
            try:
                data = _read_capped(fh, limit, name)
            except OSError as exc:
                raise InputError(f"{name}: cannot read ({exc.strerror or exc})") from None
    if gunzip and data[:2] == _GZIP_MAGIC:
        return _gunzip_capped(data, limit, name)
    return data


def read_text(
    path: str | os.PathLike[str],
    *,
    limit: int = MAX_INPUT_BYTES,
    gunzip: bool = True,
    errors: str = "replace",
) -> str:
    """``read_bytes`` decoded as UTF-8 (undecodable bytes replaced unless ``errors='strict'``,
    which raises InputError naming the file)."""
    data = read_bytes(path, limit=limit, gunzip=gunzip)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from None


__all__ = ["MAX_INPUT_BYTES", "InputError", "check_regular_file", "read_bytes", "read_text"]
