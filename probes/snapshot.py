"""The caching allocator's map of one probe run, for address attribution (child side).

``AllocatorRecorder`` turns on ``torch.cuda.memory._record_memory_history`` before the probe and
takes ``torch.cuda.memory._snapshot()`` after it (also when the probe raised: the worker's
``execute`` returns an outcome either way); ``reduce_snapshot`` boils the snapshot down to the
records of ``qmoe_doctor.core.allocator`` (``AllocatorSnapshot``: segments and blocks per device with
address, size, state, stream and the allocating stack's innermost user-code frame, and the
recorded allocations), which ``probes/run_one.py`` stores as the outcome fact
``allocator_snapshot``. The parent reads it back with ``allocator.read_allocator_snapshot``.

Both torch functions are private API: if either is missing or fails, the fact says why
(``taken: false``) and the probe's outcome stands as it was. Nothing is recorded when the
caching allocator is off (``PYTORCH_NO_CUDA_MEMORY_CACHING`` set, as in the compute-sanitizer
run): allocations then bypass the allocator (a plain cudaMalloc each), so its map would be empty.

The snapshot keys ``reduce_snapshot`` relies on (torch 2.x; ``torch/csrc/cuda/memory_snapshot.cpp``
and the ``_snapshot`` docstring), each read defensively:

* ``snapshot["segments"]``: a list of segments, each with ``device`` (CUDA ordinal),
  ``address``, ``total_size``, ``stream`` (an integer), ``segment_type`` ("large"/"small"),
  ``is_expandable`` (optional), ``frames`` (optional: who asked for the cudaMalloc) and
  ``blocks``: a list in address order, each with ``size``, ``state``
  ("active_allocated", "active_pending_free" - the docstring spells it "active_awaiting_free" -
  or "inactive"), ``requested_size`` (optional), ``address`` (optional: else the running sum of
  sizes from the segment's address) and ``frames``.
* ``snapshot["device_traces"]``: one list per device, indexed by ordinal, of history entries with
  ``action`` ("alloc", "free_requested", "free_completed", "segment_alloc", ...), ``addr``,
  ``size``, ``stream`` and ``frames``.
* A frame is ``{"filename", "line", "name"}``; a stack lists the innermost frame first (the
  memory viz reverses it for flame graphs).

This module imports no torch at import time: ``reduce_snapshot`` is pure and runs on a CPU.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from qmoe_doctor.core.allocator import (
    AllocatorSnapshot,
    AllocBlock,
    AllocFrame,
    AllocHistory,
    AllocSegment,
    BlockState,
)
from qmoe_doctor.core.records import Condition, ProbeSpec

#: The history ring buffer's length (``_record_memory_history(max_entries=...)``). A probe makes
#: tens of allocations, the pipeline a few thousand; each entry holds one Python stack.
MAX_ENTRIES = 20_000
#: Blocks kept over all segments, and recorded allocations kept per device (latest first): the
#: fact travels in the Outcome's one JSON line.
MAX_BLOCKS = 4096
MAX_HISTORY_PER_DEVICE = 2048
#: Frames from these paths are library frames, never "user code" (the child adds the install
#: directories of the stdlib, torch and triton it runs with).
LIBRARY_PARTS: tuple[str, ...] = (
    "/site-packages/torch/",
    "/dist-packages/torch/",
    "/site-packages/triton/",
    "/dist-packages/triton/",
    "<frozen ",
)
_STATES: dict[str, BlockState] = {
    "active_allocated": "active_allocated",
    "active_pending_free": "active_pending_free",
    "active_awaiting_free": "active_pending_free",
    "inactive": "inactive",
}
_FREES = frozenset({"free_requested", "free_completed"})


# ---------------------------------------------------------------------------------------------
# The reduction (pure)
# ---------------------------------------------------------------------------------------------


def user_frame(frames: Any, library_parts: Sequence[str] = LIBRARY_PARTS) -> AllocFrame | None:
    """The innermost frame of a stack that is Python source outside the libraries."""
    if not isinstance(frames, list):
        return None
    for f in frames:  # innermost first
        if not isinstance(f, Mapping):
            continue
        filename = f.get("filename")
        line = f.get("line")
        if not isinstance(filename, str) or not filename.endswith(".py") or not isinstance(line, int):
            continue
        if any(part in filename for part in library_parts):
            continue
        return AllocFrame(file=filename, line=line, name=str(f.get("name", "?")))
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reduce_snapshot(
    snapshot: Mapping[str, Any],
    *,
    max_blocks: int = MAX_BLOCKS,
    max_history_per_device: int = MAX_HISTORY_PER_DEVICE,
    library_parts: Sequence[str] = LIBRARY_PARTS,
) -> AllocatorSnapshot:
    """``torch.cuda.memory._snapshot()``'s dict as an ``AllocatorSnapshot`` (the keys it relies
    on are in this module's docstring). Malformed entries are skipped and counted in ``notes``."""
    notes: list[str] = []
    skipped = 0
    truncated = False
    segments: list[AllocSegment] = []
    n_blocks = 0
    raw_segments = snapshot.get("segments", [])
    if not isinstance(raw_segments, list):
        raw_segments = []
        notes.append("the snapshot has no segment list")
    for seg in raw_segments:
        if not isinstance(seg, Mapping):
            skipped += 1
            continue
        device, address, size = _int(seg.get("device")), _int(seg.get("address")), _int(seg.get("total_size"))
        if device is None or address is None or size is None:
            skipped += 1
            continue
        blocks: list[AllocBlock] = []
        cursor = address
        raw_blocks = seg.get("blocks", [])
        for b in raw_blocks if isinstance(raw_blocks, list) else []:
            if not isinstance(b, Mapping):
                skipped += 1
                continue
            b_size = _int(b.get("size"))
            state = _STATES.get(str(b.get("state")))
            if b_size is None or state is None:
                skipped += 1
                continue
            b_addr = _int(b.get("address"))
            b_addr = cursor if b_addr is None else b_addr
            cursor = b_addr + b_size
            if n_blocks >= max_blocks:
                truncated = True
                continue
            n_blocks += 1
            blocks.append(
                AllocBlock(
                    address=b_addr,
                    size=b_size,
                    state=state,
                    requested_size=_int(b.get("requested_size")),
                    frame=user_frame(b.get("frames"), library_parts),
                )
            )
        segments.append(
            AllocSegment(
                device=device,
                address=address,
                size=size,
                stream=_int(seg.get("stream")) or 0,
                pool=str(seg.get("segment_type", "")),
                expandable=bool(seg.get("is_expandable", False)),
                frame=user_frame(seg.get("frames"), library_parts),
                blocks=tuple(blocks),
            )
        )
    history: list[AllocHistory] = []
    traces = snapshot.get("device_traces", [])
    for device, trace in enumerate(traces if isinstance(traces, list) else []):
        kept, cut = _reduce_trace(device, trace, library_parts, max_history_per_device)
        history.extend(kept)
        truncated = truncated or cut
    if skipped:
        notes.append(f"{skipped} malformed snapshot entries skipped")
    if truncated:
        notes.append(
            f"cut to {max_blocks} blocks and the latest {max_history_per_device} allocations per device"
        )
    return AllocatorSnapshot(
        taken=True,
        segments=tuple(segments),
        history=tuple(history),
        truncated=truncated,
        notes=tuple(notes),
    )


