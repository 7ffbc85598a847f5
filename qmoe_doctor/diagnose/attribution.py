"""Which tensor, on which device, does an address belong to.

Addresses come from compute-sanitizer's records (``qmoe_doctor.diagnose.sanitizer_log``) and
from the kernel log's Xid 31 lines (``qmoe_doctor.diagnose.xid``); the tensors from our probes'
``Outcome.tensors`` on every device, and, when the run kept one, the caching allocator's map
(``qmoe_doctor.core.allocator``), which also knows memory no registered tensor holds
(temporaries, freed outputs) and which line of Python allocated it.

A cross-GPU dereference shows up in compute-sanitizer as a plain out-of-bounds access measured
against the wrong device's allocation: so every device's tensors are searched, and an address
that is a live tensor on another GPU is said to be one.

Distances are counted as AddressSanitizer counts them, which users know: the first byte after a
tensor is "0 bytes after the N-byte region", the byte just before it "1 byte before", an address
in it "K bytes inside". compute-sanitizer counts the first byte after as "1 bytes after the
nearest allocation" (``sanitizer_log.NearestAllocation.distance`` keeps its count).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from qmoe_doctor.core.allocator import AllocatorSnapshot, SnapshotPlace, locate_in_snapshot
from qmoe_doctor.core.launches import INT32_LIMIT, element_span
from qmoe_doctor.core.records import Condition, TensorInfo
from qmoe_doctor.core.reports import PlacedFit
from qmoe_doctor.diagnose.sanitizer_log import NearestAllocation, SanitizerReport

# ---------------------------------------------------------------------------------------------
# The allocator's map, in words
# ---------------------------------------------------------------------------------------------

_STATE_WORDS = {
    "active_allocated": "a live block",
    "active_pending_free": "a block freed while a stream may still use it",
    "inactive": "a freed block",
}


def snapshot_sentence(place: SnapshotPlace) -> str:
    """``inside a freed block (131,072 bytes at 0x7f..., byte 1,024 of it) of segment 0x7f...
    (2,097,152 bytes, small pool, stream 0x0) on cuda:0, allocated at grouped_gemm.py:210 in
    moe_grouped_gemm and freed since``"""
    seg = place.segment
    pool = f", {seg.pool} pool" if seg.pool else ""
    expandable = ", expandable" if seg.expandable else ""
    where = (
        f"segment 0x{seg.address:x} ({seg.size:,} bytes{pool}{expandable}, stream 0x{seg.stream:x}) "
        f"on cuda:{place.device}"
    )
    if place.block is None:
        text = f"inside {where} (its blocks were not all kept)"
    else:
        b = place.block
        text = (
            f"inside {_STATE_WORDS.get(b.state, b.state)} ({b.size:,} bytes at 0x{b.address:x}, "
            f"byte {place.address - b.address:,} of it) of {where}"
        )
    alloc = place.allocation
    own = place.block.frame if place.block is not None else None
    frame = own or (alloc.frame if alloc is not None else None)
    if frame is not None:
        text += f", allocated at {frame.render()}"
        live = place.block is not None and place.block.state == "active_allocated"
        if alloc is not None and alloc.freed and not live:
            text += " and freed since"
            if alloc.free_frame is not None:
                text += f" (at {alloc.free_frame.render()})"
    elif seg.frame is not None:
        text += f"; no recorded allocation covers it, the segment was reserved at {seg.frame.render()}"
    else:
        text += "; allocated before the history was recorded (no stack kept)"
    return text


# ---------------------------------------------------------------------------------------------
# Attribution: which tensor, on which device, does an address belong to
# ---------------------------------------------------------------------------------------------

_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "float": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "double": 8,
    "long": 8,
    "int": 4,
    "complex64": 8,
    "complex128": 16,
}
_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def itemsize(dtype: str) -> int:
    name = dtype.removeprefix("torch.")
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def describe_tensor(t: TensorInfo) -> str:
    """``x (4096 x 2048 bf16)``"""
    dims = " x ".join(str(d) for d in t.shape) or "scalar"
    dt = t.dtype.removeprefix("torch.")
    return f"{t.name} ({dims} {_DTYPE_SHORT.get(dt, dt)})"


def _is_weight_stack(t: TensorInfo) -> bool:
    return len(t.shape) == 3


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMatch:
    """The tensor on one device that holds an address, or the nearest one to it."""

    device: str
    tensor: str
    description: str  # "x (4096 x 2048 bf16)"
    relation: Literal["inside", "after", "before"]
    # bytes from the tensor's region as AddressSanitizer counts them: after, address - end (0 = the
    # first byte after); before, start - address (1 = the byte just before); inside, address - start
    gap: int
    region: int  # the tensor's bytes: the N of "N-byte region"
    offset: int  # address - data_ptr (negative before the start)
    row: int | None = None  # offset // (row stride in bytes); for a weight stack, the row in its expert
    expert: int | None = None  # weight stack (E, N, K): offset // (stride_we * itemsize)
    fits: tuple[PlacedFit, ...] = ()  # the causes where it landed fits (the sentence's "... fits")

    @property
    def reach(self) -> int:
        """Bytes from the region to the far end of the first byte accessed (0 inside): what
        "nearest" orders by, and compute-sanitizer's own count."""
        return self.gap + 1 if self.relation == "after" else 0 if self.relation == "inside" else self.gap


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribution:
    address: int
    access: str  # "read of 16 bytes", "write of 256 bytes", or "access"
    kernel: str | None
    matches: tuple[TensorMatch, ...]  # the nearest tensor on every device, nearest first
    inside_devices: tuple[str, ...]  # devices where the address lies inside a live tensor
    sanitizer_device: str | None  # device whose tensors lie in the allocation compute-sanitizer
    # measured against, when that can be told
    cross_device: bool  # the address is a live tensor on a device other than the one measured
    sentences: tuple[str, ...]
    allocator: SnapshotPlace | None = None  # where the caching allocator's map puts it, if known


