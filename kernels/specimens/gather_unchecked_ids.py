"""Specimen ``gather_unchecked_ids``: plants ``invalid-routing`` (no check of ids >= E).

What it does wrong: its routing step drops the slots whose id is negative (-1, and any other)
but never checks the ids against the local expert count, and counts the slots per expert the way
public routing code often does, ``torch.bincount``: one bin per id seen. An id past E (a global id
on a rank's local weights, an ``expert_map`` built for more experts, a corrupted id) grows the
histogram past E, and the ragged matmul, which walks every expert of the histogram, forms
``w_ptr + expert * stride_we`` past the end of ``w``. ``bincount`` also reads the largest id on
the host (a synchronization the correct ``gather_scatter`` avoids).

When it misbehaves: in the ids-out-of-range cell (ids E: -2 is dropped as negative) and the
map-past-local cell (map entries E and E + 1): the probe's NaN guard experts after ``w`` come out
in those slots' rows (a read outside ``w``, the fault). -1 slots and remote experts are dropped
right; every other cell passes.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.specimens.gather_scatter import (
    Routing,
    _ragged_kernel,
    forward,
    mapped_ids,
    positions,
)


def route(
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor | None,  # (T, k): applied after the matmul, not here
    num_experts: int,  # E: local experts (not checked against: the planted fault)
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
) -> Routing:
    """``gather_scatter.route`` without the upper bound on the ids."""
    del topk_weights
    local = mapped_ids(topk_ids, expert_map)
    # PLANTED: no `& (local < num_experts)`: an id past E is routed, and bincount grows past E
    routed = local >= 0
    hist = torch.bincount(local[routed], minlength=num_experts).to(torch.int32)
    key = torch.where(routed, local, hist.shape[0])  # dropped slots sort after every bin
    return positions(key, routed, hist)


def ragged_moe(
    hidden_states: torch.Tensor,  # (T, H)
    w: torch.Tensor,  # (E, N, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k)
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
    *,
    routing: Routing | None = None,  # a routing of these ids (route's dict); None: made here
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``gather_scatter.ragged_moe`` on the unchecked routing step."""
    return forward(
        _ragged_kernel, route, hidden_states, w, topk_ids, topk_weights, expert_map, routing, out_dtype
    )


ragged_moe.route = route  # type: ignore[attr-defined]
