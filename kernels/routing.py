"""Routing: from a top-k router's choices to rows sorted by expert, as the grouped GEMM wants.

``sort_by_expert(topk_ids, num_experts)`` takes ``topk_ids`` (T, k) and returns a ``Routing``:

* ``m_sizes`` (E,) int32: rows per expert, the grouped GEMM's ``m_sizes``;
* ``token_idx`` (T*k,) int64: the token each sorted row comes from (``x = hidden[token_idx]``);
* ``perm`` (T*k,) int64: sorted position -> flat (token, slot) index ``token * k + slot``;
* ``inv_perm`` (T*k,) int64: flat (token, slot) index -> sorted position.

The sort is stable (ties keep token order), so the result is deterministic. Ids outside
[0, E) (the -1 sentinels of dropped tokens, global ids under expert parallelism) sort after
every expert and are counted by no expert: the grouped GEMM then writes zero for those rows.
Nothing synchronizes unless ``check=True``, which reads the ids on the host and raises a
ValueError naming the bad ones (``invalid-routing``).

``sort_by_expert_torch`` is the slow, obvious twin: a Python loop over experts and rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Routing", "check_expert_ids", "sort_by_expert", "sort_by_expert_torch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Routing:
    """Rows sorted by expert; every tensor lives on the device of ``topk_ids``."""

    m_sizes: torch.Tensor  # (E,) int32 rows per expert
    token_idx: torch.Tensor  # (T*k,) int64 token of each sorted row
    perm: torch.Tensor  # (T*k,) int64 sorted position -> flat (token, slot) index
    inv_perm: torch.Tensor  # (T*k,) int64 flat (token, slot) index -> sorted position

    @property
    def num_rows(self) -> int:
        return int(self.perm.shape[0])


def _check_args(topk_ids: torch.Tensor, num_experts: int) -> None:
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D (T, k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError if any id is outside [0, num_experts). Synchronizes (reads on host)."""
    ids = topk_ids.detach().to("cpu", torch.int64).reshape(-1)
    bad = (ids < 0) | (ids >= num_experts)
    if bool(bad.any()):
        where = bad.nonzero().flatten()[:8].tolist()
        k = max(1, topk_ids.shape[1])
        shown = ", ".join(f"[{i // k}, {i % k}]={int(ids[i])}" for i in where)
        raise ValueError(
            f"topk_ids has {int(bad.sum())} expert ids outside [0, {num_experts}) "
            f"(first at [token, slot]: {shown}); global vs local ids under expert parallelism, "
            "or -1 sentinels, give this"
        )


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, *, check: bool = False) -> Routing:
    """Stable sort of the (token, slot) pairs by expert, on ``topk_ids``' device."""
    _check_args(topk_ids, num_experts)
    if check:
        check_expert_ids(topk_ids, num_experts)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # bad ids: after all experts
    sorted_key, perm = torch.sort(key, stable=True)
    # bounds[e] = first sorted position of expert e (searchsorted: deterministic, no atomics)
    bounds = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=flat.device))
    m_sizes = (bounds[1:] - bounds[:-1]).to(torch.int32)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.shape[0], device=perm.device)
    return Routing(m_sizes=m_sizes, token_idx=perm // max(k, 1), perm=perm, inv_perm=inv_perm)


def sort_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, *, check: bool = False) -> Routing:
    """The slow, obvious twin: for each expert, walk the flat (token, slot) list in order."""
    _check_args(topk_ids, num_experts)
    if check:
        check_expert_ids(topk_ids, num_experts)
    k = topk_ids.shape[1]
    ids = topk_ids.detach().to("cpu", torch.int64).reshape(-1).tolist()
    order: list[int] = []
    sizes: list[int] = []
    for expert in range(num_experts):
        rows = [i for i, e in enumerate(ids) if e == expert]
        order.extend(rows)
        sizes.append(len(rows))
    order.extend(i for i, e in enumerate(ids) if not 0 <= e < num_experts)  # bad ids last
    inverse = [0] * len(order)
    for pos, flat_index in enumerate(order):
        inverse[flat_index] = pos
    device = topk_ids.device
    perm = torch.tensor(order, dtype=torch.int64, device=device)
    return Routing(
        m_sizes=torch.tensor(sizes, dtype=torch.int32, device=device),
        token_idx=torch.tensor([i // max(k, 1) for i in order], dtype=torch.int64, device=device),
        perm=perm,
        inv_perm=torch.tensor(inverse, dtype=torch.int64, device=device),
    )