#: Rows past M: what an m_sizes summing past M makes the last experts' tiles touch.
_ROWS_PAST_M = PlacedFit(cause="invalid-routing", words="m_sizes summing past M", cell=Condition.OVER_ROUTED.value)
#: An expert id >= E walks past the end of a weight stack; a -1 (a sentinel) before its start.
_EXPERT_OUT_OF_RANGE = PlacedFit(cause="invalid-routing", words="out-of-range routing")
_NEGATIVE_EXPERT = PlacedFit(cause="invalid-routing", words="a -1 sentinel expert id")
#: An index x stride product formed in int32 that wrapped: it passes the end, or (negative)
#: lands before the start.
_WRAPPED = PlacedFit(
    cause="int32-offset-overflow", words="an int32 product that wrapped", cell=Condition.INT32_BOUNDARY.value
)


#: The routing buffers of a kernel that routes inside (the routed protocol): integer tensors a
#: kernel indexes by expert id, by position or by slot. Where an address lands past one says which
#: of its indices ran past it.
_IDS_PAST_E = PlacedFit(
    cause="invalid-routing", words="expert ids past E", cell=Condition.IDS_OUT_OF_RANGE.value
)
_PADDED_PAST_END = PlacedFit(
    cause="invalid-routing", words="a padded count past the end of its buffer", cell=Condition.PADDED_COUNT.value
)
_SLOTS_PAST_END = PlacedFit(cause="invalid-routing", words="slot ids past T*k", cell=Condition.GATHER_PAST_T.value)
_NEGATIVE_INDEX = PlacedFit(cause="invalid-routing", words="a -1 read as an index", cell=Condition.DROPPED_SLOTS.value)
#: Rows past the end of a row operand in a launch that routes by ids: a slot id past T*k (the
#: padding read as a slot) or a gather index past T.
_ROWS_PAST_ROUTED = PlacedFit(
    cause="invalid-routing",
    words="slot or token ids past the rows (a padded count or a gather index past the end)",
    cell=Condition.PADDED_COUNT.value,
)
_INT_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "int", "long"})


