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

Where the compiled kernel's launcher has the layout this module knows (the ``CudaLauncher`` of
Triton 3.6, validated on GPUs, and of 3.5, whose Python side is the same by its source; 3.7 and
later differ and keep their own: :func:`_launcher_parts`), a lean call goes one step further
and calls the C launcher under it directly (:class:`_Direct`). Triton's Python launcher encodes
every tensor descriptor's ``CUtensorMap`` again on each call and re-packs the argument list
around it: 4-5 of the 14-17 us a forward launch took through it on two H200 hosts (2026-11-29,
``tools/profile/host_overhead.py``). A plan hands its
descriptors to the :class:`Launch` as templates (shape, strides, block: fixed by the plan) and
each call passes the descriptor's tensor; the direct call keeps each descriptor's encoding per
base address (an encoding is a pure function of the address and the template, so a kept one is
exact) and hands the C launcher the arguments Triton's wrapper would have built (a launch
observer is handed that direct launch). A launcher of any other layout, or one that needs a
scratch buffer: the compiled kernel's own ``run``, with each template over its tensor
(:func:`rebase`).
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
    direct: int = 0  # of the lean ones, straight to the C launcher under it (_Direct)
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


#: The positional arguments Triton 3.6's C launcher takes before the kernel's own (grid x, y, z,
#: stream, function, cooperative, PDL, global and profile scratch, packed metadata, launch
#: metadata, enter and exit hook): its ``_BASE_ARGS_FORMAT``, which :func:`_launcher_parts`
#: checks before it trusts the layout.
_C_BASE_FORMAT = "iiiKKppOOOOOO"
#: Encodings kept per descriptor argument of a launch (one per base address); past this many
#: they start over, so a plan that sees ever new activations keeps a bounded few.
DESCRIPTOR_ENCODINGS_KEPT = 16


@dataclasses.dataclass(frozen=True, slots=True)
class _LauncherParts:
    """What :class:`_Direct` needs of a compiled kernel's launcher."""

    c_launch: Any  # the C function: (*base arguments, *kernel arguments, descriptors expanded)
    cooperative: bool
    pdl: bool
    descriptor_meta: dict[int, Any]  # kernel-argument position of each tensor descriptor: its metadata
    encode: Any  # (descriptor, metadata) -> [CUtensorMap, *shape, *strides]


