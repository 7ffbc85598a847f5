"""Records that cross the process boundary: what a probe is asked to do and what came of it.

Data flows one way::

    plan --> [ProbeSpec] --isolate--> child (probes/) --> Outcome (JSON line)
    [Outcome] --classify--> [Diagnosis] --render--> terminal | JSON | JUnit

Every record is a frozen dataclass (stdlib only) and round-trips through JSON with
``schema_version``. ``to_json``/``from_json`` are generic over these dataclasses, so adding
a field needs no serializer change.
"""

from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from qmoe_doctor.core.compat import StrEnum

SCHEMA_VERSION = 1
#: How the Outcome line a one-shot child prints on stdout starts (``probes/run_one.py`` writes it,
#: ``isolate.one_shot`` reads the last such line).
OUTCOME_PREFIX = "QMOE-OUTCOME "


class Condition(StrEnum):
    """One controlled condition a probe runs the kernel under.

    Pair conditions take an ordered GPU pair (a, b): operands live on b, and ``a`` is the
    device that is current at the call unless the condition says otherwise.
    """

    # --- single device (each GPU alone, or the CPU tier under TRITON_INTERPRET=1) ---
    SINGLE = "single"  # operands and current device on one device: correctness baseline
    SIDE_STREAM = "side-stream"  # caller's current stream is a side stream of the operand
    # device, with the producer of x still queued on it (behind a hold of the stream)
    OVER_ROUTED = "over-routed"  # m_sizes sums past M (invalid routing); canaries around x and y
    NEGATIVE_SIZES = "negative-sizes"  # a -1 sentinel count in m_sizes (invalid routing)
    REPEAT_CALL = "repeat-call"  # first and second call of a fresh process on identical inputs
    INT32_BOUNDARY = "int32-boundary"  # rows routed to the first expert whose offset passes 2**31
    OFFSETS = "offsets"  # operands as strided / offset views (params say which)
    LAUNCH_CONFIG = "launch-config"  # a pinned tile / warp / stage config (params say which)
    # --- the routed protocol, fn(hidden_states, w, topk_ids, topk_weights[, expert_map]): one
    # device; each edge cell calls the kernel with valid routing first on the same operands
    # (probes/routed_conditions.py; Shape.m is T tokens, Shape.k the hidden size H) ---
    ROUTED = "routed"  # valid top-k routing, k > 1: the routed protocol's own baseline cell
    IDS_OUT_OF_RANGE = "ids-out-of-range"  # expert ids >= E and < -1 in some slots
    DROPPED_SLOTS = "dropped-slots"  # -1 ids (dropped slots), no expert_map
    EXPERT_MAP = "expert-map"  # global ids, an expert_map with -1 for experts on other ranks
    MAP_PAST_LOCAL = "map-past-local"  # expert_map entries at or past the local expert count
    PADDED_COUNT = "padded-count"  # sorted-token-ids style: num_tokens_post_padded past its buffer
    GATHER_PAST_T = "gather-past-t"  # gather/scatter style: a gather index whose token is past T
    GATHERED_INT32 = "gathered-int32"  # gathered slot ids whose product with a row stride passes 2**31
    # --- ordered pair (a current, operands on b) ---
    GUARDED = "guarded"  # current device b: the guarded baseline for the pair
    UNTOUCHED = "untouched"  # current device a, a's context never created in this process
    NO_PEER = "no-peer"  # a touched, peer access a->b not enabled
    PEER = "peer"  # peer access a->b enabled by one copy a->b (what device_map pipelines do)
    PRODUCER_RACE = "producer-race"  # PEER, and x still being written on b's stream
    SIZES_RACE = "sizes-race"  # PEER, and m_sizes still being written on b's stream into a
    # recycled allocator block that holds large stale values
    # --- a model split across GPUs (qmoe-doctor repro; probes/pipeline.py) ---
    INTERPRETER_CHECK = "interpreter-check"  # a trivial reference Triton kernel on the CPU
    # interpreter: if it fails, the CPU tier cannot run here (an environment fact, no kernel's)
    PIPELINE = "pipeline"  # MoE blocks placed over params["devices"] as device_map="auto" places
    # them, the first GPU current, forward and backward for a few steps, against the torch twin
    # --- parallel modes (qmoe-doctor scan --parallel; probes/parallel/): one outcome per rank,
    # each rank compared with a single-device run of the same weights and inputs it makes itself ---
    PARALLEL_SINGLE = "parallel-single"  # the block on one device: the modes' timing baseline
    PARALLEL_DP = "parallel-dp"  # DistributedDataParallel, gradients all-reduced
    PARALLEL_PP = "parallel-pp"  # layers over the GPUs of one process, as device_map="auto"
    PARALLEL_TP = "parallel-tp"  # gate_up split by columns, down by rows, outputs all-reduced
    PARALLEL_EP = "parallel-ep"  # experts sharded, tokens dispatched and combined by all-to-all
    # --- isolation self-tests: children that misbehave on purpose (no torch needed) ---
    SELFTEST_OK = "selftest-ok"
    SELFTEST_RAISE = "selftest-raise"  # raises an exception whose text params["message"] gives
    SELFTEST_SEGFAULT = "selftest-segfault"
    SELFTEST_HANG = "selftest-hang"
    SELFTEST_EXIT = "selftest-exit"  # os._exit(params["code"]) after printing params["message"]

    @property
    def is_pair(self) -> bool:
        return self in PAIR_CONDITIONS

    @property
    def is_selftest(self) -> bool:
        return self.value.startswith("selftest-")


