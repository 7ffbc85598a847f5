"""The last launches of a process, kept cheaply: plain lists on the hot path, records at a flush.

A launch is appended as a list (``Entry``) of what the hot path had in hand: the kernel's name,
the grid, the launch device's ordinal, the stream, and per tensor argument its name (shared by
every launch of one argument layout), data pointer and device ordinal (``Tensor.get_device()``).
Shapes, strides and dtypes are read at the launch only for a *sampled* launch (a kernel's first
ones, every ``SAMPLE_EVERY``-th after, every flagged one, every launch of a kernel whose lint
found an int32 product) into ``FACTS``. When the record is written, an unsampled launch's tensor
takes the facts of a sampled launch of the same kernel argument at the same address and device
(``known``: a plan's buffers, launch after launch), else it keeps its name, device and pointer
with no size. Nothing is converted or formatted per launch, and the ring keeps no tensor alive.
``to_launch`` turns an entry into a ``core.launches.Launch``. ``collections.deque`` with
``maxlen`` appends and drops in C, so threads (autograd's device threads launch too) share it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from qmoe_doctor.core.launches import Launch, SourceSite, TensorArg, element_span

# Entry fields, by index (a list: the grid function and the outcome fill theirs in later)
# DEVICE: the launch device's ordinal (None: the interpreter); NAMES, PTRS, DEVICES: one item
# per tensor argument; FACTS: the RawTensors of a sampled launch (None when not sampled);
# THREAD: threading.get_ident(); FLAGGED: the keys of the findings the launch showed (() when none);
# USER_SITE, WRAPPER: the user's own line and the wrapper's reference (callsite.Sites), sampled
(
    SEQ, KERNEL, KERNEL_SEQ, GRID, DEVICE, STREAM, NAMES, PTRS, DEVICES, FACTS, CALL_SITE, LAUNCH_SITE, T, THREAD,
    RAISED, FLAGGED, USER_SITE, WRAPPER,
) = range(18)  # fmt: skip
Entry = list[Any]
#: One tensor argument, read whole: (name, device, data_ptr, shape, strides, dtype).
RawTensor = tuple[str, Any, int, Any, Any, Any]
#: The fields of a launch that has not run yet, and of one whose sites were not taken.
_AFTER = ("", (), None, None)


def new_entry(
    seq: int,
    kernel: str,
    kernel_seq: int,
    grid: Any,
    device: int | None,
    stream: int | None,
    names: tuple[str, ...],
    ptrs: tuple[int, ...],
    devices: tuple[int, ...],
    t: float,
    thread: int,
) -> Entry:
    """An entry as the hot path makes it (it writes the list literal itself; this spells it)."""
    return [seq, kernel, kernel_seq, grid, device, stream, names, ptrs, devices, None, None, None, t, thread, *_AFTER]


class Ring:
    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: deque[Entry] = deque(maxlen=max(size, 1))
        #: the hot path's bound ``append``
        self.add = self.entries.append

    def snapshot(self) -> list[Entry]:
        """The entries, oldest first (``list(deque)`` runs in C: no thread interleaves)."""
        return list(self.entries)

    def clear(self) -> None:
        self.entries.clear()


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(ordinal: int | None) -> str | None:
    """A launch device's name from its ordinal (None: the interpreter, no device)."""
    return None if ordinal is None else f"cuda:{ordinal}"


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


def read_tensor(name: str, tensor: Any) -> RawTensor:
    """Everything the record keeps of one tensor argument, read from it now."""
    return (name, tensor.device, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)


def _unsampled(name: str, ptr: int, ordinal: int) -> TensorArg:
    """A tensor of a launch that was not sampled: its name, device and pointer (no size:
    ``nbytes`` 0, so no address is placed in it; a sampled launch of the same tensor has it)."""
    device = "cpu" if ordinal < 0 else f"cuda:{ordinal}"
    return TensorArg(name=name, device=device, data_ptr=ptr, nbytes=0, shape=(), strides=(), dtype="", numel=0)


#: (kernel name, tensor name, data_ptr, device ordinal) -> that tensor read whole at a sampled launch
Known = Mapping[tuple[str, str, int, int], TensorArg]


def known_tensors(entries: Iterable[Entry]) -> dict[tuple[str, str, int, int], TensorArg]:
    """The tensors of the sampled launches among ``entries``, by kernel, name, address and device
    (a later entry's facts win)."""
    known: dict[tuple[str, str, int, int], TensorArg] = {}
    for entry in entries:
        facts: tuple[RawTensor, ...] | None = entry[FACTS]
        if facts is None:
            continue
        for raw, ordinal in zip(facts, entry[DEVICES], strict=True):
            known[(entry[KERNEL], raw[0], int(raw[2]), ordinal)] = tensor_arg(raw)
    return known


def tensor_args(entry: Entry, known: Known | None = None) -> tuple[TensorArg, ...]:
    facts: tuple[RawTensor, ...] | None = entry[FACTS]
    if facts is not None:
        return tuple(tensor_arg(raw) for raw in facts)
    kernel = entry[KERNEL]
    out: list[TensorArg] = []
    for name, ptr, ordinal in zip(entry[NAMES], entry[PTRS], entry[DEVICES], strict=True):
        seen = known.get((kernel, name, ptr, ordinal)) if known else None
        out.append(seen if seen is not None else _unsampled(name, ptr, ordinal))
    return tuple(out)


def grid_tuple(grid: Any) -> tuple[int, ...] | None:
    if grid is None or callable(grid):
        return None
    try:
        return tuple(int(g) for g in grid)
    except (TypeError, ValueError):
        return None


def to_launch(entry: Entry, threads: Mapping[int, str] | None = None, known: Known | None = None) -> Launch:
    """The record of one entry; ``threads``: thread names by ident (the main thread absent or
    named ""); ``known``: sampled tensors (``known_tensors``) for an unsampled entry's."""
    call_site: SourceSite | None = entry[CALL_SITE]
    launch_site: SourceSite | None = entry[LAUNCH_SITE]
    thread = (threads or {}).get(entry[THREAD], "")
    return Launch(
        seq=entry[SEQ],
        kernel=entry[KERNEL],
        kernel_seq=entry[KERNEL_SEQ],
        grid=grid_tuple(entry[GRID]),
        device=device_name(entry[DEVICE]),
        stream=entry[STREAM],
        tensors=tensor_args(entry, known),
        call_site=call_site,
        launch_site=launch_site,
        user_site=entry[USER_SITE],
        wrapper=entry[WRAPPER],
        t=round(entry[T], 6),
        thread=thread,
        raised=entry[RAISED],
        flagged=bool(entry[FLAGGED]),
    )


__all__ = [
    "CALL_SITE",
    "DEVICE",
    "DEVICES",
    "FACTS",
    "FLAGGED",
    "GRID",
    "KERNEL",
    "KERNEL_SEQ",
    "LAUNCH_SITE",
    "NAMES",
    "PTRS",
    "RAISED",
    "SEQ",
    "STREAM",
    "T",
    "THREAD",
    "USER_SITE",
    "WRAPPER",
    "Entry",
    "Known",
    "RawTensor",
    "Ring",
    "device_name",
    "dtype_name",
    "grid_tuple",
    "known_tensors",
    "new_entry",
    "read_tensor",
    "tensor_arg",
    "tensor_args",
    "to_launch",
]
