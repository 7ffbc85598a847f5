"""The routed calling convention on our grouped GEMM: kernels that take the router's output.

``routed_moe(hidden_states, w, topk_ids, topk_weights, expert_map=None) -> out (T, N)``:

* ``hidden_states``: (T, H), one row per token;
* ``w``: (E, N, H), this rank's experts (any strides);
* ``topk_ids``: (T, k) int32 or int64, the experts each token's k slots go to: local ids in
  [0, E), or global ids when ``expert_map`` is given;
* ``topk_weights``: (T, k), each slot's routing weight;
* ``expert_map``: optional (E_global,) int32 or int64, global expert id -> local id on this rank,
  -1 for an expert held by another rank (expert parallelism);
* ``out[t] = sum_j topk_weights[t, j] * hidden_states[t] @ w[e(t, j)].T`` over the slots routed
  to a local expert.

A slot is routed nowhere (it adds nothing to ``out``) when its id is -1 (a dropped slot), lies
outside [0, E) (or outside the map), or its ``expert_map`` entry is -1 or outside [0, E). Nothing
of that is read on the host: ids outside the range sort after every expert and no expert counts
them (``routing.sort_by_expert``), so the grouped GEMM never sees them. No synchronization, every
access inside the operands whatever the ids hold.

``routed_moe_rows`` is the same call with one output row per (token, slot): ``out (T*k, N)``, row
``t*k + j`` is ``hidden_states[t] @ w[e(t, j)].T`` unweighted, zero for a slot routed nowhere (the
first GEMM of a fused MoE in the sorted-token-ids style).

The pipeline: ``local_expert_ids`` (the map) -> ``sort_by_expert`` (m_sizes, the sorted rows'
tokens, the inverse permutation) -> ``hidden_states[token_idx]`` -> ``moe_grouped_gemm`` -> the
weighted segment sum back to tokens (``combine.segment_sum``) or the un-permute. The slow,
obvious twins: ``routed_moe_torch`` and ``routed_moe_rows_torch`` (float32, a loop over experts).
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.combine import segment_sum
from qmoe_doctor.kernels.grouped_gemm import device_guard, moe_grouped_gemm
from qmoe_doctor.kernels.routing import sort_by_expert

__all__ = [
    "check_routed_operands",
    "local_expert_ids",
    "routed_moe",
    "routed_moe_rows",
    "routed_moe_rows_torch",
    "routed_moe_torch",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_ID_DTYPES = (torch.int32, torch.int64)


def check_routed_operands(
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> None:
    """Shapes, dtypes and devices of a routed call, each error naming its argument. Reads no
    value (no synchronization): the ids are the kernel's to mask, never the host's to check."""
    named = [
        ("hidden_states", hidden_states),
        ("w", w),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
    ]
    if expert_map is not None:
        named.append(("expert_map", expert_map))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D (T, H), got shape {tuple(hidden_states.shape)}")
    if w.dim() != 3:
        raise ValueError(f"w must be 3-D (E, N, H), got shape {tuple(w.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"topk_ids must be (T, k) with T={hidden_states.shape[0]} tokens, got shape {tuple(topk_ids.shape)}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in _ID_DTYPES):
        raise ValueError(
            f"expert_map must be 1-D int32 or int64 (global id -> local id), got {expert_map.dtype} "
            f"of shape {tuple(expert_map.shape)}"
        )
    if hidden_states.dtype not in _FLOAT_DTYPES or w.dtype != hidden_states.dtype:
        raise TypeError(f"hidden_states ({hidden_states.dtype}) and w ({w.dtype}) must be one float dtype")
    if w.shape[2] != hidden_states.shape[1]:
        raise ValueError(f"hidden_states has H={hidden_states.shape[1]} but w is (E, N, H)={tuple(w.shape)}")
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        placed = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"operands are on different devices ({placed}); move them to one device")


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int) -> torch.Tensor:
    """(T, k) int64 local expert ids: ``expert_map[topk_ids]`` (or the ids themselves without a
    map), -1 wherever a slot is routed to no local expert (an id outside the map, a map entry of
    -1 or outside [0, num_local), an id outside [0, num_local)). On the ids' device, no sync."""
    ids = topk_ids.to(torch.int64)
    if expert_map is not None:
        n_global = int(expert_map.shape[0])
        if n_global == 0:
            return torch.full_like(ids, -1)
        inside_map = (ids >= 0) & (ids < n_global)
        mapped = expert_map.to(torch.int64)[ids.clamp(0, n_global - 1)]
        ids = torch.where(inside_map, mapped, -1)
    return torch.where((ids >= 0) & (ids < num_local), ids, -1)


