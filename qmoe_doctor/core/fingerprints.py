"""Fingerprints of the tensors a Triton launch reads and writes: what ``qmoe-doctor run
--compare`` records in each pass and compares between them (stdlib only).

In a compare pass the launch monitor reads every tensor argument of a launch just before it and
just after it, on the tensor's own device, and keeps a :class:`Contents` of each: the element
count, the sum and the sum of absolute values in float64, the count of non-finite elements, and
a hash of the values at fixed positions (:func:`sample_positions`: evenly spaced over the
flattened tensor, the first and last element included, the same in every run and process for a
tensor of that many elements), with a few of those values kept to say by how much two runs
differ. One launch is a :class:`LaunchPrint`, keyed in its process by the kernel and the
launch's ordinal among that kernel's printed launches; the autotuner's benchmark launches are
left out of the ordinals (their count depends on timing).

Each process appends its prints to ``prints-<pid>-<token>.jsonl`` beside its record
(``process-<pid>-<token>.json``), one JSON object a line: ``{"launch": LaunchPrint}``, and
``{"state": PrintsState}`` at each flush (the last one holds). What a fingerprint can tell:
two runs whose prints of a tensor are equal agree on its sums, its non-finite count and the
values at the sampled positions, not necessarily everywhere else; two prints that differ
differ for sure. A difference of sums is a lower bound on the sum of absolute differences
(``|sum a - sum b| <= sum |a - b|``), never its maximum.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from qmoe_doctor.core.launches import SourceSite
from qmoe_doctor.core.records import SCHEMA_VERSION, from_jsonable, to_json

#: Positions of a tensor whose values are hashed (all of them for a smaller tensor).
SAMPLE_HASHED = 1024
#: Of those, the values kept in the print (evenly spaced among them), to measure differences.
SAMPLE_KEPT = 16
#: Launches of each kernel printed per process, by default (``run --compare-launches``): a long
#: run has millions of launches; the first ones of each kernel locate where two runs part.
DEFAULT_PRINTED_LAUNCHES = 128
#: A process stops printing once its prints file reaches this size (the report says so).
MAX_PRINTS_BYTES = 64 * 2**20
#: Leading numbers of the vector the monitor reads per tensor: sum, sum of |x|, non-finite count.
HEAD = 3


def sample_positions(numel: int, count: int = SAMPLE_HASHED) -> list[int]:
    """The flat positions (row-major over the tensor's shape) whose values are hashed: every
    position of a tensor of ``count`` elements or fewer, else ``count`` evenly spaced ones, the
    first and the last included."""
    if numel <= count:
        return list(range(numel))
    if count == 1:
        return [0]
    return [(i * (numel - 1)) // (count - 1) for i in range(count)]


def kept_indices(hashed: int) -> list[int]:
    """Which of ``hashed`` sampled values a print keeps (evenly spaced, at most SAMPLE_KEPT)."""
    return sample_positions(hashed, SAMPLE_KEPT)


def sample_hash(values: Sequence[float]) -> str:
    """A hash of the sampled values as float64 (exact for every float and int dtype up to 2**53)."""
    packed = struct.pack(f"<{len(values)}d", *values)
    return hashlib.blake2b(packed, digest_size=8).hexdigest()


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@dataclass(frozen=True, slots=True, kw_only=True)
class Contents:
    """One tensor's contents at one moment (before or after a launch)."""

    total: float  # sum of the elements, accumulated in float64
    total_abs: float  # sum of |x|, float64
    nonfinite: int  # NaN and +-inf elements
    sample_hash: str  # sample_hash() of the values at sample_positions()
    sample: tuple[float, ...] = ()  # the kept values (kept_indices() of the sampled ones)

    def same(self, other: Contents) -> bool:
        """Equal in every measure (NaN sums equal NaN sums)."""
        return (
            self.sample_hash == other.sample_hash
            and self.nonfinite == other.nonfinite
            and _same_float(self.total, other.total)
            and _same_float(self.total_abs, other.total_abs)
        )

    @classmethod
    def from_vector(cls, vector: Sequence[float]) -> Contents:
        """From what the monitor reads per tensor: [sum, sum |x|, non-finite count, *sampled values]."""
        values = list(vector[HEAD:])  # floats already (Tensor.tolist of a float64 tensor)
        return cls(
            total=float(vector[0]),
            total_abs=float(vector[1]),
            nonfinite=int(vector[2]),
            sample_hash=sample_hash(values),
            sample=tuple(values[i] for i in kept_indices(len(values))),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorPrint:
    """One tensor argument of a printed launch."""

    name: str  # the kernel parameter ("x_ptr"), as the monitor's records name it
    device: str  # "cuda:1", "cpu"
    dtype: str  # "bfloat16"
    shape: tuple[int, ...]
    numel: int
    before: Contents  # read just before the launch (in its stream's order on the launch device)
    after: Contents | None = None  # read just after it; None: the same as before (not written)

    @property
    def written(self) -> bool:
        return self.after is not None

    @property
    def final(self) -> Contents:
        return self.after if self.after is not None else self.before


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPrint:
    """One printed launch: its place in its process, what ran, and its tensors' prints."""

    seq: int  # the process's launch number (the monitor's record counts the same way)
    kernel: str
    ordinal: int  # this kernel's printed launch number in its process, from 1 (benchmarks left out)
    config: str | None = None  # constexpr arguments and launch options ("BLOCK=16, num_warps=4")
    scalars: str | None = None  # the other non-tensor arguments ("N=100, stride_xm=16")
    grid: tuple[int, ...] | None = None
    device: str | None = None  # the launch device; None under the interpreter
    stream: int | None = None  # the launch stream's handle; None under the interpreter
    call_site: SourceSite | None = None  # the user's frame
    launch_site: SourceSite | None = None  # the frame that wrote kernel[grid](...)
    thread: str = ""  # the launching thread's name when not the main thread
    tensors: tuple[TensorPrint, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PrintsState:
    """How a process's printing went, rewritten at each flush (the last line of its kind holds)."""

    schema_version: int = SCHEMA_VERSION
    pid: int = 0
    limit: int = DEFAULT_PRINTED_LAUNCHES  # launches printed per kernel
    printed: int = 0  # launches printed
    past_limit: int = 0  # launches not printed: their kernel had reached the limit
    benchmark: int = 0  # the autotuner's benchmark launches (never printed)
    kernels_at_limit: tuple[str, ...] = ()
    stopped: str = ""  # why printing stopped early ("" when it did not)
    lost: int = 0  # printed launches whose results never came back (a CUDA error, a hard end)
    final: bool = False  # written when the process ended (not by a periodic flush)
    problems: tuple[str, ...] = ()


def prints_name(pid: int, token: str) -> str:
    """``prints-<pid>-<token>.jsonl``: beside ``process-<pid>-<token>.json``, the same token."""
    return f"prints-{pid}-{token}.jsonl"


def _contents(c: Contents) -> dict[str, object]:
    return {
        "total": c.total,
        "total_abs": c.total_abs,
        "nonfinite": c.nonfinite,
        "sample_hash": c.sample_hash,
        "sample": list(c.sample),
    }


def _site(site: SourceSite | None) -> dict[str, object] | None:
    return None if site is None else {"file": site.file, "line": site.line, "function": site.function}


def launch_line(launch: LaunchPrint) -> str:
    """``{"launch": ...}`` and a newline: what ``to_json`` writes, spelt out (the generic writer
    took most of a print's time, on the path of every printed launch)."""
    body = {
        "seq": launch.seq,
        "kernel": launch.kernel,
        "ordinal": launch.ordinal,
        "config": launch.config,
        "scalars": launch.scalars,
        "grid": None if launch.grid is None else list(launch.grid),
        "device": launch.device,
        "stream": launch.stream,
        "call_site": _site(launch.call_site),
        "launch_site": _site(launch.launch_site),
        "thread": launch.thread,
        "tensors": [
            {
                "name": t.name,
                "device": t.device,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "numel": t.numel,
                "before": _contents(t.before),
                "after": None if t.after is None else _contents(t.after),
            }
            for t in launch.tensors
        ],
    }
    return json.dumps({"launch": body}, separators=(",", ":"), allow_nan=True) + "\n"


def state_line(state: PrintsState) -> str:
    return '{"state":' + to_json(state) + "}\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessPrints:
    """A process's prints file, read back: its launches in launch order and its last state."""

    launches: tuple[LaunchPrint, ...] = ()
    state: PrintsState | None = None  # None: no state line (killed before its first flush)
    unreadable: int = 0  # lines that could not be read (a line cut by a hard end)


def read_prints(text: str) -> ProcessPrints:
    """Parse a prints file; a line that does not parse is counted, not fatal (the last one may be
    cut short by a hard end)."""
    launches: list[LaunchPrint] = []
    state: PrintsState | None = None
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if "launch" in obj:
                launches.append(from_jsonable(LaunchPrint, obj["launch"]))
            elif "state" in obj:
                state = from_jsonable(PrintsState, obj["state"])
            else:
                bad += 1
        except (ValueError, TypeError, KeyError):
            bad += 1
    launches.sort(key=lambda launch: launch.seq)
    return ProcessPrints(launches=tuple(launches), state=state, unreadable=bad)


__all__ = [
    "DEFAULT_PRINTED_LAUNCHES",
    "HEAD",
    "MAX_PRINTS_BYTES",
    "SAMPLE_HASHED",
    "SAMPLE_KEPT",
    "Contents",
    "LaunchPrint",
    "PrintsState",
    "ProcessPrints",
    "TensorPrint",
    "kept_indices",
    "launch_line",
    "prints_name",
    "read_prints",
    "sample_hash",
    "sample_positions",
    "state_line",
]
