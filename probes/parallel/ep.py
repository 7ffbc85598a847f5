"""Expert parallelism: which rank owns which expert, what travels where, and the all-to-all op.

Experts are sharded in contiguous blocks: with E experts over W ranks, rank r owns global
experts ``[r * E_local, (r + 1) * E_local)`` (``E_local = E / W``) and holds them as a local
stack of ``E_local`` experts, where global expert ``r * E_local + j`` is local expert ``j``.

Dispatch is per (token, destination rank), not per (token, expert): a token whose k experts
include several of rank r's is sent to r once, with its k global ids and k routing weights
(at top-8 of 128 experts on two ranks a token has about four experts on each, so this moves a
quarter of the bytes of a per-expert dispatch). ``token_dispatch`` lists the (token, rank)
pairs in send order (by rank, then token) and counts them per rank; the pairs go out with
``all_to_all_single``. The receiver keeps the slots whose expert it owns (``local_slots``),
remaps their global ids to local ones, runs its experts on those rows, weights each row and sums
the rows of each pair; the sums go back with the split sizes swapped and the sender adds each
rank's share into its tokens.

Pure functions here (no collective): they are the arithmetic the CPU tests check.
``all_to_all`` (autograd) and ``exchange_counts`` are the two collectives, in one place.
``all_to_all_torch`` is the slow, obvious twin of what W ranks' ``all_to_all_single`` produce,
computed in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def experts_per_rank(num_experts: int, world: int) -> int:
    """E_local; a ValueError when E does not split evenly (every rank holds the same stack)."""
    if world < 1 or num_experts < 1:
        raise ValueError(f"need at least one rank and one expert, got E={num_experts}, W={world}")
    if num_experts % world:
        raise ValueError(f"{num_experts} experts do not split evenly over {world} ranks")
    return num_experts // world


def owner_of(ids: torch.Tensor, per_rank: int) -> torch.Tensor:
    """The rank that owns each global expert id (contiguous blocks of ``per_rank`` experts)."""
    return torch.div(ids.to(torch.int64), per_rank, rounding_mode="floor")


def first_expert(rank: int, per_rank: int) -> int:
    """The global id of rank ``rank``'s local expert 0."""
    return rank * per_rank


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenDispatch:
    """Which of a rank's tokens go to which rank; tensors on ``topk_ids``' device."""

    tokens: torch.Tensor  # (P,) int64: the token of each (token, rank) pair, in send order
    dest: torch.Tensor  # (P,) int64: the rank of each pair (non-decreasing)
    send_counts: tuple[int, ...]  # (W,) pairs to each rank, in rank order

    @property
    def num_pairs(self) -> int:
        return int(self.tokens.shape[0])


def token_dispatch(
    topk_ids: torch.Tensor, num_experts: int, world: int, *, check: bool = False
) -> TokenDispatch:
    """The (token, rank) pairs of a rank's tokens: one per token and rank owning at least one of
    its k experts, ordered by rank, then token.

    Reads the per-rank counts on the host (the split sizes of the all-to-all): synchronizes
    once. ``check=True`` first verifies every id is in [0, E) (a router never makes others, and
    one would name a rank that does not exist); it synchronizes again.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (T, k), got shape {tuple(topk_ids.shape)}")
    per_rank = experts_per_rank(num_experts, world)
    ids = topk_ids.to(torch.int64)
    if check and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts}) cannot be dispatched")
    need = torch.zeros((ids.shape[0], world), dtype=torch.bool, device=ids.device)
    need.scatter_(1, owner_of(ids, per_rank), True)  # (T, W): token t has an expert on rank r
    dest, tokens = need.t().nonzero(as_tuple=True)  # row-major over (rank, token): send order
    counts = torch.bincount(dest, minlength=world)
    return TokenDispatch(tokens=tokens, dest=dest, send_counts=tuple(int(c) for c in counts.tolist()))


def token_dispatch_exchange(
    topk_ids: torch.Tensor, num_experts: int, world: int, group: Any = None
) -> tuple[TokenDispatch, tuple[int, ...]]:
    """``token_dispatch`` and ``exchange_counts`` with ONE host synchronization: the per-rank
    counts are exchanged on the device, then both count vectors come to the host together."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (T, k), got shape {tuple(topk_ids.shape)}")
    per_rank = experts_per_rank(num_experts, world)
    ids = topk_ids.to(torch.int64)
    need = torch.zeros((ids.shape[0], world), dtype=torch.bool, device=ids.device)
    need.scatter_(1, owner_of(ids, per_rank), True)
    counts = need.sum(dim=0)  # (W,) pairs to each rank
    recv_t = torch.empty_like(counts)
    dist.all_to_all_single(recv_t, counts, group=group)
    both = torch.cat([counts, recv_t]).tolist()  # the one synchronization
    total = int(sum(both[:world]))
    try:  # sized on the host already: no second synchronization
        dest, tokens = torch.nonzero_static(need.t(), size=total).unbind(1)
    except (AttributeError, NotImplementedError, RuntimeError):  # a build without it on this device
        dest, tokens = need.t().nonzero(as_tuple=True)
    plan = TokenDispatch(tokens=tokens, dest=dest, send_counts=tuple(int(c) for c in both[:world]))
    return plan, tuple(int(c) for c in both[world:])


