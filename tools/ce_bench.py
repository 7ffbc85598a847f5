"""Copy-engine exchange through symmetric memory, against NCCL, alone and beside a GEMM (issue 7).

    torchrun --nproc-per-node 2 tools/ce_bench.py [--tokens 131072] [--out DIR]

Each rank owns ``tokens / W`` packed token rows (30B preset: H + 2k = 2064 bf16 columns) and sends
them to every other rank, three ways: (a) ``all_to_all_single`` (NCCL, SM kernels); (b) a push
into the peers' symmetric-memory buffers (``peer_buffer.copy_``: a copy-engine transfer, no SM)
between two ``barrier``s; then each beside our grouped GEMM at the rank's EP expert shape
(``tokens * k / W`` rows over ``E / W`` experts, N=1536, K=2048) running on the default stream:
how long the pair takes against the GEMM alone tells whether the exchange hides behind it.
Checks the pushed rows arrive bit for bit. Prints one JSON line per rank. Diagnostic only.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def timed(fn, reps: int = 10) -> float:
    """Median ms of ``fn`` on the current stream (everything it issues is awaited)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    import torch.distributed._symmetric_memory as symm_mem

    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm

    rows, cols = args.tokens // world, 2048 + 16
    dtype = torch.bfloat16
    src = torch.full((rows, cols), float(rank + 1), device=device, dtype=dtype)
    buf = symm_mem.empty(world, rows, cols, dtype=dtype, device=device)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peers = [hdl.get_buffer(p, (world, rows, cols), dtype) for p in range(world)]
    comm = torch.cuda.Stream(device)
    nbytes = rows * cols * 2 * (world - 1)  # sent per rank

    def join() -> None:
        torch.cuda.current_stream().wait_stream(comm)

    def push(wait: bool = True) -> None:
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm):
            hdl.barrier(channel=0)
            for p in range(world):
                if p != rank:
                    peers[p][rank].copy_(src)
            hdl.barrier(channel=0)
        if wait:
            join()

    send = src.repeat(world, 1)
    recv = torch.empty_like(send)

    def nccl(wait: bool = True) -> None:
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm):
            dist.all_to_all_single(recv, send)
        if wait:
            join()

    push()
    torch.cuda.synchronize()
    arrived = all(bool((buf[p] == float(p + 1)).all()) for p in range(world) if p != rank)

    e_local, k = 128 // world, 8
    m = args.tokens * k // world
    x = torch.randn(m, 2048, device=device, dtype=dtype)
    w = torch.randn(e_local, 1536, 2048, device=device, dtype=dtype) * 0.02
    m_sizes = torch.full((e_local,), m // e_local, device=device, dtype=torch.int32)

    def gemm() -> None:
        moe_grouped_gemm(x, w, m_sizes)

    gemm()
    nccl()
    res = {"rank": rank, "world": world, "tokens": args.tokens, "bytes_sent": nbytes, "push_arrived": arrived}
    res["push_ms"] = timed(push)
    res["nccl_ms"] = timed(nccl)
    res["push_GBps"] = nbytes / res["push_ms"] / 1e6
    res["nccl_GBps"] = nbytes / res["nccl_ms"] / 1e6
    res["gemm_ms"] = timed(gemm)
    # the exchange issued first on its own stream, the GEMM then on the default stream
    res["gemm_plus_push_ms"] = timed(lambda: (push(False), gemm(), join()))
    res["gemm_plus_nccl_ms"] = timed(lambda: (nccl(False), gemm(), join()))
    print(json.dumps(res), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ce_bench_rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
