"""Where an expert-parallel step's time goes (issue 7), on the GPUs of one host.

    torchrun --nproc-per-node 2 tools/ep_profile.py --out DIR [--tokens 32768] [--dispatch alltoall]

Each rank builds the 30B-preset block, its ExpertParallelBlock (probes/parallel/modes.py: the
code ``qmoe-doctor parallel --modes ep`` runs) and times forward+backward steps with CUDA events
per phase; rank 0 also times the one-GPU block on the full batch (the baseline the speedup is
against), the bare all_to_all bandwidth of the dispatch payload, and writes a torch.profiler
table of two EP steps (top kernels by GPU time, GPU busy fraction). Prints one JSON line per
rank and writes DIR/ep_profile_rank{r}.json. Diagnostic tooling: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dispatch", default="", help="ExpertParallelBlock dispatch strategy, if it has several")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    for var in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
        os.environ[var] = "0" if var == "NCCL_NVLS_ENABLE" else "1"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)

    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm
    from qmoe_doctor.kernels.moe_block import MoEBlock
    from qmoe_doctor.probes.parallel.hooks import hooks_for
    from qmoe_doctor.probes.parallel.modes import ExpertParallelBlock

    torch.manual_seed(0)
    full = MoEBlock(args.preset, device=dev, dtype=torch.bfloat16)
    kw = {"dispatch": args.dispatch} if args.dispatch else {}
    layer = ExpertParallelBlock(
        full, rank=rank, world=world, kernel=moe_grouped_gemm, hooks=hooks_for(None), **kw
    )
    g = torch.Generator(device=dev).manual_seed(1)
    x_all = torch.randn(args.tokens, full.shape.hidden, generator=g, device=dev).to(torch.bfloat16)
    part = args.tokens // world
    xs = x_all[rank * part : (rank + 1) * part].contiguous()
    up = torch.randn_like(xs)

    phases: dict[str, list[float]] = {"step": [], "forward": [], "backward": []}

    def ep_step(record: bool) -> None:
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        xr = xs.detach().requires_grad_()
        e0.record()
        out, _ = layer(xr)
        e1.record()
        (out.float() * up.float()).sum().backward()
        if layer.gate.weight.grad is not None:
            dist.all_reduce(layer.gate.weight.grad)
        e2.record()
        layer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if record:
            phases["forward"].append(e0.elapsed_time(e1))
            phases["backward"].append(e1.elapsed_time(e2))

    for _ in range(3):
        ep_step(False)
    dist.barrier()
    for _ in range(args.steps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ep_step(True)
        phases["step"].append((time.perf_counter() - t0) * 1e3)
    result: dict[str, object] = {
        "rank": rank,
        "world": world,
        "tokens": args.tokens,
        "dispatch": args.dispatch or "default",
    }
    result.update({f"{k}_ms": round(statistics.median(v), 3) for k, v in phases.items()})

    # bare all_to_all of the dispatch payload: every token to every other rank, bf16 rows
    payload = torch.randn(part * world, full.shape.hidden, device=dev).to(torch.bfloat16)
    recv = torch.empty_like(payload)
    for _ in range(3):
        dist.all_to_all_single(recv, payload)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dist.all_to_all_single(recv, payload)
    torch.cuda.synchronize()
    a2a_ms = (time.perf_counter() - t0) * 1e3 / 10
    moved = payload.numel() * 2 * (world - 1) / world
    result["all_to_all_ms"] = round(a2a_ms, 3)
    result["all_to_all_GBps_per_rank"] = round(moved / a2a_ms / 1e6, 1)

    # every rank runs the profiled steps (they are collective); rank 0 keeps the table
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            ep_step(False)
    if rank == 0:
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ep_profile_table.txt").write_text(table)
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / 2  # ms per step
        result["gpu_busy_ms_per_step"] = round(busy, 3)
    dist.barrier()
    if rank == 0:
        # the one-GPU baseline on the full batch (what `parallel` scales against)
        xr_all = x_all.detach()
        up_all = torch.randn_like(xr_all)
        times = []
        for i in range(3 + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            xr = xr_all.requires_grad_() if not xr_all.requires_grad else xr_all
            out, _ = full(xr)
            (out.float() * up_all.float()).sum().backward()
            full.zero_grad(set_to_none=True)
            xr.grad = None
            torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        result["single_step_ms"] = round(statistics.median(times), 3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof1:
            for _ in range(2):
                out, _ = full(xr)
                (out.float() * up_all.float()).sum().backward()
                full.zero_grad(set_to_none=True)
                xr.grad = None
        table = prof1.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60
        )
        (args.out / "single_profile_table.txt").write_text(table)
        result["ep_speedup"] = round(result["single_step_ms"] / result["step_ms"], 3)  # type: ignore[operator]
    dist.barrier()
    print(json.dumps(result), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ep_profile_rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