PAIR_CONDITIONS = frozenset(
    {
        Condition.GUARDED,
        Condition.UNTOUCHED,
        Condition.NO_PEER,
        Condition.PEER,
        Condition.PRODUCER_RACE,
        Condition.SIZES_RACE,
    }
)


class Phase(StrEnum):
    """The phases a child passes through; it writes a breadcrumb before each one."""

    SPAWN = "spawn"
    IMPORT = "import"
    SETUP = "setup"
    COMPILE = "compile"
    LAUNCH = "launch"
    SYNC = "sync"
    COMPARE = "compare"
    DONE = "done"


class Status(StrEnum):
    PASS = "pass"  # matches the twin within tolerance, every output written, canaries intact
    WRONG = "wrong"  # ran to completion, numbers or placement wrong
    ERROR = "error"  # raised, crashed, or timed out (see ErrorKind)
    SKIPPED = "skipped"  # did not apply (reason in Outcome.notes)


class ErrorKind(StrEnum):
    """What kind of failure ended a probe, classified from exception text and exit status."""

    # The sticky CUDA errors (``CUDA_ERROR_KINDS``), one kind each: the cudaError / CUresult
    # number, then the error it stands for (``core.error_kind`` quotes the texts).
    ILLEGAL_ADDRESS = "illegal-address"  # 700: a load or store on an invalid address
    LAUNCH_TIMEOUT = "launch-timeout"  # 702: the kernel ran past the watchdog
    DEVICE_ASSERT = "device-assert"  # 710: device-side assert (e.g. TRITON_DEBUG int32 overflow)
    HARDWARE_STACK_ERROR = "hardware-stack-error"  # 714: call stack corrupt or overflowed
    ILLEGAL_INSTRUCTION = "illegal-instruction"  # 715: e.g. a TMA store past its descriptor
    MISALIGNED_ADDRESS = "misaligned-address"  # 716: a load or store on a misaligned address
    INVALID_ADDRESS_SPACE = "invalid-address-space"  # 717: a global/shared-only instruction elsewhere
    INVALID_PC = "invalid-pc"  # 718: an invalid program counter
    LAUNCH_FAILURE = "launch-failure"  # 719: "unspecified launch failure"
    ECC_UNCORRECTABLE = "ecc-uncorrectable"  # 214: an uncorrectable ECC error (hardware)
    ERROR_CONTAINED = "error-contained"  # 226: a fault the GPU's error containment caught
    POINTER_INACCESSIBLE = "pointer-inaccessible"  # Triton launch check: "Pointer argument ...
    # cannot be accessed from Triton"
    DEVICE_MISMATCH = "device-mismatch"  # aten: "Expected all tensors to be on the same device"
    INVALID_HANDLE = "invalid-resource-handle"  # a handle from another device's context
    OUT_OF_RESOURCES = "out-of-resources"  # launch config over shared memory / registers
    OOM = "oom"  # device memory exhausted
    TIMEOUT = "timeout"  # the parent killed the child's process group
    SIGNAL = "signal"  # the child died of a signal (segfault, abort)
    BAD_INPUT = "bad-input"  # the kernel's own argument checks (ValueError / TypeError)
    KERNEL_IMPORT = "kernel-import"  # the kernel under test could not be imported or resolved
    # the call needs CUDA and the process has none ("Torch not compiled with CUDA enabled"): on the
    # CPU tier the cell is not checked, never a fault or a refusal (docs/cells.md)
    NEEDS_CUDA = "needs-cuda"
    OTHER = "other"


