"""What the launch monitor saw inside a user's process: one record per process (stdlib only).

``qmoe-doctor run -- COMMAND`` injects the monitor (``qmoe_doctor.monitor``) into every Python
process the command starts; each process that imports Triton writes one ``ProcessRecord`` (a
JSON file in the folder ``$QMOE_DOCTOR_RUN_DIR`` names) when it ends, raises, gets a CUDA error
or a SIGTERM/SIGINT, and from time to time while it runs, so that a hard crash leaves what was
flushed. The parent reads them back (``workflows.run``)::

    ProcessRecord(pid, rank, ..., ring=(Launch(kernel, grid, device, stream,
                                               tensors=(TensorArg, ...), call_site), ...),
                  findings=(LaunchFinding, ...), kernels=(KernelSeen, ...),
                  lint=(SourceLint, ...), end=ProcessEnd | None)

``LaunchFacts`` is what the device checks (``diagnose.launch_rules``, pure functions) read: one
launch's kernel, device and tensors, with what the lint found in the kernel's source and the
process's local rank under a launcher.

Records round-trip through JSON like those of ``core.records`` (``to_json`` / ``from_json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.lint_findings import LintFinding
from qmoe_doctor.core.records import SCHEMA_VERSION, ErrorKind, TensorInfo

#: An int32 offset product wraps once the element offset it forms passes this.
INT32_LIMIT = 2**31


def element_span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """1 + the largest element offset a view of ``shape`` and ``strides`` reaches (0 when empty)."""
    total = 1
    for size, stride in zip(shape, strides, strict=True):
        if size == 0:
            return 0
        total += (size - 1) * abs(stride)
    return total


class HookPoint(StrEnum):
    """Where the monitor sits in Triton's launch path (docs/run.md: measured per version).

    Both see every launch of a ``@triton.jit`` function, autotuned and heuristics-wrapped ones
    included (the autotuner calls ``fn.run`` of the function it wraps), once per launch."""

    JIT_RUN = "JITFunction.run"  # compiled launches, triton 3.4 to 3.9
    INTERPRETER = "GridExecutor.__call__"  # TRITON_INTERPRET=1, triton 3.4 to 3.9


class FindingKind(StrEnum):
    """What a device check saw at a launch (``diagnose.launch_rules``), or a check over a
    process's last launches at a flush (``diagnose.stream_rules``)."""

    OTHER_DEVICE = "tensor-on-other-device"  # a tensor on another GPU than the launch's
    MIXED_DEVICES = "mixed-devices"  # the tensors of one launch on several devices
    CPU_TENSOR = "cpu-tensor"  # a CPU tensor passed to a GPU launch
    INT32_BY_SIZE = "int32-offset-by-size"  # a tensor of >= 2**31 elements, int32 products in the lint
    # a launcher's rank r != 0 with its tensors on cuda:r and a tensor (or the launch) on cuda:0
    RANK_ON_DEVICE_0 = "rank-on-device-0"
    # found over the ring at a flush, not at a launch: a kernel always on the default stream while
    # the same thread's other launches on that device ran on a side stream
    DEFAULT_STREAM = "default-stream-launch"
    # found over a --sanitize pass, not at a launch: compute-sanitizer's invalid addresses, placed
    # in the recorded tensors, agree on one argument and one cause (``diagnose.run_findings``)
    PLACED_ACCESS = "invalid-access-placed"


