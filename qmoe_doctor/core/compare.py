"""What ``qmoe-doctor run --compare REFERENCE`` concluded, as records (stdlib only).

The run pass is the *subject*; the reference runs ``--repeat N`` times. Both print every
launch's tensors (``core.fingerprints``); ``diagnose.compare`` matches their launches per
process and kernel ordinal and finds:

* :class:`LaunchDifference` ``divergence``: the subject's first launch whose prints differ from
  the reference's beyond what the reference runs differ among themselves, *in* the kernel
  (inputs equal, outputs not) or *before* it (its inputs already differ);
* :class:`LaunchDifference` ``nondeterminism``: the first launch whose prints differ between
  the reference runs themselves (every run, the subject too, under ``repeat``);
* per matched process pair (:class:`CompareProcesses`): how many launches were compared, where
  the launch sequences stop matching (extra launches, another autotune choice), and the
  nondeterministic launches;
* the verdict, with a cause id where one fits, and the ``qmoe-doctor scan`` command that proves
  it on the extracted kernel.

``RunReport.compare`` holds it (``core.reports``); the reference passes are
``RunReport.reference_passes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.fingerprints import Contents, LaunchPrint
from qmoe_doctor.core.records import Confidence


class CompareKind(StrEnum):
    BLOCKING = "blocking"  # the same command with CUDA_LAUNCH_BLOCKING=1: no overlap, no race
    REPEAT = "repeat"  # the same command again: run-to-run nondeterminism
    COMMAND = "command"  # another command (another placement, one GPU): a placement fault


#: Where a launch's difference arose: in the kernel (its inputs equal, its outputs not), before
#: it (its inputs already differ), or undecided (only a tensor it writes held different contents
#: before it: uninitialized memory, or an input it accumulates into).
DifferenceWhere = Literal["in-kernel", "before", "undecided"]
#: Which read of a tensor differs: just before the launch, or just after it.
Phase = Literal["before", "after"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorDelta:
    """One tensor argument whose prints differ between two runs, and by how much, measured by
    what a print holds (never the whole tensor element by element)."""

    name: str
    device: str  # in the subject (the first run compared)
    other_device: str  # in the reference
    dtype: str
    shape: tuple[int, ...]
    numel: int
    phase: Phase
    subject: Contents
    reference: Contents
    written: bool  # the launch writes it (its contents after differ from before, in some run)
    #: the sampled values kept (core.fingerprints.SAMPLE_KEPT at fixed positions): their largest
    #: and mean |difference|, and the largest |difference| / |reference value| (reference != 0)
    sample_max_abs: float
    sample_mean_abs: float
    sample_max_rel: float | None
    sample_differing: int  # kept values that differ
    sample_kept: int
    #: a lower bound on the mean |difference| over the whole tensor: max(|d sum|, |d sum |x||) / numel
    mean_abs_lower_bound: float
    tolerance: float | None = None  # allowed |d sum| (noise seen between reference runs); None: exact

    @property
    def sum_delta(self) -> float:
        return self.subject.total - self.reference.total

    @property
    def abs_sum_delta(self) -> float:
        return self.subject.total_abs - self.reference.total_abs

    @property
    def hash_differs(self) -> bool:
        return self.subject.sample_hash != self.reference.sample_hash


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchDifference:
    """One launch whose prints differ between two runs, with the launch before it that matched."""

    process: str  # "rank 0 (pid 11)" in the subject (the first run compared)
    launch: LaunchPrint  # in the subject (for nondeterminism: the first run that differs)
    other: LaunchPrint  # the same launch in the reference run
    where: DifferenceWhere
    deltas: tuple[TensorDelta, ...]  # the tensors whose relevant read differs
    #: tensors the launch writes whose contents *before* it differed (not counted as inputs)
    written_before: tuple[TensorDelta, ...] = ()
    arguments: str = ""  # the grid or scalar arguments that differ ("" when they are equal)
    previous: LaunchPrint | None = None  # the last launch before it that matched (None: it is the first)
    noisy: bool = False  # the reference runs differ at this launch too: compared within a tolerance
    position: int = 0  # its place among the process's matched launches, from 1


@dataclass(frozen=True, slots=True, kw_only=True)
class CompareProcesses:
    """One subject process matched with its reference runs' processes."""

    subject: str  # its label, "rank 1 (pid 4242)"
    references: tuple[str, ...]  # one per reference run, "" where that run had no such process
    compared: int  # launches matched and compared
    printed: int  # launches the subject printed
    stop: str = ""  # where and why the launch sequences stop matching ("" when they do not)
    nondeterministic: int = 0  # compared launches whose prints differ between reference runs
    #: of those, the launches whose inputs were equal between those runs and outputs not: the
    #: kernel itself is nondeterministic (atomic adds, split-K, a race inside)
    nondeterministic_in_kernel: int = 0
    divergent: int = 0  # compared launches whose subject prints differ beyond the references'
    first_divergent: int | None = None  # its launch number (seq) in the subject
    first_nondeterministic: int | None = None  # its seq in the first run that differs


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCompare:
    """The compare section of a run report."""

    kind: CompareKind
    reference: tuple[str, ...]  # the reference command as it ran (argv)
    reference_env: dict[str, str]  # what the reference passes set ({"CUDA_LAUNCH_BLOCKING": "1"})
    repeat: int  # reference runs
    limit: int  # launches of each kernel printed per process
    processes: tuple[CompareProcesses, ...] = ()
    divergence: LaunchDifference | None = None
    nondeterminism: LaunchDifference | None = None
    verdict: str = ""  # one line
    cause: str | None = None  # a key of core.causes.CAUSES where one fits
    confidence: Confidence | None = None
    explanation: tuple[str, ...] = ()  # what the evidence says, line by line
    nondeterminism_explanation: tuple[str, ...] = ()  # the same of the nondeterministic launch
    scan: str = ""  # the qmoe-doctor scan command that proves it on the extracted kernel
    scan_note: str = ""  # why there is none, when there is none
    tolerance: str = ""  # how nondeterministic launches were compared
    notes: tuple[str, ...] = ()

    @property
    def diverged(self) -> bool:
        return self.divergence is not None

    @property
    def nothing_compared(self) -> bool:
        """No launch was compared (none printed, none matched, the references interrupted):
        the section claims nothing either way."""
        return not self.diverged and sum(p.compared for p in self.processes) == 0


__all__ = [
    "CompareKind",
    "CompareProcesses",
    "DifferenceWhere",
    "LaunchDifference",
    "Phase",
    "RunCompare",
    "TensorDelta",
]
