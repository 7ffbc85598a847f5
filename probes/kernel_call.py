"""The kernel under test, watched at every call (child side; imports triton lazily).

``watch(ctx, kernel)`` returns a callable with the kernel's signature that records, on the
probe's context, what a report needs to tell apart outcomes that look alike:

* ``kernel_launches``: Triton kernel launches during the call (``JITFunction.run`` and the
  interpreter's ``InterpretedFunction.run``, warm-ups not counted; autotuner benchmark runs
  are launches too). None where Triton cannot be hooked.
* when the call raises: ``raised_in`` (where the exception was raised: "kernel" for the kernel's
  own Python code, its wrapper; "triton" or "torch" inside those libraries; "doctor" in the
  probe's own code), ``raise_site`` (file:line) and ``raise_source`` (that line's text, which
  names the refused input for a bare ``assert x.is_contiguous()``). A ValueError, TypeError or
  AssertionError raised in the kernel's own code with no launch before it is a contract refusal
  (the cell is ``rejected``, ``diagnose/matrix.py``), never a fault.
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


def raise_origin(exc: BaseException) -> tuple[str, str | None, str | None]:
    """(where, "file:line", source line) of the frame that raised ``exc``: where is "kernel",
    "triton", "torch" or "doctor" (see the module docstring)."""
    tb = exc.__traceback__
    if tb is None:
        return "kernel", None, None
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    line = tb.tb_lineno
    source = linecache.getline(filename, line).strip() or None
    where = "kernel"
    for name in ("triton", "torch"):
        root = _package_dir(name)
        if root and filename.startswith(root + os.sep):
            where = name
            break
    else:
        if filename.startswith(_PROBES_DIR + os.sep) and tb.tb_frame.f_code.co_name not in _CONTROL_CODE:
            where = "doctor"
    return where, f"{os.path.basename(filename)}:{line}", source


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
            where, site, source = raise_origin(exc)
            ctx.fact("raised_in", where)
            ctx.fact("raise_site", site)
            ctx.fact("raise_source", source)
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


__all__ = ["KernelFn", "raise_origin", "watch"]
