"""The last launches of a process, kept cheaply: plain lists on the hot path, records at a flush.

A launch is appended as a list (``Entry``) of what the hot path read from the tensors' metadata
(torch objects that hold no tensor: a ``torch.device``, a ``torch.Size``, a ``torch.dtype``), so
nothing is converted, formatted or kept alive per launch; ``to_launch`` turns one into a
``core.launches.Launch`` when the record is written. ``collections.deque`` with ``maxlen``
appends and drops in C, so threads (autograd's device threads launch too) share it safely.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from qmoe_doctor.core.launches import Launch, SourceSite, TensorArg, element_span

# Entry fields, by index (a list: the grid function and the outcome fill theirs in later)
# (FLAGGED holds the keys of the findings the launch showed: () when none)
SEQ, KERNEL, KERNEL_SEQ, GRID, DEVICE, STREAM, TENSORS, CALL_SITE, LAUNCH_SITE, T, THREAD, RAISED, FLAGGED = range(
    13
)
Entry = list[Any]
#: One tensor argument as the hot path takes it: (name, device, data_ptr, shape, strides, dtype).
RawTensor = tuple[str, Any, int, Any, Any, Any]


def new_entry(
    seq: int, kernel: str, kernel_seq: int, grid: Any, device: str | None, stream: int | None, t: float
) -> Entry:
    return [seq, kernel, kernel_seq, grid, device, stream, (), None, None, t, "", "", ()]


class Ring:
    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: deque[Entry] = deque(maxlen=max(size, 1))

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)

    def snapshot(self) -> list[Entry]:
        """The entries, oldest first (``list(deque)`` runs in C: no thread interleaves)."""
        return list(self.entries)

    def clear(self) -> None:
        self.entries.clear()


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_arg(raw: RawTensor) -> TensorArg:
    name, device, data_ptr, shape, strides, dtype = raw
    dims = tuple(int(d) for d in shape)
    steps = tuple(int(s) for s in strides)
    numel = math.prod(dims)
    span = element_span(dims, steps)
    itemsize = int(getattr(dtype, "itemsize", 0) or 0)
    return TensorArg(
        name=name,
        device=str(device),
        data_ptr=int(data_ptr),
        nbytes=span * itemsize,
        shape=dims,
        strides=steps,
        dtype=dtype_name(dtype),
        numel=numel,
    )


def grid_tuple(grid: Any) -> tuple[int, ...] | None:
    if grid is None or callable(grid):
        return None
    try:
        return tuple(int(g) for g in grid)
    except (TypeError, ValueError):
        return None


def to_launch(entry: Entry) -> Launch:
    call_site: SourceSite | None = entry[CALL_SITE]
    launch_site: SourceSite | None = entry[LAUNCH_SITE]
    return Launch(
        seq=entry[SEQ],
        kernel=entry[KERNEL],
        kernel_seq=entry[KERNEL_SEQ],
        grid=grid_tuple(entry[GRID]),
        device=entry[DEVICE],
        stream=entry[STREAM],
        tensors=tuple(tensor_arg(raw) for raw in entry[TENSORS]),
        call_site=call_site,
        launch_site=launch_site,
        t=round(entry[T], 6),
        thread=entry[THREAD],
        raised=entry[RAISED],
        flagged=bool(entry[FLAGGED]),
    )


__all__ = [
    "CALL_SITE",
    "DEVICE",
    "FLAGGED",
    "GRID",
    "KERNEL",
    "KERNEL_SEQ",
    "LAUNCH_SITE",
    "RAISED",
    "SEQ",
    "STREAM",
    "TENSORS",
    "THREAD",
    "Entry",
    "RawTensor",
    "Ring",
    "T",
    "dtype_name",
    "grid_tuple",
    "new_entry",
    "tensor_arg",
    "to_launch",
]
