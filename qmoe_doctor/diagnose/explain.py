"""Explain a saved compute-sanitizer log or Python traceback from a user's run.

A log alone rarely proves a cause: this module says what the text shows (kernel, access,
nearest allocation, user frames, the CUDA error) and which causes of the catalogue *fit* it and
why, then names the ``qmoe-doctor`` command whose differential evidence would settle it.

The text is read by ``sanitizer_log`` (compute-sanitizer's records) and ``traceback`` (frames,
exception lines, device-side asserts); error kinds come from
``qmoe_doctor.core.error_kind.classify_error``, the same classifier probe outcomes use.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.conditions import DEFAULT_CONDITIONS
from qmoe_doctor.core.error_kind import CUDA_ERROR_OF, classify_error, cuda_error_kind, pointer_arg_index
from qmoe_doctor.core.records import SCHEMA_VERSION, Condition, ErrorKind, is_cuda_error
from qmoe_doctor.diagnose.device_assert import overflow_check
from qmoe_doctor.diagnose.log_lines import LogNumberError, parse_int
from qmoe_doctor.diagnose.sanitizer_log import (
    CodeLocation,
    ErrorGroup,
    HostFrame,
    SanitizerError,
    SanitizerReport,
    looks_like_sanitizer_log,
    parse_sanitizer_log,
    short_function_name,
)
from qmoe_doctor.diagnose.scan_rules import SETTLED_BY
from qmoe_doctor.diagnose.traceback import (
    PyFrame,
    TracebackReport,
    bare_cuda_error,
    is_user_path,
    looks_like_traceback,
    parse_traceback,
)

InputKind = Literal["sanitizer-log", "traceback", "both"]
_DEVICES = re.compile(r"\bcuda:(\d+)")
# Triton's pointer-argument refusal with an index no kernel has (pointer_arg_index reads six digits)
_HUGE_POINTER_ARG = re.compile(r"Pointer argument \(at \d{1000,}\)", re.IGNORECASE)
_RESOURCES = re.compile(
    r"out of resource: (?P<what>[\w ]+?), Required: (?P<req>\d+), Hardware limit: (?P<lim>\d+)"
)
# the source line of a launch: `kernel[grid](...)` (the grid may index: `k[(cdiv(x.shape[0], 64),)](`),
# or Inductor's `triton_poi_..._0.run(...)`
_LAUNCH_CODE = re.compile(r"(?P<jit>\w+)\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(|\b(?P<inductor>triton_\w+)\.run\(")
_TRITON_LAUNCH = re.compile(r"/triton/(runtime|backends|compiler)/")
# torch's line under a CUDA error: "Search for `cudaErrorMisalignedAddress' in https://docs.nvidia..."
_TORCH_SEARCH = re.compile(r"Search for `(cudaError\w+)'")
_FAR = 64 * 2**20  # an access this far from any allocation is not an off-by-a-few row


@dataclass(frozen=True, slots=True, kw_only=True)
class CauseFit:
    cause: str  # id from qmoe_doctor.core.causes
    title: str
    why: str  # what in this text fits the cause
    settle: str  # the qmoe-doctor command whose differential evidence would prove or clear it


@dataclass(frozen=True, slots=True, kw_only=True)
class Explanation:
    schema_version: int = SCHEMA_VERSION
    source: str
    input_kind: InputKind
    findings: bool  # the text shows an error, fault or hazard (exit 1); False for a clean run
    headline: str
    error_kind: ErrorKind | None = None
    kernel: str | None = None
    facts: tuple[str, ...] = ()
    user_frames: tuple[str, ...] = ()  # "file:line in function", outermost first
    assert_site: str | None = None  # "file.py:123" of a device-side assertion
    pointer_argument: int | None = None  # index from Triton's pointer check
    resources: tuple[int, int] | None = None  # (required, limit) bytes of an OutOfResources
    fits: tuple[CauseFit, ...] = ()
    next_steps: tuple[str, ...] = ()
    caveats: tuple[str, ...] = ()
    sanitizer: SanitizerReport | None = None
    traceback: TracebackReport | None = None


class NothingToExplain(ValueError):
    """The text is neither a compute-sanitizer log nor a Python traceback."""


def _fit(cause: str, why: str, settle: str) -> CauseFit:
    return CauseFit(cause=cause, title=CAUSES[cause].title, why=why, settle=settle)


def _kernel_spec(frames: Sequence[PyFrame]) -> str:
    """``path.py:function`` of the wrapper that launched the Triton kernel, when the traceback
    shows it (the last frame before Triton's own); else a placeholder."""
    for i, f in enumerate(frames):
        if _TRITON_LAUNCH.search(f.file) and i > 0:
            caller = frames[i - 1]
            if not _TRITON_LAUNCH.search(caller.file) and caller.file.endswith(".py"):
                return f"{caller.file}:{caller.function}"
    return "path.py:fn"  # the launch is not in the traceback (an asynchronous error surfaced later)


def _gpus(text: str) -> str:
    found = sorted({parse_int(d) for d in _DEVICES.findall(text)})
    if len(found) >= 2:
        return ",".join(str(d) for d in found)
    return "0,1"


def _repro(gpus: str, kernel: str) -> str:
    """``qmoe-doctor repro --gpus A,B --kernel REF``: run the user's kernel the way it failed."""
    return f"qmoe-doctor repro --gpus {gpus} --kernel {kernel}"


def _scan(gpus: str, kernel: str, only: Sequence[str] = ()) -> str:
    """``qmoe-doctor scan --gpus A,B --kernel REF [--only C1,C2]``: the cells whose differential
    evidence settles a cause. Every condition must be one that scan plans (a typo here would hand
    the user a command that runs nothing), so a wrong one fails loudly in the tests."""
    cmd = f"qmoe-doctor scan --gpus {gpus} --kernel {kernel}"
    if only:
        for name in only:
            if Condition(name) not in DEFAULT_CONDITIONS:
                raise ValueError(f"scan does not plan condition {name!r}")
        cmd += " --only " + ",".join(only)
    return cmd


def _int32_overflow(text: str) -> bool:
    try:
        found = overflow_check(text)
    except ValueError:  # "int999...9 overflow": int() refuses thousands of digits
        raise LogNumberError("its overflow check names an integer width of thousands of digits") from None
    return found is not None and found[0] == 32


def _first_gpu(gpus: str) -> str:
    """The int32-boundary cell needs one GPU only: the first of the pair."""
    return gpus.split(",")[0]


# the scan cells that tell each cause apart from the others (the sets the scan's rules cite)
_ROUTING = SETTLED_BY["invalid-routing"]
_GUARD = SETTLED_BY["missing-device-guard"]
_BUFFER = SETTLED_BY["default-device-buffer"]
_INT32 = SETTLED_BY["int32-offset-overflow"]
_STREAM = SETTLED_BY["wrong-device-stream"]
_ALIGNMENT = SETTLED_BY["misaligned-operand"]
# narrower sets, where the text already rules part of a cause's cells out
_SIZES_RACE = (Condition.PEER, Condition.SIZES_RACE)
_PRODUCER_RACE = (Condition.PEER, Condition.PRODUCER_RACE)
_NEVER_SET = (Condition.UNTOUCHED, Condition.NO_PEER)
_MIXED_DEVICES = (Condition.UNTOUCHED, Condition.NO_PEER, Condition.PEER)


def _bytes(n: int) -> str:
    return f"{n:,} byte" + ("" if n == 1 else "s")


def _group_fact(g: ErrorGroup) -> str:
    e = g.first
    kernel = short_function_name(g.kernel) if g.kernel else "an unnamed kernel"
    where = ""
    if e.location is not None:
        loc: CodeLocation = e.location
        if loc.file and loc.line is not None:
            where = f" at {loc.file}:{loc.line}"
        if loc.pc is not None:
            where += f" (pc 0x{loc.pc:x})"
    times = f"{g.count} time{'s' if g.count != 1 else ''}"
    if e.category in ("invalid-access", "uninitialized"):
        what = "uninitialized " if e.category == "uninitialized" else "invalid "
        size = f" of {_bytes(e.size)}" if e.size is not None else ""
        text = f"{what}__{e.space}__ {e.access}{size} in {kernel}{where}: {times}"
        if g.distinct_addresses:
            text += f", {g.distinct_addresses} distinct address{'es' if g.distinct_addresses != 1 else ''}"
        if e.thread is not None and e.block is not None:
            text += f"; first by thread {e.thread} in block {e.block}"
    elif e.category == "race":
        parts = [
            f"{a.access} at {a.location.render()}" + (f" [{a.hazards} hazards]" if a.hazards else "")
            for a in e.race_accesses
        ]
        text = f"{e.severity or 'race'}: shared-memory race between " + " and ".join(parts)
    elif e.category == "api-error":
        code = f" (error {e.cuda_error_code})" if e.cuda_error_code is not None else ""
        text = (
            f'{e.cuda_error}{code} "{e.cuda_error_text or ""}" returned by {e.api_call or "a CUDA API call"}'
        )
    else:
        text = f"{e.message}: {times}"
    if not g.complete:
        text += " (record cut off in the log)"
    return text


def _address_fact(e: SanitizerError) -> str | None:
    if e.address is None:
        return None
    text = f"address 0x{e.address:x}"
    if e.misaligned:
        return text + " is misaligned"
    n = e.nearest
    if n is None:
        return text + (" is out of bounds (no nearest allocation printed)" if e.out_of_bounds else "")
    if n.relation == "inside":
        return text + f" is inside the nearest allocation (0x{n.base:x}, {_bytes(n.size)}) yet reported"
    # AddressSanitizer's count (the first byte after is "0 bytes after"); the log's is one more
    return text + f" is {_bytes(n.gap)} {n.relation} the nearest allocation, a {n.size:,}-byte region at 0x{n.base:x}"


# Python files of Triton's and torch's launch path. compute-sanitizer 2025.x prints Python host
# frames innermost first with a bare file name ("__call__ in driver.py:713", "run in jit.py:744"),
# so user code is told apart by position: the frames outside the last of these.
_LAUNCH_PATH_FILES = frozenset(
    {"driver.py", "jit.py", "autotuner.py", "compiler.py", "_contextlib.py", "module.py", "function.py"}
)


def _user_host_frames(errors: Sequence[SanitizerError]) -> list[str]:
    out: list[str] = []
    for e in errors:
        frames = [h for h in e.host_frames if h.file]
        last_lib = max(
            (i for i, h in enumerate(frames) if (h.file or "").rsplit("/", 1)[-1] in _LAUNCH_PATH_FILES),
            default=-1,
        )
        for i, h in enumerate(frames):
            file = h.file or ""
            if i <= last_lib or not is_user_path(file):
                continue
            s = f"{file}:{h.line}" + (f" in {h.function}" if h.function else "")
            if s not in out:
                out.append(s)
    return out


def _python_in_backtrace(frames: Sequence[HostFrame]) -> bool:
    return any(
        (h.module or "").rsplit("/", 1)[-1].startswith(("python", "libpython")) or h.is_python_source
        for h in frames
    )


def _sanitizer_fits(report: SanitizerReport, kernel: str, gpus: str) -> tuple[list[CauseFit], list[str]]:
    fits: list[CauseFit] = []
    caveats: list[str] = []
    seen: set[str] = set()

    def add(cause: str, why: str, settle: str) -> None:
        if cause not in seen:
            seen.add(cause)
            fits.append(_fit(cause, why, settle))

    if report.tool_failures:
        caveats.append(
            f"compute-sanitizer failed during the run ({report.tool_failures[0]}): the records before it are "
            "what it saw; the rest of the run was not checked. Rerun on a smaller case of the same fault."
        )
    for e in report.errors:
        if e.category == "invalid-access" and e.space == "shared":
            caveats.append(
                "An invalid __shared__ access stays inside one block's tiles: no cross-GPU cause fits it. "
                "compute-sanitizer has also misreported shared accesses of Hopper WGMMA instructions "
                "(NVIDIA/compute-sanitizer-samples #19)."
            )
            continue
        if e.category == "invalid-access" and e.misaligned:
            add(
                "misaligned-operand",
                "the address is misaligned for the access's size: a base or stride off the 16-byte grid (a "
                "sliced view, a storage offset) fed to vectorized or TMA accesses",
                _scan(_first_gpu(gpus), kernel, _ALIGNMENT),
            )
            caveats.append("A misaligned access is not a placement fault: no cross-GPU cause fits it.")
            continue
        if e.category == "invalid-access":
            n = e.nearest
            if n is not None and n.relation == "after" and n.distance < _FAR:
                add(
                    "invalid-routing",
                    f"the access lands {_bytes(n.gap)} after the end of a {n.size:,}-byte allocation: a "
                    "row or expert just past a tensor, what m_sizes summing past M or an expert id >= E give",
                    _scan(gpus, kernel, _ROUTING),
                )
                add(
                    "cross-device-stream-race",
                    "the same shape appears when m_sizes is read before its producer (on another GPU's "
                    "stream) finished writing it: stale sizes walk past the rows",
                    _scan(gpus, kernel, _SIZES_RACE),
                )
            if n is not None and n.relation == "before" and n.size >= 2**31:
                add(
                    "int32-offset-overflow",
                    f"the address is {_bytes(n.gap)} before an allocation of {_bytes(n.size)} (more than "
                    "2**31 bytes): an int32 index x stride product that wrapped negative lands before the base",
                    _scan(_first_gpu(gpus), kernel, _INT32),
                )
            if n is not None and n.relation != "inside" and n.distance >= _FAR:
                add(
                    "missing-device-guard",
                    f"the address is {_bytes(n.gap)} {n.relation} the nearest allocation of the device that ran "
                    "the kernel: compute-sanitizer reports a dereference of another GPU's memory this way",
                    _scan(gpus, kernel, _GUARD),
                )
                add(
                    "default-device-buffer",
                    "a helper or output buffer allocated on the current device instead of the input's gives "
                    "the same far-away pointer",
                    _scan(gpus, kernel, _BUFFER),
                )
            if n is not None and n.relation == "inside":
                add(
                    "expandable-segments-unmap",
                    "the address is inside the nearest allocation yet reported: memory mapped as one range but "
                    "partly unmapped (expandable segments, pytorch #196209) fits",
                    _repro(gpus, kernel),
                )
            if n is None and e.out_of_bounds:
                for cause in ("invalid-routing", "int32-offset-overflow", "missing-device-guard"):
                    add(
                        cause,
                        "an out-of-bounds global access without a nearest allocation (older compute-sanitizer "
                        "output) fits any index or placement fault; the log cannot tell them apart",
                        _scan(gpus, kernel),
                    )
        elif e.category == "api-error":
            err = (e.cuda_error or "").lower()
            api_kind = cuda_error_kind(e.cuda_error or "")
            if api_kind in (ErrorKind.MISALIGNED_ADDRESS, ErrorKind.ILLEGAL_INSTRUCTION):
                for fit in _misaligned_or_tma_fits(api_kind, kernel, gpus):
                    add(fit.cause, f"{e.cuda_error} at a CUDA API call: {fit.why}", fit.settle)
            elif "illegaladdress" in err:
                add("invalid-routing", "an illegal address surfaced at a CUDA API call", _scan(gpus, kernel))
                add(
                    "cross-device-stream-race",
                    "an illegal address surfaced at a CUDA API call",
                    _scan(gpus, kernel),
                )
            elif "launchfailure" in err:
                add(
                    "invalid-routing",
                    "under memcheck an out-of-bounds access aborts the kernel, and the next CUDA call reports "
                    "an unspecified launch failure (measured: our over-routed cell on 2x H200)",
                    _scan(gpus, kernel, _ROUTING),
                )
                add(
                    "int32-offset-overflow",
                    "an unspecified launch failure is also how some drivers surface Triton's int32 overflow "
                    "assertion (triton #11349)",
                    _scan(_first_gpu(gpus), kernel, _INT32),
                )
            elif "assert" in err:
                add(
                    "int32-offset-overflow",
                    "a device-side assert at a CUDA API call",
                    _scan(_first_gpu(gpus), kernel, _INT32),
                )
        elif e.category == "other" and (hw := hardware_exception_kind(e.message)) is not None:
            for fit in _misaligned_or_tma_fits(hw, kernel, gpus):
                add(fit.cause, f"memcheck: {e.message}: {fit.why}", fit.settle)
        elif e.category == "uninitialized":
            add(
                "cross-device-stream-race",
                "the kernel read global memory nothing had written yet: a kernel that runs before its producer "
                "(another stream or GPU) fits",
                _scan(gpus, kernel, _PRODUCER_RACE),
            )
            add(
                "wrong-device-stream",
                "a launch on a stream that does not wait for the producer reads unwritten memory the same way",
                _scan(gpus, kernel, _STREAM),
            )
    if any(e.category == "race" for e in report.errors) or report.racecheck_summary is not None:
        caveats.append(
            "racecheck sees shared-memory hazards only: a race on global memory across streams or GPUs "
            "(cross-device-stream-race) is invisible to it."
        )
    return fits, caveats


#: memcheck's hardware-exception records that name a sticky CUDA error. "Misaligned shared or local
#: address": recorded on one H100 (compute-sanitizer of CUDA 13.0, 2026-12-07) for a device-side
#: TMA descriptor of a global x two bytes off the 16-byte grid, the program ending in "CUDA
#: error: misaligned address" (tests/fixtures/sanitizer/2026-12-07-h100-3d8e2cb); "Illegal
#: Instruction" by its name (not recorded yet). A misaligned PC is no data access: left out.
_HARDWARE_EXCEPTIONS = (
    (re.compile(r"\bmisaligned\b(?!.*\bpc\b)", re.IGNORECASE), ErrorKind.MISALIGNED_ADDRESS),
    (re.compile(r"\billegal instruction\b", re.IGNORECASE), ErrorKind.ILLEGAL_INSTRUCTION),
)


def hardware_exception_kind(message: str) -> ErrorKind | None:
    """The CUDA error a memcheck hardware-exception record ("Misaligned shared or local
    address") stands for, or None."""
    return next((kind for pattern, kind in _HARDWARE_EXCEPTIONS if pattern.search(message)), None)


def _misaligned_or_tma_fits(kind: ErrorKind, kernel: str, gpus: str) -> list[CauseFit]:
    """The causes that fit a misaligned address or an illegal instruction, most likely first."""
    alignment = _fit(
        "misaligned-operand",
        "CUDA refused an access off its width's grid: TMA descriptors and vectorized loads need "
        "16-byte-aligned bases and strides, and a sliced view (a storage offset) breaks that"
        if kind is ErrorKind.MISALIGNED_ADDRESS
        else "a TMA copy whose address is not 16-byte aligned ends in an illegal instruction (triton #7385): "
        "a sliced view (a storage offset) fed to a TMA-descriptor kernel fits",
        _scan(_first_gpu(gpus), kernel, _ALIGNMENT),
    )
    if kind is ErrorKind.MISALIGNED_ADDRESS:
        return [alignment]
    routing = _fit(
        "invalid-routing",
        "a TMA store past the end of its tensor ends in an illegal instruction, not an illegal address "
        "(measured: a persistent TMA-descriptor grouped GEMM over-routed by 64 rows on an H100)",
        _scan(gpus, kernel, _ROUTING),
    )
    return [routing, alignment]


def _traceback_fits(tb: TracebackReport, kind: ErrorKind | None, kernel: str, gpus: str) -> list[CauseFit]:
    """The causes that fit the error ``kind`` a traceback (or any text: an empty ``tb``) shows."""
    fits: list[CauseFit] = []
    msg = tb.exception.message if tb.exception else ""
    if kind is ErrorKind.POINTER_INACCESSIBLE:
        arg = pointer_arg_index(msg)
        which = f"argument {arg}" if arg is not None else "a pointer argument"
        fits.append(
            _fit(
                "missing-device-guard",
                f"Triton's launch check found {which} not accessible from the current device: the tensors "
                "live on another GPU than the current one and peer access is off (or it is a CPU tensor)",
                _scan(gpus, kernel, _GUARD),
            )
        )
        fits.append(
            _fit(
                "default-device-buffer",
                f"{which} may be a buffer made with device='cuda' on the current device while the inputs "
                "live elsewhere (or the reverse)",
                _scan(gpus, kernel, _BUFFER),
            )
        )
        if tb.streams:
            fits.append(
                _fit(
                    "device-never-set",
                    f"several ranks ({', '.join(tb.streams)}) hit it: ranks that never call set_device all "
                    "launch on GPU 0",
                    _scan(gpus, kernel, _NEVER_SET),
                )
            )
    elif kind is ErrorKind.DEVICE_MISMATCH:
        fits.append(
            _fit(
                "default-device-buffer",
                "an aten op saw tensors on two devices: a buffer allocated on the current device instead of "
                "the input's fits",
                _scan(gpus, kernel, _MIXED_DEVICES),
            )
        )
        fits.append(
            _fit(
                "missing-device-guard",
                "a wrapper that allocates or launches on the current device, not the tensors', mixes devices",
                _scan(gpus, kernel, _MIXED_DEVICES),
            )
        )
    elif kind is ErrorKind.DEVICE_ASSERT:
        if any(a.overflow_bits == 32 for a in tb.asserts) or _int32_overflow(msg):
            fits.append(
                _fit(
                    "int32-offset-overflow",
                    "Triton's debug-mode overflow check fired: an int32 index x stride product passed 2**31",
                    _scan(_first_gpu(gpus), kernel, _INT32),
                )
            )
        else:
            fits.append(
                _fit(
                    "invalid-routing",
                    "a device-side assert in a kernel that checks its indices fits routing that does not "
                    "describe the rows (ids out of range, sizes past M)",
                    _scan(gpus, kernel, _ROUTING),
                )
            )
    elif kind is ErrorKind.ILLEGAL_ADDRESS:
        fits.append(
            _fit(
                "invalid-routing",
                "an illegal address in a grouped kernel most often comes from m_sizes or expert ids that do "
                "not describe the rows",
                _scan(gpus, kernel),
            )
        )
        fits.append(
            _fit(
                "cross-device-stream-race",
                "sizes or pointers read before their producer on another stream finished give the same fault",
                _scan(gpus, kernel),
            )
        )
        fits.append(
            _fit(
                "int32-offset-overflow",
                "a wrapped int32 offset can leave the allocation (it usually stays inside, silently wrong)",
                _scan(gpus, kernel),
            )
        )
        fits.append(
            _fit(
                "missing-device-guard",
                "pointers loaded from memory (expert tables, m_sizes on another GPU) skip Triton's launch-time "
                "pointer check and fault here instead",
                _scan(gpus, kernel),
            )
        )
    elif kind in (ErrorKind.MISALIGNED_ADDRESS, ErrorKind.ILLEGAL_INSTRUCTION):
        fits += _misaligned_or_tma_fits(kind, kernel, gpus)
    elif kind is ErrorKind.LAUNCH_FAILURE:
        fits.append(
            _fit(
                "invalid-routing",
                "an unspecified launch failure is a kernel that faulted (under memcheck: stopped at an "
                "out-of-bounds access; measured: our over-routed cell on 2x H200)",
                _scan(gpus, kernel, _ROUTING),
            )
        )
        fits.append(
            _fit(
                "int32-offset-overflow",
                "a wrapped int32 offset that leaves its allocation ends the kernel the same way",
                _scan(_first_gpu(gpus), kernel, _INT32),
            )
        )
    elif kind is ErrorKind.LAUNCH_TIMEOUT:
        fits.append(
            _fit(
                "cross-device-stream-race",
                "a kernel past the watchdog: counts read before their producer finished writing them can be "
                "huge, and a persistent kernel walks them for ever",
                _scan(gpus, kernel, _SIZES_RACE),
            )
        )
        fits.append(
            _fit(
                "invalid-routing",
                "m_sizes summing far past M make a kernel that trusts them walk that many rows",
                _scan(gpus, kernel, _ROUTING),
            )
        )
    elif kind is ErrorKind.ERROR_CONTAINED:
        fits.append(
            _fit(
                "missing-device-guard",
                "CUDA contains certain invalid accesses of peer GPU memory over NVLink this way: a kernel "
                "launched on one GPU dereferencing another's memory fits",
                _scan(gpus, kernel, _GUARD),
            )
        )
    elif kind is ErrorKind.OUT_OF_RESOURCES:
        fits.append(
            _fit(
                "launch-config-fault",
                "Triton refused the launch: the config needs more shared memory than a block may have here",
                _repro(_first_gpu(gpus), kernel),
            )
        )
        fits.append(
            _fit(
                "per-device-state-cached",
                "a config or limit tuned on one GPU model and reused on another gives the same refusal",
                _repro(gpus, kernel),
            )
        )
    elif kind is ErrorKind.INVALID_HANDLE:
        fits.append(
            _fit(
                "thread-without-context",
                "a handle from another device's context, or a thread with no current context",
                _repro(gpus, kernel),
            )
        )
        fits.append(
            _fit(
                "per-device-state-cached",
                "a module or stream cached from the first device and used on another",
                _repro(gpus, kernel),
            )
        )
    elif kind is ErrorKind.OOM:
        fits.append(
            _fit(
                "device-never-set",
                "every rank allocating on GPU 0 runs it out of memory first",
                _repro(gpus, kernel),
            )
        )
        fits.append(
            _fit(
                "default-device-buffer",
                "buffers made with device='cuda' pile up on the current device",
                _repro(gpus, kernel),
            )
        )
    return fits


def _frame_str(f: PyFrame) -> str:
    return f"{f.file}:{f.line} in {f.function}"


def explain_text(text: str, *, source: str = "<text>") -> Explanation:
    """Explain a compute-sanitizer log, a Python traceback, or a file with both.

    Raises NothingToExplain when the text is neither, or is damaged past reading (a number of
    thousands of digits where a line number, an address or a size belongs).
    """
    try:
        return _explain(text, source)
    except LogNumberError as exc:
        raise NothingToExplain(f"{exc}; not a log or a traceback as the tools write them") from None


def _explain(text: str, source: str) -> Explanation:
    if not text.strip():
        raise NothingToExplain("it is empty")
    # a bare "CUDA error: ..." line (a C++ program's, the program's own output beside a log's
    # records): never a clean run, whatever else the text shows
    bare = bare_cuda_error(text)
    named = bare[0] if bare is not None else None
    is_log = looks_like_sanitizer_log(text)
    report = parse_sanitizer_log(text) if is_log else None
    is_tb = looks_like_traceback(text)
    tb = parse_traceback(text) if is_tb else None
    if report is None and tb is None:
        raise NothingToExplain(
            "found neither a compute-sanitizer log (lines starting with '=========') nor a Python traceback"
        )
    input_kind: InputKind = "both" if report and tb else ("sanitizer-log" if report else "traceback")

    facts: list[str] = []
    caveats: list[str] = []
    user_frames: list[str] = []
    fits: list[CauseFit] = []
    kernel_name: str | None = None
    error_kind: ErrorKind | None = None
    gpus = _gpus(text)
    frames = tb.frames if tb else ()
    kernel_spec = _kernel_spec(frames)

    # --- the traceback side ---
    assert_site: str | None = None
    pointer_arg: int | None = None
    resources: tuple[int, int] | None = None
    if tb is not None:
        if tb.exception is not None:
            error_kind = classify_error(tb.exception.type, tb.exception.message)
            searched = _TORCH_SEARCH.search(text)
            if error_kind is ErrorKind.OTHER and searched is not None:
                # torch's "Search for `cudaError...'" line below the exception's first line
                error_kind = cuda_error_kind(searched.group(1)) or error_kind
            facts.append(f"{tb.exception.type}: {tb.exception.message}")
            if _HUGE_POINTER_ARG.search(tb.exception.message):  # "(at 999...)": no kernel has that many
                raise LogNumberError("its pointer argument index has thousands of digits")
            pointer_arg = pointer_arg_index(tb.exception.message)
            if pointer_arg is not None:
                facts.append(
                    f"Triton's launch check refused pointer argument {pointer_arg} (0 = the kernel's first "
                    "pointer parameter): it is not accessible from the device that was current at the launch"
                )
            rm = _RESOURCES.search(tb.exception.message)
            if rm:
                resources = (parse_int(rm.group("req")), parse_int(rm.group("lim")))
                facts.append(
                    f"the launch needs {_bytes(resources[0])} of {rm.group('what')}, the device allows "
                    f"{_bytes(resources[1])} ({resources[0] - resources[1]:,} over)"
                )
            if len({(x.type, x.message) for x in tb.exceptions}) > 1:
                others = [f"{x.stream + ': ' if x.stream else ''}{x.type}" for x in tb.exceptions[1:4]]
                facts.append("further exceptions in the text: " + ", ".join(others))
        if tb.asserts:
            a = tb.asserts[0]
            if error_kind is None or error_kind is ErrorKind.OTHER:
                error_kind = ErrorKind.DEVICE_ASSERT
            assert_site = a.site
            where = f" at {assert_site}" if assert_site else " (the kernel's file:line was not printed)"
            facts.append(
                f"device-side assertion '{a.message}'{where}"
                + (f", block [{a.block}] thread [{a.thread}]" if a.block else "")
            )
            if len(tb.asserts) > 1:
                facts.append(f"{len(tb.asserts)} assertion lines in all")
        user_frames = [_frame_str(f) for f in frames if f.user] or [
            _frame_str(f) for f in tb.other_user_frames
        ]
        for f in reversed(frames):
            m = _LAUNCH_CODE.search(f.code or "")
            if m:
                kernel_name = m.group("jit") or m.group("inductor")
                facts.append(f"Triton kernel launched: {kernel_name} (from {_frame_str(f)})")
                break
        launched_here = any(_TRITON_LAUNCH.search(f.file) for f in frames)
        if is_cuda_error(error_kind) and frames and not launched_here:
            caveats.append(
                "the error surfaced at a later CUDA call (kernel errors are asynchronous): these frames show "
                "where it was noticed, not the launch; CUDA_LAUNCH_BLOCKING=1 makes it surface at the launch"
            )
        if assert_site is not None and kernel_spec == "path.py:fn" and tb.asserts[0].file:
            kernel_spec = f"{tb.asserts[0].file}:fn"
            caveats.append(
                "in the commands, replace fn with the Python function that launches the asserting kernel"
            )
        if tb.truncated:
            caveats.append(
                "the traceback is cut before its exception line: the error itself is not in the text"
            )
        if tb.streams:
            facts.append(f"lines from {len(tb.streams)} ranks/workers: {', '.join(tb.streams)}")

    # --- the sanitizer side ---
    if report is not None:
        tool = report.tool or "compute-sanitizer"
        if report.error_summary is not None:
            facts.append(
                f"{tool}: ERROR SUMMARY {report.error_summary:,} error{'s' if report.error_summary != 1 else ''}"
            )
        if report.racecheck_summary is not None:
            rs = report.racecheck_summary
            facts.append(
                f"racecheck: {rs.displayed} hazard(s) displayed ({rs.errors} errors, {rs.warnings} warnings)"
            )
        for g in report.groups[:6]:
            facts.append(_group_fact(g))
            addr = _address_fact(g.first)
            if addr:
                facts.append(addr)
        if len(report.groups) > 6:
            facts.append(f"... and {len(report.groups) - 6} more distinct error kinds")
        kernels = [g.kernel for g in report.groups if g.kernel and g.category != "api-error"]
        if kernels and kernel_name is None:
            kernel_name = short_function_name(kernels[0])
        user_frames += [s for s in _user_host_frames(report.errors) if s not in user_frames]
        if any(_python_in_backtrace(e.host_frames) for e in report.errors) and not _user_host_frames(
            report.errors
        ):
            caveats.append("the host backtrace shows the Python interpreter but no Python source frames")
        if report.errors and error_kind in (None, ErrorKind.OTHER):
            accesses = [e for e in report.errors if e.category == "invalid-access"]
            api_kinds = [k for e in report.errors if (k := cuda_error_kind(e.cuda_error or "")) is not None]
            hardware = [k for e in report.errors if e.category == "other" and (k := hardware_exception_kind(e.message))]
            if accesses:
                misaligned = all(e.misaligned for e in accesses)
                error_kind = ErrorKind.MISALIGNED_ADDRESS if misaligned else ErrorKind.ILLEGAL_ADDRESS
            elif hardware:
                error_kind = hardware[0]
            elif api_kinds:
                error_kind = api_kinds[0]
        if report.truncated:
            caveats.append(
                "the log has no ERROR SUMMARY line: the run was cut, killed, or the paste is incomplete"
            )
        if report.starts_mid_record:
            caveats.append("the log starts in the middle of a record: earlier errors are missing")
        if report.program_lines:
            facts.append(f"{report.program_lines} lines of program output mixed in (ignored)")
        if len(report.streams) > 1:
            facts.append(
                f"lines from {len(report.streams)} processes: {', '.join(s or '(no prefix)' for s in report.streams)}"
            )
        for note in report.notes:
            caveats.append(f"compute-sanitizer: {note}")
        located = next((g for g in report.groups if g.location and g.location.file), None)
        if located is not None and located.location is not None and kernel_spec == "path.py:fn":
            launched = short_function_name(located.kernel or "?")
            kernel_spec = f"{located.location.file}:fn"
            caveats.append(f"in the commands, replace fn with the Python function that launches {launched}")
        s_fits, s_caveats = _sanitizer_fits(report, kernel_spec, gpus)
        fits += s_fits
        caveats += s_caveats

    from_text = named is not None and error_kind in (None, ErrorKind.OTHER)
    if from_text and named is not None:
        error_kind = named
        assert bare is not None
        facts.append(f"the text names a CUDA error ({named}): {bare[1][:200]}")
        if report is not None and report.clean:
            caveats.append(
                f"compute-sanitizer reported no error in what it checked, yet the program met {named}: the "
                "fault is in a kernel it did not check (a --kernel-name filter, a --launch-count bound) or is "
                "not an access memcheck sees"
            )
    if tb is not None or from_text:
        for fit in _traceback_fits(tb or TracebackReport(), error_kind, kernel_spec, gpus):
            if fit.cause not in {x.cause for x in fits}:
                fits.append(fit)

    findings = bool(tb and (tb.exception or tb.asserts)) or bool(report and report.has_findings) or bool(named)
    clean = bool(report and report.clean) and not (tb and (tb.exception or tb.asserts)) and named is None
    if clean:
        caveats.append(
            "0 errors does not clear the kernel: compute-sanitizer cannot see races across streams or GPUs, "
            "and the caching allocator hides out-of-bounds accesses that stay inside a pooled segment"
        )
    if error_kind in _NO_CAUSE and not fits:
        caveats.append(f"no cause of the catalogue fits {error_kind}: {_NO_CAUSE[error_kind]}")
    # the text names a CUDA error (not the interpreter's assertion of the same kind, on the CPU)
    cuda_named = is_cuda_error(error_kind) and cuda_error_kind(text) is not None
    if cuda_named:
        caveats.append(
            "the CUDA error is sticky: every later CUDA call of the process fails too (often as "
            "'unspecified launch failure'); the first CUDA error the process printed is the fault"
        )
    next_steps: list[str] = []
    for fit in fits:
        if fit.settle not in next_steps:
            next_steps.append(fit.settle)
    if not next_steps:
        next_steps.append(_scan(gpus, kernel_spec))
    if fits:
        caveats.append("a log alone rarely proves a cause: these fit the text; the commands above settle it")

    headline = _headline(error_kind, report, tb, kernel_name, clean, cuda_named=cuda_named)
    return Explanation(
        source=source,
        input_kind=input_kind,
        findings=findings and not clean,
        headline=headline,
        error_kind=error_kind,
        kernel=kernel_name,
        facts=tuple(facts),
        user_frames=tuple(user_frames),
        assert_site=assert_site,
        pointer_argument=pointer_arg,
        resources=resources,
        fits=tuple(fits),
        next_steps=tuple(next_steps),
        caveats=tuple(dict.fromkeys(caveats)),
        sanitizer=report,
        traceback=tb,
    )


#: How a headline names each sticky CUDA error the ``names`` of ``_headline`` leave out.
_CUDA_WORDS = {
    ErrorKind.MISALIGNED_ADDRESS: "a misaligned memory access",
    ErrorKind.ILLEGAL_INSTRUCTION: "an illegal instruction",
    ErrorKind.LAUNCH_FAILURE: "an unspecified launch failure: a kernel faulted",
    ErrorKind.LAUNCH_TIMEOUT: "a kernel stopped by the watchdog",
    ErrorKind.HARDWARE_STACK_ERROR: "a hardware stack error",
    ErrorKind.INVALID_PC: "an invalid program counter",
    ErrorKind.INVALID_ADDRESS_SPACE: "an instruction on an address space it does not support",
    ErrorKind.ECC_UNCORRECTABLE: "an uncorrectable ECC error of the GPU's memory",
    ErrorKind.ERROR_CONTAINED: "a device fault caught by the GPU's error containment",
}

#: The sticky CUDA errors no cause of the catalogue fits, and why.
_NO_CAUSE = {
    ErrorKind.HARDWARE_STACK_ERROR: "deep recursion or a stack overflow in device code, not a placement, "
    "offset or routing fault",
    ErrorKind.INVALID_PC: "a jump to an invalid instruction address: a miscompiled kernel or a corrupt "
    "function pointer, not a placement, offset or routing fault",
    ErrorKind.INVALID_ADDRESS_SPACE: "a shared- or global-only instruction given the other kind of "
    "address: a kernel or compiler bug, not a placement, offset or routing fault",
    ErrorKind.ECC_UNCORRECTABLE: "the GPU's memory failed (Xid 48): no kernel change fixes it; check "
    "`nvidia-smi -q -d ECC` and have the GPU reset or replaced",
}


def _headline(
    kind: ErrorKind | None,
    report: SanitizerReport | None,
    tb: TracebackReport | None,
    kernel: str | None,
    clean: bool,
    *,
    cuda_named: bool = True,
) -> str:
    in_kernel = f" in {kernel}" if kernel else ""
    if clean and report is not None and report.error_summary is None:
        return "compute-sanitizer reported no hazards (RACECHECK SUMMARY: 0 hazards displayed)"
    if clean:
        return "compute-sanitizer reported no errors (ERROR SUMMARY: 0 errors)"
    names = {
        ErrorKind.POINTER_INACCESSIBLE: "Triton refused a pointer argument at launch",
        ErrorKind.ILLEGAL_ADDRESS: f"an illegal / out-of-bounds memory access{in_kernel}",
        ErrorKind.DEVICE_ASSERT: f"a device-side assertion{in_kernel}",
        ErrorKind.DEVICE_MISMATCH: "tensors on two different devices met in one op",
        ErrorKind.INVALID_HANDLE: "a CUDA handle from another context",
        ErrorKind.OUT_OF_RESOURCES: f"a launch config the device cannot run{in_kernel}",
        ErrorKind.OOM: "device memory ran out",
        ErrorKind.BAD_INPUT: "the code rejected its arguments",
        ErrorKind.KERNEL_IMPORT: "the kernel could not be imported",
        ErrorKind.NEEDS_CUDA: (
            "the code asked for CUDA in a process that has none (a CPU-only build, no driver, no visible GPU)"
        ),
    }
    if kind in names:
        return names[kind]
    api_only = None
    if report is not None and report.errors:
        api = next((e for e in report.errors if e.category == "api-error"), None)
        if api is not None and {e.category for e in report.errors} == {"api-error"}:
            api_only = f"{api.cuda_error} returned by {api.api_call or 'a CUDA API call'}"
    if kind is not None and kind in _CUDA_WORDS and (api_only is None or tb is not None):
        if not cuda_named:  # the interpreter's check of the same fault: no CUDA error code
            return f"{_CUDA_WORDS[kind]}{in_kernel} (Triton's interpreter refused it, on the CPU)"
        info = CUDA_ERROR_OF[kind]
        return f"{_CUDA_WORDS[kind]}{in_kernel} ({info.runtime}, CUDA error {info.code})"
    if api_only is not None:
        return api_only
    if report is not None and report.errors:
        cats = {e.category for e in report.errors}
        if "race" in cats:
            return f"shared-memory race hazards{in_kernel}"
        if "uninitialized" in cats:
            return f"reads of uninitialized global memory{in_kernel}"
        return f"compute-sanitizer reported {report.records} record(s){in_kernel}"
    if tb is not None and tb.exception is not None:
        return f"{tb.exception.type}{in_kernel}"
    if report is not None:
        return "a compute-sanitizer log with no error records in the part present"
    return "a traceback without an exception line"
