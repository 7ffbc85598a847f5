"""What a watched run's Xid errors say, in words, with an Xid 31 fault address placed.

The records come from ``qmoe_doctor.machine.xid.XidWatcher`` (``qmoe_doctor.core.xid``); the
address is placed against the tensors of every device, as compute-sanitizer's addresses are
(``qmoe_doctor.diagnose.attribution``), and against the caching allocator's map when the run
kept one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from qmoe_doctor.core.allocator import AllocatorSnapshot
from qmoe_doctor.core.records import TensorInfo
from qmoe_doctor.core.xid import XID_MMU_FAULT, XID_NAMES, KernelXid, XidReport
from qmoe_doctor.diagnose.attribution import attribute_address, describe_tensor

#: Bytes of one GPU page as far as a fault address tells: tensors overlapping it are matched.
FAULT_PAGE_BYTES = 4096
#: A kernel-log line's "pid=..., name=...," head: the sentence names the process already.
_WHO = re.compile(r"^\s*pid=[^,]*,\s*(?:name=[^,]*,?)?\s*")


def _device_word(device: str, gpu_of_device: Mapping[str, int]) -> str:
    gpu = gpu_of_device.get(device)
    return f"{device} (GPU {gpu})" if gpu is not None else device


def place_fault_address(
    line: KernelXid,
    tensor_tables: Mapping[str, Sequence[TensorInfo]],
    *,
    device_of_gpu: Mapping[int, str],
    snapshot: AllocatorSnapshot | None = None,
) -> list[str]:
    """Sentences placing an Xid 31 address against the tensors of every device (and the
    allocator's segments, given a snapshot), as the sanitizer's addresses are placed."""
    if line.address is None:
        return []
    address = line.address
    gpu_of_device = {d: g for g, d in device_of_gpu.items()}
    faulted_on = device_of_gpu.get(line.gpu_index) if line.gpu_index is not None else None
    a = attribute_address(
        address,
        tensor_tables,
        access=f"{line.access} (MMU fault)",
        reported_out_of_bounds=False,
        snapshot=snapshot,
    )
    out: list[str] = []
    page_end = address + FAULT_PAGE_BYTES
    # the fault names a page: any tensor overlapping it is a candidate, nearest first
    overlapping = [
        (device, t)
        for device, tensors in tensor_tables.items()
        for t in tensors
        if t.nbytes > 0 and t.data_ptr < page_end and address < t.data_ptr + t.nbytes
    ]
    if overlapping:
        for device, t in overlapping:
            at = (
                f"byte offset {address - t.data_ptr:,} of it"
                if address >= t.data_ptr
                else f"which starts {t.data_ptr - address:,} bytes into the page"
            )
            out.append(
                f"the faulting page 0x{address:x} holds part of {describe_tensor(t)} on "
                f"{_device_word(device, gpu_of_device)} ({at})"
            )
        hosts = {device for device, _ in overlapping}
        if faulted_on is not None and faulted_on not in hosts:
            host = ", ".join(_device_word(d, gpu_of_device) for d in sorted(hosts))
            out.append(
                f"the MMU of {_device_word(faulted_on, gpu_of_device)} faulted on memory of {host}: the "
                "kernel ran on the GPU that faulted and dereferenced another GPU's tensor without a peer "
                "mapping (a cross-GPU dereference; compute-sanitizer calls the same access plain "
                "out-of-bounds)"
            )
        elif faulted_on is not None:
            out.append(
                f"the page belongs to a tensor of {_device_word(faulted_on, gpu_of_device)} itself, the GPU "
                "that faulted: memory unmapped under a live address (a freed segment, expandable "
                "segments' unmap) fits better than a cross-GPU read"
            )
    else:
        out.extend(s.rstrip(".") for s in a.sentences if not s.startswith("Allocator:"))
    out.extend(s.rstrip(".") for s in a.sentences if s.startswith("Allocator:"))
    return out


def xid_evidence(
    report: XidReport,
    tensor_tables: Mapping[str, Sequence[TensorInfo]] | None = None,
    *,
    device_of_gpu: Mapping[int, str] | None = None,
    snapshot: AllocatorSnapshot | None = None,
) -> tuple[str, ...]:
    """The watched run's Xid evidence as sentences: NVML events folded per GPU and Xid, each
    kernel-log line with its fault address placed, and what could not be watched."""
    tables = tensor_tables or {}
    devices = dict(device_of_gpu or {})
    out: list[str] = []
    counts: dict[tuple[int | None, int], int] = {}
    for e in report.events:
        counts[(e.gpu_index, e.xid)] = counts.get((e.gpu_index, e.xid), 0) + 1
    for (gpu, xid), n in counts.items():
        where = f"GPU {gpu}" if gpu is not None else "a watched GPU"
        if gpu is not None and gpu in devices:
            where += f" ({devices[gpu]})"
        times = "" if n == 1 else f", {n} times"
        text = f"NVML: Xid {xid} ({XID_NAMES.get(xid, 'see the Xid catalogue')}) on {where} during the run{times}"
        if xid == XID_MMU_FAULT and not any(k.xid == XID_MMU_FAULT for k in report.kernel_lines):
            text += "; NVML gives no address: the kernel log's Xid 31 line has it" + (
                f" ({report.kernel_log})" if report.kernel_log else ""
            )
        out.append(text + ".")
    for k in report.kernel_lines:
        where = f"GPU {k.gpu_index}" if k.gpu_index is not None else f"PCI {k.pci}"
        who = f", pid {k.pid}" + (f" ({k.process})" if k.process else "") if k.pid is not None else ""
        head = f"kernel log: Xid {k.xid} ({XID_NAMES.get(k.xid, 'see the Xid catalogue')}) on {where}{who}"
        if k.address is not None:
            kind = " ".join(p for p in (k.fault_type, k.access_type) if p)
            head += f": {k.access} fault at 0x{k.address:x}" + (f" ({kind})" if kind else "")
            placed = place_fault_address(k, tables, device_of_gpu=devices, snapshot=snapshot)
            out.append(head + (": " + "; ".join(placed) if placed else "") + ".")
        else:
            detail = _WHO.sub("", k.text).strip(" ,.")
            out.append(f"{head}" + (f": {detail[:200]}" if detail else "") + ".")
    if report.unavailable is not None:
        out.append(f"NVML Xid events: unavailable: {report.unavailable}.")
    elif not report.events:
        out.append(
            f"NVML Xid events: none on {', '.join(f'GPU {g}' for g in report.watched)} during the run."
        )
    if report.kernel_log is not None:
        out.append(f"kernel log: not read ({report.kernel_log}).")
    return tuple(out)


__all__ = ["FAULT_PAGE_BYTES", "place_fault_address", "xid_evidence"]