def is_routing_buffer(t: TensorInfo) -> bool:
    """An integer tensor of one or two dimensions: counts per expert (``m_sizes``, a histogram),
    ids per slot (``topk_ids``), per position (``sorted_token_ids``, ``expert_ids``, gather and
    scatter indices) or a map (``expert_map``)."""
    return t.dtype.removeprefix("torch.") in _INT_DTYPES and len(t.shape) in (1, 2)


def _by_expert(t: TensorInfo, experts: frozenset[int]) -> bool:
    """A 1-D table with one entry per expert (or per expert and one more: offsets) of a weight
    stack on the same device: indexed by expert id."""
    return len(t.shape) == 1 and bool(t.shape) and (t.shape[0] in experts or t.shape[0] - 1 in experts)


@dataclass(frozen=True, slots=True)
class _Device:
    """What the tensors on one device say about a launch's layout."""

    experts: frozenset[int] = frozenset()  # expert counts of the weight stacks there
    routed: bool = False  # a routing buffer indexed by position or slot: the kernel routes by ids

    @classmethod
    def of(cls, tensors: Sequence[TensorInfo]) -> _Device:
        experts = frozenset(t.shape[0] for t in tensors if _is_weight_stack(t) and t.shape)
        routed = any(is_routing_buffer(t) and not _by_expert(t, experts) for t in tensors)
        return cls(experts=experts, routed=routed)


def _routing_fits(t: TensorInfo, relation: str, layout: _Device) -> tuple[PlacedFit, ...]:
    if relation == "before":
        return (_NEGATIVE_INDEX,)
    if len(t.shape) == 2:
        return (_SLOTS_PAST_END,)  # (T, k) ids or weights indexed by slot
    if _by_expert(t, layout.experts):
        return (_IDS_PAST_E,)
    return (_PADDED_PAST_END,)  # indexed by position: sorted ids, expert ids per block, gather indices


def _fits(
    t: TensorInfo, relation: str, expert: int | None, row: int | None, layout: _Device = _Device()
) -> tuple[PlacedFit, ...]:
    """The causes an address fits, from where it landed: structured, as the sentence says it."""
    if relation == "inside":
        return ()
    if is_routing_buffer(t):
        return _routing_fits(t, relation, layout)
    if expert is not None:
        if relation == "after":
            return (_EXPERT_OUT_OF_RANGE, _WRAPPED)
        # a negative product: an int32 wrap only reaches that far in a stack that spans 2**31
        # elements; in a smaller one a negative expert id (a -1 sentinel) fits as well
        if element_span(t.shape, t.strides) >= INT32_LIMIT:
            return (_WRAPPED,)
        return (_WRAPPED, _NEGATIVE_EXPERT)
    if row is not None and len(t.shape) >= 2 and relation == "after":
        return (_ROWS_PAST_ROUTED,) if layout.routed else (_ROWS_PAST_M,)
    return ()


def _match(address: int, t: TensorInfo, device: str, layout: _Device = _Device()) -> TensorMatch:
    start, end = t.data_ptr, t.data_ptr + t.nbytes
    offset = address - start
    relation: Literal["inside", "after", "before"]
    if start <= address < end:
        relation, gap = "inside", offset
    elif address >= end:
        relation, gap = "after", address - end
    else:
        relation, gap = "before", start - address
    size = itemsize(t.dtype)
    row: int | None = None
    expert: int | None = None
    if _is_weight_stack(t) and t.strides and t.strides[0] > 0:
        expert_bytes = t.strides[0] * size
        expert = offset // expert_bytes
        if len(t.strides) > 1 and t.strides[1] > 0:
            row = (offset - expert * expert_bytes) // (t.strides[1] * size)
    elif len(t.shape) >= 2 and t.strides and t.strides[0] > 0:
        row = offset // (t.strides[0] * size)
    elif len(t.shape) == 1:
        row = offset // size  # element index
    return TensorMatch(
        device=device,
        tensor=t.name,
        description=describe_tensor(t),
        relation=relation,
        gap=gap,
        region=t.nbytes,
        offset=offset,
        row=row,
        expert=expert,
        fits=_fits(t, relation, expert, row, layout),
    )


