"""Xid errors: their records, their names, and the grammar of the kernel log's ``NVRM: Xid`` lines.

An *Xid* is the NVIDIA driver's numbered report of a GPU error. Two places carry them, and each
knows a different part of the story:

* **NVML events** (``nvmlEventTypeXidCriticalError``). ``qmoe_doctor.machine.xid.XidWatcher``
  registers them for the probed GPUs in a background thread for the length of a run and collects
  one ``XidEvent`` per delivery: which GPU (by handle, mapped back to its NVML index through its
  UUID) and which Xid (``nvmlEventData_t.eventData`` holds the Xid number on Linux). An NVML event carries no
  address and no process. Events only exist from registration on, so nothing from before the run
  leaks in, but every process's Xids on those GPUs do.
* **The kernel log** (``dmesg``). The driver writes one line per Xid that does carry the details.
  ``parse_kernel_xid_lines`` reads them; reading the log (``qmoe_doctor.machine.xid``) is
  optional (``dmesg`` is often restricted to root, and absent inside containers) and never raises.

The kernel log line, as the driver prints it. The text ``NVRM: Xid``, then the GPU's PCI location
in parentheses and without the function number (``PCI:0000:18:00`` = domain, bus, device), a colon
and the Xid number. What follows the number depends on the Xid and the driver release: recent
drivers first name the process (``pid=4711, name=python3,``; ``'<unknown>'`` when the fault is
not attributable), then the channel (``Ch 0000003a`` in older releases, ``channel 0x0000000c`` in
newer ones) and an interrupt word. For **Xid 31**, a fault of the GPU's MMU (a page the running
context has no mapping for), the line goes on with ``MMU Fault: ENGINE <engine and client>
faulted @ 0x<high>_<low 8 hex digits>. Fault is of type <FAULT_...> <ACCESS_TYPE_...>``: the GPU
virtual address printed in two groups split by an underscore (``0x7f3a_c2000000`` is
0x7f3ac2000000), the kind of fault (``FAULT_PDE``: nothing mapped in that whole region,
``FAULT_PTE``: no page there) and the access (``ACCESS_TYPE_VIRT_READ``, ``_VIRT_WRITE``,
``_VIRT_ATOMIC``...). The address is that of the faulting *page* as far as the public logs
show (always page-aligned there), so a tensor is matched against the whole page. Lines may be
prefixed by ``dmesg``'s ``[ 1234.567890]``, ``dmesg -T``'s ``[Mon Nov 29 11:28:11 2021]`` or
syslog's ``Nov 29 11:28:11 host kernel:``; a preceding ``NVRM: GPU at PCI:0000:18:00:
GPU-<uuid>`` line names the GPU's UUID. Examples from public reports (NVIDIA's
open-gpu-kernel-modules issues #363 and #1030)::

    NVRM: Xid (PCI:0000:08:00): 31, pid=169800, name=chrome, Ch 00000023, intr 00000000. MMU Fault:
      ENGINE CE0 HUBCLIENT_HSCE0 faulted @ 0x0_0abe0000. Fault is of type FAULT_PTE ACCESS_TYPE_VIRT_READ
    NVRM: Xid (PCI:0000:01:00): 31, pid=13705, name=UnrealEditor, channel 0x0000000c, intr 00000000.
      MMU Fault: ENGINE GRAPHICS GPC2 GPCCLIENT_PROP_0 faulted @ 0x0_00000000. Fault is of type ...

(each one line in the log; wrapped here).

The watcher (machine) fills these records and the diagnosis (``qmoe_doctor.diagnose.xid``) puts
them into words, so they live here, stdlib only, where both may import them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from qmoe_doctor.core.records import SCHEMA_VERSION

#: Xid 31: the GPU's MMU found no mapping for an address a kernel touched.
XID_MMU_FAULT = 31
#: What the Xids a probe can meet mean (NVIDIA's Xid catalogue, abridged).
XID_NAMES: dict[int, str] = {
    13: "graphics engine exception: an SM-level fault such as an out-of-range address",
    31: "GPU memory page fault: an MMU fault",
    32: "invalid or corrupted push buffer stream",
    43: "GPU stopped processing: the faulting context's channel was torn down",
    45: "preemptive cleanup after previous errors",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
}


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class XidEvent:
    """One NVML Xid event delivered while a run was watched."""

    gpu_index: int | None  # NVML index; None when the event's device could not be told
    xid: int
    event_data: int  # nvmlEventData_t.eventData as delivered (the Xid number for Xid events)
    time: float  # Unix time the watcher received it

    @property
    def name(self) -> str:
        return XID_NAMES.get(self.xid, "see NVIDIA's Xid catalogue")


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelXid:
    """One ``NVRM: Xid`` line of the kernel log."""

    pci: str  # "0000:18:00" (domain:bus:device, lower case), as ``pci_key`` spells it
    xid: int
    text: str  # everything after the Xid number
    raw: str  # the whole line as read
    gpu_index: int | None = None  # NVML index, when the reader knew the GPU's PCI location
    uuid: str | None = None  # from a preceding "NVRM: GPU at PCI:...: GPU-..." line
    stamp: str | None = None  # the line's time prefix as printed ("12345.678901", "Nov 29 11:28:11")
    uptime_s: float | None = None  # dmesg's seconds since boot, when the prefix is that
    pid: int | None = None
    process: str | None = None
    address: int | None = None  # Xid 31: the faulting GPU virtual address (page)
    engine: str | None = None  # Xid 31: "GRAPHICS GPC2 GPCCLIENT_T1_0"
    fault_type: str | None = None  # Xid 31: "FAULT_PDE"
    access_type: str | None = None  # Xid 31: "ACCESS_TYPE_VIRT_READ"

    @property
    def access(self) -> str:
        """``read`` / ``write`` / ``atomic`` / ``access``."""
        if self.access_type is None:
            return "access"
        word = self.access_type.removeprefix("ACCESS_TYPE_").removeprefix("VIRT_").lower()
        return word or "access"


@dataclass(frozen=True, slots=True, kw_only=True)
class XidReport:
    """What one watched run saw. ``unavailable`` says why NVML events could not be watched at
    all; ``kernel_log`` why the kernel log was not read (None: it was, or was not asked for)."""

    schema_version: int = SCHEMA_VERSION
    gpus: tuple[int, ...] = ()  # NVML indices asked for
    watched: tuple[int, ...] = ()  # those whose Xid events were registered
    events: tuple[XidEvent, ...] = ()
    kernel_lines: tuple[KernelXid, ...] = ()  # Xid lines that appeared in the kernel log meanwhile
    unavailable: str | None = None
    kernel_log: str | None = None
    notes: tuple[str, ...] = ()  # per-GPU registration failures, a wait that failed
    started: float = 0.0  # Unix time
    ended: float = 0.0

    @property
    def status(self) -> str:
        """``watched GPU 0, GPU 1`` or ``unavailable: <reason>``."""
        if self.unavailable is not None:
            return f"unavailable: {self.unavailable}"
        return "watched " + ", ".join(f"GPU {g}" for g in self.watched)

    @property
    def xids(self) -> tuple[int, ...]:
        """Distinct Xid numbers seen by either source, in first-seen order."""
        seen = [e.xid for e in self.events] + [k.xid for k in self.kernel_lines]
        return tuple(dict.fromkeys(seen))


# ---------------------------------------------------------------------------------------------
# The kernel log
# ---------------------------------------------------------------------------------------------

_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})(?:\.[0-7])?$"
)
_XID_LINE = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F:.]+)\): (?P<xid>\d+)\b,?\s*(?P<text>.*?)\s*$")
_GPU_AT = re.compile(r"NVRM: GPU at PCI:(?P<pci>[0-9a-fA-F:.]+): (?P<uuid>GPU-[0-9a-fA-F-]+)")
_DMESG_STAMP = re.compile(r"^\s*\[\s*(?P<s>\d+\.\d+)\]")
_BRACKET_STAMP = re.compile(r"^\s*\[(?P<s>[^\]]+)\]")
_SYSLOG_STAMP = re.compile(r"^\s*(?P<s>[A-Z][a-z]{2}\s+\d+\s+\d\d:\d\d:\d\d)")
_PID = re.compile(r"\bpid=(?P<pid>\d+)")
_NAME = re.compile(r"\bname=(?P<name>[^,]+),")
_MMU = re.compile(
    r"MMU Fault: ENGINE (?P<engine>.+?) faulted @ (?P<addr>0x[0-9a-fA-F_]+)"
    r"(?:\.\s*Fault is of type (?P<ftype>\S+)(?: (?P<atype>\S+?))?\.?\s*$)?"
)


def pci_key(bus_id: str) -> str | None:
    """One spelling for a PCI location: NVML's ``00000000:18:00.0``, CUDA's ``0000:18:00.0`` and
    the kernel log's ``0000:18:00`` all give ``0000:18:00``. None when it is not one."""
    m = _PCI_RE.match(bus_id.strip())
    if m is None:
        return None
    domain = int(m.group("domain") or "0", 16)
    return f"{domain:04x}:{int(m.group('bus'), 16):02x}:{int(m.group('dev'), 16):02x}"


