"""Host time per call of our grouped GEMMs against ``torch._grouped_mm`` (GPU), and where it goes.

    python3 tools/profile/host_overhead.py --tokens 128

Small batches are launch-bound: the GPU finishes a 128-token grouped GEMM faster than Python
issues the next. This times N back-to-back calls on the host (no synchronization inside the
loop; the queue is drained before and after), per op and implementation, then profiles our
forward with cProfile and prints the functions that take the time, and times the dw call's
host path stage by stage (bounds, config, descriptors, the launch alone).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def _per_call(fn, calls: int) -> float:
    """Host microseconds per call of ``fn`` (the GPU queue drained before, not inside)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return host * 1e6


def _print_stages(title: str, stages: dict, calls: int) -> None:
    print(title)
    for name, fn in stages.items():
        print(f"  {name:34} {_per_call(fn, calls):7.1f} us/call")


def dw_stages(point, calls: int) -> None:
    """The dw call's host path, one stage at a time, with the packaged config."""
    import torch

    from qmoe_doctor.kernels import backward as bw
    from qmoe_doctor.kernels import dw_overlap as ov

    dy, x, sizes = point.dy, point.x, point.m_sizes
    m, n = dy.shape
    k, e = x.shape[1], sizes.shape[0]
    cfg = bw.pick_dw_config(n, k, x.device, x.dtype, avg_rows=m / e)
    dw = torch.empty((e, n, k), device=x.device, dtype=x.dtype)
    bounds = bw.row_bounds(sizes, m)
    programs = bw.dw_grid_size(e, n, k, cfg, x.device)
    stages = {
        "check_dw_operands": lambda: bw.check_dw_operands(dy, x, sizes),
        "torch.empty (dw)": lambda: torch.empty((e, n, k), device=x.device, dtype=x.dtype),
        "row_bounds": lambda: bw.row_bounds(sizes, m),
        "pick_dw_config": lambda: bw.pick_dw_config(n, k, x.device, x.dtype, avg_rows=m / e),
        "dw_grid_size": lambda: bw.dw_grid_size(e, n, k, cfg, x.device),
    }
    if cfg.overlap and ov.dw_overlap_plan(dy, x, dw, cfg) is not None:
        plan = ov.dw_overlap_plan(dy, x, dw, cfg)
        stages["dw_overlap_plan (3 descriptors)"] = lambda: ov.dw_overlap_plan(dy, x, dw, cfg)
        stages["launch_dw_overlap (Gluon launch)"] = lambda: ov.launch_dw_overlap(
            plan, dy, x, dw, bounds, cfg, programs
        )
    else:
        cfg = bw.overlap_fallback(cfg) if cfg.overlap else cfg
        plan = bw.dw_tma_plan(dy, x, dw, cfg)
        if plan is not None:
            stages["dw_tma_plan (3 descriptors)"] = lambda: bw.dw_tma_plan(dy, x, dw, cfg)
            stages["launch_grouped_gemm_dw_tma"] = lambda: bw.launch_grouped_gemm_dw_tma(
                plan, dy, x, dw, bounds, cfg, programs
            )
    stages["row_bounds_torch (the six torch ops)"] = lambda: bw.row_bounds_torch(sizes, m)
    stages["device_guard enter/exit"] = lambda: _guarded(x.device)
    stages["moe_grouped_gemm_dw (whole call)"] = lambda: bw.moe_grouped_gemm_dw(dy, x, sizes)
    _print_stages(f"dw host path by stage (config {cfg.name}):", stages, calls)


def _guarded(device) -> None:
    from qmoe_doctor.kernels.grouped_gemm import device_guard

    with device_guard(device):
        pass


def forward_stages(point, calls: int) -> None:
    """The forward call's host path, one stage at a time, with the packaged config."""
    import torch

    from qmoe_doctor.kernels import grouped_gemm as gg

    x, w, sizes = point.x, point.w, point.m_sizes
    m, k = x.shape
    e, n, _ = w.shape
    cfg = gg.pick_config(m, n, k, e, x.device, x.dtype, op="forward")
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    programs = gg.grid_size(m, n, e, cfg, x.device)
    plan = gg.tma_plan(x, w, y, cfg)
    stages = {
        "check_operands": lambda: gg.check_operands(x, w, sizes),
        "torch.empty (y)": lambda: torch.empty((m, n), device=x.device, dtype=x.dtype),
        "pick_config": lambda: gg.pick_config(m, n, k, e, x.device, x.dtype, op="forward"),
        "grid_size": lambda: gg.grid_size(m, n, e, cfg, x.device),
        "tma_plan (3 descriptors)": lambda: gg.tma_plan(x, w, y, cfg),
    }
    if plan is not None and not cfg.flat:
        stages["launch_grouped_gemm_tma (Triton launch)"] = lambda: gg.launch_grouped_gemm_tma(
            plan, y, sizes, m, n, k, e, cfg, programs
        )
    stages["moe_grouped_gemm (whole call)"] = lambda: gg.moe_grouped_gemm(x, w, sizes)
    _print_stages(f"forward host path by stage (config {cfg.name}):", stages, calls)


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.tune_kernels import PRESET_GEMMS, Point

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="30b-gate_up")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    e, n, k = PRESET_GEMMS[args.shape]
    point = Point(args.shape, e, n, k, args.tokens, torch.device("cuda", 0), torch.bfloat16, 8)
    for op in ("forward", "dx", "dw"):
        for impl, fn in (("qmoe", point.ours(op, None)), ("torch._grouped_mm", point.theirs(op))):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            host = (time.perf_counter() - t0) / args.calls
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.calls
            print(f"{op:8} {impl:18} host {host * 1e6:7.1f} us/call   host+GPU {wall * 1e6:7.1f} us/call")
    dw_stages(point, args.calls)
    forward_stages(point, args.calls)
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
