"""compute-sanitizer's text output, read into records: one per reported error, folded into groups.

Finding the binary and building its command line is ``qmoe_doctor.machine.sanitizer``; placing
the addresses it reports against the tensors our probes handed the kernel is
``qmoe_doctor.diagnose.attribution``.

Text output, as our own run recorded it (compute-sanitizer 2025.3.1, memcheck, 2x H200:
``tests/fixtures/sanitizer/2026-11-22-2xh200-7ada31c/memcheck-unmasked-overrouted-nocache.log``,
abridged: 31 of the 33 host frames and 49 of the 50 printed records left out)::

    ========= COMPUTE-SANITIZER
    ========= Invalid __global__ write of size 16 bytes
    =========     at _grouped_gemm_kernel_unmasked+0x3390 in unmasked_rows.py:111
    =========     by thread (0,0,0) in block (14,0,0)
    =========     Access to 0x7f7cc49c0000 is out of bounds
    =========     and is 1 bytes after the nearest allocation at 0x7f7cc49a0000 of size 131,072 bytes
    =========     Saved host backtrace up to driver entry point at kernel launch time
    =========         Host Frame: launch [0x2057] in __triton_launcher.cpython-312-x86_64-linux-gnu.so
    =========         Host Frame: moe_grouped_gemm in unmasked_rows.py:29
    =========
    ========= ERROR SUMMARY: 450 errors

Other forms the parser accepts, printed by other releases of the tool (known from public
reports; we hold no recording of them yet): the address line may read ``Address 0x...`` or
``Access at 0x...`` instead of ``Access to 0x...``; the nearest-allocation line may say
``before`` or ``inside`` instead of ``after``; older releases print the location as
``at 0xPC in FILE:LINE:FUNCTION``, add ``Device Frame:`` lines, and print host frames as
``MODULE (FUNCTION + 0xOFF) [0xADDR]``; racecheck prints ``Error:``/``Warning: Race reported
between ACCESS access at LOCATION`` followed by ``and ACCESS access at LOCATION [N hazards]``;
API failures read ``Program hit cudaErrorXxx (error N) due to "TEXT" on CUDA API call to FN``.

Top-level lines carry one space after the nine '=', continuation lines more: the parser relies
on that, and on nothing else about position, so program output mixed into the log, logs cut at
either end, and logs of several processes told apart by a line prefix (``[rank0]: ``) all parse.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from qmoe_doctor.core.records import SCHEMA_VERSION
from qmoe_doctor.diagnose.log_lines import parse_int

# ---------------------------------------------------------------------------------------------
# Records of a parsed report
# ---------------------------------------------------------------------------------------------

#: The tools' names as ``--tool`` takes them (``qmoe_doctor.machine.sanitizer.SanitizerTool``);
#: a report says which one wrote it when its records tell.
ToolName = Literal["memcheck", "racecheck", "initcheck", "synccheck"]

Category = Literal[
    "invalid-access",  # memcheck: out-of-bounds / misaligned access (Invalid __global__ read ...)
    "uninitialized",  # initcheck: Uninitialized __global__ memory read
    "api-memory",  # initcheck/memcheck: Host API memory access error (cudaMemcpy of bad memory)
    "api-error",  # Program hit cudaErrorXxx on CUDA API call to ...
    "race",  # racecheck hazard
    "other",  # any other top-level record (hardware exception, barrier error, leak, ...)
]


@dataclass(frozen=True, slots=True, kw_only=True)
class CodeLocation:
    """Where in device code: ``function+0xpc in file:line`` or ``0xpc in file:line:function``."""

    function: str | None
    pc: int | None = None
    file: str | None = None
    line: int | None = None

    def render(self) -> str:
        where = f" ({self.file}:{self.line})" if self.file and self.line is not None else ""
        pc = f"+0x{self.pc:x}" if self.pc is not None else ""
        return f"{short_function_name(self.function or '?')}{pc}{where}"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostFrame:
    raw: str
    function: str | None = None
    module: str | None = None  # the binary or shared object ("libcuda.so.1", "/usr/bin/python3")
    file: str | None = None  # a source file when the frame names one (Python frames do)
    line: int | None = None
    offset: int | None = None  # the [0x...] offset

    @property
    def is_python_source(self) -> bool:
        return bool(self.file and self.file.endswith(".py"))


@dataclass(frozen=True, slots=True, kw_only=True)
class NearestAllocation:
    relation: Literal["after", "before", "inside"]
    distance: int  # bytes, as compute-sanitizer counts them (an access at base+size is "1 bytes after")
    base: int
    size: int

    @property
    def end(self) -> int:
        return self.base + self.size

    @property
    def gap(self) -> int:
        """The distance as AddressSanitizer counts it, the count reports render: an access at
        base+size is "0 bytes after"; before the base the counts agree; 0 inside (no offset
        printed)."""
        return self.distance - 1 if self.relation == "after" else self.distance


@dataclass(frozen=True, slots=True, kw_only=True)
class RaceAccess:
    access: str  # "read" / "write"
    location: CodeLocation
    hazards: int | None = None  # "[12 hazards]" on the second and later accesses


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerError:
    """One top-level record of the report."""

    category: Category
    message: str  # the record's first line, as printed
    stream: str = ""  # the line prefix that told interleaved processes apart ("" when none)
    space: str | None = None  # "global", "shared", "local"
    access: str | None = None  # "read", "write", "atomic", "?"
    size: int | None = None  # bytes of the access
    location: CodeLocation | None = None
    kernel: str | None = None  # the __global__ function (outermost device frame, else location)
    thread: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    address: int | None = None
    out_of_bounds: bool = False
    misaligned: bool = False
    nearest: NearestAllocation | None = None
    device_frames: tuple[CodeLocation, ...] = ()
    host_frames: tuple[HostFrame, ...] = ()
    backtrace_at: str | None = None  # "kernel launch time" / "error"
    # race hazards: the first access is on the header line, the others follow with "and ... at"
    severity: str | None = None  # racecheck: "error" / "warning"
    race_accesses: tuple[RaceAccess, ...] = ()
    # API errors
    cuda_error: str | None = None  # "cudaErrorLaunchFailure"
    cuda_error_code: int | None = None
    cuda_error_text: str | None = None  # "unspecified launch failure"
    api_call: str | None = None  # "cudaStreamSynchronize"
    complete: bool = True  # False: the log ended (or was cut) inside this record
    extra: tuple[str, ...] = ()  # continuation lines this parser did not recognize

    @property
    def hazards(self) -> int:
        return sum(a.hazards or 0 for a in self.race_accesses)


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorGroup:
    """Identical errors (same kind, kernel, access, size and pc) folded into one, with counts."""

    category: Category
    kernel: str | None
    space: str | None
    access: str | None
    size: int | None
    location: CodeLocation | None
    count: int
    addresses: tuple[int, ...]  # distinct faulting addresses, first seen first (at most 64 kept)
    distinct_addresses: int
    threads: int  # distinct (block, thread) pairs
    first: SanitizerError
    complete: bool  # False when any member was cut


@dataclass(frozen=True, slots=True, kw_only=True)
class RacecheckSummary:
    displayed: int
    errors: int
    warnings: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerReport:
    schema_version: int = SCHEMA_VERSION
    tool: ToolName | None = None  # inferred from the records
    legacy_cuda_memcheck: bool = False  # the pre-2021 "CUDA-MEMCHECK" tool wrote it
    version: str | None = None  # when the log carries a version banner
    # the records kept whole: each group's first, and one per distinct address it keeps; the
    # others are counted in their group (``groups[].count``) and in ``errors_folded``
    errors: tuple[SanitizerError, ...] = ()
    errors_folded: int = 0
    groups: tuple[ErrorGroup, ...] = ()
    error_summary: int | None = None  # "ERROR SUMMARY: N errors"
    errors_not_printed: int = 0  # errors counted but not printed (--print-limit reached)
    racecheck_summary: RacecheckSummary | None = None
    notes: tuple[str, ...] = ()  # tool warnings: "Maximum number of hazards reached", ...
    streams: tuple[str, ...] = ()  # distinct line prefixes seen (interleaved processes)
    sanitizer_lines: int = 0
    program_lines: int = 0  # lines without the ========= prefix (the program's own output)
    starts_mid_record: bool = False  # the first sanitizer lines continue a record cut off above
    truncated: bool = False  # no summary line: the run was cut, killed, or the paste incomplete
    partial_last_line: str | None = None  # a final line without newline, not trusted as data

    @property
    def records(self) -> int:
        """Every record the log holds, kept whole or folded."""
        return len(self.errors) + self.errors_folded

    @property
    def has_findings(self) -> bool:
        return (
            bool(self.errors)
            or bool(self.error_summary)
            or bool(self.racecheck_summary and self.racecheck_summary.displayed)
        )

    @property
    def clean(self) -> bool:
        """A complete run that reported nothing: ``ERROR SUMMARY: 0 errors`` (or racecheck's
        ``RACECHECK SUMMARY: 0 hazards displayed``) and no records."""
        if self.errors or self.truncated or self.error_summary:
            return False
        race = self.racecheck_summary
        return self.error_summary == 0 or (race is not None and race.displayed == 0 and not race.errors)

    @property
    def recognized(self) -> bool:
        return self.sanitizer_lines > 0

    @property
    def tool_failures(self) -> tuple[str, ...]:
        """The tool's own failures: ``Internal Sanitizer Error: The Sanitizer failed to handle a
        hardware exception.`` (recorded on one H100, 2026-11-25, memcheck of a kernel writing a
        million rows past its output). After one, the records the log holds are what the tool saw
        before it gave up: the rest of the run is unchecked, never clean."""
        return tuple(e.message for e in self.errors if e.message.startswith(_TOOL_FAILURE))


# ---------------------------------------------------------------------------------------------
# Text parser
# ---------------------------------------------------------------------------------------------

#: The first words of a record in which the tool reports its own failure.
_TOOL_FAILURE = "Internal Sanitizer Error"
#: A version banner: "Compute Sanitizer ... Version 2025.3.1.0" (only some logs carry one).
_VERSION_RE = re.compile(r"Version\s+(\d+(?:\.\d+)+)")
_NUM = r"\d[\d,]*"
_HEX = r"0x[0-9a-fA-F]+"

# A sanitizer line: optional prefix (a rank tag such as "[rank0]: ", a worker tag in parentheses,
# a log timestamp, indentation), then exactly nine '=' (pytest's longer rules are not ours), body.
_LINE_RE = re.compile(r"^(?P<prefix>.{0,160}?)(?<!=)={9}(?!=)(?P<body>.*)$")
# Log-collector timestamps vary from line to line and must not split one process into many.
_TIMESTAMP_RE = re.compile(
    r"\d{4}-\d\d-\d\d[T ][\d:.,]+(?:Z|[+-]\d\d:?\d\d)?(?:\s+(?:stdout|stderr)\s+[FP])?"
    r"|\b\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?|\b\d\d:\d\d:\d\d(?:[.,]\d+)?"
)

_H_INVALID = re.compile(
    rf"^Invalid __(?P<space>\w+)__ (?P<access>\S+) of size (?P<size>{_NUM})(?: bytes?)?\s*$"
)
_H_UNINIT = re.compile(
    rf"^Uninitialized __(?P<space>\w+)__ memory (?P<access>\S+) of size (?P<size>{_NUM})(?: bytes?)?\s*$"
)
_H_RACE = re.compile(r"^(?P<sev>Error|Warning): Race reported between (?P<access>\w+) access at (?P<loc>.+)$")
_H_API = re.compile(
    r"^Program hit (?P<err>\w+)(?: \(error (?P<code>\d+)\))?"
    r'(?: due to "(?P<text>[^"]*)")?(?: on CUDA API call to (?P<api>[\w:]+))?'
)
_H_HOST_API = re.compile(rf"^Host API memory access error at host access to (?P<addr>{_HEX})")
_ERROR_SUMMARY = re.compile(rf"^ERROR SUMMARY: (?P<n>{_NUM}) errors?\s*$")
# printed after the summary when --print-limit cut the report (measured, 2025.3.1):
# "ERROR SUMMARY: 2617 errors were not printed. Use --print-limit option to adjust ..."
_NOT_PRINTED = re.compile(rf"^ERROR SUMMARY: (?P<n>{_NUM}) errors? (?:was|were) not printed")
_RACE_SUMMARY = re.compile(
    rf"^RACECHECK SUMMARY: (?P<d>{_NUM}) hazards? displayed \((?P<e>{_NUM}) errors?, (?P<w>{_NUM}) warnings?\)"
)

_C_AT = re.compile(r"^at (?P<loc>.+)$")
_C_THREAD = re.compile(
    r"^by thread \((?P<t>\s*\d+\s*,\s*\d+\s*,\s*\d+\s*)\) in block \((?P<b>\s*\d+\s*,\s*\d+\s*,\s*\d+\s*)\)"
)
_C_ADDRESS = re.compile(rf"^(?:Access (?:to|at)|Address) (?P<addr>{_HEX})(?P<rest>.*)$")
_C_NEAREST = re.compile(
    rf"^and is (?:(?P<dist>{_NUM}) bytes? (?P<rel>after|before)|(?P<inside>inside)) the nearest allocation"
    rf" at (?P<base>{_HEX}) of size (?P<size>{_NUM}) bytes?"
)
_C_DEVICE_FRAME = re.compile(r"^Device Frame:\s*(?P<rest>.+)$")
_C_BACKTRACE = re.compile(r"^Saved host backtrace up to driver entry point(?: at (?P<at>.+))?")
_C_HOST_FRAME = re.compile(r"^Host Frame:\s*(?P<rest>.*)$")
_C_IN_MODULE = re.compile(r"^in (?P<module>\S.*)$")
_C_RACE_AND = re.compile(rf"^and (?P<access>\w+) access at (?P<loc>.+?)(?: \[(?P<n>{_NUM}) hazards?\])?\s*$")
_HAZARD_COUNT = re.compile(rf"^(?P<loc>.+?) \[(?P<n>{_NUM}) hazards?\]\s*$")

# older releases: "0xPC in FILE:LINE:FUNCTION", or "0xPC in FUNCTION(ARGS)" without a source line
_LOC_OLD = re.compile(rf"^(?P<pc>{_HEX}) in (?P<rest>.+)$")
_LOC_FILE_LINE_FUNC = re.compile(r"^(?P<file>[^\s:()<>]+):(?P<line>\d+):(?P<func>.+)$")
# 2024+ releases: "FUNCTION+0xPC in FILE:LINE" (ours: "_grouped_gemm_kernel_unmasked+0x3390 in
# unmasked_rows.py:111"), "FUNCTION+0xPC" without a source line, or "FUNCTION in FILE:LINE" without a pc
_LOC_NEW = re.compile(rf"^(?P<func>.+?)\+(?P<pc>{_HEX})(?: in (?P<file>\S+?):(?P<line>\d+))?\s*$")
_LOC_FUNC_IN_FILE = re.compile(r"^(?P<func>.+?) in (?P<file>\S+?):(?P<line>\d+)\s*$")
# old device frames: "FUNCTION(ARGS) (FUNCTION(ARGS) : 0xPC)"
_LOC_PAREN_PC = re.compile(rf"^(?P<func>.+?) \((?P<func2>.+) : (?P<pc>{_HEX})\)\s*$")

# host frames
_HF_NEW = re.compile(rf"^(?P<func>.*?)\s*\[(?P<off>{_HEX})\](?: in (?P<module>.+))?\s*$")
_HF_OLD = re.compile(rf"^(?P<module>[^\s(]+) \((?P<func>.+) \+ {_HEX}\) \[(?P<off>{_HEX})\]\s*$")
_HF_FUNC_FILE = re.compile(r"^(?P<func>.*?)\s*\bin (?P<file>[^\s\[]+?):(?P<line>\d+)\s*$")
_HF_FILE_FUNC = re.compile(r"^(?P<file>[^\s:\[]+):(?P<line>\d+):(?P<func>.+)$")


def short_function_name(name: str) -> str:
    """``void cub::Foo<int>::bar<(int)1>(T1, int)`` -> ``cub::Foo::bar``; Triton names pass through."""
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    # drop the argument list: the last balanced (...) at the end
    if s.endswith(")") and not s.endswith("() const"):
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            if s[i] == ")":
                depth += 1
            elif s[i] == "(":
                depth -= 1
                if depth == 0:
                    s = s[:i]
                    break
    elif s.endswith("() const"):
        s = s[: -len("() const")]
    # drop template arguments
    out: list[str] = []
    depth = 0
    for ch in s:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    short = "".join(out).strip()
    return short or name.strip()


def parse_location(text: str) -> CodeLocation:
    text = text.strip()
    m = _LOC_OLD.match(text)
    if m:
        pc = parse_int(m.group("pc"))
        rest = m.group("rest").strip()
        fl = _LOC_FILE_LINE_FUNC.match(rest)
        if fl:
            return CodeLocation(
                function=fl.group("func").strip(),
                pc=pc,
                file=fl.group("file"),
                line=parse_int(fl.group("line")),
            )
        return CodeLocation(function=rest, pc=pc)
    m = _LOC_NEW.match(text)
    if m:
        return CodeLocation(
            function=m.group("func").strip(),
            pc=parse_int(m.group("pc")),
            file=m.group("file"),
            line=parse_int(m.group("line")) if m.group("line") else None,
        )
    m = _LOC_PAREN_PC.match(text)
    if m:
        return CodeLocation(function=m.group("func").strip(), pc=parse_int(m.group("pc")))
    m = _LOC_FUNC_IN_FILE.match(text)
    if m:
        return CodeLocation(
            function=m.group("func").strip(), file=m.group("file"), line=parse_int(m.group("line"))
        )
    fl = _LOC_FILE_LINE_FUNC.match(text)
    if fl:
        return CodeLocation(
            function=fl.group("func").strip(), file=fl.group("file"), line=parse_int(fl.group("line"))
        )
    return CodeLocation(function=text)


def parse_host_frame(text: str) -> HostFrame:
    raw = text.strip()
    m = _HF_OLD.match(raw)
    if m:
        return HostFrame(
            raw=raw,
            function=m.group("func").strip(),
            module=m.group("module"),
            offset=parse_int(m.group("off")),
        )
    m = _HF_NEW.match(raw)
    if not m:
        # 2025.x Python frames carry no offset: "Host Frame: moe_grouped_gemm in unmasked_rows.py:29"
        fm = _HF_FUNC_FILE.match(raw)
        if fm:
            return HostFrame(
                raw=raw,
                function=fm.group("func").strip() or None,
                file=fm.group("file"),
                line=parse_int(fm.group("line")),
            )
        return HostFrame(raw=raw, function=raw or None)
    func = m.group("func").strip() or None
    module = m.group("module").strip() if m.group("module") else None
    file: str | None = None
    line: int | None = None
    if func:
        fm = _HF_FUNC_FILE.match(func)
        if fm:
            func, file, line = fm.group("func").strip() or None, fm.group("file"), parse_int(fm.group("line"))
        else:
            ff = _HF_FILE_FUNC.match(func)
            if ff:
                func, file, line = ff.group("func").strip(), ff.group("file"), parse_int(ff.group("line"))
        if module is None and func and (func.startswith(("/", "./")) or ".so" in func) and " " not in func:
            # old releases print a bare module path and an offset for some frames
            # ("Host Frame:MODULE [0xOFF]"): the name is the module, the function is unknown
            module, func = func, None
    return HostFrame(
        raw=raw, function=func, module=module, file=file, line=line, offset=parse_int(m.group("off"))
    )


@dataclass(slots=True)
class _Builder:
    """Mutable state of the record being read, per stream."""

    category: Category
    message: str
    stream: str
    space: str | None = None
    access: str | None = None
    size: int | None = None
    location: CodeLocation | None = None
    thread: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    address: int | None = None
    out_of_bounds: bool = False
    misaligned: bool = False
    nearest: NearestAllocation | None = None
    backtrace_at: str | None = None
    severity: str | None = None
    cuda_error: str | None = None
    cuda_error_code: int | None = None
    cuda_error_text: str | None = None
    api_call: str | None = None
    device_frames: list[CodeLocation] = field(default_factory=list)
    host_frames: list[HostFrame] = field(default_factory=list)
    race_accesses: list[RaceAccess] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    complete: bool = True

    def build(self) -> SanitizerError:
        if self.device_frames:
            kernel = self.device_frames[-1].function
        elif self.location is not None:
            kernel = self.location.function
        elif self.race_accesses:
            kernel = self.race_accesses[0].location.function
        else:
            kernel = None
        return SanitizerError(
            category=self.category,
            message=self.message,
            stream=self.stream,
            space=self.space,
            access=self.access,
            size=self.size,
            location=self.location,
            kernel=kernel,
            thread=self.thread,
            block=self.block,
            address=self.address,
            out_of_bounds=self.out_of_bounds,
            misaligned=self.misaligned,
            nearest=self.nearest,
            device_frames=tuple(self.device_frames),
            host_frames=tuple(self.host_frames),
            backtrace_at=self.backtrace_at,
            severity=self.severity,
            race_accesses=tuple(self.race_accesses),
            cuda_error=self.cuda_error,
            cuda_error_code=self.cuda_error_code,
            cuda_error_text=self.cuda_error_text,
            api_call=self.api_call,
            complete=self.complete,
            extra=tuple(self.extra),
        )


def _triple(text: str) -> tuple[int, int, int]:
    a, b, c = (parse_int(x) for x in text.split(","))
    return (a, b, c)


def _stream_key(prefix: str) -> str:
    return _TIMESTAMP_RE.sub("", prefix).strip()


def _start_record(body: str, stream: str) -> _Builder | None:
    m = _H_INVALID.match(body) or _H_UNINIT.match(body)
    if m:
        return _Builder(
            category="invalid-access" if m.re is _H_INVALID else "uninitialized",
            message=body,
            stream=stream,
            space=m.group("space"),
            access=m.group("access"),
            size=parse_int(m.group("size")),
        )
    m = _H_RACE.match(body)
    if m:
        b = _Builder(category="race", message=body, stream=stream, severity=m.group("sev").lower())
        loc_text = m.group("loc")
        hz = _HAZARD_COUNT.match(loc_text)
        if hz:
            loc_text = hz.group("loc")
        b.race_accesses.append(
            RaceAccess(
                access=m.group("access").lower(),
                location=parse_location(loc_text),
                hazards=parse_int(hz.group("n")) if hz else None,
            )
        )
        return b
    m = _H_API.match(body)
    if m:
        return _Builder(
            category="api-error",
            message=body,
            stream=stream,
            cuda_error=m.group("err"),
            cuda_error_code=parse_int(m.group("code")) if m.group("code") else None,
            cuda_error_text=m.group("text"),
            api_call=m.group("api"),
        )
    m = _H_HOST_API.match(body)
    if m:
        return _Builder(
            category="api-memory", message=body, stream=stream, address=parse_int(m.group("addr"))
        )
    return None


def _continue_record(b: _Builder, body: str) -> None:
    m = _C_AT.match(body)
    if m and b.location is None:
        b.location = parse_location(m.group("loc"))
        return
    m = _C_THREAD.match(body)
    if m:
        b.thread, b.block = _triple(m.group("t")), _triple(m.group("b"))
        return
    m = _C_ADDRESS.match(body)
    if m and b.address is None:
        b.address = parse_int(m.group("addr"))
        b.out_of_bounds = "out of bounds" in m.group("rest")
        b.misaligned = "misaligned" in m.group("rest")
        return
    m = _C_NEAREST.match(body)
    if m:
        base, size = parse_int(m.group("base")), parse_int(m.group("size"))
        if m.group("inside"):
            b.nearest = NearestAllocation(relation="inside", distance=0, base=base, size=size)
        else:
            b.nearest = NearestAllocation(
                relation="after" if m.group("rel") == "after" else "before",
                distance=parse_int(m.group("dist")),
                base=base,
                size=size,
            )
        return
    m = _C_DEVICE_FRAME.match(body)
    if m:
        b.device_frames.append(parse_location(m.group("rest")))
        return
    m = _C_BACKTRACE.match(body)
    if m:
        b.backtrace_at = (m.group("at") or "").strip() or None
        return
    m = _C_HOST_FRAME.match(body)
    if m:
        b.host_frames.append(parse_host_frame(m.group("rest")))
        return
    m = _C_IN_MODULE.match(body)
    if m and b.host_frames and b.host_frames[-1].module is None:
        last = b.host_frames[-1]
        b.host_frames[-1] = HostFrame(
            raw=last.raw,
            function=last.function,
            module=m.group("module").strip(),
            file=last.file,
            line=last.line,
            offset=last.offset,
        )
        return
    m = _C_RACE_AND.match(body)
    if m and b.category == "race":
        b.race_accesses.append(
            RaceAccess(
                access=m.group("access").lower(),
                location=parse_location(m.group("loc")),
                hazards=parse_int(m.group("n")) if m.group("n") else None,
            )
        )
        return
    if body.strip() in ("...", ""):
        return
    b.extra.append(body.strip())


def _infer_tool(errors: Sequence[SanitizerError], saw_race_summary: bool) -> ToolName | None:
    cats = {e.category for e in errors}
    if "race" in cats or saw_race_summary:
        return "racecheck"
    if "uninitialized" in cats:
        return "initcheck"
    if any(
        "barrier" in e.message.lower() or "sync" in e.message.lower() for e in errors if e.category == "other"
    ):
        return "synccheck"
    if cats & {"invalid-access", "api-error"}:
        return "memcheck"
    return None


#: Distinct faulting addresses a group keeps (and records kept per group, one per address).
MAX_GROUP_ADDRESSES = 64


def _group_key(e: SanitizerError) -> tuple[object, ...]:
    loc = e.location
    return (
        e.category,
        e.kernel,
        e.space,
        e.access,
        e.size,
        loc.pc if loc else None,
        loc.function if loc else None,
        e.cuda_error,
        e.api_call,
        tuple((a.access, a.location.function, a.location.pc) for a in e.race_accesses),
    )


class _Group:
    """One group being folded: counts of every member, the first member, and the members that
    brought a new address (at most ``max_addresses``)."""

    __slots__ = ("addresses", "complete", "count", "first", "seen", "threads")

    def __init__(self, first: SanitizerError) -> None:
        self.first = first
        self.count = 0
        self.addresses: list[int] = []
        self.seen: set[int] = set()
        self.threads: set[tuple[object, object]] = set()
        self.complete = True

    def add(self, e: SanitizerError, max_addresses: int) -> bool:
        """Count ``e``; True when it is worth keeping whole (the first, or a new address kept)."""
        self.count += 1
        self.complete = self.complete and e.complete
        if e.thread is not None:
            self.threads.add((e.block, e.thread))
        keep = self.count == 1
        if e.address is not None and e.address not in self.seen:
            self.seen.add(e.address)
            if len(self.addresses) < max_addresses:
                self.addresses.append(e.address)
                keep = True
        return keep

    def build(self) -> ErrorGroup:
        first = self.first
        return ErrorGroup(
            category=first.category,
            kernel=first.kernel,
            space=first.space,
            access=first.access,
            size=first.size,
            location=first.location,
            count=self.count,
            addresses=tuple(self.addresses),
            distinct_addresses=len(self.seen),
            threads=len(self.threads),
            first=first,
            complete=self.complete,
        )


class ErrorFolder:
    """Folds records as they are read, keeping memory bounded by what is distinct: each group's
    counts, its first record and one record per kept address. A 59 MiB log of 330,000 identical
    faults keeps a few dozen records, not 330,000 (``explain --json`` of it ran out of memory)."""

    def __init__(self, *, max_addresses: int = MAX_GROUP_ADDRESSES) -> None:
        self.max_addresses = max_addresses
        self.groups: dict[tuple[object, ...], _Group] = {}
        self.kept: list[SanitizerError] = []  # in log order
        self.folded = 0  # records counted in their group but not kept

    def add(self, e: SanitizerError) -> None:
        key = _group_key(e)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _Group(e)
        if group.add(e, self.max_addresses):
            self.kept.append(e)
        else:
            self.folded += 1

    def result(self) -> tuple[tuple[SanitizerError, ...], tuple[ErrorGroup, ...]]:
        return tuple(self.kept), tuple(g.build() for g in self.groups.values())


def is_top_level_line(body: str) -> bool:
    """Whether a line's text, without the ``=========`` prefix, is one the tool prints at the top
    level: a record header, a summary, or the banner (everything else continues a record). Lets
    a reader of other containers (the ``--xml`` report's elements) re-prefix bare lines."""
    body = body.strip()
    return (
        _start_record(body, "") is not None
        or bool(_ERROR_SUMMARY.match(body) or _NOT_PRINTED.match(body) or _RACE_SUMMARY.match(body))
        or body in ("COMPUTE-SANITIZER", "CUDA-MEMCHECK")
    )


def looks_like_sanitizer_log(text: str) -> bool:
    for line in text.splitlines():
        m = _LINE_RE.match(line)
        if m and m.group("body").strip():
            return True
    return False


def parse_sanitizer_log(text: str) -> SanitizerReport:
    """Parse compute-sanitizer (or legacy cuda-memcheck) text output. Never raises on content:
    unknown lines are kept as ``extra`` on their record or counted as program output."""
    ends_with_newline = text.endswith("\n")
    lines = text.splitlines()
    partial: str | None = None
    if lines and not ends_with_newline:
        partial = lines.pop()  # cut mid-line: a half address or half name would be wrong data
        body_m = _LINE_RE.match(partial)
        body = body_m.group("body").strip() if body_m else ""
        if _ERROR_SUMMARY.match(body) or _RACE_SUMMARY.match(body) or _NOT_PRINTED.match(body):
            lines.append(partial)  # a summary without its newline is still whole (its count is)
            partial = None
    open_records: dict[str, _Builder] = {}
    done = ErrorFolder()
    streams: list[str] = []
    notes: list[str] = []
    error_summary: int | None = None
    race_summary: RacecheckSummary | None = None
    legacy = False
    version: str | None = None
    sanitizer_lines = 0
    program_lines = 0
    starts_mid = False
    seen_any_record = False
    summarized: set[str] = set()  # streams whose summary line was seen
    errors_not_printed = 0

    def close(stream: str) -> None:
        b = open_records.pop(stream, None)
        if b is not None:
            done.add(b.build())

    for line in lines:
        m = _LINE_RE.match(line)
        if not m:
            if line.strip():
                program_lines += 1
            vm = (
                _VERSION_RE.search(line)
                if "Compute Sanitizer" in line or line.startswith("Version")
                else None
            )
            if vm:
                version = vm.group(1)
            continue
        sanitizer_lines += 1
        stream = _stream_key(m.group("prefix"))
        if stream not in streams:
            streams.append(stream)
        raw_body = m.group("body")
        body = raw_body.strip()
        top_level = raw_body.startswith(" ") and not raw_body.startswith("  ")
        if not body:
            close(stream)  # a bare "=========" separates records
            continue
        if top_level:
            if body in ("COMPUTE-SANITIZER", "CUDA-MEMCHECK"):
                legacy = legacy or body == "CUDA-MEMCHECK"
                continue
            npm = _NOT_PRINTED.match(body)
            if npm:
                errors_not_printed += parse_int(npm.group("n"))
                continue
            sm = _ERROR_SUMMARY.match(body)
            if sm:
                close(stream)
                summarized.add(stream)
                error_summary = (error_summary or 0) + parse_int(sm.group("n"))
                continue
            rm = _RACE_SUMMARY.match(body)
            if rm:
                close(stream)
                summarized.add(stream)
                prev = race_summary or RacecheckSummary(displayed=0, errors=0, warnings=0)
                race_summary = RacecheckSummary(
                    displayed=prev.displayed + parse_int(rm.group("d")),
                    errors=prev.errors + parse_int(rm.group("e")),
                    warnings=prev.warnings + parse_int(rm.group("w")),
                )
                continue
            new = _start_record(body, stream)
            if new is not None:
                close(stream)
                open_records[stream] = new
                seen_any_record = True
                continue
            if body.startswith(
                (
                    "Warning:",
                    "This tool is deprecated",
                    "Please use",
                    "Target application",
                    "Error: process",
                    "LEAK SUMMARY",
                )
            ):
                close(stream)
                notes.append(body)
                continue
            # any other top-level line opens a record of its own (hardware exceptions, barrier
            # errors, leaks): never silently dropped
            close(stream)
            open_records[stream] = _Builder(category="other", message=body, stream=stream)
            seen_any_record = True
            continue
        current = open_records.get(stream)
        if current is None:
            if not seen_any_record and body not in ("...",):
                starts_mid = True
            continue
        _continue_record(current, body)

    truncated = error_summary is None and race_summary is None
    for stream in list(open_records):
        if stream not in summarized or partial is not None:
            open_records[stream].complete = False  # the log ended inside this record
        close(stream)
    errors, groups = done.result()
    return SanitizerReport(
        tool=_infer_tool(errors, race_summary is not None),
        legacy_cuda_memcheck=legacy,
        version=version,
        errors=errors,
        errors_folded=done.folded,
        groups=groups,
        error_summary=error_summary,
        errors_not_printed=errors_not_printed,
        racecheck_summary=race_summary,
        notes=tuple(notes),
        streams=tuple(streams),
        sanitizer_lines=sanitizer_lines,
        program_lines=program_lines,
        starts_mid_record=starts_mid,
        truncated=truncated,
        partial_last_line=partial,
    )


__all__ = [
    "MAX_GROUP_ADDRESSES",
    "Category",
    "ErrorFolder",
    "CodeLocation",
    "ErrorGroup",
    "HostFrame",
    "NearestAllocation",
    "RaceAccess",
    "RacecheckSummary",
    "SanitizerError",
    "SanitizerReport",
    "ToolName",
    "is_top_level_line",
    "looks_like_sanitizer_log",
    "parse_host_frame",
    "parse_int",
    "parse_location",
    "parse_sanitizer_log",
    "short_function_name",
]
