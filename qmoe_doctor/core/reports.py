"""Report records: what each command produced, as data (stdlib only).

Workflows build them, the report writers (JSON, JUnit, scripts, plots) and the CLI's renderers
read them. Every report carries ``schema_version`` and round-trips through JSON like the records
in ``records``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from qmoe_doctor import __version__
from qmoe_doctor.core.audit import AuditReport
from qmoe_doctor.core.compare import RunCompare
from qmoe_doctor.core.coverage import Coverage
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.launches import FindingKind, Launch, LaunchFinding, ProcessRecord, SourceLint
from qmoe_doctor.core.lint_findings import LintError, LintFinding
from qmoe_doctor.core.modes import Mode
from qmoe_doctor.core.records import (
    SCHEMA_VERSION,
    Confidence,
    Diagnosis,
    ErrorKind,
    Evidence,
    Outcome,
    Phase,
    Shape,
    Status,
)
from qmoe_doctor.core.xid import XidReport


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfo:
    label: str
    gpu_of_ordinal: dict[int, int]  # child ordinal -> NVML index
    cuda_visible_devices: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    kernel: str
    tier: str  # "gpu" or "cpu"
    started: str  # ISO 8601, UTC
    wall_s: float
    gpus: tuple[int, ...]  # NVML indices scanned, in --gpus order
    sessions: tuple[SessionInfo, ...]
    outcomes: tuple[Outcome, ...]
    diagnoses: tuple[Diagnosis, ...]  # faults (exit 1)
    explanations: tuple[str, ...] = ()
    unexplained: tuple[Evidence, ...] = ()
    skipped: tuple[str, ...] = ()
    log_dir: str = ""
    inventory: dict[str, Any] = field(default_factory=dict)
    audit: tuple[AuditReport, ...] = ()  # int32 offset audit of the scanned presets
    # severity "hardening": wrong values from input the kernel's contract excludes, every access
    # in bounds; reported, not faults (exit 0)
    hardening: tuple[Diagnosis, ...] = ()
    coverage: Coverage | None = None  # what the verdict covers (None: a report from before it)
    # False in the reports written while the scan runs (``on_progress``): what ran so far, and the
    # sessions still to run. A scan that is killed leaves the last of them behind.
    complete: bool = True
    not_run: tuple[str, ...] = ()
    # the lint of what the kernel reaches, as check's; notes, not faults: the scan's verdict
    # and exit code come from its cells (None: not linted, the source not found)
    lint: LintResult | None = None

    @property
    def healthy(self) -> bool:
        return self.complete and not self.diagnoses and not self.unexplained


# ---------------------------------------------------------------------------------------------
# check: lint, the CPU tier and the fast GPU subset, per kernel
# ---------------------------------------------------------------------------------------------

Tier = Literal["cpu", "gpu"]
#: pass: ran and was right; fail: wrong, crashed, or the slow evidence of a diagnosis;
#: skip: did not apply (reason in detail); error: the check could not run it (spawn, import).
Verdict = Literal["pass", "fail", "skip", "error"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LintResult:
    paths: tuple[str, ...]  # as given (or the kernel's own source)
    files: tuple[str, ...]  # the Python files linted (for a kernel: every file it reaches)
    findings: tuple[LintFinding, ...] = ()
    errors: tuple[LintError, ...] = ()  # missing, unreadable or unparsable files
    reached_from: str = ""  # "file.py:function" the files were reached from ("" for --lint paths)
    notes: tuple[str, ...] = ()  # what the reach did not follow or left out, and why

    @property
    def exit_code(self) -> ExitCode:
        if self.errors:
            return ExitCode.USAGE  # as `qmoe-doctor lint`: a path that is not a readable source
        return ExitCode.FAULT if self.findings else ExitCode.HEALTHY


@dataclass(frozen=True, slots=True, kw_only=True)
class CellResult:
    """One probe as CI sees it (a JUnit test case)."""

    probe_id: str
    tier: Tier
    group: str  # as the report names it: "CPU", "GPU 1", "GPU 0 -> GPU 1"
    name: str  # the condition, with its variant: "peer", "offsets:padded-rows", "int32-boundary+debug"
    label: str  # pass | slow | wrong | skipped | <error kind>
    verdict: Verdict
    detail: str  # one line: what it showed, or why it was skipped
    cause: str | None = None  # the diagnosis that cites this failing cell; None: unexplained
    wall_s: float = 0.0
    notes: tuple[str, ...] = ()
    log: str = ""  # error text and the child's stderr tail (failures and errors)


@dataclass(frozen=True, slots=True, kw_only=True)
class TierResult:
    tier: Tier
    gpus: tuple[int, ...]  # NVML indices (empty for the CPU tier)
    wall_s: float
    counts: dict[str, int]  # verdict -> cells
    skipped: tuple[str, ...] = ()  # what the plan left out, and why
    spawn_failed: bool = False  # every probe died before its child was ready
    log_dir: str = ""  # "" once the run's logs were removed (it ended healthy)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelCheck:
    kernel: str
    exit_code: int  # an ExitCode value
    problem: str = ""  # why the check of this kernel could not give an answer, when it could not
    wall_s: float = 0.0
    lint: LintResult | None = None  # what the kernel reaches (when no --lint paths were given)
    tiers: tuple[TierResult, ...] = ()
    cells: tuple[CellResult, ...] = ()
    summary: dict[str, int] = field(default_factory=dict)  # verdict -> cells, over every tier
    diagnoses: tuple[Diagnosis, ...] = ()
    unexplained: tuple[Evidence, ...] = ()
    explanations: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what was not checked and why ("no lint: the source of ...")
    hardening: tuple[Diagnosis, ...] = ()  # as ScanReport's, over every tier: not faults
    coverage: Coverage | None = None  # what the cells of every tier covered (None: no tier ran)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    started: str  # ISO 8601, UTC
    wall_s: float
    gpus: tuple[int, ...]  # NVML indices the GPU subset used (empty: CPU only)
    exit_code: int  # an ExitCode value: the process's exit status
    kernels: tuple[KernelCheck, ...] = ()
    lint: LintResult | None = None  # the --lint paths, when given
    notes: tuple[str, ...] = ()  # why a tier did not run, NVML trouble
    inventory: dict[str, Any] = field(default_factory=dict)
    log_dir: str = ""  # the workers' logs: --log-dir, or kept because something failed; "" removed
    # False in the reports written while the check runs (``on_progress``): the kernels checked
    # so far (the last one maybe in part), and the kernels still to check.
    complete: bool = True
    not_run: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.complete and self.exit_code == ExitCode.HEALTHY


# ---------------------------------------------------------------------------------------------
# parallel: the MoE block under dp, pp, tp and ep, per rank
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ModeResult:
    """One mode over its ranks: correctness and throughput against one GPU, and how it was
    launched (what a per-rank repro script restates)."""

    mode: Mode
    world_size: int
    devices_used: int
    status: Status  # the worst rank's
    ranks: tuple[str, ...]  # probe ids of its outcomes
    max_rel_error: float | None = None
    tolerance: float | None = None
    step_ms: float | None = None  # the slowest rank's median step
    tokens_per_step: int | None = None
    tokens_per_s: float | None = None
    speedup: float | None = None  # tokens/s over the one-device baseline's
    efficiency: float | None = None  # speedup / devices used
    command: tuple[str, ...] = ()
    run_dir: str = ""  # "" once the run's logs were removed (it ended healthy)
    exit_code: int | None = None
    timed_out: bool = False
    wall_s: float = 0.0
    torchrun: bool = False  # one process per rank under torchrun (dp, tp, ep)
    nproc: int = 1  # local processes of the launch
    shape: Shape | None = None  # the gate_up GEMM of one rank's step (M rows, E experts, N, K)
    seed: int = 0
    cuda_visible_devices: str | None = None  # as the ranks saw it (None: not set, the CPU tier)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    kernel: str
    tier: str
    started: str
    wall_s: float
    preset: str
    tokens: int
    dtype: str
    backend: str
    gpus: tuple[int, ...]
    gpu_of_ordinal: dict[int, int]
    modes: tuple[ModeResult, ...]
    outcomes: tuple[Outcome, ...]
    diagnoses: tuple[Diagnosis, ...]
    explanations: tuple[str, ...] = ()
    unexplained: tuple[Evidence, ...] = ()
    skipped: tuple[str, ...] = ()
    log_dir: str = ""  # the ranks' logs: --log-dir, or kept because something failed; "" removed

    @property
    def healthy(self) -> bool:
        return not self.diagnoses and not self.unexplained


# ---------------------------------------------------------------------------------------------
# repro: the pipeline, the shrink, the verdict and its confirmation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSummary:
    status: Status
    layers: int
    steps: int
    preset: str
    layer_gpus: tuple[int, ...]  # NVML index of each layer
    failed: bool
    step: int | None = None  # where it first failed
    layer: int | None = None
    gpu: int | None = None  # NVML index of that layer (or of the device where it surfaced)
    ordinal: int | None = None  # the same as a CUDA ordinal inside the child
    stage: str | None = None  # forward | backward | sync | compare
    what: str = ""  # wrong | misplaced | the error kind
    rel_error: float | None = None
    tolerance: float | None = None
    error_message: str | None = None
    current_device_kept: bool | None = None
    wall_s: float = 0.0

    def describe(self) -> str:
        where = ", ".join(f"layer {i} on GPU {g}" for i, g in enumerate(self.layer_gpus))
        head = f"{self.layers} layers of {self.preset} ({where}), {self.steps} steps"
        if not self.failed:
            return f"{head}: every layer's output and gradients matched the torch twin"
        at = []
        if self.step is not None:
            at.append(f"step {self.step}")
        if self.layer is not None:
            at.append(f"layer {self.layer}")
        if self.gpu is not None:
            at.append(f"GPU {self.gpu}")
        place = ", ".join(at) or "before the first layer"
        if self.status is Status.ERROR:
            msg = (self.error_message or "").strip().splitlines()
            text = f"{head}: {self.what} at {place} ({self.stage or 'setup'})"
            if self.stage == "sync":
                text += ", where asynchronous errors of that step's kernels surface"
            return text + (f": {msg[0][:160]}" if msg else "")
        err = (
            f", rel. error {self.rel_error:.3g} (tolerance {self.tolerance:g})"
            if self.rel_error is not None
            else ""
        )
        return f"{head}: first diverged at {place}, {self.stage}: {self.what}{err}"


SanitizerStatus = Literal["confirmed", "clean", "not-run", "unavailable", "failed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerConfirmation:
    status: SanitizerStatus
    reason: str
    probe_id: str | None = None
    tool: str | None = None  # path of the binary
    version: str | None = None
    errors: int | None = None  # ERROR SUMMARY
    first_error: str | None = None  # "Invalid __global__ write of size 16 bytes at f+0x10 (f.py:11)"
    touched: str | None = None  # the tensor the first bad access touched, in words
    attributions: tuple[str, ...] = ()  # one sentence per distinct address (the first few)
    tensors_hit: dict[str, int] = field(default_factory=dict)  # nearest tensor -> addresses
    sanitized_status: str | None = None  # the probe's own status under the sanitizer
    log_path: str | None = None
    wall_s: float = 0.0
    xid: XidReport | None = None  # Xid errors on the pair's GPUs during the sanitized run
    xid_evidence: tuple[str, ...] = ()  # the same in words, an Xid 31 address placed


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTime:
    name: str
    seconds: float
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReproReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    kernel: str
    started: str  # ISO 8601, UTC
    gpus: tuple[int, ...]  # NVML indices, pipeline order
    pair: tuple[int, int]  # (a current, b operands) of the shrink, NVML indices
    pipeline: PipelineSummary | None
    outcomes: tuple[Outcome, ...]  # in run order, the pipeline among them
    tried: tuple[str, ...]  # probe ids run, in order
    diagnoses: tuple[Diagnosis, ...] = ()
    explanations: tuple[str, ...] = ()
    unexplained: tuple[Evidence, ...] = ()
    verdict: str | None = None  # cause id of the primary diagnosis
    minimal: tuple[str, ...] = ()  # probe ids of the minimal failing probes, first = the minimal one
    stop: str | None = None  # why the shrink stopped where it did
    sanitizer: SanitizerConfirmation
    script: str | None = None  # path of the standalone repro script
    script_note: str = ""  # why no script, or how to run it
    stages: tuple[StageTime, ...] = ()
    time_to_verdict_s: float = 0.0
    wall_s: float = 0.0
    log_dir: str = ""  # the probes' logs: --log-dir, or kept because something failed; "" removed
    notes: tuple[str, ...] = ()

    @property
    def reproduced(self) -> bool:
        """The pipeline failed: the failure reproduced the way users hit it."""
        return self.pipeline is not None and self.pipeline.failed

    @property
    def faulty(self) -> bool:
        return self.reproduced or bool(self.diagnoses) or bool(self.unexplained)

    @property
    def could_not_run(self) -> bool:
        """Every probe died before its child was ready: nothing was tested."""
        return bool(self.outcomes) and all(
            o.status is Status.ERROR and o.phase is Phase.SPAWN for o in self.outcomes
        )


# --- qmoe-doctor run -- COMMAND (workflows.run): the user's own program, launch by launch ------


#: The passes of one run: the command as given, then the reruns asked for (each only when the
#: first pass gives it something to confirm): with CUDA_LAUNCH_BLOCKING=1, and under
#: compute-sanitizer memcheck with the caching allocator off.
#: "reference": a pass of ``run --compare``'s reference (``RunReport.reference_passes``).
RunPassLabel = Literal["run", "blocking", "sanitize", "reference"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCudaError:
    """A CUDA error one process met, with the launches before it (the faulting kernel is among
    them: CUDA reports a kernel's fault at a later call)."""

    process: str  # "rank 1 (pid 4242)"
    pid: int
    rank: int | None
    message: str
    error_kind: ErrorKind | None
    last_launches: tuple[Launch, ...]  # the ring's last ones, oldest first
    faulting: str | None = None  # the kernel whose launch raised it under CUDA_LAUNCH_BLOCKING=1
    exact: bool = False  # ``faulting`` is the faulting kernel (blocking launches), not a guess
    note: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPass:
    label: RunPassLabel
    argv: tuple[str, ...]  # what ran (compute-sanitizer's own arguments first, for "sanitize")
    env: dict[str, str] = field(default_factory=dict)  # what this pass set beyond the monitor's
    exit_code: int  # the shell's convention: 128 + N for a death by signal N
    end: str  # "exit 0", "killed by SIGSEGV", "SIGINT passed on, exit 130"
    wall_s: float
    processes: tuple[ProcessRecord, ...] = ()
    cuda_errors: tuple[RunCudaError, ...] = ()
    notes: tuple[str, ...] = ()  # records that ended unflushed or could not be read, ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RunDiagnosis:
    """A cause the monitor saw at work, with the first launch that showed it."""

    cause: str  # a key of core.causes.CAUSES
    kind: FindingKind
    confidence: Confidence
    summary: str
    kernel: str
    processes: tuple[str, ...]  # where it was seen ("rank 0 (pid 11)", ...)
    launches: int  # launches that showed it, all processes together
    finding: LaunchFinding  # the first: its launch, call site, tensors, lint
    seen_in: RunPassLabel = "run"
    # how the confidence was reached, in words ("placed by memcheck, 64 of 64 addresses after the
    # end of y_ptr; not yet proven differentially"); "" in reports written before it was kept
    basis: str = ""
    # the command that proves it differentially on the kernel (a scan), or how to get there
    repro: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacedFit:
    """A cause an invalid address fits, from where it landed ("rows past M": invalid-routing)."""

    cause: str  # a key of core.causes.CAUSES
    words: str  # what fits, as the placement's sentence says it ("m_sizes summing past M")
    cell: str = ""  # the scan condition that proves it on the kernel ("over-routed"); "" none does


@dataclass(frozen=True, slots=True, kw_only=True)
class AddressNote:
    """One invalid address compute-sanitizer reported, placed against the recorded tensors."""

    address: int
    kernel: str | None
    access: str  # "read of 16 bytes"
    tensor: str | None  # the recorded tensor it lies in or nearest to ("x_ptr of _k #3")
    device: str | None
    relation: str | None  # "inside", "after", "before"
    cross_device: bool
    sentences: tuple[str, ...]
    # bytes from the tensor's region, as AddressSanitizer counts them ("0 bytes after the N-byte
    # region"): after, address - end (0: the first byte after it); before, start - address (1: the
    # byte just before it); inside, address - start. None in reports written before it was kept,
    # whose sentences count the first byte after as 1 (compute-sanitizer's count)
    gap: int | None = None
    region: int | None = None  # the tensor's bytes (the N of "N-byte region")
    row: int | None = None  # the row (of a 2-D tensor; of its expert in a weight stack), or element
    expert: int | None = None  # in a weight stack (E, N, K)
    fits: tuple[PlacedFit, ...] = ()  # the causes where it landed fits


@dataclass(frozen=True, slots=True, kw_only=True)
class SanitizerRun:
    """The ``--sanitize`` pass: whether it ran, on which kernels, and what it found."""

    ran: bool
    note: str  # why it did not run, or one line on what it found
    binary: str = ""
    version: str = ""
    kernels: tuple[str, ...] = ()  # the --kernel-name filter's kernels
    launch_count: int | None = None
    log_path: str = ""
    errors: int = 0  # records in the log
    addresses: tuple[AddressNote, ...] = ()
    # what the placed addresses say together: the diagnosis they gave, or why they gave none
    agreement: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    command: tuple[str, ...]
    started: str  # ISO 8601, UTC
    wall_s: float
    exit_code: int  # what qmoe-doctor run exits with (README: exit codes)
    command_exit: int  # the command's own, in the first pass
    passes: tuple[RunPass, ...]
    diagnoses: tuple[RunDiagnosis, ...] = ()
    lint: tuple[SourceLint, ...] = ()  # the lint of every source that launched a kernel
    sanitizer: SanitizerRun | None = None
    record_dir: str = ""  # where the records stay ("" once removed: a healthy run)
    notes: tuple[str, ...] = ()
    compare: RunCompare | None = None  # run --compare: the subject (the run pass) against a reference
    reference_passes: tuple[RunPass, ...] = ()  # run --compare: the reference's passes

    @property
    def cuda_errors(self) -> tuple[RunCudaError, ...]:
        return tuple(e for p in self.passes for e in p.cuda_errors)

    @property
    def sanitizer_errors(self) -> int:
        """The errors compute-sanitizer memcheck reported in the ``--sanitize`` pass (invalid
        accesses, the CUDA errors they ended in); 0 when it found none or did not run."""
        s = self.sanitizer
        return s.errors if s is not None and s.ran else 0

    @property
    def healthy(self) -> bool:
        """Nothing found: no diagnosis, no CUDA error in any pass, no memcheck error, and (with
        --compare) no divergent launch."""
        diverged = self.compare is not None and self.compare.diverged
        return not self.diagnoses and not self.cuda_errors and not self.sanitizer_errors and not diverged