def _nearest_on_device(address: int, tensors: Sequence[TensorInfo], device: str) -> TensorMatch | None:
    best: TensorMatch | None = None
    layout = _Device.of(tensors)
    for t in tensors:
        if t.nbytes <= 0:
            continue
        m = _match(address, t, device, layout)
        if best is None or (m.relation == "inside", -m.reach) > (best.relation == "inside", -best.reach):
            best = m
    return best


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _fits_words(fits: tuple[PlacedFit, ...]) -> str:
    """``m_sizes summing past M fits`` / ``a or b fits``."""
    return " or ".join(f.words for f in fits) + " fits"


def _match_sentence(m: TensorMatch, verb: str, tables: Mapping[str, Sequence[TensorInfo]]) -> str:
    """AddressSanitizer's wording: ``write 0 bytes after the 12,582,912-byte region of y (4096 x
    1536 bf16) on cuda:0: row 4096, ...``; ``... bytes before the ...``; ``... bytes inside ...``."""
    t = next(t for t in tables[m.device] if t.name == m.tensor)
    region = f"the {m.region:,}-byte region of {m.description} on {m.device}"
    if m.relation == "inside":
        where = f"{verb} {_plural(m.gap, 'byte')} inside {region}"
        if m.expert is not None:
            where += f": expert {m.expert}" + (f", row {m.row}" if m.row is not None else "")
        elif m.row is not None:
            where += f": {'element' if len(t.shape) == 1 else 'row'} {m.row}"
        return where
    text = f"{verb} {_plural(m.gap, 'byte')} {m.relation} {region}"
    if m.expert is not None:
        n_exp = t.shape[0]
        text += f": expert {m.expert} of {n_exp}"
        if m.relation == "after":
            text += f", i.e. an expert id >= {n_exp} ({_fits_words(m.fits)})"
        else:
            text += f", i.e. a negative expert offset ({_fits_words(m.fits)})"
    elif is_routing_buffer(t) and m.fits:
        count = t.shape[0] if t.shape else 0
        if len(t.shape) == 2:
            where = f"row {m.row} of {count}, i.e. slot ids past {count * t.shape[1]}"
        elif m.relation == "before":
            where = f"element {m.row}, i.e. a negative index"
        else:
            where = f"element {m.row} of {count}, i.e. an index past its {count:,} entries"
        text += f": {where} ({_fits_words(m.fits)})"
    elif m.row is not None and len(t.shape) >= 2:
        text += f": row {m.row}"
        if m.fits == (_ROWS_PAST_ROUTED,):
            text += f", i.e. rows past its {t.shape[0]:,} ({_fits_words(m.fits)})"
        elif m.fits:
            text += f", i.e. rows past M={t.shape[0]} ({_fits_words(m.fits)})"
    elif m.row is not None:
        text += f": element {m.row} of {t.shape[0] if t.shape else 0}"
    return text