#: The CUDA errors that end the CUDA context of the process that met them: "This leaves the
#: process in an inconsistent state and any further CUDA work will return the same error. To
#: continue using CUDA, the process must be terminated and relaunched" (the CUDA runtime API's
#: cudaError enum, for 700, 702, 710, 714-719 and 226; PyTorch's c10/cuda/CUDAMiscFunctions.cpp
#: keeps the same list). An uncorrectable ECC error (214) ends the work on that GPU too. The one
#: notion of "a CUDA error" every command shares: ``run`` records it, ``scan`` retires the
#: worker, ``explain`` and the crash classifier name it (``is_cuda_error``).
CUDA_ERROR_KINDS = frozenset(
    {
        ErrorKind.ILLEGAL_ADDRESS,
        ErrorKind.LAUNCH_TIMEOUT,
        ErrorKind.DEVICE_ASSERT,
        ErrorKind.HARDWARE_STACK_ERROR,
        ErrorKind.ILLEGAL_INSTRUCTION,
        ErrorKind.MISALIGNED_ADDRESS,
        ErrorKind.INVALID_ADDRESS_SPACE,
        ErrorKind.INVALID_PC,
        ErrorKind.LAUNCH_FAILURE,
        ErrorKind.ECC_UNCORRECTABLE,
        ErrorKind.ERROR_CONTAINED,
    }
)


def is_cuda_error(kind: ErrorKind | None) -> bool:
    """Whether ``kind`` is a sticky CUDA error (``CUDA_ERROR_KINDS``)."""
    return kind in CUDA_ERROR_KINDS


#: Error kinds after which the child's CUDA context cannot be trusted: the worker is replaced.
POISONING_KINDS = CUDA_ERROR_KINDS | {ErrorKind.TIMEOUT, ErrorKind.SIGNAL, ErrorKind.OTHER}


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """Problem size of one grouped GEMM call: x (M, K), w (E, N, K), y (M, N)."""

    m: int
    e: int
    n: int
    k: int
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # how rows are spread over experts: "uniform", "random", "empty-experts", "hot-expert",
    # "last-expert", or "expert:<i>" (every row on expert i)
    routing: str = "random"


