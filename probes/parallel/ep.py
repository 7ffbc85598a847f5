"""Expert parallelism: which rank owns which expert, what travels where, and the all-to-all op.

Experts are sharded in contiguous blocks: with E experts over W ranks, rank r owns global
experts ``[r * E_local, (r + 1) * E_local)`` (``E_local = E / W``) and holds them as a local
stack of ``E_local`` experts, where global expert ``r * E_local + j`` is local expert ``j``.

Dispatch is per (token, destination rank), not per (token, expert): a token whose k experts
include several of rank r's is sent to r once, with its k global ids and k routing weights
(at top-8 of 128 experts on two ranks a token has about four experts on each, so this moves a
quarter of the bytes of a per-expert dispatch). ``plan_micro_batches`` lists each micro-batch's
(token, rank) pairs in send order (by rank, then token), counts them per rank and exchanges
every count with ONE host synchronization, including the number of slots each receiver owns
(so the receiver sizes its rows without reading the device again). A pair travels as ONE row: the token, its k weights and its k ids bit for bit
(``pack_tokens`` / ``unpack_pairs``), by ``all_to_all_single``. The receiver keeps the slots whose
expert it owns (``local_slots``), remaps their global ids to local ones, runs its experts on
those rows, weights each row and sums the rows of each pair; the sums go back with the split
sizes swapped and the sender adds each rank's share into its tokens.

Pure functions here (no collective): they are the arithmetic the CPU tests check.
``all_to_all`` (autograd) and ``exchange_micro_counts`` are the two collectives, in one place.
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


# ---------------------------------------------------------------------------------------------
# Micro-batches: the rank's tokens in contiguous spans, each dispatched on its own, so that one
# span's exchange runs while another span's experts compute. ONE count exchange (and one host
# synchronization) serves every span and also tells each receiver how many of the slots it gets
# are its own, so it never reads a count from the device again.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroPlan:
    """One micro-batch's dispatch, as this rank sees it."""

    span: tuple[int, int]  # the tokens [lo, hi) of the rank's batch this micro-batch covers
    tokens: torch.Tensor  # (P,) int64 token (index into the rank's batch) of each pair, send order
    send_counts: tuple[int, ...]  # (W,) pairs to each rank
    recv_counts: tuple[int, ...]  # (W,) pairs from each rank
    recv_slots: int  # (pair, slot) entries of the received pairs whose expert this rank owns


def micro_spans(tokens: int, micro: int) -> list[tuple[int, int]]:
    """``micro`` contiguous, nearly equal spans of ``tokens`` (fewer when there are fewer tokens;
    one empty span for no tokens)."""
    if micro < 1:
        raise ValueError(f"need at least one micro-batch, got {micro}")
    n = max(1, min(micro, tokens))
    bounds = [tokens * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def dispatch_counts(
    topk_ids: torch.Tensor, num_experts: int, world: int, spans: Sequence[tuple[int, int]]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per span, the (T_span, W) mask "token t has an expert on rank r"; and the (W, S, 2) int64
    counts this rank sends: ``[r, s, 0]`` pairs of span s to rank r, ``[r, s, 1]`` the slots
    among them whose expert rank r owns. No synchronization."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (T, k), got shape {tuple(topk_ids.shape)}")
    per_rank = experts_per_rank(num_experts, world)
    owner = owner_of(topk_ids, per_rank)  # (T, k)
    needs: list[torch.Tensor] = []
    counts = torch.zeros((world, len(spans), 2), dtype=torch.int64, device=topk_ids.device)
    for s, (lo, hi) in enumerate(spans):
        own = owner[lo:hi]
        slots = torch.zeros((hi - lo, world), dtype=torch.int64, device=topk_ids.device)
        slots.scatter_add_(1, own, torch.ones_like(own))  # (T_span, W) slots per rank
        need = slots > 0
        needs.append(need)
        counts[:, s, 0] = need.sum(dim=0)
        counts[:, s, 1] = slots.sum(dim=0)
    return needs, counts


def micro_plans(
    needs: Sequence[torch.Tensor],
    spans: Sequence[tuple[int, int]],
    sent: Sequence[Sequence[Sequence[int]]],
    received: Sequence[Sequence[Sequence[int]]],
) -> list[MicroPlan]:
    """The plans from the masks and both count tables (host lists, (W, S, 2) each: ``sent`` what
    this rank sends, ``received[r]`` what rank r sends it). Pairs are listed by rank, then token."""
    plans = []
    for s, ((lo, hi), need) in enumerate(zip(spans, needs, strict=True)):
        send = tuple(int(row[s][0]) for row in sent)
        _, tok = nonzero_sized(need.t(), sum(send))  # row-major over (rank, token): send order
        plans.append(
            MicroPlan(
                span=(lo, hi),
                tokens=tok + lo,
                send_counts=send,
                recv_counts=tuple(int(row[s][0]) for row in received),
                recv_slots=sum(int(row[s][1]) for row in received),
            )
        )
    return plans


def exchange_micro_counts(
    counts: torch.Tensor, group: Any = None
) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """Every rank sends rank r its ``counts[r]`` (S, 2); returns (sent, received) as host lists,
    both count tables in ONE synchronization."""
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)
    both = torch.stack([counts, recv]).tolist()  # the one synchronization
    return both[0], both[1]


