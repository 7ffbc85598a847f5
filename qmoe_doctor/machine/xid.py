"""Xid errors seen while a probe runs, read from this host: NVML's Xid events, and the kernel log.

``XidWatcher`` registers NVML's Xid events for the probed GPUs in a background thread for the
length of a run, and reads the kernel log (``dmesg``) before and after it: the ``NVRM: Xid``
lines that appeared meanwhile, on the watched GPUs, are the run's. What the records hold and how
a kernel-log line reads: ``qmoe_doctor.core.xid``. What they say about the probe (an Xid 31
address placed against its tensors): ``qmoe_doctor.diagnose.xid``.

No torch here, and no CUDA context: NVML only. Nothing here raises on a machine without NVML,
without permission to read the kernel log, or inside a container: each becomes a reason.
"""

from __future__ import annotations

import importlib
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

from qmoe_doctor.core.xid import KernelXid, XidEvent, XidReport, new_kernel_lines, pci_key

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


__all__ = ["KernelLogReader", "XidWatcher", "read_dmesg"]