#: What became of a launch that a device check flagged: Triton refused its pointer ("refused"),
#: it ran (over peer access: remotely, "ran"), it raised something else ("raised"), or it was
#: stopped before the launch by --strict ("stopped"); "pending" while it runs.
LaunchOutcome = Literal["pending", "ran", "refused", "raised", "stopped"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSite:
    """One frame: ``path:line in function``."""

    file: str
    line: int
    function: str

    def render(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorArg:
    """One tensor argument of a launch, as the kernel received it (read from the tensor's
    metadata only: its contents, such as ``m_sizes`` counts, are never read)."""

    name: str  # the kernel parameter it was bound to ("x_ptr"), or "arg3" past the signature
    device: str  # "cuda:1", "cpu"
    data_ptr: int
    nbytes: int  # bytes the view spans from data_ptr: (largest element offset + 1) x itemsize
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # "bfloat16"
    numel: int

    @property
    def span(self) -> int:
        """Elements from the first to the last one the view reaches (numel when contiguous):
        what an offset formed over this tensor can reach."""
        return element_span(self.shape, self.strides)

    @property
    def device_index(self) -> int | None:
        """The CUDA ordinal, or None for a CPU (or other non-indexed) tensor."""
        kind, _, index = self.device.partition(":")
        return int(index) if kind != "cpu" and index.isdigit() else None

    def tensor_info(self, label: str | None = None) -> TensorInfo:
        """As ``core.records.TensorInfo``, for address attribution."""
        return TensorInfo(
            name=label or self.name,
            device=self.device,
            data_ptr=self.data_ptr,
            nbytes=self.nbytes,
            shape=self.shape,
            strides=self.strides,
            dtype=self.dtype,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceLint:
    """The lint of one source file that launched (or defines) a kernel, run once per process
    at the first launch that needed it."""

    path: str
    findings: tuple[LintFinding, ...] = ()
    error: str = ""  # why it could not be linted ("" when it was)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSeen:
    """One ``@triton.jit`` function this process launched."""

    name: str
    file: str  # its source file
    line: int  # first line of its definition (a decorator's, when it has some)
    end_line: int | None = None  # last line, when the source could be read
    launches: int = 0
    int32_lines: tuple[int, ...] = ()  # lines of int32 offset products the lint found in it


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """One launch, as the ring keeps it."""

    seq: int  # this process's launch number, from 1
    kernel: str
    kernel_seq: int  # this kernel's launch number in this process, from 1
    grid: tuple[int, ...] | None = None  # None: a grid function that was not evaluated
    device: str | None = None  # the device Triton launched on ("cuda:0"); None: the interpreter
    stream: int | None = None  # the CUDA stream handle (None: the interpreter)
    tensors: tuple[TensorArg, ...] = ()
    call_site: SourceSite | None = None  # first frame outside torch, triton and qmoe-doctor
    launch_site: SourceSite | None = None  # the frame that wrote kernel[grid](...)
    # the user's own line: the first frame outside site-packages / dist-packages too (the call
    # site is a library's line when a pip-installed library launched the kernel)
    user_site: SourceSite | None = None
    # a --kernel reference ("pkg.ops:grouped_gemm") to the innermost module-level function from
    # the launch outwards called with three tensors shaped (x, w, m_sizes) and taking three
    # required positional arguments: what `scan` can call. "" when the frames were walked and
    # none is; None when they were not (a launch not sampled, an older record)
    wrapper: str | None = None
    t: float = 0.0  # seconds since the monitor attached
    thread: str = ""  # the thread's name when not the main thread
    raised: str = ""  # what the launch itself raised ("" when it returned)
    flagged: bool = False  # a device check found something at this launch


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchFacts:
    """What the device checks read: one launch and what is known of its kernel."""

    seq: int = 0  # the launch's number in its process
    kernel: str
    device: str | None  # launch device ("cuda:0"); None under the interpreter (no device)
    tensors: tuple[TensorArg, ...]
    int32_lint: tuple[LintFinding, ...] = ()  # int32 offset products the lint found in the kernel
    local_rank: int | None = None  # the process's LOCAL_RANK (a launcher's rank), read once at attach


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchFinding:
    """One fact a device check established, with the first launch that showed it. Repeats of
    the same fact (same kind, kernel, devices and tensors) count, they do not repeat."""

    kind: FindingKind
    cause: str  # a key of core.causes.CAUSES
    kernel: str
    message: str  # one line, in this launch's terms
    launch_device: str | None
    tensors: tuple[TensorArg, ...]  # the tensors involved
    peer_access: bool | None = None  # can the launch device reach the tensors' GPU (None: unknown)
    outcome: LaunchOutcome = "pending"
    first_seq: int = 0  # the first launch that showed it
    count: int = 1  # launches that showed it
    lint: tuple[LintFinding, ...] = ()  # the lint findings that back it (int32 offset products)
    launch: Launch | None = None  # the first launch that showed it, whole (the ring may lose it)

    @property
    def key(self) -> tuple[str, ...]:
        """Repeats of one fact share it: kind, kernel, launch device, tensors and their devices.
        A default-stream finding (made over the ring, its example launch changing as the ring
        moves) is one fact per kernel, device and thread."""
        if self.kind is FindingKind.DEFAULT_STREAM:
            thread = self.launch.thread if self.launch is not None else ""
            return (self.kind.value, self.kernel, self.launch_device or "", f"thread={thread}")
        named = tuple(f"{t.name}@{t.device}" for t in self.tensors)
        return (self.kind.value, self.kernel, self.launch_device or "", *named)


class EndKind(StrEnum):
    EXIT = "exit"  # the interpreter shut down (sys.exit, end of the program)
    EXCEPTION = "exception"  # an uncaught exception that is no CUDA error
    CUDA_ERROR = "cuda-error"  # a CUDA error: illegal memory access, device-side assert, ...
    SIGNAL = "signal"  # SIGTERM / SIGINT (the user's handler ran after ours)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessEnd:
    kind: EndKind
    detail: str = ""  # exception type and message, or the signal's name
    error_kind: ErrorKind | None = None  # of a CUDA error (core.error_kind.match_text)
    seq: int = 0  # launches made when it ended


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessRecord:
    """One monitored process. ``end`` is None in a record flushed while the process ran: if it
    is still None once the command is over, the process died without flushing again (SIGKILL,
    a segfault, ``os._exit``) and the launches after ``flushed_at`` are lost."""

    schema_version: int = SCHEMA_VERSION
    pid: int
    ppid: int
    rank: int | None = None  # from torchrun's RANK / LOCAL_RANK / WORLD_SIZE
    local_rank: int | None = None
    world_size: int | None = None
    argv: tuple[str, ...] = ()
    python: str = ""
    triton_version: str = ""
    torch_version: str = ""
    hooks: tuple[HookPoint, ...] = ()  # the hook points patched in this process
    interpreter: bool = False  # TRITON_INTERPRET=1
    strict: bool = False
    started: float = 0.0  # time.time() when the monitor attached
    flushed_at: float = 0.0
    launches: int = 0  # launches seen in all (the ring keeps the last ``ring_size``)
    ring_size: int = 0
    ring: tuple[Launch, ...] = ()
    kernels: tuple[KernelSeen, ...] = ()
    lint: tuple[SourceLint, ...] = ()
    findings: tuple[LaunchFinding, ...] = ()
    end: ProcessEnd | None = None
    cuda_error: str = ""  # the first CUDA error text a launch or an exception carried
    problems: tuple[str, ...] = ()  # the monitor's own troubles (a hook it could not place, ...)

    @property
    def label(self) -> str:
        """``rank 1 (pid 4242)`` or ``pid 4242``."""
        return f"rank {self.rank} (pid {self.pid})" if self.rank is not None else f"pid {self.pid}"

    @property
    def flushed_whole(self) -> bool:
        return self.end is not None


#: Stream handles that are a default stream to CUDA. Torch reports 0 for every device's default
#: stream (``torch.cuda.default_stream(d).cuda_stream``: c10's ``CUDAStream::stream()`` returns
#: nullptr for it); 1 is ``cudaStreamLegacy`` and 2 ``cudaStreamPerThread`` (an external stream
#: wrapping either, or a build whose default stream is per thread).
DEFAULT_STREAMS = frozenset({0, 1, 2})


__all__ = [
    "DEFAULT_STREAMS",
    "INT32_LIMIT",
    "EndKind",
    "FindingKind",
    "HookPoint",
    "KernelSeen",
    "Launch",
    "LaunchFacts",
    "LaunchFinding",
    "LaunchOutcome",
    "ProcessEnd",
    "ProcessRecord",
    "SourceLint",
    "SourceSite",
    "TensorArg",
    "element_span",
]
