"""Python tracebacks as a user pastes them: frames, exception lines and device-side asserts.

Read per stream: lines tagged by a launcher (``[rank3]: ``, a worker's ``(... pid=N)``) are
told apart (``log_lines``), so interleaved ranks do not mix their frames. The frames kept are
those of the first traceback that ends in an exception; the user frames of the others are kept
apart. A C++ abort (``terminate called after throwing an instance of ...`` / ``what():``) counts
as an exception line; device-side assertion lines are read by ``device_assert``.

Error kinds are not decided here: ``qmoe_doctor.core.error_kind.classify_error`` (the same
classifier probe outcomes use) tells them from the exception's type and message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qmoe_doctor.core.error_kind import classify_error, cuda_error_kind
from qmoe_doctor.core.records import SCHEMA_VERSION, ErrorKind
from qmoe_doctor.diagnose.device_assert import DeviceAssert, is_device_assert_line, parse_device_assert
from qmoe_doctor.diagnose.log_lines import LogNumberError, parse_int, strip_prefix


@dataclass(frozen=True, slots=True, kw_only=True)
class PyFrame:
    file: str
    line: int
    function: str
    code: str | None = None  # the source line Python printed under the frame
    user: bool = False  # not in site-packages / torch / triton / generated code


@dataclass(frozen=True, slots=True, kw_only=True)
class PyException:
    type: str  # "ValueError", "triton.runtime.errors.OutOfResources", "c10::Error"
    message: str
    stream: str = ""  # "rank3" when the line carried a rank or worker prefix


@dataclass(frozen=True, slots=True, kw_only=True)
class TracebackReport:
    schema_version: int = SCHEMA_VERSION
    frames: tuple[PyFrame, ...] = ()  # of the traceback that ends in ``exception``
    exception: PyException | None = None  # the first exception line found
    exceptions: tuple[PyException, ...] = ()  # every exception line (several ranks, chained)
    asserts: tuple[DeviceAssert, ...] = ()  # device-side assertion lines
    streams: tuple[str, ...] = ()  # rank / worker prefixes seen
    other_user_frames: tuple[PyFrame, ...] = ()  # user frames of the other tracebacks in the text
    truncated: bool = False  # frames but no exception line: the paste was cut


_TB_START = re.compile(r"^\s*Traceback \(most recent call last\):")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
_FRAME_IPY = re.compile(r"^\s*File (?P<file>\S+?):(?P<line>\d+), in (?P<func>.+?)\s*$")
_EXC = re.compile(
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Resources|Exit|Interrupt|Failure))"
    r"(?::\s?(?P<msg>.*))?\s*$"
)
_CXX_WHAT = re.compile(r"^\s*what\(\):\s+(?P<msg>.+)$")
_CXX_THROW = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
_LIBRARY_PATH = re.compile(
    r"(site-packages|dist-packages|/lib/python\d|/torch/|/triton/|torchinductor_|/\.triton/|"
    r"^<|/usr/lib/|/usr/local/lib/|sysdeps/|csu/|importlib)"
)


def is_user_path(path: str) -> bool:
    return not _LIBRARY_PATH.search(path)


def _bare_cuda_error(line: str) -> ErrorKind | None:
    """The sticky CUDA error of a line that is one, as a C++ program or a logger prints it:
    ``CUDA error: misaligned address`` at the start of the line (after a rank prefix); never a
    line of prose that quotes one in a code span."""
    body = line.strip()
    return cuda_error_kind(body) if body.startswith("CUDA error: ") and "`" not in body else None


def bare_cuda_error(text: str) -> tuple[ErrorKind, str] | None:
    """The first line of ``text`` that is a bare CUDA error (no exception type before it), with
    its kind."""
    for raw in text.splitlines():
        _, line = strip_prefix(raw)
        kind = _bare_cuda_error(line)
        if kind is not None:
            return kind, line.strip()
    return None


def looks_like_traceback(text: str) -> bool:
    for raw in text.splitlines():
        _, line = strip_prefix(raw)
        if (
            _TB_START.match(line)
            or _FRAME.match(line)
            or is_device_assert_line(line)
            or _CXX_THROW.search(line)
            or _bare_cuda_error(line) is not None
        ):
            return True
        m = _EXC.match(line.strip())
        if m and classify_error(m.group("type"), m.group("msg") or "") is not ErrorKind.OTHER:
            return True
    return False


def parse_traceback(text: str) -> TracebackReport:
    """Read Python tracebacks (with rank / worker prefixes), exception lines and device-side
    assertion lines. The frames kept are those of the first traceback that ends in an exception,
    read per stream, so interleaved ranks do not mix their frames."""
    frames_by_stream: dict[str, list[PyFrame]] = {}
    expect_code: set[str] = set()  # streams whose last line was a frame header
    chosen: tuple[PyFrame, ...] | None = None
    exceptions: list[PyException] = []
    asserts: list[DeviceAssert] = []
    streams: list[str] = []
    pending_cxx: str | None = None
    all_frames: list[PyFrame] = []
    for raw in text.splitlines():
        tag, line = strip_prefix(raw)
        if tag and tag not in streams:
            streams.append(tag)
        frames = frames_by_stream.setdefault(tag, [])
        stripped = line.strip()
        if tag in expect_code:
            expect_code.discard(tag)
            if frames and line[:1] in (" ", "\t") and stripped and not set(stripped) <= {"^", "~", " "}:
                if not (_FRAME.match(line) or _FRAME_IPY.match(line)):
                    last = frames[-1]
                    frames[-1] = PyFrame(
                        file=last.file, line=last.line, function=last.function, code=stripped, user=last.user
                    )
                    continue
        if _TB_START.match(line):
            frames.clear()
            continue
        fm = _FRAME.match(line) or _FRAME_IPY.match(line)
        if fm:
            file = fm.group("file")
            frame = PyFrame(
                file=file,
                line=parse_int(fm.group("line")),
                function=fm.group("func"),
                user=is_user_path(file),
            )
            frames.append(frame)
            all_frames.append(frame)
            expect_code.add(tag)
            continue
        try:
            found = parse_device_assert(line)
            if found is not None:
                found.overflow_bits  # noqa: B018 -- read now: the property converts the int width
        except ValueError:  # its line number or int width has thousands of digits (int() refuses)
            raise LogNumberError(
                "a device-side assertion line holds a number of thousands of digits"
            ) from None
        if found is not None:
            asserts.append(found)
            continue
        tm = _CXX_THROW.search(line)
        if tm:
            pending_cxx = tm.group("type")
            continue
        wm = _CXX_WHAT.match(line)
        if wm and pending_cxx:
            exceptions.append(PyException(type=pending_cxx, message=wm.group("msg").strip(), stream=tag))
            pending_cxx = None
            continue
        em = _EXC.match(line) if line[:1] not in (" ", "\t") else None
        if em:
            exceptions.append(
                PyException(type=em.group("type"), message=(em.group("msg") or "").strip(), stream=tag)
            )
            if chosen is None and frames:
                chosen = tuple(frames)
    if chosen is None:
        # frames but no exception after them: keep the longest partial traceback
        candidates = [tuple(f) for f in frames_by_stream.values() if f]
        chosen = max(candidates, key=len) if candidates else ()
    kept = {(f.file, f.line, f.function) for f in chosen}
    others: list[PyFrame] = []
    for f in all_frames:
        key = (f.file, f.line, f.function)
        if f.user and key not in kept:
            kept.add(key)
            others.append(f)
    return TracebackReport(
        frames=chosen,
        exception=exceptions[0] if exceptions else None,
        exceptions=tuple(exceptions),
        asserts=tuple(asserts),
        streams=tuple(streams),
        other_user_frames=tuple(others),
        truncated=bool(all_frames) and not exceptions,
    )


__all__ = [
    "PyException",
    "PyFrame",
    "TracebackReport",
    "bare_cuda_error",
    "is_user_path",
    "looks_like_traceback",
    "parse_traceback",
]
