"""The caching allocator's own map of one probe run: segments, blocks and who allocated them.

The child (``probes/snapshot.py``) reduces ``torch.cuda.memory._snapshot()`` to these records
and hands them back as the outcome fact ``allocator_snapshot``; the parent reads the fact back
with ``read_allocator_snapshot`` and places a faulting address with ``locate_in_snapshot``
(``qmoe_doctor.diagnose.attribution`` puts the place into words). An address that no registered
tensor holds may still lie in a block the allocator handed out (a temporary, a freed output, a
canary), and the allocator knows which line of Python asked for it.

Stdlib only: both sides import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from qmoe_doctor.core.records import SCHEMA_VERSION, from_jsonable

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


__all__ = [
    "AllocBlock",
    "AllocFrame",
    "AllocHistory",
    "AllocSegment",
    "AllocatorSnapshot",
    "BlockState",
    "SnapshotPlace",
    "locate_in_snapshot",
    "read_allocator_snapshot",
]