def plan_micro_batches(
    topk_ids: torch.Tensor, num_experts: int, world: int, micro: int, group: Any = None
) -> list[MicroPlan]:
    """``micro`` micro-batches of this rank's tokens, dispatched with one count exchange."""
    spans = micro_spans(int(topk_ids.shape[0]), micro)
    needs, counts = dispatch_counts(topk_ids, num_experts, world, spans)
    sent, received = exchange_micro_counts(counts, group)
    return micro_plans(needs, spans, sent, received)


# ---------------------------------------------------------------------------------------------
# One message per pair: the token's row, its k routing weights and its k expert ids travel
# together (the ids as integers of the row dtype's width, bit for bit), so a micro-batch's
# dispatch is one all-to-all, and so is the gradient's way back (rows and weights together).
# ---------------------------------------------------------------------------------------------

_ID_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_tokens(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(T, H + 2k): each token's row, its weights (in the row dtype) and its ids' bits.
    Differentiable in ``hidden`` and ``weights``."""
    if hidden.dim() != 2 or weights.shape != ids.shape or weights.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"need hidden (T, H) and weights/ids (T, k), got {tuple(hidden.shape)}, "
            f"{tuple(weights.shape)}, {tuple(ids.shape)}"
        )
    id_dtype = _ID_DTYPES.get(hidden.element_size())
    if id_dtype is None:
        raise TypeError(f"cannot carry expert ids in rows of {hidden.dtype}")
    bits = ids.to(id_dtype).view(hidden.dtype)
    return torch.cat([hidden, weights.to(hidden.dtype), bits], dim=1)


class _Unpack(torch.autograd.Function):
    """rows and weights of a packed buffer as views; the backward writes the buffer's gradient
    once (rows, weights, zeros for the ids) instead of one zero-filled copy per view."""

    @staticmethod
    def forward(ctx: Any, buf: torch.Tensor, hidden: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.shape = (hidden, k)
        return buf[:, :hidden], buf[:, hidden : hidden + k]

    @staticmethod
    def backward(
        ctx: Any, g_rows: torch.Tensor | None, g_w: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, k = ctx.shape
        ref = g_rows if g_rows is not None else g_w
        assert ref is not None
        p = ref.shape[0]
        if g_rows is None:
            g_rows = ref.new_zeros((p, hidden))
        if g_w is None:
            g_w = ref.new_zeros((p, k))
        return torch.cat([g_rows, g_w.to(g_rows.dtype), g_rows.new_zeros((p, k))], dim=1), None, None


def unpack_pairs(buf: torch.Tensor, hidden: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows (P, H), weights (P, k), ids (P, k) int64) of a received buffer; rows and weights are
    views whose gradients flow back into ``buf``; ids carry no gradient."""
    if buf.dim() != 2 or buf.shape[1] != hidden + 2 * k:
        raise ValueError(f"a packed buffer has H + 2k = {hidden + 2 * k} columns, got {tuple(buf.shape)}")
    id_dtype = _ID_DTYPES[buf.element_size()]
    ids = buf.detach()[:, hidden + k :].contiguous().view(id_dtype).to(torch.int64)
    if buf.requires_grad:
        rows, weights = _Unpack.apply(buf, hidden, k)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
    else:
        rows, weights = buf[:, :hidden], buf[:, hidden : hidden + k]
    return rows, weights, ids


def max_packed_experts(dtype: torch.dtype) -> int:
    """The most experts whose ids fit the id field of a row of ``dtype``."""
    width = torch.empty((), dtype=dtype).element_size()
    return int(torch.iinfo(_ID_DTYPES[width]).max) + 1 if width in _ID_DTYPES else 0


def nonzero_sized(mask: torch.Tensor, count: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of a 2-D mask's true entries, row-major; ``count`` (how many there are,
    known on the host) spares the synchronization ``nonzero`` needs to size its result."""
    if count is not None:
        try:
            rows, cols = torch.nonzero_static(mask, size=count).unbind(1)
            return rows, cols
        except (AttributeError, NotImplementedError, RuntimeError):  # a build without it here
            pass
    rows, cols = mask.nonzero(as_tuple=True)
    return rows, cols


def local_slots(
    ids: torch.Tensor, rank: int, per_rank: int, count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the received pairs' (P, k) global ids, the slots whose expert ``rank`` owns, as
    (pair index, slot index) of each such row, pair-major. ``count``: how many there are, when
    the count exchange said so (then no synchronization)."""
    return nonzero_sized(owner_of(ids, per_rank) == rank, count)


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
    def forward(
        ctx: Any, x: torch.Tensor, recv: tuple[int, ...], send: tuple[int, ...], group: Any
    ) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), list(ctx.send), list(ctx.recv), group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, recv: Sequence[int], send: Sequence[int], group: Any = None) -> torch.Tensor:
    """Differentiable ``all_to_all_single``: x holds ``send[r]`` rows for each rank r, in rank
    order; returns ``recv[s]`` rows from each rank s, in rank order."""
    out: torch.Tensor = _AllToAll.apply(x, tuple(recv), tuple(send), group)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
    return out


__all__ = [
    "MicroPlan",
    "all_to_all",
    "all_to_all_torch",
    "experts_per_rank",
    "first_expert",
    "dispatch_counts",
    "exchange_micro_counts",
    "local_slots",
    "max_packed_experts",
    "micro_plans",
    "micro_spans",
    "nonzero_sized",
    "pack_tokens",
    "plan_micro_batches",
    "unpack_pairs",
    "out_of_range",
    "owner_of",
    "receive_counts",
]
