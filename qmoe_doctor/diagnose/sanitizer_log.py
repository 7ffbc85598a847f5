"""compute-sanitizer: find it, build its command line, read its text (and XML) output, and
attribute the addresses it reports to the tensors our probes handed the kernel.

The parent never runs a kernel; this module only drives the binary and reads what it wrote.

Text output, as our own run recorded it (compute-sanitizer 2025.3.1, memcheck, 2x H200:
``tests/fixtures/recorded/h200x2-run1/sanitizer/memcheck-unmasked-overrouted-nocache.log``,
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

import glob
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from qmoe_doctor.core import knobs
from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.records import SCHEMA_VERSION, TensorInfo, from_jsonable

# ---------------------------------------------------------------------------------------------
# Finding the binary and building its command line
# ---------------------------------------------------------------------------------------------

BINARY = "compute-sanitizer"
_VERSION_RE = re.compile(r"Version\s+(\d+(?:\.\d+)+)")


class SanitizerTool(StrEnum):
    MEMCHECK = "memcheck"  # out-of-bounds / misaligned accesses, hardware exceptions
    RACECHECK = "racecheck"  # shared-memory hazards only (global-memory races are invisible)
    SYNCCHECK = "synccheck"  # invalid barrier / synchronization use
    INITCHECK = "initcheck"  # reads of uninitialized global memory


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerInfo:
    path: str
    version: str | None  # "2025.3.1.0" from `compute-sanitizer --version`; None if it did not say
    found_via: str  # "QMOE_DOCTOR_COMPUTE_SANITIZER", "PATH", "CUDA_HOME", or the directory searched

    @property
    def version_tuple(self) -> tuple[int, ...]:
        if not self.version:
            return ()
        return tuple(int(p) for p in self.version.split("."))


def _default_search_dirs(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(directory, label) pairs to look in after PATH, most specific first."""
    dirs: list[tuple[str, str]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = env.get(var)
        if root:
            dirs.append((os.path.join(root, "bin"), var))
            dirs.append((os.path.join(root, "compute-sanitizer"), var))
    dirs.append(("/usr/local/cuda/bin", "/usr/local/cuda/bin"))
    dirs.append(("/usr/local/cuda/compute-sanitizer", "/usr/local/cuda/compute-sanitizer"))
    # versioned toolkits, newest first (cuda-12.10 after cuda-12.9: compare numerically)
    for pattern in ("/usr/local/cuda-*/bin", "/usr/local/cuda-*/compute-sanitizer"):
        for d in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            dirs.append((d, d))
    # the HPC SDK lays toolkits out as /opt/nvidia/hpc_sdk/Linux_x86_64/<ver>/cuda/<ver>/bin
    for pattern in (
        "/opt/nvidia/hpc_sdk/*/*/cuda/*/bin",
        "/opt/nvidia/hpc_sdk/*/*/cuda/*/compute-sanitizer",
        "/opt/nvidia/hpc_sdk/*/*/cuda/bin",
        "/opt/nvidia/*/bin",
    ):
        for d in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            dirs.append((d, d))
    return dirs


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def read_version(path: str, *, timeout_s: float = 20.0) -> str | None:
    """Ask the binary for its version; None if it does not answer in time or says no version."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION_RE.search(out.stdout + "\n" + out.stderr)
    return match.group(1) if match else None


def find_compute_sanitizer(
    *,
    env: Mapping[str, str] | None = None,
    search_dirs: Sequence[tuple[str, str]] | None = None,
    query_version: bool = True,
) -> SanitizerInfo | None:
    """Locate compute-sanitizer: $QMOE_DOCTOR_COMPUTE_SANITIZER, then PATH, then $CUDA_HOME /
    $CUDA_PATH, then the usual toolkit directories (newest first).

    When QMOE_DOCTOR_COMPUTE_SANITIZER is set it is the only candidate: a wrong explicit path
    must not be papered over by another binary found elsewhere. ``env`` and ``search_dirs``
    exist for tests.
    """
    env = os.environ if env is None else env
    explicit = env.get(knobs.QMOE_SANITIZER)
    if explicit:
        if not _is_executable(explicit):
            return None
        return SanitizerInfo(
            path=explicit,
            version=read_version(explicit) if query_version else None,
            found_via=knobs.QMOE_SANITIZER,
        )
    candidates: list[tuple[str, str]] = []
    on_path = shutil.which(BINARY, path=env.get("PATH", ""))
    if on_path:
        candidates.append((on_path, "PATH"))
    dirs = _default_search_dirs(env) if search_dirs is None else list(search_dirs)
    candidates.extend((os.path.join(d, BINARY), label) for d, label in dirs)
    for path, label in candidates:
        if _is_executable(path):
            return SanitizerInfo(
                path=path, version=read_version(path) if query_version else None, found_via=label
            )
    return None


def sanitizer_command(
    info: SanitizerInfo,
    tool: SanitizerTool | str,
    argv: Sequence[str],
    *,
    kernel_regex: str | None = None,
    launch_count: int | None = None,
    launch_skip: int | None = None,
    xml_path: str | os.PathLike[str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    print_limit: int | None = None,
    error_exitcode: int | None = None,
    target_processes_all: bool = False,
) -> list[str]:
    """The argv that runs ``argv`` under one compute-sanitizer tool.

    Flags as documented for compute-sanitizer 2023+ (and measured with 2025.3.1):
    ``--kernel-name regex=...`` filters kernels (the older ``--kernel-regex`` was renamed);
    ``--launch-count N`` / ``--launch-skip N`` bound which launches are checked (memcheck costs
    ~47x, racecheck ~35,000x: check one launch of a minimal probe); ``--xml yes --save FILE``
    is the only machine-readable output (there is no JSON); ``--log-file`` takes the text report
    off the child's stderr.
    """
    tool = SanitizerTool(tool)
    if not argv:
        raise ValueError("sanitizer_command: empty argv (nothing to run)")
    cmd = [info.path, "--tool", tool.value]
    if kernel_regex is not None:
        if not kernel_regex or "," in kernel_regex:
            # the value is a key=value list separated by commas: a comma would split the regex
            raise ValueError(f"kernel_regex must be non-empty and contain no comma: {kernel_regex!r}")
        cmd += ["--kernel-name", f"regex={kernel_regex}"]
    for flag, value in (("--launch-count", launch_count), ("--launch-skip", launch_skip)):
        if value is not None:
            if value < (1 if flag == "--launch-count" else 0):
                raise ValueError(f"{flag} must be {'>= 1' if flag == '--launch-count' else '>= 0'}: {value}")
            cmd += [flag, str(value)]
    if print_limit is not None:
        if print_limit < 0:
            raise ValueError(f"print_limit must be >= 0 (0 = no limit): {print_limit}")
        cmd += ["--print-limit", str(print_limit)]
    if error_exitcode is not None:
        cmd += ["--error-exitcode", str(error_exitcode)]
    if target_processes_all:
        cmd += ["--target-processes", "all"]
    if xml_path is not None:
        # `--xml` is a flag in 2025.3: "--xml yes" fails with "extra yes detected on the input
        # command line" (validation run 3 on H200)
        cmd += ["--xml", "--save", os.fspath(xml_path)]
    if log_path is not None:
        cmd += ["--log-file", os.fspath(log_path)]
    return cmd + list(argv)


# ---------------------------------------------------------------------------------------------
# Records of a parsed report
# ---------------------------------------------------------------------------------------------

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
    tool: str | None = None  # memcheck / racecheck / initcheck / synccheck, inferred from records
    legacy_cuda_memcheck: bool = False  # the pre-2021 "CUDA-MEMCHECK" tool wrote it
    version: str | None = None  # when the log carries a version banner
    errors: tuple[SanitizerError, ...] = ()
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


# ---------------------------------------------------------------------------------------------
# Text parser
# ---------------------------------------------------------------------------------------------

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


def parse_int(text: str) -> int:
    """'131,072' -> 131072; '0x7f..' -> int."""
    text = text.strip()
    if text.lower().startswith("0x"):
        return int(text, 16)
    return int(text.replace(",", ""))


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
                function=fl.group("func").strip(), pc=pc, file=fl.group("file"), line=int(fl.group("line"))
            )
        return CodeLocation(function=rest, pc=pc)
    m = _LOC_NEW.match(text)
    if m:
        return CodeLocation(
            function=m.group("func").strip(),
            pc=parse_int(m.group("pc")),
            file=m.group("file"),
            line=int(m.group("line")) if m.group("line") else None,
        )
    m = _LOC_PAREN_PC.match(text)
    if m:
        return CodeLocation(function=m.group("func").strip(), pc=parse_int(m.group("pc")))
    m = _LOC_FUNC_IN_FILE.match(text)
    if m:
        return CodeLocation(function=m.group("func").strip(), file=m.group("file"), line=int(m.group("line")))
    fl = _LOC_FILE_LINE_FUNC.match(text)
    if fl:
        return CodeLocation(
            function=fl.group("func").strip(), file=fl.group("file"), line=int(fl.group("line"))
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
                line=int(fm.group("line")),
            )
        return HostFrame(raw=raw, function=raw or None)
    func = m.group("func").strip() or None
    module = m.group("module").strip() if m.group("module") else None
    file: str | None = None
    line: int | None = None
    if func:
        fm = _HF_FUNC_FILE.match(func)
        if fm:
            func, file, line = fm.group("func").strip() or None, fm.group("file"), int(fm.group("line"))
        else:
            ff = _HF_FILE_FUNC.match(func)
            if ff:
                func, file, line = ff.group("func").strip(), ff.group("file"), int(ff.group("line"))
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
    a, b, c = (int(x) for x in text.split(","))
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
            cuda_error_code=int(m.group("code")) if m.group("code") else None,
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


def _infer_tool(errors: Sequence[SanitizerError], saw_race_summary: bool) -> str | None:
    cats = {e.category for e in errors}
    if "race" in cats or saw_race_summary:
        return SanitizerTool.RACECHECK.value
    if "uninitialized" in cats:
        return SanitizerTool.INITCHECK.value
    if any(
        "barrier" in e.message.lower() or "sync" in e.message.lower() for e in errors if e.category == "other"
    ):
        return SanitizerTool.SYNCCHECK.value
    if cats & {"invalid-access", "api-error"}:
        return SanitizerTool.MEMCHECK.value
    return None


def group_errors(errors: Iterable[SanitizerError], *, max_addresses: int = 64) -> tuple[ErrorGroup, ...]:
    """Fold identical errors: same category, kernel, memory space, access, size and pc."""
    order: list[tuple[object, ...]] = []
    members: dict[tuple[object, ...], list[SanitizerError]] = {}
    for e in errors:
        loc = e.location
        key: tuple[object, ...] = (
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
        if key not in members:
            members[key] = []
            order.append(key)
        members[key].append(e)
    groups: list[ErrorGroup] = []
    for key in order:
        ms = members[key]
        addrs: list[int] = []
        seen: set[int] = set()
        for e in ms:
            if e.address is not None and e.address not in seen:
                seen.add(e.address)
                if len(addrs) < max_addresses:
                    addrs.append(e.address)
        threads = {(e.block, e.thread) for e in ms if e.thread is not None}
        first = ms[0]
        groups.append(
            ErrorGroup(
                category=first.category,
                kernel=first.kernel,
                space=first.space,
                access=first.access,
                size=first.size,
                location=first.location,
                count=len(ms),
                addresses=tuple(addrs),
                distinct_addresses=len(seen),
                threads=len(threads),
                first=first,
                complete=all(e.complete for e in ms),
            )
        )
    return tuple(groups)


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
    done: list[SanitizerError] = []
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
            done.append(b.build())

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
    errors = tuple(done)
    return SanitizerReport(
        tool=_infer_tool(errors, race_summary is not None),
        legacy_cuda_memcheck=legacy,
        version=version,
        errors=errors,
        groups=group_errors(errors),
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


# ---------------------------------------------------------------------------------------------
# XML parser (``--xml yes --save FILE``)
# ---------------------------------------------------------------------------------------------


def parse_sanitizer_xml(path_or_text: str | os.PathLike[str]) -> SanitizerReport:
    """Best-effort reader of compute-sanitizer's XML report.

    We have no recorded XML file yet (no public one was found; the lead will record ours), so
    this reader does not assume element names: every element whose text holds a record line
    that the text parser knows ("Invalid __global__ write of size 16 bytes", "Access to 0x...",
    ...) is fed to the text parser, and numeric address/size elements are picked up by name
    (``address``, ``size``, ``*Address``). Malformed or truncated XML is parsed as text.
    """
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str)
        and "\n" not in path_or_text
        and not path_or_text.lstrip().startswith("<")
    ):
        text = Path(path_or_text).read_text(encoding="utf-8", errors="replace")
    else:
        text = str(path_or_text)
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        # truncated or not XML at all: read whatever record lines sit between the tags
        return parse_sanitizer_log(_pseudo_log(re.sub(r"<[^>]+>", "\n", text).splitlines()))
    lines: list[str] = []
    for elem in root.iter():
        lines.extend((elem.text or "").splitlines())
    return parse_sanitizer_log(_pseudo_log(lines))


def _pseudo_log(lines: Iterable[str]) -> str:
    """Re-prefix bare record lines so the text parser reads them: headers and summaries at the
    top level, everything else as a continuation."""
    out: list[str] = []
    for ln in lines:
        ln = ln.strip()
        if not ln:
            continue
        top = (
            _start_record(ln, "") is not None
            or bool(_ERROR_SUMMARY.match(ln) or _NOT_PRINTED.match(ln) or _RACE_SUMMARY.match(ln))
            or ln in ("COMPUTE-SANITIZER", "CUDA-MEMCHECK")
        )
        out.append(("========= " if top else "=========     ") + ln)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# The caching allocator's own map: segments, blocks and who allocated them
# ---------------------------------------------------------------------------------------------
#
# The child (``probes/snapshot.py``) reduces ``torch.cuda.memory._snapshot()`` to these records
# and hands them back as the outcome fact ``allocator_snapshot``. An address that no registered
# tensor holds may still lie in a block the allocator handed out (a temporary, a freed output,
# a canary), and the allocator knows which line of Python asked for it.

BlockState = Literal["active_allocated", "active_pending_free", "inactive"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocFrame:
    """One Python frame of an allocating stack (the innermost frame in user code)."""

    file: str
    line: int
    name: str

    def render(self) -> str:
        """``conditions.py:97 in make_operands``"""
        return f"{os.path.basename(self.file)}:{self.line} in {self.name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocBlock:
    """A piece of a segment: handed out (``active_allocated``), freed while another stream may
    still use it (``active_pending_free``), or free in the cache (``inactive``)."""

    address: int
    size: int  # bytes the block spans (rounded up from the request)
    state: BlockState
    requested_size: int | None = None  # bytes asked for, when the allocator kept it
    frame: AllocFrame | None = None  # who allocated it (the block's own frames; live blocks only)

    @property
    def end(self) -> int:
        return self.address + self.size


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocSegment:
    """One cudaMalloc (or expandable mapping) the allocator holds, split into blocks."""

    device: int  # CUDA ordinal inside the child
    address: int
    size: int  # total_size
    stream: int  # the stream the segment was allocated for (cudaStream_t as an integer)
    pool: str = ""  # "large" (blocks over 1 MiB) or "small"
    expandable: bool = False  # expandable_segments: pages can be unmapped under a live address
    frame: AllocFrame | None = None  # who asked for the cudaMalloc
    blocks: tuple[AllocBlock, ...] = ()

    @property
    def end(self) -> int:
        return self.address + self.size


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocHistory:
    """One ``alloc`` action of the allocator's recorded history, and whether it was freed since."""

    device: int
    address: int
    size: int
    stream: int
    frame: AllocFrame | None = None
    freed: bool = False  # a later free_requested / free_completed of the same address
    free_frame: AllocFrame | None = None  # who freed it, when the history kept a stack

    @property
    def end(self) -> int:
        return self.address + self.size


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocatorSnapshot:
    """The outcome fact ``allocator_snapshot``: the caching allocator's segments after the probe
    (on every device), and the allocations it recorded while the probe ran, latest last."""

    schema_version: int = SCHEMA_VERSION
    taken: bool
    reason: str = ""  # why it was not taken, or what went wrong taking it
    segments: tuple[AllocSegment, ...] = ()
    history: tuple[AllocHistory, ...] = ()
    truncated: bool = False  # blocks or history entries were left out (the caps in the child)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotPlace:
    """Where an address lies in the allocator's map."""

    address: int
    device: int
    segment: AllocSegment
    block: AllocBlock | None  # the block holding it (None if the blocks were cut by the cap)
    allocation: AllocHistory | None  # the latest recorded allocation that covered it

    @property
    def frame(self) -> AllocFrame | None:
        """Who allocated the memory at this address: the live block's own stack, else the
        latest recorded allocation over it, else the segment's."""
        if self.block is not None and self.block.frame is not None:
            return self.block.frame
        if self.allocation is not None and self.allocation.frame is not None:
            return self.allocation.frame
        return self.segment.frame


def read_allocator_snapshot(value: object) -> AllocatorSnapshot | None:
    """The ``allocator_snapshot`` fact as a record; None when absent or unreadable."""
    if not isinstance(value, dict):
        return None
    try:
        return from_jsonable(AllocatorSnapshot, value)
    except (TypeError, ValueError, KeyError):
        return None


def locate_in_snapshot(address: int, snapshot: AllocatorSnapshot) -> SnapshotPlace | None:
    """The segment, block and latest recorded allocation holding ``address``; None when no
    segment of any device holds it."""
    segment = next((s for s in snapshot.segments if s.address <= address < s.end), None)
    if segment is None:
        return None
    block = next((b for b in segment.blocks if b.address <= address < b.end), None)
    allocation = None
    for h in reversed(snapshot.history):  # latest first
        if h.device == segment.device and h.address <= address < h.end:
            allocation = h
            break
    return SnapshotPlace(
        address=address, device=segment.device, segment=segment, block=block, allocation=allocation
    )


_STATE_WORDS = {
    "active_allocated": "a live block",
    "active_pending_free": "a block freed while a stream may still use it",
    "inactive": "a freed block",
}


def snapshot_sentence(place: SnapshotPlace) -> str:
    """``inside a freed block (131,072 bytes at 0x7f..., byte 1,024 of it) of segment 0x7f...
    (2,097,152 bytes, small pool, stream 0x0) on cuda:0, allocated at grouped_gemm.py:210 in
    moe_grouped_gemm and freed since``"""
    seg = place.segment
    pool = f", {seg.pool} pool" if seg.pool else ""
    expandable = ", expandable" if seg.expandable else ""
    where = (
        f"segment 0x{seg.address:x} ({seg.size:,} bytes{pool}{expandable}, stream 0x{seg.stream:x}) "
        f"on cuda:{place.device}"
    )
    if place.block is None:
        text = f"inside {where} (its blocks were not all kept)"
    else:
        b = place.block
        text = (
            f"inside {_STATE_WORDS.get(b.state, b.state)} ({b.size:,} bytes at 0x{b.address:x}, "
            f"byte {place.address - b.address:,} of it) of {where}"
        )
    alloc = place.allocation
    own = place.block.frame if place.block is not None else None
    frame = own or (alloc.frame if alloc is not None else None)
    if frame is not None:
        text += f", allocated at {frame.render()}"
        live = place.block is not None and place.block.state == "active_allocated"
        if alloc is not None and alloc.freed and not live:
            text += " and freed since"
            if alloc.free_frame is not None:
                text += f" (at {alloc.free_frame.render()})"
    elif seg.frame is not None:
        text += f"; no recorded allocation covers it, the segment was reserved at {seg.frame.render()}"
    else:
        text += "; allocated before the history was recorded (no stack kept)"
    return text


# ---------------------------------------------------------------------------------------------
# Attribution: which tensor, on which device, does an address belong to
# ---------------------------------------------------------------------------------------------

_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "float": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "double": 8,
    "long": 8,
    "int": 4,
    "complex64": 8,
    "complex128": 16,
}
_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def itemsize(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def describe_tensor(t: TensorInfo) -> str:
    """``x (4096 x 2048 bf16)``"""
    dims = " x ".join(str(d) for d in t.shape) or "scalar"
    dt = t.dtype.removeprefix("torch.")
    return f"{t.name} ({dims} {_DTYPE_SHORT.get(dt, dt)})"


def _is_weight_stack(t: TensorInfo) -> bool:
    return len(t.shape) == 3


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMatch:
    """The tensor on one device that holds an address, or the nearest one to it."""

    device: str
    tensor: str
    description: str  # "x (4096 x 2048 bf16)"
    relation: Literal["inside", "after", "before"]
    distance: int  # bytes past the end (1 = the first byte after) or before the start; 0 inside
    offset: int  # address - data_ptr (negative before the start)
    row: int | None = None  # offset // (row stride in bytes); for a weight stack, the row in its expert
    expert: int | None = None  # weight stack (E, N, K): offset // (stride_we * itemsize)


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribution:
    address: int
    access: str  # "read of 16 bytes", "write of 256 bytes", or "access"
    kernel: str | None
    matches: tuple[TensorMatch, ...]  # the nearest tensor on every device, nearest first
    inside_devices: tuple[str, ...]  # devices where the address lies inside a live tensor
    sanitizer_device: str | None  # device whose tensors lie in the allocation compute-sanitizer
    # measured against, when that can be told
    cross_device: bool  # the address is a live tensor on a device other than the one measured
    sentences: tuple[str, ...]
    allocator: SnapshotPlace | None = None  # where the caching allocator's map puts it, if known


def _match(address: int, t: TensorInfo, device: str) -> TensorMatch:
    start, end = t.data_ptr, t.data_ptr + t.nbytes
    offset = address - start
    if start <= address < end:
        relation: Literal["inside", "after", "before"] = "inside"
        distance = 0
    elif address >= end:
        relation, distance = "after", address - end + 1
    else:
        relation, distance = "before", start - address
    size = itemsize(t.dtype)
    row: int | None = None
    expert: int | None = None
    if _is_weight_stack(t) and t.strides and t.strides[0] > 0:
        expert_bytes = t.strides[0] * size
        expert = offset // expert_bytes
        if len(t.strides) > 1 and t.strides[1] > 0:
            row = (offset - expert * expert_bytes) // (t.strides[1] * size)
    elif len(t.shape) >= 2 and t.strides and t.strides[0] > 0:
        row = offset // (t.strides[0] * size)
    elif len(t.shape) == 1:
        row = offset // size  # element index
    return TensorMatch(
        device=device,
        tensor=t.name,
        description=describe_tensor(t),
        relation=relation,
        distance=distance,
        offset=offset,
        row=row,
        expert=expert,
    )


def _nearest_on_device(address: int, tensors: Sequence[TensorInfo], device: str) -> TensorMatch | None:
    best: TensorMatch | None = None
    for t in tensors:
        if t.nbytes <= 0:
            continue
        m = _match(address, t, device)
        if best is None or (m.relation == "inside", -m.distance) > (
            best.relation == "inside",
            -best.distance,
        ):
            best = m
    return best


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _match_sentence(m: TensorMatch, verb: str, tables: Mapping[str, Sequence[TensorInfo]]) -> str:
    t = next(t for t in tables[m.device] if t.name == m.tensor)
    if m.relation == "inside":
        where = f"inside {m.description} on {m.device}, byte offset {m.offset:,}"
        if m.expert is not None:
            where += f": expert {m.expert}" + (f", row {m.row}" if m.row is not None else "")
        elif m.row is not None:
            where += f": {'element' if len(t.shape) == 1 else 'row'} {m.row}"
        return where
    side = "past the end of" if m.relation == "after" else "before the start of"
    text = f"{verb} {_plural(m.distance, 'byte')} {side} {m.description} on {m.device}"
    if m.expert is not None:
        n_exp = t.shape[0]
        text += f": expert {m.expert} of {n_exp}"
        if m.relation == "after":
            text += f", i.e. an expert id >= {n_exp} (out-of-range routing, or an offset that wrapped) fits"
        else:
            text += ", i.e. a negative expert offset (an int32 product that wrapped negative) fits"
    elif m.row is not None and len(t.shape) >= 2:
        text += f": row {m.row}"
        if m.relation == "after":
            text += f", i.e. rows past M={t.shape[0]} (m_sizes summing past M fits)"
    elif m.row is not None:
        text += f": element {m.row} of {t.shape[0] if t.shape else 0}"
    return text


def attribute_address(
    address: int,
    tensor_tables: Mapping[str, Sequence[TensorInfo]],
    *,
    access: str = "access",
    kernel: str | None = None,
    nearest: NearestAllocation | None = None,
    reported_out_of_bounds: bool = True,
    snapshot: AllocatorSnapshot | None = None,
) -> Attribution:
    """Place one address against the tensors known on every device, and, given the child's
    allocator snapshot, against the caching allocator's segments and blocks (which also know
    memory no registered tensor holds: temporaries, freed outputs, and who allocated them)."""
    matches: list[TensorMatch] = []
    for device, tensors in tensor_tables.items():
        m = _nearest_on_device(address, tensors, device)
        if m is not None:
            matches.append(m)
    matches.sort(key=lambda m: (m.relation != "inside", m.distance))
    inside = tuple(m.device for m in matches if m.relation == "inside")
    # the allocation compute-sanitizer measured against: which device's tensors lie in it?
    sanitizer_device: str | None = None
    if nearest is not None:
        for device, tensors in tensor_tables.items():
            if any(nearest.base <= t.data_ptr < nearest.end for t in tensors):
                sanitizer_device = device
                break
    verb = access.split(" ")[0] if access != "access" else "accessed"
    sentences: list[str] = []
    cross = False
    if not matches:
        sentences.append(f"0x{address:x}: no tensor is known on any device to place it against.")
    else:
        for m in matches:
            sentences.append(_match_sentence(m, verb, tensor_tables) + ".")
        if inside and reported_out_of_bounds:
            others = [d for d in tensor_tables if d not in inside]
            measured = sanitizer_device if sanitizer_device and sanitizer_device not in inside else None
            if sanitizer_device in inside:
                sentences.append(
                    f"compute-sanitizer measured it against an allocation on {sanitizer_device}, the device "
                    "that holds the tensor: a freed or unmapped block (expandable segments) fits better than "
                    "a cross-GPU read."
                )
            elif measured or others:
                cross = True
                dev_list = ", ".join(inside)
                ran_on = measured or (others[0] if len(others) == 1 else "another GPU")
                sentences.append(
                    f"This address is inside a live tensor on another GPU ({dev_list}), yet compute-sanitizer "
                    f"called it out of bounds: the kernel most likely ran on {ran_on} and dereferenced "
                    f"{dev_list} memory (compute-sanitizer reports a cross-GPU dereference as plain "
                    "out-of-bounds, measured against the wrong device's allocation)."
                )
    place = locate_in_snapshot(address, snapshot) if snapshot is not None and snapshot.taken else None
    if place is not None:
        sentences.append(f"Allocator: 0x{address:x} is {snapshot_sentence(place)}.")
    elif snapshot is not None and snapshot.taken:
        sentences.append(
            f"Allocator: 0x{address:x} lies in no segment the caching allocator holds on any device "
            "(memory from outside the allocator, or not mapped at all)."
        )
    return Attribution(
        address=address,
        access=access,
        kernel=kernel,
        matches=tuple(matches),
        inside_devices=inside,
        sanitizer_device=sanitizer_device,
        cross_device=cross,
        sentences=tuple(sentences),
        allocator=place,
    )


def attribute(
    report: SanitizerReport,
    tensor_tables: Mapping[str, Sequence[TensorInfo]],
    *,
    snapshot: AllocatorSnapshot | None = None,
) -> tuple[Attribution, ...]:
    """Attribute every distinct faulting address of the report (one per group and address).

    ``tensor_tables`` maps a device string ("cuda:0") to the tensors known on it (our probes'
    ``Outcome.tensors``); include every device, since a cross-GPU dereference shows up as an
    out-of-bounds address that is a live tensor on the other GPU. ``snapshot`` is the same run's
    ``allocator_snapshot`` fact (``read_allocator_snapshot``), when it has one.
    """
    out: list[Attribution] = []
    for g in report.groups:
        e = g.first
        access = f"{e.access} of {_plural(e.size, 'byte')}" if e.access and e.size is not None else "access"
        for addr in g.addresses:
            member = next((m for m in report.errors if m.address == addr and m.kernel == g.kernel), e)
            out.append(
                attribute_address(
                    addr,
                    tensor_tables,
                    access=access,
                    kernel=g.kernel,
                    nearest=member.nearest,
                    reported_out_of_bounds=member.out_of_bounds or member.category == "invalid-access",
                    snapshot=snapshot,
                )
            )
    return tuple(out)
