"""The monitor of one process: what each launch records, the device checks, the live warnings,
``--strict``, and the record it writes.

The hot path (:meth:`Monitor.launch`) reads each tensor argument's metadata (device, pointer,
shape, strides, dtype: a few hundred nanoseconds per tensor, never the contents, so no
synchronization is added and ``m_sizes`` is never read), appends one entry to the ring and makes
a cheap pre-check: every tensor on the launch device, and, for a kernel whose lint found an int32
offset product, no tensor spanning 2**31 elements. Only a launch that fails it is turned into
``LaunchFacts`` for the device checks (``diagnose.launch_rules``), once per kernel and placement;
repeats are counted. The call site (a frame walk) is taken for the first launches of each kernel
and for every flagged launch.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from qmoe_doctor.core import knobs
from qmoe_doctor.core.error_kind import match_text
from qmoe_doctor.core.launches import (
    INT32_LIMIT,
    HookPoint,
    LaunchFacts,
    LaunchFinding,
    LaunchOutcome,
    ProcessEnd,
    ProcessRecord,
    element_span,
)
from qmoe_doctor.core.records import ErrorKind
from qmoe_doctor.diagnose.launch_rules import check_launch, cross_device
from qmoe_doctor.monitor import ring as R
from qmoe_doctor.monitor.callsite import Places, call_path, find_sites
from qmoe_doctor.monitor.kernels import KernelInfo, SourceCache, describe_kernel, lint_kernel
from qmoe_doctor.monitor.writer import CUDA_ERROR_KINDS, RecordWriter, exception_text

#: Argument types that are never tensors (checked before anything slower).
_PLAIN = frozenset({int, float, bool, str, type(None)})
#: Problems a record keeps (the same one repeated is counted once).
MAX_PROBLEMS = 20


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
        self._devices: dict[int, tuple[Any, str]] = {}  # launch GPU -> (torch.device, "cuda:N")
        self._device_type = "cuda"
        self._peer: dict[tuple[int, int], bool | None] = {}
        self._tensor_type: Any = None
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
        self.seq = 0
        self.t0 = time.monotonic()
        self.started = time.time()
        self.last_flush = self.t0
        self.end: ProcessEnd | None = None
        self.cuda_error = ""
        self.problems: list[str] = []
        self.warned: set[tuple[str, ...]] = set()
        self._flush_soon = False

    def forked(self) -> None:
        """In the child of a fork: a process of its own, with an empty ring and its own record."""
        for info in self.kernels.values():
            info.launches = 0
        kernels = self.kernels
        self._start_process()
        self.kernels = kernels  # the kernels' source facts and lint stay valid

    # --- the hot path ------------------------------------------------------------------------

    def launch(
        self,
        key: object,
        fn: object,
        arg_names: Sequence[str],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        grid: Any,
        gpu: int | None,
        stream: int | None,
    ) -> R.Entry:
        """Record one launch about to happen; run the device checks when the pre-check fails.
        ``gpu``: the device Triton launches on (None: the interpreter). Raises
        CrossDeviceLaunchError under --strict."""
        info = self.kernels.get(id(key))
        if info is None or info.key is not key:
            info = self._first_launch(key, fn, tuple(arg_names), sys._getframe(1))
        info.launches += 1
        self.seq += 1
        now = time.monotonic()
        launch_dev: Any = None
        dev_name: str | None = None
        if gpu is not None:
            known = self._devices.get(gpu)
            if known is None:
                known = self._launch_device(gpu)
            launch_dev, dev_name = known
        entry = R.new_entry(self.seq, info.name, info.launches, grid, dev_name, stream, now - self.t0)
        tensor_type = self._tensor_type
        if tensor_type is None:
            tensor_type = self._find_tensor_type()
        tensors: list[R.RawTensor] = []
        if tensor_type is not None:
            names = info.arg_names
            count = len(names)
            for i, a in enumerate(args):
                if type(a) in _PLAIN:
                    continue
                if isinstance(a, tensor_type):
                    name = names[i] if i < count else f"arg{i}"
                    tensors.append((name, a.device, a.data_ptr(), a.shape, a.stride(), a.dtype))
                else:
                    self._other_arg(tensors, names[i] if i < count else f"arg{i}", a, tensor_type)
            for name, a in kwargs.items():
                if type(a) in _PLAIN:
                    continue
                if isinstance(a, tensor_type):
                    tensors.append((name, a.device, a.data_ptr(), a.shape, a.stride(), a.dtype))
                else:
                    self._other_arg(tensors, name, a, tensor_type)
        entry[R.TENSORS] = tensors
        odd = False
        if launch_dev is not None:
            for t in tensors:
                if t[1] != launch_dev:
                    odd = True
                    break
        elif len(tensors) > 1:
            first = tensors[0][1]
            odd = any(t[1] != first for t in tensors)
        big: tuple[bool, ...] = ()
        if info.int32_lint:
            big = tuple(element_span(t[3], t[4]) >= INT32_LIMIT for t in tensors)
            odd = odd or any(big)
        if threading.get_ident() != self._main:
            entry[R.THREAD] = threading.current_thread().name
        if odd or info.launches <= self.settings.call_sites:
            entry[R.LAUNCH_SITE], entry[R.CALL_SITE] = find_sites(self.places, sys._getframe(1))
        self.ring.add(entry)
        if odd:
            self._check(info, entry, big)
        if self._flush_soon or now - self.last_flush > self.settings.flush_interval_s:
            self._flush_soon = False
            self.flush()
        return entry

    def _other_arg(self, tensors: list[R.RawTensor], name: str, a: Any, tensor_type: Any) -> None:
        """A TensorDescriptor (its ``base`` tensor), or a tuple of tensors (one level)."""
        if isinstance(a, tuple):
            for j, item in enumerate(a):
                if isinstance(item, tensor_type):
                    tensors.append((f"{name}[{j}]", item.device, item.data_ptr(), item.shape, item.stride(), item.dtype))
            return
        base = getattr(a, "base", None)
        if isinstance(base, tensor_type):
            tensors.append((f"{name}.base", base.device, base.data_ptr(), base.shape, base.stride(), base.dtype))

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
        if kind in CUDA_ERROR_KINDS:
            if not self.cuda_error:
                self.cuda_error = text
            self.flush()

    # --- first launch, checks, findings ----------------------------------------------------

    def _first_launch(
        self, key: object, fn: object, arg_names: tuple[str, ...], frame: FrameType | None
    ) -> KernelInfo:
        """Describe a kernel and lint the code its first launch came through."""
        with self._lock:
            info = self.kernels.get(id(key))
            if info is not None and info.key is key:
                return info
            try:
                info = describe_kernel(key, fn, arg_names, self.sources)
                lint_kernel(info, call_path(self.places, frame), self.sources)
            except Exception as exc:  # the monitor never breaks the program
                self.problem(f"could not describe kernel {getattr(fn, '__name__', fn)!r}: {exc}")
                name = str(getattr(fn, "__name__", "kernel"))
                info = KernelInfo(key=key, name=name, file="", line=0, end_line=None, arg_names=arg_names)
            self.kernels[id(key)] = info
        self._flush_soon = True  # a new kernel: what a crash at its first launch leaves names it
        return info

    def _launch_device(self, gpu: int) -> tuple[Any, str]:
        torch = sys.modules.get("torch")
        name = f"{self._device_type}:{gpu}"
        device = torch.device(self._device_type, gpu) if torch is not None else name
        self._devices[gpu] = (device, name)
        return device, name

    def _find_tensor_type(self) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None:
            self._tensor_type = torch.Tensor
        return self._tensor_type

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
        raw = entry[R.TENSORS]
        placement = (id(info.key), entry[R.DEVICE], tuple((t[0], str(t[1])) for t in raw), big)
        with self._lock:
            keys = self._checked.get(placement)
            new: list[LaunchFinding] = []
            if keys is None:
                facts = LaunchFacts(
                    seq=entry[R.SEQ],
                    kernel=info.name,
                    device=entry[R.DEVICE],
                    tensors=tuple(R.tensor_arg(t) for t in raw),
                    int32_lint=info.int32_lint,
                )
                found = check_launch(facts, self.peer_access)
                launch = dataclasses.replace(R.to_launch(entry), flagged=bool(found))
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
        where = f" (called at {site.render()})" if site is not None else ""
        stream = self.stderr or sys.stderr
        try:
            stream.write(f"qmoe-doctor: {who}{f.cause}: {f.message}{where}\n")
            stream.flush()
        except (OSError, ValueError):
            pass

    def problem(self, text: str) -> None:
        if text not in self.problems and len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    # --- the record ------------------------------------------------------------------------

    def record(self) -> ProcessRecord:
        entries = self.ring.snapshot()
        with self._lock:
            findings = tuple(self.findings.values())
            kernels = tuple(info.seen() for info in self.kernels.values())
        triton = sys.modules.get("triton")
        torch = sys.modules.get("torch")
        return ProcessRecord(
            pid=self.pid,
            ppid=os.getppid(),
            rank=_env_int("RANK"),
            local_rank=_env_int("LOCAL_RANK"),
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
            ring=tuple(R.to_launch(e) for e in entries),
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
        try:
            self.writer.write(self.record())
        except Exception as exc:
            self.problem(f"could not write the record {self.writer.path}: {type(exc).__name__}: {exc}")

    def finish(self, end: ProcessEnd) -> None:
        """The process ends (or raised, or got a signal): the first end is the one kept."""
        if self.end is None:
            self.end = end
        if end.error_kind in CUDA_ERROR_KINDS and not self.cuda_error:
            self.cuda_error = end.detail
        self.flush()


__all__ = ["CrossDeviceLaunchError", "Monitor", "Settings"]
