"""Specimen ``sorted_minus_one``: plants ``invalid-routing`` (a -1 read as a valid expert id).

What it does wrong: the correct ``sorted_ids`` kernel with its check of the block's expert
removed. Its alignment puts every slot routed to no local expert (a -1 id, an id past E, an
``expert_map`` entry of -1, remote experts under expert parallelism) in blocks of expert -1, as
the public design does since expert parallelism came to it; this kernel reads that -1 as an
expert and forms ``w_ptr + expert * stride_we`` one expert *before* ``w``.

When it misbehaves: in every routed cell with a slot routed nowhere: ids-out-of-range,
dropped-slots, expert-map, map-past-local. The cells put ``w`` between NaN guard experts, so the
read lands in the guard before it and the slot's row comes out NaN: a read outside ``w``, the
fault. Outside the probes it reads whatever precedes ``w`` (another tensor, or unmapped memory:
an illegal address). With valid routing and no -1 it is right (the routed and m_sizes cells).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.specimens.sorted_ids import Routing, align, forward


@triton.jit
def _sorted_moe_kernel_minus_one(
    hidden_ptr,  # (T, H) token rows
    w_ptr,  # (E, N, H) local experts
    out_ptr,  # (T*k, N) one row per slot
    sorted_ids_ptr,  # (P,) int32 flat slot ids grouped by expert, num_slots in the padding
    expert_ids_ptr,  # (P // BLOCK_M,) int32 local expert of each block, -1: routed nowhere
    num_post_ptr,  # (1,) int32 num_tokens_post_padded
    N,
    H,
    num_slots,  # T*k
    top_k,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # slot * stride_om passes 2**31 once T*k*N does (1M tokens x top-8 x N=256): int64 slot ids
    slots = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    slot_mask = (slots >= 0) & (slots < num_slots)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    out_ptrs = out_ptr + slots[:, None] * stride_om + cols[None, :] * stride_on
    out_mask = slot_mask[:, None] & col_mask[None, :]
    # PLANTED: no `if expert < 0` (write zeros, return): a block of expert -1 reads w[-1]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    tokens = slots // top_k
    h_ptrs = hidden_ptr + tokens[:, None] * stride_hm + offs_k[None, :] * stride_hk
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = (k0 + offs_k) < H
        a = tl.load(h_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        h_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


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
    """``sorted_ids.fused_moe`` with blocks of expert -1 read as expert -1."""
    return forward(
        _sorted_moe_kernel_minus_one, hidden_states, w, topk_ids, topk_weights, expert_map, routing, out_dtype
    )


fused_moe.route = align  # type: ignore[attr-defined]
