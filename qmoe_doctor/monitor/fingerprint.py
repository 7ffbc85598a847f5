"""Fingerprints of each launch's tensors, in the passes of ``qmoe-doctor run --compare`` only.

A plain run never loads this path: ``hook.py`` installs the wrappers below instead of its own
only when ``$QMOE_DOCTOR_RUN_PRINTS`` is set (``Monitor.prints``), so the plain hot path keeps
its cost. Each wrapper records and checks the launch as the plain one does
(``Monitor.watch``), then:

* **before the launch**, reads every tensor argument (:meth:`Fingerprints.before`): sum and sum
  of |x| accumulated in float64, the non-finite count, and the values at the fixed positions of
  ``core.fingerprints.sample_positions``, each as a small float64 vector computed *on the
  tensor's device* by torch ops on that device's current stream, which for a tensor on the
  launch device is the launch's stream: what is read is what the kernel finds in its stream's
  order. A tensor on another device than the launch's is read on its own device's current
  stream (where its producer ran).
* **after the launch**, reads them again (:meth:`Fingerprints.after`): on the launch's stream
  for its device's tensors; for a tensor on another device, on a stream of the doctor's own on
  that device, made to wait for an event recorded on the launch's stream after the kernel (the
  user's streams are never made to wait on anything).

Nothing waits on the host at a launch: each vector block is copied to pinned host memory
without blocking and an event recorded behind it; finished launches are collected at later
launches (``Event.query``), all of them at a flush (every 5 s, at exit, at a CUDA error) or
when ``MAX_PENDING`` are outstanding. A wait on the host after every launch would order each
later launch after it and hide exactly the races a compare looks for (a consumer on a side
stream that does not wait for its producer). Under the interpreter (CPU tensors) every read is
done at once.

A kernel's launches past ``limit`` are counted, not printed; the autotuner's benchmark launches
are left out of the ordinals (their number depends on timing). What the prints are, and what
they can and cannot tell, is in ``core.fingerprints``.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from qmoe_doctor.core import fingerprints as F
from qmoe_doctor.core.launches import element_span
from qmoe_doctor.monitor import ring as R
from qmoe_doctor.monitor.callsite import Sites, find_sites
from qmoe_doctor.monitor.layout import PLAIN, make_layout

#: Launches whose prints may be outstanding on the GPU; past this the oldest is waited for.
MAX_PENDING = 256
#: Elements reduced at once: a larger tensor is read in pieces of this size (a float64 copy of
#: each piece is made; 2**24 elements take 128 MiB).
CHUNK = 2**24
#: Frames looked at to tell an autotuner's benchmark launch (``Autotuner._bench``) from a real one.
BENCH_FRAMES = 16
#: Characters of a launch's config or scalars kept.
ARGS_CHARS = 500
#: Sample index tensors kept (per device, stream, shape and strides) before they start over.
MAX_INDICES = 4096


def _benchmarking(frame: FrameType | None) -> bool:
    """Whether the launch comes from ``triton.runtime.autotuner.Autotuner._bench``."""
    for _ in range(BENCH_FRAMES):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_bench" and code.co_filename.endswith("autotuner.py"):
            return True
        frame = frame.f_back
    return False


class _Batch:
    """The vectors of one phase of one launch read on one device (stream), as one host block."""

    __slots__ = ("_vectors", "event", "host", "sizes")

    def __init__(self, event: Any, host: Any, sizes: list[int]) -> None:
        self.event = event  # None: read on the CPU, ``host`` holds the values already
        self.host = host
        self.sizes = sizes
        self._vectors: list[list[float]] | None = None

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def vectors(self) -> list[list[float]]:
        """The vectors, once the copy has landed (waited for here when it has not)."""
        if self._vectors is None:
            if self.event is not None:
                self.event.synchronize()
            flat: list[float] = self.host.tolist()
            out: list[list[float]] = []
            at = 0
            for size in self.sizes:
                out.append(flat[at : at + size])
                at += size
            self._vectors, self.host, self.event = out, None, None
        return self._vectors


#: Where one tensor's vector went: (its batch, its index in the batch).
_Slot = tuple[_Batch, int]


#: One tensor as a print names it: (name, device, dtype, shape, numel).
_Meta = tuple[str, str, str, tuple[int, ...], int]


class _Job:
    """One launch being printed: what is known of it, its tensors until the after-read."""

    __slots__ = (
        "after", "before", "config", "entry", "gpu", "kernel", "meta", "ordinal", "scalars", "sites", "tensors",
        "thread",
    )  # fmt: skip

    def __init__(
        self,
        *,
        entry: R.Entry,
        ordinal: int,
        config: str | None,
        scalars: str | None,
        tensors: tuple[Any, ...],
        meta: tuple[_Meta, ...],
        sites: Sites,
        thread: str,
    ) -> None:
        self.entry = entry
        self.kernel: str = entry[R.KERNEL]
        self.gpu: int | None = entry[R.DEVICE]
        self.ordinal = ordinal
        self.config = config
        self.scalars = scalars
        self.tensors = tensors
        self.meta = meta
        self.sites = sites
        self.thread = thread
        self.before: list[_Slot] = []
        self.after: list[_Slot] = []

    def ready(self) -> bool:
        return all(batch.ready() for batch, _ in (*self.before, *self.after))


class Fingerprints:
    """The prints of one process: ordinals per kernel, the reads, the outstanding results, the
    prints file. Torch comes from ``sys.modules`` (the tensors are its)."""

    def __init__(self, monitor: Any, limit: int) -> None:
        self.monitor = monitor
        self.limit = limit
        self.path = Path(monitor.settings.folder) / F.prints_name(monitor.pid, monitor.token)
        self._lock = threading.Lock()
        self._ordinals: dict[str, int] = {}
        self._argnames: dict[int, tuple[tuple[str, ...], frozenset[str]]] = {}
        self._pending: deque[_Job] = deque()
        self._lines: list[str] = []
        self._indices: dict[tuple[Any, ...], Any] = {}
        self._private: dict[tuple[int, int], Any] = {}
        self.printed = 0
        self.past_limit = 0
        self.benchmark = 0
        self.lost = 0
        self.at_limit: dict[str, None] = {}
        self.bytes = 0
        self.stopped = ""
        self.problems: list[str] = []

    # --- what a launch passes ------------------------------------------------------------

    def _kernel_names(
        self, key: Any, arg_names: Sequence[str] | None, constexprs: Sequence[str] | None
    ) -> tuple[tuple[str, ...], frozenset[str]]:
        known = self._argnames.get(id(key))
        if known is None:
            names = tuple(
                str(n) for n in (arg_names if arg_names is not None else getattr(key, "arg_names", ()))
            )
            if constexprs is None:
                params = getattr(key, "params", ())
                constexprs = [str(p.name) for p in params if getattr(p, "is_constexpr", False)]
            known = (names, frozenset(constexprs))
            self._argnames[id(key)] = known
        return known

    @staticmethod
    def _arguments(
        names: Sequence[str], constexprs: frozenset[str], kwnames: tuple[str, ...], values: Sequence[Any]
    ) -> tuple[str, str]:
        """(config, scalars): the launch's plain arguments by name, constexprs and launch options
        (keywords that are no parameter: num_warps) apart from the others."""
        positional = len(values) - len(kwnames)
        labels = [names[i] if i < len(names) else f"arg{i}" for i in range(positional)] + list(kwnames)
        params = set(names)
        config: list[str] = []
        scalars: list[str] = []
        for label, value in zip(labels, values, strict=True):
            if type(value) not in PLAIN:
                continue
            text = f"{label}={value!r}"
            (config if label in constexprs or label not in params else scalars).append(text)
        return ", ".join(config)[:ARGS_CHARS], ", ".join(scalars)[:ARGS_CHARS]

    def _tensors(
        self, key: Any, kwnames: tuple[str, ...], values: Sequence[Any]
    ) -> tuple[tuple[str, ...], tuple[Any, ...]]:
        monitor = self.monitor
        info = monitor.kernels.get(id(key))
        layout = None
        if info is not None:
            last = info.last_layout
            if last[0] == kwnames and last[1] == tuple(map(type, values)):
                layout = last[2]
        if layout is None:
            names = info.arg_names if info is not None else tuple(getattr(key, "arg_names", ()))
            layout = make_layout(names, kwnames, values, monitor._tensor_type)
        if layout.simple:
            return layout.names, layout.pick(values)
        return layout.expand(values)

    # --- the reads ----------------------------------------------------------------------

    def _torch(self) -> Any:
        return sys.modules["torch"]

    def _index(self, torch: Any, t: Any, stream: int | None) -> Any:
        """The storage offsets of ``t``'s sampled positions, as an int64 tensor on its device
        (made once per device, stream, shape and strides; copied without a host wait)."""
        shape, strides = tuple(t.shape), tuple(t.stride())
        key = (str(t.device), stream, shape, strides)
        index = self._indices.get(key)
        if index is not None:
            return index
        positions = F.sample_positions(t.numel())
        if t.is_contiguous():
            offsets = positions
        else:
            offsets = []
            for p in positions:
                offset = 0
                for size, step in zip(reversed(shape), reversed(strides), strict=True):
                    p, i = divmod(p, size)
                    offset += i * step
                offsets.append(offset)
        index = torch.tensor(offsets, dtype=torch.int64)
        if t.device.type == "cuda":
            index = index.pin_memory().to(t.device, non_blocking=True)
        if len(self._indices) >= MAX_INDICES:
            self._indices.clear()
        self._indices[key] = index
        return index

    def _vector(self, torch: Any, t: Any, stream: int | None) -> Any:
        """[sum, sum |x|, non-finite count, *sampled values], float64, on ``t``'s device: torch
        ops on that device's current stream, nothing waited for."""
        f64 = torch.float64
        if t.is_complex():
            t = torch.view_as_real(t)
        n = t.numel()
        if n == 0:
            return torch.zeros(F.HEAD, dtype=f64, device=t.device)
        if n <= CHUNK:
            pieces = [t]
        elif t.is_contiguous():
            pieces = list(t.view(-1).split(CHUNK))
        else:
            pieces = list(t.split(max(1, CHUNK // max(1, n // t.shape[0])), dim=0))
        total: Any = None
        abs_total: Any = None
        bad: Any = None
        for piece in pieces:
            wide = piece.to(f64)
            s, a, b = wide.sum(), wide.abs().sum(), (~torch.isfinite(wide)).sum()
            total = s if total is None else total + s
            abs_total = a if abs_total is None else abs_total + a
            bad = b if bad is None else bad + b
        index = self._index(torch, t, stream)
        if t.is_contiguous():
            base = t.reshape(-1)
        else:
            base = t.as_strided((element_span(t.shape, t.stride()),), (1,), t.storage_offset())
        head = torch.stack([total, abs_total, bad.to(f64)])
        return torch.cat([head, base[index].to(f64)])

    def _block(self, torch: Any, vectors: list[Any], stream: Any) -> _Batch:
        sizes = [int(v.numel()) for v in vectors]
        flat = torch.cat(vectors) if len(vectors) > 1 else vectors[0]
        if flat.device.type != "cuda":
            return _Batch(None, flat, sizes)
        host = torch.empty(flat.numel(), dtype=torch.float64, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return _Batch(event, host, sizes)

    def _private_stream(self, torch: Any, launch_stream: int, device: int) -> Any:
        """The doctor's own stream on ``device`` for the tensors of launches on ``launch_stream``:
        one per pair, so a wait on one launch stream never orders another behind it."""
        key = (launch_stream, device)
        stream = self._private.get(key)
        if stream is None:
            stream = self._private[key] = torch.cuda.Stream(device=device)
        return stream

    def _read(self, tensors: Sequence[Any], gpu: int | None, after: bool) -> list[_Slot]:
        """Every tensor's vector, grouped into one block per device (stream)."""
        torch = self._torch()
        groups: dict[tuple[str, int | None], tuple[Any, list[int], list[Any]]] = {}
        kernel_done: Any = None  # event on the launch stream after the kernel (other-device reads)
        for i, t in enumerate(tensors):
            device = t.device
            if device.type != "cuda":
                key: tuple[str, int | None] = ("cpu", None)
                if key not in groups:
                    groups[key] = (None, [], [])
                stream = None
                groups[key][1].append(i)
                groups[key][2].append(self._vector(torch, t, None))
                continue
            index = device.index if device.index is not None else torch.cuda.current_device()
            if after and gpu is not None and index != gpu:
                launch_stream = torch.cuda.current_stream(gpu)
                if kernel_done is None:
                    kernel_done = torch.cuda.Event()
                    kernel_done.record(launch_stream)
                stream = self._private_stream(torch, launch_stream.cuda_stream, index)
                key = (f"cuda:{index}", stream.cuda_stream)
                if key not in groups:
                    stream.wait_event(kernel_done)
                    groups[key] = (stream, [], [])
                with torch.cuda.stream(stream):
                    vector = self._vector(torch, t, stream.cuda_stream)
            else:
                stream = torch.cuda.current_stream(index)
                key = (f"cuda:{index}", stream.cuda_stream)
                if key not in groups:
                    groups[key] = (stream, [], [])
                vector = self._vector(torch, t, stream.cuda_stream)
            groups[key][1].append(i)
            groups[key][2].append(vector)
        slots: list[_Slot | None] = [None] * len(tensors)
        for stream, indices, vectors in groups.values():
            if stream is not None:
                with torch.cuda.stream(stream):
                    batch = self._block(torch, vectors, stream)
            else:
                batch = self._block(torch, vectors, None)
            for at, i in enumerate(indices):
                slots[i] = (batch, at)
        return [s for s in slots if s is not None]

    # --- a launch -----------------------------------------------------------------------

    def before(
        self,
        key: Any,
        entry: R.Entry,
        kwnames: tuple[str, ...],
        values: Sequence[Any],
        frame: FrameType | None,
        *,
        arg_names: Sequence[str] | None = None,
        constexprs: Sequence[str] | None = None,
        lean: bool = False,
    ) -> _Job | None:
        """Read the launch's tensors before it; None when it is not printed (a benchmark launch,
        its kernel past the limit, printing stopped, or the read failed). Never raises."""
        if self.stopped:
            return None
        try:
            if _benchmarking(frame):
                with self._lock:
                    self.benchmark += 1
                return None
            kernel = entry[R.KERNEL]
            with self._lock:
                ordinal = self._ordinals.get(kernel, 0) + 1
                self._ordinals[kernel] = ordinal
                if ordinal > self.limit:
                    self.past_limit += 1
                    self.at_limit[kernel] = None
                    return None
            config: str | None = None
            scalars: str | None = None
            if not lean:
                names, constexpr_names = self._kernel_names(key, arg_names, constexprs)
                config, scalars = self._arguments(names, constexpr_names, kwnames, values)
            labels, tensors = self._tensors(key, kwnames, values)
            current = threading.current_thread()
            job = _Job(
                entry=entry,
                ordinal=ordinal,
                config=config,
                scalars=scalars,
                tensors=tensors,
                meta=tuple(
                    (
                        name,
                        str(t.device),
                        R.dtype_name(t.dtype),
                        tuple(int(d) for d in t.shape),
                        int(t.numel()),
                    )
                    for name, t in zip(labels, tensors, strict=True)
                ),
                sites=find_sites(self.monitor.places, frame),
                thread=current.name if current is not threading.main_thread() else "",
            )
            job.before = self._read(tensors, job.gpu, after=False)
            return job
        except Exception as exc:  # the launch goes on, unprinted
            self.problem(
                f"a launch of {entry[R.KERNEL]} could not be fingerprinted: {type(exc).__name__}: {exc}"
            )
            return None

    def after(self, job: _Job) -> None:
        """Read the launch's tensors after it and queue the launch for collection. Never raises."""
        try:
            job.after = self._read(job.tensors, job.gpu, after=True)
        except Exception as exc:
            self.problem(
                f"a launch of {job.kernel} could not be fingerprinted after it ran: {type(exc).__name__}: {exc}"
            )
            return
        finally:
            job.tensors = ()  # no tensor is kept alive past its launch
        self._pending.append(job)
        self._collect(wait=len(self._pending) - MAX_PENDING)

    def _collect(self, wait: int) -> None:
        """Turn finished launches into lines, in order: the oldest ``wait`` waited for, then
        those whose results are on the host already."""
        with self._lock:
            while self._pending:
                job = self._pending[0]
                try:
                    if wait <= 0 and not job.ready():
                        return
                    self._lines.append(F.launch_line(self._print(job)))
                except Exception as exc:  # a CUDA error: what is outstanding will not come back
                    self.lost += len(self._pending)
                    self._pending.clear()
                    self.problem(f"fingerprints lost: {type(exc).__name__}: {exc}")
                    return
                self._pending.popleft()
                self.printed += 1
                wait -= 1

    def _print(self, job: _Job) -> F.LaunchPrint:
        before = [batch.vectors()[at] for batch, at in job.before]
        after = [batch.vectors()[at] for batch, at in job.after]
        tensors = []
        for (name, device, dtype, shape, numel), b, a in zip(job.meta, before, after, strict=True):
            first = F.Contents.from_vector(b)
            then = F.Contents.from_vector(a)
            tensors.append(
                F.TensorPrint(
                    name=name,
                    device=device,
                    dtype=dtype,
                    shape=shape,
                    numel=numel,
                    before=first,
                    after=None if then.same(first) else then,
                )  # fmt: skip
            )
        entry = job.entry
        launch_site, call_site = job.sites.launch, job.sites.call
        return F.LaunchPrint(
            seq=entry[R.SEQ],
            kernel=job.kernel,
            ordinal=job.ordinal,
            config=job.config,
            scalars=job.scalars,
            grid=R.grid_tuple(entry[R.GRID]),
            device=R.device_name(entry[R.DEVICE]),
            stream=entry[R.STREAM],
            call_site=call_site,
            launch_site=launch_site,
            thread=job.thread,
            tensors=tuple(tensors),
        )

    def problem(self, text: str) -> None:
        if text not in self.problems and len(self.problems) < 20:
            self.problems.append(text)

    # --- the file -----------------------------------------------------------------------

    def state(self, final: bool) -> F.PrintsState:
        return F.PrintsState(
            pid=self.monitor.pid,
            limit=self.limit,
            printed=self.printed,
            past_limit=self.past_limit,
            benchmark=self.benchmark,
            kernels_at_limit=tuple(self.at_limit),
            stopped=self.stopped,
            lost=self.lost + (len(self._pending) if final else 0),
            final=final,
            problems=tuple(self.problems),
        )

    def flush(self, final: bool) -> None:
        """Append the collected lines and the state. ``final`` (the process ends): wait for every
        outstanding launch first. Never raises."""
        try:
            self._collect(wait=len(self._pending) if final else 0)
        except Exception as exc:
            self.problem(f"collecting fingerprints failed: {type(exc).__name__}: {exc}")
        with self._lock:
            lines, self._lines = self._lines, []
            text = "".join(lines) + F.state_line(self.state(final))
        try:
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(text)
            self.bytes += len(text)
        except OSError as exc:
            self.problem(f"could not write {self.path}: {exc}")
        if self.bytes >= F.MAX_PRINTS_BYTES and not self.stopped:
            self.stopped = (
                f"the prints file reached {F.MAX_PRINTS_BYTES // 2**20} MiB after {self.printed:,} launches: "
                "later launches were not printed"
            )


def jit_wrapper(
    original: Callable[..., Any], monitor: Any, driver: Any, spied: Callable[[Any, R.Entry], Any]
) -> Callable[..., Any]:
    """``JITFunction.run`` in a compare pass: the plain wrapper's recording and checks, with the
    tensors read before and after."""
    from qmoe_doctor.monitor.session import CrossDeviceLaunchError

    prints: Fingerprints = monitor.prints

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        try:
            active = driver.active
            gpu: int | None = active.get_current_device()
            stream: int | None = active.get_current_stream(gpu)
        except Exception:
            gpu = stream = None
        kwnames = tuple(kwargs)
        values = (*args, *kwargs.values()) if kwargs else args
        try:
            entry = monitor.watch(self, kwnames, values, grid, gpu, stream)
        except CrossDeviceLaunchError:
            raise
        except Exception as exc:
            monitor.problem(f"a launch could not be recorded: {type(exc).__name__}: {exc}")
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        job = prints.before(self, entry, kwnames, values, sys._getframe(1))
        if callable(grid):
            grid = spied(grid, entry)
        try:
            result = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        except BaseException as exc:
            monitor.ended(entry, exc)
            raise
        if entry[R.FLAGGED]:
            monitor.ended(entry, None)
        if job is not None:
            prints.after(job)
        return result

    return run


def interpreter_wrapper(
    original: Callable[..., Any], monitor: Any, spied: Callable[[Any, R.Entry], Any]
) -> Callable[..., Any]:
    """``GridExecutor.__call__`` in a compare pass."""
    from qmoe_doctor.monitor.session import CrossDeviceLaunchError

    prints: Fingerprints = monitor.prints

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("warmup"):
            return original(self, *args, **kwargs)
        try:
            entry = monitor.launch(
                self.fn, args, kwargs, self.grid, None, None, fn=self.fn, arg_names=self.arg_names
            )
        except CrossDeviceLaunchError:
            raise
        except Exception as exc:
            monitor.problem(f"a launch could not be recorded: {type(exc).__name__}: {exc}")
            return original(self, *args, **kwargs)
        kwnames = tuple(kwargs)
        values = (*args, *kwargs.values()) if kwargs else args
        job = prints.before(
            self.fn, entry, kwnames, values, sys._getframe(1),
            arg_names=self.arg_names, constexprs=getattr(self, "constexprs", None),
        )  # fmt: skip
        if callable(self.grid):
            self.grid = spied(self.grid, entry)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            monitor.ended(entry, exc)
            raise
        if entry[R.FLAGGED]:
            monitor.ended(entry, None)
        if job is not None:
            prints.after(job)
        return result

    return call


def lean_observer(monitor: Any) -> Callable[..., Any]:
    """The observer of our kernels' lean launches (``core.launch_observer``) in a compare pass:
    ``Monitor.observe`` with the reads around the launch. A lean launch passes its tensors only:
    its config and scalars are the plan's, not printed."""
    from qmoe_doctor.monitor.session import CrossDeviceLaunchError

    prints: Fingerprints = monitor.prints

    def observe(
        kernel: Any,
        grid: tuple[int, int, int],
        device: int,
        stream: int,
        names: Sequence[str],
        values: Sequence[Any],
        launcher: Callable[..., Any],
        call: tuple[Any, ...],
    ) -> Any:
        try:
            entry = monitor.watch(kernel, tuple(names), values, grid, device, stream)
        except CrossDeviceLaunchError:
            raise
        except Exception as exc:
            monitor.problem(f"a launch could not be recorded: {type(exc).__name__}: {exc}")
            return launcher(*call)
        job = prints.before(kernel, entry, tuple(names), values, sys._getframe(1), lean=True)
        try:
            result = launcher(*call)
        except BaseException as exc:
            monitor.ended(entry, exc)
            raise
        if entry[R.FLAGGED]:
            monitor.ended(entry, None)
        if job is not None:
            prints.after(job)
        return result

    return observe


__all__ = ["CHUNK", "MAX_PENDING", "Fingerprints", "interpreter_wrapper", "jit_wrapper", "lean_observer"]
