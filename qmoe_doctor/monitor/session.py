"""The monitor of one process: what each launch records, the device checks, the live warnings,
``--strict``, and the record it writes.

The hot path (:meth:`Monitor.watch`, for every launch, through ``JITFunction.run``, the
interpreter or our kernels' lean path) looks up the kernel and its argument layout
(``monitor/layout.py``: which arguments are tensors, worked out once per layout), reads two
numbers per tensor (``data_ptr()`` and ``get_device()``, never the contents: no synchronization
is added and ``m_sizes`` is never read), makes the cheap device pre-check (every tensor on the
launch device; under the interpreter, every tensor on one device) and appends one list to the
ring. That pre-check runs at **every** launch: only the recording is sampled.

A launch is *sampled* (its tensors read whole, its call site taken: a frame walk) when it is one
of its kernel's first ``call_sites`` launches, every ``SAMPLE_EVERY``-th after, or when it fails
the pre-check. A launch that fails it is turned into ``LaunchFacts`` for the device checks
(``diagnose.launch_rules``), once per kernel and placement; repeats are counted. A kernel whose
lint found an int32 offset product has every launch read whole: its tensors' spans are checked
against 2**31 each time. ``LOCAL_RANK`` (a launcher's rank) is read once, when the monitor
attaches, and goes into those facts.

The checks over many launches (``diagnose.stream_rules``: a kernel on the default stream among
its thread's side-stream launches) run on the ring when the record is written, never at a launch.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from qmoe_doctor.core import knobs
from qmoe_doctor.core.error_kind import match_text
from qmoe_doctor.core.launches import (
    INT32_LIMIT,
    HookPoint,
    Launch,
    LaunchFacts,
    LaunchFinding,
    LaunchOutcome,
    ProcessEnd,
    ProcessRecord,
    element_span,
)
from qmoe_doctor.core.records import ErrorKind, is_cuda_error
from qmoe_doctor.diagnose.launch_rules import check_launch, cross_device
from qmoe_doctor.diagnose.stream_rules import shows, wrong_stream
from qmoe_doctor.monitor import ring as R
from qmoe_doctor.monitor.callsite import Places, call_path, find_sites
from qmoe_doctor.monitor.kernels import KernelInfo, SourceCache, describe_kernel, lint_kernel
from qmoe_doctor.monitor.layout import Layout, make_layout
from qmoe_doctor.monitor.writer import RecordWriter, exception_text

if TYPE_CHECKING:
    from qmoe_doctor.monitor.fingerprint import Fingerprints

#: After a kernel's first ``call_sites`` launches, every SAMPLE_EVERY-th is sampled too: a long
#: run keeps call sites and whole tensors in its ring (a fault after hours is near a sample).
SAMPLE_EVERY = 64
#: Argument layouts kept per kernel; a launch of a layout past them is worked out on the spot.
MAX_LAYOUTS = 64
#: Problems a record keeps (the same one repeated is counted once).
MAX_PROBLEMS = 20


def _no_tensor(value: Any) -> Any:  # the per-tensor readers before torch is loaded (no tensor)
    raise TypeError(f"not a tensor: {type(value).__name__}")


class CrossDeviceLaunchError(RuntimeError):
    """``qmoe-doctor run --strict``: a launch with a tensor on another device than the launch's,
    stopped before it ran."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    folder: str
    ring: int = knobs.DEFAULT_RUN_RING
    call_sites: int = knobs.DEFAULT_RUN_CALL_SITES
    strict: bool = False
    flush_interval_s: float = knobs.RUN_FLUSH_INTERVAL_S
    prints: int = 0  # a compare pass: launches of each kernel fingerprinted (monitor/fingerprint.py)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings | None:
        """The settings ``qmoe-doctor run`` put in the environment; None when the monitor is off.
        Raises ValueError for a malformed number."""
        folder = knobs.run_dir(environ)
        if folder is None:
            return None
        return cls(
            folder=folder,
            ring=knobs.run_ring(environ),
            call_sites=knobs.run_call_sites(environ),
            strict=knobs.run_strict(environ),
            prints=knobs.run_prints(environ),
        )


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.lstrip("-").isdigit() else None


