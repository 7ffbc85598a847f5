"""Host time per call of our grouped GEMMs against ``torch._grouped_mm`` (GPU), and where it goes.

    python3 tools/profile/host_overhead.py --tokens 128

Small batches are launch-bound: the GPU finishes a 128-token grouped GEMM about as fast as Python
issues the next. This times back-to-back calls on the host (no synchronization inside the loop;
the queue is drained before and after), per op: ours on the lean launch path (a cached launch
plan, the compiled kernel's launcher: ``kernels/launch.py``), ours through Triton's
``JITFunction.run`` (``QMOE_DOCTOR_LEAN_LAUNCH=0``), ``torch._grouped_mm``
(``benchmarks.side_by_side.measure_host``, which the per-card run reports against its 25 us
target); then the forward's and dw's steady-state path stage by stage (plan key, lookup, device
guard, output, descriptors, the launch alone), and a cProfile of the forward.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def _stages(title: str, stages: dict[str, Callable[[], Any]], calls: int) -> None:
    import torch

    from benchmarks.side_by_side import host_us

    print(title)
    for name, fn in stages.items():
        print(f"  {name:40} {host_us(fn, calls, torch.cuda.synchronize):7.1f} us/call")


def forward_stages(point: Any, calls: int) -> None:
    """The forward's steady-state path, one stage at a time."""
    import torch

    from qmoe_doctor.kernels import grouped_gemm as gg
    from qmoe_doctor.kernels.launch import _current_device

    x, w, sizes = point.x, point.w, point.m_sizes
    gg.moe_grouped_gemm(x, w, sizes)  # the plan
    plan = gg._gemm_plan(x, w, sizes, None, None, False)
    y = torch.empty((plan.m, plan.n), device=x.device, dtype=x.dtype)
    values = (x, w, y, sizes)
    args = [values[i] for i in plan.sources]
    launch = plan.launch
    assert launch is not None
    compiled = launch._compiled
    stream = torch.cuda.current_stream().cuda_stream

    def through_triton() -> None:  # what the lean path did before it went direct: Triton's Python launcher
        full = launch._arguments(tuple(args))
        compiled.run(*launch.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *full)

    def guard() -> None:
        with torch.cuda.device(plan.guard_index):
            pass

    stages: dict[str, Callable[[], Any]] = {
        "plan key (3 operands)": lambda: (gg._operand_key(x), gg._operand_key(w), gg._operand_key(sizes)),
        "plan lookup (key + dict)": lambda: gg._gemm_plan(x, w, sizes, None, None, False),
        "current-device check (the launch's)": _current_device,
        "device guard enter/exit (another device current)": guard,
        "x.new_empty (y)": lambda: x.new_empty((plan.m, plan.n)),
        f"launch alone ({plan.path}, lean: {launch.lean}, direct: {launch.direct})": lambda: launch(*args),
        "launch through Triton's launcher (descriptors built)": through_triton,
        "moe_grouped_gemm (whole call)": lambda: gg.moe_grouped_gemm(x, w, sizes),
    }
    _stages(f"forward steady-state path by stage (config {plan.config.name if plan.config else '-'}):", stages, calls)


def dw_stages(point: Any, calls: int) -> None:
    """The dw call's steady-state path, one stage at a time."""
    from qmoe_doctor.kernels import backward as bw

    dy, x, sizes = point.dy, point.x, point.m_sizes
    bw.moe_grouped_gemm_dw(dy, x, sizes)
    plan = bw._dw_plan(dy, x, sizes, None, None)
    bounds = bw._bounds_plan(sizes, plan.m)  # what a dw past FOLDED_MAX_EXPERTS launches first
    stages: dict[str, Callable[[], Any]] = {
        "plan lookup (key + dict)": lambda: bw._dw_plan(dy, x, sizes, None, None),
        "x.new_empty (dw)": lambda: x.new_empty((plan.e, plan.n, plan.k)),
        f"row bounds launch (allocation + launch; this call's plan: {'yes' if plan.bounds else 'no, folded'})": (
            lambda: bounds(sizes)
        ),
        "moe_grouped_gemm_dw (whole call)": lambda: bw.moe_grouped_gemm_dw(dy, x, sizes),
    }
    _stages(f"dw steady-state path by stage (config {plan.config.name if plan.config else '-'}, {plan.path}):", stages, calls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="30b-gate_up")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)

    import torch

    from benchmarks.side_by_side import measure_host
    from benchmarks.tune_kernels import PRESET_GEMMS, Point
    from qmoe_doctor.kernels.tuning import describe_device_table

    e, n, k = PRESET_GEMMS[args.shape]
    point = Point(args.shape, e, n, k, args.tokens, torch.device("cuda", 0), torch.bfloat16, 8)
    print(f"{torch.cuda.get_device_name(0)}; config table: {describe_device_table(0)}")
    for row in measure_host(point, args.calls):
        print(
            f"{row['op']:8} ours {row['ours']:7.1f} us/call (lean: {row['lean_used']})   "
            f"through JITFunction.run {row['ours_standard']:7.1f}   torch._grouped_mm {row['grouped_mm']:7.1f}"
        )
    forward_stages(point, args.calls)
    dw_stages(point, args.calls)
    fn = point.ours("forward", None)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue()[-4000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
