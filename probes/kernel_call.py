"""The kernel under test, watched at every call (child side; imports triton lazily).

``watch(ctx, kernel)`` returns a callable with the kernel's signature that records, on the
probe's context, what a report needs to tell apart outcomes that look alike:

* ``kernel_launches``: Triton kernel launches during the call (``JITFunction.run`` and the
  interpreter's ``InterpretedFunction.run``, warm-ups not counted; autotuner benchmark runs
  are launches too). None where Triton cannot be hooked.
* when the call raises: the exception (``ProbeContext.call_error``: the worker records
  ``raised_in_call`` when it is the one that ended the probe), ``raised_in`` (where the exception was raised: "kernel" for the kernel's
  own Python code, its wrapper; "triton" or "torch" inside those libraries; "doctor" in the
  probe's own code), ``raise_site`` (file:line) and ``raise_source`` (that line's text, which
  names the refused input for a bare ``assert x.is_contiguous()``); when torch or Triton raised,
  ``kernel_site`` / ``kernel_source``: the kernel's own line that called them. An exception out of the call
  with no launch before it, the same kernel passing the baseline cell, is a contract refusal
  (the cell is ``rejected``, ``diagnose/blind_spots.py``), never a fault.
* ``returned``: the type of what the call returned when it is not a tensor (``NoneType``), so
  the report says "returned None" instead of a relative error of NaN.
* ``autotuned_launches`` / ``autotune_benchmarked`` / ``autotune_configs``: what the kernel's
  autotuners did (``probes/autotune.py``).
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from qmoe_doctor.probes import autotune
from qmoe_doctor.probes.context import ProbeContext

KernelFn = Callable[..., Any]

#: Where a frame's file lives, by package folder: the first match names it.
_PROBES_DIR = os.path.dirname(os.path.abspath(__file__))


class _Launches:
    """Counts Triton launches while a watched call runs (class-level wrappers, installed once)."""

    count = 0
    active = 0
    hooked = False

    @classmethod
    def install(cls) -> None:
        if cls.hooked:
            return
        targets: list[Any] = []
        with contextlib.suppress(ImportError):
            from triton.runtime.jit import JITFunction

            targets.append(JITFunction)
        with contextlib.suppress(ImportError):
            from triton.runtime.interpreter import InterpretedFunction

            targets.append(InterpretedFunction)
        for owner in targets:
            owner.run = cls._wrap(owner.run)
        cls.hooked = bool(targets)

    @classmethod
    def _wrap(cls, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if cls.active and not kwargs.get("warmup"):
                cls.count += 1
            return original(self, *args, **kwargs)

        return run

    @classmethod
    @contextlib.contextmanager
    def counting(cls) -> Iterator[None]:
        cls.active += 1
        try:
            yield
        finally:
            cls.active -= 1


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) if path else None


#: The named controls the loader itself provides (``torch:grouped_mm``): their body is the kernel
#: under test, not the doctor's probe code, although it lives in probes/loader.py.
_CONTROL_CODE = frozenset({"torch_grouped_mm"})


def _frame_origin(tb: TracebackType) -> str:
    """Whose code a traceback entry runs: "triton", "torch", "doctor" or "kernel"."""
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    for name in ("triton", "torch"):
        root = _package_dir(name)
        if root and filename.startswith(root + os.sep):
            return name
    if filename.startswith(_PROBES_DIR + os.sep) and tb.tb_frame.f_code.co_name not in _CONTROL_CODE:
        return "doctor"
    return "kernel"


def _site(tb: TracebackType) -> tuple[str, str | None]:
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    source = linecache.getline(filename, tb.tb_lineno).strip() or None
    return f"{os.path.basename(filename)}:{tb.tb_lineno}", source


def raise_origin(exc: BaseException) -> tuple[str, str | None, str | None]:
    """(where, "file:line", source line) of the frame that raised ``exc``: where is "kernel",
    "triton", "torch" or "doctor" (see the module docstring)."""
    tb = exc.__traceback__
    if tb is None:
        return "kernel", None, None
    while tb.tb_next is not None:
        tb = tb.tb_next
    site, source = _site(tb)
    return _frame_origin(tb), site, source


def kernel_frame(exc: BaseException) -> tuple[str, str | None] | None:
    """("file:line", source line) of the deepest frame of the kernel's own code that ``exc``
    passed through (the user's line that called into torch or Triton), or None."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        if _frame_origin(tb) == "kernel":
            found = tb
        tb = tb.tb_next
    return _site(found) if found is not None else None


def watch(ctx: ProbeContext, kernel: KernelFn) -> KernelFn:
    """``kernel`` with every call watched (see the module docstring). The facts describe the
    latest call."""
    _Launches.install()

    @functools.wraps(kernel)
    def call(*args: Any, **kwargs: Any) -> Any:
        before = _Launches.count
        try:
            with autotune.record() as tuned, _Launches.counting():
                y = kernel(*args, **kwargs)
        except BaseException as exc:
            ctx.call_error = exc
            where, site, source = raise_origin(exc)
            ctx.fact("raised_in", where)
            ctx.fact("raise_site", site)
            ctx.fact("raise_source", source)
            own = kernel_frame(exc)
            if own is not None and own[0] != site:  # torch or Triton raised, called from this line
                ctx.fact("kernel_site", own[0])
                ctx.fact("kernel_source", own[1])
            ctx.fact("kernel_launches", _Launches.count - before if _Launches.hooked else None)
            raise
        ctx.fact("kernel_launches", _Launches.count - before if _Launches.hooked else None)
        if tuned.calls:
            ctx.fact("autotuned_launches", tuned.calls)
            ctx.fact("autotune_benchmarked", tuned.benchmarked > 0)
            ctx.fact("autotune_configs", sorted(set(tuned.configs)))
        if not _is_tensor(y):
            ctx.fact("returned", type(y).__name__)
        return y

    return call


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


__all__ = ["KernelFn", "kernel_frame", "raise_origin", "watch"]