class Monitor:
    def __init__(self, settings: Settings, *, stderr: Any = None) -> None:
        self.settings = settings
        self.stderr = stderr  # None: sys.stderr at the time of a warning
        self.sources = SourceCache()
        self.places = Places()
        self.hooks: list[HookPoint] = []
        self._lock = threading.RLock()
        self._main = threading.main_thread().ident
        self._peer: dict[tuple[int, int], bool | None] = {}
        # torch, from sys.modules once a launch needs it: the tensor type and its two readers
        self._tensor_type: Any = None
        self._data_ptr: Callable[[Any], int] = _no_tensor
        self._get_device: Callable[[Any], int] = _no_tensor
        self._start_process()

    def _start_process(self) -> None:
        """State of a new process (at attach, and in the child of a fork)."""
        self.pid = os.getpid()
        self.token = secrets.token_hex(4)
        self.writer = RecordWriter(self.settings.folder, self.pid, self.token)
        self.ring = R.Ring(self.settings.ring)
        self.kernels: dict[int, KernelInfo] = {}
        self.findings: dict[tuple[str, ...], LaunchFinding] = {}
        self._checked: dict[tuple[object, ...], tuple[tuple[str, ...], ...]] = {}
        self._threads: dict[int, str] = {}  # names of the threads that launched, by ident
        self.seq = 0
        self.sampled = 0  # launches read whole (tests and the benchmarks read it)
        self.local_rank = _env_int("LOCAL_RANK")  # a launcher's rank; None outside one
        self._ring_counted = 0  # the last launch the ring checks counted (``_check_ring``)
        self.t0 = time.monotonic()
        self.started = time.time()
        self.last_flush = self.t0
        self._flush_at = self.t0 + self.settings.flush_interval_s
        self.end: ProcessEnd | None = None
        self.cuda_error = ""
        self.problems: list[str] = []
        self.warned: set[tuple[str, ...]] = set()
        # a compare pass's fingerprints (None in a plain run, which never loads their module)
        self.prints: Fingerprints | None = None
        if self.settings.prints:
            from qmoe_doctor.monitor.fingerprint import Fingerprints

            self.prints = Fingerprints(self, self.settings.prints)

    def forked(self) -> None:
        """In the child of a fork: a process of its own, with an empty ring and its own record."""
        for info in self.kernels.values():
            info.launches = 0
            info.sample_at = 1
            info.last_sampled = None
        kernels = self.kernels
        self._start_process()
        self.kernels = kernels  # the kernels' source facts, lint and layouts stay valid
        self._main = threading.get_ident()  # the thread that forked is the child's only one

    # --- the hot path ------------------------------------------------------------------------

    def launch(
        self,
        key: Any,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        grid: Any,
        gpu: int | None,
        stream: int | None,
        *,
        fn: object = None,
        arg_names: Sequence[str] | None = None,
    ) -> R.Entry:
        """Record a launch through ``JITFunction.run`` (or the interpreter) about to happen:
        ``key`` the kernel (its ``fn`` and ``arg_names`` unless given), ``args`` and ``kwargs``
        as Triton got them, ``gpu`` the device it launches on (None: the interpreter). Raises
        CrossDeviceLaunchError under --strict."""
        if kwargs:
            return self.watch(key, tuple(kwargs), (*args, *kwargs.values()), grid, gpu, stream, fn, arg_names)
        return self.watch(key, (), args, grid, gpu, stream, fn, arg_names)

    def watch(
        self,
        key: Any,
        kwnames: tuple[str, ...],
        values: Sequence[Any],
        grid: Any,
        gpu: int | None,
        stream: int | None,
        fn: object = None,
        arg_names: Sequence[str] | None = None,
    ) -> R.Entry:
        """Record one launch about to happen and run the device pre-check; the slow part
        (:meth:`_sample`) only for a sampled or suspicious launch. ``values``: the arguments,
        the last ``len(kwnames)`` of them passed by those names."""
        info = self.kernels.get(id(key))
        if info is None or info.key is not key:
            info = self._first_launch(key, fn, arg_names, sys._getframe(1))
        info.launches = k = info.launches + 1
        self.seq = seq = self.seq + 1
        types = tuple(map(type, values))
        last = info.last_layout  # (kwnames, types, layout) of the kernel's previous launch
        if types == last[1] and kwnames == last[0]:
            layout: Layout = last[2]
        else:
            layout = self._layout(info, kwnames, values, types)
        if layout.simple:
            names, tensors = layout.names, layout.pick(values)
        else:
            names, tensors = layout.expand(values)
        devices = tuple(map(self._get_device, tensors))
        # the pre-check, at every launch: each tensor on the launch device (interpreter: on one)
        if gpu is not None:
            odd = devices.count(gpu) != len(devices)
        else:
            odd = len(devices) > 1 and devices.count(devices[0]) != len(devices)
        now = time.monotonic()
        entry: R.Entry = [
            seq, info.name, k, grid, gpu, stream, names, tuple(map(self._data_ptr, tensors)), devices,
            None, None, None, now - self.t0, threading.get_ident(), "", (), None, None,
        ]  # fmt: skip
        if odd or k >= info.sample_at:
            self._sample(info, entry, tensors, odd)
        self.ring.add(entry)
        if now > self._flush_at:
            self.flush()
        return entry

    def observe(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        device: int,
        stream: int,
        names: Sequence[str],
        values: Sequence[Any],
        launcher: Callable[..., Any],
        call: tuple[Any, ...],
    ) -> Any:
        """The observer of our kernels' lean launches (``core.launch_observer``): record and
        check the launch as :meth:`launch` does, make it, follow it to its end."""
        try:
            entry = self.watch(kernel, tuple(names), values, grid, device, stream)
        except CrossDeviceLaunchError:
            raise
        except Exception as exc:  # the monitor never breaks the program
            self.problem(f"a launch could not be recorded: {type(exc).__name__}: {exc}")
            return launcher(*call)
        try:
            result = launcher(*call)
        except BaseException as exc:
            self.ended(entry, exc)
            raise
        if entry[R.FLAGGED]:
            self.ended(entry, None)
        return result

    def _layout(
        self, info: KernelInfo, kwnames: tuple[str, ...], values: Sequence[Any], types: tuple[type, ...]
    ) -> Layout:
        layout = info.layouts.get((kwnames, types))
        if layout is None:
            if self._tensor_type is None:
                self._find_torch()
            layout = make_layout(info.arg_names, kwnames, values, self._tensor_type)
            if len(info.layouts) < MAX_LAYOUTS:
                info.layouts[(kwnames, types)] = layout
        info.last_layout = (kwnames, types, layout)  # one reference: a thread reads it whole
        return layout

    def _sample(self, info: KernelInfo, entry: R.Entry, tensors: Sequence[Any], odd: bool) -> None:
        """Read a launch whole: its tensors, its call site; check it when the pre-check failed
        or the kernel's lint found an int32 offset product."""
        self.sampled += 1
        facts = tuple(R.read_tensor(name, t) for name, t in zip(entry[R.NAMES], tensors, strict=True))
        entry[R.FACTS] = facts
        info.last_sampled = entry  # its tensors stand for later unsampled launches' (ring.known_tensors)
        big: tuple[bool, ...] = ()
        if info.int32_lint:
            big = tuple(element_span(t[3], t[4]) >= INT32_LIMIT for t in facts)
            odd = odd or any(big)
        k = entry[R.KERNEL_SEQ]
        sites = self.settings.call_sites
        if odd or k <= sites or not k % SAMPLE_EVERY:
            where = find_sites(self.places, sys._getframe(1), self._tensor_type)
            entry[R.LAUNCH_SITE], entry[R.CALL_SITE], entry[R.USER_SITE], entry[R.WRAPPER] = where
        # the next launch of this kernel to read whole: each one while its first launches last
        # or its lint found an int32 product (each is checked by size), then every SAMPLE_EVERY-th
        if k < sites or info.int32_lint:
            info.sample_at = k + 1
        else:
            info.sample_at = max(sites + 1, (k // SAMPLE_EVERY + 1) * SAMPLE_EVERY)
        ident = entry[R.THREAD]
        if ident != self._main and ident not in self._threads:
            self._threads[ident] = threading.current_thread().name
        if odd:
            self._check(info, entry, big)

    def ended(self, entry: R.Entry, exc: BaseException | None) -> None:
        """A launch returned (``exc`` None; called for flagged launches only) or raised ``exc``.
        Never raises: what goes wrong here is a problem of the monitor's."""
        try:
            if exc is not None:
                self.raised(entry, exc)
            elif entry[R.FLAGGED]:
                self.launched(entry)
        except Exception as err:
            self.problem(f"a launch's end could not be recorded: {type(err).__name__}: {err}")

    def launched(self, entry: R.Entry) -> None:
        """A flagged launch returned: it ran (over peer access, remotely, for another device)."""
        self._settle(entry, "ran")

    def raised(self, entry: R.Entry, exc: BaseException) -> None:
        """The launch itself raised (a pointer refused; with CUDA_LAUNCH_BLOCKING=1 the CUDA
        error of this very kernel)."""
        text = exception_text(exc)
        entry[R.RAISED] = text
        kind = match_text(text)
        if entry[R.FLAGGED]:
            self._settle(entry, "refused" if kind is ErrorKind.POINTER_INACCESSIBLE else "raised")
        if is_cuda_error(kind):
            if not self.cuda_error:
                self.cuda_error = text
            self.flush()

    # --- first launch, checks, findings ----------------------------------------------------

    def _first_launch(
        self, key: Any, fn: object, arg_names: Sequence[str] | None, frame: FrameType | None
    ) -> KernelInfo:
        """Describe a kernel (``fn``, ``arg_names``: the key's own unless given) and lint the
        code its first launch came through."""
        with self._lock:
            info = self.kernels.get(id(key))
            if info is not None and info.key is key:
                return info
            if fn is None:
                fn = getattr(key, "fn", key)
            names = tuple(str(n) for n in (arg_names if arg_names is not None else getattr(key, "arg_names", ())))
            try:
                info = describe_kernel(key, fn, names, self.sources)
                lint_kernel(info, call_path(self.places, frame), self.sources)
            except Exception as exc:  # the monitor never breaks the program
                self.problem(f"could not describe kernel {getattr(fn, '__name__', fn)!r}: {exc}")
                name = str(getattr(fn, "__name__", "kernel"))
                info = KernelInfo(key=key, name=name, file="", line=0, end_line=None, arg_names=names)
            self.kernels[id(key)] = info
        self._flush_at = 0.0  # a new kernel: what a crash at its first launch leaves names it
        return info

    def _find_torch(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None:
            self._tensor_type = torch.Tensor
            self._data_ptr = torch.Tensor.data_ptr
            self._get_device = torch.Tensor.get_device

    def peer_access(self, launch_gpu: int, tensor_gpu: int) -> bool | None:
        """``torch.cuda.can_device_access_peer``, asked once per pair (a query; torch is loaded:
        the tensors are its)."""
        key = (launch_gpu, tensor_gpu)
        if key not in self._peer:
            torch = sys.modules.get("torch")
            try:
                self._peer[key] = bool(torch.cuda.can_device_access_peer(launch_gpu, tensor_gpu)) if torch else None
            except Exception:
                self._peer[key] = None
        return self._peer[key]

    def _check(self, info: KernelInfo, entry: R.Entry, big: tuple[bool, ...]) -> None:
        raw: tuple[R.RawTensor, ...] = entry[R.FACTS]
        placement = (id(info.key), entry[R.DEVICE], tuple((t[0], str(t[1])) for t in raw), big)
        with self._lock:
            keys = self._checked.get(placement)
            new: list[LaunchFinding] = []
            if keys is None:
                facts = LaunchFacts(
                    seq=entry[R.SEQ],
                    kernel=info.name,
                    device=R.device_name(entry[R.DEVICE]),
                    tensors=tuple(R.tensor_arg(t) for t in raw),
                    int32_lint=info.int32_lint,
                    local_rank=self.local_rank,
                )
                found = check_launch(facts, self.peer_access)
                launch = dataclasses.replace(R.to_launch(entry, self._thread_names()), flagged=bool(found))
                keys = tuple(f.key for f in found)
                self._checked[placement] = keys
                for f in found:
                    if f.key in self.findings:
                        self._bump(f.key)
                    else:
                        self.findings[f.key] = dataclasses.replace(f, launch=launch)
                        new.append(self.findings[f.key])
            else:
                for k in keys:
                    self._bump(k)
            entry[R.FLAGGED] = keys
        if not keys:
            return
        for f in new:
            self._warn(f)
        stop = [self.findings[k] for k in keys if cross_device(self.findings[k])]
        if self.settings.strict and stop:
            self._settle(entry, "stopped")
            self.flush()
            raise CrossDeviceLaunchError(f"qmoe-doctor run --strict: {stop[0].cause}: {stop[0].message}")
        if new:
            self.flush()

    def _bump(self, key: tuple[str, ...]) -> None:
        f = self.findings[key]
        self.findings[key] = dataclasses.replace(f, count=f.count + 1)

    def _settle(self, entry: R.Entry, outcome: LaunchOutcome) -> None:
        keys = entry[R.FLAGGED]
        if not keys:
            return
        with self._lock:
            for k in keys:
                f = self.findings.get(k)
                if f is not None and f.outcome in ("pending", "ran"):
                    self.findings[k] = dataclasses.replace(f, outcome=outcome)

    def _warn(self, f: LaunchFinding) -> None:
        if f.key in self.warned:
            return
        self.warned.add(f.key)
        rank = _env_int("RANK")
        who = f"rank {rank}: " if rank is not None else ""
        site = f.launch.call_site or f.launch.launch_site if f.launch is not None else None
        where = f" (called at {site.render()}" if site is not None else ""
        mine = f.launch.user_site if f.launch is not None else None
        if where and mine is not None and mine != site:
            where += f"; your line {mine.render()}"
        where += ")" if where else ""
        stream = self.stderr or sys.stderr
        try:
            stream.write(f"qmoe-doctor: {who}{f.cause}: {f.message}{where}\n")
            stream.flush()
        except (OSError, ValueError):
            pass

    def _check_ring(self, ring: Sequence[Launch]) -> None:
        """The checks over the last launches (``diagnose.stream_rules``), where the record is
        written. A new finding is warned about; one found before counts its launches made since
        the previous check (launches the ring dropped in between are not counted)."""
        if not ring:
            return
        found = wrong_stream(ring)
        new: list[LaunchFinding] = []
        with self._lock:  # flushes may overlap (any launching thread flushes): count each launch once
            counted = self._ring_counted
            self._ring_counted = max(counted, ring[-1].seq)
            for f in found:
                known = self.findings.get(f.key)
                if known is None:
                    self.findings[f.key] = f
                    new.append(f)
                    continue
                more = sum(1 for launch in ring if launch.seq > counted and shows(known, launch))
                if more:
                    self.findings[f.key] = dataclasses.replace(known, count=known.count + more)
        for f in new:
            self._warn(f)

    def problem(self, text: str) -> None:
        if text not in self.problems and len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    # --- the record ------------------------------------------------------------------------

    def _thread_names(self) -> dict[int, str]:
        """Names of the threads that launched, by ident ("" for the main thread)."""
        names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
        names.update(self._threads)
        if self._main is not None:
            names[self._main] = ""
        return names

    def record(self) -> ProcessRecord:
        """The record as it stands, once the checks over the ring have run on it."""
        entries = self.ring.snapshot()
        threads = self._thread_names()
        with self._lock:
            kernels = tuple(info.seen() for info in self.kernels.values())
            sampled = [info.last_sampled for info in self.kernels.values() if info.last_sampled is not None]
        known = R.known_tensors([*sampled, *entries])
        ring = tuple(R.to_launch(e, threads, known) for e in entries)
        try:
            self._check_ring(ring)
        except Exception as exc:  # the record is written all the same
            self.problem(f"the checks over the ring failed: {type(exc).__name__}: {exc}")
        with self._lock:
            findings = tuple(self.findings.values())
        triton = sys.modules.get("triton")
        torch = sys.modules.get("torch")
        return ProcessRecord(
            pid=self.pid,
            ppid=os.getppid(),
            rank=_env_int("RANK"),
            local_rank=self.local_rank,
            world_size=_env_int("WORLD_SIZE"),
            argv=tuple(str(a) for a in sys.argv),
            python=sys.version.split()[0],
            triton_version=str(getattr(triton, "__version__", "")),
            torch_version=str(getattr(torch, "__version__", "")),
            hooks=tuple(self.hooks),
            interpreter=os.environ.get(knobs.TRITON_INTERPRET, "") not in ("", "0"),
            strict=self.settings.strict,
            started=self.started,
            flushed_at=time.time(),
            launches=self.seq,
            ring_size=self.settings.ring,
            ring=ring,
            kernels=kernels,
            lint=self.sources.lints(),
            findings=findings,
            end=self.end,
            cuda_error=self.cuda_error,
            problems=tuple(self.problems),
        )

    def flush(self) -> None:
        """Write the record now. Never raises: a failure is noted and the program goes on."""
        self.last_flush = time.monotonic()
        self._flush_at = self.last_flush + self.settings.flush_interval_s
        if self.prints is not None:
            self.prints.flush(final=self.end is not None)
        try:
            self.writer.write(self.record())
        except Exception as exc:
            self.problem(f"could not write the record {self.writer.path}: {type(exc).__name__}: {exc}")

    def finish(self, end: ProcessEnd) -> None:
        """The process ends (or raised, or got a signal): the first end is the one kept."""
        if self.end is None:
            self.end = end
        if is_cuda_error(end.error_kind) and not self.cuda_error:
            self.cuda_error = end.detail
        self.flush()


__all__ = ["CrossDeviceLaunchError", "Monitor", "Settings"]