def _reduce_trace(
    device: int, trace: Any, library_parts: Sequence[str], keep: int
) -> tuple[list[AllocHistory], bool]:
    """The ``alloc`` entries of one device's history, each marked freed when a later free of
    the same address follows; the latest ``keep`` of them, oldest first."""
    if not isinstance(trace, list):
        return [], False
    allocs: list[AllocHistory] = []
    live: dict[int, int] = {}  # address -> index in allocs of its latest allocation
    for entry in trace:
        if not isinstance(entry, Mapping):
            continue
        action = entry.get("action")
        addr = _int(entry.get("addr"))
        if addr is None:
            continue
        if action == "alloc":
            size = _int(entry.get("size"))
            if size is None:
                continue
            live[addr] = len(allocs)
            allocs.append(
                AllocHistory(
                    device=device,
                    address=addr,
                    size=size,
                    stream=_int(entry.get("stream")) or 0,
                    frame=user_frame(entry.get("frames"), library_parts),
                )
            )
        elif action in _FREES and addr in live:
            i = live[addr]
            h = allocs[i]
            if not h.freed or h.free_frame is None:
                free_frame = h.free_frame or user_frame(entry.get("frames"), library_parts)
                allocs[i] = AllocHistory(
                    device=h.device,
                    address=h.address,
                    size=h.size,
                    stream=h.stream,
                    frame=h.frame,
                    freed=True,
                    free_frame=free_frame,
                )
            if action == "free_completed":
                del live[addr]
    cut = len(allocs) > keep
    return allocs[-keep:] if keep > 0 else [], cut


