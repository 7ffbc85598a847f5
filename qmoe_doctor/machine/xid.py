"""Xid errors seen while a probe runs: NVML's Xid events, and the kernel log's ``NVRM: Xid`` lines.

An *Xid* is the NVIDIA driver's numbered report of a GPU error. Two places carry them, and each
knows a different part of the story:

* **NVML events** (``nvmlEventTypeXidCriticalError``). ``XidWatcher`` registers them for the
  probed GPUs in a background thread for the length of a run and collects one ``XidEvent`` per
  delivery: which GPU (by handle, mapped back to its NVML index through its UUID) and which Xid
  (``nvmlEventData_t.eventData`` holds the Xid number on Linux). An NVML event carries no
  address and no process. Events only exist from registration on, so nothing from before the run
  leaks in, but every process's Xids on those GPUs do.
* **The kernel log** (``dmesg``). The driver writes one line per Xid that does carry the details.
  ``parse_kernel_xid_lines`` reads them; reading the log is optional (``dmesg`` is often
  restricted to root, and absent inside containers) and never raises.

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

(each one line in the log; wrapped here). No torch here: this runs in the parent.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from qmoe_doctor.core.records import SCHEMA_VERSION, TensorInfo
from qmoe_doctor.diagnose.sanitizer_log import AllocatorSnapshot, attribute_address, describe_tensor

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
#: Bytes of one GPU page as far as a fault address tells: tensors overlapping it are matched.
FAULT_PAGE_BYTES = 4096
#: nvmlEventSetWait's timeout per call (ms): how long ``stop`` may wait for the thread.
POLL_MS = 200
#: After the run, keep listening this long: the driver reports an Xid as the context dies,
#: which can trail the process's exit.
SETTLE_S = 0.5
#: How long ``__enter__`` waits for the thread to have registered (NVML init takes ~0.1 s).
START_TIMEOUT_S = 5.0
DMESG_TIMEOUT_S = 5.0

# nvmlReturn_t codes (pynvml.NVML_ERROR_*), spelled out: a fake or an old binding may lack names.
_NVML_NOT_SUPPORTED = 3
_NVML_NO_PERMISSION = 4
_NVML_TIMEOUT = 10
_NVML_FUNCTION_NOT_FOUND = 13
_EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError


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
_WHO = re.compile(r"^\s*pid=[^,]*,\s*(?:name=[^,]*,?)?\s*")
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


#: Reads the kernel log: (its text, or None and why not). Must never raise.
KernelLogReader = Callable[[], tuple[str | None, str]]


def read_dmesg() -> tuple[str | None, str]:
    """``dmesg``'s output, or None and the reason (not installed, not permitted: the kernel's
    ``dmesg_restrict``, a container without the syslog capability)."""
    try:
        proc = subprocess.run(
            ["dmesg"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=DMESG_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return None, "dmesg is not installed"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"dmesg could not run: {exc}"
    if proc.returncode != 0:
        err = (proc.stderr or "").strip().splitlines()
        return None, f"dmesg exited with status {proc.returncode}" + (f": {err[-1][:200]}" if err else "")
    return proc.stdout, ""


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


# ---------------------------------------------------------------------------------------------
# NVML events
# ---------------------------------------------------------------------------------------------


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _why(exc: BaseException) -> str:
    code = _code(exc)
    text = str(exc) or type(exc).__name__
    if code == _NVML_NOT_SUPPORTED:
        return f"not supported ({text}; usual in VMs and for vGPUs)"
    if code == _NVML_NO_PERMISSION:
        return f"not permitted ({text})"
    if code == _NVML_FUNCTION_NOT_FOUND:
        return f"this driver's NVML lacks the call ({text})"
    return text


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class XidWatcher:
    """Watch ``gpu_indices`` (NVML indices) for Xid errors while the ``with`` block runs.

    ``with XidWatcher([0, 1]) as w: run(); report = w.report()``. A background thread owns NVML
    (init, an event set, registration, ``nvmlEventSetWait_v2`` every ``poll_ms``, free,
    shutdown); ``__enter__`` returns once the registration is done, so a fault in the block is
    not missed. Never raises: NVML missing, events not supported, no permission, a failed wait
    all end up as ``XidReport.unavailable`` or ``notes``. ``nvml`` (a pynvml-like module) and
    ``kernel_log`` (None: do not read it) exist for tests; ``settle_s`` keeps listening after
    the block, since the driver reports an Xid while the faulting context is torn down.
    """

    def __init__(
        self,
        gpu_indices: Iterable[int],
        *,
        nvml: Any | None = None,
        kernel_log: KernelLogReader | None = read_dmesg,
        poll_ms: int = POLL_MS,
        settle_s: float = SETTLE_S,
        start_timeout_s: float = START_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.gpus = tuple(dict.fromkeys(int(g) for g in gpu_indices))
        self._nvml = nvml
        self._kernel_log = kernel_log
        self._poll_ms = max(1, int(poll_ms))
        self._settle_s = max(0.0, settle_s)
        self._start_timeout_s = start_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: list[XidEvent] = []
        self._notes: list[str] = []
        self._watched: list[int] = []
        self._pci_of: dict[int, str] = {}
        self._unavailable: str | None = None
        self._log_before: str | None = None
        self._log_reason: str | None = None
        self._kernel_lines: tuple[KernelXid, ...] = ()
        self._started = 0.0
        self._ended = 0.0

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> XidWatcher:
        self._started = self._clock()
        if self._kernel_log is not None:
            self._log_before, reason = self._read_log()
            if self._log_before is None:
                self._log_reason = reason
        if not self.gpus:
            self._unavailable = "no GPU to watch"
            self._ready.set()
            return self
        self._thread = threading.Thread(target=self._run, name="qmoe-xid-watcher", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout_s):
            with self._lock:
                self._notes.append(
                    f"NVML did not finish registering Xid events within {self._start_timeout_s:g} s; "
                    "events before that are missed"
                )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop listening (after ``settle_s`` when events are being watched) and read the kernel
        log's new lines. Safe to call twice."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            with self._lock:
                watching = bool(self._watched)
            if watching and self._settle_s:
                self._stop.wait(self._settle_s)
            self._stop.set()
            thread.join(self._poll_ms / 1000 + 2.0)
            if thread.is_alive():
                with self._lock:
                    self._notes.append("the NVML event thread did not stop; events after this were dropped")
        self._stop.set()
        if self._kernel_log is not None and self._log_before is not None and not self._kernel_lines:
            after, reason = self._read_log()
            if after is None:
                self._log_reason = reason
            else:
                with self._lock:
                    gpu_of_pci = {pci: g for g, pci in self._pci_of.items()}
                lines = new_kernel_lines(self._log_before, after, gpu_of_pci=gpu_of_pci)
                if gpu_of_pci:  # NVML named our GPUs' PCI locations: keep only theirs
                    lines = [x for x in lines if x.gpu_index is not None]
                self._kernel_lines = tuple(lines)
        if not self._ended:
            self._ended = self._clock()

    def report(self) -> XidReport:
        with self._lock:
            return XidReport(
                gpus=self.gpus,
                watched=tuple(self._watched),
                events=tuple(self._events),
                kernel_lines=self._kernel_lines,
                unavailable=self._unavailable,
                kernel_log=self._log_reason,
                notes=tuple(self._notes),
                started=self._started,
                ended=self._ended or self._clock(),
            )

    # -- the thread -----------------------------------------------------------------------
    def _read_log(self) -> tuple[str | None, str]:
        assert self._kernel_log is not None
        try:
            return self._kernel_log()
        except Exception as exc:  # a reader must not raise; if it does, it is only a note
            return None, f"reading the kernel log failed: {exc}"

    def _note(self, text: str) -> None:
        with self._lock:
            self._notes.append(text)

    def _give_up(self, reason: str) -> None:
        with self._lock:
            self._unavailable = reason

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # never let the thread die with a traceback on stderr
            with self._lock:
                if not self._watched and self._unavailable is None:
                    self._unavailable = f"NVML event watching failed: {exc}"
                else:
                    self._notes.append(f"NVML event watching stopped: {exc}")
        finally:
            self._ready.set()

    def _watch(self) -> None:
        try:
            nvml = self._nvml if self._nvml is not None else importlib.import_module("pynvml")
        except ImportError as exc:
            self._give_up(f"pynvml (the nvidia-ml-py package) cannot be imported: {exc}")
            return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError (no driver, no library), OSError from ctypes
            self._give_up(f"NVML could not start: {_why(exc)}")
            return
        event_set: Any = None
        try:
            nvml_error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
            xid_bit = int(getattr(nvml, "nvmlEventTypeXidCriticalError", _EVENT_XID))
            try:
                event_set = nvml.nvmlEventSetCreate()
            except (nvml_error, AttributeError) as exc:
                self._give_up(f"NVML cannot create an event set: {_why(exc)}")
                return
            index_of_uuid = self._register(nvml, nvml_error, event_set, xid_bit)
            self._ready.set()
            if index_of_uuid is None:
                return
            self._listen(nvml, nvml_error, event_set, xid_bit, index_of_uuid)
        finally:
            self._ready.set()
            if event_set is not None:
                try:
                    nvml.nvmlEventSetFree(event_set)
                except Exception:  # freeing is best effort
                    pass
            try:
                nvml.nvmlShutdown()
            except Exception:  # shutting down a half-failed library is best effort
                pass

    def _register(
        self, nvml: Any, nvml_error: type[BaseException], event_set: Any, xid_bit: int
    ) -> dict[str, int] | None:
        """Register every GPU's Xid events; the UUID -> index map of those registered, or None
        (with ``unavailable`` set) when none could be."""
        index_of_uuid: dict[str, int] = {}
        failures: list[str] = []
        for gpu in self.gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
            except nvml_error as exc:
                failures.append(f"GPU {gpu}: NVML cannot open it ({_why(exc)})")
                continue
            try:  # the PCI location maps kernel-log lines to this GPU, events or not
                key = pci_key(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
                if key is not None:
                    with self._lock:
                        self._pci_of[gpu] = key
            except (nvml_error, AttributeError):
                pass
            try:
                supported = getattr(nvml, "nvmlDeviceGetSupportedEventTypes", None)
                if supported is not None and not int(supported(handle)) & xid_bit:
                    failures.append(f"GPU {gpu}: Xid events not supported (not in its event mask)")
                    continue
                nvml.nvmlDeviceRegisterEvents(handle, xid_bit, event_set)
            except nvml_error as exc:
                failures.append(f"GPU {gpu}: Xid events {_why(exc)}")
                continue
            try:
                index_of_uuid[_text(nvml.nvmlDeviceGetUUID(handle))] = gpu
            except nvml_error:
                index_of_uuid[f"#{gpu}"] = gpu  # still watched; its events map by elimination
            with self._lock:
                self._watched.append(gpu)
        with self._lock:
            self._notes.extend(failures)
        if not index_of_uuid:
            self._give_up("; ".join(failures) or "no GPU could be registered")
            return None
        return index_of_uuid

    def _listen(
        self,
        nvml: Any,
        nvml_error: type[BaseException],
        event_set: Any,
        xid_bit: int,
        index_of_uuid: dict[str, int],
    ) -> None:
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        while True:
            stopping = self._stop.is_set()
            try:  # after stop, drain what is already due without waiting
                data = wait(event_set, 0 if stopping else self._poll_ms)
            except nvml_error as exc:
                if _code(exc) == _NVML_TIMEOUT:
                    if stopping:
                        return
                    continue
                self._note(f"NVML event wait failed, stopped listening: {_why(exc)}")
                return
            event_type = int(getattr(data, "eventType", 0))
            if not event_type & xid_bit:
                continue
            value = int(getattr(data, "eventData", 0))
            gpu = self._gpu_of(nvml, nvml_error, getattr(data, "device", None), index_of_uuid)
            with self._lock:
                self._events.append(XidEvent(gpu_index=gpu, xid=value, event_data=value, time=self._clock()))

    def _gpu_of(
        self, nvml: Any, nvml_error: type[BaseException], handle: Any, index_of_uuid: Mapping[str, int]
    ) -> int | None:
        if handle is not None:
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                if uuid in index_of_uuid:
                    return index_of_uuid[uuid]
            except (nvml_error, AttributeError, TypeError):
                pass
        return next(iter(index_of_uuid.values())) if len(index_of_uuid) == 1 else None


# ---------------------------------------------------------------------------------------------
# Evidence: what the run's Xids say, in words, with the Xid 31 address placed
# ---------------------------------------------------------------------------------------------


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


__all__ = [
    "FAULT_PAGE_BYTES",
    "XID_MMU_FAULT",
    "XID_NAMES",
    "KernelLogReader",
    "KernelXid",
    "XidEvent",
    "XidReport",
    "XidWatcher",
    "new_kernel_lines",
    "parse_kernel_xid_lines",
    "pci_key",
    "place_fault_address",
    "read_dmesg",
    "xid_evidence",
]
