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

``routing_sizes(pattern, m, e, seed=...)`` gives the rows per expert of a named routing pattern
(``Shape.routing`` of ``qmoe_doctor.core.records``: uniform, hot-expert, last-expert, expert:<i>,
empty-experts, random): the m_sizes every probe, benchmark and repro script builds its operands
from. The repro scripts (``qmoe_doctor/reports/repro_script.py``) carry a copy as text, so that
they run without qmoe-doctor installed; ``tests/unit/test_repro.py`` checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Routing", "check_expert_ids", "routing_sizes", "sort_by_expert", "sort_by_expert_torch"]


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
    flat = topk_ids.reshape(-1)
    # bad ids sort after every expert: clamped into [-1, E], then -1 -> E by the remainder
    # (two ops where a where/mask took five: the eager block issues this per step, host-bound)
    key = flat.clamp(-1, num_experts).remainder(num_experts + 1)
    sorted_key, perm = torch.sort(key, stable=True)
    # bounds[e] = first sorted position of expert e (searchsorted: deterministic, no atomics)
    bounds = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=flat.device, dtype=key.dtype))
    m_sizes = bounds.diff().to(torch.int32)
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


def routing_sizes(pattern: str, m: int, e: int, *, seed: int = 0) -> list[int]:
    """Rows per expert (E,) summing to M for a routing pattern, deterministic from ``seed``:

    * "uniform": M // E each, the remainder one each to the first experts;
    * "hot-expert": every row on expert E // 2; "last-expert": on expert E - 1; "expert:<i>": on i;
    * "empty-experts": every other expert gets no rows, the rest drawn at random;
    * anything else ("random"): drawn from skewed weights (w**2 + 0.01), like real routers.
    """
    if pattern == "uniform":
        sizes = [m // e] * e
        for i in range(m - sum(sizes)):
            sizes[i] += 1
        return sizes
    if pattern == "hot-expert":
        return [m if i == e // 2 else 0 for i in range(e)]
    if pattern == "last-expert":
        return [0] * (e - 1) + [m]
    if pattern.startswith("expert:"):
        hot = int(pattern.split(":", 1)[1])
        return [m if i == hot else 0 for i in range(e)]
    gen = torch.Generator().manual_seed(seed + 7)
    if pattern == "empty-experts":  # every other expert empty
        weights = torch.tensor([0.0 if i % 2 else 1.0 for i in range(e)])
    else:  # "random": skewed like real routers
        weights = torch.rand(e, generator=gen) ** 2 + 0.01
    ids = torch.multinomial(weights, m, replacement=True, generator=gen)
    sizes_list: list[int] = torch.bincount(ids, minlength=e).tolist()
    return sizes_list
