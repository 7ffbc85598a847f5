"""One kernel launch with everything but its tensors fixed, and the lean way to repeat it.

A grouped GEMM of a few hundred tokens takes about as long on the GPU as Python takes to issue
it through Triton's ``JITFunction.run``: binding and specialising every argument, the cache
key (``str(options)`` included), launch metadata; about 50 of the 70 us a forward call cost on
an H200 host (``tools/profile/host_overhead.py``, 2026-11-22), against ~20 us for
``torch._grouped_mm``. An eager MoE block issues many such calls and was host-bound.

A :class:`Launch` is made once per launch plan of the callers (``grouped_gemm``, ``backward``,
``dw_overlap``, ``combine``): one kernel, one grid, every scalar and constexpr argument fixed,
the tensor arguments named. Its first call goes through ``kernel[grid](...)`` like any launch
(compile, specialise) and keeps the ``CompiledKernel`` Triton returns; later calls hand the
arguments to that compiled kernel's launcher directly (what ``CompiledKernel[grid](...)``
does, without its launch metadata when no hook listens).

That is right only while a later call would specialise the same way: the plan key of every
caller holds each value Triton specialises on (the integer arguments, the 16-byte alignment of
each pointer, the dtypes, the device). And only while nothing else watches the launches: with a
launch hook installed (``triton.knobs.runtime.launch_enter_hook``: profilers), a per-function
pre-run hook, a wrapped ``JITFunction.run``, under the interpreter, or with
``QMOE_DOCTOR_LEAN_LAUNCH=0``, every call goes through ``kernel[grid]``. qmoe-doctor's own launch
monitor (``qmoe-doctor run``) is the exception: it wraps ``JITFunction.run`` *and* puts an
observer in ``core.launch_observer``, to which every lean call hands its launch (kernel, grid,
device, stream, the tensor arguments), so the monitor sees and checks it and the lean path
stays on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qmoe_doctor.core import knobs, launch_observer

__all__ = ["Launch", "LaunchCounts", "counts", "lean_launch_enabled", "rebase"]


@dataclasses.dataclass(slots=True)
class LaunchCounts:
    """Launches by path since the process started (tests and tools read them)."""

    standard: int = 0  # through JITFunction.run (first call of a plan, hooks, interpreter)
    lean: int = 0  # through the compiled kernel's launcher
    #: launchers that refused the lean call's arguments (a Triton whose launcher API moved):
    #: that plan went back to JITFunction.run for good
    refused: list[str] = dataclasses.field(default_factory=list)


counts = LaunchCounts()


def lean_launch_enabled() -> bool:
    """False under the interpreter or with ``QMOE_DOCTOR_LEAN_LAUNCH=0`` (read per plan)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return knobs.lean_launch()  # ValueError for a value other than 0 or 1, naming it


def _plain_triton_run() -> bool:
    """Whether the lean path may skip ``JITFunction.run``: it is Triton's own, or qmoe-doctor's
    launch monitor's wrapper with the monitor's observer in ``core.launch_observer`` (lean
    launches are handed to it). Any other wrapper (a profiler's) must see every launch, so the
    lean path steps aside."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    run = JITFunction.run
    if getattr(run, launch_observer.WRAPPER_MARK, False):
        return launch_observer.observer is not None
    return getattr(run, "__module__", "") == "triton.runtime.jit" and not hasattr(run, "__wrapped__")


def _idle(hook: Any) -> bool:
    """A launch hook slot with nothing in it: None (Triton <= 3.4) or an empty HookChain."""
    if hook is None:
        return True
    calls = getattr(hook, "calls", None)
    return isinstance(calls, list) and not calls


class _Runtime:
    """Triton's launch hooks and the current-stream function, looked up once."""

    knobs: Any = None
    stream: Any = None
    ready = False

    @classmethod
    def load(cls) -> bool:
        if not cls.ready:
            try:
                import triton
                from triton import knobs

                cls.knobs = knobs.runtime
                cls.stream = triton.runtime.driver.active.get_current_stream
            except (ImportError, AttributeError, RuntimeError):
                cls.knobs = None
            cls.ready = True
        return cls.knobs is not None

    @classmethod
    def hooks_idle(cls) -> bool:
        rt = cls.knobs
        return _idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)


def _compiled_usable(compiled: Any, kernel: Any, n_args: int) -> bool:
    """A CompiledKernel whose launcher takes the arguments in ``kernel.arg_names`` order."""
    if compiled is None or getattr(kernel, "pre_run_hooks", None):
        return False
    if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
        return False
    fn = getattr(getattr(compiled, "src", None), "fn", None)
    names = getattr(fn, "arg_names", None)
    return names is None or len(names) == n_args


