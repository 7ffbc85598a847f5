"""Where an expert-parallel step's time goes, on the GPUs of one host.

    torchrun --nproc-per-node 2 tools/profile/ep_profile.py --out DIR [--tokens 32768] \
        [--variants "micro=1;micro=2;micro=2,reserve=16"]

Each rank builds the 30B-preset block, its ExpertParallelBlock (probes/parallel/modes.py: the
code ``qmoe-doctor parallel --modes ep`` runs), once per variant (its keyword arguments:
``micro`` micro-batches, ``reserve`` SMs left to NCCL), and times forward+backward steps with
CUDA events per phase; rank 0 also times the one-GPU block on the full batch (the baseline the
speedup is against), the bare all_to_all bandwidth of the dispatch payload, and writes a
torch.profiler table of three profiled EP steps of the first variant (top kernels by GPU time)
and its chrome trace; per variant (and for the one-GPU block), from the last two profiled steps:
GPU busy time, NCCL kernel time and how much of it overlapped other kernels, the GPU's idle gaps
and the host op that ended each (``gpu_gaps``). Prints
one JSON line per rank and writes DIR/ep_profile_rank{r}.json. Diagnostic tooling: nothing
here is asserted.
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


def parse_variant(spec: str) -> dict[str, int | str]:
    """'micro=2,reserve=16' or 'dispatch=gather,transport=symm' -> ExpertParallelBlock keyword
    arguments."""
    numbers = {"micro": "micro_batches", "reserve": "reserve_sms"}
    words = {"dispatch": ("a2a", "gather"), "transport": ("auto", "symm", "collective")}
    kw: dict[str, int | str] = {}
    for item in spec.split(","):
        key, _, value = item.strip().partition("=")
        value = value.strip()
        if key in numbers and value.isdigit():
            kw[numbers[key]] = int(value)
        elif key in words and value in words[key]:
            kw[key] = value
        else:
            raise SystemExit(
                f"bad variant item {item!r}: use micro=N, reserve=N, dispatch=a2a|gather, "
                "transport=auto|symm|collective"
            )
    return kw


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


STEP_MARK = "qmoe_profiled_step"


def gpu_gaps(trace: dict, steps: int, min_us: float = 5.0, top: int = 8) -> dict[str, object]:
    """Per step, from a chrome trace (torch.profiler's export): GPU busy time (union of device
    activity), NCCL kernel time and the part of it that ran while another kernel ran, and the
    idle gaps, each charged to the host op that launched the work ending it (the innermost
    ``cpu_op`` around its launch call, and the outermost one: where the host was while the GPU
    waited). A gap the host caused (issuing slower than the GPU ran) and one a synchronization
    caused both show up here.

    When the host marked its steps (``record_function(STEP_MARK)``), only work launched inside the
    marks after the first is counted (``steps`` of them): the first profiled step carries the
    profiler's own start-up. A device interval never starts before its launch (the profiler has
    reported NCCL kernels spanning hundreds of ms before it)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("name") == STEP_MARK and e.get("cat") == "user_annotation"
    )
    window = (marks[1][0], marks[-1][1]) if len(marks) > 1 else None
    launches = {e.get("args", {}).get("correlation"): e for e in events if e.get("cat") in LAUNCH_CATS}
    device = []
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        corr = e.get("args", {}).get("correlation")
        launch = launches.get(corr)
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if launch is not None:
            if window and not window[0] <= float(launch["ts"]) <= window[1]:
                continue
            start = min(max(start, float(launch["ts"])), end)
        elif window:
            continue
        device.append((start, end, corr, "nccl" in str(e.get("name", "")).lower()))
    device.sort()
    if not device:
        return {}
    ops_by_tid: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_tid.setdefault(e.get("tid"), []).append(e)

    def enclosing(launch: dict) -> tuple[str, str]:
        ts = float(launch["ts"])
        around = [
            e
            for e in ops_by_tid.get(launch.get("tid"), [])
            if float(e["ts"]) <= ts <= float(e["ts"]) + float(e.get("dur", 0))
        ]
        if not around:
            return "-", "-"
        around.sort(key=lambda e: float(e.get("dur", 0)))
        return around[0]["name"], around[-1]["name"]

    gaps: dict[str, list[float]] = {}
    idle, busy_end = 0.0, device[0][1]
    for start, end, corr, _ in device[1:]:
        if start - busy_end >= min_us:
            gap = start - busy_end
            idle += gap
            launch = launches.get(corr)
            inner, outer = enclosing(launch) if launch else ("?", "?")
            gaps.setdefault(f"{outer} > {inner}", []).append(gap)
        busy_end = max(busy_end, end)
    nccl = _union([(a, b) for a, b, _, is_nccl in device if is_nccl])
    other = _union([(a, b) for a, b, _, is_nccl in device if not is_nccl])
    worst = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]
    per = 1e3 * steps
    return {
        "gpu_busy_ms_per_step": round(_length(_union(nccl + other)) / per, 3),
        "nccl_ms_per_step": round(_length(nccl) / per, 3),
        "nccl_overlapped_ms_per_step": round(_intersect(nccl, other) / per, 3),
        "gpu_idle_ms_per_step": round(idle / per, 3),
        "gpu_idle_gaps": [
            {
                "before": name,
                "count": len(v) / steps,
                "ms_per_step": round(sum(v) / per, 3),
                "largest_us": round(max(v), 1),
            }
            for name, v in worst
        ],
    }


