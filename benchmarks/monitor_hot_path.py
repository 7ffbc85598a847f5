"""Host cost per launch of `qmoe-doctor run`'s launch monitor, on the CPU: a micro-benchmark.

    python3 -m benchmarks.monitor_hot_path                 # the table
    python3 -m benchmarks.monitor_hot_path --profile       # and cProfile's view of the hot path
    python3 -m benchmarks.monitor_hot_path --launches 20000 --repeats 7

The launch is a stand-in whose compiled launch does nothing, so what is timed is the launch
path around it: Triton's ``KernelInterface.__getitem__`` lambda calling ``JITFunction.run(self,
*args, grid, warmup, **kwargs)``, once as it is (``plain``) and once wrapped by the monitor
(``monitored``: ``qmoe_doctor.monitor.hook.patch_jit`` on a stand-in ``triton.runtime.jit``
module). ``cost`` is the difference per launch. The kernels take 4 or 7 tensors beside 11
scalars and constexprs, passed positionally (how users write ``kernel[grid](x, y, ...)``) or by
name (how ``kernels/launch.py`` makes a plan's first call). A third row per kernel is our lean
launch path under the monitor: ``kernels/launch.py`` hands a plan's later launches to the
observer in ``core.launch_observer`` with the tensors it already holds; ``plain`` there calls
the compiled launcher directly.

The tensors are CPU tensors standing in for GPU ones. The stand-in driver says the current
device is -1, the index a CPU tensor reports (``Tensor.get_device()``), so the monitor's device
checks run the path of a GPU launch whose tensors are all on the launch device: the steady state
of a healthy program. (A CPU tensor on a real GPU launch is a finding and takes the slow path.)

Rows: ``steady`` is every launch after a kernel's first ones (call sites sampled: the monitor
takes one for the first ``--call-sites`` launches of each kernel, then every
``SAMPLE_EVERY``-th); ``first launch`` is a kernel's first launch (describe it, lint the files
its launch came through, flush the record soon after); ``first launch, cold`` the first of the
process (nothing linted yet). ``flush`` is writing the record with a full ring (256 launches).
The ``compare pass`` rows are a ``run --compare`` pass's monitor (``monitor/fingerprint.py``):
each launch's tensors read before and after it (CPU tensors, so at once), and a kernel past its
``--compare-launches`` (counted, not read).

To compare with an earlier design, run this file against that commit's package (``git archive
COMMIT qmoe_doctor | tar -x -C DIR``, then ``PYTHONPATH=DIR python3 benchmarks/monitor_hot_path.py``
from outside the checkout): without ``core.launch_observer`` the lean rows are left out, and
``_stand_in`` gives a monitor that compares ``torch.device`` objects the stand-in device.

Timings are the best of ``--repeats`` rounds of ``--launches`` launches (the machine is shared);
they claim nothing about a GPU host, where Python runs slower: compare rows of one run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from qmoe_doctor.monitor import hook
from qmoe_doctor.monitor.session import Monitor, Settings

try:  # absent before the lean path handed its launches to the monitor: no lean rows then
    from qmoe_doctor.core import launch_observer
except ImportError:
    launch_observer = None  # type: ignore[assignment]
#: The stand-in launch device: the index CPU tensors report (see the module's docstring).
STAND_IN_DEVICE = -1
STREAM = 0x1234


def gemm_4(x_ptr, w_ptr, y_ptr, m_sizes_ptr, M, N, K, E, stride_xm, stride_wn, stride_ym, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K):  # type: ignore[no-untyped-def]  # noqa: E501, N803
    """Stands for a @triton.jit grouped GEMM: 4 tensors, 11 scalars and constexprs."""
    return x_ptr, w_ptr, y_ptr, m_sizes_ptr, M, N, K, E, stride_xm, stride_wn, stride_ym, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K


def gemm_7(x_ptr, w_ptr, y_ptr, m_sizes_ptr, bias_ptr, scale_ptr, gate_ptr, M, N, K, E, stride_xm, stride_wn, stride_ym, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K):  # type: ignore[no-untyped-def]  # noqa: E501, N803
    """Stands for a @triton.jit fused MoE kernel: 7 tensors, 11 scalars and constexprs."""
    return x_ptr, w_ptr, y_ptr, m_sizes_ptr, bias_ptr, scale_ptr, gate_ptr, M, N, K


SCALARS: dict[str, Any] = {
    "M": 2048, "N": 1536, "K": 2048, "E": 128, "stride_xm": 2048, "stride_wn": 2048, "stride_ym": 1536,
    "NUM_PROGRAMS": 132, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64,
}  # fmt: skip


class CompiledStandIn:
    """What ``JITFunction.run`` returns: a compiled kernel whose launcher does nothing."""

    function = None
    packed_metadata = None

    @staticmethod
    def run(*args: Any) -> None:
        return None


COMPILED = CompiledStandIn()


def jit_module() -> ModuleType:
    """A stand-in ``triton.runtime.jit``: ``JITFunction`` with Triton's ``run`` signature and
    ``__getitem__`` (the lambda Triton's ``KernelInterface`` returns), and a driver."""
    module = ModuleType("triton.runtime.jit")

    class JITFunction:
        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn
            self.arg_names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
            self.pre_run_hooks: list[Any] = []

        def run(self, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
            return COMPILED

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            return lambda *args, **kwargs: self.run(grid=grid, warmup=False, *args, **kwargs)  # noqa: B026

    class Driver:
        @staticmethod
        def get_current_device() -> int:
            return STAND_IN_DEVICE

        @staticmethod
        def get_current_stream(device: int) -> int:
            return STREAM

    class DriverConfig:  # triton.runtime.driver.driver: ``active`` is a property
        @property
        def active(self) -> Driver:
            return Driver()

    module.JITFunction = JITFunction  # type: ignore[attr-defined]
    module.driver = DriverConfig()  # type: ignore[attr-defined]
    return module


def operands(count: int) -> dict[str, torch.Tensor]:
    names = ["x_ptr", "w_ptr", "y_ptr", "m_sizes_ptr", "bias_ptr", "scale_ptr", "gate_ptr"][:count]
    return {name: torch.empty(16 + i, 8) for i, name in enumerate(names)}


def best_ns(fn: Callable[[int], None], launches: int, repeats: int) -> float:
    """Best of ``repeats`` rounds of ``fn(launches)``, per launch, in ns (gc off while timed)."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            fn(launches)
            best = min(best, (time.perf_counter_ns() - t0) / launches)
        finally:
            gc.enable()
    return best


def by_position(kernel: Any, tensors: dict[str, torch.Tensor]) -> Callable[[int], None]:
    args = (*tensors.values(), *SCALARS.values())
    launch = kernel[(132, 1, 1)]

    def go(n: int) -> None:
        for _ in range(n):
            launch(*args)

    return go


def by_name(kernel: Any, tensors: dict[str, torch.Tensor]) -> Callable[[int], None]:
    named = {**tensors, **SCALARS}
    grid = (132, 1, 1)

    def go(n: int) -> None:
        for _ in range(n):
            kernel[grid](**named, num_warps=8, num_stages=3)

    return go


def lean(kernel: Any, tensors: dict[str, torch.Tensor], *, observed: bool) -> Callable[[int], None]:
    """``kernels/launch.py``'s lean call: the launcher with the arguments in signature order,
    handed to the observer when one is installed (what ``Launch.__call__`` does)."""
    grid = (132, 1, 1)
    names = tuple(tensors)
    values = tuple(tensors.values())
    call = (*grid, STREAM, COMPILED.function, COMPILED.packed_metadata, None, None, None, *values, *SCALARS.values())
    run = COMPILED.run

    if not observed:

        def go(n: int) -> None:
            for _ in range(n):
                run(*call)

        return go

    def watched(n: int) -> None:
        for _ in range(n):
            observer = launch_observer.observer
            if observer is None:
                run(*call)
            else:
                observer(kernel, grid, STAND_IN_DEVICE, STREAM, names, values, run, call)

    return watched


def measure(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="qmoe-doctor-hot-path-") as folder:
        module = jit_module()
        monitor = Monitor(Settings(folder=folder, call_sites=args.call_sites), stderr=io.StringIO())
        _stand_in(monitor)
        kernels = {count: module.JITFunction(gemm_4 if count == 4 else gemm_7) for count in (4, 7)}
        tensors = {count: operands(count) for count in (4, 7)}
        plain: dict[str, float] = {}
        for count, kernel in kernels.items():
            plain[f"{count} positional"] = best_ns(by_position(kernel, tensors[count]), args.launches, args.repeats)
            plain[f"{count} by name"] = best_ns(by_name(kernel, tensors[count]), args.launches, args.repeats)
            plain[f"{count} lean"] = best_ns(lean(kernel, tensors[count], observed=False), args.launches, args.repeats)
        # the first launches of a kernel: the cold one first (nothing linted in this process)
        t0 = time.perf_counter_ns()
        hook.patch_jit(module, monitor)
        patched_ns = time.perf_counter_ns() - t0
        cold = _first_launch(module, monitor, tensors[7])
        firsts = [_first_launch(module, monitor, tensors[7]) for _ in range(20)]
        for count, kernel in kernels.items():
            for style, make in (("positional", by_position), ("by name", by_name)):
                go = make(kernel, tensors[count])
                go(args.call_sites + 1)  # past the first launches: the steady state
                label = f"{count} {style}"
                rows.append((f"steady, {count} tensors, {style}", plain[label], best_ns(go, args.launches, args.repeats)))
            if launch_observer is not None and launch_observer.observer is not None:
                go = lean(kernel, tensors[count], observed=True)
                label = f"{count} lean"
                rows.append((f"steady, {count} tensors, lean path", plain[label], best_ns(go, args.launches, args.repeats)))
        rows.append(("first launch of a kernel", plain["7 positional"], min(firsts)))
        rows.append(("first launch, cold (lint)", plain["7 positional"], cold))
        monitor_flush = _flush_ns(monitor)
        rows.append((f"flush, ring of {monitor.settings.ring}", 0.0, monitor_flush))
        rows.append(("patch (attach)", 0.0, patched_ns))
        if args.profile:
            _profile(kernels[7], tensors[7], args.launches)
        rows += _compare_rows(args, folder, tensors[7], plain["7 positional"])
    return rows


def _compare_rows(
    args: argparse.Namespace, folder: str, tensors: dict[str, torch.Tensor], plain_ns: float
) -> list[tuple[str, float, float]]:
    """A compare pass's monitor (``run --compare``): every launch's 7 tensors fingerprinted
    before and after it (CPU tensors: read at once), and a kernel past its printed launches (the
    steady state of a long run). A tenth of the launches: each print is kept until the flush."""
    try:
        monitor = Monitor(Settings(folder=folder, call_sites=args.call_sites, prints=10**9), stderr=io.StringIO())
    except TypeError:  # a package from before compare passes
        return []
    module = jit_module()
    hook.patch_jit(module, monitor)
    launches = max(1, args.launches // 10)
    printed = by_position(module.JITFunction(gemm_7), tensors)
    printed(args.call_sites + 1)
    rows = [("compare pass, 7 tensors, printed", plain_ns, best_ns(printed, launches, args.repeats))]
    monitor.prints.limit = 0  # type: ignore[union-attr]  # every later launch is past the limit
    past = by_position(module.JITFunction(gemm_7), tensors)
    past(args.call_sites + 1)
    rows.append(("compare pass, 7 tensors, past the limit", plain_ns, best_ns(past, args.launches, args.repeats)))
    if launch_observer is not None:
        launch_observer.install(None)
    return rows


def _stand_in(monitor: Monitor) -> None:
    """A monitor that compares ``torch.device`` objects (before ``get_device()``): the stand-in
    device is the CPU's."""
    devices = getattr(monitor, "_devices", None)
    if isinstance(devices, dict) and hasattr(monitor, "_launch_device"):
        devices[STAND_IN_DEVICE] = (torch.device("cpu"), f"cuda:{STAND_IN_DEVICE}")


def _first_launch(module: ModuleType, monitor: Monitor, tensors: dict[str, torch.Tensor]) -> float:
    kernel = module.JITFunction(gemm_7)  # a new kernel object: the monitor meets it first here
    args = (*tensors.values(), *SCALARS.values())
    t0 = time.perf_counter_ns()
    kernel[(132, 1, 1)](*args)
    return float(time.perf_counter_ns() - t0)


def _flush_ns(monitor: Monitor) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        monitor.flush()
        best = min(best, time.perf_counter_ns() - t0)
    return best


def _profile(kernel: Any, tensors: dict[str, torch.Tensor], launches: int) -> None:
    go = by_position(kernel, tensors)
    profiler = cProfile.Profile()
    profiler.enable()
    go(launches)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
    print(f"\ncProfile, {launches} steady launches, 7 tensors, positional (tottime first):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="monitor_hot_path", description="Host cost per launch of the launch monitor.")
    p.add_argument("--launches", type=int, default=20000, help="launches per timed round")
    p.add_argument("--repeats", type=int, default=5, help="rounds; the best is kept")
    p.add_argument("--call-sites", type=int, default=8, help="launches of each kernel with a call site")
    p.add_argument("--profile", action="store_true", help="print cProfile's view of the steady state")
    args = p.parse_args(argv)
    rows = measure(args)
    print(f"launch monitor hot path, CPU stand-in launches; python {sys.version.split()[0]}, torch {torch.__version__}")
    print(f"best of {args.repeats} rounds of {args.launches} launches; us per launch")
    print(f"{'case':<38}  {'plain us':>9}  {'monitored us':>12}  {'cost us':>8}")
    for label, plain_ns, watched_ns in rows:
        cost = watched_ns - plain_ns
        print(f"{label:<38}  {plain_ns / 1e3:>9.2f}  {watched_ns / 1e3:>12.2f}  {cost / 1e3:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