def _launcher_parts(compiled: Any, n_args: int) -> _LauncherParts | None:
    """The C launcher under ``compiled.run`` and what its Python wrapper adds, where the layout
    is the one this module knows (Triton 3.6: a ``CudaLauncher`` whose ``launch`` is the C
    function, or a closure named ``inner`` over it that expands each descriptor argument with
    ``make_tensordesc_arg(arg, metadata)``), no scratch buffer is needed, the signature has one
    entry per argument and every descriptor has its TMA metadata; else None (the compiled
    kernel's ``run`` is called as it is)."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except (ImportError, RuntimeError):
        return None
    run: Any = getattr(compiled, "run", None)
    if type(run).__name__ != "CudaLauncher" or getattr(nvidia, "_BASE_ARGS_FORMAT", None) != _C_BASE_FORMAT:
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    encode = getattr(nvidia, "make_tensordesc_arg", None)
    code = getattr(encode, "__code__", None)
    if code is None or code.co_argcount != 2:
        return None
    wrapper: Any = getattr(run, "launch", None)
    inner = getattr(wrapper, "__code__", None)
    if inner is None:  # no descriptor argument: ``launch`` is the C function itself
        c_launch = wrapper
    elif inner.co_name == "inner" and inner.co_freevars == ("launcher", "tensordesc_indices", "tensordesc_meta"):
        c_launch = wrapper.__closure__[0].cell_contents
    else:
        return None
    signature = list(getattr(getattr(compiled, "src", None), "signature", {}).values())
    if not callable(c_launch) or len(signature) != n_args:
        return None
    slots = [i for i, ty in enumerate(signature) if isinstance(ty, str) and ty.startswith("tensordesc")]
    meta = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None) or []
    if len(meta) != len(slots) or (slots and inner is None):
        return None
    if not all(isinstance(m, dict) and not m.get("fp4_padded") for m in meta):
        return None  # Triton's own decomposition (no TMA metadata), or a shape it widens
    return _LauncherParts(
        c_launch=c_launch, cooperative=bool(run.launch_cooperative_grid), pdl=bool(run.launch_pdl),
        descriptor_meta=dict(zip(slots, meta, strict=True)), encode=encode,
    )  # fmt: skip


class _Direct:
    """One plan's kernel launched through the C launcher under Triton's Python one, with the
    arguments Triton's wrapper would build: every fixed argument in place, each tensor as its
    address, each descriptor expanded to its ``CUtensorMap``, shape and strides (the shape and
    strides are the plan's; the encoding is kept per base address)."""

    __slots__ = ("_args", "_base", "_c_launch", "_encode", "_fills")

    def __init__(self, parts: _LauncherParts, compiled: Any, launch: Launch) -> None:
        self._c_launch = parts.c_launch
        self._encode = parts.encode
        # after the grid and the stream: function, cooperative, PDL, no scratch, packed
        # metadata, no launch metadata, no hooks (a hook keeps the plan off the lean path)
        self._base = (compiled.function, parts.cooperative, parts.pdl, None, None, compiled.packed_metadata, None, None, None)
        templates = dict(zip(launch._slots, launch._descriptors, strict=True))
        expanded: list[Any] = []
        position: dict[int, int] = {}
        for i, value in enumerate(launch._template):
            position[i] = len(expanded)
            template = templates.get(i)
            if (template is not None) != (i in parts.descriptor_meta):
                raise TypeError(f"argument {i}: a descriptor for the kernel and the plan disagree")
            expanded.extend([None, *template.shape, *template.strides] if template is not None else [value])
        self._args = expanded
        # per tensor argument, in call order: (position, descriptor template or None, its metadata, kept encodings)
        self._fills: tuple[tuple[int, Any, Any, dict[int, Any]], ...] = tuple(
            (position[slot], templates.get(slot), parts.descriptor_meta.get(slot), {}) for slot in launch._slots
        )

    def __call__(self, grid: tuple[int, int, int], stream: Any, tensors: tuple[Any, ...]) -> None:
        args = self._args.copy()
        for (at, template, meta, kept), value in zip(self._fills, tensors, strict=True):
            if template is None:  # the address, as Triton's launcher would take it from data_ptr()
                args[at] = value.data_ptr() if isinstance(value, torch.Tensor) else value
                continue
            address = value.data_ptr()
            encoded = kept.get(address)
            if encoded is None:
                if len(kept) >= DESCRIPTOR_ENCODINGS_KEPT:
                    kept.clear()
                encoded = kept[address] = self._encode(rebase(template, value), meta)[0]
            args[at] = encoded
        self._c_launch(*grid, stream, *self._base, *args)


class Launch:
    """``kernel[grid](**args, **options)`` with the names in ``tensors`` filled per call
    (``grid``: programs, or a tuple of up to three dimensions).

    ``args`` holds every other parameter of the kernel by name (scalars, constexprs, None for
    an absent optional descriptor); ``options`` the launch options (num_warps, num_stages).
    ``descriptors`` maps a tensor parameter that takes a tensor descriptor to its template (a
    descriptor made at plan time, without its tensor: :func:`rebase`); a call passes the
    descriptor's tensor there and the launch puts it in the template.
    ``device_index`` is the device the plan is for (-1: CPU tensors under the interpreter);
    every call launches with that device current (inside its guard when another device is
    current), on that device's current stream (the compiled kernel is loaded on that device)."""

    __slots__ = (
        "_compiled", "_descriptors", "_device", "_direct", "_lean", "_names", "_options", "_slots", "_template",
        "_tensor_names", "grid", "kernel",
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
        descriptors: Mapping[str, Any] | None = None,
    ) -> None:
        names: list[str] = list(kernel.arg_names)
        descriptors = descriptors or {}
        unknown = (set(args) | set(tensors) | set(descriptors)) - set(names)
        missing = set(names) - set(args) - set(tensors)
        loose = set(descriptors) - set(tensors)  # a descriptor's tensor comes with each call
        if unknown or missing or loose:
            raise TypeError(
                f"launch of {getattr(kernel, '__name__', kernel)}: unknown arguments {sorted(unknown)}, "
                f"missing {sorted(missing)}" + (f", descriptors not among the tensors {sorted(loose)}" if loose else "")
            )
        self.kernel = kernel
        dims = (grid,) if isinstance(grid, int) else tuple(grid)
        self.grid: tuple[int, int, int] = (dims[0], dims[1] if len(dims) > 1 else 1, dims[2] if len(dims) > 2 else 1)
        self._names = names
        self._template = [args.get(name) for name in names]
        self._slots = tuple(names.index(name) for name in tensors)
        self._descriptors = tuple(descriptors.get(name) for name in tensors)  # None: a plain tensor
        self._tensor_names = tuple(tensors)  # what a launch observer is told the tensors are
        # an option that is also a parameter (a Gluon kernel's num_warps) goes in once, by name
        self._options = {key: value for key, value in options.items() if key not in names}
        self._compiled: Any = None
        self._direct: _Direct | None = None
        self._device = device_index  # -1: CPU tensors (the interpreter)
        self._lean = device_index >= 0 and lean_launch_enabled() and _plain_triton_run() and _Runtime.load()

    def __call__(self, *tensors: Any) -> None:
        if self._device < 0 or _current_device() == self._device:
            # CPU tensors, or the plan's device is current (checked just above): no guard to enter
            self._launch(tensors)  # qmoe-doctor: ignore[unguarded-launch]
        else:
            with _device_guard(self._device):
                self._launch(tensors)

    def _launch(self, tensors: tuple[Any, ...]) -> None:
        """The launch itself, with the plan's device current."""
        compiled = self._compiled
        if compiled is not None and _Runtime.hooks_idle():
            stream = _Runtime.stream(self._device)
            direct = self._direct
            launcher: Any
            if direct is not None:
                launcher, call = direct, (self.grid, stream, tensors)
            else:
                args = self._arguments(tensors)
                launcher = compiled.run
                call = (*self.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
            observer = launch_observer.observer
            try:
                if observer is None:
                    launcher(*call)
                else:  # qmoe-doctor run's monitor: it records, checks and makes the launch
                    observer(self.kernel, self.grid, self._device, stream, self._tensor_names, tensors, launcher, call)
            except TypeError as exc:  # a launcher parses its arguments before it launches
                name = getattr(self.kernel, "__name__", self.kernel)
                if direct is not None:  # this call and the later ones: the compiled kernel's run
                    self._direct = None
                    counts.refused.append(f"{name} (direct): {exc}")
                    self._launch(tensors)
                    return
                self._compiled, self._lean = None, False
                counts.refused.append(f"{name}: {exc}")
            else:
                counts.lean += 1
                counts.direct += direct is not None
                return
        args = self._arguments(tensors)
        # by name, as a plain launch: a parameter that is also an option (num_warps) serves both
        result = self.kernel[self.grid](**dict(zip(self._names, args, strict=True)), **self._options)
        counts.standard += 1
        if self._lean and compiled is None and _compiled_usable(result, self.kernel, len(args)):
            self._compiled = result
            parts = _launcher_parts(result, len(args))
            try:
                self._direct = _Direct(parts, result, self) if parts is not None else None
            except TypeError as exc:
                counts.refused.append(f"{getattr(self.kernel, '__name__', self.kernel)} (direct): {exc}")

    def _arguments(self, tensors: tuple[Any, ...]) -> list[Any]:
        """Every argument in the kernel's order: the fixed ones, this call's tensors, each
        descriptor template over its tensor."""
        args = self._template.copy()
        for slot, template, value in zip(self._slots, self._descriptors, tensors, strict=True):
            args[slot] = value if template is None else rebase(template, value)
        return args

    @property
    def lean(self) -> bool:
        """Whether later calls take the compiled kernel's launcher."""
        return self._compiled is not None

    @property
    def direct(self) -> bool:
        """Whether later calls go straight to the C launcher under it."""
        return self._direct is not None


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
