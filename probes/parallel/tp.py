"""Tensor parallelism of the MoE block: each rank holds a slice of every expert's intermediate.

With W ranks and moe_intermediate_size I (``I % W == 0``, ``I_local = I / W``), rank r holds

* ``gate_up_proj`` split by columns of its output: rows ``[r*I_local, (r+1)*I_local)`` of the
  gate half *and* the same rows of the up half, so ``SiLU(gate) * up`` stays rank-local:
  ``(E, 2I, H) -> (E, 2*I_local, H)``;
* ``down_proj`` split by rows of its input (its last dimension): ``(E, H, I) -> (E, H, I_local)``;
* the router (``gate``) whole, and every token.

Each rank's block then computes a partial output ``sum_e w_e * down_r(act_r)``; the partials sum
to the full output (``reduce_from_tensor_parallel``: all-reduce forward, identity backward). The
input enters through ``copy_to_tensor_parallel`` (identity forward, all-reduce backward) so the
input gradient sums every rank's share, and the router's weight gradient, a partial too, is
all-reduced after backward by the caller.

``shard_gate_up`` / ``shard_down`` are pure (slices, no collective); ``gather_gate_up`` /
``gather_down`` are their inverses, for tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def tp_slice(size: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous share of ``size`` items; a ValueError when it does not split."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if size % world:
        raise ValueError(f"{size} does not split evenly over {world} ranks")
    part = size // world
    return slice(rank * part, (rank + 1) * part)


def shard_gate_up(gate_up: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """(E, 2I, H) -> (E, 2*I_local, H): this rank's rows of the gate half, then of the up half."""
    inter = gate_up.shape[1] // 2
    s = tp_slice(inter, rank, world)
    return torch.cat([gate_up[:, s], gate_up[:, inter + s.start : inter + s.stop]], dim=1)


def shard_down(down: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """(E, H, I) -> (E, H, I_local): this rank's columns of every expert's down projection."""
    return down[:, :, tp_slice(down.shape[2], rank, world)]


def gather_gate_up(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard_gate_up`` over all ranks."""
    halves = [s.chunk(2, dim=1) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)


def gather_down(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard_down`` over all ranks."""
    return torch.cat(list(shards), dim=2)


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Identity forward; the backward all-reduces (sums) the input gradient over the ranks."""
    out: torch.Tensor = _CopyToParallel.apply(x, group)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
    return out


def reduce_from_tensor_parallel(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce (sum) of the ranks' partial outputs; identity backward."""
    out: torch.Tensor = _ReduceFromParallel.apply(x, group)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
    return out


__all__ = [
    "copy_to_tensor_parallel",
    "gather_down",
    "gather_gate_up",
    "reduce_from_tensor_parallel",
    "shard_down",
    "shard_gate_up",
    "tp_slice",
]