def _grouped(
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots sorted by local expert and multiplied: (y (T*k, N) in sorted order, inv_perm)."""
    e = w.shape[0]
    routing = sort_by_expert(local_expert_ids(topk_ids, expert_map, e), e)
    x = hidden_states.index_select(0, routing.token_idx)  # (T*k, H): the slots' rows, sorted by expert
    # rows past sum(m_sizes) are the slots routed nowhere: the grouped GEMM writes them as zero
    y = moe_grouped_gemm(x, w, routing.m_sizes, out_dtype=out_dtype)
    return y, routing.inv_perm


def routed_moe(
    hidden_states: torch.Tensor,  # (T, H)
    w: torch.Tensor,  # (E, N, H)
    topk_ids: torch.Tensor,  # (T, k) expert of each slot (global ids when expert_map is given)
    topk_weights: torch.Tensor,  # (T, k) routing weight of each slot
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out (T, N)``, each token's slots reduced with their weights (see the module docstring)."""
    check_routed_operands(hidden_states, w, topk_ids, topk_weights, expert_map)
    tokens, k = topk_ids.shape
    with device_guard(hidden_states.device):
        y, inv_perm = _grouped(hidden_states, w, topk_ids, expert_map, out_dtype)
        # token t's k rows sit at sorted positions inv_perm[t*k : t*k + k]
        starts = torch.arange(0, tokens * k + 1, k, device=hidden_states.device)
        return segment_sum(y, inv_perm, starts, topk_weights.reshape(-1).to(y.dtype))


def routed_moe_rows(
    hidden_states: torch.Tensor,  # (T, H)
    w: torch.Tensor,  # (E, N, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k): not applied (the rows are unweighted)
    expert_map: torch.Tensor | None = None,  # (E_global,)
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out (T*k, N)``: row t*k + j is slot (t, j)'s product, unweighted, zero where the slot
    is routed nowhere."""
    check_routed_operands(hidden_states, w, topk_ids, topk_weights, expert_map)
    tokens, k = topk_ids.shape
    with device_guard(hidden_states.device):
        y, inv_perm = _grouped(hidden_states, w, topk_ids, expert_map, out_dtype)
        out = torch.empty((tokens * k, w.shape[1]), dtype=y.dtype, device=y.device)
        return torch.index_select(y, 0, inv_perm, out=out)


def _slots_by_expert(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, tokens, slots) of every local expert some slot is routed to, on the host."""
    ids = local_expert_ids(
        topk_ids.detach().cpu(), None if expert_map is None else expert_map.cpu(), num_local
    )
    found = []
    for expert in range(num_local):
        token, slot = torch.where(ids == expert)
        if token.numel():
            found.append((expert, token, slot))
    return found


def routed_moe_torch(
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The slow, obvious twin of ``routed_moe``: a loop over experts in float32 (float64 for
    float64 operands), the same slots routed nowhere."""
    check_routed_operands(hidden_states, w, topk_ids, topk_weights, expert_map)
    acc = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    out = torch.zeros((hidden_states.shape[0], w.shape[1]), dtype=acc, device=hidden_states.device)
    for expert, token, slot in _slots_by_expert(topk_ids, expert_map, w.shape[0]):
        token, slot = token.to(out.device), slot.to(out.device)
        rows = hidden_states[token].to(acc) @ w[expert].to(acc).T
        out.index_add_(0, token, rows * topk_weights[token, slot].to(acc)[:, None])
    return out.to(out_dtype or hidden_states.dtype)


def routed_moe_rows_torch(
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The slow, obvious twin of ``routed_moe_rows``."""
    check_routed_operands(hidden_states, w, topk_ids, topk_weights, expert_map)
    acc = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    k = topk_ids.shape[1]
    out = torch.zeros((hidden_states.shape[0] * k, w.shape[1]), dtype=acc, device=hidden_states.device)
    for expert, token, slot in _slots_by_expert(topk_ids, expert_map, w.shape[0]):
        token, slot = token.to(out.device), slot.to(out.device)
        out[token * k + slot] = hidden_states[token].to(acc) @ w[expert].to(acc).T
    return out.to(out_dtype or hidden_states.dtype)
