"""Small routed kernels the routed-protocol tests hand the doctor, each with one behaviour at the
routing edges (plain torch: no launch, every access inside the operands):

* ``clamping``: clamps every id into [0, E) (a -1 becomes expert 0, E becomes E - 1): wrong values
  at the edges, never outside its tensors (a hardening finding);
* ``refusing``: checks the ids on the host and raises ValueError naming ``topk_ids`` for any id
  outside [-1, E), before anything runs (``rejected``); -1 slots it skips;
* ``ignores_map``: takes an ``expert_map`` and never applies it: under expert parallelism a
  global id lands on another expert of the rank, in bounds (always a fault in the expert-map cell);
* ``no_map``: right, but has no ``expert_map`` parameter (the expert-map cells are skipped).

Used as ``adapter:routed:tests/unit/routed_kernels.py:NAME``.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.routed import routed_moe_torch


def _loop(
    hidden_states: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """out (T, N) from ids already in [0, E) or -1 (skipped)."""
    return routed_moe_torch(hidden_states, w, ids, topk_weights)


def clamping(
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    ids = topk_ids.to(torch.int64)
    if expert_map is not None:
        ids = expert_map.to(torch.int64)[ids.clamp(0, expert_map.shape[0] - 1)]
    return _loop(hidden_states, w, ids.clamp(0, w.shape[0] - 1), topk_weights)


def refusing(
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    ids = topk_ids.to(torch.int64)
    if expert_map is not None:
        ids = torch.where(ids >= 0, expert_map.to(torch.int64)[ids.clamp(0, expert_map.shape[0] - 1)], -1)
    bad = (ids < -1) | (ids >= w.shape[0])
    if bool(bad.any()):
        raise ValueError(f"topk_ids holds {int(bad.sum())} ids outside [-1, {w.shape[0]})")
    return _loop(hidden_states, w, ids, topk_weights)


def ignores_map(
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    del expert_map
    ids = topk_ids.to(torch.int64)
    return _loop(hidden_states, w, torch.where(ids < w.shape[0], ids, ids % w.shape[0]), topk_weights)


def no_map(
    hidden_states: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    return routed_moe_torch(hidden_states, w, topk_ids, topk_weights)


def three_args(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
    """Not a routed kernel: the m_sizes signature."""
    return x