def parse_kernel_xid_lines(text: str, *, gpu_of_pci: Mapping[str, int] | None = None) -> list[KernelXid]:
    """Every ``NVRM: Xid`` line of a kernel log (dmesg, journalctl -k, a pasted excerpt), in
    order. ``gpu_of_pci`` maps ``pci_key`` spellings to NVML indices to fill ``gpu_index``.
    Lines that do not parse are skipped; this never raises on odd text."""
    lookup = {pci_key(k) or k: v for k, v in (gpu_of_pci or {}).items()}
    uuid_of: dict[str, str] = {}
    out: list[KernelXid] = []
    for raw in text.splitlines():
        at = _GPU_AT.search(raw)
        if at is not None:
            key = pci_key(at.group("pci"))
            if key is not None:
                uuid_of[key] = at.group("uuid")
            continue
        m = _XID_LINE.search(raw)
        if m is None:
            continue
        key = pci_key(m.group("pci"))
        if key is None:
            continue
        body = m.group("text")
        stamp: str | None = None
        uptime: float | None = None
        head = raw[: m.start()]
        if (dm := _DMESG_STAMP.match(head)) is not None:
            stamp, uptime = dm.group("s"), float(dm.group("s"))
        elif (bm := _BRACKET_STAMP.match(head)) is not None:
            stamp = bm.group("s").strip()
        elif (sm := _SYSLOG_STAMP.match(head)) is not None:
            stamp = sm.group("s")
        pid_m = _PID.search(body)
        name_m = _NAME.search(body)
        mmu = _MMU.search(body)
        address = None
        if mmu is not None:
            try:
                address = int(mmu.group("addr").replace("_", ""), 16)
            except ValueError:
                address = None
        process = name_m.group("name").strip().strip("'") if name_m else None
        out.append(
            KernelXid(
                pci=key,
                xid=int(m.group("xid")),
                text=body,
                raw=raw.rstrip("\n"),
                gpu_index=lookup.get(key),
                uuid=uuid_of.get(key),
                stamp=stamp,
                uptime_s=uptime,
                pid=int(pid_m.group("pid")) if pid_m else None,
                process=process or None,
                address=address,
                engine=mmu.group("engine") if mmu else None,
                fault_type=mmu.group("ftype") if mmu else None,
                access_type=mmu.group("atype") if mmu else None,
            )
        )
    return out


def new_kernel_lines(
    before: str, after: str, *, gpu_of_pci: Mapping[str, int] | None = None
) -> list[KernelXid]:
    """The Xid lines of ``after`` that ``before`` did not have (each line counted as often as
    it appears, so a repeated identical line still counts once more)."""
    seen: dict[str, int] = {}
    for x in parse_kernel_xid_lines(before):
        seen[x.raw] = seen.get(x.raw, 0) + 1
    fresh: list[KernelXid] = []
    for x in parse_kernel_xid_lines(after, gpu_of_pci=gpu_of_pci):
        if seen.get(x.raw, 0) > 0:
            seen[x.raw] -= 1
            continue
        fresh.append(x)
    return fresh


__all__ = [
    "XID_MMU_FAULT",
    "XID_NAMES",
    "KernelXid",
    "XidEvent",
    "XidReport",
    "new_kernel_lines",
    "parse_kernel_xid_lines",
    "pci_key",
]