def allocator_delta(before: dict, after: dict) -> dict[str, int]:
    """cudaMalloc/cudaFree calls and allocator retries (a retry frees cached blocks: it
    synchronizes the device) between two ``torch.cuda.memory_stats()`` snapshots."""
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in keys if k in after}


def count_syncs(step: object) -> dict[str, object]:
    """Host synchronizations in one step, as torch's sync debug mode reports them (warn mode:
    each sync is a warning), with the distinct Python lines that caused them."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step()  # type: ignore[operator]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    where = [
        f"{os.path.basename(w.filename)}:{w.lineno}" for w in seen if "synchroniz" in str(w.message).lower()
    ]
    return {"host_syncs_per_step": len(where), "host_sync_sites": sorted(set(where))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--variants",
        default="micro=2",
        help="';'-separated ExpertParallelBlock settings, e.g. 'micro=1;micro=2,reserve=16'",
    )
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument(
        "--dump-after",
        type=float,
        default=0.0,
        help="print every thread's stack after S seconds, then exit (a hang)",
    )
    args = ap.parse_args()
    if args.dump_after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after, exit=True)
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
    g = torch.Generator(device=dev).manual_seed(1)
    x_all = torch.randn(args.tokens, full.shape.hidden, generator=g, device=dev).to(torch.bfloat16)
    part = args.tokens // world
    xs = x_all[rank * part : (rank + 1) * part].contiguous()
    up = torch.randn_like(xs)
    from torch.profiler import ProfilerActivity, profile, record_function

    result: dict[str, object] = {"rank": rank, "world": world, "tokens": args.tokens, "variants": {}}
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    for index, spec in enumerate(variants):
        kw = parse_variant(spec)
        layer = ExpertParallelBlock(
            full, rank=rank, world=world, kernel=moe_grouped_gemm, hooks=hooks_for(None), **kw
        )
        phases: dict[str, list[float]] = {"step": [], "forward": [], "backward": [], "cpu_forward": []}

        def ep_step(record: bool, layer: ExpertParallelBlock = layer, phases: dict = phases) -> None:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            xr = xs.detach().requires_grad_()
            e0.record()
            c0 = time.perf_counter()
            out, _ = layer(xr)
            c1 = time.perf_counter()  # the host's time to issue the forward (no sync after it)
            e1.record()
            (out.float() * up.float()).sum().backward()
            if layer.gate.weight.grad is not None:
                dist.all_reduce(layer.gate.weight.grad)
            e2.record()
            layer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if record:
                phases["forward"].append(e0.elapsed_time(e1))
                phases["cpu_forward"].append((c1 - c0) * 1e3)
                phases["backward"].append(e1.elapsed_time(e2))

        for _ in range(3):
            ep_step(False)
        dist.barrier()
        stats0 = torch.cuda.memory_stats(dev)
        for _ in range(args.steps):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ep_step(True)
            phases["step"].append((time.perf_counter() - t0) * 1e3)
        row: dict[str, object] = {f"{k}_ms": round(statistics.median(v), 3) for k, v in phases.items()}
        row["allocator_in_timed_steps"] = allocator_delta(stats0, torch.cuda.memory_stats(dev))
        print(f"rank {rank} {spec}: timed", flush=True)
        row.update(count_syncs(lambda: ep_step(False)))
        print(f"rank {rank} {spec}: syncs counted", flush=True)
        # every rank runs the profiled steps (they are collective); rank 0 keeps the figures. The
        # ranks start them together: otherwise the first NCCL kernel of the faster rank waits for
        # the other one inside the trace (a trace with expandable segments on 2x H200 had one of 126 ms)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                with record_function(STEP_MARK):
                    ep_step(False)
        if rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            trace_path = args.out / f"ep_trace_rank0_{index}.json"
            prof.export_chrome_trace(str(trace_path))
            row.update(gpu_gaps(json.loads(trace_path.read_text()), steps=2))  # steps 2 and 3
            if index:
                trace_path.unlink()  # the first variant's trace is kept
            if index == 0:
                table = prof.key_averages().table(
                    sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60
                )
                (args.out / "ep_profile_table.txt").write_text(f"variant {spec}\n{table}")
        result["variants"][spec] = row  # type: ignore[index]
        print(json.dumps({"rank": rank, "variant": spec, **row}), flush=True)
        del layer
        dist.barrier()

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
            for _ in range(3):
                with record_function(STEP_MARK):
                    out, _ = full(xr)
                    (out.float() * up_all.float()).sum().backward()
                    full.zero_grad(set_to_none=True)
                    xr.grad = None
        table = prof1.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60
        )
        (args.out / "single_profile_table.txt").write_text(table)
        single_trace = args.out / "single_trace.json"
        prof1.export_chrome_trace(str(single_trace))
        result["single"] = gpu_gaps(json.loads(single_trace.read_text()), steps=2)
        single_trace.unlink()
        for row in result["variants"].values():  # type: ignore[union-attr]
            row["ep_speedup"] = round(result["single_step_ms"] / row["step_ms"], 3)  # type: ignore[operator]
    dist.barrier()
    print(json.dumps(result), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ep_profile_rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