#: A probe that reruns another one: ``debug`` under TRITON_DEBUG=1 (its int32 overflow check and
#: device asserts name the source line), ``memcheck`` under compute-sanitizer (``repro``).
Rerun = Literal["", "debug", "memcheck"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where a probe runs and which report cell it fills. Written by the planner (and the rank
    child for torchrun ranks), read by the matrix, the rules, the reports and the renderers: no
    one takes a probe id apart.

    ``group`` is the report's group key: "CPU", "GPU 3" (a single-device cell), "0->1" (an
    ordered pair: a current, operands on b), "rank 1" or "local rank 1" (a torchrun rank),
    "pipeline" (repro's model), or a parallel mode ("dp": a launch's template, before its
    ranks). GPUs are NVML indices, as ``--gpus`` names them; a CUDA ordinal inside the child is
    ``ProbeSpec.device`` / ``current``.
    """

    group: str = ""
    gpu_a: int | None = None  # NVML index current at the call (pair cells only)
    gpu_b: int | None = None  # NVML index holding the operands (a pair's b, a single cell's GPU)
    rank: int | None = None  # torchrun rank (the local one for "local rank N")
    # tells apart cells of one condition and group: an offsets variant ("padded-rows") or a
    # launch config's name ("64x128x64-w4-s3"); "" for every other condition
    variant: str = ""
    rerun: Rerun = ""

    @property
    def is_pair(self) -> bool:
        return self.gpu_a is not None and self.gpu_b is not None

    @property
    def label(self) -> str:
        """How a report names the group: "GPU 0 -> GPU 1" for a pair, else the group itself."""
        if self.is_pair:
            return f"GPU {self.gpu_a} -> GPU {self.gpu_b}"
        return self.group

    def cell_name(self, condition: Condition) -> str:
        """The cell within its group: "peer", "offsets:padded-rows", "int32-boundary+debug"."""
        name = condition.value + (f":{self.variant}" if self.variant else "")
        return name + (f"+{self.rerun}" if self.rerun else "")

    def probe_id(self, condition: Condition) -> str:
        """The probe id the planners give a spec of this placement: "<group>/<cell>"."""
        return f"{self.group}/{self.cell_name(condition)}"


def pair_placement(a: int, b: int) -> Placement:
    """An ordered pair's cells: a (NVML index) current, operands on b."""
    return Placement(group=f"{a}->{b}", gpu_a=a, gpu_b=b)


def gpu_placement(gpu: int) -> Placement:
    """A single-device cell on one GPU (NVML index)."""
    return Placement(group=f"GPU {gpu}", gpu_b=gpu)


