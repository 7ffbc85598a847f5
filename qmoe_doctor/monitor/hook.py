"""The two launch paths the monitor patches, and why these two (docs/run.md, per version).

* ``triton.runtime.jit.JITFunction.run(self, *args, grid, warmup, **kwargs)``: every compiled
  launch goes through it, on triton 3.4, 3.5, 3.6 and 3.9 alike: ``kernel[grid](...)``
  (``KernelInterface.__getitem__`` calls ``self.run``), ``Autotuner.run`` and ``Heuristics.run``
  (they call ``self.fn.run`` of the function they wrap, its benchmark launches included). It is
  patched on the class, so functions decorated before the monitor attached are seen too.
  Triton's own hooks were measured and set aside: ``knobs.runtime.launch_enter_hook`` sees no
  tensor argument unless the kernel has a ``launch_metadata`` callback, and
  ``add_pre_run_hook`` is per function (every function would need it) and sees no grid.
* ``triton.runtime.interpreter.GridExecutor.__call__(self, *args, **kwargs)`` under
  ``TRITON_INTERPRET=1``: on 3.4 and 3.5 ``InterpretedFunction.__getitem__`` builds a
  ``GridExecutor`` directly and ``run`` is a closure set per instance (no class method to
  patch); on 3.6+ ``run`` is a method that builds one. The executor is the one place every
  interpreted launch passes on all of them.

Launches through PyTorch's static launcher (``torch.compile``'s Inductor kernels) bypass both:
the monitor does not see them.

The wrappers never change what Triton does: the monitor's own failures are noted in its record
and the launch goes on; only ``--strict`` raises (``CrossDeviceLaunchError``), before the launch.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from qmoe_doctor.core.launches import HookPoint
from qmoe_doctor.monitor import ring as R
from qmoe_doctor.monitor.session import CrossDeviceLaunchError, Monitor

#: Set on our wrappers: a second attach leaves the first in place.
MARK = "__qmoe_doctor_monitor__"


class GridSpy:
    """A grid function that keeps the grid Triton computes from it in the launch's entry."""

    __slots__ = ("entry", "fn")

    def __init__(self, fn: Callable[[Any], Any], entry: R.Entry) -> None:
        self.fn = fn
        self.entry = entry

    def __call__(self, meta: Any) -> Any:
        grid = self.fn(meta)
        self.entry[R.GRID] = grid
        return grid


def _watched(
    monitor: Monitor,
    key: object,
    fn: object,
    arg_names: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grid: Any,
    device: int | None,
    stream: int | None,
    go: Callable[[Any], Any],
) -> Any:
    """Record a launch, make it (``go(grid)``: the grid a GridSpy when it is a function), record
    how it ended. Only --strict's stop leaves the monitor; its own failures are noted."""
    try:
        entry: R.Entry | None = monitor.launch(key, fn, arg_names, args, kwargs, grid, device, stream)
    except CrossDeviceLaunchError:
        raise
    except Exception as exc:  # the monitor never breaks the program
        monitor.problem(f"a launch could not be recorded: {type(exc).__name__}: {exc}")
        entry = None
    if entry is not None and callable(grid):
        if isinstance(grid, GridSpy):  # an executor called again
            grid.entry = entry
        else:
            grid = GridSpy(grid, entry)
    try:
        result = go(grid)
    except BaseException as exc:
        _after(monitor, entry, exc)
        raise
    _after(monitor, entry, None)
    return result


def _after(monitor: Monitor, entry: R.Entry | None, exc: BaseException | None) -> None:
    if entry is None:
        return
    try:
        if exc is not None:
            monitor.raised(entry, exc)
        elif entry[R.FLAGGED]:
            monitor.launched(entry)
    except Exception as err:
        monitor.problem(f"a launch's end could not be recorded: {type(err).__name__}: {err}")


def patch_jit(module: ModuleType, monitor: Monitor) -> bool:
    """Wrap ``JITFunction.run`` of ``triton.runtime.jit``; False when it is not there."""
    cls = getattr(module, "JITFunction", None)
    original = getattr(cls, "run", None)
    if cls is None or original is None:
        monitor.problem("triton.runtime.jit has no JITFunction.run: launches are not monitored")
        return False
    if getattr(original, MARK, False):
        return True
    driver = getattr(module, "driver", None)

    def current() -> tuple[int | None, int | None]:
        try:
            active = driver.active  # type: ignore[union-attr]
            device = int(active.get_current_device())
            return device, int(active.get_current_stream(device))
        except Exception:
            return None, None

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        device, stream = current()
        return _watched(
            monitor, self, self.fn, self.arg_names, args, kwargs, grid, device, stream,
            lambda g: original(self, *args, grid=g, warmup=warmup, **kwargs),
        )

    setattr(run, MARK, True)
    run.__wrapped__ = original  # type: ignore[attr-defined]
    run.__doc__ = original.__doc__
    cls.run = run
    monitor.hooks.append(HookPoint.JIT_RUN)
    return True


def patch_interpreter(module: ModuleType, monitor: Monitor) -> bool:
    """Wrap ``GridExecutor.__call__`` of ``triton.runtime.interpreter``."""
    cls = getattr(module, "GridExecutor", None)
    original = vars(cls).get("__call__") if cls is not None else None
    if cls is None or original is None:
        monitor.problem("triton.runtime.interpreter has no GridExecutor: interpreted launches are not monitored")
        return False
    if getattr(original, MARK, False):
        return True

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("warmup"):
            return original(self, *args, **kwargs)

        def go(grid: Any) -> Any:
            self.grid = grid
            return original(self, *args, **kwargs)

        return _watched(monitor, self.fn, self.fn, self.arg_names, args, kwargs, self.grid, None, None, go)

    setattr(call, MARK, True)
    call.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__call__ = call
    monitor.hooks.append(HookPoint.INTERPRETER)
    return True


#: Module name -> its patch.
PATCHES: dict[str, Callable[[ModuleType, Monitor], bool]] = {
    "triton.runtime.jit": patch_jit,
    "triton.runtime.interpreter": patch_interpreter,
}

__all__ = ["MARK", "PATCHES", "GridSpy", "patch_interpreter", "patch_jit"]