class Launch:
    """``kernel[grid](**args, **options)`` with the names in ``tensors`` filled per call
    (``grid``: programs, or a tuple of up to three dimensions).

    ``args`` holds every other parameter of the kernel by name (scalars, constexprs, None for
    an absent optional descriptor); ``options`` the launch options (num_warps, num_stages).
    ``device_index`` is the device the plan is for (-1: CPU tensors under the interpreter);
    every call launches with that device current (inside its guard when another device is
    current), on that device's current stream (the compiled kernel is loaded on that device)."""

    __slots__ = (
        "_compiled", "_device", "_lean", "_names", "_options", "_slots", "_template", "_tensor_names", "grid", "kernel",
    )  # fmt: skip

    def __init__(
        self,
        kernel: Any,
        grid: int | tuple[int, ...],
        args: Mapping[str, Any],
        tensors: Sequence[str],
        options: Mapping[str, int],
        *,
        device_index: int,
    ) -> None:
        names: list[str] = list(kernel.arg_names)
        unknown = (set(args) | set(tensors)) - set(names)
        missing = set(names) - set(args) - set(tensors)
        if unknown or missing:
            raise TypeError(
                f"launch of {getattr(kernel, '__name__', kernel)}: unknown arguments {sorted(unknown)}, "
                f"missing {sorted(missing)}"
            )
        self.kernel = kernel
        dims = (grid,) if isinstance(grid, int) else tuple(grid)
        self.grid: tuple[int, int, int] = (dims[0], dims[1] if len(dims) > 1 else 1, dims[2] if len(dims) > 2 else 1)
        self._names = names
        self._template = [args.get(name) for name in names]
        self._slots = tuple(names.index(name) for name in tensors)
        self._tensor_names = tuple(tensors)  # what a launch observer is told the tensors are
        # an option that is also a parameter (a Gluon kernel's num_warps) goes in once, by name
        self._options = {key: value for key, value in options.items() if key not in names}
        self._compiled: Any = None
        self._device = device_index  # -1: CPU tensors (the interpreter)
        self._lean = device_index >= 0 and lean_launch_enabled() and _plain_triton_run() and _Runtime.load()

    def __call__(self, *tensors: Any) -> None:
        args = self._template.copy()
        for slot, value in zip(self._slots, tensors, strict=True):
            args[slot] = value
        if self._device < 0 or _current_device() == self._device:
            # CPU tensors, or the plan's device is current (checked just above): no guard to enter
            self._launch(args, tensors)  # qmoe-doctor: ignore[unguarded-launch]
        else:
            with _device_guard(self._device):
                self._launch(args, tensors)

    def _launch(self, args: list[Any], tensors: tuple[Any, ...]) -> None:
        """The launch itself, with the plan's device current."""
        compiled = self._compiled
        if compiled is not None and _Runtime.hooks_idle():
            stream = _Runtime.stream(self._device)
            observer = launch_observer.observer
            call = (*self.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
            try:
                if observer is None:
                    compiled.run(*call)
                else:  # qmoe-doctor run's monitor: it records, checks and makes the launch
                    observer(self.kernel, self.grid, self._device, stream, self._tensor_names, tensors, compiled.run, call)
            except TypeError as exc:  # the launcher parses its arguments before it launches
                self._compiled, self._lean = None, False
                counts.refused.append(f"{getattr(self.kernel, '__name__', self.kernel)}: {exc}")
            else:
                counts.lean += 1
                return
        # by name, as a plain launch: a parameter that is also an option (num_warps) serves both
        result = self.kernel[self.grid](**dict(zip(self._names, args, strict=True)), **self._options)
        counts.standard += 1
        if self._lean and compiled is None and _compiled_usable(result, self.kernel, len(args)):
            self._compiled = result

    @property
    def lean(self) -> bool:
        """Whether later calls take the compiled kernel's launcher."""
        return self._compiled is not None


def _current_device() -> int:
    """The current CUDA device (a guard entered and left costs more than this look)."""
    return torch.cuda.current_device()


def _device_guard(index: int) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.device(index)``; nothing for CPU tensors (index -1, the interpreter)."""
    if index < 0:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def rebase(template: Any, base: Any) -> Any:
    """A copy of the tensor descriptor ``template`` over ``base`` (same shape, strides, dtype
    and 16-byte alignment, which the caller's plan key guarantees), without the validation of
    its constructor: the descriptor classes are plain dataclasses, so their fields copy."""
    try:
        desc = object.__new__(type(template))
        desc.__dict__.update(template.__dict__)
        desc.base = base
        return desc
    except (AttributeError, TypeError):  # a descriptor class with slots: the constructor
        return dataclasses.replace(template, base=base)
