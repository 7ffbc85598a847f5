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

* Our own kernels' lean launch path (``kernels/launch.py``) calls a plan's compiled launcher
  directly after its first launch, past ``JITFunction.run``: ``patch_jit`` puts
  ``Monitor.observe`` in ``core.launch_observer`` and the lean path hands it every such launch
  (it would otherwise step aside for a wrapped ``run`` and pay Triton's full path again).

Launches through PyTorch's static launcher (``torch.compile``'s Inductor kernels) bypass both:
the monitor does not see them.

In a compare pass (``run --compare``, ``Monitor.prints`` set) the three are replaced by those of
``monitor/fingerprint.py``, which do the same and read each launch's tensors before and after it;
a plain run never loads that module.

The wrappers never change what Triton does: the monitor's own failures are noted in its record
and the launch goes on; only ``--strict`` raises (``CrossDeviceLaunchError``), before the launch.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from qmoe_doctor.core import launch_observer
from qmoe_doctor.core.launches import HookPoint
from qmoe_doctor.monitor import ring as R
from qmoe_doctor.monitor.session import CrossDeviceLaunchError, Monitor

#: Set on our wrappers: a second attach leaves the first in place, and our kernels' lean launch
#: path knows the wrapper (it hands its launches to the monitor's observer instead of stepping
#: aside).
MARK = launch_observer.WRAPPER_MARK


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


def _spied(grid: Any, entry: R.Entry) -> Any:
    if isinstance(grid, GridSpy):  # an executor called again
        grid.entry = entry
        return grid
    return GridSpy(grid, entry)


# The three launch paths (this wrapper, the interpreter's, ``Monitor.observe`` for our lean
# launches) each spell out "record, launch, follow to the end" rather than share a helper: a
# shared ``follow(entry, launch, *args, **kwargs)`` measured 0.3-0.5 us more per launch
# (``benchmarks/monitor_hot_path.py``, CPU, 2026-11-25), on the path every launch takes.


def patch_jit(module: ModuleType, monitor: Monitor) -> bool:
    """Wrap ``JITFunction.run`` of ``triton.runtime.jit`` and put the monitor's observer in
    ``core.launch_observer`` (our kernels' lean launches); False when ``run`` is not there."""
    cls = getattr(module, "JITFunction", None)
    original = getattr(cls, "run", None)
    if cls is None or original is None:
        monitor.problem("triton.runtime.jit has no JITFunction.run: launches are not monitored")
        return False
    if getattr(original, MARK, False):
        return True
    driver = getattr(module, "driver", None)
    if monitor.prints is not None:  # a compare pass: the same, with each launch's tensors read
        from qmoe_doctor.monitor import fingerprint

        return _install_jit(cls, original, fingerprint.jit_wrapper(original, monitor, driver, _spied), monitor,
                            fingerprint.lean_observer(monitor))  # fmt: skip

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        try:
            active = driver.active  # type: ignore[union-attr]
            gpu: int | None = active.get_current_device()
            stream: int | None = active.get_current_stream(gpu)
        except Exception:  # no driver: Triton's own call says why
            gpu = stream = None
        try:
            if kwargs:
                entry = monitor.watch(self, tuple(kwargs), (*args, *kwargs.values()), grid, gpu, stream)
            else:
                entry = monitor.watch(self, (), args, grid, gpu, stream)
        except CrossDeviceLaunchError:
            raise
        except Exception as exc:  # the monitor never breaks the program
            monitor.problem(f"a launch could not be recorded: {type(exc).__name__}: {exc}")
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        if callable(grid):
            grid = _spied(grid, entry)
        try:
            result = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        except BaseException as exc:
            monitor.ended(entry, exc)
            raise
        if entry[R.FLAGGED]:
            monitor.ended(entry, None)
        return result

    return _install_jit(cls, original, run, monitor, monitor.observe)


def _install_jit(
    cls: Any, original: Callable[..., Any], run: Callable[..., Any], monitor: Monitor, observer: Any
) -> bool:
    setattr(run, MARK, True)
    run.__wrapped__ = original  # type: ignore[attr-defined]
    run.__doc__ = original.__doc__
    cls.run = run
    launch_observer.install(observer)
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
    if monitor.prints is not None:  # a compare pass
        from qmoe_doctor.monitor import fingerprint

        return _install_interpreter(cls, original, fingerprint.interpreter_wrapper(original, monitor, _spied), monitor)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("warmup"):
            return original(self, *args, **kwargs)
        try:
            entry = monitor.launch(self.fn, args, kwargs, self.grid, None, None, fn=self.fn, arg_names=self.arg_names)
        except CrossDeviceLaunchError:
            raise
        except Exception as exc:  # the monitor never breaks the program
            monitor.problem(f"a launch could not be recorded: {type(exc).__name__}: {exc}")
            return original(self, *args, **kwargs)
        if callable(self.grid):
            self.grid = _spied(self.grid, entry)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            monitor.ended(entry, exc)
            raise
        if entry[R.FLAGGED]:
            monitor.ended(entry, None)
        return result

    return _install_interpreter(cls, original, call, monitor)


def _install_interpreter(cls: Any, original: Callable[..., Any], call: Callable[..., Any], monitor: Monitor) -> bool:
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
