"""Torchrun ranks, each training its own copy of the MoE block on its own GPU: a user's program for
``qmoe-doctor run`` to watch under a launcher (docs/run.md).

    torchrun --nproc-per-node 2 examples/moe_ranks.py                        # ours: no finding
    qmoe-doctor run -- torchrun --nproc-per-node 2 examples/moe_ranks.py \\
        --kernel specimen:rank_no_set_device                                  # device-never-set, rank 1
    qmoe-doctor run -- torchrun --nproc-per-node 2 examples/moe_ranks.py --cpu --steps 1
    python examples/moe_ranks.py --cpu --steps 1                             # one rank, no torchrun

Each rank reads ``LOCAL_RANK`` and takes ``cuda:LOCAL_RANK`` (the CPU with ``--cpu``: the Triton
interpreter, float32, gloo), makes it current the way the kernel's module says (its
``qmoe_set_rank_device`` rank hook when it has one, as ``qmoe-doctor parallel``'s ranks do: see
``probes/parallel/hooks.py``; else ``torch.cuda.set_device``), builds
``qmoe_doctor.kernels.moe_block.MoEBlock`` there on the ``--kernel`` forward grouped GEMM
(``builtin``, ``specimen:NAME``, ``module:function``, ``path/to/file.py:function``) and runs
``--steps`` forward + backward steps of ``--tokens`` random tokens, all-reducing the loss over the
process group (nccl on GPUs, gloo on the CPU): one collective a step, as a training loop has; the
gradients are not averaged, so it is not data parallel in full. Run alone, without torchrun, it is one rank with
its process group in memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", "-k", default="builtin", help="the forward grouped GEMM (a qmoe-doctor kernel reference)")
    p.add_argument("--cpu", action="store_true", help="the Triton interpreter on the CPU, float32, gloo (CI)")
    p.add_argument("--preset", default=None, help="MoE shape preset (default: tiny on --cpu, qwen3-30b-a3b on GPUs)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step and rank (default: 512; 16 on the CPU)")
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("tokens", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1")
    return args


def rank_env(environ: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, local rank, world size) as torchrun sets them; (0, 0, 1) run alone."""
    return int(environ.get("RANK", "0")), int(environ.get("LOCAL_RANK", "0")), int(environ.get("WORLD_SIZE", "1"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch
    import torch.distributed as dist

    from qmoe_doctor.probes.loader import load_kernel
    from qmoe_doctor.probes.parallel.hooks import hooks_for

    rank, local_rank, world = rank_env(os.environ)
    if args.cpu:
        device = torch.device("cpu")
        dtype = torch.float32  # the interpreter's tl.dot is wrong in bfloat16
    else:
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            print(f"rank {rank}: no cuda:{local_rank}; pass --cpu to run on the Triton interpreter", file=sys.stderr)
            return 2
        device = torch.device("cuda", local_rank)
        dtype = torch.bfloat16
    kernel = load_kernel(args.kernel)
    # the kernel module's own rank hook (a specimen's may plant a fault), else set_device
    hooks_for(kernel).set_device(device)
    backend = "gloo" if args.cpu else "nccl"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:  # run alone: one rank, no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return train(args, kernel, device, dtype, rank, world)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, kernel: Any, device: Any, dtype: Any, rank: int, world: int) -> int:
    """``args.steps`` forward + backward steps of the block on ``device``, the loss all-reduced."""
    import torch
    import torch.distributed as dist

    from qmoe_doctor.core.shapes import get_preset
    from qmoe_doctor.kernels.moe_block import MoEBlock

    shape = get_preset(args.preset or ("tiny" if args.cpu else "qwen3-30b-a3b"))
    tokens = args.tokens or (16 if args.cpu else 512)
    torch.manual_seed(args.seed)  # every rank starts from the same weights
    block = MoEBlock(shape, kernel=kernel, device=device, dtype=dtype)
    optimizer = torch.optim.SGD(block.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own tokens
    current = torch.cuda.current_device() if device.type == "cuda" else "cpu"
    print(f"rank {rank}: {args.kernel} on {device} (current device {current}), {tokens} tokens a step", flush=True)
    for step in range(1, args.steps + 1):
        x = torch.randn(tokens, shape.hidden, generator=generator).to(device=device, dtype=dtype)
        t0 = time.perf_counter()
        out, _router_logits = block(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # a collective per step
        value, mean = loss.item(), total.item() / world  # waits for the step
        print(
            f"rank {rank} step {step}/{args.steps}: loss {value:.4f}, mean over {world} rank"
            f"{'s' if world != 1 else ''} {mean:.4f} ({time.perf_counter() - t0:.2f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