CPU_PLACEMENT = Placement(group="CPU")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeSpec:
    """One probe: a kernel, a condition, a placement and a shape. Runs in a child process.

    Devices are CUDA ordinals *inside the child*, whose CUDA_VISIBLE_DEVICES the parent sets
    to the selected GPUs' UUIDs in --gpus order; ``None`` means the CPU (interpreter tier).
    """

    probe_id: str
    kernel: str  # "builtin", "specimen:NAME", "module:function", "path/to/file.py:function"
    condition: Condition
    # where it runs, as the report groups it (written by the planner; "" group: a spec made by
    # hand that no report groups). Reports written before the field existed get one derived
    # from their probe ids when read (``legacy_placement``).
    placement: Placement = Placement()
    device: int | None = None  # ordinal holding the operands (b)
    current: int | None = None  # ordinal current at the call (a for pair conditions)
    shape: Shape
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict)  # condition-specific knobs
    env: dict[str, str] = field(default_factory=dict)  # extra environment (forces a fresh process)
    fresh_process: bool = False  # needs a child where no CUDA context was created yet
    timeout_s: float = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    """One tensor the probe handed to the kernel: lets an address be attributed."""

    name: str
    device: str
    data_ptr: int
    nbytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What came of one probe. Crashes, signals and timeouts are data too."""

    schema_version: int = SCHEMA_VERSION
    probe_id: str
    spec: ProbeSpec
    status: Status
    phase: Phase  # last phase reached (for a crash: the last breadcrumb)
    error_kind: ErrorKind | None = None
    error_type: str | None = None  # exception class name, or "signal"/"timeout"/"exit"
    error_message: str | None = None  # first lines of the error text
    rel_error: float | None = None  # ||out - ref|| / ||ref|| against the torch twin
    tolerance: float | None = None  # the tolerance rel_error was judged against
    unwritten: int | None = None  # output elements still holding the poison value
    nan_written: int | None = None  # output elements the kernel wrote as NaN (where the twin is finite)
    canary_hits: tuple[str, ...] = ()  # guard regions written that must not be ("after y", ...)
    out_device: str | None = None  # device the kernel returned its output on
    kernel_ms: float | None = None  # median time of the kernel call (device events)
    calls_rel_error: tuple[float, ...] = ()  # per call, for REPEAT_CALL
    facts: dict[str, Any] = field(default_factory=dict)  # condition-specific observations
    tensors: tuple[TensorInfo, ...] = ()  # the operands, for address attribution
    notes: tuple[str, ...] = ()  # human-readable remarks (skip reasons, what was set up)
    stderr_tail: str = ""  # last lines of the child's stderr (crashes)
    wall_s: float = 0.0  # wall time of the probe in the child (or until it died)
    exit_code: int | None = None  # child exit status when the child died on this probe

    @property
    def failed(self) -> bool:
        return self.status in (Status.WRONG, Status.ERROR)


#: fault: memory safety or placement is broken (exit 1); hardening: wrong values from input the
#: kernel's contract excludes (invalid routing) with every access inside its tensors (README,
#: "Exit codes": reported, exit 0).
Severity = Literal["fault", "hardening"]


class Confidence(StrEnum):
    HIGH = "high"  # differential evidence: one condition flips the outcome, baseline passes
    MEDIUM = "medium"  # consistent evidence, but a baseline is missing or a cell is ambiguous
    LOW = "low"  # suggestive only


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """One cell that supports a diagnosis, with what it showed."""

    probe_id: str
    condition: Condition
    label: str  # the rendered cell label: pass, slow, wrong, or the error kind
    detail: str  # one line: what differs from the baseline
    # the kernel source line the evidence points at ("forward.py:79": a device-side assert's
    # file:line) and what failed there ("int32 overflow detected for operation mul")
    site: str | None = None
    check: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    """A cause named from differential evidence. Mechanism, fix and docs come from the
    cause catalogue (``qmoe_doctor.core.causes``); this holds the facts of this run."""

    cause: str  # kebab-case cause id, a key of causes.CAUSES
    confidence: Confidence
    summary: str  # one line: what was proven, in this run's terms
    evidence: tuple[Evidence, ...]
    where: tuple[str, ...] = ()  # GPUs or pairs it was seen on, e.g. ("GPU 0 -> GPU 1",)
    repro: str = ""  # one-line command that reproduces it
    severity: Severity = "fault"


def rank_spec(template: ProbeSpec, rank: int, ordinal: int | None, *, local: bool = False) -> ProbeSpec:
    """One torchrun rank's spec from its launch's template: the rank child writes it for itself,
    the parent for a rank that died before it could (``isolate.torchrun``)."""
    who = f"{'local rank' if local else 'rank'} {rank}"
    placement = Placement(group=who, rank=rank)
    return dataclasses.replace(
        template,
        probe_id=placement.probe_id(template.condition),
        placement=placement,
        device=ordinal,
        current=ordinal,
    )


def legacy_placement(probe_id: str) -> Placement:
    """COMPAT, applied only when reading: the Placement of a spec written before ProbeSpec had
    one (the recorded reports under tests/fixtures/reports/), derived from its probe id
    ("0->1/peer", "GPU 1/offsets:padded-rows", "CPU/int32-boundary+debug", "rank 1/parallel-dp",
    "pipeline"), which the planners built as "<group>/<condition>[:<variant>][+<rerun>]".
    Nothing else reads a probe id's parts."""
    group, _, cell = probe_id.partition("/")
    rerun: Rerun = ""
    if cell.endswith("+debug"):
        cell, rerun = cell.removesuffix("+debug"), "debug"
    elif cell.endswith("+memcheck"):
        cell, rerun = cell.removesuffix("+memcheck"), "memcheck"
    _, _, variant = cell.partition(":")
    gpu_a: int | None = None
    gpu_b: int | None = None
    rank: int | None = None
    a, arrow, b = group.partition("->")
    if arrow and a.isdigit() and b.isdigit():
        gpu_a, gpu_b = int(a), int(b)
    elif group.startswith("GPU ") and group[4:].isdigit():
        gpu_b = int(group[4:])
    elif group.startswith(("rank ", "local rank ")) and group.rsplit(" ", 1)[-1].isdigit():
        rank = int(group.rsplit(" ", 1)[-1])
    return Placement(group=group, gpu_a=gpu_a, gpu_b=gpu_b, rank=rank, variant=variant, rerun=rerun)