def attribute_address(
    address: int,
    tensor_tables: Mapping[str, Sequence[TensorInfo]],
    *,
    access: str = "access",
    kernel: str | None = None,
    nearest: NearestAllocation | None = None,
    reported_out_of_bounds: bool = True,
    snapshot: AllocatorSnapshot | None = None,
) -> Attribution:
    """Place one address against the tensors known on every device, and, given the child's
    allocator snapshot, against the caching allocator's segments and blocks (which also know
    memory no registered tensor holds: temporaries, freed outputs, and who allocated them)."""
    matches: list[TensorMatch] = []
    for device, tensors in tensor_tables.items():
        m = _nearest_on_device(address, tensors, device)
        if m is not None:
            matches.append(m)
    matches.sort(key=lambda m: (m.relation != "inside", m.reach))
    inside = tuple(m.device for m in matches if m.relation == "inside")
    # the allocation compute-sanitizer measured against: which device's tensors lie in it?
    sanitizer_device: str | None = None
    if nearest is not None:
        for device, tensors in tensor_tables.items():
            if any(nearest.base <= t.data_ptr < nearest.end for t in tensors):
                sanitizer_device = device
                break
    verb = access.split(" ")[0] if access != "access" else "accessed"
    sentences: list[str] = []
    cross = False
    if not matches:
        sentences.append(f"0x{address:x}: no tensor is known on any device to place it against.")
    else:
        for m in matches:
            sentences.append(_match_sentence(m, verb, tensor_tables) + ".")
        if inside and reported_out_of_bounds:
            others = [d for d in tensor_tables if d not in inside]
            measured = sanitizer_device if sanitizer_device and sanitizer_device not in inside else None
            if sanitizer_device in inside:
                sentences.append(
                    f"compute-sanitizer measured it against an allocation on {sanitizer_device}, the device "
                    "that holds the tensor: a freed or unmapped block (expandable segments) fits better than "
                    "a cross-GPU read."
                )
            elif measured or others:
                cross = True
                dev_list = ", ".join(inside)
                ran_on = measured or (others[0] if len(others) == 1 else "another GPU")
                sentences.append(
                    f"This address is inside a live tensor on another GPU ({dev_list}), yet compute-sanitizer "
                    f"called it out of bounds: the kernel most likely ran on {ran_on} and dereferenced "
                    f"{dev_list} memory (compute-sanitizer reports a cross-GPU dereference as plain "
                    "out-of-bounds, measured against the wrong device's allocation)."
                )
    place = locate_in_snapshot(address, snapshot) if snapshot is not None and snapshot.taken else None
    if place is not None:
        sentences.append(f"Allocator: 0x{address:x} is {snapshot_sentence(place)}.")
    elif snapshot is not None and snapshot.taken:
        sentences.append(
            f"Allocator: 0x{address:x} lies in no segment the caching allocator holds on any device "
            "(memory from outside the allocator, or not mapped at all)."
        )
    return Attribution(
        address=address,
        access=access,
        kernel=kernel,
        matches=tuple(matches),
        inside_devices=inside,
        sanitizer_device=sanitizer_device,
        cross_device=cross,
        sentences=tuple(sentences),
        allocator=place,
    )


def attribute(
    report: SanitizerReport,
    tensor_tables: Mapping[str, Sequence[TensorInfo]],
    *,
    snapshot: AllocatorSnapshot | None = None,
) -> tuple[Attribution, ...]:
    """Attribute every distinct faulting address of the report (one per group and address).

    ``tensor_tables`` maps a device string ("cuda:0") to the tensors known on it (our probes'
    ``Outcome.tensors``); include every device, since a cross-GPU dereference shows up as an
    out-of-bounds address that is a live tensor on the other GPU. ``snapshot`` is the same run's
    ``allocator_snapshot`` fact (``read_allocator_snapshot``), when it has one.
    """
    out: list[Attribution] = []
    for g in report.groups:
        e = g.first
        access = f"{e.access} of {_plural(e.size, 'byte')}" if e.access and e.size is not None else "access"
        for addr in g.addresses:
            member = next((m for m in report.errors if m.address == addr and m.kernel == g.kernel), e)
            out.append(
                attribute_address(
                    addr,
                    tensor_tables,
                    access=access,
                    kernel=g.kernel,
                    nearest=member.nearest,
                    reported_out_of_bounds=member.out_of_bounds or member.category == "invalid-access",
                    snapshot=snapshot,
                )
            )
    return tuple(out)


__all__ = [
    "Attribution",
    "TensorMatch",
    "attribute",
    "attribute_address",
    "describe_tensor",
    "is_routing_buffer",
    "itemsize",
    "snapshot_sentence",
]