def local_slots(ids: torch.Tensor, rank: int, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the received pairs' (P, k) global ids, the slots whose expert ``rank`` owns, as
    (pair index, slot index) of each such row, pair-major."""
    mine = owner_of(ids, per_rank) == rank
    pair, slot = mine.nonzero(as_tuple=True)
    return pair, slot


def receive_counts(send_counts: Sequence[Sequence[int]], rank: int) -> tuple[int, ...]:
    """What rank ``rank`` receives from each rank, given every rank's send counts (a pure
    restatement of the count exchange: rank r gets ``send_counts[s][r]`` rows from rank s)."""
    return tuple(int(row[rank]) for row in send_counts)


def all_to_all_torch(
    inputs: Sequence[torch.Tensor], send_counts: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """The slow, obvious twin of ``all_to_all_single`` over W ranks, in one process.

    ``inputs[s]`` is rank s's send buffer (rows grouped by destination, ``send_counts[s][r]``
    rows to rank r); returns each rank's receive buffer: the chunks addressed to it, in rank
    order of their senders.
    """
    world = len(inputs)
    chunks = [list(torch.split(inputs[s], list(send_counts[s]))) for s in range(world)]
    return [torch.cat([chunks[s][r] for s in range(world)]) for r in range(world)]


def out_of_range(local_ids: torch.Tensor, num_local: int) -> torch.Tensor:
    """Mask of local ids that are not a row of a stack of ``num_local`` experts."""
    return (local_ids < 0) | (local_ids >= num_local)


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Rows out by ``send``, rows in by ``recv``; the backward sends gradients the other way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, recv: tuple[int, ...], send: tuple[int, ...], group: Any
    ) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), list(ctx.send), list(ctx.recv), group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, recv: Sequence[int], send: Sequence[int], group: Any = None) -> torch.Tensor:
    """Differentiable ``all_to_all_single``: x holds ``send[r]`` rows for each rank r, in rank
    order; returns ``recv[s]`` rows from each rank s, in rank order."""
    out: torch.Tensor = _AllToAll.apply(x, tuple(recv), tuple(send), group)
    return out


def exchange_counts(send: Sequence[int], device: torch.device, group: Any = None) -> tuple[int, ...]:
    """Every rank tells every other how many rows it sends it; returns what this rank receives
    from each. Synchronizes (the split sizes go to the host)."""
    send_t = torch.tensor(list(send), dtype=torch.int64, device=device)
    recv_t = torch.empty_like(send_t)
    dist.all_to_all_single(recv_t, send_t, group=group)
    return tuple(int(c) for c in recv_t.tolist())


__all__ = [
    "TokenDispatch",
    "all_to_all",
    "all_to_all_torch",
    "exchange_counts",
    "experts_per_rank",
    "first_expert",
    "local_slots",
    "out_of_range",
    "owner_of",
    "receive_counts",
    "token_dispatch",
    "token_dispatch_exchange",
]