T = TypeVar("T")


def to_jsonable(obj: Any) -> Any:
    """Turn a record (or a structure of records) into plain JSON types."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, StrEnum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def _convert(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        last_error: Exception | None = None
        for arg in args:
            try:
                return _convert(arg, value)
            except (TypeError, ValueError, KeyError) as exc:
                last_error = exc
        raise ValueError(f"cannot read {value!r} as {tp}") from last_error
    if origin is Literal:
        if value not in get_args(tp):
            raise ValueError(f"{value!r} is not one of {get_args(tp)}")
        return value
    if origin is tuple:
        targs = get_args(tp)
        if len(targs) == 2 and targs[1] is Ellipsis:
            return tuple(_convert(targs[0], v) for v in value)
        return tuple(_convert(a, v) for a, v in zip(targs, value, strict=True))
    if origin is list:
        (arg,) = get_args(tp)
        return [_convert(arg, v) for v in value]
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        # JSON object keys are always strings: an int key comes back as "0"
        return {
            _convert(key_tp, int(k) if key_tp is int and isinstance(k, str) else k): _convert(val_tp, v)
            for k, v in value.items()
        }
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_jsonable(tp, value)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        return tp(value)
    if tp is float and isinstance(value, int):
        return float(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise TypeError(f"expected {tp.__name__}, got {type(value).__name__}: {value!r}")
    return value


#: The fields that hold a record's error text, beside its ``error_kind``.
_ERROR_TEXT_FIELDS = ("error_message", "detail", "message")


def from_jsonable(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild a record from ``to_jsonable`` output. Unknown keys are ignored (forward
    compatibility); a ``schema_version`` newer than ours is refused."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    version = data.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise ValueError(
            f"{cls.__name__} has schema_version {version}; this qmoe-doctor reads up to {SCHEMA_VERSION}"
        )
    hints = get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name])
    if cls is ProbeSpec and "placement" not in data and isinstance(kwargs.get("probe_id"), str):
        kwargs["placement"] = legacy_placement(kwargs["probe_id"])  # written before the field
    if kwargs.get("error_kind") in (ErrorKind.ILLEGAL_ADDRESS, ErrorKind.OTHER):
        # written before each sticky CUDA error had its own kind (Outcome, ProcessEnd,
        # RunCudaError): read again from the record's own text. error_kind imports this module,
        # so it is imported here, when a record is read.
        from qmoe_doctor.core.error_kind import legacy_error_kind

        text = next((v for k in _ERROR_TEXT_FIELDS if isinstance(v := data.get(k), str) and v), "")
        kwargs["error_kind"] = legacy_error_kind(kwargs["error_kind"], text)
    return cls(**kwargs)


def json_document(kind: str, payload: Any) -> dict[str, Any]:
    """The versioned JSON document of a report: ``schema_version``, ``kind``, then the record's
    fields (``reports.json`` writes it; the benchmark child writes its own with it)."""
    body = to_jsonable(payload)
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": kind}
    if isinstance(body, dict):
        doc.update(body)
    else:
        doc["items"] = body
    return doc


def to_json(obj: Any) -> str:
    """One JSON line (no newline inside)."""
    return json.dumps(to_jsonable(obj), separators=(",", ":"), allow_nan=True)


def from_json(cls: type[T], line: str) -> T:
    return from_jsonable(cls, json.loads(line))