# ---------------------------------------------------------------------------------------------
# Recording (torch; guarded)
# ---------------------------------------------------------------------------------------------


def _library_parts(names: Iterable[str] = ("torch", "triton")) -> tuple[str, ...]:
    """LIBRARY_PARTS plus the directories this process loaded the stdlib, torch and triton from
    (a source checkout of torch is not under site-packages)."""
    parts = list(LIBRARY_PARTS)
    stdlib = sysconfig.get_paths().get("stdlib")
    if stdlib:
        parts.append(os.path.join(stdlib, ""))
    for name in names:
        path = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(path, str):
            parts.append(os.path.join(os.path.dirname(path), ""))
    return tuple(parts)


class AllocatorRecorder:
    """``start()`` before the probe, ``finish()`` after it. Never raises: anything that goes
    wrong ends as ``AllocatorSnapshot(taken=False, reason=...)``."""

    def __init__(
        self,
        spec: ProbeSpec,
        *,
        max_entries: int = MAX_ENTRIES,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.max_entries = max_entries
        self.environ = os.environ if environ is None else environ
        self.reason: str | None = None  # set when nothing will be (or was) recorded
        self._recording = False

    def _skip_reason(self) -> str | None:
        if "PYTORCH_NO_CUDA_MEMORY_CACHING" in self.environ:
            return (
                "the caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING is set): allocations "
                "bypass it, so it has no segments to show"
            )
        if self.spec.condition is Condition.UNTOUCHED:
            # turning the history on initializes torch's CUDA state; this cell needs ordinal a
            # to have no context at the call, so it is left exactly as the scan runs it
            return "the untouched condition runs without allocator recording (it would touch CUDA first)"
        if self.spec.device is None and self.spec.current is None:
            return "a CPU probe: no CUDA allocator"
        return None

    def start(self) -> None:
        self.reason = self._skip_reason()
        if self.reason is not None:
            return
        try:
            import torch

            if not torch.cuda.is_available():
                self.reason = "no CUDA device in this process"
                return
            record = getattr(torch.cuda.memory, "_record_memory_history", None)
            if record is None:
                self.reason = "this torch has no torch.cuda.memory._record_memory_history"
                return
            try:
                record(enabled="all", context="all", stacks="python", max_entries=self.max_entries)
            except TypeError:  # torch 2.0's signature: (enabled: bool, ..., trace_alloc_max_entries)
                record(True, trace_alloc_max_entries=self.max_entries, trace_alloc_record_context=True)
            self._recording = True
        except Exception as exc:
            self.reason = f"allocator history could not be turned on: {type(exc).__name__}: {exc}"

    def finish(self) -> AllocatorSnapshot:
        if self.reason is not None or not self._recording:
            return AllocatorSnapshot(taken=False, reason=self.reason or "recording was never started")
        try:
            import torch

            take = getattr(torch.cuda.memory, "_snapshot", None)
            if take is None:
                return AllocatorSnapshot(taken=False, reason="this torch has no torch.cuda.memory._snapshot")
            return reduce_snapshot(take(), library_parts=_library_parts())
        except Exception as exc:
            return AllocatorSnapshot(
                taken=False, reason=f"the snapshot failed: {type(exc).__name__}: {str(exc)[:300]}"
            )
        finally:
            self._stop()

    def _stop(self) -> None:
        if not self._recording:
            return
        self._recording = False
        try:
            import torch

            record: Any = torch.cuda.memory._record_memory_history
            try:
                record(enabled=None)
            except TypeError:  # torch 2.0
                record(False)
        except Exception:  # the process ends after this probe; turning it off is a courtesy
            pass


__all__ = [
    "LIBRARY_PARTS",
    "MAX_BLOCKS",
    "MAX_ENTRIES",
    "MAX_HISTORY_PER_DEVICE",
    "AllocatorRecorder",
    "reduce_snapshot",
    "user_frame",
]
