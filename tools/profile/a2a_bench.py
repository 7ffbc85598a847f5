"""Bare all_to_all_single bandwidth of EP-sized payloads, under torchrun on one host.

    torchrun --nproc-per-node N tools/profile/a2a_bench.py [--rows 16384] [--hidden 2048] [--label TEXT]

Each rank sends ``rows`` bf16 rows of ``hidden`` columns split evenly over the ranks (the
expert-parallel dispatch of a 30B-preset step sends each token once to each other rank) and
prints one JSON line (rank 0): payload MB, ms per exchange, GB/s moved per rank, for 1x, 2x and
4x the payload, with the NCCL_* variables of the environment, so that runs under different NCCL
settings can be compared. Diagnostic tooling: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for scale in (1, 2, 4):
        n = args.rows * scale // world * world
        send = torch.randn(n, args.hidden, device=dev).to(torch.bfloat16)
        recv = torch.empty_like(send)
        for _ in range(3):
            dist.all_to_all_single(recv, send)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_to_all_single(recv, send)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / args.iters
        moved = send.numel() * send.element_size() * (world - 1) / world
        rows.append(
            {
                "payload_mb": round(send.numel() * 2 / 1e6, 1),
                "ms": round(ms, 3),
                "GBps_per_rank": round(moved / ms / 1e6, 1),
            }
        )
    if rank == 0:
        env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
        print(json.dumps({"label": args.label, "world": world, "results": rows, "env": env}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
