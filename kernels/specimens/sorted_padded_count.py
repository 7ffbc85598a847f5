"""Specimen ``sorted_padded_count``: plants ``invalid-routing`` (trusting num_tokens_post_padded).

What it does wrong: the correct ``sorted_ids`` wrapper sizes its grid from the alignment's
``num_tokens_post_padded``, read on the host, instead of from the ``sorted_token_ids`` /
``expert_ids`` buffers the count describes. A count that lies (a stale or recycled count, an
alignment of other ids, one made for a CUDA graph's larger batch) launches blocks past the end of
both buffers: their slot ids and experts are whatever memory follows them.

When it misbehaves: only in the padded-count cell, whose count runs two blocks past the buffer:
the blocks past the end read the guard slot and expert placed there, recompute that slot with
the wrong expert, and its row alone comes out wrong (a read past ``sorted_token_ids`` and
``expert_ids``: the fault). Its own alignment never lies, so every other cell passes.
"""

from __future__ import annotations

import torch
import triton

from qmoe_doctor.kernels.grouped_gemm import device_guard
from qmoe_doctor.kernels.routed import check_routed_operands
from qmoe_doctor.kernels.specimens.sorted_ids import Routing, _sorted_moe_kernel, align, launch, tile_of


def fused_moe(
    hidden_states: torch.Tensor,  # (T, H)
    w: torch.Tensor,  # (E, N, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k): not applied (one unweighted row per slot)
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
    *,
    routing: Routing | None = None,  # an alignment of these ids (align's dict); None: made here
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sorted_ids.fused_moe`` with its grid sized by the count instead of the buffer."""
    check_routed_operands(hidden_states, w, topk_ids, topk_weights, expert_map)
    tokens, k = topk_ids.shape
    with device_guard(hidden_states.device):
        if routing is None:
            routing = align(topk_ids, topk_weights, w.shape[0], expert_map)
        out = torch.empty(
            (tokens * k, w.shape[1]), dtype=out_dtype or hidden_states.dtype, device=hidden_states.device
        )
        # PLANTED: blocks from num_tokens_post_padded (the count), not from sorted_token_ids (the buffer)
        blocks = triton.cdiv(int(routing["num_tokens_post_padded"].item()), tile_of(hidden_states.device)[0])
        launch(_sorted_moe_kernel, hidden_states, w, out, routing, k, blocks)
    return out


fused_moe.route = align  # type: ignore[attr-defined]
